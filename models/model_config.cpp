// Parses a Hugging Face config.json (and generation_config.json's EOS ids) into
// ModelConfig, and computes RoPE inverse frequencies. nlohmann::json exceptions are caught here;
// callers only see Status.
#include "models/model_config.h"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
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

// --- quantization_config ---------------------------------------------------------

constexpr char kQuantSupported[] =
    "treeserve serves FP8 (e4m3) linear layers from quant_method 'fp8' (per-tensor or "
    "per-channel weight scales, activation_scheme dynamic or static) or 'compressed-tensors' "
    "(format float-quantized or naive-quantized; 8-bit float weights with strategy channel or "
    "tensor and 8-bit float input activations with strategy token and dynamic true, or "
    "strategy tensor and dynamic false), and 16-bit checkpoints (which --quantization fp8 "
    "quantizes at load)";

// "<file>: quantization_config.<field> <what> is not supported; <what treeserve serves>".
Status quant_unsupported(const std::string& file, const std::string& field,
                         const std::string& what) {
  return InvalidArgument(file + ": quantization_config." + field + " " + what +
                         " is not supported; " + kQuantSupported);
}

// The names of the modules treeserve quantizes (model.layers.N.self_attn.q_proj, ...).
std::vector<std::string> quantized_linear_names(int64_t layers) {
  std::vector<std::string> names;
  for (int64_t i = 0; i < layers; ++i) {
    for (const char* p : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) {
      names.push_back("model.layers." + std::to_string(i) + "." + p);
    }
  }
  return names;
}

// An ignore list (compressed-tensors' ignore, the fp8 layout's ignored_layers or
// modules_to_not_convert): treeserve quantizes every projection of every layer and keeps
// lm_head 16-bit, so an entry may only name modules outside the projections (lm_head). An
// entry matches a module when it equals or is part of its name, when it is a "re:" regular
// expression matching the name's start (Python's re.match, as compressed-tensors applies it),
// or when it names the class ("Linear").
Status check_ignore_list(const json& q, const char* field, const std::string& file,
                         int64_t layers) {
  auto it = q.find(field);
  if (it == q.end() || it->is_null()) return Status::Ok();
  const std::string where = std::string("quantization_config.") + field;
  if (!it->is_array()) {
    return InvalidArgument(file + ": field '" + where + "' must be a list of module names, got " +
                           json_type_name(*it));
  }
  const std::vector<std::string> names = quantized_linear_names(layers);
  for (const json& e : *it) {
    if (!e.is_string()) {
      return InvalidArgument(file + ": field '" + where + "' must be a list of module names, got " +
                             e.dump());
    }
    const std::string entry = e.get<std::string>();
    std::optional<std::regex> pattern;
    if (entry.rfind("re:", 0) == 0) {
      try {
        pattern.emplace(entry.substr(3));
      } catch (const std::regex_error& err) {
        return InvalidArgument(file + ": " + where + " entry '" + entry +
                               "' is not a regular expression treeserve can read: " + err.what());
      }
    }
    for (const std::string& name : names) {
      const bool hit =
          entry == "Linear" ||
          (pattern ? std::regex_search(name, *pattern, std::regex_constants::match_continuous)
                   : name.find(entry) != std::string::npos);
      if (hit) {
        return InvalidArgument(file + ": " + where + " lists '" + entry + "', which names " + name +
                               ": treeserve quantizes every q/k/v/o/gate/up/down projection "
                               "alike (only lm_head may stay unquantized)");
      }
    }
  }
  return Status::Ok();
}

// quant_method "fp8" (AutoFP8, llm-compressor's and transformers' FP8 layout, as vLLM reads
// it): activation_scheme dynamic | static; the weight scales' granularity is left to the
// weight_scale tensors' shape.
Status parse_fp8_layout(const json& q, const std::string& file, int64_t layers, QuantConfig* out) {
  FieldReader r(q, file + ": quantization_config");
  if (r.has("weight_block_size")) {
    return quant_unsupported(file, "weight_block_size",
                             q.at("weight_block_size").dump() + " (block-wise FP8)");
  }
  std::string scheme;
  TS_RETURN_IF_ERROR(r.get_string("activation_scheme", &scheme));
  if (scheme.empty()) return r.missing("activation_scheme");
  if (scheme == "dynamic") {
    out->activation_scale = Fp8ActivationScale::kDynamicPerToken;
  } else if (scheme == "static") {
    out->activation_scale = Fp8ActivationScale::kStaticPerTensor;
  } else {
    return quant_unsupported(file, "activation_scheme", "'" + scheme + "'");
  }
  for (const char* list : {"ignored_layers", "modules_to_not_convert"}) {
    TS_RETURN_IF_ERROR(check_ignore_list(q, list, file, layers));
  }
  out->weight_scale_stated = false;
  out->source = "config.json quantization_config (fp8)";
  return Status::Ok();
}

