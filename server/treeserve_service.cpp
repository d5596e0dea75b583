// TreeServe method bodies: request validation (docs/api.md, Errors) and the translation
// between protobuf messages and scheduler calls. The server checks what depends on the wire
// format and its configured limits; the checks every caller of the scheduler needs are the
// scheduler's (scheduler.h), and the server calls the same functions where its order of
// checks puts them.
#include "server/treeserve_service.h"

#include <grpc/grpc.h>
#include <spdlog/spdlog.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/metrics.h"
#include "models/chat_template.h"
#include "models/tokenizer.h"
#include "scheduler/scheduler.h"
#include "server/grpc_status.h"

namespace treeserve {

namespace {

constexpr std::chrono::milliseconds kStreamPoll{20};
// GetTree: live branches per page when the request says 0, and the most a page holds (a
// request for more gets this many). 4096 is the most live branches a tree can have, so one
// page of the maximum size is the whole tree (a few hundred KB).
constexpr int32_t kGetTreeDefaultPageSize = 1024;
constexpr int32_t kGetTreeMaxPageSize = 4096;
// ListTrees: trees per page when the request says 0, and the most a page holds.
constexpr int32_t kListTreesDefaultPageSize = 100;
constexpr int32_t kListTreesMaxPageSize = 1000;

v1::FinishReason to_proto(FinishReason r) {
  switch (r) {
    case FinishReason::kNone:
      return v1::FINISH_NONE;
    case FinishReason::kLength:
      return v1::FINISH_LENGTH;
    case FinishReason::kStop:
      return v1::FINISH_STOP;
    case FinishReason::kEos:
      return v1::FINISH_EOS;
    case FinishReason::kPruned:
      return v1::FINISH_PRUNED;
    case FinishReason::kCancelled:
      return v1::FINISH_CANCELLED;
  }
  return v1::FINISH_NONE;
}

// Bounds the wait for a TreeSearch level's scores: a blocking Read cannot time out, so a
// watcher thread ends the call with DEADLINE_EXCEEDED when the time passes (the Read then
// returns false). grpc_call_cancel_with_status rather than ServerContext::TryCancel, which
// would tell the client CANCELLED.
class ScoreWatch {
 public:
  ScoreWatch(grpc::ServerContext* ctx, std::chrono::milliseconds timeout, std::string message)
      : thread_([this, ctx, timeout, message = std::move(message)] {
          std::unique_lock<std::mutex> lock(mu_);
          if (cv_.wait_for(lock, timeout, [&] { return done_; })) return;
          fired_ = true;
          grpc_call_cancel_with_status(ctx->c_call(), GRPC_STATUS_DEADLINE_EXCEEDED,
                                       message.c_str(), nullptr);
        }) {}
  ~ScoreWatch() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  bool fired() {
    std::lock_guard<std::mutex> lock(mu_);
    return fired_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool fired_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

// An id the request must name: an empty one is INVALID_ARGUMENT naming the field (it names no
// tree or branch, so NOT_FOUND would be misleading).
grpc::Status require_id(const std::string& field, const std::string& id) {
  if (id.empty()) return grpc_invalid(field + ": must not be empty");
  return grpc::Status::OK;
}

grpc::Status require_ids(const std::string& field,
                         const google::protobuf::RepeatedPtrField<std::string>& ids) {
  for (int i = 0; i < ids.size(); ++i) {
    if (ids[i].empty()) {
      return grpc_invalid(field + "[" + std::to_string(i) + "]: must not be empty");
    }
  }
  return grpc::Status::OK;
}

// Text is bounded in bytes before it is tokenized or matched (ServingInfo::max_text_bytes), so
// an oversized text costs a comparison, not a tokenization.
Status check_text_bytes(const std::string& field, size_t bytes, int64_t limit) {
  if (limit > 0 && int64_t(bytes) > limit) {
    return InvalidArgument(field + ": " + std::to_string(bytes) + " bytes is over the limit of " +
                           std::to_string(limit) +
                           " bytes (limits.max_prompt_tokens x the tokenizer's longest token)");
  }
  return Status::Ok();
}

}  // namespace

// Counts a call in flight for the graceful shutdown, and refuses new ones while draining.
class CallScope {
 public:
  explicit CallScope(TreeServeService* s) : s_(s) { ++s_->active_calls_; }
  ~CallScope() { --s_->active_calls_; }
  bool draining() const { return s_->draining_.load(); }

