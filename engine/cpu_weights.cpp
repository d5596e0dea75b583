// Float32 conversion and Q/K/V, gate/up fusion of the checkpoint's tensors; FP8 weights
// dequantized (or 16-bit ones quantized and dequantized) for the CPU backend's emulation.
#include "engine/cpu_weights.h"

#include <algorithm>
#include <cmath>
#include <new>
#include <string>

#include "models/fp8.h"

namespace treeserve {
namespace {

Status check_shape(const TensorView& t, std::initializer_list<int64_t> want) {
  std::vector<int64_t> w(want);
  if (t.shape != w || t.data == nullptr) {
    std::string ws = "[";
    for (size_t i = 0; i < w.size(); ++i) ws += (i ? ", " : "") + std::to_string(w[i]);
    return InvalidArgument("tensor '" + t.name + "' has shape " + t.shape_string() + ", expected " +
                           ws + "]");
  }
  return Status::Ok();
}

// Appends the converted tensor to *dst (so fused matrices are built by appending rows).
void append_f32(const TensorView& t, std::vector<float>* dst) {
  const size_t old = dst->size();
  dst->resize(old + size_t(t.numel()));
  to_float(t, dst->data() + old);
}

// w [rows][cols] (float(q) values) times the weight scale: one for the matrix or one per row.
void scale_rows(float* w, int64_t rows, int64_t cols, const std::vector<float>& scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const float s = scale.size() == 1 ? scale[0] : scale[size_t(r)];
    for (int64_t c = 0; c < cols; ++c) w[r * cols + c] *= s;
  }
}

// FP8 from float32 weights: quantized per row by models/fp8.h's rule, then dequantized.
void fake_quantize_rows(float* w, int64_t rows, int64_t cols) {
  std::vector<uint8_t> q(size_t(rows * cols));
  std::vector<float> scale(static_cast<size_t>(rows));
  quantize_fp8_rows(w, rows, cols, q.data(), scale.data());
  for (int64_t i = 0; i < rows * cols; ++i) w[i] = e4m3_to_float(q[size_t(i)]);
  scale_rows(w, rows, cols, scale);
}

// Appends one projection as float32 rows: as it is, or under FP8 dequantized (float(q) *
// weight_scale of the row) from the checkpoint's e4m3 weight, or quantized and dequantized
// from a 16-bit one. *input_scale becomes the largest static input scale seen.
Status append_linear(const ModelConfig& c, const TensorView& w, const Fp8Scales& scales,
                     std::vector<float>* dst, float* input_scale) {
  const int64_t rows = w.shape[0], cols = w.shape[1];
  const size_t old = dst->size();
  dst->resize(old + size_t(rows * cols));
  float* out = dst->data() + old;
  const bool fp8 = c.quant.scheme == QuantScheme::kFp8;
  const bool e4m3 = fp8 && c.quant.prequantized;
  if ((w.dtype == DType::kF8E4M3) != e4m3) {
    return InvalidArgument("tensor '" + w.name + "' is " + dtype_name(w.dtype) +
                           (e4m3 ? ", expected F8_E4M3 (an FP8 checkpoint)"
                                 : ", expected F32, F16 or BF16 (the config names no FP8 "
                                   "checkpoint)"));
  }
  to_float(w, out);
  if (!fp8) return Status::Ok();
  if (!c.quant.prequantized) {
    fake_quantize_rows(out, rows, cols);
    return Status::Ok();
  }
  StatusOr<std::vector<float>> scale = fp8_row_scales(scales, rows);
  if (!scale.ok()) return scale.status();
  scale_rows(out, rows, cols, *scale);
  if (c.quant.activation_scale == Fp8ActivationScale::kStaticPerTensor) {
    StatusOr<float> s = fp8_input_scale(scales);
    if (!s.ok()) return s.status();
    *input_scale = std::max(*input_scale, *s);
  }
  return Status::Ok();
}

Status convert_layer(const ModelConfig& c, const LlamaLayerWeights& w, CpuLayerWeights* out) {
  const int64_t h = c.hidden_size, q = c.q_size(), kv = c.kv_size(), im = c.intermediate_size;
  TS_RETURN_IF_ERROR(check_shape(w.input_layernorm, {h}));
  TS_RETURN_IF_ERROR(check_shape(w.q_proj, {q, h}));
  TS_RETURN_IF_ERROR(check_shape(w.k_proj, {kv, h}));
  TS_RETURN_IF_ERROR(check_shape(w.v_proj, {kv, h}));
  TS_RETURN_IF_ERROR(check_shape(w.o_proj, {h, q}));
  TS_RETURN_IF_ERROR(check_shape(w.post_attention_layernorm, {h}));
  TS_RETURN_IF_ERROR(check_shape(w.gate_proj, {im, h}));
  TS_RETURN_IF_ERROR(check_shape(w.up_proj, {im, h}));
  TS_RETURN_IF_ERROR(check_shape(w.down_proj, {h, im}));
  append_f32(w.input_layernorm, &out->input_norm);
  out->qkv.reserve(size_t((q + 2 * kv) * h));
  TS_RETURN_IF_ERROR(append_linear(c, w.q_proj, w.q_scale, &out->qkv, &out->qkv_input_scale));
  TS_RETURN_IF_ERROR(append_linear(c, w.k_proj, w.k_scale, &out->qkv, &out->qkv_input_scale));
  TS_RETURN_IF_ERROR(append_linear(c, w.v_proj, w.v_scale, &out->qkv, &out->qkv_input_scale));
  TS_RETURN_IF_ERROR(append_linear(c, w.o_proj, w.o_scale, &out->o, &out->o_input_scale));
  append_f32(w.post_attention_layernorm, &out->post_norm);
  out->gate_up.reserve(size_t(2 * im * h));
  TS_RETURN_IF_ERROR(
      append_linear(c, w.gate_proj, w.gate_scale, &out->gate_up, &out->gate_up_input_scale));
  TS_RETURN_IF_ERROR(
      append_linear(c, w.up_proj, w.up_scale, &out->gate_up, &out->gate_up_input_scale));
  TS_RETURN_IF_ERROR(
      append_linear(c, w.down_proj, w.down_scale, &out->down, &out->down_input_scale));
  return Status::Ok();
}

// cuda_ops.cu's fill_random, element for element: u from the top 24 bits of a splitmix64
// finaliser of seed * golden + index, value offset + scale * (2u - 1) in float.
uint64_t fill_mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void fill_random(std::vector<float>* dst, int64_t n, uint64_t seed, float scale, float offset) {
  dst->resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = fill_mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
    const float u = float(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    (*dst)[size_t(i)] = offset + scale * (2.0f * u - 1.0f);
  }
}

}  // namespace

