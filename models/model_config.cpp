// Parses a Hugging Face config.json (and generation_config.json's EOS ids) into
// ModelConfig, and computes RoPE inverse frequencies. nlohmann::json exceptions are caught here;
// callers only see Status.
#include "models/model_config.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace treeserve {
namespace {

using nlohmann::json;

const char* json_type_name(const json& v) {
  if (v.is_number_integer() || v.is_number_unsigned()) return "integer";
  return v.type_name();
}

// Field readers: `where` is "<file>" or "<file>: rope_scaling"; absent and null
// are the same thing (HF writes null for unset optional fields).
class FieldReader {
 public:
  FieldReader(const json& object, std::string where) : object_(object), where_(std::move(where)) {}

  bool has(const char* field) const {
    auto it = object_.find(field);
    return it != object_.end() && !it->is_null();
  }

  Status missing(const char* field) const {
    return InvalidArgument(where_ + ": missing required field '" + field + "'");
  }

  Status ill_typed(const char* field, const char* expected) const {
    return InvalidArgument(where_ + ": field '" + field + "' must be " + expected + ", got " +
                           json_type_name(object_.at(field)) + " " + object_.at(field).dump());
  }

  Status get_int(const char* field, int64_t* out, bool required) const {
    if (!has(field)) return required ? missing(field) : Status::Ok();
    const json& v = object_.at(field);
    if (!v.is_number_integer() && !v.is_number_unsigned()) return ill_typed(field, "an integer");
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX}) {
      return InvalidArgument(where_ + ": field '" + field + "' is out of range: " + v.dump());
    }
    *out = v.get<int64_t>();
    return Status::Ok();
  }

  Status get_positive_int(const char* field, int64_t* out, bool required) const {
    TS_RETURN_IF_ERROR(get_int(field, out, required));
    if (has(field) && *out <= 0) {
      return InvalidArgument(where_ + ": field '" + field + "' must be positive, got " +
                             std::to_string(*out));
    }
    return Status::Ok();
  }

  // A dimension: positive and at most INT32_MAX, since the KV layout and the engines keep
  // sizes in int32 (a larger one would be truncated there, not refused).
  Status get_size(const char* field, int64_t* out, bool required) const {
    TS_RETURN_IF_ERROR(get_positive_int(field, out, required));
    if (has(field) && *out > INT32_MAX) {
      return InvalidArgument(where_ + ": field '" + field + "' is " + std::to_string(*out) +
                             ", over the largest supported size " + std::to_string(INT32_MAX));
    }
    return Status::Ok();
  }

  Status get_double(const char* field, double* out, bool required) const {
    if (!has(field)) return required ? missing(field) : Status::Ok();
    const json& v = object_.at(field);
    if (!v.is_number()) return ill_typed(field, "a number");
    *out = v.get<double>();
    return Status::Ok();
  }

  Status get_bool(const char* field, bool* out) const {
    if (!has(field)) return Status::Ok();
    const json& v = object_.at(field);
    if (!v.is_boolean()) return ill_typed(field, "a boolean");
    *out = v.get<bool>();
    return Status::Ok();
  }

  Status get_string(const char* field, std::string* out) const {
    if (!has(field)) return Status::Ok();
    const json& v = object_.at(field);
    if (!v.is_string()) return ill_typed(field, "a string");
    *out = v.get<std::string>();
    return Status::Ok();
  }

  // An int32 token id, or a list of them (eos_token_id in Llama-3 configs).
  Status get_token_ids(const char* field, std::vector<int32_t>* out) const {
    if (!has(field)) return Status::Ok();
    const json& v = object_.at(field);
    auto one = [&](const json& e) -> Status {
      if (!e.is_number_integer() && !e.is_number_unsigned()) {
        return ill_typed(field, "an integer token id or a list of them");
      }
      int64_t id = e.get<int64_t>();
      if (id < 0 || id > INT32_MAX) {
        return InvalidArgument(where_ + ": field '" + field + "' holds an invalid token id " +
                               e.dump());
      }
      out->push_back(static_cast<int32_t>(id));
      return Status::Ok();
    };
    if (!v.is_array()) return one(v);
    for (const json& e : v) TS_RETURN_IF_ERROR(one(e));
    return Status::Ok();
  }

 private:
  const json& object_;
  std::string where_;
};