 private:
  TreeServeService* s_;
};

TreeServeService::TreeServeService(const TreeserveConfig& config, const Tokenizer* tokenizer,
                                   ServingInfo info, Scheduler* scheduler, Authenticator* auth,
                                   TenantGate* tenants)
    : config_(config),
      tokenizer_(tokenizer),
      info_(std::move(info)),
      scheduler_(scheduler),
      auth_(auth),
      tenants_(tenants),
      ready_(scheduler != nullptr) {}

// Auth, then the request's size against server.max_request_bytes (the transport accepts a
// margin more, so an oversized request gets this clear INVALID_ARGUMENT).
grpc::Status TreeServeService::admit(const grpc::ServerContext* context,
                                     const google::protobuf::Message& request,
                                     Principal* principal) const {
  // The method is the request type's name without "Request" (CreateTreeRequest: CreateTree).
  std::string_view method = request.GetDescriptor()->name();
  if (method.size() > 7 && method.substr(method.size() - 7) == "Request") {
    method.remove_suffix(7);
  }
  if (auto s = check_auth(context, method, principal); !s.ok()) return s;
  // gRPC may start the handler of a call its client already cancelled: start no work for it.
  if (context->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the call before it ran");
  }
  return check_size(request);
}

grpc::Status TreeServeService::check_size(const google::protobuf::Message& request) const {
  const size_t bytes = request.ByteSizeLong();
  if (bytes > size_t(config_.server.max_request_bytes)) {
    return grpc_invalid("request: " + std::to_string(bytes) +
                        " bytes is over server.max_request_bytes (" +
                        std::to_string(config_.server.max_request_bytes) + ")");
  }
  return grpc::Status::OK;
}

grpc::Status TreeServeService::check_auth(const grpc::ServerContext* context,
                                          std::string_view method, Principal* principal) const {
  if (draining_.load()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
  }
  Principal caller;
  if (auth_ != nullptr && auth_->enabled()) {
    const auto& md = context->client_metadata();
    auto it = md.find("authorization");
    std::string_view value;
    if (it != md.end()) value = std::string_view(it->second.data(), it->second.size());
    StatusOr<Principal> who =
        auth_->authenticate(it != md.end() ? &value : nullptr, context->peer(),
                            "/treeserve.v1.TreeServe/" + std::string(method));
    if (!who.ok()) return to_grpc(who.status());
    caller = std::move(*who);
  }
  if (!ready_.load(std::memory_order_acquire)) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "the model is loading; the health service reports SERVING once it is "
                        "loaded");
  }
  if (tenants_ != nullptr) {
    if (Status s = tenants_->admit_request(caller.tenant); !s.ok()) return to_grpc(s);
  }
  if (StatusOr<std::string> route = route_header(*context); !route.ok()) {
    return to_grpc(route.status());
  }
  if (principal != nullptr) *principal = std::move(caller);
  return grpc::Status::OK;
}

grpc::Status TreeServeService::check_replica(const std::string& tree_id) const {
  ServerMetrics* metrics = scheduler_->metrics();
  return to_grpc(check_tree_replica(tree_id, {config_.server.replica_id, info_.incarnation},
                                    metrics ? metrics->misrouted_calls_total : nullptr));
}

grpc::Status TreeServeService::answer(const Status& status) const {
  if (tenants_ != nullptr) tenants_->count(status);
  return to_grpc(status);
}

StatusOr<TenantGate::StreamSlot> TreeServeService::open_stream(const Principal& who) const {
  if (tenants_ == nullptr) return TenantGate::StreamSlot();
  return tenants_->open_stream(who.tenant);
}

Status TreeServeService::check_ids(const std::string& field,
                                   const std::vector<int32_t>& ids) const {
  const int32_t vocab = tokenizer_->vocab_size();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      return InvalidArgument(field + "[" + std::to_string(i) + "]: token id " +
                             std::to_string(ids[i]) + " is outside the vocabulary [0, " +
                             std::to_string(vocab) + ")");
    }
  }
  return Status::Ok();
}

// Text prompts are tokenized with the model's BOS first (as Hugging Face does); token
// prompts are used exactly as given; messages are rendered with the chat template, which
// writes any BOS itself. `bos` is false for a prompt appended to a branch.
StatusOr<std::vector<int32_t>> TreeServeService::resolve_prompt(const std::string& field,
                                                                const v1::Prompt& prompt,
                                                                bool bos) const {
  std::vector<int32_t> ids;
  if (prompt.has_tokens()) {
    ids.assign(prompt.tokens().ids().begin(), prompt.tokens().ids().end());
    TS_RETURN_IF_ERROR(check_ids(field + ".tokens.ids", ids));
  } else if (prompt.has_messages()) {
    StatusOr<std::vector<int32_t>> chat = resolve_messages(field + ".messages", prompt.messages(),
                                                           /*continuation=*/!bos);
    if (!chat.ok()) return chat.status();
    ids = std::move(*chat);
  } else if (!prompt.text().empty()) {
    TS_RETURN_IF_ERROR(
        check_text_bytes(field + ".text", prompt.text().size(), info_.max_text_bytes));
    StatusOr<std::vector<int32_t>> enc = tokenizer_->encode(prompt.text());
    if (!enc.ok()) return enc.status();
    if (bos && tokenizer_->bos_id() >= 0) ids.push_back(tokenizer_->bos_id());
    ids.insert(ids.end(), enc->begin(), enc->end());
  }
  TS_RETURN_IF_ERROR(check_tokens_given(field, ids));
  if (static_cast<int64_t>(ids.size()) > config_.limits.max_prompt_tokens) {
    return InvalidArgument(field + ": " + std::to_string(ids.size()) +
                           " tokens is over the limit of " +
                           std::to_string(config_.limits.max_prompt_tokens));
  }
  if (info_.max_sequence_tokens > 0 &&
      static_cast<int64_t>(ids.size()) >= info_.max_sequence_tokens) {
    return InvalidArgument(
        field + ": " + std::to_string(ids.size()) +
        " tokens leave no room in the model's context of " +
        std::to_string(info_.max_sequence_tokens) + " tokens" +
        (info_.context_limit_reason.empty() ? "" : " (" + info_.context_limit_reason + ")"));
  }
  return ids;
}

