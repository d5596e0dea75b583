// The HTTP API's shared pieces (server/http_call.h): JSON fields, OpenAI-shaped errors, and
// Generate calls served whole or as server-sent events.
#include "server/http_call.h"

#include <cmath>
#include <limits>
#include <regex>

#include "common/route_key.h"
#include "server/http_listener.h"

namespace treeserve::http {

namespace {

using Clock = std::chrono::steady_clock;

const char* error_type(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
      return "invalid_request_error";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "authentication_error";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "permission_error";
    case grpc::StatusCode::NOT_FOUND:
      return "not_found_error";
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::ABORTED:
      return "conflict_error";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "rate_limit_error";
    case grpc::StatusCode::CANCELLED:
      return "cancelled_error";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "timeout_error";
    case grpc::StatusCode::UNAVAILABLE:
      return "service_unavailable_error";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "not_implemented_error";
    default:
      return "server_error";
  }
}

const char* code_name(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

// The HTTP name of a field of a TreeServe request: the sampling fields carry OpenAI's names
// at the top level, and a Prompt is one value (text, token ids or messages).
std::string http_field(std::string field) {
  if (field.rfind("sampling.", 0) == 0) field = field.substr(9);
  for (const char* prompt : {"prompt", "append"}) {
    const std::string p = prompt;
    for (const char* inner : {".text", ".tokens.ids", ".tokens"}) {
      if (field.rfind(p + inner, 0) == 0) field = p + field.substr(p.size() + strlen(inner));
    }
    // A conversation is the request's `messages`: prompt.messages.messages[2].role.
    for (const char* inner : {".messages.messages", ".messages"}) {
      if (field.rfind(p + inner, 0) == 0) {
        field = "messages" + field.substr(p.size() + strlen(inner));
        break;
      }
    }
  }
  return field;
}

std::string dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

int http_status_of(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return 200;
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::OUT_OF_RANGE:
      return 400;
    case grpc::StatusCode::UNAUTHENTICATED:
      return 401;
    case grpc::StatusCode::PERMISSION_DENIED:
      return 403;
    case grpc::StatusCode::NOT_FOUND:
      return 404;
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::ABORTED:
      return 409;
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return 429;
    case grpc::StatusCode::CANCELLED:
      return 499;
    case grpc::StatusCode::UNIMPLEMENTED:
      return 501;
    case grpc::StatusCode::UNAVAILABLE:
      return 503;
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return 504;
    default:
      return 500;
  }
}

HttpError make_error(grpc::StatusCode code, const std::string& message) {
  // "<field>: <why>" or "<field> = <value> <why>", the field a path such as sampling.stop[1]
  // or prompt.tokens.ids[3].
  static const std::regex kField(
      R"(^([A-Za-z_][A-Za-z0-9_]*(\[[0-9]+\])*(\.[A-Za-z_][A-Za-z0-9_]*(\[[0-9]+\])*)*)(: | = ))");
  std::smatch m;
  json param = nullptr;
  std::string text = message;
  if (std::regex_search(message, m, kField)) {
    const std::string field = http_field(m[1].str());
    param = field;
    text = field + message.substr(size_t(m[1].length()));
  }
  HttpError e;
  e.status = http_status_of(code);
  e.body = {{"error",
             {{"message", text},
              {"type", error_type(code)},
              {"param", param},
              {"code", code_name(code)}}}};
  return e;
}

HttpError make_error(const Status& status) {
  return make_error(static_cast<grpc::StatusCode>(static_cast<int>(status.code())),
                    status.message());
}

void write_json(httplib::Response& res, const json& body) {
  // With a charset: cpp-httplib compresses only a bare "application/json", and a streamed
  // body must not wait in a compressor.
  res.set_content(dump(body), "application/json; charset=utf-8");
}

void write_error(httplib::Response& res, const HttpError& error) {
  res.status = error.status;
  if (error.status == 401) res.set_header("WWW-Authenticate", "Bearer");
  write_json(res, error.body);
}

bool authenticate(const ApiContext& api, const httplib::Request& req, httplib::Response& res) {
  StatusOr<Principal> who = authenticate_http(api.auth, req);
  if (!who.ok()) {
    write_error(res, make_error(who.status()));
    return false;
  }
  // Routing keys go on to the service as metadata, which cannot carry every byte a header can:
  // a value that is not a key is refused here, with the service's message.
  const size_t routes = req.get_header_value_count(kRouteHeader);
  for (size_t i = 0; i < routes; ++i) {
    if (Status s = check_route_key(req.get_header_value(kRouteHeader, i)); !s.ok()) {
      write_error(res, make_error(s));
      return false;
    }
  }
  return true;
}

void prepare_context(const httplib::Request& req, grpc::ClientContext* ctx) {
  // Only a key the HTTP layer already accepted reaches here (or none, with keys off).
  if (req.has_header("Authorization")) {
    ctx->AddMetadata("authorization", req.get_header_value("Authorization"));
  }
  // Routing keys, checked by authenticate(); the service refuses more than one.
  const size_t routes = req.get_header_value_count(kRouteHeader);
  for (size_t i = 0; i < routes; ++i) {
    ctx->AddMetadata(kRouteHeader, req.get_header_value(kRouteHeader, i));
  }
}

// ---------------------------------------------------------------- JsonRequest

StatusOr<JsonRequest> JsonRequest::parse(const std::string& text) {
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) return JsonRequest(json::object());
  json value;
  try {
    value = json::parse(text);
  } catch (const json::exception& e) {
    return InvalidArgument(std::string("request body: not valid JSON (") + e.what() + ")");
  }
  if (!value.is_object()) return InvalidArgument("request body: must be a JSON object");
  return JsonRequest(std::move(value));
}