// rope_scaling (transformers <= 4.x) or rope_parameters (newer): {"rope_type" | "type": ...}.
Status parse_rope(const json& root, const std::string& file, ModelConfig* config) {
  const char* key = nullptr;
  if (root.contains("rope_parameters") && !root.at("rope_parameters").is_null()) {
    key = "rope_parameters";
  } else if (root.contains("rope_scaling") && !root.at("rope_scaling").is_null()) {
    key = "rope_scaling";
  } else {
    return Status::Ok();
  }
  const json& rope = root.at(key);
  if (!rope.is_object()) {
    return InvalidArgument(file + ": field '" + key + "' must be an object, got " +
                           json_type_name(rope));
  }
  FieldReader r(rope, file + ": " + key);
  // rope_parameters carries rope_theta itself.
  TS_RETURN_IF_ERROR(r.get_double("rope_theta", &config->rope_theta, /*required=*/false));

  std::string type;
  const char* type_field = r.has("rope_type") ? "rope_type" : "type";
  TS_RETURN_IF_ERROR(r.get_string(type_field, &type));
  if (type.empty()) return r.missing("rope_type");
  if (type == "default") return Status::Ok();
  if (type != "llama3") {
    return InvalidArgument(file + ": " + key + "." + type_field + " '" + type +
                           "' is not supported (supported: default, llama3)");
  }
  RopeScaling& s = config->rope_scaling;
  s.type = RopeType::kLlama3;
  TS_RETURN_IF_ERROR(r.get_double("factor", &s.factor, true));
  TS_RETURN_IF_ERROR(r.get_double("low_freq_factor", &s.low_freq_factor, true));
  TS_RETURN_IF_ERROR(r.get_double("high_freq_factor", &s.high_freq_factor, true));
  TS_RETURN_IF_ERROR(r.get_positive_int("original_max_position_embeddings",
                                        &s.original_max_position_embeddings, true));
  if (!(s.factor > 0.0) || !(s.low_freq_factor > 0.0) ||
      !(s.high_freq_factor > s.low_freq_factor)) {
    return InvalidArgument(file + ": " + key +
                           " needs factor > 0 and 0 < low_freq_factor < high_freq_factor");
  }
  return Status::Ok();
}

// Qwen2 is Llama's shape plus biases on the q, k and v projections, which the engines' GEMMs
// do not add: refused by name rather than served without them.
Status qwen2_refused(const std::string& file) {
  return InvalidArgument(file +
                         ": architecture Qwen2ForCausalLM is not supported: its attention adds "
                         "biases to the q, k and v projections, which treeserve's engines do "
                         "not implement (supported: LlamaForCausalLM, MistralForCausalLM)");
}

Status parse_architecture(const FieldReader& r, const json& root, const std::string& file,
                          ModelConfig* config) {
  TS_RETURN_IF_ERROR(r.get_string("model_type", &config->model_type));
  if (r.has("architectures")) {
    const json& archs = root.at("architectures");
    if (!archs.is_array()) return r.ill_typed("architectures", "a list of strings");
    std::string seen;
    for (const json& a : archs) {
      if (!a.is_string()) return r.ill_typed("architectures", "a list of strings");
      const std::string name = a.get<std::string>();
      if (name == "LlamaForCausalLM" || name == "MistralForCausalLM") {
        config->architecture = name;
        return Status::Ok();
      }
      if (name == "Qwen2ForCausalLM") return qwen2_refused(file);
      seen += (seen.empty() ? "" : ", ") + name;
    }
    return InvalidArgument(file + ": field 'architectures' [" + seen +
                           "] names no supported architecture "
                           "(LlamaForCausalLM, MistralForCausalLM)");
  }
  if (config->model_type == "llama") {
    config->architecture = "LlamaForCausalLM";
  } else if (config->model_type == "mistral") {
    config->architecture = "MistralForCausalLM";
  } else if (config->model_type == "qwen2") {
    return qwen2_refused(file);
  } else {
    return InvalidArgument(file + ": missing field 'architectures' and model_type '" +
                           config->model_type + "' is not llama or mistral");
  }
  return Status::Ok();
}

Status check_shapes(const std::string& file, bool head_dim_given, const ModelConfig& c) {
  if (!head_dim_given && c.hidden_size % c.num_attention_heads != 0) {
    return InvalidArgument(file + ": hidden_size " + std::to_string(c.hidden_size) +
                           " is not divisible by num_attention_heads " +
                           std::to_string(c.num_attention_heads));
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return InvalidArgument(file + ": num_attention_heads " + std::to_string(c.num_attention_heads) +
                           " is not divisible by num_key_value_heads " +
                           std::to_string(c.num_key_value_heads));
  }
  for (auto [what, heads] :
       {std::pair<const char*, int64_t>{"num_attention_heads", c.num_attention_heads},
        {"num_key_value_heads", c.num_key_value_heads}}) {
    if (heads * c.head_dim > INT32_MAX) {
      return InvalidArgument(file + ": " + what + " x head_dim (" + std::to_string(heads) + " x " +
                             std::to_string(c.head_dim) + ") is over the largest supported size " +
                             std::to_string(INT32_MAX));
    }
  }
  if (c.head_dim % 2 != 0) {
    return InvalidArgument(file + ": head_dim " + std::to_string(c.head_dim) +
                           " must be even (RoPE rotates pairs)");
  }
  if (c.bos_token_id >= c.vocab_size) {
    return InvalidArgument(file + ": bos_token_id " + std::to_string(c.bos_token_id) +
                           " is outside vocab_size " + std::to_string(c.vocab_size));
  }
  for (int32_t eos : c.eos_token_ids) {
    if (eos >= c.vocab_size) {
      return InvalidArgument(file + ": eos_token_id " + std::to_string(eos) +
                             " is outside vocab_size " + std::to_string(c.vocab_size));
    }
  }
  return Status::Ok();
}

}  // namespace