StatusOr<std::vector<int32_t>> TreeServeService::resolve_messages(const std::string& field,
                                                                  const v1::ChatMessages& chat,
                                                                  bool continuation) const {
  if (info_.chat_template == nullptr) {
    return FailedPrecondition(field +
                              ": the model has no chat template (neither tokenizer_config.json's "
                              "chat_template nor chat_template.jinja); start the server with "
                              "--chat-template FILE, or send text or tokens");
  }
  if (chat.messages_size() == 0) return InvalidArgument(field + ".messages: must not be empty");
  std::vector<ChatMessage> messages;
  size_t bytes = 0;
  for (int i = 0; i < chat.messages_size(); ++i) {
    const v1::ChatMessage& m = chat.messages(i);
    if (m.role().empty()) {
      return InvalidArgument(field + ".messages[" + std::to_string(i) +
                             "].role: must not be empty");
    }
    bytes += m.role().size() + m.content().size();
    messages.push_back({m.role(), m.content()});
  }
  TS_RETURN_IF_ERROR(check_text_bytes(field + ".messages", bytes, info_.max_text_bytes));
  ChatRenderOptions options;
  options.add_generation_prompt = !chat.has_add_generation_prompt() || chat.add_generation_prompt();
  options.continuation = continuation;
  // The template's own text comes on top of the messages' (headers, a default system prompt).
  if (info_.max_text_bytes > 0) options.max_bytes = size_t(info_.max_text_bytes) + (1 << 20);
  StatusOr<std::vector<int32_t>> ids = info_.chat_template->encode(messages, options);
  if (!ids.ok()) {
    return Status(ids.status().code(),
                  field + ": the model's chat template: " + ids.status().message());
  }
  return ids;
}

StatusOr<SamplingParams> TreeServeService::resolve_sampling(const v1::SamplingParams& p,
                                                            GenerateSpec* spec) const {
  SamplingParams out;
  out.temperature = p.temperature();
  out.top_k = p.top_k();
  out.top_p = p.top_p() == 0.0f ? 1.0f : p.top_p();  // API: 0 or 1 = off
  out.seed = p.seed();
  out.logprobs = p.logprobs();
  Status valid = validate_sampling_params(out);
  if (!valid.ok()) return InvalidArgument("sampling." + valid.message());
  if (spec) {
    if (p.max_tokens() < 0 || p.max_tokens() > config_.limits.max_tokens) {
      return InvalidArgument("sampling.max_tokens: " + std::to_string(p.max_tokens()) +
                             " is outside [0, " + std::to_string(config_.limits.max_tokens) +
                             "] (0 = the server default)");
    }
    if (p.stop_size() > config_.limits.max_stop_strings) {
      return InvalidArgument("sampling.stop: at most " +
                             std::to_string(config_.limits.max_stop_strings) + " stop strings");
    }
    for (int i = 0; i < p.stop_size(); ++i) {
      if (p.stop(i).empty()) {
        return InvalidArgument("sampling.stop[" + std::to_string(i) + "]: must not be empty");
      }
      TS_RETURN_IF_ERROR(check_text_bytes("sampling.stop[" + std::to_string(i) + "]",
                                          p.stop(i).size(), info_.max_text_bytes));
    }
    std::vector<int32_t> stop_ids(p.stop_token_ids().begin(), p.stop_token_ids().end());
    TS_RETURN_IF_ERROR(check_ids("sampling.stop_token_ids", stop_ids));
    spec->max_tokens = p.max_tokens();
    spec->stop.assign(p.stop().begin(), p.stop().end());
    spec->stop_token_ids = std::move(stop_ids);
  }
  return out;
}

