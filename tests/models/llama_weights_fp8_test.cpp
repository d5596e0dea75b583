// load_llama_weights on FP8 checkpoints: e4m3 projections with their weight_scale (per tensor
// [] / [1], per channel [out] / [out, 1]) and static input_scale, the granularity recorded in
// LlamaWeights::quant, and every broken checkpoint refused naming the tensor and the file:
// a missing or misshapen scale, a 16-bit weight under an FP8 config (and the reverse), an
// e4m3 lm_head, scales of another granularity than the config's or of mixed granularity, and
// scales that are not positive finite numbers.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "models/llama_weights.h"
#include "tests/models/test_util.h"

namespace treeserve {
namespace {

using testing::raw_bytes;
using testing::safetensors_bytes;
using testing::small_llama_config;
using testing::status_is;
using testing::TempDir;
using testing::TestTensor;
using testing::write_file;

// small_llama_config() with FP8 projections.
ModelConfig fp8_config(Fp8ActivationScale activations, bool stated,
                       Fp8WeightScale granularity = Fp8WeightScale::kChannel) {
  ModelConfig c = small_llama_config();
  c.quant.scheme = QuantScheme::kFp8;
  c.quant.prequantized = true;
  c.quant.activation_scale = activations;
  c.quant.weight_scale_stated = stated;
  c.quant.weight_scale = granularity;
  c.quant.source = "config.json quantization_config (test)";
  return c;
}

const std::vector<std::pair<std::string, std::vector<int64_t>>>& projections() {
  static const std::vector<std::pair<std::string, std::vector<int64_t>>> p = {
      {"self_attn.q_proj", {8, 8}}, {"self_attn.k_proj", {4, 8}}, {"self_attn.v_proj", {4, 8}},
      {"self_attn.o_proj", {8, 8}}, {"mlp.gate_proj", {12, 8}},   {"mlp.up_proj", {12, 8}},
      {"mlp.down_proj", {8, 12}}};
  return p;
}

TestTensor f32(const std::string& name, std::vector<int64_t> shape, float value) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return {name, "F32", std::move(shape), raw_bytes(std::vector<float>(size_t(n), value))};
}

// The checkpoint's tensors by name: BF16 embeddings and norms, F8_E4M3 projections (every byte
// 0x38, 1.0), F32 weight scales of `scale_shape` ("channel": [out], "channel2": [out, 1],
// "tensor": [], "tensor1": [1]) and, when `input_scales`, F32 [] input scales.
std::map<std::string, TestTensor> fp8_tensors(const std::string& scale_shape, bool input_scales) {
  std::map<std::string, TestTensor> t;
  auto bf16 = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    t[name] = {name, "BF16", std::move(shape), std::string(size_t(n) * 2, '\0')};
  };
  bf16("model.embed_tokens.weight", {16, 8});
  bf16("model.norm.weight", {8});
  bf16("lm_head.weight", {16, 8});
  for (int i = 0; i < 2; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    bf16(p + "input_layernorm.weight", {8});
    bf16(p + "post_attention_layernorm.weight", {8});
    for (const auto& [proj, dims] : projections()) {
      const std::string w = p + proj + ".weight";
      t[w] = {w, "F8_E4M3", dims, std::string(size_t(dims[0] * dims[1]), '\x38')};
      const std::string s = p + proj + ".weight_scale";
      std::vector<int64_t> shape = scale_shape == "channel"    ? std::vector<int64_t>{dims[0]}
                                   : scale_shape == "channel2" ? std::vector<int64_t>{dims[0], 1}
                                   : scale_shape == "tensor1"  ? std::vector<int64_t>{1}
                                                               : std::vector<int64_t>{};
      t[s] = f32(s, shape, 0.5f);
      if (input_scales) {
        const std::string is = p + proj + ".input_scale";
        t[is] = f32(is, {}, 0.25f);
      }
    }
  }
  return t;
}

StatusOr<LlamaWeights> load(const TempDir& dir, const ModelConfig& config,
                            const std::map<std::string, TestTensor>& tensors) {
  std::vector<TestTensor> list;
  for (const auto& [name, t] : tensors) list.push_back(t);
  write_file(dir.file("model.safetensors"), safetensors_bytes(list));
  auto reader = SafetensorsReader::open_dir(dir.path());
  if (!reader.ok()) return reader.status();
  return load_llama_weights(config, *reader);
}

