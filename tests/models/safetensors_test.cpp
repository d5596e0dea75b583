// SafetensorsReader: single files, directories, sharded checkpoints with an index,
// dtype conversion through the mapping, and every malformed input we can think of,
// each with an error naming the file (and the tensor, where there is one).
#include "models/safetensors.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "tests/models/test_util.h"

namespace treeserve {
namespace {

using testing::raw_bytes;
using testing::safetensors_bytes;
using testing::status_is;
using testing::TempDir;
using testing::TestTensor;
using testing::write_file;

TestTensor f32_tensor(const std::string& name, std::vector<int64_t> shape, float start) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> values(static_cast<size_t>(n));
  for (size_t i = 0; i < values.size(); ++i) values[i] = start + static_cast<float>(i);
  return {name, "F32", std::move(shape), raw_bytes(values)};
}

std::vector<float> read_floats(const TensorView& view) {
  std::vector<float> out(static_cast<size_t>(view.numel()));
  to_float(view, out.data());
  return out;
}

TEST(SafetensorsTest, ReadsAGoodFile) {
  TempDir dir;
  const std::vector<uint16_t> halves = {0x3C00, 0xC000, 0x3800, 0x0000};  // 1, -2, 0.5, 0
  const std::vector<uint16_t> bhalves = {0x3F80, 0x4040};                 // 1, 3
  write_file(dir.file("model.safetensors"),
             safetensors_bytes({f32_tensor("b.weight", {2, 3}, 10.0f),
                                {"a.half", "F16", {2, 2}, raw_bytes(halves)},
                                {"c.bf", "BF16", {2}, raw_bytes(bhalves)},
                                {"scalar", "F32", {}, raw_bytes(std::vector<float>{7.0f})}}));
  auto reader = SafetensorsReader::open_dir(dir.path());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->tensor_names(),
            (std::vector<std::string>{"a.half", "b.weight", "c.bf", "scalar"}));
  EXPECT_EQ(reader->files(), std::vector<std::string>{dir.file("model.safetensors")});
  EXPECT_TRUE(reader->contains("b.weight"));
  EXPECT_FALSE(reader->contains("__metadata__"));

  auto b = reader->tensor("b.weight");
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->name, "b.weight");
  EXPECT_EQ(b->dtype, DType::kF32);
  EXPECT_EQ(b->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(b->shape_string(), "[2, 3]");
  EXPECT_EQ(b->numel(), 6);
  EXPECT_EQ(b->nbytes, 24u);
  EXPECT_EQ(b->file, dir.file("model.safetensors"));
  EXPECT_EQ(read_floats(*b), (std::vector<float>{10, 11, 12, 13, 14, 15}));

  auto a = reader->tensor("a.half");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->dtype, DType::kF16);
  EXPECT_EQ(read_floats(*a), (std::vector<float>{1.0f, -2.0f, 0.5f, 0.0f}));
  auto c = reader->tensor("c.bf");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(read_floats(*c), (std::vector<float>{1.0f, 3.0f}));
  auto s = reader->tensor("scalar");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->shape_string(), "[]");
  EXPECT_EQ(read_floats(*s), std::vector<float>{7.0f});

  // The tensor views outlive the reader they came from while a copy is held.
  SafetensorsReader copy = *reader;
  reader = Status(StatusCode::kCancelled, "dropped");
  auto again = copy.tensor("b.weight");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(read_floats(*again)[5], 15.0f);
}

TEST(SafetensorsTest, HalfSpecialValuesThroughTheFile) {
  TempDir dir;
  // F16: smallest subnormal, largest subnormal (negative), inf, -inf, NaN, -0.
  const std::vector<uint16_t> f16 = {0x0001, 0x83FF, 0x7C00, 0xFC00, 0x7E00, 0x8000};
  // BF16: a float32 subnormal, inf, NaN, -0.
  const std::vector<uint16_t> bf16 = {0x0001, 0x7F80, 0x7FC0, 0x8000};
  write_file(dir.file("x.safetensors"),
             safetensors_bytes(
                 {{"h", "F16", {6}, raw_bytes(f16)}, {"b", "BF16", {2, 2}, raw_bytes(bf16)}}));
  auto reader = SafetensorsReader::open_files({dir.file("x.safetensors")});
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  const std::vector<float> h = read_floats(*reader->tensor("h"));
  EXPECT_EQ(h[0], std::ldexp(1.0f, -24));
  EXPECT_EQ(h[1], -std::ldexp(1023.0f, -24));
  EXPECT_EQ(h[2], INFINITY);
  EXPECT_EQ(h[3], -INFINITY);
  EXPECT_TRUE(std::isnan(h[4]));
  EXPECT_EQ(std::bit_cast<uint32_t>(h[5]), 0x80000000u);
  const std::vector<float> b = read_floats(*reader->tensor("b"));
  EXPECT_EQ(b[0], std::ldexp(1.0f, -133));
  EXPECT_EQ(b[1], INFINITY);
  EXPECT_TRUE(std::isnan(b[2]));
  EXPECT_EQ(std::bit_cast<uint32_t>(b[3]), 0x80000000u);
}