const json* JsonRequest::find(const char* key) const {
  auto it = obj_.find(key);
  if (it == obj_.end() || it->is_null()) return nullptr;
  return &*it;
}

namespace {

Status wrong_type(const std::string& field, const char* want, const json& got) {
  std::string shown = dump(got);
  if (shown.size() > 64) shown = shown.substr(0, 61) + "...";
  return InvalidArgument(field + ": must be " + want + ", got " + shown);
}

// An integral JSON number (2 or 2.0) in [lo, hi].
bool integer_of(const json& v, int64_t lo, int64_t hi, int64_t* out) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max()) || int64_t(u) > hi || int64_t(u) < lo) {
      return false;
    }
    *out = int64_t(u);
    return true;
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < lo || i > hi) return false;
    *out = i;
    return true;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || d < double(lo) || d > double(hi)) return false;
    *out = int64_t(d);
    return true;
  }
  return false;
}

}  // namespace

Status JsonRequest::get(const char* key, std::string* out) const {
  const json* v = find(key);
  if (v == nullptr) return Status::Ok();
  if (!v->is_string()) return wrong_type(key, "a string", *v);
  *out = v->get<std::string>();
  return Status::Ok();
}

Status JsonRequest::get(const char* key, bool* out) const {
  const json* v = find(key);
  if (v == nullptr) return Status::Ok();
  if (!v->is_boolean()) return wrong_type(key, "true or false", *v);
  *out = v->get<bool>();
  return Status::Ok();
}

Status JsonRequest::get(const char* key, double* out) const {
  const json* v = find(key);
  if (v == nullptr) return Status::Ok();
  if (!v->is_number()) return wrong_type(key, "a number", *v);
  *out = v->get<double>();
  return Status::Ok();
}

Status JsonRequest::get(const char* key, int64_t lo, int64_t hi, int64_t* out) const {
  const json* v = find(key);
  if (v == nullptr) return Status::Ok();
  if (!integer_of(*v, lo, hi, out)) {
    return wrong_type(
        key, ("an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]").c_str(),
        *v);
  }
  return Status::Ok();
}

Status JsonRequest::get_int32(const char* key, int32_t* out) const {
  int64_t v = *out;
  TS_RETURN_IF_ERROR(
      get(key, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(), &v));
  *out = int32_t(v);
  return Status::Ok();
}

