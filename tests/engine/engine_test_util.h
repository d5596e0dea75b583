// Helpers for the engine tests: the tiny model (loaded once per process) and a small
// scheduler stand-in that drives a Backend from kvcache/'s KvCache exactly as the scheduler
// will — slots, page copies, slot moves and attention views all come from KvCache.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "kvcache/kv_cache.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "tests/engine/reference_model.h"

namespace treeserve::testing {

struct TinyModel {
  ModelConfig config;
  LlamaWeights weights;
  std::unique_ptr<ReferenceModel> reference;
};

// The tiny model of TREESERVE_TINY_MODEL_DIR, loaded on first use; nullptr (after an ADD_FAILURE
// naming the problem) if it cannot be loaded.
const TinyModel* tiny_model();

// A backend over the tiny model (kv_cache_fp8: with the FP8 KV cache's emulation); fails the
// test (returns nullptr) on error.
std::unique_ptr<Backend> make_cpu_backend(const TinyModel& model, int32_t page_size,
                                          int64_t num_pages, int32_t num_threads = 2,
                                          bool kv_cache_fp8 = false);

// Deterministic pseudo-random tokens in [3, vocab) (no unk / bos / eos).
std::vector<int32_t> test_tokens(int64_t n, uint64_t seed, int64_t vocab);

// Max |a - b| over n floats.
float max_abs_diff(const float* a, const float* b, int64_t n);

// Drives one Backend + KvCache pair like the scheduler: tokens added to a branch are pending
// until the next step() runs them (with whatever page copies and slot moves are pending).
class TreeDriver {
 public:
  TreeDriver(Backend* backend, int32_t page_size, int32_t num_pages);

  BranchId start(std::span<const int32_t> prompt);
  std::vector<BranchId> fork(BranchId branch, int32_t n);
  void append(BranchId branch, std::span<const int32_t> tokens);
  // Speculative token tree after the branch's last token (see KvCache::append_token_tree).
  void append_drafts(BranchId branch, std::span<const int32_t> tokens,
                     std::span<const int32_t> parents);
  void accept(BranchId branch, std::span<const int32_t> path);
  void prune(BranchId branch);

  // Fills *batch with the pending tokens of `branches` (in that order; every branch listed
  // must have pending tokens or drafts) and the pending copies and moves. Logits: every row
  // when all_logits, else the last pending token of each branch.
  void build_step(std::span<const BranchId> branches, bool all_logits, StepBatch* batch);
  // build_step + forward; the pending state is cleared only on success.
  Status step(std::span<const BranchId> branches, bool all_logits, Logits* out);

  // The branch's tokens (as KvCache holds them).
  std::vector<int32_t> tokens(BranchId branch) const;
  KvCache& kv() { return *kv_; }
  size_t pending_copies() const { return copies_.size(); }
  size_t pending_moves() const { return moves_.size(); }

 private:
  struct Pending {
    std::vector<int32_t> tokens;
    std::vector<KvSlot> slots;
    std::vector<int32_t> draft_tokens, draft_parents;
    std::vector<KvSlot> draft_slots;
  };
  Backend* backend_;
  int32_t page_size_;
  std::unique_ptr<KvCache> kv_;
  std::map<BranchId, Pending> pending_;
  std::vector<StepPageCopy> copies_;
  std::vector<StepSlotMove> moves_;
  StepBatch batch_;
};

}  // namespace treeserve::testing
