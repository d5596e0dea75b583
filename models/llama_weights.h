// LlamaWeights: every tensor of a LlamaForCausalLM / MistralForCausalLM checkpoint,
// found by its Hugging Face name and shape-checked against ModelConfig. Holds views
// into the mapped safetensors (no copies); engines convert and upload as they need.
#pragma once

#include <vector>

#include "common/status.h"
#include "models/model_config.h"
#include "models/quantization.h"
#include "models/safetensors.h"

namespace treeserve {

// The scales of one FP8 linear layer of a prequantized checkpoint (ModelConfig::quant.
// prequantized): its weight is F8_E4M3 [out, in] and stands for float(q) * scale, row by row.
// Both views are empty (data == nullptr) otherwise.
struct Fp8Scales {
  // <proj>.weight_scale: F32 (or BF16 / F16: read it with to_float), positive and finite.
  // [] or [1]: one scale for the whole matrix (per tensor); [out] or [out, 1]: one per output
  // row (per channel). Every projection of a checkpoint has the same granularity
  // (LlamaWeights::quant.weight_scale).
  TensorView weight_scale;
  // <proj>.input_scale, static activation scales only (quant.activation_scale ==
  // kStaticPerTensor): [] or [1], F32 / BF16 / F16, positive and finite; the linear layer's
  // input x is quantized as e4m3(x / input_scale). Empty for dynamic activations.
  TensorView input_scale;
};

// A projection's weight scales as floats, one per output row of its `rows` (a per-tensor scale
// repeated): what both backends multiply each row by. INVALID_ARGUMENT naming the tensor unless
// weight_scale holds 1 or `rows` values (load_llama_weights has checked that, and that every
// value is positive and finite).
StatusOr<std::vector<float>> fp8_row_scales(const Fp8Scales& scales, int64_t rows);

// The static input scale: INVALID_ARGUMENT naming the tensor unless input_scale holds one value.
StatusOr<float> fp8_input_scale(const Fp8Scales& scales);

// HF Linear layout: weight is [out_features, in_features]. For FP8 checkpoints the seven
// projections are F8_E4M3 with their scales in the *_scale fields; the norms stay 16-bit.
struct LlamaLayerWeights {
  TensorView input_layernorm;           // [hidden]
  TensorView q_proj;                    // [heads * head_dim, hidden]
  TensorView k_proj;                    // [kv_heads * head_dim, hidden]
  TensorView v_proj;                    // [kv_heads * head_dim, hidden]
  TensorView o_proj;                    // [hidden, heads * head_dim]
  TensorView post_attention_layernorm;  // [hidden]
  TensorView gate_proj;                 // [intermediate, hidden]
  TensorView up_proj;                   // [intermediate, hidden]
  TensorView down_proj;                 // [hidden, intermediate]
  // FP8 checkpoints only (see Fp8Scales).
  Fp8Scales q_scale, k_scale, v_scale, o_scale, gate_scale, up_scale, down_scale;
};

struct LlamaWeights {
  TensorView embed_tokens;  // [vocab, hidden]
  std::vector<LlamaLayerWeights> layers;
  TensorView norm;           // [hidden]
  TensorView lm_head;        // [vocab, hidden]; the embed_tokens view when tie_word_embeddings
  SafetensorsReader reader;  // keeps the mappings the views point into alive
  // The config's quantization with, for a prequantized checkpoint, weight_scale the
  // granularity its weight_scale tensors have (weight_scale_stated true).
  QuantConfig quant;
};

// Errors name the tensor and the file: NOT_FOUND for a missing tensor (an FP8 checkpoint's
// weight_scale, or input_scale under static activation scales, included), INVALID_ARGUMENT
// for a wrong shape (expected vs got), an unsupported dtype, an FP8 weight where the config
// names no FP8 scheme (or a 16-bit one where it does), scales of a granularity other than the
// config's, and scales that are not positive finite numbers. Embeddings, norms and lm_head
// must be F32, F16 or BF16 in every checkpoint.
StatusOr<LlamaWeights> load_llama_weights(const ModelConfig& config,
                                          const SafetensorsReader& reader);

}  // namespace treeserve
