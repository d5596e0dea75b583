// Shared by the GPU tests: the tiny model's checkpoint and StepBuilder, step batches built by
// one KvCache, so that every backend that runs them holds the same pages.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "engine/step_batch.h"
#include "kvcache/kv_cache.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/safetensors.h"

namespace treeserve::testing {

// The build's tiny model, or $TREESERVE_TINY_MODEL_DIR (a copy carried to a GPU machine).
inline std::string tiny_model_dir() {
  const char* env = std::getenv("TREESERVE_TINY_MODEL_DIR");
  return env ? env : TREESERVE_TINY_MODEL_DIR;
}

// The tiny checkpoint: its config, the mapped file, and the weights (views into the mapping,
// so the reader stays where it is).
struct TinyCheckpoint {
  ModelConfig config;
  std::unique_ptr<SafetensorsReader> reader;
  LlamaWeights weights;
};

// Loads it; a failure is a test failure and gives null.
inline std::unique_ptr<TinyCheckpoint> load_tiny_checkpoint() {
  auto config = load_model_config(tiny_model_dir());
  EXPECT_TRUE(config.ok()) << config.status().message();
  auto opened = SafetensorsReader::open_dir(tiny_model_dir());
  EXPECT_TRUE(opened.ok()) << opened.status().message();
  if (!config.ok() || !opened.ok()) return nullptr;
  auto reader = std::make_unique<SafetensorsReader>(std::move(*opened));
  auto weights = load_llama_weights(*config, *reader);
  EXPECT_TRUE(weights.ok()) << weights.status().message();
  if (!weights.ok()) return nullptr;
  return std::make_unique<TinyCheckpoint>(
      TinyCheckpoint{*config, std::move(reader), std::move(*weights)});
}

class StepBuilder {
 public:
  StepBuilder(int64_t num_pages, int32_t page_size) : page_size_(page_size) {
    KvCacheConfig kc;
    kc.page_size = page_size;
    kc.num_pages = int32_t(num_pages);
    kv_ = std::move(KvCache::create(kc).value());
  }

  KvCache& kv() { return *kv_; }
  StepBatch& batch() { return batch_; }
  int64_t slot_index(const KvSlot& s) const { return int64_t(s.page) * page_size_ + s.slot; }

  // Rows for `tokens` of `branch` (already in the pool at `slots`) from first_position, and
  // their view query; logits for the last row when asked.
  void add_rows(BranchId branch, const std::vector<int32_t>& tokens,
                const std::vector<KvSlot>& slots, int32_t first_position, bool logits) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      batch_.token_ids.push_back(tokens[i]);
      batch_.positions.push_back(first_position + int32_t(i));
      batch_.kv_slots.push_back(slot_index(slots[i]));
    }
    if (logits) batch_.logit_rows.push_back(batch_.num_rows() - 1);
    queries_.push_back({branch, int32_t(tokens.size())});
  }

  // A speculative token tree under `branch`'s last token (parents index the drafts; -1: that
  // token) into the pool, and as rows with logits at first_position + depth. The view puts
  // them under the branch's query.
  Status add_token_tree(BranchId branch, const std::vector<int32_t>& drafts,
                        const std::vector<int32_t>& parents, int32_t first_position) {
    std::vector<KvSlot> slots;
    TS_RETURN_IF_ERROR(kv_->append_token_tree(branch, drafts, parents, &slots));
    std::vector<int32_t> depth(drafts.size());
    for (size_t i = 0; i < drafts.size(); ++i) {
      depth[i] = parents[i] < 0 ? 0 : depth[size_t(parents[i])] + 1;
      batch_.token_ids.push_back(drafts[i]);
      batch_.positions.push_back(first_position + depth[i]);
      batch_.kv_slots.push_back(slot_index(slots[i]));
      batch_.logit_rows.push_back(batch_.num_rows() - 1);
    }
    return Status::Ok();
  }

  void add_page_copies(const std::vector<PageCopy>& copies) {
    for (const PageCopy& c : copies) {
      batch_.page_copies.push_back({c.src_page, c.dst_page, c.num_slots});
    }
  }
  void add_slot_moves(const std::vector<SlotMove>& moves) {
    for (const SlotMove& m : moves) {
      batch_.slot_moves.push_back({slot_index(m.src), slot_index(m.dst)});
    }
  }

  // The step's attention view (before running it); clear() after it ran everywhere.
  Status build_view() { return kv_->build_attention_view(queries_, &batch_.view); }
  void clear() {
    batch_.clear();
    queries_.clear();
  }

 private:
  int32_t page_size_;
  std::unique_ptr<KvCache> kv_;
  StepBatch batch_;
  std::vector<ViewQuery> queries_;
};

}  // namespace treeserve::testing
