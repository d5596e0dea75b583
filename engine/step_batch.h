// StepBatch: everything the engine needs to run one decode step, and nothing else
// (llama.cpp's ubatch idea). The scheduler fills it from kvcache/ (slots, page copies,
// attention view) and its own bookkeeping (tokens, positions, which rows want logits);
// every backend (CPU reference, CUDA) consumes the same struct.
//
// Rows are the tokens run this step, in any mix: prefill chunks, one decode token per live
// branch, speculative draft tokens. Row r's K/V is written to kv_slots[r] BEFORE attention
// reads the pool, so the view may (and for causal attention must) include the rows' own new
// tokens. Each row is exactly one query of the view (AttentionQuery::row = r).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "engine/sampling.h"
#include "kernels/attention_view.h"
#include "kernels/kv_layout.h"

namespace treeserve {

// Copy of a fork's partially filled page (kvcache's PageCopy, field for field; the engine
// does not include kvcache/), done before the step's forward: the first num_slots slots of
// every layer's K and V, every KV head, from src_page to dst_page.
struct StepPageCopy {
  int32_t src_page = 0;
  int32_t dst_page = 0;
  int32_t num_slots = 0;  // [1, page_size]
};

// One token's K/V moved (every layer, K and V, every KV head) after a speculative accept
// (kvcache's SlotMove); slots are page * page_size + slot.
struct StepSlotMove {
  int64_t src_slot = 0;
  int64_t dst_slot = 0;
};

// What to draw from one logit row when the backend samples (StepBatch::sampling): the
// params and the draw's counter (sampling.h: the uniform is a hash of seed, stream_key and
// position).
struct StepSampling {
  SamplingParams params;
  uint64_t stream_key = 0;
  int64_t position = 0;
};

struct StepBatch {
  std::vector<int32_t> token_ids;   // [num_rows] token id of each row
  std::vector<int32_t> positions;   // [num_rows] sequence position (RoPE angle) of each row
  std::vector<int64_t> kv_slots;    // [num_rows] page * page_size + slot the row's K/V goes to
  AttentionView view;               // what each row's query sees (rows' own tokens included)
  std::vector<int32_t> logit_rows;  // rows whose logits are wanted, in output order
  // false: every logit row is sampled greedily without logprob alternatives, so a backend
  // may return only each row's argmax and its logprob (Logits::argmax) instead of the full
  // [rows][vocab] logits (a GPU backend then copies a few bytes per row, not the vocab).
  bool full_logits = true;
  // Ids >= vocab_limit are never produced: the backend's argmax (full_logits == false) and
  // its logprob consider only the first vocab_limit logits of a row, and so must the
  // caller's sampling of full rows. For checkpoints whose embedding is padded past the
  // tokenizer's vocabulary. 0 = the model's whole vocab_size.
  int64_t vocab_limit = 0;
  // Non-empty (one entry per logit row): the backend samples every logit row itself and
  // returns Logits::sampled instead of logits or argmaxes — a GPU backend then copies a
  // token, its logprob and the requested alternatives per row, not the vocabulary.
  std::vector<StepSampling> sampling;
  std::vector<StepSlotMove> slot_moves;   // done first, in order
  std::vector<StepPageCopy> page_copies;  // done next, in order; then the forward

  int32_t num_rows() const { return static_cast<int32_t>(token_ids.size()); }
  // The ids [0, n) a row's argmax or draw considers: vocab_limit, or the model's vocab_size.
  int64_t drawable_vocab(int64_t vocab_size) const {
    return vocab_limit > 0 ? vocab_limit : vocab_size;
  }

  void clear() {
    token_ids.clear();
    positions.clear();
    kv_slots.clear();
    view.clear();
    logit_rows.clear();
    full_logits = true;
    vocab_limit = 0;
    sampling.clear();
    slot_moves.clear();
    page_copies.clear();
  }
};

struct StepBatchCheckScratch {
  std::vector<int32_t> row_query;  // [num_rows] query index of each row, -1 = none yet
  std::vector<int64_t> slots;      // sorted copy of kv_slots
};

// StepBatch::sampling drawn on the host from full logits rows (logit row i at rows + i *
// row_stride floats), into *out (one SampledToken per logit row).
void sample_rows_on_host(const StepBatch& batch, const float* rows, int64_t row_stride,
                         int64_t vocab_size, SamplingScratch* scratch,
                         std::vector<SampledToken>* out);

// Checks the batch against the pool layout and the vocabulary: equal row counts, ids in
// [0, vocab), vocab_limit in [0, vocab], slots inside the pool and distinct, page copies and slot
// moves inside the pool, logit rows in range, exactly one view query per row, and each row's own
// token where the view says it is: position = depth_tokens + leaf_tokens - 1 of its query, kv_slot
// = the page and slot of token leaf_tokens - 1 of its leaf run. (The view's own structure is
// checked by validate_attention_view, which build_attention_plan runs.) Returns INVALID_ARGUMENT
// naming the first bad field.
Status validate_step_batch(const StepBatch& batch, const KvLayout& layout, int64_t vocab_size,
                           StepBatchCheckScratch* scratch);

}  // namespace treeserve
