// The TreeServe gRPC service: validates every request at the boundary (docs/api.md, Errors),
// authenticates when a key is configured (server/auth.h), answers UNAVAILABLE while the model
// loads, applies the caller's tenant quotas on requests per second and streams
// (server/quotas.h), and forwards to the components below, naming the caller's tenant in
// every scheduler call (a tree of another tenant is NOT_FOUND there).
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "proto/treeserve.grpc.pb.h"
#include "scheduler/scheduler.h"
#include "scheduler/tree_search.h"
#include "server/auth.h"
#include "server/config.h"
#include "server/parsed_service.h"
#include "server/quotas.h"
#include "server/routing.h"

namespace treeserve {

class ChatTemplate;
class Tokenizer;
struct ModelConfig;

// What the service reads about the loaded model and the KV pool.
struct ServingInfo {
  std::string model_name;
  std::string backend;  // "cpu" | "cuda"
  int32_t tensor_parallel = 1;
  int32_t page_size = 16;
  int64_t kv_pages_total = 0;
  // The pool's K/V element type: "float16", "bfloat16", "float32" (CPU backend) or "fp8_e4m3"
  // (kv_cache.dtype fp8; on the CPU backend emulated in its float32 pool).
  std::string kv_cache_dtype = "float32";
  int64_t max_sequence_tokens = 0;  // the model's context; 0 = unlimited
  // Bytes of one text field (a text prompt or append, Tokenize's text, a stop string), checked
  // before any tokenizing; 0 = unbounded. The server derives it from limits.max_prompt_tokens
  // and the tokenizer's longest piece (app.cpp).
  int64_t max_text_bytes = 0;
  // Renders `messages` prompts (models/chat_template.h); null: the model has no chat template
  // and such prompts are FAILED_PRECONDITION.
  const ChatTemplate* chat_template = nullptr;
  // Why max_sequence_tokens is what it is, when not max_position_embeddings (said in the
  // refusal of a prompt that does not fit), e.g. the model's sliding window.
  std::string context_limit_reason;
  // This run of the replica (8 hex digits, drawn at start): tree ids name it, and an id of an
  // earlier run is NOT_FOUND naming the restart (server/routing.h).
  std::string incarnation;
};

class TreeServeService final : public ParsedRequestsService {
 public:
  // `scheduler` null: the model is still loading, and every call gets UNAVAILABLE until
  // set_ready. `auth` null: no authentication (every call is the default principal).
  // `tenants` null: no per-tenant rate or stream limits.
  TreeServeService(const TreeserveConfig& config, const Tokenizer* tokenizer, ServingInfo info,
                   Scheduler* scheduler, Authenticator* auth = nullptr,
                   TenantGate* tenants = nullptr);

  grpc::Status CreateTree(grpc::ServerContext*, const v1::CreateTreeRequest*,
                          v1::CreateTreeResponse*) override;
  grpc::Status Branch(grpc::ServerContext*, const v1::BranchRequest*, v1::BranchResponse*) override;
  // Generate (ParsedRequestsService reads its request and calls this).
  grpc::Status generate_stream(grpc::ServerContext*, const v1::GenerateRequest*,
                               grpc::internal::WriterInterface<v1::GenerateResponse>*) override;
  grpc::Status Prune(grpc::ServerContext*, const v1::PruneRequest*, v1::PruneResponse*) override;
  grpc::Status Verify(grpc::ServerContext*, const v1::VerifyRequest*, v1::VerifyResponse*) override;
  grpc::Status GetTree(grpc::ServerContext*, const v1::GetTreeRequest*, v1::TreeInfo*) override;
  grpc::Status DeleteTree(grpc::ServerContext*, const v1::DeleteTreeRequest*,
                          v1::DeleteTreeResponse*) override;
  grpc::Status Tokenize(grpc::ServerContext*, const v1::TokenizeRequest*,
                        v1::TokenizeResponse*) override;
  grpc::Status Detokenize(grpc::ServerContext*, const v1::DetokenizeRequest*,
                          v1::DetokenizeResponse*) override;
  grpc::Status GetServerInfo(grpc::ServerContext*, const v1::GetServerInfoRequest*,
                             v1::ServerInfo*) override;
  grpc::Status TreeSearch(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<v1::TreeSearchResponse, v1::TreeSearchRequest>*) override;
  grpc::Status ListTrees(grpc::ServerContext*, const v1::ListTreesRequest*,
                         v1::ListTreesResponse*) override;

  // Graceful shutdown: from now on new calls get UNAVAILABLE; in-flight ones go on.
  void begin_drain() { draining_ = true; }
  // The model is loaded: calls from now on go to `scheduler`.
  void set_ready(Scheduler* scheduler) {
    scheduler_ = scheduler;
    ready_.store(true, std::memory_order_release);
  }
  int active_calls() const { return active_calls_.load(); }

 private:
  // UNAUTHENTICATED unless auth is off or the call carries "authorization: Bearer <token>".
  // Then UNAVAILABLE while the model loads (scheduler_ is read only after this check passed),
  // then RESOURCE_EXHAUSTED when the tenant is over its requests per second.
  // Then INVALID_ARGUMENT for an x-treeserve-route header that is not a routing key.
  // `principal` (may be null) gets who the call acts for.
  // `method` ("CreateTree") names the call in the failed-authentication log.
  grpc::Status check_auth(const grpc::ServerContext* context, std::string_view method,
                          Principal* principal = nullptr) const;
  grpc::Status admit(const grpc::ServerContext* context, const google::protobuf::Message& request,
                     Principal* principal = nullptr) const;
  // INVALID_ARGUMENT for a request over server.max_request_bytes.
  grpc::Status check_size(const google::protobuf::Message& request) const;
  // A scheduler call's status as the client gets it; tenant quota refusals are counted.
  grpc::Status answer(const Status& status) const;
  // FAILED_PRECONDITION for a tree of another replica, NOT_FOUND for one of an earlier run
  // (server/routing.h): before the scheduler looks the tree up, so before its tenant's.
  grpc::Status check_replica(const std::string& tree_id) const;
  // A stream slot of the tenant (Generate, TreeSearch); empty without a TenantGate.
  StatusOr<TenantGate::StreamSlot> open_stream(const Principal& who) const;
  Status check_ids(const std::string& field, const std::vector<int32_t>& ids) const;
  StatusOr<std::vector<int32_t>> resolve_prompt(const std::string& field, const v1::Prompt& prompt,
                                                bool bos) const;
  // A messages prompt's token ids: rendered with the chat template (as a continuation of the
  // branch's conversation for an append) and tokenized without an added BOS.
  StatusOr<std::vector<int32_t>> resolve_messages(const std::string& field,
                                                  const v1::ChatMessages& chat,
                                                  bool continuation) const;
  // Validated sampling parameters; with spec, also its max_tokens and stop conditions.
  StatusOr<SamplingParams> resolve_sampling(const v1::SamplingParams& p, GenerateSpec* spec) const;
  StatusOr<TreeSearchSpec> resolve_search(const v1::TreeSearchStart& start) const;

  const TreeserveConfig config_;
  const Tokenizer* tokenizer_;
  const ServingInfo info_;
  Scheduler* scheduler_;
  Authenticator* auth_;
  TenantGate* tenants_;
  std::atomic<bool> ready_{false};
  std::atomic<bool> draining_{false};
  std::atomic<int> active_calls_{0};
  friend class CallScope;
};

}  // namespace treeserve
