// JSON presets -> TreeserveConfig, with strict key checking and range validation.
#include "server/config.h"

#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <type_traits>

#include "common/route_key.h"
#include "models/quantization.h"

namespace treeserve {
namespace {

using nlohmann::json;

// Reads one section, refusing keys it does not know.
class Section {
 public:
  Section(const json& obj, std::string path, std::string source)
      : obj_(obj), path_(std::move(path)), source_(std::move(source)) {}

  template <typename T>
  Status get(const char* key, T* out) {
    seen_.insert(key);
    auto it = obj_.find(key);
    if (it == obj_.end()) return Status::Ok();
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      // nlohmann would convert 2.5, true or 2^40 into an int32 silently (and 1e30, undefined
      // behaviour): an integer field takes a JSON integer in the field's range, nothing else.
      // (nlohmann keeps a non-negative integer as unsigned, a negative one as signed.)
      using Limits = std::numeric_limits<T>;
      bool fits = false;
      if (it->is_number_unsigned()) {
        fits = it->template get<uint64_t>() <= uint64_t(Limits::max());
        if (fits) *out = static_cast<T>(it->template get<uint64_t>());
      } else if (it->is_number_integer() && std::is_signed_v<T>) {
        const int64_t v = it->template get<int64_t>();
        fits = v >= int64_t(Limits::min()) && v <= int64_t(Limits::max());
        if (fits) *out = static_cast<T>(v);
      }
      if (!fits) {
        return InvalidArgument(source_ + ": " + path_ + key + " must be an integer in [" +
                               std::to_string(Limits::min()) + ", " +
                               std::to_string(Limits::max()) + "], got " + it->dump());
      }
      return Status::Ok();
    }
    try {
      *out = it->get<T>();
    } catch (const json::exception& e) {
      return InvalidArgument(source_ + ": " + path_ + key + " has the wrong type (" + e.what() +
                             ")");
    }
    return Status::Ok();
  }

  // Marks a key handled elsewhere (a nested section) as known.
  void known(const char* key) { seen_.insert(key); }

  Status check_unknown() const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      if (!seen_.count(it.key())) {
        return InvalidArgument(source_ + ": unknown key " + path_ + it.key());
      }
    }
    return Status::Ok();
  }

 private:
  const json& obj_;
  std::string path_;
  std::string source_;
  std::set<std::string> seen_;
};

Status sub_object(const json& root, const char* key, const std::string& source, const json** out) {
  *out = nullptr;
  auto it = root.find(key);
  if (it == root.end()) return Status::Ok();
  if (!it->is_object()) return InvalidArgument(source + ": " + key + " must be an object");
  *out = &*it;
  return Status::Ok();
}

}  // namespace