grpc::Status TreeServeService::CreateTree(grpc::ServerContext* ctx,
                                          const v1::CreateTreeRequest* request,
                                          v1::CreateTreeResponse* response) {
  CallScope scope(this);
  Principal who;
  if (auto s = admit(ctx, *request, &who); !s.ok()) return s;
  StatusOr<std::vector<int32_t>> prompt = resolve_prompt("prompt", request->prompt(), true);
  if (!prompt.ok()) return to_grpc(prompt.status());
  const int64_t max_lease_ms = config_.server.tree_lease_max_s * 1000;
  if (request->lease_ms() < 0 || request->lease_ms() > max_lease_ms) {
    return grpc_invalid("lease_ms: " + std::to_string(request->lease_ms()) + " is outside [0, " +
                        std::to_string(max_lease_ms) +
                        "] (0 = the default; the maximum is server.tree_lease_max_s = " +
                        std::to_string(config_.server.tree_lease_max_s) + " s)");
  }
  CreateTreeOptions options;
  options.lease_ms =
      request->lease_ms() > 0 ? request->lease_ms() : config_.server.tree_lease_default_s * 1000;
  // A client that gives up (cancel, deadline, disconnect) stops the prefill: no orphan tree.
  options.cancelled = [ctx] { return ctx->IsCancelled(); };
  options.tenant = who.tenant;
  // The header's key (admit checked it), else the prompt's: every tree id carries a route.
  StatusOr<std::string> route = route_header(*ctx);
  options.route = route.ok() && !route->empty() ? *route : prompt_route_key(request->prompt());
  StatusOr<CreateTreeResult> r = scheduler_->create_tree(std::move(*prompt), options);
  if (!r.ok()) return answer(r.status());
  response->set_tree_id(r->tree_id);
  response->set_root_branch_id(r->root_branch_id);
  response->set_prompt_tokens(r->prompt_tokens);
  response->set_cached_tokens(r->cached_tokens);
  response->set_lease_ms(r->lease_ms);
  spdlog::debug("tree={} created: {} prompt tokens, {} cached", r->tree_id, r->prompt_tokens,
                r->cached_tokens);
  return grpc::Status::OK;
}

grpc::Status TreeServeService::Branch(grpc::ServerContext* ctx, const v1::BranchRequest* request,
                                      v1::BranchResponse* response) {
  CallScope scope(this);
  Principal who;
  if (auto s = admit(ctx, *request, &who); !s.ok()) return s;
  if (auto s = require_id("tree_id", request->tree_id()); !s.ok()) return s;
  if (auto s = check_replica(request->tree_id()); !s.ok()) return s;
  if (auto s = require_id("branch_id", request->branch_id()); !s.ok()) return s;
  if (request->n() < 1 || request->n() > config_.limits.max_n) {
    return grpc_invalid("n: " + std::to_string(request->n()) + " is outside [1, " +
                        std::to_string(config_.limits.max_n) + "]");
  }
  if (request->at_offset() < 0) return grpc_invalid("at_offset: must be >= 0");
  StatusOr<std::vector<std::string>> ids = scheduler_->branch(
      request->tree_id(), request->branch_id(), request->n(), request->at_offset(),
      [ctx] { return ctx->IsCancelled(); }, who.tenant);
  if (!ids.ok()) return answer(ids.status());
  for (const std::string& id : *ids) response->add_branch_ids(id);
  return grpc::Status::OK;
}