TEST(SafetensorsTest, ShardedCheckpointWithIndex) {
  TempDir dir;
  write_file(
      dir.file("model-00001-of-00002.safetensors"),
      safetensors_bytes({f32_tensor("layer.0", {4}, 0.0f), f32_tensor("layer.1", {4}, 4.0f)}));
  write_file(dir.file("model-00002-of-00002.safetensors"),
             safetensors_bytes({f32_tensor("layer.2", {2, 2}, 8.0f)}));
  write_file(dir.file("model.safetensors.index.json"), R"({
    "metadata": {"total_size": 48},
    "weight_map": {"layer.0": "model-00001-of-00002.safetensors",
                   "layer.1": "model-00001-of-00002.safetensors",
                   "layer.2": "model-00002-of-00002.safetensors"}})");
  // A stray model.safetensors must be ignored when an index is present.
  write_file(dir.file("model.safetensors"), "garbage");
  auto reader = SafetensorsReader::open_dir(dir.path());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->files().size(), 2u);
  EXPECT_EQ(reader->tensor_names(), (std::vector<std::string>{"layer.0", "layer.1", "layer.2"}));
  auto t2 = reader->tensor("layer.2");
  ASSERT_TRUE(t2.ok());
  EXPECT_EQ(t2->file, dir.file("model-00002-of-00002.safetensors"));
  EXPECT_EQ(read_floats(*t2), (std::vector<float>{8, 9, 10, 11}));
  EXPECT_EQ(read_floats(*reader->tensor("layer.1")), (std::vector<float>{4, 5, 6, 7}));
  EXPECT_TRUE(status_is(reader->tensor("layer.3").status(), StatusCode::kNotFound,
                        {"'layer.3'", "model.safetensors.index.json"}));
}

TEST(SafetensorsTest, DirectoryOfShardsWithoutIndex) {
  TempDir dir;
  write_file(dir.file("b.safetensors"), safetensors_bytes({f32_tensor("y", {1}, 2.0f)}));
  write_file(dir.file("a.safetensors"), safetensors_bytes({f32_tensor("x", {1}, 1.0f)}));
  write_file(dir.file("notes.txt"), "not a shard");
  auto reader = SafetensorsReader::open_dir(dir.path());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->files(),
            (std::vector<std::string>{dir.file("a.safetensors"), dir.file("b.safetensors")}));
  EXPECT_EQ(read_floats(*reader->tensor("y"))[0], 2.0f);
}

TEST(SafetensorsTest, TotalBytesIsTheSumOfShardSizes) {
  TempDir dir;
  const std::string one = safetensors_bytes({f32_tensor("x", {3}, 0.0f)});
  const std::string two = safetensors_bytes({f32_tensor("y", {5}, 0.0f)});
  write_file(dir.file("1.safetensors"), one);
  write_file(dir.file("2.safetensors"), two);
  auto reader =
      SafetensorsReader::open_files({dir.file("1.safetensors"), dir.file("2.safetensors")});
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(reader->total_bytes(), one.size() + two.size());
}

// --- malformed files -------------------------------------------------------------------

// Writes bytes to bad.safetensors and returns open_files' status.
Status open_bytes(const TempDir& dir, const std::string& bytes) {
  write_file(dir.file("bad.safetensors"), bytes);
  return SafetensorsReader::open_files({dir.file("bad.safetensors")}).status();
}

TEST(SafetensorsErrorTest, MissingFileAndDirectory) {
  TempDir dir;
  EXPECT_TRUE(status_is(SafetensorsReader::open_files({dir.file("none.safetensors")}).status(),
                        StatusCode::kNotFound, {dir.file("none.safetensors")}));
  EXPECT_TRUE(status_is(SafetensorsReader::open_dir(dir.file("nodir")).status(),
                        StatusCode::kNotFound, {dir.file("nodir")}));
  EXPECT_TRUE(status_is(SafetensorsReader::open_dir(dir.path()).status(), StatusCode::kNotFound,
                        {dir.path(), "safetensors"}));
  EXPECT_TRUE(status_is(SafetensorsReader::open_files({}).status(), StatusCode::kInvalidArgument,
                        {"no safetensors files"}));
}