Status merge_config_json(const std::string& json_text, const std::string& source,
                         TreeserveConfig* c) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
    return InvalidArgument(source + ": invalid JSON: " + e.what());
  }
  if (!root.is_object()) return InvalidArgument(source + ": top level must be a JSON object");

  Section top(root, "", source);
  TS_RETURN_IF_ERROR(top.get("log_level", &c->log_level));
  const json* obj = nullptr;

  for (const char* k : {"server", "model", "engine", "kv_cache", "limits", "scheduler"}) {
    top.known(k);
  }
  TS_RETURN_IF_ERROR(top.check_unknown());

  TS_RETURN_IF_ERROR(sub_object(root, "server", source, &obj));
  if (obj) {
    Section s(*obj, "server.", source);
    TS_RETURN_IF_ERROR(s.get("listen", &c->server.listen));
    TS_RETURN_IF_ERROR(s.get("metrics_listen", &c->server.metrics_listen));
    TS_RETURN_IF_ERROR(s.get("http_listen", &c->server.http_listen));
    TS_RETURN_IF_ERROR(s.get("http_threads", &c->server.http_threads));
    TS_RETURN_IF_ERROR(s.get("auth_token", &c->server.auth_token));
    TS_RETURN_IF_ERROR(s.get("keys_file", &c->server.keys_file));
    TS_RETURN_IF_ERROR(s.get("tls_cert_file", &c->server.tls_cert_file));
    TS_RETURN_IF_ERROR(s.get("tls_key_file", &c->server.tls_key_file));
    TS_RETURN_IF_ERROR(s.get("tls_client_ca_file", &c->server.tls_client_ca_file));
    TS_RETURN_IF_ERROR(s.get("max_request_bytes", &c->server.max_request_bytes));
    TS_RETURN_IF_ERROR(s.get("shutdown_grace_ms", &c->server.shutdown_grace_ms));
    TS_RETURN_IF_ERROR(s.get("tree_lease_default_s", &c->server.tree_lease_default_s));
    TS_RETURN_IF_ERROR(s.get("tree_lease_max_s", &c->server.tree_lease_max_s));
    TS_RETURN_IF_ERROR(s.get("replica_id", &c->server.replica_id));
    TS_RETURN_IF_ERROR(s.check_unknown());
  }
  TS_RETURN_IF_ERROR(sub_object(root, "model", source, &obj));
  if (obj) {
    Section s(*obj, "model.", source);
    TS_RETURN_IF_ERROR(s.get("dir", &c->model.dir));
    TS_RETURN_IF_ERROR(s.get("random_weights_seed", &c->model.random_weights_seed));
    TS_RETURN_IF_ERROR(s.get("chat_template", &c->model.chat_template));
    TS_RETURN_IF_ERROR(s.get("quantization", &c->model.quantization));
    TS_RETURN_IF_ERROR(s.check_unknown());
  }
  TS_RETURN_IF_ERROR(sub_object(root, "engine", source, &obj));
  if (obj) {
    Section s(*obj, "engine.", source);
    TS_RETURN_IF_ERROR(s.get("backend", &c->engine.backend));
    TS_RETURN_IF_ERROR(s.get("cpu_threads", &c->engine.cpu_threads));
    TS_RETURN_IF_ERROR(s.get("tensor_parallel", &c->engine.tensor_parallel));
    TS_RETURN_IF_ERROR(s.get("attention", &c->engine.attention));
    TS_RETURN_IF_ERROR(s.get("cuda_graphs", &c->engine.cuda_graphs));
    TS_RETURN_IF_ERROR(s.get("gemm_autotune", &c->engine.gemm_autotune));
    TS_RETURN_IF_ERROR(s.get("p2p_all_reduce", &c->engine.p2p_all_reduce));
    TS_RETURN_IF_ERROR(s.get("gemm_split_k", &c->engine.gemm_split_k));
    TS_RETURN_IF_ERROR(s.check_unknown());
  }
  TS_RETURN_IF_ERROR(sub_object(root, "kv_cache", source, &obj));
  if (obj) {
    Section s(*obj, "kv_cache.", source);
    TS_RETURN_IF_ERROR(s.get("page_size", &c->kv_cache.page_size));
    TS_RETURN_IF_ERROR(s.get("memory_bytes", &c->kv_cache.memory_bytes));
    TS_RETURN_IF_ERROR(s.get("prefix_sharing", &c->kv_cache.prefix_sharing));
    TS_RETURN_IF_ERROR(s.get("dtype", &c->kv_cache.dtype));
    TS_RETURN_IF_ERROR(s.check_unknown());
  }
  TS_RETURN_IF_ERROR(sub_object(root, "limits", source, &obj));
  if (obj) {
    Section s(*obj, "limits.", source);
    TS_RETURN_IF_ERROR(s.get("max_prompt_tokens", &c->limits.max_prompt_tokens));
    TS_RETURN_IF_ERROR(s.get("max_n", &c->limits.max_n));
    TS_RETURN_IF_ERROR(s.get("max_tokens", &c->limits.max_tokens));
    TS_RETURN_IF_ERROR(s.get("max_verify_tokens", &c->limits.max_verify_tokens));
    TS_RETURN_IF_ERROR(s.get("max_stop_strings", &c->limits.max_stop_strings));
    TS_RETURN_IF_ERROR(s.get("max_live_trees", &c->limits.max_live_trees));
    TS_RETURN_IF_ERROR(
        s.get("tree_search_score_timeout_ms", &c->limits.tree_search_score_timeout_ms));
    TS_RETURN_IF_ERROR(s.check_unknown());
  }
  TS_RETURN_IF_ERROR(sub_object(root, "scheduler", source, &obj));
  if (obj) {
    Section s(*obj, "scheduler.", source);
    TS_RETURN_IF_ERROR(s.get("max_step_tokens", &c->scheduler.max_step_tokens));
    TS_RETURN_IF_ERROR(s.get("max_step_rows", &c->scheduler.max_step_rows));
    TS_RETURN_IF_ERROR(s.get("default_max_tokens", &c->scheduler.default_max_tokens));
    TS_RETURN_IF_ERROR(s.check_unknown());
  }
  return Status::Ok();
}

Status load_config_file(const std::string& path, TreeserveConfig* config) {
  std::ifstream in(path);
  if (!in) return NotFound("config file " + path + " cannot be opened");
  std::stringstream ss;
  ss << in.rdbuf();
  return merge_config_json(ss.str(), path, config);
}

