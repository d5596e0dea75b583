// Authentication at the server's edge: the key a call carries ("authorization: Bearer <key>",
// as gRPC metadata or an HTTP header) -> the Principal it acts for, or UNAUTHENTICATED.
//
// Keys map to principals through a table keyed by the key's SHA-256: the keys of the keys file
// (server.keys_file; server/keys_file.h), each naming its tenant, and the single key of
// server.auth_token or $TREESERVE_API_KEY, whose tenant is "default". With no key configured
// authentication is off and every call acts for "default".
//
// Failures are counted (treeserve:auth_failures_total) and logged at warn, naming the peer and
// the method, at most one line per kAuthLogInterval with the count of those not logged.
#pragma once

#include <grpcpp/support/server_interceptor.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "server/config.h"
#include "server/keys_file.h"

namespace treeserve {

// The environment variable that holds the single API key (an alternative to
// server.auth_token that keeps the key out of config files).
inline constexpr const char* kApiKeyEnv = "TREESERVE_API_KEY";
inline constexpr std::chrono::seconds kAuthLogInterval{5};

// Who a call acts for.
struct Principal {
  std::string tenant = kDefaultTenant;
};

class Authenticator {
 public:
  // Keys from options.auth_token and env_api_key (the value of $TREESERVE_API_KEY, or null),
  // and those of `keys_file` (may be null): INVALID_ARGUMENT when both of the first two are
  // set, a key is empty where set or holds whitespace or control characters, or the single
  // key is also one of the file's. `registry` (may be null) gets
  // treeserve:auth_failures_total.
  static StatusOr<std::unique_ptr<Authenticator>> create(const ServerOptions& options,
                                                         const char* env_api_key,
                                                         MetricsRegistry* registry,
                                                         const KeysFile* keys_file = nullptr);

  // True when at least one key is configured; false: every call is the default principal.
  bool enabled() const { return !keys_.empty(); }
  // Where the keys came from, for the start-up log: "server.auth_token",
  // "$TREESERVE_API_KEY", "keys file keys.json (3 keys)", both joined by " and ", or "" (off).
  const std::string& source() const { return source_; }

  // `authorization`: the value of the call's authorization header or metadata, null when it
  // has none. `peer` and `method` name the call in the failure log.
  StatusOr<Principal> authenticate(const std::string_view* authorization, std::string_view peer,
                                   std::string_view method);

  // Counts and logs (rate-limited) a failure found elsewhere, such as a TLS handshake the
  // transport refused (a client without a certificate the client CA signed).
  void record_failure(std::string_view peer, std::string_view method, std::string_view why);

  int64_t failures() const { return failures_.load(); }

 private:
  Authenticator() = default;

  std::unordered_map<std::string, Principal> keys_;  // SHA-256 of a key -> its principal
  std::string source_;
  Counter* failures_metric_ = nullptr;
  std::atomic<int64_t> failures_{0};
  std::mutex log_mu_;
  std::chrono::steady_clock::time_point next_log_{};
  int64_t not_logged_ = 0;
};

// A server interceptor that authenticates calls to every method except those whose full
// name ("/package.Service/Method") starts with one of `open_prefixes` (the health service,
// and services that authenticate each call themselves). A call that fails is ended with
// UNAUTHENTICATED before its handler reads a message. It works on plaintext and TLS listeners
// alike (an AuthMetadataProcessor would need secure credentials). Calls pass untouched while
// `auth` is not enabled.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
make_auth_interceptor_factory(Authenticator* auth, std::vector<std::string> open_prefixes);

// True for a listen address ("host:port") that only this machine can reach: 127.0.0.0/8,
// [::1], localhost.
bool is_loopback_listen_address(const std::string& address);

}  // namespace treeserve
