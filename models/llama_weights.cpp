// Finds and shape-checks the tensors of a Llama checkpoint (models/llama_weights.h), and for
// FP8 checkpoints each projection's e4m3 weight and its scales.
#include "models/llama_weights.h"

#include <cmath>
#include <optional>
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

// A tensor that is never quantized (embeddings, norms, lm_head), or a projection of a
// checkpoint whose config names no FP8 scheme: F32, F16 or BF16.
Status fetch_unquantized(const ModelConfig& c, const SafetensorsReader& reader,
                         const std::string& name, const std::vector<int64_t>& expected,
                         TensorView* out) {
  TS_RETURN_IF_ERROR(fetch(reader, name, expected, out));
  if (out->dtype != DType::kF8E4M3) return Status::Ok();
  if (c.quant.prequantized) {
    return InvalidArgument(out->file + ": tensor '" + name +
                           "' is F8_E4M3, expected F32, F16 or BF16: treeserve keeps the "
                           "embeddings, the norms and lm_head 16-bit (an FP8 checkpoint's "
                           "quantization_config leaves lm_head out)");
  }
  return InvalidArgument(out->file + ": tensor '" + name +
                         "' is F8_E4M3, but config.json has no FP8 quantization_config (an FP8 "
                         "checkpoint names its scheme there: quant_method fp8 or "
                         "compressed-tensors)");
}

// A scale tensor's values as floats.
std::vector<float> scale_floats(const TensorView& t) {
  std::vector<float> v(size_t(t.numel()));
  if (!v.empty()) to_float(t, v.data());
  return v;
}

// A scale tensor: F32, BF16 or F16, every value positive and finite.
Status check_scale_values(const TensorView& t) {
  if (t.dtype != DType::kF32 && t.dtype != DType::kBF16 && t.dtype != DType::kF16) {
    return InvalidArgument(t.file + ": tensor '" + t.name + "' is " + dtype_name(t.dtype) +
                           ", expected F32 (or BF16 / F16) for a scale");
  }
  const std::vector<float> v = scale_floats(t);
  for (size_t i = 0; i < v.size(); ++i) {
    if (!(v[i] > 0.0f) || !std::isfinite(v[i])) {
      return InvalidArgument(t.file + ": tensor '" + t.name + "' holds " + std::to_string(v[i]) +
                             " at index " + std::to_string(i) +
                             "; a scale must be a positive finite number");
    }
  }
  return Status::Ok();
}

// reader.tensor(name), with `why` added to a NOT_FOUND message.
Status fetch_scale(const SafetensorsReader& reader, const std::string& name, const std::string& why,
                   TensorView* out) {
  StatusOr<TensorView> view = reader.tensor(name);
  if (view.status().code() == StatusCode::kNotFound) {
    return NotFound(view.status().message() + " (" + why + ")");
  }
  if (!view.ok()) return view.status();
  *out = std::move(*view);
  return check_scale_values(*out);
}

const char* granularity_name(Fp8WeightScale g) {
  return g == Fp8WeightScale::kChannel ? "per channel" : "per tensor";
}

// One projection of an FP8 checkpoint: <prefix>.weight F8_E4M3 [rows, cols], its weight_scale
// and, for static activation scales, its input_scale. *quant's weight_scale is the config's
// granularity when stated, else the first projection's, which every later one must share
// (*first names that projection's scale).
Status fetch_fp8_linear(const ModelConfig& c, const SafetensorsReader& reader,
                        const std::string& prefix, int64_t rows, int64_t cols, TensorView* weight,
                        Fp8Scales* scales, QuantConfig* quant, std::string* first) {
  TS_RETURN_IF_ERROR(fetch(reader, prefix + ".weight", {rows, cols}, weight));
  if (weight->dtype != DType::kF8E4M3) {
    return InvalidArgument(weight->file + ": tensor '" + weight->name + "' is " +
                           dtype_name(weight->dtype) + ", expected F8_E4M3: " + c.quant.source +
                           " says the checkpoint's linear layers are FP8");
  }
  TensorView& ws = scales->weight_scale;
  TS_RETURN_IF_ERROR(fetch_scale(reader, prefix + ".weight_scale",
                                 "an FP8 checkpoint has a weight_scale beside each e4m3 weight",
                                 &ws));
  const std::string per_tensor = "[] or [1] (per tensor)";
  const std::string per_channel =
      shape_string({rows}) + " or " + shape_string({rows, 1}) + " (per channel)";
  std::optional<Fp8WeightScale> got;
  if (ws.numel() == 1 && (ws.shape.empty() || ws.shape == std::vector<int64_t>{1})) {
    got = Fp8WeightScale::kTensor;
  } else if (ws.shape == std::vector<int64_t>{rows} || ws.shape == std::vector<int64_t>{rows, 1}) {
    got = Fp8WeightScale::kChannel;
  }
  if (!got) {
    return InvalidArgument(ws.file + ": tensor '" + ws.name + "' has shape " + ws.shape_string() +
                           ", expected " + per_tensor + " or " + per_channel);
  }
  if (quant->weight_scale_stated && *got != quant->weight_scale) {
    return InvalidArgument(
        ws.file + ": tensor '" + ws.name + "' has shape " + ws.shape_string() + " (" +
        granularity_name(*got) + "), expected " +
        (quant->weight_scale == Fp8WeightScale::kChannel ? per_channel : per_tensor) + ": " +
        c.quant.source + " says the weight scales are " + granularity_name(quant->weight_scale));
  }
  if (!quant->weight_scale_stated) {
    if (first->empty()) {
      quant->weight_scale = *got;
      *first = ws.name;
    } else if (*got != quant->weight_scale) {
      return InvalidArgument(ws.file + ": tensor '" + ws.name + "' has shape " + ws.shape_string() +
                             " (" + granularity_name(*got) + "), but '" + *first + "' is " +
                             granularity_name(quant->weight_scale) +
                             ": treeserve needs one granularity for every projection");
    }
  }
  if (c.quant.activation_scale != Fp8ActivationScale::kStaticPerTensor) return Status::Ok();
  TensorView& is = scales->input_scale;
  TS_RETURN_IF_ERROR(fetch_scale(reader, prefix + ".input_scale",
                                 "static activation scales: " + c.quant.source +
                                     " needs an input_scale beside each e4m3 weight",
                                 &is));
  if (is.numel() != 1 || is.shape.size() > 1) {
    return InvalidArgument(is.file + ": tensor '" + is.name + "' has shape " + is.shape_string() +
                           ", expected " + per_tensor);
  }
  return Status::Ok();
}

}  // namespace

