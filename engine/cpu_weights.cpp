// Float32 conversion and Q/K/V, gate/up fusion of the checkpoint's tensors.
#include "engine/cpu_weights.h"

#include <new>
#include <string>

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
  append_f32(w.q_proj, &out->qkv);
  append_f32(w.k_proj, &out->qkv);
  append_f32(w.v_proj, &out->qkv);
  append_f32(w.o_proj, &out->o);
  append_f32(w.post_attention_layernorm, &out->post_norm);
  out->gate_up.reserve(size_t(2 * im * h));
  append_f32(w.gate_proj, &out->gate_up);
  append_f32(w.up_proj, &out->gate_up);
  append_f32(w.down_proj, &out->down);
  return Status::Ok();
}

}  // namespace

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