// One quantization args object of a compressed-tensors config group ("weights",
// "input_activations"): num_bits 8, type float, symmetric; returns its strategy and dynamic.
Status parse_ct_args(const json& args, const std::string& file, const std::string& field,
                     std::string* strategy, bool* dynamic) {
  if (!args.is_object()) {
    return InvalidArgument(file + ": field 'quantization_config." + field +
                           "' must be an object, got " + json_type_name(args));
  }
  FieldReader r(args, file + ": quantization_config." + field);
  int64_t num_bits = 0;
  TS_RETURN_IF_ERROR(r.get_int("num_bits", &num_bits, true));
  std::string type = "int";  // compressed-tensors' default
  TS_RETURN_IF_ERROR(r.get_string("type", &type));
  if (type != "float") {
    return quant_unsupported(file, field + ".type",
                             "'" + type + "' (" + std::to_string(num_bits) + "-bit " + type + ")");
  }
  if (num_bits != 8) {
    return quant_unsupported(file, field + ".num_bits", std::to_string(num_bits));
  }
  bool symmetric = true;
  TS_RETURN_IF_ERROR(r.get_bool("symmetric", &symmetric));
  if (!symmetric) return quant_unsupported(file, field + ".symmetric", "false (asymmetric)");
  if (r.has("group_size")) {
    return quant_unsupported(file, field + ".group_size",
                             args.at("group_size").dump() + " (group-wise scales)");
  }
  if (r.has("block_structure")) {
    return quant_unsupported(file, field + ".block_structure",
                             args.at("block_structure").dump() + " (block-wise scales)");
  }
  TS_RETURN_IF_ERROR(r.get_string("strategy", strategy));
  if (strategy->empty()) return r.missing("strategy");
  *dynamic = false;
  TS_RETURN_IF_ERROR(r.get_bool("dynamic", dynamic));
  return Status::Ok();
}

// quant_method "compressed-tensors" (llm-compressor): FP8 W8A8 in its float-quantized (or
// naive-quantized) format.
Status parse_compressed_tensors(const json& q, const std::string& file, int64_t layers,
                                QuantConfig* out) {
  FieldReader r(q, file + ": quantization_config");
  const json* groups = nullptr;
  if (auto it = q.find("config_groups"); it != q.end() && it->is_object()) groups = &*it;
  if (groups == nullptr || groups->size() != 1) {
    if (!r.has("config_groups")) return r.missing("config_groups");
    if (!q.at("config_groups").is_object()) return r.ill_typed("config_groups", "an object");
    return quant_unsupported(file, "config_groups",
                             "with " + std::to_string(groups->size()) +
                                 " groups (one group quantizing every Linear layer alike)");
  }
  const std::string group_name = groups->begin().key();
  const json& group = groups->begin().value();
  const std::string g = "config_groups." + group_name;
  if (!group.is_object()) {
    return InvalidArgument(file + ": field 'quantization_config." + g +
                           "' must be an object, got " + json_type_name(group));
  }
  // The format: top level, else the group's own.
  std::string format;
  TS_RETURN_IF_ERROR(r.get_string("format", &format));
  std::string format_field = "format";
  if (format.empty()) {
    TS_RETURN_IF_ERROR(
        FieldReader(group, file + ": quantization_config." + g).get_string("format", &format));
    format_field = g + ".format";
  }
  if (format.empty()) return r.missing("format");
  if (format != "float-quantized" && format != "naive-quantized") {
    return quant_unsupported(file, format_field, "'" + format + "'");
  }
  // targets: ["Linear"].
  const auto targets = group.find("targets");
  if (targets == group.end() || !targets->is_array() || targets->size() != 1 ||
      !(*targets)[0].is_string() || (*targets)[0].get<std::string>() != "Linear") {
    return quant_unsupported(file, g + ".targets",
                             targets == group.end() ? std::string("(missing)")
                                                    : targets->dump() + " (only [\"Linear\"])");
  }
  const auto weights = group.find("weights");
  if (weights == group.end() || weights->is_null()) {
    return FieldReader(group, file + ": quantization_config." + g).missing("weights");
  }
  std::string strategy;
  bool dynamic = false;
  TS_RETURN_IF_ERROR(parse_ct_args(*weights, file, g + ".weights", &strategy, &dynamic));
  if (strategy == "channel") {
    out->weight_scale = Fp8WeightScale::kChannel;
  } else if (strategy == "tensor") {
    out->weight_scale = Fp8WeightScale::kTensor;
  } else {
    return quant_unsupported(file, g + ".weights.strategy", "'" + strategy + "'");
  }
  if (dynamic) return quant_unsupported(file, g + ".weights.dynamic", "true");
  const auto inputs = group.find("input_activations");
  if (inputs == group.end() || inputs->is_null()) {
    return quant_unsupported(file, g + ".input_activations",
                             "null (FP8 weight-only, 16-bit activations)");
  }
  TS_RETURN_IF_ERROR(parse_ct_args(*inputs, file, g + ".input_activations", &strategy, &dynamic));
  if (strategy == "token" && dynamic) {
    out->activation_scale = Fp8ActivationScale::kDynamicPerToken;
  } else if (strategy == "tensor" && !dynamic) {
    out->activation_scale = Fp8ActivationScale::kStaticPerTensor;
  } else {
    return quant_unsupported(
        file, g + ".input_activations",
        "strategy '" + strategy + "' with dynamic " + (dynamic ? "true" : "false"));
  }
  if (auto o = group.find("output_activations"); o != group.end() && !o->is_null()) {
    return quant_unsupported(file, g + ".output_activations", o->dump());
  }
  if (auto s = q.find("sparsity_config"); s != q.end() && !s->is_null()) {
    const auto f = s->find("format");
    if (!s->is_object() || (f != s->end() && *f != "dense")) {
      return quant_unsupported(file, "sparsity_config", s->dump());
    }
  }
  TS_RETURN_IF_ERROR(check_ignore_list(q, "ignore", file, layers));
  out->weight_scale_stated = true;
  out->source = "config.json quantization_config (compressed-tensors)";
  return Status::Ok();
}