Status validate_listen_address(const std::string& address, const std::string& field) {
  auto bad = [&](const std::string& why) {
    return InvalidArgument(field + " '" + address + "' is not a valid listen address (" + why +
                           "); expected host:port, e.g. 127.0.0.1:50051 or [::1]:50051");
  };
  size_t colon = address.rfind(':');
  if (colon == std::string::npos) return bad("no port");
  std::string host = address.substr(0, colon);
  std::string port = address.substr(colon + 1);
  if (host.empty()) return bad("empty host");
  if (host.front() == '[' && host.back() != ']') return bad("unclosed [ in IPv6 host");
  if (host.front() != '[' && host.find(':') != std::string::npos) {
    return bad("IPv6 hosts must be written in brackets");
  }
  for (char ch : host) {
    if (ch == ' ' || ch == '/' || ch == '\t') return bad("invalid character in host");
  }
  if (port.empty() || port.size() > 5) return bad("port must be a number 0-65535");
  for (char ch : port) {
    if (ch < '0' || ch > '9') return bad("port must be a number 0-65535");
  }
  if (std::stoi(port) > 65535) return bad("port must be a number 0-65535");
  return Status::Ok();
}

Status validate_config(const TreeserveConfig& c) {
  TS_RETURN_IF_ERROR(validate_listen_address(c.server.listen, "listen"));
  if (!c.server.metrics_listen.empty()) {
    TS_RETURN_IF_ERROR(validate_listen_address(c.server.metrics_listen, "metrics_listen"));
  }
  if (!c.server.http_listen.empty()) {
    TS_RETURN_IF_ERROR(validate_listen_address(c.server.http_listen, "http_listen"));
  }
  if (c.server.http_threads < 1 || c.server.http_threads > 4096) {
    return InvalidArgument("server.http_threads must be in [1, 4096], got " +
                           std::to_string(c.server.http_threads));
  }
  TS_RETURN_IF_ERROR(check_replica_id(c.server.replica_id, "server.replica_id (--replica-id)"));
  const auto& b = c.engine.backend;
  if (b != "cpu" && b != "cuda" && b != "auto") {
    return InvalidArgument("backend must be cpu, cuda or auto, got '" + b + "'");
  }
  static const std::set<std::string> kLevels = {"trace", "debug",    "info", "warn",
                                                "error", "critical", "off"};
  if (!kLevels.count(c.log_level)) {
    return InvalidArgument(
        "log_level must be one of trace, debug, info, warn, error, critical, "
        "off; got '" +
        c.log_level + "'");
  }
  if (c.kv_cache.page_size < 1 || c.kv_cache.page_size > 256) {
    return InvalidArgument("kv_cache.page_size must be in [1, 256], got " +
                           std::to_string(c.kv_cache.page_size));
  }
  if (c.kv_cache.memory_bytes <= 0) {
    return InvalidArgument("kv_cache.memory_bytes must be positive");
  }
  if (StatusOr<KvCacheDtype> dtype =
          parse_kv_cache_dtype(c.kv_cache.dtype, "kv_cache.dtype (--kv-cache-dtype)");
      !dtype.ok()) {
    return dtype.status();
  }
  if (c.engine.tensor_parallel < 1) {
    return InvalidArgument("engine.tensor_parallel must be >= 1");
  }
  if (c.engine.cpu_threads < 0) return InvalidArgument("engine.cpu_threads must be >= 0");
  if (c.engine.gemm_split_k < 0 || c.engine.gemm_split_k > 8) {
    return InvalidArgument("engine.gemm_split_k must be in [0, 8] (0 = auto, 1 = off), got " +
                           std::to_string(c.engine.gemm_split_k));
  }
  if (c.engine.attention != "tree" && c.engine.attention != "baseline") {
    return InvalidArgument("engine.attention must be tree or baseline, got '" + c.engine.attention +
                           "'");
  }
  if (c.model.quantization != "auto" && c.model.quantization != "none" &&
      c.model.quantization != "fp8") {
    return InvalidArgument("model.quantization (--quantization) must be auto, none or fp8, got '" +
                           c.model.quantization + "'");
  }
  if (c.model.random_weights_seed < -1) {
    return InvalidArgument("model.random_weights_seed must be >= 0 (or -1 = off), got " +
                           std::to_string(c.model.random_weights_seed));
  }
  const auto& l = c.limits;
  if (l.max_prompt_tokens < 1 || l.max_n < 1 || l.max_tokens < 1 || l.max_verify_tokens < 1 ||
      l.max_stop_strings < 0 || l.max_live_trees < 1) {
    return InvalidArgument("limits.* must be positive");
  }
  if (c.scheduler.max_step_rows < 1) {
    return InvalidArgument("scheduler.max_step_rows must be >= 1");
  }
  if (c.scheduler.max_step_tokens < 1) {
    return InvalidArgument("scheduler.max_step_tokens must be >= 1");
  }
  if (c.scheduler.default_max_tokens < 1 || c.scheduler.default_max_tokens > l.max_tokens) {
    return InvalidArgument("scheduler.default_max_tokens must be in [1, limits.max_tokens]");
  }
  if (c.server.max_request_bytes != 0 && c.server.max_request_bytes < 1024) {
    return InvalidArgument("server.max_request_bytes must be 0 (derived) or at least 1024");
  }
  if (c.server.tls_cert_file.empty() != c.server.tls_key_file.empty()) {
    return InvalidArgument(
        "server.tls_cert_file and server.tls_key_file go together: set both (TLS) or neither");
  }
  if (!c.server.tls_client_ca_file.empty() && c.server.tls_cert_file.empty()) {
    return InvalidArgument(
        "server.tls_client_ca_file needs server.tls_cert_file and server.tls_key_file (mutual "
        "TLS is TLS with client certificates)");
  }
  // Leases are carried in milliseconds: at most ~100 years keeps every sum far from overflow.
  constexpr int64_t kLongestLeaseS = int64_t(100) * 365 * 86400;
  if (c.server.tree_lease_max_s < 1 || c.server.tree_lease_max_s > kLongestLeaseS) {
    return InvalidArgument("server.tree_lease_max_s must be in [1, " +
                           std::to_string(kLongestLeaseS) + "], got " +
                           std::to_string(c.server.tree_lease_max_s));
  }
  if (c.server.tree_lease_default_s < 1 ||
      c.server.tree_lease_default_s > c.server.tree_lease_max_s) {
    return InvalidArgument("server.tree_lease_default_s must be in [1, server.tree_lease_max_s = " +
                           std::to_string(c.server.tree_lease_max_s) + "], got " +
                           std::to_string(c.server.tree_lease_default_s));
  }
  if (c.limits.tree_search_score_timeout_ms < 1) {
    return InvalidArgument("limits.tree_search_score_timeout_ms must be >= 1, got " +
                           std::to_string(c.limits.tree_search_score_timeout_ms));
  }
  return Status::Ok();
}

