// Scheduler: decoding trees and their branches, driven by one step-loop thread that owns the
// KV cache and the backend. Every public call is thread-safe: it becomes a command that the
// loop runs between two steps, so tree state is only ever touched by the loop thread.
//
// Branch state. A branch's token sequence is its KV tokens (in kvcache/, computed) followed
// by `pending` tokens whose KV the next step computes. The last token of a branch is always
// pending: the step that computes its KV also yields the logits of the next token, so no
// logits are kept between calls and a fork copies nothing but the pending list.
//
// Each step batches, for every tree: the prefill chunks of new trees and of appended text,
// one decode row per generating branch, and whole speculative token trees (continuous
// batching: work that arrives joins at the next step). Prefill chunks share a per-step token
// budget; decode and verify rows always run.
//
// Memory. Work that cannot get KV pages (after evicting unlocked cached prefixes) waits for
// a later step; when nothing at all can run, the waiting work is refused with
// RESOURCE_EXHAUSTED and leaves nothing behind. A request larger than the whole pool is
// refused at once. A tree's tables hold its live branches only: a branch that ends (Prune,
// a dropped beam) leaves them, so memory and GetTree grow with live branches, not history.
//
// Ids. Tree ids ("t_<route>.<replica>.<incarnation>.<random>", common/route_key.h) and branch
// ids ("b_...") carry 128 random bits (common/random_id.h): unguessable, and never reused,
// within a run or across restarts. A tree id also names the tree's routing key (given by the
// caller, else the key of its prompt's ids), this replica and its run, so that the server can
// tell a call routed to the wrong replica from one naming an unknown tree. A branch's sampling
// stream key is its creation index within its tree, so seeded sampling does not depend on the
// ids.
//
// Leases. A tree that no call touches for its idle lease is deleted by the loop thread, its
// KV kept as evictable cache (as DeleteTree). Any call naming the tree renews the lease; a
// tree with a call in flight (Generate, Verify, its prefill, a held TreeSearch) does not
// expire. One-shot trees have no lease.
//
// Cancellation. A cancelled Generate stops its branches within one step; they stay live with
// every token they have (FINISH_CANCELLED), the tree usable. A CreateTree or Branch whose
// caller gives up (its CancelCheck turns true) leaves nothing behind.
//
// Tenants (scheduler/tenants.cpp). Every call names the tenant it acts for (`tenant`; callers
// without tenants, such as tests and tools, leave it ""). A tree belongs to the tenant whose
// call made it: another tenant's call naming it gets NOT_FOUND with the message an unknown id
// gets, and renews nothing. Each tenant's trees create their branches in its cache namespace
// (kvcache/kv_cache.h), so a prefix is reused, and counted in cached_tokens, only between
// trees of tenants with the same cache salt. A tenant's quotas (SchedulerOptions::tenants)
// bound its live trees, its live branches and its namespace's KV pages; a refusal is
// RESOURCE_EXHAUSTED naming the tenant, its usage and the quota. A tenant the scheduler was not
// configured with has no quotas and shares the default namespace with the other such tenants.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/sampling.h"

