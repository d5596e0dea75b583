// Scheduler internals shared by scheduler.cpp (commands) and step.cpp (the step loop).
// Everything here is owned and touched by the loop thread only, except the command queue.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "engine/backend.h"
#include "engine/sampling.h"
#include "engine/step_batch.h"
#include "kvcache/kv_cache.h"
#include "models/detokenizer.h"
#include "scheduler/scheduler.h"

namespace treeserve {

struct Tree;
struct TenantState;
struct GenerateJob;
struct PrefillJob;
struct VerifyJob;

// What a branch is doing this step; at most one activity at a time.
enum class Activity { kIdle, kPrefill, kGenerate, kVerify, kBeam };

struct SchedBranch {
  std::string id;           // "b_" + random (common/random_id.h)
  int32_t index = 0;        // within its tree: creation order and the sampling stream key
  std::string parent;       // the nearest live ancestor; "" for the root
  int32_t fork_offset = 0;  // tokens shared with `parent` (a prefix of both)
  int32_t children = 0;     // live branches whose parent this is
  Tree* tree = nullptr;
  bool live = true;
  std::optional<BranchId> kv;    // absent while the branch has no KV tokens yet
  int32_t kv_len = 0;            // tokens in kvcache
  std::vector<int32_t> pending;  // tokens after them, KV not computed; never empty when live
  Activity activity = Activity::kIdle;
  GenerateJob* job = nullptr;
  PrefillJob* prefill = nullptr;
  VerifyJob* verify = nullptr;
  GenerateJob* beam_job = nullptr;                 // a beam of this job's beam search
  FinishReason last_finish = FinishReason::kNone;  // of its last Generate (GetTree detail)

  int32_t length() const { return kv_len + static_cast<int32_t>(pending.size()); }
};

// Cache salt -> cache namespace, interned (scheduler/tenants.cpp): each distinct key gets the
// next id (1, 2, ...; 0 is the default namespace) for the scheduler's life. A table, not a hash
// of the salt, so two salts never share a namespace; a tenant's private namespace is keyed
// apart from every salt, so no salt can name it.
class CacheSaltTable {
 public:
  CacheNamespace salt(const std::string& salt);  // shared by every tenant with this salt
  CacheNamespace private_to(const std::string& tenant);
  size_t size() const { return salts_.size() + tenants_.size(); }

