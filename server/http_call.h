// Internals of the HTTP API (server/http_api.h) that its route files share: request fields
// read from JSON with errors naming the field, errors in OpenAI's JSON shape, unary TreeServe
// calls and Generate calls over the in-process channel, and serving a Generate call as a
// whole JSON response or as server-sent events.
#pragma once

#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "proto/treeserve.grpc.pb.h"

namespace treeserve {

class Authenticator;
class DetokenizerVocab;
class Tokenizer;

namespace http {

using nlohmann::json;

// A response that takes longer than this to finish starts anyway (200, then the body as it
// comes), so that the connection can be watched for a client that went away; before it the
// status is still open, and a call that fails gets its own (the error's HTTP status).
inline constexpr std::chrono::milliseconds kCommitAfter{1000};
// After this long without a byte written, a committed response writes a keep-alive (an SSE
// comment, or a space before a JSON body): a write to a closed connection fails, and the
// call is cancelled. TCP reports a peer's close on the second write after it, so a client that
// goes away is noticed within about two intervals.
inline constexpr std::chrono::milliseconds kKeepAlive{250};

// What every route reads.
struct ApiContext {
  v1::TreeServe::Stub* stub = nullptr;
  Authenticator* auth = nullptr;  // null: no keys
  const Tokenizer* tokenizer = nullptr;
  // The streaming detokenizer table, set once the model is loaded (null before).
  std::atomic<const DetokenizerVocab*> vocab{nullptr};
  std::string model_name;
  int64_t created_unix_s = 0;  // when the server started (GET /v1/models)
};

// ---------------------------------------------------------------- errors

// An HTTP error in OpenAI's shape:
// {"error": {"message", "type", "param", "code"}}, code the gRPC status code's name.
struct HttpError {
  int status = 500;
  json body;
};
// The HTTP status of a gRPC code (docs/http-api.md, Errors).
int http_status_of(grpc::StatusCode code);
// From a message "<field>: <why>" (the service's, or this layer's): param is the field under
// its HTTP name (rename maps the gRPC request's field names: sampling.max_tokens ->
// max_tokens, prompt.text -> prompt), and the message starts with that name.
HttpError make_error(grpc::StatusCode code, const std::string& message);
HttpError make_error(const Status& status);
void write_error(httplib::Response& res, const HttpError& error);
inline void write_error(httplib::Response& res, grpc::StatusCode code, const std::string& msg) {
  write_error(res, make_error(code, msg));
}
void write_json(httplib::Response& res, const json& body);

// "Authorization: Bearer <key>" against the server's keys, with the HTTP peer in the failure
// log; on failure writes 401 and returns false. Then each x-treeserve-route value: one that is
// not a routing key gets 400 naming the header (common/route_key.h).
bool authenticate(const ApiContext& api, const httplib::Request& req, httplib::Response& res);

// A client context for a TreeServe call on behalf of `req`: its authorization and routing key
// forwarded.
void prepare_context(const httplib::Request& req, grpc::ClientContext* ctx);

// ---------------------------------------------------------------- request fields

// A JSON request body. Accessors leave *out alone when the key is absent or null (the
// defaults stay), and return INVALID_ARGUMENT naming the key for a value of the wrong type.
class JsonRequest {
 public:
  // INVALID_ARGUMENT unless `text` is a JSON object ("" reads as {}).
  static StatusOr<JsonRequest> parse(const std::string& text);
  explicit JsonRequest(json object) : obj_(std::move(object)) {}

  // The value, or null when absent or JSON null.
  const json* find(const char* key) const;
  bool has(const char* key) const { return find(key) != nullptr; }
  Status get(const char* key, std::string* out) const;
  Status get(const char* key, bool* out) const;
  Status get(const char* key, double* out) const;
  // An integer within [lo, hi] (a JSON number without a fraction).
  Status get(const char* key, int64_t lo, int64_t hi, int64_t* out) const;
  Status get_int32(const char* key, int32_t* out) const;
  // A string, or a list of strings.
  Status get_strings(const char* key, std::vector<std::string>* out) const;
  // A list of strings.
  Status get_string_list(const char* key, std::vector<std::string>* out) const;
  // A list of integers that fit int32 (token ids, parent indices).
  Status get_ids(const char* key, std::vector<int32_t>* out) const;
  const json& object() const { return obj_; }

 private:
  json obj_;
};

// `value` as token ids (a list of int32 integers), naming `field` (and the index) otherwise.
Status ids_from_json(const json& value, const std::string& field, std::vector<int32_t>* out);
// A prompt given as text or token ids -> the Prompt message.
Status prompt_from_json(const json& value, const std::string& field, v1::Prompt* out);
// OpenAI's messages (role and content: a string, or text parts, joined by newlines) -> the
// ChatMessages of a Prompt, rendered by the service with the model's chat template.
Status messages_from_json(const json& value, const std::string& field, v1::ChatMessages* out);

// ---------------------------------------------------------------- Generate calls

// One Generate call over the in-process channel, read through gRPC's callback API into a
// queue, so the HTTP thread can wait on it with a timeout (and write keep-alives meanwhile).
class GenerateCall : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  enum class Wait { kMessage, kEnd, kTimeout };
  GenerateCall(v1::TreeServe::Stub* stub, const httplib::Request& req,
               const v1::GenerateRequest& request);
  ~GenerateCall() override;  // cancels the call if it still runs, and waits for its end

  Wait next(v1::GenerateResponse* out, std::chrono::milliseconds timeout);
  // The call's status once next() returned kEnd.
  const grpc::Status& status() const { return status_; }
  // Ends the call (the service sees a cancelled call: its branches stop within a step).
  void cancel() { ctx_.TryCancel(); }

  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  grpc::ClientContext ctx_;
  v1::GenerateRequest request_;
  v1::GenerateResponse incoming_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<v1::GenerateResponse> queue_;
  bool done_ = false;
  grpc::Status status_;
};

// How a route turns a Generate call's messages into its response.
class GenerateFormatter {
 public:
  virtual ~GenerateFormatter() = default;
  // A message. Streaming: the SSE bytes to send for it now ("" = none).
  virtual std::string on_message(const v1::GenerateResponse& message) = 0;
  // The call ended OK. Streaming: the last SSE events (the "data: [DONE]" line included);
  // whole: the response body.
  virtual std::string on_end() = 0;
};

// Serves a started Generate call as the response to its HTTP request. It waits for the first
// message, the end, or kCommitAfter: a call that failed by then gets the error's status;
// a whole response that is complete gets 200 and its body. Otherwise the response starts (200,
// chunked): server-sent events (`stream`), or the JSON body once complete behind spaces; a
// failure after that is a last event `data: {"error": ...}`, or the error object as the body.
// A write that fails (the client went away) cancels the call.
void serve_generate(std::shared_ptr<GenerateCall> call,
                    std::shared_ptr<GenerateFormatter> formatter, bool stream,
                    httplib::Response& res);

// "data: <json>\n\n".
std::string sse_event(const json& value);

// ---------------------------------------------------------------- route sets

// GET /v1/models, POST /v1/completions, POST /v1/chat/completions (http_openai.cpp).
void add_openai_routes(httplib::Server& server, ApiContext& api);
// GET /v1/server and the tree API, /v1/trees... (http_trees.cpp).
void add_tree_routes(httplib::Server& server, ApiContext& api);

}  // namespace http
}  // namespace treeserve
