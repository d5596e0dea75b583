// TLS for the server's listeners: the certificate, key and optional client CA named by
// server.tls_cert_file / tls_key_file / tls_client_ca_file, read and checked once at start
// (so a bad file stops the server with a message naming the key and the path, before it
// listens), then turned into gRPC server credentials and the HTTPS settings of the HTTP
// listeners (metrics, the HTTP API).
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>

#include "common/status.h"
#include "server/config.h"

struct ssl_ctx_st;  // OpenSSL's SSL_CTX

namespace treeserve {

struct TlsMaterial {
  std::string cert_file, key_file, client_ca_file;  // the paths, for the HTTPS listener
  std::string cert_pem;                             // the certificate chain, leaf first
  std::string key_pem;
  std::string client_ca_pem;  // empty: no client certificates are asked for
  std::string subject;        // the leaf certificate's subject, for the start-up log
  bool mutual() const { return !client_ca_pem.empty(); }
};

// Reads and checks the TLS files of `options`. Returns nothing (TLS off) when
// tls_cert_file is empty. INVALID_ARGUMENT naming the config key and path when a file cannot
// be read, holds no PEM certificate / private key (an encrypted key counts as none), or the
// key does not belong to the certificate. An expired certificate is logged at warn.
StatusOr<std::unique_ptr<TlsMaterial>> load_tls_material(const ServerOptions& options);

// TLS credentials from `tls` (with client_ca_pem: clients must present a certificate that
// CA signed), or insecure (plaintext) credentials when `tls` is null.
std::shared_ptr<grpc::ServerCredentials> make_server_credentials(const TlsMaterial* tls);

// Sets up an OpenSSL context of an HTTPS listener (metrics, the HTTP API) from `tls`: TLS 1.2
// or later, its certificate and key, and with a client CA, a client certificate that CA
// signed required. False when a file cannot be used.
bool configure_https_context(const TlsMaterial& tls, ssl_ctx_st* ctx);

}  // namespace treeserve
