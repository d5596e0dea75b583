// GET /metrics -> MetricsRegistry::render(), with cpp-httplib (its SSLServer for HTTPS).
#include "server/metrics_http.h"

#include <httplib.h>
#include <openssl/ssl.h>

#include "server/auth.h"
#include "server/tls.h"

namespace treeserve {

MetricsHttpServer::MetricsHttpServer(const MetricsRegistry* registry, Authenticator* auth,
                                     const TlsMaterial* tls)
    : registry_(registry), auth_(auth), tls_(tls) {}

MetricsHttpServer::~MetricsHttpServer() { stop(); }

Status MetricsHttpServer::start(const std::string& address) {
  size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  int port = std::stoi(address.substr(colon + 1));
  if (tls_ != nullptr) {
    // TLS 1.2 or later, the files load_tls_material checked; with a client CA, a client
    // certificate it signed is required.
    const TlsMaterial* tls = tls_;
    auto https = std::make_unique<httplib::SSLServer>([tls](SSL_CTX& ctx) {
      SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
      if (SSL_CTX_use_certificate_chain_file(&ctx, tls->cert_file.c_str()) != 1 ||
          SSL_CTX_use_PrivateKey_file(&ctx, tls->key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
          SSL_CTX_check_private_key(&ctx) != 1) {
        return false;
      }
      if (tls->mutual()) {
        if (SSL_CTX_load_verify_locations(&ctx, tls->client_ca_file.c_str(), nullptr) != 1) {
          return false;
        }
        SSL_CTX_set_verify(&ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
      }
      return true;
    });
    if (!https->is_valid()) {
      return InvalidArgument("metrics listener: cannot use the TLS certificate '" +
                             tls_->cert_file + "' and key '" + tls_->key_file + "'");
    }
    http_ = std::move(https);
  } else {
    http_ = std::make_unique<httplib::Server>();
  }
  http_->Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
    if (auth_ != nullptr && auth_->enabled()) {
      std::string value;
      std::string_view view;
      const std::string_view* authorization = nullptr;
      if (req.has_header("Authorization")) {
        value = req.get_header_value("Authorization");
        view = value;
        authorization = &view;
      }
      StatusOr<Principal> who = auth_->authenticate(
          authorization, req.remote_addr + ":" + std::to_string(req.remote_port), "GET /metrics");
      if (!who.ok()) {
        res.status = 401;
        res.set_header("WWW-Authenticate", "Bearer");
        res.set_content(who.status().message() + "\n", "text/plain");
        return;
      }
    }
    res.set_content(registry_->render(), "text/plain; version=0.0.4");
  });
  if (port == 0) {
    port_ = http_->bind_to_any_port(host);
  } else {
    port_ = http_->bind_to_port(host, port) ? port : -1;
  }
  if (port_ < 0) return Unavailable("cannot listen for metrics on " + address);
  thread_ = std::thread([this] { http_->listen_after_bind(); });
  return Status::Ok();
}

void MetricsHttpServer::stop() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace treeserve
