// OpenAI's completions and chat completions (docs/http-api.md): the request becomes a one-shot
// Generate (one prefill, n forks sharing the prompt's KV), run by the TreeServe service over
// the in-process channel; its token messages become OpenAI's response, whole or as
// server-sent events.
#include <cmath>
#include <ctime>
#include <limits>
#include <map>

#include "common/random_id.h"
#include "models/detokenizer.h"
#include "models/tokenizer.h"
#include "server/http_call.h"

namespace treeserve::http {

namespace {

// What the request asked of the response.
struct ResponseShape {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;     // per-token logprobs
  int32_t top_logprobs = 0;  // alternatives per token
  bool token_ids = false;    // vLLM's return_token_ids: each choice's token ids
};

// A field OpenAI defines that this server does not implement: refused unless it holds its
// neutral value, so a request never silently means something else.
Status refuse_unless(const JsonRequest& body, const char* key, const json& neutral) {
  const json* v = body.find(key);
  if (v == nullptr || *v == neutral) return Status::Ok();
  if (v->is_object() && v->empty() && neutral.is_object()) return Status::Ok();
  return InvalidArgument(std::string(key) + ": not supported by this server (only " +
                         neutral.dump() + ")");
}

uint64_t random_seed() {
  uint64_t seed = 0;
  random_bytes(&seed, sizeof(seed));
  return seed;
}

// The request's fields -> a one-shot GenerateRequest and the response's shape. Types are
// checked here (an error names the field); values the service checks (ranges, limits, the
// vocabulary) are its to refuse, with the same messages gRPC callers get.
Status parse_request(const JsonRequest& body, bool chat, v1::GenerateRequest* out,
                     ResponseShape* shape) {
  shape->chat = chat;
  std::string model;
  TS_RETURN_IF_ERROR(body.get("model", &model));  // one model: any name is served by it
  if (chat) {
    const json* messages = body.find("messages");
    if (messages == nullptr) return InvalidArgument("messages: required");
    v1::ChatMessages* chat_messages = out->mutable_prompt()->mutable_messages();
    TS_RETURN_IF_ERROR(messages_from_json(*messages, "messages", chat_messages));
    bool add_generation_prompt = true;  // vLLM's extension: false to continue the last turn
    TS_RETURN_IF_ERROR(body.get("add_generation_prompt", &add_generation_prompt));
    chat_messages->set_add_generation_prompt(add_generation_prompt);
  } else {
    const json* prompt = body.find("prompt");
    if (prompt == nullptr) return InvalidArgument("prompt: required");
    TS_RETURN_IF_ERROR(prompt_from_json(*prompt, "prompt", out->mutable_prompt()));
  }
  int32_t n = 1;
  TS_RETURN_IF_ERROR(body.get_int32("n", &n));
  if (n < 1) return InvalidArgument("n: must be >= 1, got " + std::to_string(n));
  out->set_n(n);

  v1::SamplingParams* s = out->mutable_sampling();
  int32_t max_tokens = 0;
  TS_RETURN_IF_ERROR(body.get_int32("max_tokens", &max_tokens));
  const char* max_field = "max_tokens";
  if (body.has("max_completion_tokens")) {
    TS_RETURN_IF_ERROR(body.get_int32("max_completion_tokens", &max_tokens));
    max_field = "max_completion_tokens";
  }
  if (body.has(max_field) && max_tokens < 1) {
    return InvalidArgument(std::string(max_field) + ": must be >= 1, got " +
                           std::to_string(max_tokens));
  }
  s->set_max_tokens(max_tokens);          // absent: 0, the server's default
  double temperature = 1.0, top_p = 1.0;  // OpenAI's defaults
  TS_RETURN_IF_ERROR(body.get("temperature", &temperature));
  TS_RETURN_IF_ERROR(body.get("top_p", &top_p));
  s->set_temperature(float(temperature));
  s->set_top_p(float(top_p));
  int32_t top_k = 0;
  TS_RETURN_IF_ERROR(body.get_int32("top_k", &top_k));
  s->set_top_k(top_k == -1 ? 0 : top_k);  // vLLM's -1 = off
  // No seed: a fresh one, so that unseeded requests differ as OpenAI's do.
  if (body.has("seed")) {
    int64_t seed = 0;
    TS_RETURN_IF_ERROR(body.get("seed", std::numeric_limits<int64_t>::min(),
                                std::numeric_limits<int64_t>::max(), &seed));
    s->set_seed(uint64_t(seed));
  } else {
    s->set_seed(random_seed());
  }
  std::vector<std::string> stop;
  TS_RETURN_IF_ERROR(body.get_strings("stop", &stop));
  for (std::string& one : stop) s->add_stop(std::move(one));
  std::vector<int32_t> stop_ids;
  TS_RETURN_IF_ERROR(body.get_ids("stop_token_ids", &stop_ids));  // vLLM's extension
  s->mutable_stop_token_ids()->Add(stop_ids.begin(), stop_ids.end());

  if (chat) {
    TS_RETURN_IF_ERROR(body.get("logprobs", &shape->logprobs));
    TS_RETURN_IF_ERROR(body.get_int32("top_logprobs", &shape->top_logprobs));
    if (body.has("top_logprobs") && !shape->logprobs) {
      return InvalidArgument("top_logprobs: needs logprobs: true");
    }
  } else if (body.has("logprobs")) {
    TS_RETURN_IF_ERROR(body.get_int32("logprobs", &shape->top_logprobs));
    shape->logprobs = true;
  }
  if (shape->top_logprobs < 0) {
    return InvalidArgument(std::string(chat ? "top_logprobs" : "logprobs") + ": must be >= 0");
  }
  s->set_logprobs(shape->top_logprobs);

  TS_RETURN_IF_ERROR(body.get("stream", &shape->stream));
  if (const json* so = body.find("stream_options")) {
    if (!shape->stream) return InvalidArgument("stream_options: only with stream: true");
    if (!so->is_object()) return InvalidArgument("stream_options: must be an object");
    JsonRequest options(*so);
    Status s_usage = options.get("include_usage", &shape->include_usage);
    if (!s_usage.ok()) return InvalidArgument("stream_options." + s_usage.message());
  }
  TS_RETURN_IF_ERROR(body.get("return_token_ids", &shape->token_ids));

  TS_RETURN_IF_ERROR(refuse_unless(body, "echo", false));
  TS_RETURN_IF_ERROR(refuse_unless(body, "suffix", ""));
  TS_RETURN_IF_ERROR(refuse_unless(body, "presence_penalty", 0));
  TS_RETURN_IF_ERROR(refuse_unless(body, "frequency_penalty", 0));
  TS_RETURN_IF_ERROR(refuse_unless(body, "logit_bias", json::object()));
  TS_RETURN_IF_ERROR(refuse_unless(body, "tools", json::array()));
  if (const json* best_of = body.find("best_of")) {
    if (*best_of != 1 && *best_of != n) {
      return InvalidArgument("best_of: not supported by this server (use n)");
    }
  }
  return Status::Ok();
}

const char* finish_name(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_LENGTH:
      return "length";
    case v1::FINISH_STOP:
    case v1::FINISH_EOS:
      return "stop";
    default:
      return "abort";  // cancelled or pruned (vLLM's name)
  }
}

// A token's own text and bytes (for logprobs): the text it adds after a plain piece, so a
// leading space shows; bytes of a character split over tokens are the raw ones.
struct TokenText {
  std::string text;
  std::string bytes;
};

TokenText token_text(const ApiContext& api, int32_t id) {
  TokenText out;
  const DetokenizerVocab* vocab = api.vocab.load();
  if (vocab != nullptr && vocab->plain_text(id) != nullptr) {
    out.text = *vocab->plain_text(id);
  } else if (vocab != nullptr && vocab->anchor() >= 0) {
    StatusOr<std::string> t = api.tokenizer->decode({vocab->anchor(), id});
    if (t.ok()) out.text = t->substr(std::min(vocab->anchor_text().size(), t->size()));
  } else {
    StatusOr<std::string> t = api.tokenizer->decode({id});
    if (t.ok()) out.text = *t;
  }
  const std::string_view raw = api.tokenizer->token_bytes(id);
  out.bytes = raw.empty() ? out.text : std::string(raw);
  return out;
}

json byte_list(const std::string& bytes) {
  json list = json::array();
  for (unsigned char c : bytes) list.push_back(int(c));
  return list;
}

int64_t utf8_length(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

// One choice of the response, built up from its branch's messages.
struct Choice {
  int index = 0;
  std::string text;
  std::vector<int32_t> token_ids;
  json logprobs;  // completions: {tokens, token_logprobs, top_logprobs, text_offset}; chat: [..]
  std::string finish_reason;
  bool started = false;  // chat streaming: the role was sent
};

// Turns the Generate messages into OpenAI's completion or chat completion.
class OpenAiFormatter : public GenerateFormatter {
 public:
  OpenAiFormatter(const ApiContext& api, ResponseShape shape)
      : api_(api),
        shape_(shape),
        id_(random_id(shape.chat ? "chatcmpl-" : "cmpl-")),
        created_(int64_t(std::time(nullptr))) {}

  std::string on_message(const v1::GenerateResponse& m) override {
    if (m.prompt_tokens() > 0) {
      prompt_tokens_ = m.prompt_tokens();
      cached_tokens_ = m.cached_tokens();
    }
    auto [it, fresh] = by_branch_.try_emplace(m.branch_id(), int(choices_.size()));
    if (fresh) {
      choices_.emplace_back();
      choices_.back().index = it->second;
    }
    Choice& c = choices_[size_t(it->second)];
    const bool token = m.token_id() >= 0;
    json lp = nullptr;
    if (token) {
      ++completion_tokens_;
      c.token_ids.push_back(m.token_id());
      if (shape_.logprobs) lp = logprobs_of(m, c);
    }
    const size_t text_before = c.text.size();
    c.text += m.text();
    if (m.finish_reason() != v1::FINISH_NONE) c.finish_reason = finish_name(m.finish_reason());
    if (!shape_.stream) return "";

    json fr = c.finish_reason.empty() ? json(nullptr) : json(c.finish_reason);
    std::string out;
    json choice = {{"index", c.index}, {"logprobs", lp}, {"finish_reason", fr}};
    if (shape_.chat) {
      json delta = json::object();
      if (!c.started) {
        c.started = true;
        delta["role"] = "assistant";
        delta["content"] = "";
        if (m.text().empty() && lp.is_null() && fr.is_null()) return chunk(choice, delta);
        out = chunk({{"index", c.index}, {"logprobs", nullptr}, {"finish_reason", nullptr}}, delta);
        delta = json::object();
      }
      if (!m.text().empty()) delta["content"] = m.text();
      if (m.text().empty() && lp.is_null() && fr.is_null() && !shape_.token_ids) return out;
      if (shape_.token_ids && token) choice["token_ids"] = {m.token_id()};
      return out + chunk(choice, delta);
    }
    if (m.text().empty() && lp.is_null() && fr.is_null() && !shape_.token_ids) return "";
    choice["text"] = c.text.substr(text_before);
    if (shape_.token_ids && token) choice["token_ids"] = {m.token_id()};
    return chunk(choice, nullptr);
  }

  std::string on_end() override {
    if (shape_.stream) {
      std::string out;
      if (shape_.include_usage) {
        json last = header();
        last["choices"] = json::array();
        last["usage"] = usage();
        out += sse_event(last);
      }
      return out + "data: [DONE]\n\n";
    }
    json body = header();
    body["choices"] = json::array();
    for (const Choice& c : choices_) {
      json choice = {
          {"index", c.index},
          {"finish_reason", c.finish_reason.empty() ? json(nullptr) : json(c.finish_reason)}};
      json lp = nullptr;
      // Chat logprobs carry OpenAI's `refusal` list beside `content` (null: never a refusal).
      if (shape_.logprobs) {
        lp = shape_.chat ? json{{"content", c.logprobs}, {"refusal", nullptr}} : c.logprobs;
      }
      choice["logprobs"] = lp;
      if (shape_.chat) {
        choice["message"] = {{"role", "assistant"}, {"content", c.text}, {"refusal", nullptr}};
      } else {
        choice["text"] = c.text;
      }
      if (shape_.token_ids) choice["token_ids"] = c.token_ids;
      body["choices"].push_back(std::move(choice));
    }
    body["usage"] = usage();
    return body.dump(-1, ' ', false, json::error_handler_t::replace);
  }

 private:
  json header() const {
    return {{"id", id_},
            {"object", shape_.chat ? (shape_.stream ? "chat.completion.chunk" : "chat.completion")
                                   : "text_completion"},
            {"created", created_},
            {"model", api_.model_name}};
  }

  std::string chunk(json choice, json delta) const {
    json c = header();
    if (shape_.chat) choice["delta"] = std::move(delta);
    c["choices"] = json::array({std::move(choice)});
    if (shape_.include_usage) c["usage"] = nullptr;
    return sse_event(c);
  }

  json usage() const {
    return {{"prompt_tokens", prompt_tokens_},
            {"completion_tokens", completion_tokens_},
            {"total_tokens", prompt_tokens_ + completion_tokens_},
            {"prompt_tokens_details", {{"cached_tokens", cached_tokens_}}}};
  }

  // The message's token in the request's logprobs format; also appended to the choice's
  // whole-response logprobs. Returns the streamed chunk's logprobs.
  json logprobs_of(const v1::GenerateResponse& m, Choice& c) {
    const TokenText tok = token_text(api_, m.token_id());
    if (shape_.chat) {
      json alts = json::array();
      for (const v1::TopLogprob& t : m.top_logprobs()) {
        const TokenText alt = token_text(api_, t.token_id());
        alts.push_back(
            {{"token", alt.text}, {"logprob", t.logprob()}, {"bytes", byte_list(alt.bytes)}});
      }
      json entry = {{"token", tok.text},
                    {"logprob", m.logprob()},
                    {"bytes", byte_list(tok.bytes)},
                    {"top_logprobs", std::move(alts)}};
      if (c.logprobs.is_null()) c.logprobs = json::array();
      c.logprobs.push_back(entry);
      return {{"content", json::array({std::move(entry)})}, {"refusal", nullptr}};
    }
    // {token: logprob} per token, empty with `logprobs: 0` (no alternatives asked for).
    json top = json::object();
    if (shape_.top_logprobs > 0) {
      for (const v1::TopLogprob& t : m.top_logprobs()) {
        top[token_text(api_, t.token_id()).text] = t.logprob();
      }
    }
    const int64_t offset = utf8_length(c.text);
    if (c.logprobs.is_null()) {
      c.logprobs = {{"tokens", json::array()},
                    {"token_logprobs", json::array()},
                    {"top_logprobs", json::array()},
                    {"text_offset", json::array()}};
    }
    c.logprobs["tokens"].push_back(tok.text);
    c.logprobs["token_logprobs"].push_back(m.logprob());
    c.logprobs["top_logprobs"].push_back(top);
    c.logprobs["text_offset"].push_back(offset);
    return {{"tokens", {tok.text}},
            {"token_logprobs", {m.logprob()}},
            {"top_logprobs", {top}},
            {"text_offset", {offset}}};
  }

  const ApiContext& api_;
  const ResponseShape shape_;
  const std::string id_;
  const int64_t created_;
  std::map<std::string, int> by_branch_;  // branch id -> choice index (order of first message)
  std::vector<Choice> choices_;
  int64_t prompt_tokens_ = 0;
  int64_t cached_tokens_ = 0;
  int64_t completion_tokens_ = 0;
};

void serve_completion(ApiContext& api, const httplib::Request& req, httplib::Response& res,
                      bool chat) {
  if (!authenticate(api, req, res)) return;
  StatusOr<JsonRequest> body = JsonRequest::parse(req.body);
  if (!body.ok()) return write_error(res, make_error(body.status()));
  v1::GenerateRequest request;
  ResponseShape shape;
  if (Status s = parse_request(*body, chat, &request, &shape); !s.ok()) {
    return write_error(res, make_error(s));
  }
  auto call = std::make_shared<GenerateCall>(api.stub, req, request);
  serve_generate(std::move(call), std::make_shared<OpenAiFormatter>(api, shape), shape.stream, res);
}

}  // namespace

void add_openai_routes(httplib::Server& server, ApiContext& api) {
  server.Get("/v1/models", [&api](const httplib::Request& req, httplib::Response& res) {
    if (!authenticate(api, req, res)) return;
    write_json(res, {{"object", "list"},
                     {"data",
                      {{{"id", api.model_name},
                        {"object", "model"},
                        {"created", api.created_unix_s},
                        {"owned_by", "treeserve"}}}}});
  });
  server.Post("/v1/completions", [&api](const httplib::Request& req, httplib::Response& res) {
    serve_completion(api, req, res, /*chat=*/false);
  });
  server.Post("/v1/chat/completions", [&api](const httplib::Request& req, httplib::Response& res) {
    serve_completion(api, req, res, /*chat=*/true);
  });
}

}  // namespace treeserve::http