Status JsonRequest::get_strings(const char* key, std::vector<std::string>* out) const {
  const json* v = find(key);
  if (v == nullptr) return Status::Ok();
  if (v->is_string()) {
    out->assign(1, v->get<std::string>());
    return Status::Ok();
  }
  return get_string_list(key, out);
}

Status JsonRequest::get_string_list(const char* key, std::vector<std::string>* out) const {
  const json* v = find(key);
  if (v == nullptr) return Status::Ok();
  if (!v->is_array()) return wrong_type(key, "a string or a list of strings", *v);
  out->clear();
  for (size_t i = 0; i < v->size(); ++i) {
    if (!(*v)[i].is_string()) {
      return wrong_type(std::string(key) + "[" + std::to_string(i) + "]", "a string", (*v)[i]);
    }
    out->push_back((*v)[i].get<std::string>());
  }
  return Status::Ok();
}

Status JsonRequest::get_ids(const char* key, std::vector<int32_t>* out) const {
  const json* v = find(key);
  if (v == nullptr) return Status::Ok();
  return ids_from_json(*v, key, out);
}

Status ids_from_json(const json& value, const std::string& field, std::vector<int32_t>* out) {
  if (!value.is_array()) return wrong_type(field, "a list of integers", value);
  out->clear();
  out->reserve(value.size());
  for (size_t i = 0; i < value.size(); ++i) {
    int64_t id = 0;
    if (!integer_of(value[i], std::numeric_limits<int32_t>::min(),
                    std::numeric_limits<int32_t>::max(), &id)) {
      return wrong_type(field + "[" + std::to_string(i) + "]", "a 32-bit integer", value[i]);
    }
    out->push_back(int32_t(id));
  }
  return Status::Ok();
}

Status prompt_from_json(const json& value, const std::string& field, v1::Prompt* out) {
  if (value.is_string()) {
    out->set_text(value.get<std::string>());
    return Status::Ok();
  }
  if (!value.is_array()) {
    return wrong_type(field, "a string or a list of token ids", value);
  }
  // OpenAI's batch forms with one element: ["text"] and [[ids]].
  if (!value.empty() && (value[0].is_string() || value[0].is_array())) {
    if (value.size() > 1) {
      return InvalidArgument(field + ": a batch of " + std::to_string(value.size()) +
                             " prompts; send one prompt per request (n forks one prompt)");
    }
    return prompt_from_json(value[0], field, out);
  }
  std::vector<int32_t> ids;
  TS_RETURN_IF_ERROR(ids_from_json(value, field, &ids));
  out->mutable_tokens()->mutable_ids()->Add(ids.begin(), ids.end());
  return Status::Ok();
}

Status messages_from_json(const json& value, const std::string& field, v1::ChatMessages* out) {
  if (!value.is_array()) return wrong_type(field, "a list of messages", value);
  for (size_t i = 0; i < value.size(); ++i) {
    const std::string at = field + "[" + std::to_string(i) + "]";
    const json& m = value[i];
    if (!m.is_object()) return wrong_type(at, "an object with role and content", m);
    v1::ChatMessage* msg = out->add_messages();
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return wrong_type(at + ".role", "a string", role == m.end() ? json(nullptr) : *role);
    }
    msg->set_role(role->get<std::string>());
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) continue;  // e.g. an assistant's tool call
    if (content->is_string()) {
      msg->set_content(content->get<std::string>());
      continue;
    }
    if (!content->is_array())
      return wrong_type(at + ".content", "a string or a list of parts", *content);
    std::string text;
    for (size_t j = 0; j < content->size(); ++j) {
      const std::string part_at = at + ".content[" + std::to_string(j) + "]";
      const json& part = (*content)[j];
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
          !part["text"].is_string()) {
        return InvalidArgument(part_at +
                               ": only {\"type\": \"text\", \"text\": ...} parts are "
                               "supported");
      }
      if (j > 0) text += "\n";
      text += part["text"].get<std::string>();
    }
    msg->set_content(std::move(text));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- GenerateCall

