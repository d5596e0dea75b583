// The HTTP listener (server/http_api.h): cpp-httplib's server (its SSLServer for HTTPS), a
// pool of server.http_threads connection threads, the routes, and the answers for what no
// route takes.
#include "server/http_api.h"

#include <spdlog/spdlog.h>

#include <ctime>

#include "common/route_key.h"
#include "server/http_call.h"
#include "server/http_listener.h"
#include "server/viewer_assets.h"

namespace treeserve {

namespace {

std::string content_type_of(std::string_view name) {
  auto ends = [&](std::string_view ext) {
    return name.size() >= ext.size() && name.substr(name.size() - ext.size()) == ext;
  };
  if (ends(".html")) return "text/html; charset=utf-8";
  if (ends(".js")) return "text/javascript; charset=utf-8";
  if (ends(".css")) return "text/css; charset=utf-8";
  if (ends(".svg")) return "image/svg+xml";
  if (ends(".json")) return "application/json; charset=utf-8";
  if (ends(".png")) return "image/png";
  if (ends(".txt") || ends("LICENSE")) return "text/plain; charset=utf-8";
  return "application/octet-stream";
}

// GET /viewer, /viewer/ and /viewer/<file>: the files compiled in; no key needed (they hold
// no data: the page asks the API for it, with the key the user gives it).
void add_viewer_routes(httplib::Server& server) {
  auto serve = [](const std::string& name, httplib::Response& res) {
    for (const EmbeddedFile& f : viewer_files()) {
      if (f.name == name) {
        res.set_content(std::string(f.data), content_type_of(f.name));
        res.set_header("Cache-Control", "no-cache");
        return;
      }
    }
    http::write_error(res, grpc::StatusCode::NOT_FOUND, "path: no viewer file '" + name + "'");
  };
  server.Get(R"(/viewer/?)", [serve](const httplib::Request&, httplib::Response& res) {
    serve("index.html", res);
  });
  server.Get(
      R"(/viewer/([A-Za-z0-9_.-]+))",
      [serve](const httplib::Request& req, httplib::Response& res) { serve(req.matches[1], res); });
}

}  // namespace

HttpApiServer::HttpApiServer(std::shared_ptr<grpc::Channel> channel, Authenticator* auth,
                             const TlsMaterial* tls, const Tokenizer* tokenizer,
                             HttpApiOptions options)
    : channel_(std::move(channel)),
      stub_(v1::TreeServe::NewStub(channel_)),
      tls_(tls),
      options_(std::move(options)),
      api_(std::make_unique<http::ApiContext>()) {
  api_->stub = stub_.get();
  api_->auth = auth;
  api_->tokenizer = tokenizer;
  api_->model_name = options_.model_name;
  api_->created_unix_s = int64_t(std::time(nullptr));
}

HttpApiServer::~HttpApiServer() { stop(); }

void HttpApiServer::set_ready(const DetokenizerVocab* vocab) {
  api_->vocab = vocab;
  ready_ = true;
}

Status HttpApiServer::start(const std::string& address) {
  StatusOr<std::unique_ptr<httplib::Server>> server = make_http_server(tls_, "HTTP listener");
  if (!server.ok()) return server.status();
  http_ = std::move(*server);
  httplib::Server& s = *http_;
  const int threads = options_.threads;
  s.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  s.set_payload_max_length(size_t(options_.max_body_bytes));
  // Keep-alive connections serve many requests (cpp-httplib's default closes after 5).
  s.set_keep_alive_max_count(100000);
  s.set_keep_alive_timeout(5);
  // A client that stops reading a stream for this long is gone: the write fails, the call ends.
  s.set_write_timeout(30, 0);
  // Every response names the replica that wrote it, as the gRPC API's metadata does.
  s.set_post_routing_handler(
      [replica = options_.replica_id](const httplib::Request&, httplib::Response& res) {
        res.set_header(kReplicaHeader, replica);
      });

  s.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    http::write_json(res, {{"status", "ok"}});
  });
  s.Get("/ready", [this](const httplib::Request&, httplib::Response& res) {
    if (ready_.load()) {
      http::write_json(res, {{"status", "ready"}});
    } else {
      res.status = 503;
      http::write_json(res, {{"status", "loading"}});
    }
  });
  http::add_openai_routes(s, *api_);
  http::add_tree_routes(s, *api_);
  add_viewer_routes(s);

  // What no route answered (an unknown path, a wrong method, a body over the limit), and an
  // exception escaping a handler, in the same error shape.
  s.set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        grpc::StatusCode code = grpc::StatusCode::NOT_FOUND;
        std::string message = "path: no route for " + req.method + " " + req.path;
        if (res.status == 413) {
          message = "request body: larger than this server takes (server.max_request_bytes)";
          // cpp-httplib reads a form-encoded body (curl -d's default type) as form fields,
          // and takes at most 8 KiB of it.
          const std::string type = req.get_header_value("Content-Type");
          if (type.rfind("application/x-www-form-urlencoded", 0) == 0) {
            message =
                "request body: sent as a form (application/x-www-form-urlencoded), which is "
                "limited to 8 KiB; send it as Content-Type: application/json";
          }
          code = grpc::StatusCode::INVALID_ARGUMENT;
        } else if (res.status == 400) {
          message = "request: not a valid HTTP request";
          code = grpc::StatusCode::INVALID_ARGUMENT;
        }
        const int status = res.status;
        http::write_error(res, http::make_error(code, message));
        res.status = status;
        return httplib::Server::HandlerResponse::Handled;
      }));
  s.set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        spdlog::error("HTTP {} {}: {}", req.method, req.path, what);
        http::write_error(res, grpc::StatusCode::INTERNAL, "internal error: " + what);
      });

  StatusOr<int> port = bind_http_server(s, address, "HTTP");
  if (!port.ok()) return port.status();
  port_ = *port;
  thread_ = std::thread([this] { http_->listen_after_bind(); });
  return Status::Ok();
}

void HttpApiServer::stop() {
  if (http_) http_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace treeserve