namespace treeserve {

class DetokenizerVocab;

class Backend;
class Tokenizer;
struct ServerMetrics;

// One tenant's quotas and cache partition (SchedulerOptions::tenants). 0 = no limit.
struct TenantLimits {
  std::string tenant;
  // Tenants with the same non-empty salt share one cache namespace (and its KV page limit: the
  // sum of theirs, none when one of them has none); "" = a namespace of the tenant's own.
  std::string cache_salt;
  int32_t max_live_trees = 0;     // trees made by CreateTree
  int32_t max_live_branches = 0;  // branches of all its trees, one-shot Generates' included
  // KV pages its cache namespace may hold: kv_pages, else kv_share of the pool (at least 1).
  // Its live branches' pages count, and so does its evictable cache, which the namespace
  // recycles (LRU) before it takes a page from the pool.
  int32_t kv_pages = 0;
  double kv_share = 0;  // in (0, 1]
};

struct SchedulerOptions {
  int32_t max_step_tokens = 512;  // prefill tokens per step
  // Rows per step (decode rows, speculative trees, prefill chunks): work past it waits for a
  // later step, jobs taking turns to go first (a step always runs its first piece of work).
  // Bounds one forward's size, so a flood of branches queues instead of overflowing the
  // backend's fixed buffers.
  int32_t max_step_rows = 4096;
  int32_t max_live_trees = 4096;
  int32_t max_branches_per_tree = 4096;
  bool prefix_sharing = true;  // false: no radix reuse across trees (a prefix-unaware server)
  int32_t default_max_tokens = 16;
  // The model's context (max_position_embeddings): a branch never grows past it (its
  // generation ends FINISH_LENGTH; appends and token trees that would pass it are refused).
  // 0 = unlimited.
  int64_t max_sequence_tokens = 0;
  // A tree's idle lease when CreateTree names none (ms).
  int64_t tree_lease_default_ms = 600'000;
  // Tenants with quotas or a cache partition; each name at most once.
  std::vector<TenantLimits> tenants;
  // What tree ids name (common/route_key.h): this replica ("" = "local") and its run (8 hex
  // digits; "" = drawn at create).
  std::string replica_id;
  std::string incarnation;
};

// A caller's way to give up on a call: polled by the calling thread while it waits (at least
// every 20 ms) and once more when the result is ready. Empty = never.
using CancelCheck = std::function<bool()>;

enum class FinishReason { kNone = 0, kLength, kStop, kEos, kPruned, kCancelled };
// What a branch is doing: idle, its CreateTree prefill, a Generate, a Verify, or running
// beams (a beam search from it).
enum class BranchState { kIdle = 0, kPrefill, kGenerating, kVerifying, kBeam };

struct TokenEvent {
  std::string branch_id;
  int32_t token_id = 0;
  std::string text;  // the text this token completes (may be "" mid-character)
  float logprob = 0;
  std::vector<TokenLogprob> top_logprobs;
  FinishReason finish = FinishReason::kNone;
  float score = 0;  // beam search: the beam's score, on its last event
  // One-shot calls, on each branch's first token: the prompt's tokens, and how many of them
  // were reused from the radix cache (0 elsewhere).
  int32_t prompt_tokens = 0;
  int32_t cached_tokens = 0;
};

// The events of one Generate call, produced by the step loop and consumed by one reader.
class GenerateStream {
 public:
  enum class Wait { kEvent, kEnd, kTimeout };
  // Next event, the end of the stream (*final_status set), or a timeout.
  Wait next(TokenEvent* event, Status* final_status, std::chrono::milliseconds timeout);
  // Stops the call's unfinished branches within one step (FINISH_CANCELLED events follow).
  // They stay live with every token they have; a one-shot call's tree goes with the call, a
  // beam search keeps its beams (those with tokens) as live children. Idempotent.
  void cancel();

  // Producer side (the step loop).
  void push(TokenEvent event);
  void close(Status status);