std::string config_to_json(const TreeserveConfig& c) {
  nlohmann::json j = {{"log_level", c.log_level},
                      {"server",
                       {{"listen", c.server.listen},
                        {"metrics_listen", c.server.metrics_listen},
                        {"http_listen", c.server.http_listen},
                        {"http_threads", c.server.http_threads},
                        {"auth_token", c.server.auth_token.empty() ? "" : "<set>"},
                        {"keys_file", c.server.keys_file},
                        {"tls_cert_file", c.server.tls_cert_file},
                        {"tls_key_file", c.server.tls_key_file},
                        {"tls_client_ca_file", c.server.tls_client_ca_file},
                        {"max_request_bytes", c.server.max_request_bytes},
                        {"shutdown_grace_ms", c.server.shutdown_grace_ms},
                        {"tree_lease_default_s", c.server.tree_lease_default_s},
                        {"tree_lease_max_s", c.server.tree_lease_max_s},
                        {"replica_id", c.server.replica_id}}},
                      {"model",
                       {{"dir", c.model.dir},
                        {"chat_template", c.model.chat_template},
                        {"quantization", c.model.quantization}}},
                      {"engine",
                       {{"backend", c.engine.backend},
                        {"cpu_threads", c.engine.cpu_threads},
                        {"tensor_parallel", c.engine.tensor_parallel},
                        {"attention", c.engine.attention},
                        {"cuda_graphs", c.engine.cuda_graphs},
                        {"gemm_autotune", c.engine.gemm_autotune},
                        {"p2p_all_reduce", c.engine.p2p_all_reduce},
                        {"gemm_split_k", c.engine.gemm_split_k}}},
                      {"kv_cache",
                       {{"page_size", c.kv_cache.page_size},
                        {"memory_bytes", c.kv_cache.memory_bytes},
                        {"prefix_sharing", c.kv_cache.prefix_sharing},
                        {"dtype", c.kv_cache.dtype}}},
                      {"limits",
                       {{"max_prompt_tokens", c.limits.max_prompt_tokens},
                        {"max_n", c.limits.max_n},
                        {"max_tokens", c.limits.max_tokens},
                        {"max_verify_tokens", c.limits.max_verify_tokens},
                        {"max_stop_strings", c.limits.max_stop_strings},
                        {"max_live_trees", c.limits.max_live_trees},
                        {"tree_search_score_timeout_ms", c.limits.tree_search_score_timeout_ms}}},
                      {"scheduler",
                       {{"max_step_tokens", c.scheduler.max_step_tokens},
                        {"max_step_rows", c.scheduler.max_step_rows},
                        {"default_max_tokens", c.scheduler.default_max_tokens}}}};
  j["model"]["random_weights_seed"] = c.model.random_weights_seed;
  return j.dump();
}

}  // namespace treeserve