TEST(SafetensorsErrorTest, FileShorterThanTheLengthPrefix) {
  TempDir dir;
  for (const std::string& bytes : {std::string(), std::string("\x10\0\0", 3)}) {
    EXPECT_TRUE(status_is(open_bytes(dir, bytes), StatusCode::kInvalidArgument,
                          {dir.file("bad.safetensors"), "too small"}));
  }
}

TEST(SafetensorsErrorTest, HeaderLengthPastEndOfFile) {
  TempDir dir;
  std::string bytes = safetensors_bytes({f32_tensor("w", {2}, 0.0f)});
  const std::string header_cut = bytes.substr(0, 20);  // file ends inside the header
  EXPECT_TRUE(status_is(open_bytes(dir, header_cut), StatusCode::kInvalidArgument,
                        {dir.file("bad.safetensors"), "header length", "exceeds"}));
  bytes[7] = '\x7F';  // absurd length (~ 9e18)
  EXPECT_TRUE(status_is(open_bytes(dir, bytes), StatusCode::kInvalidArgument,
                        {dir.file("bad.safetensors"), "header length"}));
}

TEST(SafetensorsErrorTest, TruncatedData) {
  TempDir dir;
  const std::string bytes =
      safetensors_bytes({f32_tensor("first", {2}, 0.0f), f32_tensor("second", {4}, 0.0f)});
  EXPECT_TRUE(status_is(open_bytes(dir, bytes.substr(0, bytes.size() - 1)),
                        StatusCode::kInvalidArgument,
                        {dir.file("bad.safetensors"), "'second'", "truncated"}));
}

TEST(SafetensorsErrorTest, BadHeaderJson) {
  TempDir dir;
  const std::string path = dir.file("bad.safetensors");
  EXPECT_TRUE(status_is(open_bytes(dir, safetensors_bytes({}, R"({"w": {"dtype": )")),
                        StatusCode::kInvalidArgument, {path, "invalid safetensors JSON header"}));
  EXPECT_TRUE(status_is(open_bytes(dir, safetensors_bytes({}, "[1, 2, 3]")),
                        StatusCode::kInvalidArgument, {path, "not an object"}));
  EXPECT_TRUE(
      status_is(open_bytes(dir, safetensors_bytes({}, R"({"w": {"dtype": "F32", "shape": [1]}})")),
                StatusCode::kInvalidArgument, {path, "'w'", "data_offsets"}));
  EXPECT_TRUE(
      status_is(open_bytes(dir, safetensors_bytes({}, R"({"w": {"dtype": "F32", "shape": [-1],
                                                      "data_offsets": [0, 0]}})")),
                StatusCode::kInvalidArgument, {path, "'w'", "bad shape"}));
  EXPECT_TRUE(
      status_is(open_bytes(dir, safetensors_bytes({}, R"({"w": {"dtype": "F32", "shape": [1],
                                                      "data_offsets": [-4, 0]}})")),
                StatusCode::kInvalidArgument, {path, "'w'", "data_offsets"}));
}

TEST(SafetensorsErrorTest, OffsetsOutOfRange) {
  TempDir dir;
  const std::string data(16, '\0');
  const std::string path = dir.file("bad.safetensors");
  // end past the data section
  EXPECT_TRUE(status_is(open_bytes(dir, safetensors_bytes({{"pad", "U8", {16}, data}},
                                                          R"({"w": {"dtype": "F32", "shape": [8],
                                                  "data_offsets": [0, 32]}})")),
                        StatusCode::kInvalidArgument, {path, "'w'", "[0,32]", "outside"}));
  // begin after end
  EXPECT_TRUE(status_is(open_bytes(dir, safetensors_bytes({{"pad", "U8", {16}, data}},
                                                          R"({"w": {"dtype": "F32", "shape": [0],
                                                  "data_offsets": [8, 4]}})")),
                        StatusCode::kInvalidArgument, {path, "'w'", "[8,4]"}));
}

TEST(SafetensorsErrorTest, OverlappingTensors) {
  TempDir dir;
  const std::string data(16, '\0');
  EXPECT_TRUE(status_is(open_bytes(dir, safetensors_bytes({{"pad", "U8", {16}, data}},
                                                          R"({"a": {"dtype": "F32", "shape": [3],
                                                  "data_offsets": [0, 12]},
                                            "b": {"dtype": "F32", "shape": [2],
                                                  "data_offsets": [8, 16]}})")),
                        StatusCode::kInvalidArgument,
                        {dir.file("bad.safetensors"), "'b'", "overlaps", "'a'"}));
  // Touching ranges and empty tensors are fine.
  EXPECT_TRUE(open_bytes(dir, safetensors_bytes({{"pad", "U8", {16}, data}},
                                                R"({"a": {"dtype": "F32", "shape": [2],
                                                          "data_offsets": [0, 8]},
                                                    "e": {"dtype": "F32", "shape": [0, 4],
                                                          "data_offsets": [4, 4]},
                                                    "b": {"dtype": "F32", "shape": [2],
                                                          "data_offsets": [8, 16]}})"))
                  .ok());
}