StatusOr<std::vector<float>> fp8_row_scales(const Fp8Scales& scales, int64_t rows) {
  const TensorView& t = scales.weight_scale;
  std::vector<float> v = scale_floats(t);
  if (v.size() == 1) return std::vector<float>(size_t(rows), v[0]);
  if (int64_t(v.size()) != rows) {
    return InvalidArgument(t.file + ": tensor '" + t.name + "' has " + std::to_string(v.size()) +
                           " scales, expected 1 or " + std::to_string(rows));
  }
  return v;
}

StatusOr<float> fp8_input_scale(const Fp8Scales& scales) {
  const TensorView& t = scales.input_scale;
  const std::vector<float> v = scale_floats(t);
  if (v.size() != 1) {
    return InvalidArgument(t.file + ": tensor '" + t.name + "' must hold one input scale, has " +
                           std::to_string(v.size()));
  }
  return v[0];
}

StatusOr<LlamaWeights> load_llama_weights(const ModelConfig& c, const SafetensorsReader& reader) {
  LlamaWeights w{TensorView{}, {}, TensorView{}, TensorView{}, reader, c.quant};
  const int64_t hidden = c.hidden_size;
  TS_RETURN_IF_ERROR(fetch_unquantized(c, reader, "model.embed_tokens.weight",
                                       {c.vocab_size, hidden}, &w.embed_tokens));
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  const bool fp8 = c.quant.scheme == QuantScheme::kFp8 && c.quant.prequantized;
  std::string first_scale;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LlamaLayerWeights& l = w.layers[static_cast<size_t>(i)];
    auto linear = [&](const std::string& name, int64_t rows, int64_t cols, TensorView* weight,
                      Fp8Scales* scales) {
      return fp8 ? fetch_fp8_linear(c, reader, p + name, rows, cols, weight, scales, &w.quant,
                                    &first_scale)
                 : fetch_unquantized(c, reader, p + name + ".weight", {rows, cols}, weight);
    };
    TS_RETURN_IF_ERROR(
        fetch_unquantized(c, reader, p + "input_layernorm.weight", {hidden}, &l.input_layernorm));
    TS_RETURN_IF_ERROR(linear("self_attn.q_proj", c.q_size(), hidden, &l.q_proj, &l.q_scale));
    TS_RETURN_IF_ERROR(linear("self_attn.k_proj", c.kv_size(), hidden, &l.k_proj, &l.k_scale));
    TS_RETURN_IF_ERROR(linear("self_attn.v_proj", c.kv_size(), hidden, &l.v_proj, &l.v_scale));
    TS_RETURN_IF_ERROR(linear("self_attn.o_proj", hidden, c.q_size(), &l.o_proj, &l.o_scale));
    TS_RETURN_IF_ERROR(fetch_unquantized(c, reader, p + "post_attention_layernorm.weight", {hidden},
                                         &l.post_attention_layernorm));
    TS_RETURN_IF_ERROR(
        linear("mlp.gate_proj", c.intermediate_size, hidden, &l.gate_proj, &l.gate_scale));
    TS_RETURN_IF_ERROR(linear("mlp.up_proj", c.intermediate_size, hidden, &l.up_proj, &l.up_scale));
    TS_RETURN_IF_ERROR(
        linear("mlp.down_proj", hidden, c.intermediate_size, &l.down_proj, &l.down_scale));
  }
  if (fp8) w.quant.weight_scale_stated = true;
  TS_RETURN_IF_ERROR(fetch_unquantized(c, reader, "model.norm.weight", {hidden}, &w.norm));
  if (c.tie_word_embeddings) {
    // HF ties lm_head to embed_tokens and ignores any saved lm_head.weight.
    w.lm_head = w.embed_tokens;
  } else {
    TS_RETURN_IF_ERROR(
        fetch_unquantized(c, reader, "lm_head.weight", {c.vocab_size, hidden}, &w.lm_head));
  }
  return w;
}

}  // namespace treeserve