grpc::Status TreeServeService::generate_stream(
    grpc::ServerContext* ctx, const v1::GenerateRequest* request,
    grpc::internal::WriterInterface<v1::GenerateResponse>* writer) {
  CallScope scope(this);
  Principal who;
  if (auto s = admit(ctx, *request, &who); !s.ok()) return s;
  if (!request->tree_id().empty()) {
    if (auto s = check_replica(request->tree_id()); !s.ok()) return s;
  }
  StatusOr<TenantGate::StreamSlot> slot = open_stream(who);  // held until the call ends
  if (!slot.ok()) return to_grpc(slot.status());
  GenerateSpec spec;
  spec.tenant = who.tenant;
  StatusOr<SamplingParams> sampling = resolve_sampling(request->sampling(), &spec);
  if (!sampling.ok()) return to_grpc(sampling.status());
  spec.sampling = *sampling;
  if (request->tree_id().empty()) {
    if (request->branch_ids_size() > 0) {
      return grpc_invalid("branch_ids: only with tree_id (a one-shot Generate has no branches)");
    }
    if (request->has_append()) return grpc_invalid("append: only with tree_id; use prompt");
    if (request->n() < 0 || request->n() > config_.limits.max_n) {
      return grpc_invalid("n: " + std::to_string(request->n()) + " is outside [1, " +
                          std::to_string(config_.limits.max_n) + "] (0 = 1)");
    }
    StatusOr<std::vector<int32_t>> prompt = resolve_prompt("prompt", request->prompt(), true);
    if (!prompt.ok()) return to_grpc(prompt.status());
    spec.prompt = std::move(*prompt);
    spec.n = request->n() == 0 ? 1 : request->n();
  } else {
    if (request->has_prompt()) {
      return grpc_invalid("prompt: only for a one-shot Generate (no tree_id); use append");
    }
    if (request->n() != 0) return grpc_invalid("n: only for a one-shot Generate; use Branch");
    spec.tree_id = request->tree_id();
    spec.branch_ids.assign(request->branch_ids().begin(), request->branch_ids().end());
    if (Status s = check_branch_ids_given(spec.tree_id, spec.branch_ids); !s.ok()) {
      return to_grpc(s);
    }
    if (request->branch_ids_size() > config_.limits.max_n) {
      return grpc_invalid("branch_ids: at most " + std::to_string(config_.limits.max_n));
    }
    if (auto s = require_ids("branch_ids", request->branch_ids()); !s.ok()) return s;
    if (request->has_append()) {
      StatusOr<std::vector<int32_t>> append = resolve_prompt("append", request->append(), false);
      if (!append.ok()) return to_grpc(append.status());
      spec.append = std::move(*append);
    }
  }
  if (request->has_beam_search()) {
    const v1::BeamSearchParams& beam = request->beam_search();
    if (beam.beam_width() < 0 || beam.beam_width() > config_.limits.max_n) {
      return grpc_invalid("beam_search.beam_width: " + std::to_string(beam.beam_width()) +
                          " is outside [0, " + std::to_string(config_.limits.max_n) + "]");
    }
    if (Status s = check_length_penalty(beam.length_penalty()); !s.ok()) return to_grpc(s);
    spec.beam_width = beam.beam_width();
    spec.length_penalty = beam.length_penalty();
  }
  StatusOr<std::shared_ptr<GenerateStream>> stream = scheduler_->generate(std::move(spec));
  if (!stream.ok()) return answer(stream.status());

  // Relay events until the stream ends. A dropped client or a passed deadline stops the
  // call's branches (they stay live with their tokens); their FINISH_CANCELLED events are
  // drained before returning.
  bool cancelled = false;
  bool writable = true;
  TokenEvent ev;
  Status final_status;
  for (;;) {
    GenerateStream::Wait w = (*stream)->next(&ev, &final_status, kStreamPoll);
    if (w == GenerateStream::Wait::kEnd) break;
    if (w == GenerateStream::Wait::kEvent && writable) {
      v1::GenerateResponse out;
      out.set_branch_id(ev.branch_id);
      out.set_token_id(ev.token_id);
      out.set_text(ev.text);
      out.set_logprob(ev.logprob);
      for (const TokenLogprob& t : ev.top_logprobs) {
        v1::TopLogprob* tl = out.add_top_logprobs();
        tl->set_token_id(t.token);
        tl->set_logprob(t.logprob);
      }
      out.set_finish_reason(to_proto(ev.finish));
      out.set_score(ev.score);
      out.set_prompt_tokens(ev.prompt_tokens);
      out.set_cached_tokens(ev.cached_tokens);
      writable = writer->Write(out);
    }
    if (!cancelled && (!writable || ctx->IsCancelled())) {
      cancelled = true;
      (*stream)->cancel();
    }
  }
  if (cancelled) {
    return grpc::Status(grpc::StatusCode::CANCELLED,
                        "the client cancelled the call or its deadline passed; its branches "
                        "stopped and keep their tokens");
  }
  return answer(final_status);
}

grpc::Status TreeServeService::Prune(grpc::ServerContext* ctx, const v1::PruneRequest* request,
                                     v1::PruneResponse* response) {
  CallScope scope(this);
  Principal who;
  if (auto s = admit(ctx, *request, &who); !s.ok()) return s;
  if (auto s = require_id("tree_id", request->tree_id()); !s.ok()) return s;
  if (auto s = check_replica(request->tree_id()); !s.ok()) return s;
  if (auto s = require_ids("branch_ids", request->branch_ids()); !s.ok()) return s;
  std::vector<std::string> ids(request->branch_ids().begin(), request->branch_ids().end());
  StatusOr<PruneSummary> r =
      scheduler_->prune(request->tree_id(), ids, request->retain_kv(), who.tenant);
  if (!r.ok()) return to_grpc(r.status());
  response->set_pruned_branches(r->pruned_branches);
  response->set_freed_tokens(r->freed_tokens);
  return grpc::Status::OK;
}

grpc::Status TreeServeService::Verify(grpc::ServerContext* ctx, const v1::VerifyRequest* request,
                                      v1::VerifyResponse* response) {
  CallScope scope(this);
  Principal who;
  if (auto s = admit(ctx, *request, &who); !s.ok()) return s;
  if (auto s = require_id("tree_id", request->tree_id()); !s.ok()) return s;
  if (auto s = check_replica(request->tree_id()); !s.ok()) return s;
  if (auto s = require_id("branch_id", request->branch_id()); !s.ok()) return s;
  std::vector<int32_t> tokens(request->tokens().begin(), request->tokens().end());
  std::vector<int32_t> parents(request->parents().begin(), request->parents().end());
  if (Status s = check_tokens_given("tokens", tokens); !s.ok()) return to_grpc(s);
  if (static_cast<int32_t>(tokens.size()) > config_.limits.max_verify_tokens) {
    return grpc_invalid("tokens: " + std::to_string(tokens.size()) + " is over the limit of " +
                        std::to_string(config_.limits.max_verify_tokens));
  }
  if (Status s = check_ids("tokens", tokens); !s.ok()) return to_grpc(s);
  StatusOr<SamplingParams> sampling = resolve_sampling(request->sampling(), nullptr);
  if (!sampling.ok()) return to_grpc(sampling.status());
  StatusOr<VerifyResult> r =
      scheduler_->verify(request->tree_id(), request->branch_id(), std::move(tokens),
                         std::move(parents), *sampling, who.tenant);
  if (!r.ok()) return answer(r.status());
  response->mutable_accepted_tokens()->Add(r->accepted_tokens.begin(), r->accepted_tokens.end());
  response->set_bonus_token(r->bonus_token);
  return grpc::Status::OK;
}

