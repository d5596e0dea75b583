// LlamaWeights: every tensor of a LlamaForCausalLM / MistralForCausalLM checkpoint,
// found by its Hugging Face name and shape-checked against ModelConfig. Holds views
// into the mapped safetensors (no copies); engines convert and upload as they need.
#pragma once

#include <vector>

#include "common/status.h"
#include "models/model_config.h"
#include "models/safetensors.h"

namespace treeserve {

// HF Linear layout: weight is [out_features, in_features].
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
};

struct LlamaWeights {
  TensorView embed_tokens;  // [vocab, hidden]
  std::vector<LlamaLayerWeights> layers;
  TensorView norm;           // [hidden]
  TensorView lm_head;        // [vocab, hidden]; the embed_tokens view when tie_word_embeddings
  SafetensorsReader reader;  // keeps the mappings the views point into alive
};

// Errors name the tensor and the file: NOT_FOUND for a missing tensor,
// INVALID_ARGUMENT for a wrong shape (expected vs got) or an unsupported dtype.
StatusOr<LlamaWeights> load_llama_weights(const ModelConfig& config,
                                          const SafetensorsReader& reader);

}  // namespace treeserve
