// Finds and shape-checks the tensors of a Llama checkpoint (models/llama_weights.h).
#include "models/llama_weights.h"

#include <string>

namespace treeserve {
namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  TensorView v;
  v.shape = shape;
  return v.shape_string();
}

Status fetch(const SafetensorsReader& reader, const std::string& name,
             const std::vector<int64_t>& expected, TensorView* out) {
  StatusOr<TensorView> view = reader.tensor(name);
  if (!view.ok()) return view.status();
  if (view->shape != expected) {
    return InvalidArgument(view->file + ": tensor '" + name + "' has shape " +
                           view->shape_string() + ", expected " + shape_string(expected) +
                           " from config.json");
  }
  *out = std::move(*view);
  return Status::Ok();
}

}  // namespace

StatusOr<LlamaWeights> load_llama_weights(const ModelConfig& c, const SafetensorsReader& reader) {
  LlamaWeights w{TensorView{}, {}, TensorView{}, TensorView{}, reader};
  const int64_t hidden = c.hidden_size;
  TS_RETURN_IF_ERROR(
      fetch(reader, "model.embed_tokens.weight", {c.vocab_size, hidden}, &w.embed_tokens));
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LlamaLayerWeights& l = w.layers[static_cast<size_t>(i)];
    TS_RETURN_IF_ERROR(fetch(reader, p + "input_layernorm.weight", {hidden}, &l.input_layernorm));
    TS_RETURN_IF_ERROR(
        fetch(reader, p + "self_attn.q_proj.weight", {c.q_size(), hidden}, &l.q_proj));
    TS_RETURN_IF_ERROR(
        fetch(reader, p + "self_attn.k_proj.weight", {c.kv_size(), hidden}, &l.k_proj));
    TS_RETURN_IF_ERROR(
        fetch(reader, p + "self_attn.v_proj.weight", {c.kv_size(), hidden}, &l.v_proj));
    TS_RETURN_IF_ERROR(
        fetch(reader, p + "self_attn.o_proj.weight", {hidden, c.q_size()}, &l.o_proj));
    TS_RETURN_IF_ERROR(fetch(reader, p + "post_attention_layernorm.weight", {hidden},
                             &l.post_attention_layernorm));
    TS_RETURN_IF_ERROR(
        fetch(reader, p + "mlp.gate_proj.weight", {c.intermediate_size, hidden}, &l.gate_proj));
    TS_RETURN_IF_ERROR(
        fetch(reader, p + "mlp.up_proj.weight", {c.intermediate_size, hidden}, &l.up_proj));
    TS_RETURN_IF_ERROR(
        fetch(reader, p + "mlp.down_proj.weight", {hidden, c.intermediate_size}, &l.down_proj));
  }
  TS_RETURN_IF_ERROR(fetch(reader, "model.norm.weight", {hidden}, &w.norm));
  if (c.tie_word_embeddings) {
    // HF ties lm_head to embed_tokens and ignores any saved lm_head.weight.
    w.lm_head = w.embed_tokens;
  } else {
    TS_RETURN_IF_ERROR(fetch(reader, "lm_head.weight", {c.vocab_size, hidden}, &w.lm_head));
  }
  return w;
}

}  // namespace treeserve