grpc::Status TreeServeService::GetTree(grpc::ServerContext* ctx, const v1::GetTreeRequest* request,
                                       v1::TreeInfo* response) {
  CallScope scope(this);
  Principal who;
  if (auto s = admit(ctx, *request, &who); !s.ok()) return s;
  if (auto s = require_id("tree_id", request->tree_id()); !s.ok()) return s;
  if (auto s = check_replica(request->tree_id()); !s.ok()) return s;
  if (request->page_size() < 0) return grpc_invalid("page_size: must be >= 0 (0 = 1024)");
  TreePage page;
  page.page_size = request->page_size() == 0 ? kGetTreeDefaultPageSize
                                             : std::min(request->page_size(), kGetTreeMaxPageSize);
  page.page_token = request->page_token();
  page.detail = request->detail();
  StatusOr<TreeSummary> r = scheduler_->get_tree(request->tree_id(), page, who.tenant);
  if (!r.ok()) return to_grpc(r.status());
  response->set_tree_id(r->tree_id);
  for (const BranchSummary& b : r->branches) {
    v1::BranchInfo* info = response->add_branches();
    info->set_branch_id(b.branch_id);
    info->set_parent_branch_id(b.parent_branch_id);
    info->set_length(b.length);
    info->set_live(b.live);
    if (page.detail) {
      info->set_fork_offset(b.fork_offset);
      info->set_state(v1::BranchState(int(b.state)));  // the enums share their order
      info->set_finish_reason(to_proto(b.finish_reason));
      info->set_text(b.text);
      info->set_kv_pages(b.kv_pages);
      info->set_shared_pages(b.shared_pages);
    }
  }
  response->set_total_tokens(r->total_tokens);
  response->set_kv_pages(r->kv_pages);
  response->set_next_page_token(r->next_page_token);
  response->set_live_branches(r->live_branches);
  response->set_lease_ms(r->lease_ms);
  response->set_expires_at_unix_ms(r->expires_at_unix_ms);
  return grpc::Status::OK;
}

grpc::Status TreeServeService::DeleteTree(grpc::ServerContext* ctx,
                                          const v1::DeleteTreeRequest* request,
                                          v1::DeleteTreeResponse* response) {
  CallScope scope(this);
  Principal who;
  if (auto s = admit(ctx, *request, &who); !s.ok()) return s;
  if (auto s = require_id("tree_id", request->tree_id()); !s.ok()) return s;
  if (auto s = check_replica(request->tree_id()); !s.ok()) return s;
  StatusOr<int64_t> freed = scheduler_->delete_tree(request->tree_id(), who.tenant);
  if (!freed.ok()) return to_grpc(freed.status());
  response->set_freed_tokens(*freed);
  return grpc::Status::OK;
}

grpc::Status TreeServeService::ListTrees(grpc::ServerContext* ctx,
                                         const v1::ListTreesRequest* request,
                                         v1::ListTreesResponse* response) {
  CallScope scope(this);
  Principal who;
  if (auto s = admit(ctx, *request, &who); !s.ok()) return s;
  if (request->page_size() < 0) {
    return grpc_invalid(
        "page_size: must be >= 0 (0 = " + std::to_string(kListTreesDefaultPageSize) + ")");
  }
  TreePage page;
  page.page_size = request->page_size() == 0
                       ? kListTreesDefaultPageSize
                       : std::min(request->page_size(), kListTreesMaxPageSize);
  page.page_token = request->page_token();
  StatusOr<TreeList> r = scheduler_->list_trees(who.tenant, page);
  if (!r.ok()) return to_grpc(r.status());
  for (const TreeListing& t : r->trees) {
    v1::TreeListing* out = response->add_trees();
    out->set_tree_id(t.tree_id);
    out->set_live_branches(t.live_branches);
    out->set_total_tokens(t.total_tokens);
    out->set_kv_pages(t.kv_pages);
    out->set_lease_ms(t.lease_ms);
    out->set_expires_at_unix_ms(t.expires_at_unix_ms);
    out->set_created_at_unix_ms(t.created_at_unix_ms);
  }
  response->set_next_page_token(r->next_page_token);
  return grpc::Status::OK;
}

grpc::Status TreeServeService::Tokenize(grpc::ServerContext* ctx,
                                        const v1::TokenizeRequest* request,
                                        v1::TokenizeResponse* response) {
  CallScope scope(this);
  if (auto s = admit(ctx, *request); !s.ok()) return s;
  if (request->text().empty()) return grpc_invalid("text: must not be empty");
  if (Status s = check_text_bytes("text", request->text().size(), info_.max_text_bytes); !s.ok()) {
    return to_grpc(s);
  }
  auto ids = tokenizer_->encode(request->text());
  if (!ids.ok()) return to_grpc(ids.status());
  response->mutable_ids()->Add(ids->begin(), ids->end());
  return grpc::Status::OK;
}

