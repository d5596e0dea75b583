// load_llama_weights: the tiny model built with the project (every tensor, right
// shapes), tied embeddings, and synthetic checkpoints with a tensor missing, misshapen
// or of an unsupported dtype.
#include "models/llama_weights.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "tests/models/test_util.h"

namespace treeserve {
namespace {

using testing::safetensors_bytes;
using testing::small_llama_config;
using testing::status_is;
using testing::TempDir;
using testing::TestTensor;
using testing::write_file;

std::vector<int64_t> shape(const TensorView& v) { return v.shape; }

TEST(LlamaWeightsTest, LoadsTheTinyModel) {
  auto config = load_model_config(TREESERVE_TINY_MODEL_DIR);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  auto reader = SafetensorsReader::open_dir(TREESERVE_TINY_MODEL_DIR);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto w = load_llama_weights(*config, *reader);
  ASSERT_TRUE(w.ok()) << w.status().ToString();

  const int64_t vocab = 512, hidden = 256, inter = 512, q = 4 * 64, kv = 2 * 64;
  EXPECT_EQ(shape(w->embed_tokens), (std::vector<int64_t>{vocab, hidden}));
  EXPECT_EQ(shape(w->norm), std::vector<int64_t>{hidden});
  EXPECT_EQ(shape(w->lm_head), (std::vector<int64_t>{vocab, hidden}));
  EXPECT_NE(w->lm_head.data, w->embed_tokens.data);  // the tiny model is untied
  EXPECT_EQ(w->lm_head.name, "lm_head.weight");
  ASSERT_EQ(w->layers.size(), 4u);
  for (const LlamaLayerWeights& l : w->layers) {
    EXPECT_EQ(shape(l.input_layernorm), std::vector<int64_t>{hidden});
    EXPECT_EQ(shape(l.q_proj), (std::vector<int64_t>{q, hidden}));
    EXPECT_EQ(shape(l.k_proj), (std::vector<int64_t>{kv, hidden}));
    EXPECT_EQ(shape(l.v_proj), (std::vector<int64_t>{kv, hidden}));
    EXPECT_EQ(shape(l.o_proj), (std::vector<int64_t>{hidden, q}));
    EXPECT_EQ(shape(l.post_attention_layernorm), std::vector<int64_t>{hidden});
    EXPECT_EQ(shape(l.gate_proj), (std::vector<int64_t>{inter, hidden}));
    EXPECT_EQ(shape(l.up_proj), (std::vector<int64_t>{inter, hidden}));
    EXPECT_EQ(shape(l.down_proj), (std::vector<int64_t>{hidden, inter}));
  }
  EXPECT_EQ(w->layers[3].down_proj.name, "model.layers.3.mlp.down_proj.weight");

  // Every tensor of the file is used, and every view is float32 data in the mapping.
  std::vector<const TensorView*> all = {&w->embed_tokens, &w->norm, &w->lm_head};
  for (const LlamaLayerWeights& l : w->layers) {
    for (const TensorView* v :
         {&l.input_layernorm, &l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj,
          &l.post_attention_layernorm, &l.gate_proj, &l.up_proj, &l.down_proj}) {
      all.push_back(v);
    }
  }
  EXPECT_EQ(all.size(), reader->tensor_names().size());
  for (const TensorView* v : all) {
    EXPECT_EQ(v->dtype, DType::kF32) << v->name;
    EXPECT_EQ(v->nbytes, static_cast<size_t>(v->numel()) * 4) << v->name;
    EXPECT_NE(v->data, nullptr) << v->name;
  }

  // Norm weights are 1 +- 0.1 by construction (make_tiny_model.py).
  std::vector<float> norm(static_cast<size_t>(hidden));
  to_float(w->norm, norm.data());
  for (float x : norm) {
    EXPECT_GE(x, 0.9f);
    EXPECT_LE(x, 1.1f);
  }
}

std::map<std::string, std::vector<int64_t>> small_shapes() {
  std::map<std::string, std::vector<int64_t>> s = {
      {"model.embed_tokens.weight", {16, 8}},
      {"model.norm.weight", {8}},
      {"lm_head.weight", {16, 8}},
  };
  for (int i = 0; i < 2; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    s[p + "input_layernorm.weight"] = {8};
    s[p + "self_attn.q_proj.weight"] = {8, 8};
    s[p + "self_attn.k_proj.weight"] = {4, 8};
    s[p + "self_attn.v_proj.weight"] = {4, 8};
    s[p + "self_attn.o_proj.weight"] = {8, 8};
    s[p + "post_attention_layernorm.weight"] = {8};
    s[p + "mlp.gate_proj.weight"] = {12, 8};
    s[p + "mlp.up_proj.weight"] = {12, 8};
    s[p + "mlp.down_proj.weight"] = {8, 12};
  }
  return s;
}

// Writes the shapes as BF16 zeros (dtype does not matter to the weight map).
StatusOr<LlamaWeights> load_small(const TempDir& dir, const ModelConfig& config,
                                  const std::map<std::string, std::vector<int64_t>>& shapes,
                                  const std::string& odd_dtype_tensor = "") {
  std::vector<TestTensor> tensors;
  for (const auto& [name, dims] : shapes) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    const bool odd = name == odd_dtype_tensor;
    tensors.push_back({name, odd ? "I32" : "BF16", dims,
                       std::string(static_cast<size_t>(n) * (odd ? 4 : 2), '\0')});
  }
  write_file(dir.file("model.safetensors"), safetensors_bytes(tensors));
  auto reader = SafetensorsReader::open_dir(dir.path());
  if (!reader.ok()) return reader.status();
  return load_llama_weights(config, *reader);
}

TEST(LlamaWeightsTest, TiedEmbeddingsNeedNoLmHead) {
  TempDir dir;
  auto shapes = small_shapes();
  shapes.erase("lm_head.weight");
  auto w = load_small(dir, small_llama_config(/*tied=*/true), shapes);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->lm_head.data, w->embed_tokens.data);
  EXPECT_EQ(w->lm_head.name, "model.embed_tokens.weight");
  EXPECT_EQ(w->embed_tokens.dtype, DType::kBF16);
}

