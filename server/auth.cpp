// Keys -> principals, the rate-limited failure log, and the interceptor that guards the
// services that do not authenticate themselves (server/auth.h).
#include "server/auth.h"

#include <grpc/grpc.h>
#include <grpcpp/server_context.h>
#include <spdlog/spdlog.h>

#include <cctype>

namespace treeserve {
namespace {

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// "Bearer <key>" (the scheme in any case, then one or more spaces) -> <key>.
bool bearer_key(std::string_view value, std::string_view* key) {
  constexpr std::string_view kScheme = "bearer ";
  if (value.size() <= kScheme.size()) return false;
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(value[i])) != kScheme[i]) return false;
  }
  value.remove_prefix(kScheme.size());
  while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  *key = value;
  return !value.empty();
}

class AuthInterceptor final : public grpc::experimental::Interceptor {
 public:
  AuthInterceptor(grpc::experimental::ServerRpcInfo* info, Authenticator* auth)
      : info_(info), auth_(auth) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_INITIAL_METADATA)) {
      const auto* md = methods->GetRecvInitialMetadata();
      std::string_view value;
      const std::string_view* authorization = nullptr;
      if (md != nullptr) {
        auto it = md->find("authorization");
        if (it != md->end()) {
          value = std::string_view(it->second.data(), it->second.size());
          authorization = &value;
        }
      }
      grpc::ServerContextBase* ctx = info_->server_context();
      const char* method = info_->method() != nullptr ? info_->method() : "";
      StatusOr<Principal> who = auth_->authenticate(authorization, ctx->peer(), method);
      if (!who.ok()) {
        // Ends the call with this status: the client gets UNAUTHENTICATED and the message;
        // the handler's reads and writes fail, so it learns and sends nothing.
        grpc_call_cancel_with_status(ctx->c_call(), GRPC_STATUS_UNAUTHENTICATED,
                                     who.status().message().c_str(), nullptr);
      }
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* info_;
  Authenticator* auth_;
};

class AuthInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  AuthInterceptorFactory(Authenticator* auth, std::vector<std::string> open_prefixes)
      : auth_(auth), open_prefixes_(std::move(open_prefixes)) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    if (!auth_->enabled()) return nullptr;
    const std::string_view method = info->method() != nullptr ? info->method() : "";
    for (const std::string& prefix : open_prefixes_) {
      if (starts_with(method, prefix)) return nullptr;
    }
    return new AuthInterceptor(info, auth_);
  }

 private:
  Authenticator* auth_;
  std::vector<std::string> open_prefixes_;
};

}  // namespace

StatusOr<std::unique_ptr<Authenticator>> Authenticator::create(const ServerOptions& options,
                                                               const char* env_api_key,
                                                               MetricsRegistry* registry,
                                                               const KeysFile* keys_file) {
  std::unique_ptr<Authenticator> auth(new Authenticator());
  if (registry != nullptr) {
    auth->failures_metric_ = registry->counter(
        "treeserve:auth_failures_total",
        "Calls refused UNAUTHENTICATED (gRPC) or 401 (metrics): no key or a wrong one");
  }
  const bool from_env = env_api_key != nullptr;
  if (from_env && !options.auth_token.empty()) {
    return InvalidArgument(
        std::string("server.auth_token and $") + kApiKeyEnv +
        " are both set: set one of them (the environment variable keeps the key out of the "
        "config file)");
  }
  std::string key;
  if (from_env) {
    TS_RETURN_IF_ERROR(check_api_key(env_api_key, std::string("$") + kApiKeyEnv));
    key = env_api_key;
    auth->source_ = std::string("$") + kApiKeyEnv;
  } else if (!options.auth_token.empty()) {
    TS_RETURN_IF_ERROR(check_api_key(options.auth_token, "server.auth_token"));
    key = options.auth_token;
    auth->source_ = "server.auth_token";
  }
  if (!key.empty()) auth->keys_.emplace(sha256_digest(key), Principal{});
  if (keys_file != nullptr && !keys_file->keys.empty()) {
    for (size_t i = 0; i < keys_file->keys.size(); ++i) {
      const KeyEntry& k = keys_file->keys[i];
      if (!auth->keys_.emplace(k.sha256, Principal{k.tenant}).second) {
        return InvalidArgument(auth->source_ + " is also keys[" + std::to_string(i) +
                               "] of server.keys_file: give each key one tenant");
      }
    }
    auth->source_ += std::string(auth->source_.empty() ? "" : " and ") + "keys file " +
                     options.keys_file + " (" + std::to_string(keys_file->keys.size()) +
                     (keys_file->keys.size() == 1 ? " key)" : " keys)");
  }
  return auth;
}

StatusOr<Principal> Authenticator::authenticate(const std::string_view* authorization,
                                                std::string_view peer, std::string_view method) {
  if (!enabled()) return Principal{};
  std::string why;
  std::string_view key;
  if (authorization == nullptr) {
    why = "missing authorization metadata (expected 'Bearer <token>')";
  } else if (!bearer_key(*authorization, &key)) {
    why = "authorization metadata must be 'Bearer <token>'";
  } else {
    auto it = keys_.find(sha256_digest(key));
    if (it != keys_.end()) return it->second;
    why = "invalid auth token";
  }
  record_failure(peer, method, why);
  return Status(StatusCode::kUnauthenticated, why);
}

void Authenticator::record_failure(std::string_view peer, std::string_view method,
                                   std::string_view why) {
  ++failures_;
  if (failures_metric_ != nullptr) failures_metric_->inc();
  const auto now = std::chrono::steady_clock::now();
  int64_t not_logged = 0;
  {
    std::lock_guard<std::mutex> lock(log_mu_);
    if (now < next_log_) {
      ++not_logged_;
      return;
    }
    not_logged = not_logged_;
    not_logged_ = 0;
    next_log_ = now + kAuthLogInterval;
  }
  if (not_logged > 0) {
    spdlog::warn(
        "auth: refused {} from {}: {} ({} more refused calls not logged since the last "
        "line; at most one line per {} s)",
        method, peer, why, not_logged, kAuthLogInterval.count());
  } else {
    spdlog::warn("auth: refused {} from {}: {}", method, peer, why);
  }
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
make_auth_interceptor_factory(Authenticator* auth, std::vector<std::string> open_prefixes) {
  return std::make_unique<AuthInterceptorFactory>(auth, std::move(open_prefixes));
}

bool is_loopback_listen_address(const std::string& address) {
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon == std::string::npos ? address.size() : colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host == "localhost" || host == "::1" || starts_with(host, "127.");
}

}  // namespace treeserve
