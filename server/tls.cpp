// Reading and checking the TLS files with OpenSSL; gRPC credentials from them (server/tls.h).
#include "server/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

namespace treeserve {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using Bio = std::unique_ptr<BIO, BioFree>;
using Cert = std::unique_ptr<X509, X509Free>;
using Pkey = std::unique_ptr<EVP_PKEY, PkeyFree>;

// Never prompt on the terminal for a passphrase: an encrypted key is an error.
int no_passphrase(char*, int, int, void*) { return -1; }

Status read_file(const std::string& key, const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return InvalidArgument(key + ": cannot read '" + path + "' (" + std::strerror(errno) + ")");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  return Status::Ok();
}

Bio memory_bio(const std::string& pem) {
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// Every certificate in `pem`, in order.
std::vector<Cert> read_certs(const std::string& pem) {
  std::vector<Cert> certs;
  Bio bio = memory_bio(pem);
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, no_passphrase, nullptr)) {
    certs.emplace_back(x);
  }
  ERR_clear_error();  // the read that ends the loop leaves "no start line" queued
  return certs;
}

std::string subject_of(X509* cert) {
  char buf[256];
  X509_NAME_oneline(X509_get_subject_name(cert), buf, sizeof(buf));
  return buf;
}

}  // namespace

StatusOr<std::unique_ptr<TlsMaterial>> load_tls_material(const ServerOptions& options) {
  if (options.tls_cert_file.empty()) return std::unique_ptr<TlsMaterial>();
  auto tls = std::make_unique<TlsMaterial>();
  tls->cert_file = options.tls_cert_file;
  tls->key_file = options.tls_key_file;
  tls->client_ca_file = options.tls_client_ca_file;
  TS_RETURN_IF_ERROR(read_file("server.tls_cert_file", tls->cert_file, &tls->cert_pem));
  TS_RETURN_IF_ERROR(read_file("server.tls_key_file", tls->key_file, &tls->key_pem));
  std::vector<Cert> chain = read_certs(tls->cert_pem);
  if (chain.empty()) {
    return InvalidArgument("server.tls_cert_file: '" + tls->cert_file +
                           "' holds no PEM certificate (-----BEGIN CERTIFICATE-----)");
  }
  Pkey key;
  {
    Bio bio = memory_bio(tls->key_pem);
    key.reset(PEM_read_bio_PrivateKey(bio.get(), nullptr, no_passphrase, nullptr));
    ERR_clear_error();
  }
  if (!key) {
    return InvalidArgument("server.tls_key_file: '" + tls->key_file +
                           "' holds no unencrypted PEM private key");
  }
  if (X509_check_private_key(chain.front().get(), key.get()) != 1) {
    ERR_clear_error();
    return InvalidArgument("server.tls_key_file: the key in '" + tls->key_file +
                           "' does not belong to the certificate in '" + tls->cert_file + "'");
  }
  tls->subject = subject_of(chain.front().get());
  if (X509_cmp_current_time(X509_get0_notAfter(chain.front().get())) < 0) {
    spdlog::warn("server.tls_cert_file: the certificate in '{}' ({}) has expired", tls->cert_file,
                 tls->subject);
  }
  if (!tls->client_ca_file.empty()) {
    TS_RETURN_IF_ERROR(
        read_file("server.tls_client_ca_file", tls->client_ca_file, &tls->client_ca_pem));
    if (read_certs(tls->client_ca_pem).empty()) {
      return InvalidArgument("server.tls_client_ca_file: '" + tls->client_ca_file +
                             "' holds no PEM certificate (-----BEGIN CERTIFICATE-----)");
    }
  }
  return tls;
}

std::shared_ptr<grpc::ServerCredentials> make_server_credentials(const TlsMaterial* tls) {
  if (tls == nullptr) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      tls->mutual() ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                    : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  options.pem_root_certs = tls->client_ca_pem;
  options.pem_key_cert_pairs.push_back({tls->key_pem, tls->cert_pem});
  return grpc::SslServerCredentials(options);
}

bool configure_https_context(const TlsMaterial& tls, SSL_CTX* ctx) {
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx, tls.cert_file.c_str()) != 1 ||
      SSL_CTX_use_PrivateKey_file(ctx, tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_check_private_key(ctx) != 1) {
    return false;
  }
  if (tls.mutual()) {
    if (SSL_CTX_load_verify_locations(ctx, tls.client_ca_file.c_str(), nullptr) != 1) {
      return false;
    }
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return true;
}

}  // namespace treeserve