grpc::Status TreeServeService::Detokenize(grpc::ServerContext* ctx,
                                          const v1::DetokenizeRequest* request,
                                          v1::DetokenizeResponse* response) {
  CallScope scope(this);
  if (auto s = admit(ctx, *request); !s.ok()) return s;
  std::vector<int32_t> ids(request->ids().begin(), request->ids().end());
  if (Status s = check_ids("ids", ids); !s.ok()) return to_grpc(s);
  auto text = tokenizer_->decode(ids);
  if (!text.ok()) return to_grpc(text.status());
  response->set_text(*text);
  return grpc::Status::OK;
}

grpc::Status TreeServeService::GetServerInfo(grpc::ServerContext* ctx,
                                             const v1::GetServerInfoRequest*,
                                             v1::ServerInfo* response) {
  CallScope scope(this);
  if (auto s = check_auth(ctx, "GetServerInfo"); !s.ok()) return s;
  response->set_model(info_.model_name);
  response->set_backend(info_.backend);
  response->set_tensor_parallel(info_.tensor_parallel);
  response->set_page_size(info_.page_size);
  response->set_kv_pages_total(info_.kv_pages_total);
  response->set_kv_cache_dtype(info_.kv_cache_dtype);
  SchedulerStats st = scheduler_->stats();
  response->set_kv_pages_free(st.kv_pages_free);
  response->set_kv_pages_evictable(st.kv_pages_evictable);
  response->set_radix_cached_tokens(st.radix_cached_tokens);
  response->set_live_trees(st.live_trees);
  response->set_live_branches(st.live_branches);
  response->set_decode_steps(st.steps);
  response->set_replica_id(config_.server.replica_id);
  return grpc::Status::OK;
}

StatusOr<TreeSearchSpec> TreeServeService::resolve_search(const v1::TreeSearchStart& start) const {
  TreeSearchSpec spec;
  if (start.tree_id().empty()) return InvalidArgument("start.tree_id: must not be empty");
  const int32_t max_n = config_.limits.max_n;
  for (auto [field, value] :
       {std::pair<const char*, int32_t>{"expand", start.expand()}, {"keep", start.keep()}}) {
    if (value < 1 || value > max_n) {
      return InvalidArgument(std::string("start.") + field + ": " + std::to_string(value) +
                             " is outside [1, " + std::to_string(max_n) + "]");
    }
  }
  // One Generate runs every candidate of a level: as many branches as Generate allows.
  const int64_t per_level = int64_t(start.expand()) * start.keep();
  if (per_level > max_n) {
    return InvalidArgument("start.expand * start.keep: " + std::to_string(per_level) +
                           " candidates per level is over limits.max_n (" + std::to_string(max_n) +
                           ")");
  }
  GenerateSpec gen;
  StatusOr<SamplingParams> sampling = resolve_sampling(start.sampling(), &gen);
  if (!sampling.ok()) return InvalidArgument("start." + sampling.status().message());
  // A leaf grows by up to depth thoughts in this one call: the per-call token limit applies.
  const int64_t per_thought =
      gen.max_tokens > 0 ? gen.max_tokens : scheduler_->options().default_max_tokens;
  if (start.depth() < 1 || int64_t(start.depth()) * per_thought > config_.limits.max_tokens) {
    return InvalidArgument("start.depth: " + std::to_string(start.depth()) +
                           " must be >= 1 with depth x max_tokens (" + std::to_string(per_thought) +
                           ") at most limits.max_tokens (" +
                           std::to_string(config_.limits.max_tokens) + ")");
  }
  switch (start.score_mode()) {
    case v1::SCORE_LOGPROB:
      spec.score_mode = SearchScoreMode::kLogprob;
      break;
    case v1::SCORE_CLIENT:
      spec.score_mode = SearchScoreMode::kClient;
      break;
    default:
      return InvalidArgument("start.score_mode: unknown mode " +
                             std::to_string(int(start.score_mode())));
  }
  spec.tree_id = start.tree_id();
  spec.branch_id = start.branch_id();
  spec.expand = start.expand();
  spec.keep = start.keep();
  spec.depth = start.depth();
  spec.sampling = *sampling;
  spec.max_tokens = gen.max_tokens;
  spec.stop = std::move(gen.stop);
  spec.stop_token_ids = std::move(gen.stop_token_ids);
  return spec;
}