TEST(SafetensorsErrorTest, ShapeDisagreesWithByteCount) {
  TempDir dir;
  TestTensor t = f32_tensor("w", {2, 3}, 0.0f);
  t.shape = {2, 4};
  EXPECT_TRUE(status_is(open_bytes(dir, safetensors_bytes({t})), StatusCode::kInvalidArgument,
                        {dir.file("bad.safetensors"), "'w'", "24 bytes", "needs 32"}));
}

// Caught by fuzz_safetensors's check that numel fits (tests/fuzz): the element count was checked
// after multiplying, so [2^40, 2^40] wrapped to 0 elements, matched empty data_offsets and was
// accepted.
TEST(SafetensorsErrorTest, ShapeWhoseElementCountOverflowsIsRefused) {
  TempDir dir;
  for (const char* shape : {"[1099511627776, 1099511627776]", "[1099511627776, 16777216, 65536]",
                            "[4294967296, 4294967296]"}) {
    const std::string header = std::string(R"({"w": {"dtype": "F32", "shape": )") + shape +
                               R"(, "data_offsets": [0, 0]}})";
    EXPECT_TRUE(status_is(open_bytes(dir, safetensors_bytes({}, header)),
                          StatusCode::kInvalidArgument,
                          {dir.file("bad.safetensors"), "'w'", "too large"}))
        << shape;
  }
  // A zero dimension first keeps the count at zero: an empty tensor, as before.
  write_file(dir.file("empty.safetensors"), safetensors_bytes({}, R"({"w": {"dtype": "F32",
                 "shape": [0, 1099511627776, 1099511627776], "data_offsets": [0, 0]}})"));
  auto empty = SafetensorsReader::open_files({dir.file("empty.safetensors")});
  ASSERT_TRUE(empty.ok()) << empty.status().ToString();
  EXPECT_EQ(empty->tensor("w")->numel(), 0);
}

TEST(SafetensorsErrorTest, UnsupportedDtypeNamesTensorDtypeAndFile) {
  TempDir dir;
  write_file(dir.file("m.safetensors"),
             safetensors_bytes({{"ids", "I64", {2}, std::string(16, '\0')},
                                {"odd", "F4_E2M1", {3}, std::string(2, '\0')},
                                f32_tensor("ok", {1}, 0.0f)}));
  auto reader = SafetensorsReader::open_files({dir.file("m.safetensors")});
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();  // other tensors stay usable
  EXPECT_TRUE(reader->tensor("ok").ok());
  EXPECT_TRUE(status_is(reader->tensor("ids").status(), StatusCode::kInvalidArgument,
                        {dir.file("m.safetensors"), "'ids'", "I64", "F32, F16, BF16 and F8_E4M3"}));
  EXPECT_TRUE(status_is(reader->tensor("odd").status(), StatusCode::kInvalidArgument,
                        {"'odd'", "F4_E2M1"}));
}

// FP8 checkpoints' weights: F8_E4M3 tensors are read (one byte each) and to_float gives each
// code's e4m3 value; the other 8-bit float, F8_E5M2, stays refused by name.
TEST(SafetensorsTest, ReadsF8E4M3AndRefusesF8E5M2) {
  TempDir dir;
  const std::string codes = {'\x38', '\x7e', '\xfe', '\x01', '\x00', '\x80'};
  write_file(dir.file("m.safetensors"),
             safetensors_bytes(
                 {{"w", "F8_E4M3", {2, 3}, codes}, {"e5", "F8_E5M2", {2}, std::string(2, '\0')}}));
  auto reader = SafetensorsReader::open_files({dir.file("m.safetensors")});
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto w = reader->tensor("w");
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->dtype, DType::kF8E4M3);
  EXPECT_EQ(w->nbytes, 6u);
  EXPECT_EQ(w->numel(), 6);
  std::vector<float> out(6);
  to_float(*w, out.data());
  EXPECT_EQ(out, (std::vector<float>{1.0f, 448.0f, -448.0f, 1.0f / 512.0f, 0.0f, -0.0f}));
  EXPECT_TRUE(std::signbit(out[5]));
  EXPECT_TRUE(status_is(reader->tensor("e5").status(), StatusCode::kInvalidArgument,
                        {"'e5'", "F8_E5M2", "F8_E4M3"}));
  // An F8_E4M3 tensor whose byte span is not one byte an element is refused at open.
  write_file(dir.file("bad.safetensors"),
             safetensors_bytes({{"w", "F8_E4M3", {2, 3}, std::string(12, '\0')}}));
  EXPECT_TRUE(status_is(SafetensorsReader::open_files({dir.file("bad.safetensors")}).status(),
                        StatusCode::kInvalidArgument, {"'w'", "F8_E4M3", "needs 6"}));
}