namespace {

// The JSON object a config file holds; INVALID_ARGUMENT naming the file otherwise.
StatusOr<json> parse_object(const std::string& json_text, const std::string& file) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    return InvalidArgument(file + ": invalid JSON: " + e.what());
  }
  if (!root.is_object()) {
    return InvalidArgument(file + ": top level must be a JSON object, got " + root.type_name());
  }
  return root;
}

}  // namespace

StatusOr<ModelConfig> parse_model_config(const std::string& json_text, const std::string& file) {
  StatusOr<json> parsed = parse_object(json_text, file);
  if (!parsed.ok()) return parsed.status();
  const json& root = *parsed;
  ModelConfig c;
  FieldReader r(root, file);
  TS_RETURN_IF_ERROR(parse_architecture(r, root, file, &c));
  TS_RETURN_IF_ERROR(r.get_size("vocab_size", &c.vocab_size, true));
  TS_RETURN_IF_ERROR(r.get_size("hidden_size", &c.hidden_size, true));
  TS_RETURN_IF_ERROR(r.get_size("intermediate_size", &c.intermediate_size, true));
  TS_RETURN_IF_ERROR(r.get_size("num_hidden_layers", &c.num_hidden_layers, true));
  TS_RETURN_IF_ERROR(r.get_size("num_attention_heads", &c.num_attention_heads, true));
  c.num_key_value_heads = c.num_attention_heads;
  TS_RETURN_IF_ERROR(r.get_size("num_key_value_heads", &c.num_key_value_heads, false));
  const bool head_dim_given = r.has("head_dim");
  c.head_dim = c.hidden_size / c.num_attention_heads;
  TS_RETURN_IF_ERROR(r.get_size("head_dim", &c.head_dim, false));
  TS_RETURN_IF_ERROR(
      r.get_positive_int("max_position_embeddings", &c.max_position_embeddings, false));
  TS_RETURN_IF_ERROR(r.get_positive_int("sliding_window", &c.sliding_window, false));
  TS_RETURN_IF_ERROR(r.get_double("rms_norm_eps", &c.rms_norm_eps, false));
  if (!(c.rms_norm_eps > 0.0)) {
    return InvalidArgument(file + ": field 'rms_norm_eps' must be positive");
  }
  TS_RETURN_IF_ERROR(r.get_double("rope_theta", &c.rope_theta, false));
  TS_RETURN_IF_ERROR(parse_rope(root, file, &c));
  if (!(c.rope_theta > 1.0)) {
    return InvalidArgument(file + ": field 'rope_theta' must be > 1, got " +
                           std::to_string(c.rope_theta));
  }
  TS_RETURN_IF_ERROR(r.get_bool("tie_word_embeddings", &c.tie_word_embeddings));
  // Llama-architecture checkpoints with biases (attention_bias, mlp_bias) would load without
  // them and compute something else: refused, as Qwen2 is.
  for (const char* bias : {"attention_bias", "mlp_bias"}) {
    bool has_bias = false;
    TS_RETURN_IF_ERROR(r.get_bool(bias, &has_bias));
    if (has_bias) {
      return InvalidArgument(file + ": " + bias +
                             " is true: treeserve's engines do not add biases to the "
                             "projections (only bias-free Llama and Mistral checkpoints load)");
    }
  }
  std::vector<int32_t> bos;
  TS_RETURN_IF_ERROR(r.get_token_ids("bos_token_id", &bos));
  if (bos.size() > 1) return r.ill_typed("bos_token_id", "a single integer token id");
  if (!bos.empty()) c.bos_token_id = bos[0];
  TS_RETURN_IF_ERROR(r.get_token_ids("eos_token_id", &c.eos_token_ids));
  if (!c.eos_token_ids.empty()) c.eos_token_ids_source = "config.json";
  // transformers >= 4.56 writes "dtype"; older versions "torch_dtype".
  TS_RETURN_IF_ERROR(r.get_string(r.has("dtype") ? "dtype" : "torch_dtype", &c.torch_dtype));
  TS_RETURN_IF_ERROR(check_shapes(file, head_dim_given, c));
  return c;
}