// The search runs on this handler thread (run_tree_search); each level message is written
// here and, in CLIENT mode, the scores read back before the search goes on, waiting at most
// limits.tree_search_score_timeout_ms (then DEADLINE_EXCEEDED). A dropped client or a passed
// deadline cancels it: the generating level stops within a step, a pending Read returns, and
// every branch the search made is pruned.
grpc::Status TreeServeService::TreeSearch(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::TreeSearchResponse, v1::TreeSearchRequest>* stream) {
  CallScope scope(this);
  Principal who;
  if (auto s = check_auth(ctx, "TreeSearch", &who); !s.ok()) return s;
  StatusOr<TenantGate::StreamSlot> slot = open_stream(who);  // held until the call ends
  if (!slot.ok()) return to_grpc(slot.status());
  v1::TreeSearchRequest first;
  before_read();
  if (!stream->Read(&first)) {
    // Also a message that does not parse (INVALID_ARGUMENT naming the field) or too large.
    return failed_read("the client closed the stream before its start message");
  }
  if (auto s = check_size(first); !s.ok()) return s;
  if (!first.has_start()) return grpc_invalid("start: the first message must be a start");
  if (!first.start().tree_id().empty()) {
    if (auto s = check_replica(first.start().tree_id()); !s.ok()) return s;
  }
  StatusOr<TreeSearchSpec> spec = resolve_search(first.start());
  if (!spec.ok()) return to_grpc(spec.status());
  spec->tenant = who.tenant;
  const bool by_client = spec->score_mode == SearchScoreMode::kClient;

  TreeSearchHooks hooks;
  hooks.cancelled = [ctx] { return ctx->IsCancelled(); };
  hooks.on_level = [&](const SearchLevel& level, SearchScores* scores) -> Status {
    v1::TreeSearchResponse out;
    v1::TreeSearchLevel* lv = out.mutable_level();
    lv->set_level(level.level);
    for (const SearchCandidate& c : level.candidates) {
      v1::TreeSearchCandidate* pc = lv->add_candidates();
      pc->set_branch_id(c.branch_id);
      pc->set_parent_branch_id(c.parent_branch_id);
      pc->set_text(c.text);
      pc->set_tokens(c.tokens);
      pc->set_logprob(float(c.logprob));
      pc->set_score(float(c.logprob_score));
      pc->set_finish_reason(to_proto(c.finish));
    }
    if (!stream->Write(out)) return Cancelled("the client went away");
    if (!by_client) return Status::Ok();
    const std::string which = "level " + std::to_string(level.level);
    const int32_t timeout_ms = config_.limits.tree_search_score_timeout_ms;
    const std::string late = "scores: none for " + which + " within " + std::to_string(timeout_ms) +
                             " ms (limits.tree_search_score_timeout_ms); the search's branches "
                             "are pruned";
    v1::TreeSearchRequest msg;
    bool got = false;
    bool timed_out = false;
    {
      ScoreWatch watch(ctx, std::chrono::milliseconds(timeout_ms), late);
      before_read();
      got = stream->Read(&msg);
      timed_out = watch.fired();
    }
    if (timed_out) return Status(StatusCode::kDeadlineExceeded, late);
    if (!got) {
      // A scores message that does not parse is INVALID_ARGUMENT naming the field.
      const grpc::Status why = failed_read("");
      if (why.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
        return InvalidArgument(why.error_message());
      }
      return Cancelled(ctx->IsCancelled()
                           ? "the client cancelled the call or its deadline passed"
                           : "the client closed the stream before the scores of " + which);
    }
    const size_t bytes = msg.ByteSizeLong();
    if (bytes > size_t(config_.server.max_request_bytes)) {
      return InvalidArgument("scores: " + std::to_string(bytes) +
                             " bytes is over server.max_request_bytes");
    }
    if (!msg.has_scores()) return InvalidArgument("scores: expected the scores of " + which);
    for (const auto& [id, score] : msg.scores().scores()) (*scores)[id] = score;
    return Status::Ok();
  };
  spdlog::debug("tree={} branch={} tree search: expand={} keep={} depth={} mode={}", spec->tree_id,
                spec->branch_id, spec->expand, spec->keep, spec->depth,
                by_client ? "client" : "logprob");
  StatusOr<SearchResult> r = run_tree_search(scheduler_, *tokenizer_, *spec, hooks);
  if (!r.ok()) {
    if (ctx->IsCancelled() && r.status().code() != StatusCode::kDeadlineExceeded) {
      return grpc::Status(grpc::StatusCode::CANCELLED,
                          "the client cancelled the call or its deadline passed; the search's "
                          "branches were pruned");
    }
    return answer(r.status());
  }
  v1::TreeSearchResponse done;
  v1::TreeSearchDone* d = done.mutable_done();
  d->set_levels(r->levels);
  for (const SearchLeaf& leaf : r->leaves) {
    v1::TreeSearchLeaf* pl = d->add_leaves();
    pl->set_branch_id(leaf.branch_id);
    pl->set_text(leaf.text);
    pl->set_tokens(leaf.tokens);
    pl->set_score(float(leaf.score));
    pl->set_finish_reason(to_proto(leaf.finish));
    pl->set_level(leaf.level);
  }
  // The search succeeded: its leaves stay in the tree even if this last write fails.
  stream->Write(done);
  return grpc::Status::OK;
}

}  // namespace treeserve
