// FP8 checkpoints of the tiny model in every layout treeserve reads, written by
// tests/models/make_fp8_checkpoint.py at build time (its own e4m3 conversion), through the real
// loader (load_model_config, load_llama_weights) and the CPU backend's FP8 emulation:
// - the generator's bytes and scales equal models/fp8.h's quantize_fp8_rows / _tensor of the
//   source weights bit for bit (two independent implementations of the rule);
// - each layout's logits are close to the float32 model's;
// - the fp8 layout per channel with dynamic activations and --quantization fp8 on the source
//   checkpoint give bit-identical logits (the same rule, the same emulation);
// - the emulation quantizes activations (logits differ from the dequantized weights run in
//   float32) and keeps a row's logits independent of the rest of the batch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/cpu_ops.h"
#include "models/fp8.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "tests/engine/engine_test_util.h"
#include "tests/models/test_util.h"

namespace treeserve {
namespace {

using testing::TreeDriver;

const std::string kModels = TREESERVE_FP8_MODELS_DIR;

struct Loaded {
  ModelConfig config;
  LlamaWeights weights;
};

// Loads a model dir (config and weights); `quantization` is applied as --quantization.
std::unique_ptr<Loaded> load(const std::string& dir, const std::string& quantization = "auto") {
  StatusOr<ModelConfig> config = load_model_config(dir);
  EXPECT_TRUE(config.ok()) << dir << ": " << config.status().ToString();
  if (!config.ok()) return nullptr;
  Status s = apply_quantization_option(quantization, "--quantization", &*config);
  EXPECT_TRUE(s.ok()) << s.ToString();
  SafetensorsOptions options;
  options.progress = false;
  StatusOr<SafetensorsReader> reader = SafetensorsReader::open_dir(dir, options);
  EXPECT_TRUE(reader.ok()) << reader.status().ToString();
  if (!reader.ok()) return nullptr;
  StatusOr<LlamaWeights> weights = load_llama_weights(*config, *reader);
  EXPECT_TRUE(weights.ok()) << dir << ": " << weights.status().ToString();
  if (!weights.ok()) return nullptr;
  return std::unique_ptr<Loaded>(new Loaded{*config, std::move(weights).value()});
}

constexpr int32_t kPage = 8, kPages = 64;

// The logits of every position of `prompt` (one prefill step) on the CPU backend.
std::vector<float> prompt_logits(const ModelConfig& config, const LlamaWeights& weights,
                                 const std::vector<int32_t>& prompt) {
  CpuBackendOptions options;
  options.page_size = kPage;
  options.num_pages = kPages;
  options.num_threads = 2;
  auto backend = create_cpu_backend(config, weights, options);
  EXPECT_TRUE(backend.ok()) << backend.status().ToString();
  if (!backend.ok()) return {};
  TreeDriver driver(backend->get(), kPage, kPages);
  const BranchId b = driver.start(prompt);
  Logits out;
  Status s = driver.step(std::vector<BranchId>{b}, /*all_logits=*/true, &out);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out.data;
}

std::vector<int32_t> prompt() { return testing::test_tokens(24, 11, 512); }

struct Layout {
  const char* dir;
  Fp8WeightScale weights;
  Fp8ActivationScale activations;
  const char* source;
};

const Layout kLayouts[] = {
    {"fp8-channel-dynamic", Fp8WeightScale::kChannel, Fp8ActivationScale::kDynamicPerToken,
     "config.json quantization_config (fp8)"},
    {"fp8-tensor-static", Fp8WeightScale::kTensor, Fp8ActivationScale::kStaticPerTensor,
     "config.json quantization_config (fp8)"},
    {"ct-channel-token", Fp8WeightScale::kChannel, Fp8ActivationScale::kDynamicPerToken,
     "config.json quantization_config (compressed-tensors)"},
    {"ct-tensor-tensor", Fp8WeightScale::kTensor, Fp8ActivationScale::kStaticPerTensor,
     "config.json quantization_config (compressed-tensors)"},
};

TEST(Fp8CheckpointTest, GeneratorBytesEqualTheRule) {
  auto source = load(TREESERVE_TINY_MODEL_DIR);
  ASSERT_NE(source, nullptr);
  for (const char* dir : {"fp8-channel-dynamic", "fp8-tensor-static"}) {
    auto fp8 = load(kModels + "/" + dir);
    ASSERT_NE(fp8, nullptr);
    const bool channel = fp8->weights.quant.weight_scale == Fp8WeightScale::kChannel;
    for (size_t l = 0; l < source->weights.layers.size(); ++l) {
      const LlamaLayerWeights& s = source->weights.layers[l];
      const LlamaLayerWeights& q = fp8->weights.layers[l];
      const std::pair<const TensorView*, const Fp8Scales*> pairs[][2] = {
          {{&s.q_proj, nullptr}, {&q.q_proj, &q.q_scale}},
          {{&s.k_proj, nullptr}, {&q.k_proj, &q.k_scale}},
          {{&s.o_proj, nullptr}, {&q.o_proj, &q.o_scale}},
          {{&s.down_proj, nullptr}, {&q.down_proj, &q.down_scale}}};
      for (const auto& p : pairs) {
        const TensorView& src = *p[0].first;
        const TensorView& got = *p[1].first;
        const int64_t rows = src.shape[0], cols = src.shape[1];
        std::vector<float> w(size_t(rows * cols));
        to_float(src, w.data());
        std::vector<uint8_t> want(w.size());
        std::vector<float> want_scale(size_t(channel ? rows : 1));
        if (channel) {
          quantize_fp8_rows(w.data(), rows, cols, want.data(), want_scale.data());
        } else {
          quantize_fp8_tensor(w.data(), rows * cols, want.data(), want_scale.data());
        }
        ASSERT_EQ(got.dtype, DType::kF8E4M3);
        ASSERT_EQ(got.nbytes, want.size());
        EXPECT_EQ(std::memcmp(got.data, want.data(), want.size()), 0) << dir << " " << got.name;
        std::vector<float> got_scale(size_t(p[1].second->weight_scale.numel()));
        to_float(p[1].second->weight_scale, got_scale.data());
        ASSERT_EQ(got_scale.size(), want_scale.size()) << got.name;
        EXPECT_EQ(std::memcmp(got_scale.data(), want_scale.data(), 4 * want_scale.size()), 0)
            << dir << " " << got.name;
      }
    }
  }
}

TEST(Fp8CheckpointTest, EveryLayoutLoadsAndStaysCloseToFloat32) {
  auto source = load(TREESERVE_TINY_MODEL_DIR);
  ASSERT_NE(source, nullptr);
  const std::vector<int32_t> tokens = prompt();
  const std::vector<float> reference = prompt_logits(source->config, source->weights, tokens);
  ASSERT_FALSE(reference.empty());
  const int64_t vocab = source->config.vocab_size;
  for (const Layout& layout : kLayouts) {
    SCOPED_TRACE(layout.dir);
    auto m = load(kModels + "/" + layout.dir);
    ASSERT_NE(m, nullptr);
    EXPECT_EQ(m->config.quant.scheme, QuantScheme::kFp8);
    EXPECT_TRUE(m->config.quant.prequantized);
    EXPECT_EQ(m->config.quant.activation_scale, layout.activations);
    EXPECT_EQ(m->config.quant.source, layout.source);
    EXPECT_EQ(m->weights.quant.weight_scale, layout.weights);
    const std::vector<float> got = prompt_logits(m->config, m->weights, tokens);
    ASSERT_EQ(got.size(), reference.size());
    double err = 0.0, norm = 0.0;
    int32_t same_argmax = 0;
    for (size_t r = 0; r < tokens.size(); ++r) {
      const float* a = got.data() + r * size_t(vocab);
      const float* b = reference.data() + r * size_t(vocab);
      int64_t arg_a = 0, arg_b = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        err += double(a[v] - b[v]) * double(a[v] - b[v]);
        norm += double(b[v]) * double(b[v]);
        if (a[v] > a[arg_a]) arg_a = v;
        if (b[v] > b[arg_b]) arg_b = v;
      }
      same_argmax += arg_a == arg_b;
    }
    // About 6% from the weights' 3 mantissa bits and as much again from the activations' on
    // this random-weight model (~8% together).
    const double relative = std::sqrt(err / norm);
    EXPECT_LT(relative, 0.12) << "relative RMS logit error";
    EXPECT_GT(relative, 1e-4) << "FP8 should not be exact";
    EXPECT_GE(same_argmax, int32_t(tokens.size()) * 2 / 3);
    EXPECT_LT(testing::max_abs_diff(got.data(), reference.data(), int64_t(got.size())), 1.5f);
  }
}

TEST(Fp8CheckpointTest, QuantizationFlagEqualsTheCheckpointBitForBit) {
  auto flag = load(TREESERVE_TINY_MODEL_DIR, "fp8");
  auto ckpt = load(kModels + "/fp8-channel-dynamic", "fp8");
  ASSERT_NE(flag, nullptr);
  ASSERT_NE(ckpt, nullptr);
  EXPECT_FALSE(flag->config.quant.prequantized);
  EXPECT_EQ(flag->config.quant.source, "--quantization fp8");
  EXPECT_TRUE(ckpt->config.quant.prequantized);  // fp8 on an FP8 checkpoint: as it is
  const std::vector<int32_t> tokens = prompt();
  const std::vector<float> a = prompt_logits(flag->config, flag->weights, tokens);
  const std::vector<float> b = prompt_logits(ckpt->config, ckpt->weights, tokens);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  // And both differ from the float32 model.
  auto source = load(TREESERVE_TINY_MODEL_DIR);
  const std::vector<float> f32 = prompt_logits(source->config, source->weights, tokens);
  EXPECT_NE(std::memcmp(a.data(), f32.data(), a.size() * sizeof(float)), 0);
}

// The checkpoint's weights dequantized into a float32 copy: the FP8 run differs from it only by
// the activations' quantization, which must therefore be there.
TEST(Fp8CheckpointTest, ActivationsAreQuantized) {
  for (const char* dir : {"fp8-channel-dynamic", "fp8-tensor-static"}) {
    SCOPED_TRACE(dir);
    auto m = load(kModels + "/" + dir);
    ASSERT_NE(m, nullptr);
    std::vector<testing::TestTensor> tensors;
    auto add = [&](const TensorView& t, const Fp8Scales* scales) {
      std::vector<float> v(size_t(t.numel()));
      to_float(t, v.data());
      if (scales != nullptr) {
        std::vector<float> s(size_t(scales->weight_scale.numel()));
        to_float(scales->weight_scale, s.data());
        const int64_t cols = t.shape[1];
        for (size_t i = 0; i < v.size(); ++i) v[i] *= s.size() == 1 ? s[0] : s[i / size_t(cols)];
      }
      tensors.push_back({t.name, "F32", t.shape, testing::raw_bytes(v)});
    };
    add(m->weights.embed_tokens, nullptr);
    add(m->weights.norm, nullptr);
    add(m->weights.lm_head, nullptr);
    for (const LlamaLayerWeights& l : m->weights.layers) {
      add(l.input_layernorm, nullptr);
      add(l.post_attention_layernorm, nullptr);
      add(l.q_proj, &l.q_scale);
      add(l.k_proj, &l.k_scale);
      add(l.v_proj, &l.v_scale);
      add(l.o_proj, &l.o_scale);
      add(l.gate_proj, &l.gate_scale);
      add(l.up_proj, &l.up_scale);
      add(l.down_proj, &l.down_scale);
    }
    testing::TempDir tmp;
    testing::write_file(tmp.file("model.safetensors"), testing::safetensors_bytes(tensors));
    auto reader = SafetensorsReader::open_dir(tmp.path());
    ASSERT_TRUE(reader.ok()) << reader.status().ToString();
    ModelConfig dense = m->config;
    dense.quant = QuantConfig{};
    auto weights = load_llama_weights(dense, *reader);
    ASSERT_TRUE(weights.ok()) << weights.status().ToString();
    const std::vector<int32_t> tokens = prompt();
    const std::vector<float> fp8 = prompt_logits(m->config, m->weights, tokens);
    const std::vector<float> dequantized = prompt_logits(dense, *weights, tokens);
    ASSERT_EQ(fp8.size(), dequantized.size());
    const float diff = testing::max_abs_diff(fp8.data(), dequantized.data(), int64_t(fp8.size()));
    EXPECT_GT(diff, 1e-3f);
    EXPECT_LT(diff, 1.5f);
  }
}

// Dynamic per-token scales keep each row's logits independent of the batch: a sequence alone
// and the same sequence beside another give the same bits.
TEST(Fp8CheckpointTest, DynamicActivationsAreBatchInvariant) {
  auto m = load(TREESERVE_TINY_MODEL_DIR, "fp8");
  ASSERT_NE(m, nullptr);
  CpuBackendOptions options;
  options.page_size = kPage;
  options.num_pages = kPages;
  options.num_threads = 2;
  const std::vector<int32_t> a = prompt(), b = testing::test_tokens(17, 3, 512);
  auto alone = create_cpu_backend(m->config, m->weights, options);
  auto both = create_cpu_backend(m->config, m->weights, options);
  ASSERT_TRUE(alone.ok() && both.ok());
  TreeDriver d1(alone->get(), kPage, kPages), d2(both->get(), kPage, kPages);
  Logits x, y;
  const BranchId a1 = d1.start(a);
  ASSERT_TRUE(d1.step(std::vector<BranchId>{a1}, true, &x).ok());
  const BranchId b2 = d2.start(b);
  const BranchId a2 = d2.start(a);
  ASSERT_TRUE(d2.step(std::vector<BranchId>{b2, a2}, true, &y).ok());
  const size_t n = a.size() * 512;
  ASSERT_EQ(y.data.size(), n + b.size() * 512);
  EXPECT_EQ(std::memcmp(x.data.data(), y.data.data() + b.size() * 512, n * sizeof(float)), 0);
}

// fp8_fake_quantize_rows / _static: e4m3 of x / scale, dequantized, with scale the row's
// amax / 448 or the given static scale.
TEST(Fp8CheckpointTest, FakeQuantizationOfInputs) {
  const std::vector<float> x = {0.5f, -3.0f, 1e-6f, 2.0f, 0.0f, 0.0f, 0.0f, -0.0f};
  std::vector<float> out(x.size());
  fp8_fake_quantize_rows(x.data(), 2, 4, out.data());
  const float s0 = 3.0f / 448.0f;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(out[size_t(i)], e4m3_to_float(float_to_e4m3(x[size_t(i)] / s0)) * s0) << i;
  }
  EXPECT_FLOAT_EQ(out[1], -3.0f);                               // the amax maps to -448 * scale
  for (int i = 4; i < 8; ++i) EXPECT_EQ(out[size_t(i)], 0.0f);  // a zero row: scale 1
  fp8_fake_quantize_static(x.data(), 4, 0.25f, out.data());
  EXPECT_EQ(out[0], 0.5f);
  EXPECT_EQ(out[1], -3.0f);
  EXPECT_EQ(out[2], 0.0f);  // far below the smallest subnormal of 0.25 * 2^-9
  EXPECT_EQ(out[3], 2.0f);
  fp8_fake_quantize_static(x.data(), 2, std::ldexp(1.0f, -8), out.data());
  EXPECT_EQ(out[1], -1.75f);  // -768 saturates at -448: -448 * 2^-8
}