 private:
  friend class Scheduler;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TokenEvent> events_;
  bool closed_ = false;
  Status final_;
  std::function<void()> on_cancel_;
};

struct CreateTreeResult {
  std::string tree_id;
  std::string root_branch_id;
  int32_t prompt_tokens = 0;
  int32_t cached_tokens = 0;
  int64_t lease_ms = 0;  // the tree's idle lease
};

struct CreateTreeOptions {
  int64_t lease_ms = 0;   // the idle lease; 0 = SchedulerOptions::tree_lease_default_ms
  CancelCheck cancelled;  // true: the prefill stops and the tree is removed
  std::string tenant;     // who the tree belongs to
  // The tree's routing key, the route part of its id (1 to 64 of [A-Za-z0-9._-]); "" = the
  // routing key of the prompt's ids (route_key_ids).
  std::string route;
};

struct GenerateSpec {
  std::string tenant;   // who the call acts for
  std::string tree_id;  // empty: one-shot
  std::vector<std::string> branch_ids;
  std::vector<int32_t> append;  // appended to every listed branch first
  std::vector<int32_t> prompt;  // one-shot
  int32_t n = 1;                // one-shot
  SamplingParams sampling;
  int32_t max_tokens = 0;  // 0 = SchedulerOptions::default_max_tokens
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  // > 0: beam search of this width from the one listed branch (or the one-shot prompt with
  // n = 1) instead of sampling; the best beams are streamed at the end.
  int32_t beam_width = 0;
  float length_penalty = 0;
};

struct PruneSummary {
  int32_t pruned_branches = 0;
  int64_t freed_tokens = 0;
};

struct VerifyResult {
  std::vector<int32_t> accepted_tokens;
  int32_t bonus_token = 0;
};

struct BranchSummary {
  std::string branch_id;
  // The nearest live ancestor ("" for the root): the branch it was forked from, or, once that
  // one ended (a beam dropped by its search), that branch's own parent.
  std::string parent_branch_id;
  int32_t length = 0;
  bool live = false;  // always true: ended branches are not listed
  // With TreePage::detail only (else zero / empty):
  int32_t fork_offset = 0;  // tokens shared with the parent
  BranchState state = BranchState::kIdle;
  FinishReason finish_reason = FinishReason::kNone;  // of its last Generate
  std::string text;          // its tokens from fork_offset to its end, detokenized
  int32_t kv_pages = 0;      // pages its whole path reads (its page table)
  int32_t shared_pages = 0;  // of those, pages the radix cache or another branch holds too
};

// One page of a tree's live branches, in creation order.
struct TreePage {
  int32_t page_size = 0;   // 0 = every live branch
  std::string page_token;  // "" = from the first; else a next_page_token of this tree
  // Also each branch's state, last finish reason, text and page counts (the text is
  // detokenized on the calling thread, not the step loop's).
  bool detail = false;
};

struct TreeSummary {
  std::string tree_id;
  std::vector<BranchSummary> branches;  // this page
  std::string next_page_token;          // "" on the last page
  int32_t live_branches = 0;            // in the whole tree
  int64_t total_tokens = 0;             // whole tree
  int64_t kv_pages = 0;                 // whole tree
  int64_t lease_ms = 0;                 // 0 for a one-shot tree
  int64_t expires_at_unix_ms = 0;       // when the lease runs out unless renewed; 0: no lease
};

// One of a tenant's live trees (Scheduler::list_trees).
struct TreeListing {
  std::string tree_id;
  int32_t live_branches = 0;
  int64_t total_tokens = 0;  // counting shared tokens once
  int64_t kv_pages = 0;
  int64_t lease_ms = 0;
  int64_t expires_at_unix_ms = 0;
  int64_t created_at_unix_ms = 0;
};

struct TreeList {
  std::vector<TreeListing> trees;  // this page, oldest first
  std::string next_page_token;     // "" on the last page
};

struct SchedulerStats {
  int64_t kv_pages_total = 0;
  int64_t kv_pages_free = 0;
  int64_t kv_pages_evictable = 0;
  int64_t radix_cached_tokens = 0;
  int64_t radix_nodes = 0;
  int32_t live_trees = 0;
  int32_t live_branches = 0;
  int32_t running_requests = 0;
  int32_t waiting_requests = 0;
  int64_t steps = 0;
};

class Scheduler {
 public:
  // The backend's pool (kv_layout) sizes the KV cache. metrics may be null.
  static StatusOr<std::unique_ptr<Scheduler>> create(Backend* backend, const Tokenizer* tokenizer,
                                                     const SchedulerOptions& options,
                                                     ServerMetrics* metrics);
  ~Scheduler();  // stops the loop; in-flight work ends CANCELLED