Status parse_quantization(const json& root, const std::string& file, ModelConfig* c) {
  auto it = root.find("quantization_config");
  if (it == root.end() || it->is_null()) return Status::Ok();
  const json& q = *it;
  if (!q.is_object()) {
    return InvalidArgument(file + ": field 'quantization_config' must be an object, got " +
                           json_type_name(q));
  }
  FieldReader r(q, file + ": quantization_config");
  std::string method;
  TS_RETURN_IF_ERROR(r.get_string("quant_method", &method));
  if (method.empty()) return r.missing("quant_method");
  QuantConfig quant;
  quant.scheme = QuantScheme::kFp8;
  quant.prequantized = true;
  if (method == "fp8") {
    TS_RETURN_IF_ERROR(parse_fp8_layout(q, file, c->num_hidden_layers, &quant));
  } else if (method == "compressed-tensors") {
    TS_RETURN_IF_ERROR(parse_compressed_tensors(q, file, c->num_hidden_layers, &quant));
  } else {
    return quant_unsupported(file, "quant_method", "'" + method + "'");
  }
  c->quant = std::move(quant);
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
  TS_RETURN_IF_ERROR(parse_quantization(root, file, &c));
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
  if (config->quant.scheme == QuantScheme::kFp8) {
    spdlog::info(
        "model {}: FP8 (e4m3) linear layers from {}: weight scales {}, activation scales {}; "
        "embeddings, norms and lm_head stay 16-bit",
        model_dir, config->quant.source,
        !config->quant.weight_scale_stated ? "as the weight_scale tensors give them"
        : config->quant.weight_scale == Fp8WeightScale::kChannel ? "per channel"
                                                                 : "per tensor",
        config->quant.activation_scale == Fp8ActivationScale::kDynamicPerToken
            ? "dynamic per token"
            : "static (the checkpoint's input_scale)");
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

Status apply_quantization_option(const std::string& value, const std::string& option,
                                 ModelConfig* config) {
  const bool fp8_checkpoint = config->quant.scheme == QuantScheme::kFp8;
  if (value == "auto") return Status::Ok();
  if (value == "none") {
    if (!fp8_checkpoint) return Status::Ok();
    return InvalidArgument(option + " none: the checkpoint " + config->model_dir + " is FP8 (" +
                           config->quant.source +
                           "): its linear layers are stored as e4m3 and can only be served as "
                           "FP8 (use " +
                           option + " auto or fp8, or a 16-bit checkpoint)");
  }
  if (value == "fp8") {
    if (fp8_checkpoint) return Status::Ok();  // already FP8
    QuantConfig q;
    q.scheme = QuantScheme::kFp8;
    q.prequantized = false;
    q.weight_scale = Fp8WeightScale::kChannel;
    q.weight_scale_stated = true;
    q.activation_scale = Fp8ActivationScale::kDynamicPerToken;
    q.source = option + " fp8";
    config->quant = std::move(q);
    spdlog::info(
        "model {}: {} fp8: the linear layers are quantized to e4m3 at load (per channel), their "
        "inputs per token; embeddings, norms and lm_head stay 16-bit",
        config->model_dir, option);
    return Status::Ok();
  }
  return InvalidArgument(option + " must be auto, none or fp8, got '" + value + "'");
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