GenerateCall::GenerateCall(v1::TreeServe::Stub* stub, const httplib::Request& req,
                           const v1::GenerateRequest& request)
    : request_(request) {
  prepare_context(req, &ctx_);
  stub->async()->Generate(&ctx_, &request_, this);
  StartRead(&incoming_);
  StartCall();
}

GenerateCall::~GenerateCall() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!done_) {
    lock.unlock();
    ctx_.TryCancel();
    lock.lock();
  }
  cv_.wait(lock, [&] { return done_; });
}

void GenerateCall::OnReadDone(bool ok) {
  if (!ok) return;  // the end: OnDone follows
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(incoming_));
    cv_.notify_all();
  }
  incoming_.Clear();
  StartRead(&incoming_);
}

void GenerateCall::OnDone(const grpc::Status& status) {
  // Notified under the lock: once the destructor sees done_, nothing here touches *this.
  std::lock_guard<std::mutex> lock(mu_);
  status_ = status;
  done_ = true;
  cv_.notify_all();
}

GenerateCall::Wait GenerateCall::next(v1::GenerateResponse* out,
                                      std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !queue_.empty() || done_; });
  if (!queue_.empty()) {
    *out = std::move(queue_.front());
    queue_.pop_front();
    return Wait::kMessage;
  }
  return done_ ? Wait::kEnd : Wait::kTimeout;
}

// ---------------------------------------------------------------- serving a Generate call

std::string sse_event(const json& value) { return "data: " + dump(value) + "\n\n"; }

void serve_generate(std::shared_ptr<GenerateCall> call,
                    std::shared_ptr<GenerateFormatter> formatter, bool stream,
                    httplib::Response& res) {
  using Wait = GenerateCall::Wait;
  // Until the commit: the first message (streaming), the end, or kCommitAfter.
  auto early = std::make_shared<std::vector<v1::GenerateResponse>>();
  const auto commit_at = Clock::now() + kCommitAfter;
  bool ended = false;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(commit_at - Clock::now());
    if (left.count() <= 0) break;
    v1::GenerateResponse m;
    const Wait w = call->next(&m, left);
    if (w == Wait::kEnd) {
      ended = true;
      break;
    }
    if (w == Wait::kTimeout) break;
    early->push_back(std::move(m));
    if (stream) break;
  }
  if (ended && !call->status().ok()) {
    write_error(res, make_error(call->status().error_code(), call->status().error_message()));
    return;
  }
  if (ended && !stream) {
    for (const v1::GenerateResponse& m : *early) formatter->on_message(m);
    res.set_content(formatter->on_end(), "application/json; charset=utf-8");
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  if (stream) res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      stream ? "text/event-stream" : "application/json; charset=utf-8",
      [call, formatter, stream, early](size_t, httplib::DataSink& sink) {
        bool alive = true;
        auto last_write = Clock::now();
        auto send = [&](const std::string& bytes) {
          if (bytes.empty() || !alive) return;
          alive = sink.write(bytes.data(), bytes.size());
          last_write = Clock::now();
          if (!alive) call->cancel();  // the client went away: its branches stop
        };
        for (const v1::GenerateResponse& m : *early) {
          std::string out = formatter->on_message(m);
          if (stream) send(out);
        }
        early->clear();
        for (;;) {
          v1::GenerateResponse m;
          const Wait w = call->next(&m, kKeepAlive);
          if (w == Wait::kEnd) break;
          if (w == Wait::kMessage) {
            std::string out = formatter->on_message(m);
            if (stream) send(out);
          }
          if (alive && Clock::now() - last_write >= kKeepAlive) {
            send(stream ? ": keep-alive\n\n" : " ");
          }
        }
        if (!alive) return false;  // cpp-httplib closes the connection
        if (call->status().ok()) {
          send(formatter->on_end());
        } else {
          const HttpError e =
              make_error(call->status().error_code(), call->status().error_message());
          send(stream ? sse_event(e.body) + "data: [DONE]\n\n" : dump(e.body));
        }
        if (!alive) return false;
        sink.done();
        return true;
      });
}

}  // namespace treeserve::http
