// The tree API over JSON (docs/http-api.md): each route is one TreeServe method, its JSON body
// the request message's fields under the same names (sampling fields at the top level, as
// OpenAI names them) and its answer the response's. The service runs the call over the
// in-process channel, so the checks, limits and errors are gRPC's, mapped to HTTP statuses.
#include <cstring>
#include <string_view>

#include "server/http_call.h"

namespace treeserve::http {

namespace {

using Handler = std::function<void(const httplib::Request&, httplib::Response&)>;

// Runs a unary TreeServe method; on failure writes the error and returns false.
template <typename Request, typename Response>
bool call_unary(const ApiContext& api, const httplib::Request& req, httplib::Response& res,
                grpc::Status (v1::TreeServe::Stub::*method)(grpc::ClientContext*, const Request&,
                                                            Response*),
                const Request& request, Response* response) {
  grpc::ClientContext ctx;
  prepare_context(req, &ctx);
  const grpc::Status s = (api.stub->*method)(&ctx, request, response);
  if (s.ok()) return true;
  write_error(res, make_error(s.error_code(), s.error_message()));
  return false;
}

// Authenticates, parses the body, and hands it to `fn` (which returns a Status for a field
// it cannot read).
Handler with_body(
    ApiContext& api,
    std::function<Status(const JsonRequest&, const httplib::Request&, httplib::Response&)> fn) {
  return [&api, fn](const httplib::Request& req, httplib::Response& res) {
    if (!authenticate(api, req, res)) return;
    StatusOr<JsonRequest> body = JsonRequest::parse(req.body);
    if (!body.ok()) return write_error(res, make_error(body.status()));
    if (Status s = fn(*body, req, res); !s.ok()) write_error(res, make_error(s));
  };
}

const char* finish_name(v1::FinishReason r) {
  switch (r) {
    case v1::FINISH_LENGTH:
      return "length";
    case v1::FINISH_STOP:
      return "stop";
    case v1::FINISH_EOS:
      return "eos";
    case v1::FINISH_PRUNED:
      return "pruned";
    case v1::FINISH_CANCELLED:
      return "cancelled";
    default:
      return nullptr;
  }
}

json finish_json(v1::FinishReason r) {
  const char* name = finish_name(r);
  return name ? json(name) : json(nullptr);
}

const char* state_name(v1::BranchState s) {
  switch (s) {
    case v1::BRANCH_PREFILL:
      return "prefill";
    case v1::BRANCH_GENERATING:
      return "generating";
    case v1::BRANCH_VERIFYING:
      return "verifying";
    case v1::BRANCH_BEAM:
      return "beam";
    default:
      return "idle";
  }
}

// A query parameter that is an integer (page_size); absent leaves *out.
Status query_int(const httplib::Request& req, const char* key, int32_t* out) {
  if (!req.has_param(key)) return Status::Ok();
  const std::string v = req.get_param_value(key);
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < INT32_MIN || n > INT32_MAX) {
    return InvalidArgument(std::string(key) + ": must be an integer, got '" + v + "'");
  }
  *out = int32_t(n);
  return Status::Ok();
}

bool query_flag(const httplib::Request& req, const char* key) {
  if (!req.has_param(key)) return false;
  const std::string v = req.get_param_value(key);
  return v != "0" && v != "false";
}

// Sampling fields at the top level of a body (OpenAI's names), with the gRPC defaults
// (temperature 0: greedy; seed 0).
Status sampling_from_json(const JsonRequest& body, v1::SamplingParams* s) {
  double temperature = 0, top_p = 0;
  TS_RETURN_IF_ERROR(body.get("temperature", &temperature));
  TS_RETURN_IF_ERROR(body.get("top_p", &top_p));
  s->set_temperature(float(temperature));
  s->set_top_p(float(top_p));
  int32_t v = 0;
  TS_RETURN_IF_ERROR(body.get_int32("top_k", &v));
  s->set_top_k(v);
  int64_t seed = 0;
  TS_RETURN_IF_ERROR(
      body.get("seed", INT64_MIN, INT64_MAX, &seed));  // uint64 on the wire: -1 is 2^64 - 1
  s->set_seed(uint64_t(seed));
  v = 0;
  TS_RETURN_IF_ERROR(body.get_int32("max_tokens", &v));
  s->set_max_tokens(v);
  v = 0;
  TS_RETURN_IF_ERROR(body.get_int32("logprobs", &v));
  s->set_logprobs(v);
  std::vector<std::string> stop;
  TS_RETURN_IF_ERROR(body.get_strings("stop", &stop));
  for (std::string& one : stop) s->add_stop(std::move(one));
  std::vector<int32_t> ids;
  TS_RETURN_IF_ERROR(body.get_ids("stop_token_ids", &ids));
  s->mutable_stop_token_ids()->Add(ids.begin(), ids.end());
  return Status::Ok();
}

// CreateTree's prompt: text, token ids, or messages (rendered with the chat template).
Status tree_prompt(const JsonRequest& body, v1::Prompt* out) {
  if (const json* messages = body.find("messages")) {
    if (body.has("prompt")) return InvalidArgument("messages: give prompt or messages, not both");
    return messages_from_json(*messages, "messages", out->mutable_messages());
  }
  const json* v = body.find("prompt");
  if (v == nullptr) return InvalidArgument("prompt: required (or messages)");
  return prompt_from_json(*v, "prompt", out);
}

// Generate's messages as the tree API's events, or collected per branch for a whole answer.
class TreeFormatter : public GenerateFormatter {
 public:
  TreeFormatter(bool stream, bool logprobs) : stream_(stream), logprobs_(logprobs) {}