TEST(LlamaWeightsTest, TiedEmbeddingsIgnoreASavedLmHead) {
  TempDir dir;
  auto w = load_small(dir, small_llama_config(/*tied=*/true), small_shapes());
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(w->lm_head.data, w->embed_tokens.data);
}

TEST(LlamaWeightsTest, UntiedWithoutLmHeadIsAnError) {
  TempDir dir;
  auto shapes = small_shapes();
  shapes.erase("lm_head.weight");
  EXPECT_TRUE(status_is(load_small(dir, small_llama_config(false), shapes).status(),
                        StatusCode::kNotFound,
                        {"'lm_head.weight'", dir.file("model.safetensors")}));
}

TEST(LlamaWeightsTest, EveryMissingTensorIsNamed) {
  for (const auto& [missing, dims] : small_shapes()) {
    TempDir dir;
    auto shapes = small_shapes();
    shapes.erase(missing);
    EXPECT_TRUE(status_is(load_small(dir, small_llama_config(false), shapes).status(),
                          StatusCode::kNotFound,
                          {"'" + missing + "'", dir.file("model.safetensors")}))
        << missing;
  }
}

TEST(LlamaWeightsTest, WrongShapeNamesTensorFileAndBothShapes) {
  TempDir dir;
  auto shapes = small_shapes();
  shapes["model.layers.1.self_attn.k_proj.weight"] = {8, 8};  // as if kv_heads were 2
  EXPECT_TRUE(status_is(load_small(dir, small_llama_config(false), shapes).status(),
                        StatusCode::kInvalidArgument,
                        {dir.file("model.safetensors"), "'model.layers.1.self_attn.k_proj.weight'",
                         "shape [8, 8]", "expected [4, 8]"}));
}

TEST(LlamaWeightsTest, ConfigWithMoreLayersThanTheCheckpoint) {
  TempDir dir;
  ModelConfig config = small_llama_config(false);
  config.num_hidden_layers = 3;
  EXPECT_TRUE(status_is(load_small(dir, config, small_shapes()).status(), StatusCode::kNotFound,
                        {"'model.layers.2.input_layernorm.weight'"}));
}

TEST(LlamaWeightsTest, UnsupportedDtypeIsNamed) {
  TempDir dir;
  EXPECT_TRUE(
      status_is(load_small(dir, small_llama_config(false), small_shapes(),
                           "model.layers.0.mlp.up_proj.weight")
                    .status(),
                StatusCode::kInvalidArgument,
                {dir.file("model.safetensors"), "'model.layers.0.mlp.up_proj.weight'", "I32"}));
}

}  // namespace
}  // namespace treeserve