// Random weights under FP8 quantize per channel with dynamic activations (CPU backend).
TEST(Fp8CheckpointTest, RandomWeightsRunQuantized) {
  auto m = load(TREESERVE_TINY_MODEL_DIR);
  ASSERT_NE(m, nullptr);
  ModelConfig fp8 = m->config;
  ASSERT_TRUE(apply_quantization_option("fp8", "--quantization", &fp8).ok());
  CpuBackendOptions options;
  options.page_size = kPage;
  options.num_pages = kPages;
  options.num_threads = 2;
  auto dense = create_cpu_backend_random(m->config, options, 7);
  auto quantized = create_cpu_backend_random(fp8, options, 7);
  ASSERT_TRUE(dense.ok() && quantized.ok());
  TreeDriver d1(dense->get(), kPage, kPages), d2(quantized->get(), kPage, kPages);
  Logits x, y;
  const std::vector<int32_t> tokens = prompt();
  ASSERT_TRUE(d1.step(std::vector<BranchId>{d1.start(tokens)}, true, &x).ok());
  ASSERT_TRUE(d2.step(std::vector<BranchId>{d2.start(tokens)}, true, &y).ok());
  ASSERT_EQ(x.data.size(), y.data.size());
  const float diff = testing::max_abs_diff(x.data.data(), y.data.data(), int64_t(x.data.size()));
  EXPECT_GT(diff, 0.0f);
  EXPECT_LT(diff, 1.0f);
}

}  // namespace
}  // namespace treeserve
