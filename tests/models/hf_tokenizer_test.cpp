// tokenizer.json: small hand-made files in the layouts real checkpoints use (Llama 3's
// byte-level BPE; Llama 2's legacy Prepend/Replace + ByteFallback/Fuse/Strip; the Metaspace
// pre-tokenizer and decoder), with ids worked out by hand; added tokens, split behaviours,
// normalizers, BOS/EOS from the post-processor and tokenizer_config.json, the directory
// loader's choice of file, and the errors for what treeserve does not implement.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "models/detail/unicode.h"
#include "models/detokenizer.h"
#include "models/tokenizer.h"
#include "tests/models/test_util.h"

namespace treeserve {
namespace {

using nlohmann::json;
using testing::status_is;
using testing::TempDir;
using testing::write_file;
using Ids = std::vector<int32_t>;

const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::string byte_level(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) detail::append_utf8(detail::byte_to_char()[b], &out);
  return out;
}

json added(int32_t id, const std::string& content, bool special, json extra = json::object()) {
  json t = {{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
            {"rstrip", false}, {"normalized", false}, {"special", special}};
  for (auto& [k, v] : extra.items()) t[k] = v;
  return t;
}

json template_bos(const std::string& bos, int32_t id) {
  return {{"type", "TemplateProcessing"},
          {"single",
           {{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
            {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
          {"pair", json::array()},
          {"special_tokens", {{bos, {{"id", bos}, {"ids", {id}}, {"tokens", {bos}}}}}}};
}

// Llama 3's layout: bytes 0..255 are ids 0..255; "he" 256, "ll" 257, "hell" 258, "hello" 259,
// "Ġw" 260; added tokens from 300 (<|bos|> 300, <|eot|> 301, <tool> 302 not special,
// <|e|> 303 and <|e|>! 304 for longest-match).
json byte_level_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level(std::string(1, char(b)))] = b;
  vocab["he"] = 256;
  vocab["ll"] = 257;
  vocab["hell"] = 258;
  vocab["hello"] = 259;
  vocab[byte_level(" w")] = 260;
  return {{"version", "1.0"},
          {"added_tokens",
           {added(300, "<|bos|>", true), added(301, "<|eot|>", true), added(302, "<tool>", false),
            added(303, "<|e|>", true), added(304, "<|e|>!", true)}},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"},
               {"pattern", {{"Regex", kLlama3Pattern}}},
               {"behavior", "Isolated"},
               {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
          {"post_processor",
           {{"type", "Sequence"},
            {"processors", {{{"type", "ByteLevel"}}, template_bos("<|bos|>", 300)}}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"},
            {"ignore_merges", true},
            {"vocab", vocab},
            {"merges", {"h e", "l l", "he ll", "hell o", byte_level(" ") + " w"}}}}};
}

// Llama 2's legacy export: <unk> <s> </s>, the 256 byte pieces (3..258), then
// "▁" 259, "h" 260, "e" 261, "l" 262, "o" 263, "▁h" 264, "ll" 265, "▁he" 266, "▁hell" 267,
// "▁hello" 268, "w" 269, "▁w" 270.
const std::string kSp = "\xE2\x96\x81";  // ▁
json sentencepiece_style_tokenizer(bool metaspace) {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  const std::vector<std::string> pieces = {kSp,          "h",           "e",  "l",
                                           "o",          kSp + "h",     "ll", kSp + "he",
                                           kSp + "hell", kSp + "hello", "w",  kSp + "w"};
  for (size_t i = 0; i < pieces.size(); ++i) vocab[pieces[i]] = 259 + int(i);
  json merges = json::array();  // the [left, right] form
  for (const auto& [l, r] : std::vector<std::pair<std::string, std::string>>{{kSp, "h"},
                                                                             {"l", "l"},
                                                                             {kSp + "h", "e"},
                                                                             {kSp + "he", "ll"},
                                                                             {kSp + "hell", "o"},
                                                                             {kSp, "w"}}) {
    merges.push_back(json::array({l, r}));
  }
  json t = {
      {"version", "1.0"},
      {"added_tokens", {added(0, "<unk>", true), added(1, "<s>", true), added(2, "</s>", true)}},
      {"post_processor", template_bos("<s>", 1)},
      {"model",
       {{"type", "BPE"},
        {"unk_token", "<unk>"},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab", vocab},
        {"merges", merges}}}};
  if (metaspace) {
    t["normalizer"] = nullptr;
    t["pre_tokenizer"] = {
        {"type", "Metaspace"}, {"replacement", kSp}, {"prepend_scheme", "first"}, {"split", false}};
    t["decoder"] = {{"type", "Metaspace"}, {"replacement", kSp}, {"prepend_scheme", "first"}};
  } else {
    t["normalizer"] = {{"type", "Sequence"},
                       {"normalizers",
                        {{{"type", "Prepend"}, {"prepend", kSp}},
                         {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kSp}}}}};
    t["pre_tokenizer"] = nullptr;
    t["decoder"] = {{"type", "Sequence"},
                    {"decoders",
                     {{{"type", "Replace"}, {"pattern", {{"String", kSp}}}, {"content", " "}},
                      {{"type", "ByteFallback"}},
                      {{"type", "Fuse"}},
                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  }
  return t;
}

std::unique_ptr<Tokenizer> load_json(const TempDir& dir, const json& tokenizer,
                                     const std::string& name = "tokenizer.json") {
  write_file(dir.file(name), tokenizer.dump());
  auto t = Tokenizer::load(dir.file(name));
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

Status load_error(const json& tokenizer) {
  TempDir dir;
  write_file(dir.file("tokenizer.json"), tokenizer.dump());
  return Tokenizer::load(dir.file("tokenizer.json")).status();
}

Ids encode(const Tokenizer& t, const std::string& text) {
  auto ids = t.encode(text);
  EXPECT_TRUE(ids.ok()) << ids.status().ToString();
  return ids.ok() ? *ids : Ids{};
}

TEST(HfTokenizerTest, ByteLevelEncodeDecode) {
  TempDir dir;
  auto t = load_json(dir, byte_level_tokenizer());
  ASSERT_TRUE(t);
  EXPECT_EQ(t->vocab_size(), 305);
  EXPECT_EQ(t->bos_id(), 300);  // from TemplateProcessing
  EXPECT_EQ(t->eos_id(), -1);
  EXPECT_EQ(encode(*t, "hello"), (Ids{259}));
  EXPECT_EQ(encode(*t, "hello world"), (Ids{259, 260, 'o', 'r', 'l', 'd'}));
  EXPECT_EQ(encode(*t, "hell"), (Ids{258}));  // ignore_merges: a whole-word piece
  EXPECT_EQ(encode(*t, "\xE6\x97\xA5"), (Ids{0xE6, 0x97, 0xA5}));
  EXPECT_EQ(*t->decode({259, 260, 'o'}), "hello wo");
  EXPECT_EQ(*t->decode({0xE6}), "\xEF\xBF\xBD");  // half a character: U+FFFD
  EXPECT_EQ(t->id_to_piece(260), byte_level(" w"));
  EXPECT_EQ(t->piece_to_id(byte_level(" w")), 260);
  EXPECT_EQ(t->token_bytes(260), " w");
  EXPECT_EQ(t->token_bytes(0xE6), "\xE6");
  EXPECT_EQ(t->piece_to_id("nope"), -1);
}

TEST(HfTokenizerTest, AddedTokensComeFirstLongestMatch) {
  TempDir dir;
  auto t = load_json(dir, byte_level_tokenizer());
  ASSERT_TRUE(t);
  EXPECT_EQ(encode(*t, "hi<|eot|>hello"), (Ids{'h', 'i', 301, 259}));
  EXPECT_EQ(encode(*t, "<|e|>!<|e|>?"), (Ids{304, 303, '?'}));
  EXPECT_EQ(encode(*t, "<|eot|<|bos|>"), (Ids{'<', '|', 'e', 'o', 't', '|', 300}));
  // Special tokens are left out of decode(), not of decode_with_special(); <tool> is not special.
  const Ids ids = {300, 259, 302, 301};
  EXPECT_EQ(*t->decode(ids), "hello<tool>");
  EXPECT_EQ(*t->decode_with_special(ids), "<|bos|>hello<tool><|eot|>");
}

TEST(HfTokenizerTest, AddedTokenFlags) {
  json j = byte_level_tokenizer();
  j["added_tokens"] = {added(300, "<L>", true, {{"lstrip", true}}),
                       added(301, "<R>", true, {{"rstrip", true}}),
                       added(302, "ab", false, {{"single_word", true}})};
  TempDir dir;
  auto t = load_json(dir, j);
  ASSERT_TRUE(t);
  EXPECT_EQ(encode(*t, "x  <L>y"), (Ids{'x', 300, 'y'}));           // spaces before <L> taken
  EXPECT_EQ(encode(*t, "x<R> \n y"), (Ids{'x', 301, 'y'}));         // whitespace after <R> taken
  EXPECT_EQ(encode(*t, "ab cab"), (Ids{302, ' ', 'c', 'a', 'b'}));  // "cab" is not a word "ab"
}

TEST(HfTokenizerTest, NormalizedAddedTokensMatchNormalizedText) {
  json j = byte_level_tokenizer();
  j["normalizer"] = {{"type", "NFC"}};
  j["added_tokens"] = {added(300, "caf\xC3\xA9", false, {{"normalized", true}})};
  TempDir dir;
  auto t = load_json(dir, j);
  ASSERT_TRUE(t);
  EXPECT_EQ(encode(*t, "cafe\xCC\x81"), (Ids{300}));  // decomposed é, NFC'd, then matched
  EXPECT_EQ(encode(*t, "e\xCC\x81"), (Ids{0xC3, 0xA9}));
}

TEST(HfTokenizerTest, RoundTripsRandomText) {
  TempDir dir;
  auto t = load_json(dir, byte_level_tokenizer());
  ASSERT_TRUE(t);
  std::mt19937 rng(45);
  const uint32_t pool[] = {' ', '\n', '\t',   'h',     'e',    'l',  'o', 'w', '1',
                           '!', 0xE9, 0x65E5, 0x1F600, 0x2003, 0x85, '<', '|'};
  for (int i = 0; i < 500; ++i) {
    std::string s;
    for (int n = int(rng() % 30); n > 0; --n) detail::append_utf8(pool[rng() % 17], &s);
    if (rng() % 4 == 0) s += "<|eot|>";
    auto ids = t->encode(s);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(*t->decode_with_special(*ids), s);
  }
}

TEST(HfTokenizerTest, InvalidUtf8IsRefused) {
  TempDir dir;
  auto t = load_json(dir, byte_level_tokenizer());
  ASSERT_TRUE(t);
  EXPECT_TRUE(status_is(t->encode("ok\xE6\x97").status(), StatusCode::kInvalidArgument,
                        {"not valid UTF-8", "byte 2"}));
  EXPECT_TRUE(status_is(t->decode({305}).status(), StatusCode::kInvalidArgument,
                        {"outside the vocabulary"}));
}

TEST(HfTokenizerTest, StreamingHoldsSplitCharacters) {
  TempDir dir;
  auto t = load_json(dir, byte_level_tokenizer());
  ASSERT_TRUE(t);
  const DetokenizerVocab vocab(*t);
  IncrementalDetokenizer detok(*t, &vocab);
  std::vector<std::string> deltas;
  for (int32_t id : Ids{259, 0xE6, 0x97, 0xA5, 260, 0xF0, 0x9F}) deltas.push_back(*detok.push(id));
  EXPECT_EQ(deltas, (std::vector<std::string>{"hello", "", "", "\xE6\x97\xA5", " w", "", ""}));
  EXPECT_EQ(*detok.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(incomplete_utf8_tail(*t, {259, 0xE6, 0x97}), 2);
  EXPECT_EQ(vocab.plain_text(0xE6), nullptr);
  ASSERT_NE(vocab.plain_text(260), nullptr);
  EXPECT_EQ(*vocab.plain_text(260), " w");
}

TEST(HfTokenizerTest, LegacySentencepieceLayout) {
  TempDir dir;
  auto t = load_json(dir, sentencepiece_style_tokenizer(false));
  ASSERT_TRUE(t);
  EXPECT_EQ(t->bos_id(), 1);
  EXPECT_EQ(encode(*t, "hello"), (Ids{268}));
  EXPECT_EQ(encode(*t, "hello w"), (Ids{268, 270}));
  EXPECT_EQ(encode(*t, "h\xC3\xA9"), (Ids{264, 3 + 0xC3, 3 + 0xA9}));  // é by byte fallback
  EXPECT_EQ(encode(*t, "xy"), (Ids{259, 3 + 'x', 3 + 'y'}));
  EXPECT_EQ(*t->decode({268, 270}), "hello w");
  EXPECT_EQ(*t->decode({264, 3 + 0xC3, 3 + 0xA9}), "h\xC3\xA9");
  EXPECT_EQ(*t->decode({1, 268, 2}), "hello");
  // ByteFallback: an invalid run is one U+FFFD per byte.
  EXPECT_EQ(*t->decode({3 + 0xC3, 264}), "\xEF\xBF\xBD h");
  EXPECT_EQ(t->token_bytes(3 + 0xC3), "\xC3");
  EXPECT_EQ(t->token_bytes(268), "");

  const DetokenizerVocab vocab(*t);
  IncrementalDetokenizer detok(*t, &vocab);
  std::string streamed;
  for (int32_t id : Ids{264, 3 + 0xC3, 3 + 0xA9, 270, 268}) streamed += *detok.push(id);
  EXPECT_EQ(streamed, "h\xC3\xA9 w hello");
}

// Found by tests/fuzz (fuzz_tokenizer_json): an ASCII byte piece counted as plain text, but the
// ByteFallback decoder turns it into U+FFFD inside a run that is not UTF-8, so the table-driven
// stream emitted "?" where decode() gives U+FFFD.
TEST(HfTokenizerTest, AsciiBytePiecesAreNotPlainText) {
  TempDir dir;
  auto t = load_json(dir, sentencepiece_style_tokenizer(false));
  ASSERT_TRUE(t);
  const DetokenizerVocab vocab(*t);
  EXPECT_EQ(vocab.plain_text(3 + '?'), nullptr);
  EXPECT_EQ(vocab.plain_text(3 + 0x0C), nullptr);
  const Ids ids = {3 + 0x98, 3 + 0xE2, 3 + 0x0C, 3 + '?'};
  const std::string replacement = "\xEF\xBF\xBD";
  EXPECT_EQ(*t->decode(ids), replacement + replacement + replacement + replacement);
  IncrementalDetokenizer slow(*t);
  IncrementalDetokenizer fast(*t, &vocab);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string delta = *slow.push(id);
    EXPECT_EQ(*fast.push(id), delta) << id;
    streamed += delta;
  }
  const std::string rest = *slow.flush();
  EXPECT_EQ(*fast.flush(), rest);
  EXPECT_EQ(streamed + rest, *t->decode(ids));
}

// Found by tests/fuzz (fuzz_tokenizer_json): a piece shaped like a byte piece but without two
// hex digits ("<0xZZ>") threw std::invalid_argument out of the loader and ended the process.
TEST(HfTokenizerTest, PiecesLikeBytePiecesWithoutHexDigitsArePlainPieces) {
  json j = sentencepiece_style_tokenizer(false);
  j["model"]["vocab"]["<0xZZ>"] = 271;
  j["model"]["vocab"]["<0x1Z>"] = 272;
  TempDir dir;
  auto t = load_json(dir, j);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->token_bytes(271), "");
  EXPECT_EQ(t->token_bytes(272), "");
  EXPECT_EQ(t->token_bytes(3 + 0x0A), "\n");
  EXPECT_EQ(*t->decode({271, 272}), "<0xZZ><0x1Z>");
}

TEST(HfTokenizerTest, MetaspaceLayout) {
  TempDir dir;
  auto t = load_json(dir, sentencepiece_style_tokenizer(true));
  ASSERT_TRUE(t);
  EXPECT_EQ(encode(*t, "hello"), (Ids{268}));
  EXPECT_EQ(encode(*t, "hello w"), (Ids{268, 270}));
  // prepend_scheme "first": text after an added token gets no ▁.
  EXPECT_EQ(encode(*t, "<s>hello"), (Ids{1, 260, 261, 265, 263}));
  // The Metaspace decoder drops ▁ from the first token and spaces the others.
  EXPECT_EQ(*t->decode({268, 270}), "hello w");
  EXPECT_EQ(*t->decode({270, 268}), "w hello");
}

// A vocabulary in which every expected word is one piece: with ignore_merges each word of
// the pre-tokenizer's output is one id, so the ids spell the split.
json split_tokenizer(json pre_tokenizer) {
  json vocab = json::object();
  int32_t id = 0;
  for (const char* p : {"a", "b", "1", "2", "-", "ab", "12", "ab-", "-12", "--", "ab12", "ab-12"}) {
    vocab[p] = id++;
  }
  return {
      {"pre_tokenizer", pre_tokenizer},
      {"model",
       {{"type", "BPE"}, {"ignore_merges", true}, {"vocab", vocab}, {"merges", json::array()}}}};
}

std::vector<std::string> words(const std::string& text, const json& pre_tokenizer) {
  TempDir dir;
  auto t = load_json(dir, split_tokenizer(pre_tokenizer));
  std::vector<std::string> out;
  if (!t) return out;
  for (int32_t id : encode(*t, text)) out.push_back(t->id_to_piece(id));
  return out;
}

json split(const std::string& behavior, bool invert = false) {
  return {{"type", "Split"},
          {"pattern", {{"String", "-"}}},
          {"behavior", behavior},
          {"invert", invert}};
}

TEST(HfTokenizerTest, SplitBehaviours) {
  using W = std::vector<std::string>;
  EXPECT_EQ(words("ab-12", split("Removed")), (W{"ab", "12"}));
  EXPECT_EQ(words("ab-12", split("Isolated")), (W{"ab", "-", "12"}));
  EXPECT_EQ(words("ab-12", split("MergedWithPrevious")), (W{"ab-", "12"}));
  EXPECT_EQ(words("ab-12", split("MergedWithNext")), (W{"ab", "-12"}));
  EXPECT_EQ(words("ab--12", split("Contiguous")), (W{"ab", "--", "12"}));
  EXPECT_EQ(words("ab-12", split("Removed", true)), (W{"-"}));
  EXPECT_EQ(words("ab12", {{"type", "Digits"}, {"individual_digits", true}}), (W{"ab", "1", "2"}));
  EXPECT_EQ(words("ab12", {{"type", "Digits"}, {"individual_digits", false}}), (W{"ab", "12"}));
  EXPECT_EQ(words("ab-12", nullptr), (W{"ab-12"}));
}

TEST(HfTokenizerTest, NormalizersApply) {
  json j = split_tokenizer(nullptr);
  j["normalizer"] = {{"type", "Sequence"},
                     {"normalizers",
                      {{{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}},
                       {{"type", "Replace"}, {"pattern", {{"Regex", "[0-9]+"}}}, {"content", "12"}},
                       {{"type", "NFKC"}}}}};
  TempDir dir;
  auto t = load_json(dir, j);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->id_to_piece(encode(*t, " \u3000ab-9876\n")[0]), "ab-12");
  EXPECT_EQ(t->id_to_piece(encode(*t,
                                  "\xEF\xBD\x81"
                                  "b")[0]),
            "ab");  // fullwidth a, NFKC
}

TEST(HfTokenizerTest, UnsupportedComponentsAreNamed) {
  auto with = [](const char* stage, json value) {
    json j = byte_level_tokenizer();
    j[stage] = value;
    return load_error(j);
  };
  EXPECT_TRUE(status_is(with("normalizer", {{"type", "BertNormalizer"}}),
                        StatusCode::kInvalidArgument, {"normalizer", "'BertNormalizer'"}));
  EXPECT_TRUE(status_is(with("pre_tokenizer", {{"type", "Whitespace"}}),
                        StatusCode::kInvalidArgument, {"pre_tokenizer", "'Whitespace'"}));
  EXPECT_TRUE(status_is(with("decoder", {{"type", "WordPiece"}}), StatusCode::kInvalidArgument,
                        {"decoder", "'WordPiece'"}));
  EXPECT_TRUE(status_is(with("post_processor", {{"type", "RobertaProcessing"}}),
                        StatusCode::kInvalidArgument, {"post_processor", "'RobertaProcessing'"}));
  json suffix = template_bos("<|bos|>", 300);
  suffix["single"].push_back({{"SpecialToken", {{"id", "<|bos|>"}, {"type_id", 0}}}});
  EXPECT_TRUE(status_is(with("post_processor", suffix), StatusCode::kInvalidArgument,
                        {"TemplateProcessing", "1 after"}));
  EXPECT_TRUE(status_is(
      with("pre_tokenizer", {{"type", "Sequence"},
                             {"pretokenizers", {{{"type", "ByteLevel"}}, {{"type", "Digits"}}}}}),
      StatusCode::kInvalidArgument, {"after ByteLevel"}));
  EXPECT_TRUE(status_is(with("pre_tokenizer", {{"type", "Split"}, {"pattern", {{"Regex", "(x"}}}}),
                        StatusCode::kInvalidArgument, {"pre_tokenizer.pattern.Regex", "PCRE2"}));
  json model = byte_level_tokenizer();
  model["model"]["type"] = "WordPiece";
  EXPECT_TRUE(status_is(load_error(model), StatusCode::kInvalidArgument, {"model", "'WordPiece'"}));
  model = byte_level_tokenizer();
  model["model"]["merges"].push_back("he zz");
  EXPECT_TRUE(status_is(load_error(model), StatusCode::kInvalidArgument, {"merges[5]", "'zz'"}));
  model = byte_level_tokenizer();
  model["model"]["dropout"] = 0.1;
  EXPECT_TRUE(status_is(load_error(model), StatusCode::kInvalidArgument, {"dropout"}));
  TempDir dir;
  write_file(dir.file("tokenizer.json"), "{ not json");
  EXPECT_TRUE(status_is(Tokenizer::load(dir.file("tokenizer.json")).status(),
                        StatusCode::kInvalidArgument, {"invalid JSON"}));
  EXPECT_TRUE(status_is(Tokenizer::load(dir.file("missing.json")).status(), StatusCode::kNotFound,
                        {"missing.json"}));
}

// ---- the directory loader -----------------------------------------------------------------

const std::string kTinySpm = std::string(TREESERVE_TINY_MODEL_DIR) + "/tokenizer.model";
const char* const kTiktoken = "IQ== 0\nIg== 1\nIw== 2\n";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(TokenizerDirTest, PicksByWhatTheDirectoryHolds) {
  {
    TempDir dir;
    write_file(dir.file("tokenizer.json"), byte_level_tokenizer().dump());
    auto t = Tokenizer::load_model_dir(dir.path());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_NE((*t)->description().find("tokenizer.json"), std::string::npos);
    EXPECT_EQ((*t)->vocab_size(), 305);
  }
  {  // both: sentencepiece's own file is read
    TempDir dir;
    write_file(dir.file("tokenizer.json"), byte_level_tokenizer().dump());
    write_file(dir.file("tokenizer.model"), read_file(kTinySpm));
    auto t = Tokenizer::load_model_dir(dir.path());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_NE((*t)->description().find("sentencepiece"), std::string::npos);
    EXPECT_EQ((*t)->vocab_size(), 512);
  }
  {  // Llama 3: a tiktoken tokenizer.model beside tokenizer.json
    TempDir dir;
    write_file(dir.file("tokenizer.json"), byte_level_tokenizer().dump());
    write_file(dir.file("tokenizer.model"), kTiktoken);
    auto t = Tokenizer::load_model_dir(dir.path());
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_NE((*t)->description().find("tiktoken"), std::string::npos);
    EXPECT_EQ((*t)->vocab_size(), 305);
  }
  {  // a tiktoken file alone
    TempDir dir;
    write_file(dir.file("tokenizer.model"), kTiktoken);
    EXPECT_TRUE(status_is(Tokenizer::load_model_dir(dir.path()).status(),
                          StatusCode::kInvalidArgument, {"tiktoken", "tokenizer.json"}));
    EXPECT_TRUE(status_is(Tokenizer::load(dir.file("tokenizer.model")).status(),
                          StatusCode::kInvalidArgument, {"tiktoken"}));
  }
  {
    TempDir dir;
    EXPECT_TRUE(status_is(Tokenizer::load_model_dir(dir.path()).status(), StatusCode::kNotFound,
                          {"tokenizer.model", "tokenizer.json"}));
  }
}

StatusOr<std::unique_ptr<Tokenizer>> with_config(const json& config) {
  TempDir dir;
  write_file(dir.file("tokenizer.json"), byte_level_tokenizer().dump());
  write_file(dir.file("tokenizer_config.json"), config.dump());
  return Tokenizer::load_model_dir(dir.path());
}

TEST(TokenizerDirTest, TokenizerConfigSetsBosAndEos) {
  auto t = with_config({{"bos_token", "<|bos|>"}, {"eos_token", "<|eot|>"}});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->bos_id(), 300);
  EXPECT_EQ((*t)->eos_id(), 301);
  t = with_config({{"add_bos_token", false}, {"eos_token", {{"content", "<|eot|>"}}}});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->bos_id(), -1);
  EXPECT_EQ((*t)->eos_id(), 301);
  t = with_config({{"add_bos_token", true}, {"bos_token", "<|e|>"}});
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->bos_id(), 303);
  t = with_config({{"bos_token", nullptr}, {"eos_token", nullptr}});  // Qwen2.5 writes null BOS
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->bos_id(), 300);
  EXPECT_TRUE(status_is(with_config({{"eos_token", "<|nope|>"}}).status(),
                        StatusCode::kInvalidArgument, {"tokenizer_config.json", "eos_token"}));
  EXPECT_TRUE(status_is(with_config({{"add_bos_token", "yes"}}).status(),
                        StatusCode::kInvalidArgument, {"add_bos_token"}));
  EXPECT_TRUE(status_is(with_config({{"eos_token", 5}}).status(), StatusCode::kInvalidArgument,
                        {"eos_token"}));
}

}  // namespace
}  // namespace treeserve