TEST(SafetensorsErrorTest, MissingTensorNamesTensorAndFile) {
  TempDir dir;
  write_file(dir.file("model.safetensors"), safetensors_bytes({f32_tensor("x", {1}, 0.0f)}));
  auto reader = SafetensorsReader::open_dir(dir.path());
  ASSERT_TRUE(reader.ok());
  EXPECT_TRUE(status_is(reader->tensor("model.norm.weight").status(), StatusCode::kNotFound,
                        {"'model.norm.weight'", dir.file("model.safetensors")}));
}

TEST(SafetensorsErrorTest, TensorInTwoShards) {
  TempDir dir;
  write_file(dir.file("a.safetensors"), safetensors_bytes({f32_tensor("x", {1}, 0.0f)}));
  write_file(dir.file("b.safetensors"), safetensors_bytes({f32_tensor("x", {1}, 0.0f)}));
  EXPECT_TRUE(status_is(SafetensorsReader::open_dir(dir.path()).status(),
                        StatusCode::kInvalidArgument,
                        {"'x'", dir.file("a.safetensors"), dir.file("b.safetensors")}));
}

// --- malformed indexes ------------------------------------------------------------------

class IndexErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    write_file(dir_.file("s1.safetensors"), safetensors_bytes({f32_tensor("x", {1}, 0.0f)}));
  }
  Status open_with_index(const std::string& index) {
    write_file(index_path(), index);
    return SafetensorsReader::open_dir(dir_.path()).status();
  }
  std::string index_path() const { return dir_.file("model.safetensors.index.json"); }
  TempDir dir_;
};

TEST_F(IndexErrorTest, IndexNamesAMissingShard) {
  EXPECT_TRUE(status_is(open_with_index(R"({"weight_map": {"x": "s1.safetensors",
                                                          "y": "s2.safetensors"}})"),
                        StatusCode::kNotFound,
                        {index_path(), "'y'", "s2.safetensors", "does not exist"}));
}

TEST_F(IndexErrorTest, IndexPutsATensorInTheWrongShard) {
  EXPECT_TRUE(status_is(open_with_index(R"({"weight_map": {"x": "s1.safetensors",
                                                          "z": "s1.safetensors"}})"),
                        StatusCode::kInvalidArgument,
                        {index_path(), "'z'", "s1.safetensors", "does not hold it"}));
}

TEST_F(IndexErrorTest, BadIndexJson) {
  EXPECT_TRUE(status_is(open_with_index("{\"weight_map\": "), StatusCode::kInvalidArgument,
                        {index_path(), "invalid JSON"}));
  EXPECT_TRUE(status_is(open_with_index(R"({"metadata": {}})"), StatusCode::kInvalidArgument,
                        {index_path(), "'weight_map'"}));
  EXPECT_TRUE(status_is(open_with_index(R"({"weight_map": {"x": 3}})"),
                        StatusCode::kInvalidArgument, {index_path(), "weight_map['x']"}));
  EXPECT_TRUE(status_is(open_with_index(R"({"weight_map": {"x": "../s1.safetensors"}})"),
                        StatusCode::kInvalidArgument, {index_path(), "weight_map['x']"}));
  EXPECT_TRUE(status_is(open_with_index(R"({"weight_map": {}})"), StatusCode::kInvalidArgument,
                        {index_path(), "empty"}));
}

TEST_F(IndexErrorTest, CorruptShardBehindAnIndexNamesTheShard) {
  write_file(dir_.file("s2.safetensors"), std::string("\x08\0\0\0\0\0\0\0{bad}   ", 16));
  EXPECT_TRUE(status_is(open_with_index(R"({"weight_map": {"x": "s1.safetensors",
                                                          "y": "s2.safetensors"}})"),
                        StatusCode::kInvalidArgument, {dir_.file("s2.safetensors"), "JSON"}));
}

}  // namespace
}  // namespace treeserve