TEST(LlamaWeightsFp8Test, LoadsEveryScaleShape) {
  for (const std::string shape : {"channel", "channel2", "tensor", "tensor1"}) {
    TempDir dir;
    const bool channel = shape.rfind("channel", 0) == 0;
    auto w = load(dir, fp8_config(Fp8ActivationScale::kDynamicPerToken, /*stated=*/false),
                  fp8_tensors(shape, /*input_scales=*/false));
    ASSERT_TRUE(w.ok()) << shape << ": " << w.status().ToString();
    EXPECT_TRUE(w->quant.weight_scale_stated);
    EXPECT_EQ(w->quant.weight_scale, channel ? Fp8WeightScale::kChannel : Fp8WeightScale::kTensor);
    const LlamaLayerWeights& l = w->layers[1];
    EXPECT_EQ(l.down_proj.dtype, DType::kF8E4M3);
    EXPECT_EQ(l.down_proj.nbytes, 96u);
    EXPECT_EQ(l.down_scale.weight_scale.name, "model.layers.1.mlp.down_proj.weight_scale");
    EXPECT_EQ(l.gate_scale.weight_scale.numel(), channel ? 12 : 1);
    EXPECT_EQ(l.q_scale.input_scale.data, nullptr);  // dynamic: no input scales
    EXPECT_EQ(w->lm_head.dtype, DType::kBF16);
  }
}

TEST(LlamaWeightsFp8Test, StaticActivationsNeedInputScales) {
  TempDir dir;
  const ModelConfig config = fp8_config(Fp8ActivationScale::kStaticPerTensor, true);
  auto tensors = fp8_tensors("channel", /*input_scales=*/true);
  auto w = load(dir, config, tensors);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  std::vector<float> s(1);
  to_float(w->layers[0].v_scale.input_scale, s.data());
  EXPECT_EQ(s[0], 0.25f);

  tensors.erase("model.layers.1.self_attn.o_proj.input_scale");
  EXPECT_TRUE(status_is(load(dir, config, tensors).status(), StatusCode::kNotFound,
                        {"'model.layers.1.self_attn.o_proj.input_scale'",
                         dir.file("model.safetensors"), "static activation scales"}));
  tensors = fp8_tensors("channel", true);
  tensors["model.layers.0.mlp.up_proj.input_scale"] =
      f32("model.layers.0.mlp.up_proj.input_scale", {2}, 0.25f);
  EXPECT_TRUE(
      status_is(load(dir, config, tensors).status(), StatusCode::kInvalidArgument,
                {"'model.layers.0.mlp.up_proj.input_scale'", "shape [2]", "expected [] or [1]"}));
  tensors = fp8_tensors("channel", true);
  tensors["model.layers.0.mlp.up_proj.input_scale"] =
      f32("model.layers.0.mlp.up_proj.input_scale", {}, 0.0f);
  EXPECT_TRUE(status_is(load(dir, config, tensors).status(), StatusCode::kInvalidArgument,
                        {"'model.layers.0.mlp.up_proj.input_scale'", "positive finite"}));
}

