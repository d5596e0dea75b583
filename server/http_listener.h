// What the server's two HTTP listeners (/metrics: metrics_http.h; the HTTP API: http_api.h)
// share, on cpp-httplib: the server object (HTTPS with the TLS files), binding host:port with
// the socket options they need, and the key check of a request.
#pragma once

#include <httplib.h>

#include <memory>
#include <string>

#include "common/status.h"
#include "server/auth.h"

namespace treeserve {

struct TlsMaterial;

// An HTTPS server with `tls` (null: plain HTTP). INVALID_ARGUMENT naming `what` ("metrics
// listener") when the TLS files cannot be used.
StatusOr<std::unique_ptr<httplib::Server>> make_http_server(const TlsMaterial* tls,
                                                            const std::string& what);

// Binds `address` (host:port, validated by the config; port 0 = any free one) and returns the
// port. SO_REUSEADDR but not SO_REUSEPORT (cpp-httplib's default sets both, with which a second
// server on the port would start and share it instead of failing), TCP_NODELAY (inherited by
// the connections: a response's parts, and each streamed event, go out at once instead of
// waiting on Nagle's algorithm for the client's delayed ACK), and a listen backlog of
// SOMAXCONN (cpp-httplib listens with 5: clients past it that connect at once wait a second
// for a SYN retransmission). UNAVAILABLE naming `what` when it cannot bind.
StatusOr<int> bind_http_server(httplib::Server& server, const std::string& address,
                               const std::string& what);

// The request's "Authorization: Bearer <key>" against `auth` (null or without keys: the
// default principal), with the HTTP peer and "<METHOD> <path>" in the failure log.
StatusOr<Principal> authenticate_http(Authenticator* auth, const httplib::Request& req);

}  // namespace treeserve