Status apply_generation_config(const std::string& json_text, const std::string& file,
                               ModelConfig* config) {
  StatusOr<json> root = parse_object(json_text, file);
  if (!root.ok()) return root.status();
  std::vector<int32_t> eos;
  TS_RETURN_IF_ERROR(FieldReader(*root, file).get_token_ids("eos_token_id", &eos));
  if (eos.empty()) return Status::Ok();
  for (int32_t id : eos) {
    if (id >= config->vocab_size) {
      return InvalidArgument(file + ": eos_token_id " + std::to_string(id) +
                             " is outside vocab_size " + std::to_string(config->vocab_size));
    }
  }
  config->eos_token_ids = std::move(eos);
  config->eos_token_ids_source = "generation_config.json";
  return Status::Ok();
}

StatusOr<ModelConfig> load_model_config(const std::string& model_dir) {
  struct stat st {};
  if (stat(model_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return NotFound("model directory '" + model_dir + "' does not exist or is not a directory");
  }
  const std::string file = model_dir + "/config.json";
  std::ifstream in(file, std::ios::binary);
  if (!in) return NotFound(file + ": no such file (a Hugging Face model dir needs config.json)");
  std::stringstream text;
  text << in.rdbuf();
  StatusOr<ModelConfig> config = parse_model_config(text.str(), file);
  if (!config.ok()) return config;
  config->model_dir = model_dir;
  const std::string generation_file = model_dir + "/generation_config.json";
  if (std::ifstream generation(generation_file, std::ios::binary); generation) {
    std::stringstream generation_text;
    generation_text << generation.rdbuf();
    TS_RETURN_IF_ERROR(apply_generation_config(generation_text.str(), generation_file, &*config));
  }
  std::string ids;
  for (int32_t id : config->eos_token_ids) ids += (ids.empty() ? "" : ", ") + std::to_string(id);
  spdlog::info("model {}: generation ends on EOS ids [{}] ({})", model_dir, ids,
               config->eos_token_ids.empty() ? "none given" : config->eos_token_ids_source);
  if (config->max_sequence_tokens() < config->max_position_embeddings) {
    spdlog::info(
        "model {}: sliding_window {} (max_position_embeddings {}): treeserve attends over whole "
        "sequences, which equals sliding-window attention only within the window, so sequences "
        "are capped at {} tokens (longer prompts and appends are refused, generation stops there)",
        model_dir, config->sliding_window, config->max_position_embeddings,
        config->max_sequence_tokens());
  }
  return config;
}

// Mirrors transformers' _compute_default_rope_parameters and _compute_llama3_parameters
// op by op in float32 (torch's default dtype there). `s / tensor` is reciprocal(tensor) * s
// in torch (Tensor.__rtruediv__), and python scalars enter float32 ops rounded to float.
std::vector<float> rope_inv_freq(const ModelConfig& c) {
  const int64_t half = c.head_dim / 2;
  std::vector<float> inv_freq(half);
  const float dim = static_cast<float>(c.head_dim);
  const float base = static_cast<float>(c.rope_theta);
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / dim;
    // torch's float pow is within 1 ulp; the double pow rounded once is the exact value.
    const float power = static_cast<float>(std::pow(double{base}, double{exponent}));
    inv_freq[i] = 1.0f / power;
  }
  if (c.rope_scaling.type != RopeType::kLlama3) return inv_freq;

  const RopeScaling& s = c.rope_scaling;
  const double old_context_len = static_cast<double>(s.original_max_position_embeddings);
  const float low_freq_wavelen = static_cast<float>(old_context_len / s.low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(old_context_len / s.high_freq_factor);
  const float factor = static_cast<float>(s.factor);
  const float low = static_cast<float>(s.low_freq_factor);
  const float span = static_cast<float>(s.high_freq_factor - s.low_freq_factor);
  const float two_pi = static_cast<float>(2.0 * M_PI);
  for (int64_t i = 0; i < half; ++i) {
    const float f = inv_freq[i];
    const float wavelen = (1.0f / f) * two_pi;
    if (wavelen < high_freq_wavelen) continue;  // high frequency: unchanged
    if (wavelen > low_freq_wavelen) {           // low frequency: divided by factor
      inv_freq[i] = f / factor;
      continue;
    }
    // Medium frequency: smooth interpolation between f / factor and f.
    const float smooth = ((1.0f / wavelen) * static_cast<float>(old_context_len) - low) / span;
    const float scaled = ((1.0f - smooth) * f) / factor;
    const float kept = smooth * f;
    inv_freq[i] = scaled + kept;
  }
  return inv_freq;
}

}  // namespace treeserve
