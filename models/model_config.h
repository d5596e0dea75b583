// ModelConfig: the shape of a Llama-family model, read from a Hugging Face
// config.json (LlamaForCausalLM / MistralForCausalLM), the end-of-sequence ids generation
// stops on (generation_config.json, else config.json), how its linear layers are quantized
// (quantization_config: FP8 checkpoints; or --quantization fp8), and the RoPE inverse
// frequencies it implies (plain and Llama-3.x "llama3" scaling).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "models/quantization.h"

namespace treeserve {

enum class RopeType {
  kDefault,  // plain RoPE: inv_freq[i] = theta^(-2i/head_dim)
  kLlama3,   // Llama-3.1+ frequency-dependent scaling (transformers' _compute_llama3_parameters)
};

struct RopeScaling {
  RopeType type = RopeType::kDefault;
  // Only meaningful for kLlama3.
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string model_dir;     // directory config.json was read from
  std::string architecture;  // "LlamaForCausalLM" or "MistralForCausalLM"
  std::string model_type;    // "llama", "mistral" (may be empty in old configs)

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // defaults to num_attention_heads (no GQA)
  int64_t head_dim = 0;             // defaults to hidden_size / num_attention_heads
  int64_t max_position_embeddings = 2048;
  // Mistral v0.1 attends to only the last sliding_window positions; 0 (or null in the
  // file): full attention. treeserve's attention is full, so it caps sequences at the window
  // (max_sequence_tokens()).
  int64_t sliding_window = 0;

  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;

  bool tie_word_embeddings = false;
  int32_t bos_token_id = -1;  // -1: none given
  // Generation ends on any of these; an int or a list in the files (Llama 3.x Instruct lists
  // <|end_of_text|>, <|eom_id|>, <|eot_id|>). generation_config.json's eos_token_id, when it
  // has one, replaces config.json's, as transformers' generate() does. Empty: none given.
  std::vector<int32_t> eos_token_ids;
  std::string eos_token_ids_source;  // "generation_config.json", "config.json" or "" (none)
  std::string torch_dtype;           // "float32", "bfloat16", ... (informational)
  // The linear layers' quantization (config.json's quantization_config, or --quantization).
  QuantConfig quant;

  // The longest sequence treeserve serves: max_position_embeddings, or sliding_window when
  // that is smaller. The engine attends over whole sequences, which equals sliding-window
  // attention only while a sequence fits in the window, so longer ones are refused.
  int64_t max_sequence_tokens() const {
    return sliding_window > 0 && sliding_window < max_position_embeddings ? sliding_window
                                                                          : max_position_embeddings;
  }

  int64_t q_size() const { return num_attention_heads * head_dim; }
  int64_t kv_size() const { return num_key_value_heads * head_dim; }
};

// Reads <model_dir>/config.json and, when present, <model_dir>/generation_config.json.
// NOT_FOUND when the directory or config.json is missing; INVALID_ARGUMENT (naming the file
// and field) for bad JSON, missing or ill-typed fields, unsupported architectures or rope
// types, inconsistent shapes, EOS ids outside vocab_size, and quantization schemes treeserve
// does not serve.
//
// quantization_config (absent: 16-bit linear layers) is accepted in two layouts:
//   "quant_method": "fp8" with "activation_scheme" "dynamic" or "static" (the weight scales'
//     granularity is the weight_scale tensors' shape, decided at load; weight_block_size,
//     block-wise FP8, is refused);
//   "quant_method": "compressed-tensors", format "float-quantized" or "naive-quantized", one
//     config group targeting "Linear": 8-bit float symmetric weights of strategy "channel" or
//     "tensor", and 8-bit float input activations of strategy "token" (dynamic) or "tensor"
//     (static).
// Either may leave lm_head unquantized (ignore / ignored_layers / modules_to_not_convert);
// listing a layer treeserve quantizes there is refused. Any other quant_method, integer or
// 4-bit types, group or block strategies and weight-only schemes are refused naming the field
// and what treeserve serves instead.
StatusOr<ModelConfig> load_model_config(const std::string& model_dir);

// Applies model.quantization / --quantization (`option` names it in messages) to a loaded
// config: "auto" keeps the checkpoint's own scheme; "fp8" quantizes the linear layers of a
// 16-bit checkpoint at load (per channel, dynamic per-token activations; source "<option>
// fp8") and leaves an FP8 checkpoint as it is; "none" keeps a 16-bit checkpoint 16-bit and
// is refused on an FP8 checkpoint. Any other value is INVALID_ARGUMENT naming the option.
Status apply_quantization_option(const std::string& value, const std::string& option,
                                 ModelConfig* config);
StatusOr<ModelConfig> load_model_config(const std::string& model_dir);

// Same checks on an already-parsed JSON text; `source` names it in messages.
StatusOr<ModelConfig> parse_model_config(const std::string& json_text, const std::string& source);
// Applies a generation_config.json text to config: its eos_token_id (an int or a list)
// replaces config->eos_token_ids; other fields are ignored. `source` names it in messages.
Status apply_generation_config(const std::string& json_text, const std::string& source,
                               ModelConfig* config);

// RoPE inverse frequencies, head_dim / 2 of them, computed in float32 in the same
// order of operations as transformers (default and llama3 rope types).
std::vector<float> rope_inv_freq(const ModelConfig& config);

}  // namespace treeserve