 private:
  CacheNamespace intern(std::unordered_map<std::string, CacheNamespace>* table,
                        const std::string& key);
  std::unordered_map<std::string, CacheNamespace> salts_, tenants_;
  CacheNamespace next_ = 1;
};

// A tenant as the loop thread counts it (scheduler/tenants.cpp).
struct TenantState {
  TenantLimits limits;  // kv_pages resolved (kv_share of the pool)
  CacheNamespace ns = kDefaultCacheNamespace;
  int32_t live_trees = 0;     // CreateTree's, not one-shot ones
  int32_t live_branches = 0;  // of all its trees
  // Numbers its trees in creation order (list_trees' page tokens: per tenant, so a token
  // says nothing about other tenants' trees).
  uint64_t next_tree_seq = 1;
};

// A tree's tables hold its live branches only (scheduler/tree_table.cpp): a branch that
// ends leaves both at once (its record is kept until the loop is between steps, so pointers
// taken during a step stay valid), and a live branch's parent is always live.
struct Tree {
  std::string id;                // "t_<route>.<replica>.<incarnation>.<random>"
  TenantState* owner = nullptr;  // never null; its branches live in owner->ns
  bool one_shot = false;
  bool counted = false;  // in owner->live_trees (made by CreateTree)
  uint64_t seq = 0;      // creation order among its owner's trees (list_trees' pages)
  int64_t created_unix_ms = 0;
  int32_t next_index = 0;
  std::map<int32_t, std::unique_ptr<SchedBranch>> branches;  // by index: creation order
  std::unordered_map<std::string, SchedBranch*> by_id;
  int32_t live_branches() const { return static_cast<int32_t>(branches.size()); }
  // Idle lease (none for one-shot trees): the loop deletes the tree once `expires` passes
  // with no call in flight on it. Calls naming the tree move `expires` to now + lease.
  std::chrono::milliseconds lease{0};
  std::chrono::steady_clock::time_point expires;
  int32_t holds = 0;  // Scheduler::hold_tree
};

// CreateTree: computes KV of prompt[0, L-1) in chunks; completes when only the last token
// remains pending.
struct PrefillJob {
  uint64_t seq = 0;               // identifies the job to a caller that gives up
  SchedBranch* branch = nullptr;  // null once the branch ended
  int32_t prompt_tokens = 0;
  int32_t cached_tokens = 0;
  std::function<void(StatusOr<CreateTreeResult>)> done;
};

struct GenerateBranchState {
  SchedBranch* branch = nullptr;  // null once finished (or its branch ended)
  std::string branch_id;          // kept after the branch is pruned
  int32_t generated = 0;
  bool finished = false;
  std::unique_ptr<IncrementalDetokenizer> detok;
  std::string text;  // this call's text so far (stop-string search)
  std::chrono::steady_clock::time_point last_token_time;
};

// One hypothesis of a beam search: a branch (a child of the searched branch) and the tokens
// it added.
struct Beam {
  SchedBranch* branch = nullptr;  // null once pruned
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  double total = 0;  // sum of logprobs
  bool ended = false;
  FinishReason reason = FinishReason::kNone;
  int32_t logit_index = -1;  // this step's logits row, -1 when it did not run
};

struct GenerateJob {
  uint64_t seq = 0;  // identifies the job to a late cancel()
  std::shared_ptr<GenerateStream> stream;
  Tree* tree = nullptr;
  bool one_shot = false;
  SamplingParams sampling;
  int32_t max_tokens = 0;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  std::vector<GenerateBranchState> branches;
  int32_t unfinished = 0;
  bool waiting_prefill = false;  // one-shot n > 1: the prompt is prefilled before the fork
  std::chrono::steady_clock::time_point start;
  bool first_token_seen = false;
  // One-shot: the prompt's tokens and those the radix cache supplied (reported on each
  // branch's first token).
  int32_t prompt_tokens = 0;
  int32_t cached_tokens = 0;
  // Beam search (beam_width > 0): `branches` is empty; the beams live here.
  int32_t beam_width = 0;
  float length_penalty = 0;
  std::vector<Beam> beams;
  int32_t beam_steps = 0;
};

struct VerifyJob {
  SchedBranch* branch = nullptr;  // null once the call ended
  std::vector<int32_t> tokens;
  std::vector<int32_t> parents;
  SamplingParams sampling;
  std::function<void(StatusOr<VerifyResult>)> done;
};

// Per-step bookkeeping of one branch's rows.
struct StepEntry {
  SchedBranch* branch = nullptr;
  int32_t first_row = 0;
  int32_t num_rows = 0;           // pending tokens run this step
  int32_t logit_index = -1;       // into Logits rows: the last pending row's logits, or -1
  int32_t draft_rows = 0;         // verify: draft rows after the pending rows
  int32_t draft_logits = -1;      // verify: logits index of the first draft
  int32_t kv_len_before = 0;      // for rollback on a failed forward
  bool created_kv = false;        // the kv branch was created this step
  std::vector<int32_t> consumed;  // the pending tokens this step moved into KV
  // How the entry's logit rows are sampled (when `samples`; a prefill chunk's are not).
  bool samples = false;
  SamplingParams sampling;
};

class Scheduler::Impl {
 public:
  Impl(Backend* backend, const Tokenizer* tokenizer, const SchedulerOptions& options,
       ServerMetrics* metrics, std::unique_ptr<KvCache> kv);
  ~Impl();

  // Queues fn for the loop thread; the future gets the result it reports through `done`.
  // UNAVAILABLE once the loop is stopping.
  template <typename T>
  StatusOr<std::future<StatusOr<T>>> submit(
      std::function<void(std::function<void(StatusOr<T>)>)> fn);
  // submit, then wait for the result.
  template <typename T>
  StatusOr<T> call(std::function<void(std::function<void(StatusOr<T>)>)> fn);
  void post(std::function<void()> fn);
  void stop();