  std::string on_message(const v1::GenerateResponse& m) override {
    if (stream_) return sse_event(event(m));
    auto [it, fresh] = index_.try_emplace(m.branch_id(), branches_.size());
    if (fresh) {
      branches_.push_back({{"branch_id", m.branch_id()},
                           {"token_ids", json::array()},
                           {"text", ""},
                           {"finish_reason", nullptr}});
      if (logprobs_) branches_.back()["logprobs"] = json::array();
    }
    json& b = branches_[it->second];
    if (m.token_id() >= 0) {
      b["token_ids"].push_back(m.token_id());
      if (logprobs_) b["logprobs"].push_back(m.logprob());
      if (m.top_logprobs_size() > 0) {
        if (!b.contains("top_logprobs")) b["top_logprobs"] = json::array();
        b["top_logprobs"].push_back(top_of(m));
      }
    }
    b["text"] = b["text"].get<std::string>() + m.text();
    if (m.finish_reason() != v1::FINISH_NONE) b["finish_reason"] = finish_json(m.finish_reason());
    if (m.score() != 0) b["score"] = m.score();
    return "";
  }

  std::string on_end() override {
    if (stream_) return "data: [DONE]\n\n";
    return json{{"branches", branches_}}.dump(-1, ' ', false, json::error_handler_t::replace);
  }

 private:
  static json top_of(const v1::GenerateResponse& m) {
    json top = json::array();
    for (const v1::TopLogprob& t : m.top_logprobs()) {
      top.push_back({{"token_id", t.token_id()}, {"logprob", t.logprob()}});
    }
    return top;
  }

  static json event(const v1::GenerateResponse& m) {
    json e = {{"branch_id", m.branch_id()},
              {"token_id", m.token_id() >= 0 ? json(m.token_id()) : json(nullptr)},
              {"text", m.text()},
              {"logprob", m.logprob()},
              {"finish_reason", finish_json(m.finish_reason())}};
    if (m.top_logprobs_size() > 0) e["top_logprobs"] = top_of(m);
    if (m.score() != 0) e["score"] = m.score();
    return e;
  }

  const bool stream_;
  const bool logprobs_;
  std::map<std::string, size_t> index_;
  json branches_ = json::array();
};

json tree_json(const v1::TreeInfo& t, bool detail) {
  json branches = json::array();
  for (const v1::BranchInfo& b : t.branches()) {
    json j = {{"id", b.branch_id()},
              {"parent", b.parent_branch_id()},
              {"length", b.length()},
              {"live", b.live()}};
    if (detail) {
      j["fork_offset"] = b.fork_offset();
      j["state"] = state_name(b.state());
      j["finish_reason"] = finish_json(b.finish_reason());
      j["text"] = b.text();
      j["kv_pages"] = b.kv_pages();
      j["shared_pages"] = b.shared_pages();
    }
    branches.push_back(std::move(j));
  }
  return {{"id", t.tree_id()},
          {"branches", std::move(branches)},
          {"total_tokens", t.total_tokens()},
          {"kv_pages", t.kv_pages()},
          {"live_branches", t.live_branches()},
          {"next_page_token", t.next_page_token()},
          {"lease_ms", t.lease_ms()},
          {"expires_at_unix_ms", t.expires_at_unix_ms()}};
}

}  // namespace

