// The HTTP listeners' shared set-up (server/http_listener.h).
#include "server/http_listener.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/ssl.h>
#include <sys/socket.h>

#include "server/tls.h"

namespace treeserve {

StatusOr<std::unique_ptr<httplib::Server>> make_http_server(const TlsMaterial* tls,
                                                            const std::string& what) {
  if (tls == nullptr) return std::make_unique<httplib::Server>();
  // The files load_tls_material checked (server/tls.h).
  auto https = std::make_unique<httplib::SSLServer>(
      [tls](SSL_CTX& ctx) { return configure_https_context(*tls, &ctx); });
  if (!https->is_valid()) {
    return InvalidArgument(what + ": cannot use the TLS certificate '" + tls->cert_file +
                           "' and key '" + tls->key_file + "'");
  }
  return std::unique_ptr<httplib::Server>(std::move(https));
}

StatusOr<int> bind_http_server(httplib::Server& server, const std::string& address,
                               const std::string& what) {
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  const int port = std::stoi(address.substr(colon + 1));
  int listening = -1;  // the socket bound last (the one kept)
  server.set_socket_options([&listening](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof(yes));
    listening = sock;
  });
  int bound = -1;
  if (port == 0) {
    bound = server.bind_to_any_port(host);
  } else {
    bound = server.bind_to_port(host, port) ? port : -1;
  }
  server.set_socket_options([](socket_t) {});  // `listening` goes out of scope
  if (bound < 0) {
    return Unavailable("cannot listen for " + what + " on " + address +
                       " (address in use, or not an address of this machine)");
  }
  // listen() again on the bound socket raises its backlog.
  if (listening >= 0) ::listen(listening, SOMAXCONN);
  return bound;
}

StatusOr<Principal> authenticate_http(Authenticator* auth, const httplib::Request& req) {
  if (auth == nullptr || !auth->enabled()) return Principal{};
  std::string value;
  std::string_view view;
  const std::string_view* authorization = nullptr;
  if (req.has_header("Authorization")) {
    value = req.get_header_value("Authorization");
    view = value;
    authorization = &view;
  }
  return auth->authenticate(authorization, req.remote_addr + ":" + std::to_string(req.remote_port),
                            req.method + " " + req.path);
}

}  // namespace treeserve