  // Commands (loop thread).
  void cmd_create_tree(std::vector<int32_t> prompt, int64_t lease_ms, uint64_t seq,
                       const std::string& tenant, const std::string& route,
                       std::function<void(StatusOr<CreateTreeResult>)> done);
  // The caller of CreateTree `seq` gave up: its prefill stops and its tree goes.
  void cmd_abort_create(uint64_t seq);
  StatusOr<std::vector<std::string>> cmd_branch(const std::string& tree_id,
                                                const std::string& branch_id, int32_t n,
                                                int32_t at_offset, const std::string& tenant);
  Status cmd_generate(GenerateSpec spec, std::shared_ptr<GenerateStream> stream);
  StatusOr<PruneSummary> cmd_prune(const std::string& tree_id, const std::vector<std::string>& ids,
                                   bool retain_kv, const std::string& tenant);
  void cmd_verify(const std::string& tree_id, const std::string& branch_id,
                  std::vector<int32_t> tokens, std::vector<int32_t> parents,
                  SamplingParams sampling, const std::string& tenant,
                  std::function<void(StatusOr<VerifyResult>)> done);
  // With page.detail, *detail_ids gets each listed branch's tokens from its fork offset (the
  // caller detokenizes them off the loop thread).
  StatusOr<TreeSummary> cmd_get_tree(const std::string& tree_id, const TreePage& page,
                                     const std::string& tenant,
                                     std::vector<std::vector<int32_t>>* detail_ids = nullptr);
  // GetTree's detail of one branch, but its text (its tokens go to *ids).
  void describe_branch(const SchedBranch& b, BranchSummary* out, std::vector<int32_t>* ids) const;
  StatusOr<int64_t> cmd_delete_tree(const std::string& tree_id, const std::string& tenant);
  Status cmd_hold_tree(const std::string& tree_id, int32_t delta, const std::string& tenant);
  StatusOr<TreeList> cmd_list_trees(const std::string& tenant, const TreePage& page);
  SchedulerStats cmd_stats();
  void cmd_cancel(uint64_t job_seq);
  // Makes `b` one of the job's generating branches.
  void attach_branch(GenerateJob* job, SchedBranch* b);
  void start_one_shot(GenerateJob* job, Tree* tree, SchedBranch* root, int32_t n, Status status);

  // Tenants and quotas (tenants.cpp; loop thread).
  // Validates the tenants, interns their salts and sets their namespaces' page limits.
  Status configure_tenants(const std::vector<TenantLimits>& tenants);
  // The tenant's state: configured, or made on first use (no quotas, default namespace).
  TenantState* tenant_state(const std::string& tenant);
  // RESOURCE_EXHAUSTED naming the quota when the tenant cannot have one more tree, `more`
  // more branches, or `pages` KV pages in its namespace (`what` needs them).
  Status check_tree_quota(const TenantState& t) const;
  Status check_branch_quota(const TenantState& t, int64_t more) const;
  Status check_page_quota(const TenantState& t, int64_t pages, const std::string& what) const;
  // The refusal of work in namespace `ns` that its page limit stops (the namespace's tenants,
  // its pages and limit), or OK when the pool, not the limit, is what is short.
  Status namespace_limit_refusal(CacheNamespace ns) const;

  // Tree tables and leases (tree_table.cpp; loop thread).
  // A new tree of `owner` under a fresh id carrying `route`; lease_ms 0 = no lease (one-shot).
  Tree* add_tree(bool one_shot, int64_t lease_ms, TenantState* owner, const std::string& route);
  // The tree, its lease renewed (any call naming a tree renews it). A tree of another tenant
  // is NOT_FOUND exactly as an unknown id is.
  StatusOr<Tree*> find_tree(const std::string& id, const std::string& tenant);
  StatusOr<SchedBranch*> find_branch(Tree* tree, const std::string& id);
  // The tree's id, live branches, tokens, KV pages, lease expiry and creation time.
  void tree_totals(const Tree& tree, TreeListing* out);
  SchedBranch* add_branch(Tree* tree, SchedBranch* parent, int32_t fork_offset);
  // Ends a branch: its job (if any) gets `reason`, its KV is released or kept as cache, and
  // it leaves its tree's tables (its live children, if any, move up to its parent). Returns
  // the tokens it gave up.
  int64_t end_branch(SchedBranch* b, bool retain_kv, FinishReason reason);
  // Renews the tree's lease (now + lease).
  void touch(Tree* tree);
  // Deletes the trees whose lease ran out with no call in flight; renews busy ones.
  void expire_leases();
  // Frees the records of ended branches and removed trees (between steps).
  void free_ended();
  // Forgets deferred page copies whose destination page was freed (its branch ended).
  void drop_dead_copies();
  void finish_job_branch(GenerateJob* job, GenerateBranchState& st, FinishReason reason,
                         const TokenEvent* last);
  void maybe_close_job(GenerateJob* job, Status status);
  void close_finished_jobs();
  void remove_tree(Tree* tree, bool retain_kv, int64_t* freed);
  int32_t pages_for(int64_t tokens) const;
  void update_gauges();