  // Every call naming a tree takes the tenant it acts for last (see "Tenants" above).
  StatusOr<CreateTreeResult> create_tree(std::vector<int32_t> prompt,
                                         const CreateTreeOptions& options = {});
  // A caller that gave up (cancelled) gets CANCELLED and no new branches.
  StatusOr<std::vector<std::string>> branch(const std::string& tree_id,
                                            const std::string& branch_id, int32_t n,
                                            int32_t at_offset,
                                            const CancelCheck& cancelled = nullptr,
                                            const std::string& tenant = "");
  StatusOr<std::shared_ptr<GenerateStream>> generate(GenerateSpec spec);
  StatusOr<PruneSummary> prune(const std::string& tree_id, const std::vector<std::string>& ids,
                               bool retain_kv, const std::string& tenant = "");
  StatusOr<VerifyResult> verify(const std::string& tree_id, const std::string& branch_id,
                                std::vector<int32_t> tokens, std::vector<int32_t> parents,
                                SamplingParams sampling, const std::string& tenant = "");
  // INVALID_ARGUMENT for a page_token that is not one of this tree's, or a negative size.
  StatusOr<TreeSummary> get_tree(const std::string& tree_id, const TreePage& page = {},
                                 const std::string& tenant = "");
  StatusOr<int64_t> delete_tree(const std::string& tree_id, const std::string& tenant = "");
  // The tenant's live trees made by CreateTree, oldest first, `page.page_size` a page (0 =
  // all). INVALID_ARGUMENT for a page_token that no list_trees returned. Renews no lease.
  StatusOr<TreeList> list_trees(const std::string& tenant, const TreePage& page = {});
  // A call driven from outside the loop (TreeSearch) holds its tree so that the lease cannot
  // run out between its own calls; release renews the lease. NOT_FOUND for an unknown tree.
  Status hold_tree(const std::string& tree_id, const std::string& tenant = "");
  void release_tree(const std::string& tree_id, const std::string& tenant = "");
  SchedulerStats stats();
  // The options it was created with (limits a caller checks up front).
  const SchedulerOptions& options() const;
  ServerMetrics* metrics() const;  // may be null
  // The tokenizer's streaming table, built once (null without a tokenizer); immutable, so
  // any thread may detokenize with it.
  const DetokenizerVocab* detokenizer_vocab() const;

  // Ends every in-flight call (CANCELLED) and stops the loop. Idempotent.
  void shutdown();

  class Impl;

 private:
  explicit Scheduler(std::unique_ptr<Impl> impl);
  // Removes a tree that no caller will ever name (its CreateTree caller gave up), freeing
  // its pages.
  void discard_tree(const std::string& tree_id);
  std::unique_ptr<Impl> impl_;
};

// Checks of a request that need no tree state and that the server also makes: one function
// each, so each message has one source (scheduler/request_checks.cpp). Scheduler's methods run
// them before their command reaches the step loop, so every caller of this API gets them; the
// server runs them at their place among its own checks of the wire request, so a request with
// several faults reports the same one whichever path it came by. INVALID_ARGUMENT, naming the
// field.
//
// "<field>: must not be empty": a prompt, appended text or token tree needs tokens.
Status check_tokens_given(const std::string& field, const std::vector<int32_t>& tokens);
// A Generate on tree_id lists at least one of its branches.
Status check_branch_ids_given(const std::string& tree_id,
                              const std::vector<std::string>& branch_ids);
// A beam search's length penalty is a finite number.
Status check_length_penalty(float length_penalty);

// True for a tenant quota's refusal: RESOURCE_EXHAUSTED whose message starts "tenant '<name>':"
// (the scheduler's and the server's quota messages all do), for the refusal metric.
bool is_tenant_quota_refusal(const Status& status);

}  // namespace treeserve