StatusOr<CpuModelWeights> random_cpu_weights(const ModelConfig& config, uint64_t seed) {
  const int64_t h = config.hidden_size, q = config.q_size(), kv = config.kv_size();
  const int64_t im = config.intermediate_size, v = config.vocab_size;
  // The order and seeds of CudaBackend::randomize: one seed per matrix, in this order.
  auto mat = [&](std::vector<float>* p, int64_t n, int64_t fan_in) {
    fill_random(p, n, seed++, float(1.0 / std::sqrt(double(fan_in))), 0.0f);
  };
  auto ones = [](std::vector<float>* p, int64_t n) { p->assign(size_t(n), 1.0f); };
  CpuModelWeights out;
  try {
    mat(&out.embed, v * h, 1);
    out.layers.resize(size_t(config.num_hidden_layers));
    for (CpuLayerWeights& l : out.layers) {
      ones(&l.input_norm, h);
      mat(&l.qkv, (q + 2 * kv) * h, h);
      mat(&l.o, h * q, q);
      ones(&l.post_norm, h);
      mat(&l.gate_up, 2 * im * h, h);
      mat(&l.down, h * im, im);
    }
    ones(&out.norm, h);
    if (!config.tie_word_embeddings) mat(&out.lm_head, v * h, h);
    if (config.quant.scheme == QuantScheme::kFp8) {
      out.fp8 = true;
      for (CpuLayerWeights& l : out.layers) {
        fake_quantize_rows(l.qkv.data(), q + 2 * kv, h);
        fake_quantize_rows(l.o.data(), h, q);
        fake_quantize_rows(l.gate_up.data(), 2 * im, h);
        fake_quantize_rows(l.down.data(), h, im);
      }
    }
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("not enough host memory for the float32 random weights");
  }
  return out;
}

StatusOr<CpuModelWeights> convert_weights_to_f32(const ModelConfig& config,
                                                 const LlamaWeights& weights) {
  if (int64_t(weights.layers.size()) != config.num_hidden_layers) {
    return InvalidArgument(
        "weights have " + std::to_string(weights.layers.size()) +
        " layers, config.num_hidden_layers = " + std::to_string(config.num_hidden_layers));
  }
  const int64_t h = config.hidden_size, vocab = config.vocab_size;
  TS_RETURN_IF_ERROR(check_shape(weights.embed_tokens, {vocab, h}));
  TS_RETURN_IF_ERROR(check_shape(weights.norm, {h}));
  TS_RETURN_IF_ERROR(check_shape(weights.lm_head, {vocab, h}));
  CpuModelWeights out;
  out.fp8 = config.quant.scheme == QuantScheme::kFp8;
  out.fp8_static = out.fp8 && config.quant.prequantized &&
                   config.quant.activation_scale == Fp8ActivationScale::kStaticPerTensor;
  try {
    append_f32(weights.embed_tokens, &out.embed);
    append_f32(weights.norm, &out.norm);
    // Tied heads share the embedding's memory (the view points at the same bytes).
    if (weights.lm_head.data != weights.embed_tokens.data)
      append_f32(weights.lm_head, &out.lm_head);
    out.layers.resize(weights.layers.size());
    for (size_t l = 0; l < weights.layers.size(); ++l) {
      TS_RETURN_IF_ERROR(convert_layer(config, weights.layers[l], &out.layers[l]));
    }
  } catch (const std::bad_alloc&) {
    return ResourceExhausted("not enough host memory for the float32 weights");
  }
  return out;
}

}  // namespace treeserve