  // The step loop (step.cpp).
  void loop();
  bool has_work() const;
  // Builds and runs one step; false when no work could run.
  bool step();
  // Adds rows for `b` (its first `count` pending tokens); false if KV pages are short.
  bool add_rows(SchedBranch* b, int32_t count, bool want_logits, StepEntry* entry);
  // Rows for a generating branch (or beam): one decode row, or a chunk of its pending text
  // within *budget (prefix-cached tokens are free), with logits once the text is consumed.
  bool add_pending_rows(SchedBranch* b, int32_t* budget, StepEntry* entry);
  void rollback(const StepEntry& e);
  // Fails the waiting work (verifies, prefills, generations) of every tree, or of the trees in
  // cache namespace *only.
  void fail_stalled(const Status& status, const CacheNamespace* only = nullptr);
  void after_prefill(StepEntry& e);
  void after_generate(StepEntry& e);
  void after_verify(StepEntry& e);
  // Beam search (beam.cpp).
  Status start_beam_search(GenerateJob* job, SchedBranch* root);
  void after_beam_step(GenerateJob* job);
  void finish_beam_search(GenerateJob* job, Status status);
  double beam_score(const GenerateJob& job, const Beam& beam) const;
  // A beam step's draw: greedy, with 2 x width alternatives (the candidates).
  static SamplingParams beam_step_sampling(const GenerateJob& job);
  SampledToken sample(int32_t logit_index, const SamplingParams& params, const SchedBranch* b,
                      int64_t position);
  // Fills batch_.sampling from the entries (the backend draws every logit row) when some row
  // samples with temperature or reports alternatives; otherwise asks for argmaxes only.
  void request_sampling();

  Backend* backend_;
  const Tokenizer* tokenizer_;
  // The tokenizer's streaming table (anchor piece, context-free piece texts), built once.
  std::unique_ptr<DetokenizerVocab> detok_vocab_;
  SchedulerOptions options_;
  ServerMetrics* metrics_;
  std::unique_ptr<KvCache> kv_;
  std::vector<int32_t> eos_ids_;
  int64_t vocab_ = 0;
  size_t rotation_ = 0;  // which generate job goes first in the next step  // ids sampled:
                         // min(model vocab_size, tokenizer vocabulary)

  std::unordered_map<std::string, std::unique_ptr<Tree>> trees_;
  std::unordered_map<std::string, std::unique_ptr<TenantState>> tenants_;
  CacheSaltTable salts_;
  // Ended branches and removed trees, freed by free_ended() at the top of the next loop
  // iteration: a step or command that ended them may still hold their pointers.
  std::vector<std::unique_ptr<SchedBranch>> ended_branches_;
  std::vector<std::unique_ptr<Tree>> ended_trees_;
  // The earliest time a lease may run out (expire_leases looks no earlier).
  std::chrono::steady_clock::time_point next_lease_check_ =
      std::chrono::steady_clock::time_point::max();
  uint64_t next_job_seq_ = 1;
  std::atomic<uint64_t> next_call_seq_{1};  // CreateTree calls, numbered by their caller
  std::vector<std::unique_ptr<PrefillJob>> prefills_;
  std::vector<std::unique_ptr<GenerateJob>> jobs_;
  std::vector<std::unique_ptr<VerifyJob>> verifies_;
  // KV moves/copies decided between steps, performed at the start of the next step.
  std::vector<StepSlotMove> deferred_moves_;
  std::vector<StepPageCopy> deferred_copies_;
  int64_t steps_ = 0;
  // The backend forward's span in the last step (the step_host / step_forward metrics).
  std::chrono::steady_clock::time_point forward_begin_, forward_end_;
  int32_t stalled_steps_ = 0;

  // Step scratch, reused.
  StepBatch batch_;
  Logits logits_;
  std::vector<StepEntry> entries_;
  std::vector<ViewQuery> view_queries_;
  std::vector<KvSlot> slots_;
  SamplingScratch sampling_scratch_;

  // Command queue.
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> commands_;
  bool stopping_ = false;
  std::thread thread_;
};

// Fills in the replica and run tree ids name ("local", a fresh incarnation) and checks them:
// INVALID_ARGUMENT naming replica_id or incarnation (tree_table.cpp).
Status resolve_tree_id_options(SchedulerOptions* options);

}  // namespace treeserve