TEST(LlamaWeightsFp8Test, BrokenCheckpointsNameTheTensorAndFile) {
  const ModelConfig dynamic = fp8_config(Fp8ActivationScale::kDynamicPerToken, false);
  const std::string file_hint = "model.safetensors";
  struct Case {
    std::string what;
    std::function<void(std::map<std::string, TestTensor>*)> edit;
    StatusCode code;
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {"missing weight_scale",
       [](auto* t) { t->erase("model.layers.0.mlp.gate_proj.weight_scale"); },
       StatusCode::kNotFound,
       {"'model.layers.0.mlp.gate_proj.weight_scale'", "weight_scale beside each e4m3 weight"}},
      {"16-bit weight in an FP8 checkpoint",
       [](auto* t) {
         (*t)["model.layers.1.self_attn.k_proj.weight"] = {
             "model.layers.1.self_attn.k_proj.weight", "BF16", {4, 8}, std::string(64, '\0')};
       },
       StatusCode::kInvalidArgument,
       {"'model.layers.1.self_attn.k_proj.weight'", "is BF16, expected F8_E4M3",
        "quantization_config (test)"}},
      {"e4m3 lm_head",
       [](auto* t) {
         (*t)["lm_head.weight"] = {"lm_head.weight", "F8_E4M3", {16, 8}, std::string(128, '\0')};
       },
       StatusCode::kInvalidArgument,
       {"'lm_head.weight'", "F8_E4M3", "lm_head 16-bit"}},
      {"scale of the wrong shape",
       [](auto* t) {
         (*t)["model.layers.0.mlp.down_proj.weight_scale"] =
             f32("model.layers.0.mlp.down_proj.weight_scale", {12}, 0.5f);
       },
       StatusCode::kInvalidArgument,
       {"'model.layers.0.mlp.down_proj.weight_scale'", "shape [12]",
        "expected [] or [1] (per tensor) or [8] or [8, 1] (per channel)"}},
      {"mixed granularity",
       [](auto* t) {
         (*t)["model.layers.1.mlp.up_proj.weight_scale"] =
             f32("model.layers.1.mlp.up_proj.weight_scale", {}, 0.5f);
       },
       StatusCode::kInvalidArgument,
       {"'model.layers.1.mlp.up_proj.weight_scale'", "per tensor",
        "'model.layers.0.self_attn.q_proj.weight_scale' is per channel"}},
      {"scale of an e4m3 dtype",
       [](auto* t) {
         (*t)["model.layers.0.self_attn.v_proj.weight_scale"] = {
             "model.layers.0.self_attn.v_proj.weight_scale", "F8_E4M3", {4}, "\x38\x38\x38\x38"};
       },
       StatusCode::kInvalidArgument,
       {"'model.layers.0.self_attn.v_proj.weight_scale'", "is F8_E4M3", "expected F32"}},
      {"negative scale",
       [](auto* t) {
         (*t)["model.layers.0.self_attn.v_proj.weight_scale"] =
             f32("model.layers.0.self_attn.v_proj.weight_scale", {4}, -1.0f);
       },
       StatusCode::kInvalidArgument,
       {"'model.layers.0.self_attn.v_proj.weight_scale'", "positive finite"}},
  };
  for (const Case& k : cases) {
    TempDir dir;
    auto tensors = fp8_tensors("channel", false);
    k.edit(&tensors);
    std::vector<std::string> fragments = k.fragments;
    fragments.push_back(dir.file(file_hint));
    EXPECT_TRUE(status_is(load(dir, dynamic, tensors).status(), k.code, fragments)) << k.what;
  }
}

TEST(LlamaWeightsFp8Test, GranularityMustMatchTheConfigs) {
  TempDir dir;
  const ModelConfig per_tensor =
      fp8_config(Fp8ActivationScale::kStaticPerTensor, /*stated=*/true, Fp8WeightScale::kTensor);
  EXPECT_TRUE(load(dir, per_tensor, fp8_tensors("tensor1", true)).ok());
  EXPECT_TRUE(status_is(
      load(dir, per_tensor, fp8_tensors("channel", true)).status(), StatusCode::kInvalidArgument,
      {"'model.layers.0.self_attn.q_proj.weight_scale'", "shape [8] (per channel)",
       "expected [] or [1] (per tensor)", "says the weight scales are per tensor"}));
  const ModelConfig per_channel = fp8_config(Fp8ActivationScale::kDynamicPerToken, true);
  EXPECT_TRUE(status_is(load(dir, per_channel, fp8_tensors("tensor", false)).status(),
                        StatusCode::kInvalidArgument,
                        {"shape [] (per tensor)", "expected [8] or [8, 1] (per channel)"}));
}

TEST(LlamaWeightsFp8Test, E4m3WeightsNeedAnFp8Config) {
  TempDir dir;
  ModelConfig sixteen = fp8_config(Fp8ActivationScale::kDynamicPerToken, false);
  sixteen.quant = QuantConfig{};
  EXPECT_TRUE(status_is(load(dir, sixteen, fp8_tensors("channel", false)).status(),
                        StatusCode::kInvalidArgument,
                        {"'model.layers.0.self_attn.q_proj.weight'", "F8_E4M3",
                         "no FP8 quantization_config", dir.file("model.safetensors")}));
  // --quantization fp8 (not prequantized) reads 16-bit weights only, as a 16-bit model.
  sixteen.quant.scheme = QuantScheme::kFp8;
  sixteen.quant.source = "--quantization fp8";
  EXPECT_TRUE(status_is(load(dir, sixteen, fp8_tensors("channel", false)).status(),
                        StatusCode::kInvalidArgument, {"F8_E4M3", "no FP8 quantization_config"}));
}

}  // namespace
}  // namespace treeserve