void add_tree_routes(httplib::Server& server, ApiContext& api) {
  using Req = httplib::Request;
  using Res = httplib::Response;
  using Stub = v1::TreeServe::Stub;

  server.Get("/v1/server", [&api](const Req& req, Res& res) {
    if (!authenticate(api, req, res)) return;
    v1::ServerInfo info;
    if (!call_unary(api, req, res, &Stub::GetServerInfo, v1::GetServerInfoRequest(), &info)) {
      return;
    }
    write_json(res, {{"model", info.model()},
                     {"backend", info.backend()},
                     {"tensor_parallel", info.tensor_parallel()},
                     {"page_size", info.page_size()},
                     {"kv_pages_total", info.kv_pages_total()},
                     {"kv_cache_dtype", info.kv_cache_dtype()},
                     {"kv_pages_free", info.kv_pages_free()},
                     {"kv_pages_evictable", info.kv_pages_evictable()},
                     {"radix_cached_tokens", info.radix_cached_tokens()},
                     {"live_trees", info.live_trees()},
                     {"live_branches", info.live_branches()},
                     {"decode_steps", info.decode_steps()},
                     {"replica_id", info.replica_id()}});
  });

  server.Get("/v1/trees", [&api](const Req& req, Res& res) {
    if (!authenticate(api, req, res)) return;
    v1::ListTreesRequest r;
    int32_t page_size = 0;
    if (Status s = query_int(req, "page_size", &page_size); !s.ok()) {
      return write_error(res, make_error(s));
    }
    r.set_page_size(page_size);
    r.set_page_token(req.get_param_value("page_token"));
    v1::ListTreesResponse out;
    if (!call_unary(api, req, res, &Stub::ListTrees, r, &out)) return;
    json data = json::array();
    for (const v1::TreeListing& t : out.trees()) {
      data.push_back({{"id", t.tree_id()},
                      {"live_branches", t.live_branches()},
                      {"total_tokens", t.total_tokens()},
                      {"kv_pages", t.kv_pages()},
                      {"lease_ms", t.lease_ms()},
                      {"expires_at_unix_ms", t.expires_at_unix_ms()},
                      {"created_at_unix_ms", t.created_at_unix_ms()}});
    }
    write_json(res, {{"data", std::move(data)}, {"next_page_token", out.next_page_token()}});
  });

  server.Post("/v1/trees",
              with_body(api, [&api](const JsonRequest& body, const Req& req, Res& res) -> Status {
                v1::CreateTreeRequest r;
                TS_RETURN_IF_ERROR(tree_prompt(body, r.mutable_prompt()));
                int64_t lease_ms = 0;
                TS_RETURN_IF_ERROR(body.get("lease_ms", INT64_MIN, INT64_MAX, &lease_ms));
                r.set_lease_ms(lease_ms);
                v1::CreateTreeResponse out;
                if (!call_unary(api, req, res, &Stub::CreateTree, r, &out)) return Status::Ok();
                write_json(res, {{"id", out.tree_id()},
                                 {"root_branch_id", out.root_branch_id()},
                                 {"prompt_tokens", out.prompt_tokens()},
                                 {"cached_tokens", out.cached_tokens()},
                                 {"lease_ms", out.lease_ms()}});
                return Status::Ok();
              }));

  server.Get(R"(/v1/trees/([^/]+))", [&api](const Req& req, Res& res) {
    if (!authenticate(api, req, res)) return;
    v1::GetTreeRequest r;
    r.set_tree_id(req.matches[1]);
    int32_t page_size = 0;
    if (Status s = query_int(req, "page_size", &page_size); !s.ok()) {
      return write_error(res, make_error(s));
    }
    r.set_page_size(page_size);
    r.set_page_token(req.get_param_value("page_token"));
    r.set_detail(query_flag(req, "detail"));
    v1::TreeInfo out;
    if (!call_unary(api, req, res, &Stub::GetTree, r, &out)) return;
    write_json(res, tree_json(out, r.detail()));
  });

  server.Delete(R"(/v1/trees/([^/]+))", [&api](const Req& req, Res& res) {
    if (!authenticate(api, req, res)) return;
    v1::DeleteTreeRequest r;
    r.set_tree_id(req.matches[1]);
    v1::DeleteTreeResponse out;
    if (!call_unary(api, req, res, &Stub::DeleteTree, r, &out)) return;
    write_json(res, {{"freed_tokens", out.freed_tokens()}});
  });

  server.Post(R"(/v1/trees/([^/]+)/branch)",
              with_body(api, [&api](const JsonRequest& body, const Req& req, Res& res) -> Status {
                v1::BranchRequest r;
                r.set_tree_id(req.matches[1]);
                std::string branch_id;
                TS_RETURN_IF_ERROR(body.get("branch_id", &branch_id));
                r.set_branch_id(branch_id);
                int32_t n = 1, at_offset = 0;  // n: one fork unless asked
                TS_RETURN_IF_ERROR(body.get_int32("n", &n));
                TS_RETURN_IF_ERROR(body.get_int32("at_offset", &at_offset));
                r.set_n(n);
                r.set_at_offset(at_offset);
                v1::BranchResponse out;
                if (!call_unary(api, req, res, &Stub::Branch, r, &out)) return Status::Ok();
                write_json(
                    res, {{"branch_ids", json(std::vector<std::string>(out.branch_ids().begin(),
                                                                       out.branch_ids().end()))}});
                return Status::Ok();
              }));

  server.Post(R"(/v1/trees/([^/]+)/generate)",
              with_body(api, [&api](const JsonRequest& body, const Req& req, Res& res) -> Status {
                v1::GenerateRequest r;
                r.set_tree_id(req.matches[1]);
                std::vector<std::string> ids;
                TS_RETURN_IF_ERROR(body.get_string_list("branch_ids", &ids));
                for (std::string& id : ids) r.add_branch_ids(std::move(id));
                if (const json* append = body.find("append")) {
                  TS_RETURN_IF_ERROR(prompt_from_json(*append, "append", r.mutable_append()));
                }
                // Turns appended to each branch, rendered as a continuation of its conversation.
                if (const json* messages = body.find("messages")) {
                  if (body.has("append")) {
                    return InvalidArgument("messages: give append or messages, not both");
                  }
                  TS_RETURN_IF_ERROR(messages_from_json(*messages, "messages",
                                                        r.mutable_append()->mutable_messages()));
                }
                TS_RETURN_IF_ERROR(sampling_from_json(body, r.mutable_sampling()));
                if (const json* beam = body.find("beam_search")) {
                  if (!beam->is_object()) {
                    return InvalidArgument("beam_search: must be an object");
                  }
                  JsonRequest b(*beam);
                  int32_t width = 0;
                  double penalty = 0;
                  Status s = b.get_int32("beam_width", &width);
                  if (s.ok()) s = b.get("length_penalty", &penalty);
                  if (!s.ok()) return InvalidArgument("beam_search." + s.message());
                  r.mutable_beam_search()->set_beam_width(width);
                  r.mutable_beam_search()->set_length_penalty(float(penalty));
                }
                bool stream = false;
                TS_RETURN_IF_ERROR(body.get("stream", &stream));
                auto call = std::make_shared<GenerateCall>(api.stub, req, r);
                serve_generate(std::move(call),
                               std::make_shared<TreeFormatter>(stream, body.has("logprobs")),
                               stream, res);
                return Status::Ok();
              }));

  server.Post(R"(/v1/trees/([^/]+)/prune)",
              with_body(api, [&api](const JsonRequest& body, const Req& req, Res& res) -> Status {
                v1::PruneRequest r;
                r.set_tree_id(req.matches[1]);
                std::vector<std::string> ids;
                TS_RETURN_IF_ERROR(body.get_string_list("branch_ids", &ids));
                for (std::string& id : ids) r.add_branch_ids(std::move(id));
                bool retain_kv = false;
                TS_RETURN_IF_ERROR(body.get("retain_kv", &retain_kv));
                r.set_retain_kv(retain_kv);
                v1::PruneResponse out;
                if (!call_unary(api, req, res, &Stub::Prune, r, &out)) return Status::Ok();
                write_json(res, {{"pruned_branches", out.pruned_branches()},
                                 {"freed_tokens", out.freed_tokens()}});
                return Status::Ok();
              }));

  server.Post(R"(/v1/trees/([^/]+)/verify)",
              with_body(api, [&api](const JsonRequest& body, const Req& req, Res& res) -> Status {
                v1::VerifyRequest r;
                r.set_tree_id(req.matches[1]);
                std::string branch_id;
                TS_RETURN_IF_ERROR(body.get("branch_id", &branch_id));
                r.set_branch_id(branch_id);
                std::vector<int32_t> tokens, parents;
                TS_RETURN_IF_ERROR(body.get_ids("tokens", &tokens));
                TS_RETURN_IF_ERROR(body.get_ids("parents", &parents));
                r.mutable_tokens()->Add(tokens.begin(), tokens.end());
                r.mutable_parents()->Add(parents.begin(), parents.end());
                TS_RETURN_IF_ERROR(sampling_from_json(body, r.mutable_sampling()));
                v1::VerifyResponse out;
                if (!call_unary(api, req, res, &Stub::Verify, r, &out)) return Status::Ok();
                write_json(res, {{"accepted_tokens",
                                  json(std::vector<int32_t>(out.accepted_tokens().begin(),
                                                            out.accepted_tokens().end()))},
                                 {"bonus_token", out.bonus_token()}});
                return Status::Ok();
              }));
}

}  // namespace treeserve::http
