// Launch heuristics of tree attention (kernels/tree_attention.h), for tree_attention.cu, the
// workspace's upload, and the benches and tests that check or print them:
//
//  - the kernel's shape: its query tile, its head pairing, the stage 1 blocks an SM holds, the
//    token table's stride;
//  - which kernel runs an uploaded plan: the decode kernel (every item decode-shaped), stage 1,
//    the tail kernel (paired items beside stage 1's wide ones) or the wide kernel (pairs of
//    query tiles over the same tokens), and the kAuto rules of TreeAttentionLimits' tail_kernel
//    and wide_kernel that pick them from the plan's counts;
//  - the grid capacities a CUDA graph is captured with (tree_attention_graph_grid uses them);
//  - diagnostics: the per-block trace and the IO byte counts the benches print.
//
// The rules take counts (items, blocks, SMs), not a device query, so CPU tests check them.
#pragma once

#include <cstdint>

#include "kernels/attention_plan.h"
#include "kernels/attention_view.h"
#include "kernels/tree_attention.h"

namespace treeserve {

// ---- The kernel's shape

// Rows of the kernel's query tile: plan.queries_per_tile * plan.gqa_group_size must fit.
inline constexpr int32_t kTreeAttentionTileRows = 64;
// Kv heads stage 1 runs a decode-shaped item for in one block where the plan pairs them
// (AttentionPlanConfig::pair_heads); tiles of kv_tile_tokens / 4 tokens of each head.
inline constexpr int32_t kTreeAttentionPairHeads = 4;

// Stage 1 blocks that fit an SM at once (registers and shared memory).
inline constexpr int32_t kTreeAttentionStage1BlocksPerSm = 2;

// The fixed-stride token table's stride for items of at most max_item_tokens tokens: a whole
// number of 128-token blocks (stage 1 reads the first 128 entries before it knows the item's
// length).
inline int32_t tree_attention_table_stride(int32_t max_item_tokens) {
  return (max_item_tokens + 127) / 128 * 128;
}

// ---- Which kernel runs a plan

// Whether every item of the plan is decode-shaped (at most kDecodeShapedRows query-tile rows):
// where the upload also fills a token table and the limits allow it, the decode kernel runs
// the plan (TreeAttentionWorkspace::runs_decode_kernel).
inline bool tree_attention_all_decode_shaped(const AttentionPlan& plan) {
  for (int32_t i = 0; i < plan.num_items(); ++i) {
    if (plan.item_rows(i) > kDecodeShapedRows) return false;
  }
  return plan.num_items() > 0;
}

// The first item the kernel runs kTreeAttentionPairHeads kv heads a block for (-1: none): the
// plan's paired items where it pairs at the kernel's head count and has any
// (TreeAttentionWorkspace::paired_items_begin). -1 too for a begin outside [0, items], which
// validate_paired_items refuses (the upload checks it first).
inline int32_t tree_attention_paired_begin(const AttentionPlan& plan) {
  return plan.pair_heads == kTreeAttentionPairHeads && plan.paired_items_begin >= 0 &&
                 plan.paired_items_begin < plan.num_items()
             ? plan.paired_items_begin
             : -1;
}

// The wide kernel's work in a plan: the number of leading pairs of items (2 i, 2 i + 1) that
// read the same tokens (equal segment lists, pages and slots alike) without masks, each a query
// tile of at most kTreeAttentionTileRows rows, the first of more than kDecodeShapedRows, none
// head-paired: the query tiles of one shared chunk, which the kV-major item order lists side by
// side (few-shot prompts, speculative trees' prompts). Counting stops at the first pair that
// is not one.
inline int32_t tree_attention_wide_pairs(const AttentionPlan& plan) {
  const int32_t end = plan.pair_heads > 1 ? plan.paired_items_begin : plan.num_items();
  int32_t pairs = 0;
  for (int32_t a = 0; a + 1 < end; a += 2, ++pairs) {
    const int32_t b = a + 1;
    const size_t ia = size_t(a), ib = size_t(b);
    if (plan.item_mask_offset[ia] >= 0 || plan.item_mask_offset[ib] >= 0) break;
    if (plan.item_rows(a) <= kDecodeShapedRows || plan.item_rows(a) > kTreeAttentionTileRows ||
        plan.item_rows(b) < 1 || plan.item_rows(b) > kTreeAttentionTileRows) {
      break;
    }
    if (plan.item_num_tokens[ia] < 1 || plan.item_num_tokens[ia] != plan.item_num_tokens[ib]) {
      break;
    }
    const int32_t sa = plan.item_segment_begin[ia], sb = plan.item_segment_begin[ib];
    const int32_t n = plan.item_segment_end[ia] - sa;
    if (plan.item_segment_end[ib] - sb != n) break;
    bool same = true;
    for (int32_t j = 0; same && j < n; ++j) {
      const size_t x = size_t(sa + j), y = size_t(sb + j);
      same = sa + j == sb + j || (plan.seg_page_begin[x] == plan.seg_page_begin[y] &&
                                  plan.seg_first_slot[x] == plan.seg_first_slot[y] &&
                                  plan.seg_num_tokens[x] == plan.seg_num_tokens[y]);
    }
    if (!same) break;
  }
  return pairs;
}

// TreeAttentionLimits::Wide::kAuto's block rule (tree_attention_auto_kernels adds that no items
// are left for stage 1 after the wide kernel's pairs): the plan has wide items and paired ones,
// and either the paired items' blocks do not fit beside the wide ones in one wave of stage 1's
// block slots, so that stage 1 would run them as a second, DRAM-bound wave, or the wide blocks
// alone take more than a wave (the wide kernel's blocks loop over its units instead). Where the
// paired blocks fit beside the wide ones, stage 1 already runs both kinds side by side.
inline bool tree_attention_wide_pays(int64_t wide_blocks, int64_t paired_blocks, int32_t num_sms) {
  const int64_t slots = int64_t(kTreeAttentionStage1BlocksPerSm) * num_sms;
  return paired_blocks > 0 && wide_blocks > 0 && wide_blocks + paired_blocks > slots;
}

// TreeAttentionLimits::Tail::kAuto: the tail kernel runs a plan's paired items (where the wide
// kernel does not take the plan) where the wide items' blocks fill one wave of stage 1's slots
// at most but at least 3/4 of it, and the paired items' blocks do not fit beside them, so that
// few paired blocks would start before the wide ones end. Where more slots are free, stage 1
// runs the paired blocks beside the wide ones as fast as the tail kernel's one-warp blocks or
// faster.
inline bool tree_attention_tail_pays(int64_t wide_blocks, int64_t paired_blocks, int32_t num_sms) {
  const int64_t slots = int64_t(kTreeAttentionStage1BlocksPerSm) * num_sms;
  return tree_attention_wide_pays(wide_blocks, paired_blocks, num_sms) && wide_blocks <= slots &&
         4 * wide_blocks >= 3 * slots;
}

// The wide kernel for a plan of wide pairs alone (every item in one, no paired items: a
// sequence-parallel rank's share of a long prompt) at kAuto: where stage 1's blocks for them
// (wide_blocks: items x kv heads) would fill at least 3/4 of its slots and its chunks
// (chunk_tokens: the plan's longest item) are at least kTreeAttentionWideAloneChunk tokens:
// the shapes where the wide kernel measures faster than stage 1. Shorter chunks, not measured,
// stay in stage 1.
constexpr int32_t kTreeAttentionWideAloneChunk = 1024;
inline bool tree_attention_wide_alone_pays(int64_t wide_blocks, int32_t chunk_tokens,
                                           int32_t num_sms) {
  return 4 * wide_blocks >= 3 * int64_t(kTreeAttentionStage1BlocksPerSm) * num_sms &&
         chunk_tokens >= kTreeAttentionWideAloneChunk;
}

// The kAuto picks from a plan's counts: its items, where its paired items begin (-1: none; the
// workspace's paired_items_begin), its wide pairs (tree_attention_wide_pairs), its longest item's
// tokens (max_item_tokens) and the kv heads and SMs of the launch. A plan without paired items
// takes the wide kernel only where its pairs are all its items and tree_attention_wide_alone_pays.
// Otherwise only a plan that pairs from an item past the first can take either kernel: the wide
// kernel where tree_attention_wide_pays and its pairs cover every item before the paired ones, the
// tail kernel where tree_attention_tail_pays (where the wide kernel does not run).
// tree_attention_runs_wide / _runs_tail add what the counts do not say (the token table, the
// decode kernel, head_dim 128 and an sm_90a build); `bench_tree_attention --plan-only` prints
// these picks for an H100.
struct TreeAttentionAutoKernels {
  bool wide = false;
  bool tail = false;
};
inline TreeAttentionAutoKernels tree_attention_auto_kernels(int32_t items, int32_t paired_begin,
                                                            int32_t wide_pairs,
                                                            int32_t max_item_tokens,
                                                            int32_t num_kv_heads, int32_t num_sms) {
  TreeAttentionAutoKernels k;
  if (num_kv_heads < 1) return k;
  if (paired_begin < 0 || paired_begin >= items) {
    k.wide =
        wide_pairs > 0 && items == 2 * wide_pairs &&
        tree_attention_wide_alone_pays(int64_t(items) * num_kv_heads, max_item_tokens, num_sms);
    return k;
  }
  if (paired_begin < 1) return k;
  const int64_t wide = int64_t(paired_begin) * num_kv_heads;
  const int64_t paired =
      int64_t(items - paired_begin) * (num_kv_heads % kTreeAttentionPairHeads == 0
                                           ? num_kv_heads / kTreeAttentionPairHeads
                                           : num_kv_heads);
  k.wide = wide_pairs > 0 && paired_begin == 2 * wide_pairs &&
           tree_attention_wide_pays(wide, paired, num_sms);
  k.tail = tree_attention_tail_pays(wide, paired, num_sms);
  return k;
}

// Whether an eager launch of the workspace's last upload with num_kv_heads kv heads at
// head_dim runs the wide kernel (TreeAttentionLimits::wide_kernel): the upload has wide pairs,
// the build has the kernel, head_dim is 128, the plan does not run in the decode kernel, and
// at kAuto it has a token table and tree_attention_auto_kernels picks it (no items left for
// stage 1 after the pairs, and tree_attention_wide_pays, or tree_attention_wide_alone_pays for
// a plan of pairs alone).
bool tree_attention_runs_wide(const TreeAttentionWorkspace& workspace, int32_t num_kv_heads,
                              int32_t head_dim);

// Whether a launch of the workspace's last upload with num_kv_heads kv heads runs its paired
// items in the tail kernel (the workspace's limits().tail_kernel; at kAuto its num_sms() and
// tree_attention_tail_pays decide): what an eager launch does and what a grid for
// it should ask for. False where the plan runs in the decode kernel, pairs no item or only
// paired items, or has no token table.
bool tree_attention_runs_tail(const TreeAttentionWorkspace& workspace, int32_t num_kv_heads);

// The items stage 1 runs after the wide kernel's pairs of the workspace's last upload: those
// before its paired items (all, where it pairs none) past the pairs.
inline int32_t tree_attention_wide_rest(const TreeAttentionWorkspace& workspace) {
  const int32_t end =
      workspace.paired_items_begin() >= 0 ? workspace.paired_items_begin() : workspace.num_items();
  return end - 2 * workspace.wide_pairs();
}

// ---- Launch and grid sizes

// The tail kernel's shared memory a block at launch, given its own (own_bytes), a stage 1
// block's (stage1_bytes) and the device's per SM and reserved per block: padded so that three
// of its blocks fit beside kTreeAttentionStage1BlocksPerSm stage 1 blocks on an SM rather
// than four (aiming between the two counts' limits, whatever the allocation granularity), in
// whole 128-byte units: three run a one-wave plan's paired items faster than two or four (with
// four, the wide blocks end last). Not padded where that would more than double the block
// (head_dim 64), since the padding also bounds the tail blocks an SM holds once stage 1's are
// gone, nor where three would not fit.
inline int32_t tree_attention_tail_block_smem(int32_t own_bytes, int32_t stage1_bytes,
                                              int32_t smem_per_sm, int32_t reserved_per_block) {
  const int64_t left = int64_t(smem_per_sm) - int64_t(kTreeAttentionStage1BlocksPerSm) *
                                                  (int64_t(stage1_bytes) + reserved_per_block);
  const int64_t padded = (2 * left / 7 - reserved_per_block) / 128 * 128;  // left / 3.5 a block
  return padded > own_bytes && padded <= 2 * int64_t(own_bytes) ? int32_t(padded) : own_bytes;
}

// A capacity for the wide items of a tail grid (TreeAttentionGrid::wide_items): the next
// multiple of 8, so a stage 1 grid has at most 7 items' blocks of padding (the one-wave
// plans the tail kernel pays for have a few dozen wide items).
inline int32_t tree_attention_wide_bucket(int32_t n) { return n <= 8 ? 8 : (n + 7) / 8 * 8; }

// A capacity for a count: the next of 64, 72, 80, .. 128, 144, .. (8 steps per power of two),
// so a graph captured for one plan serves the next plans of about its size with at most 1/8
// of its blocks idle.
inline int32_t tree_attention_grid_bucket(int32_t n) {
  if (n <= 64) return 64;
  int32_t pow2 = 64;
  while (pow2 < (n + 1) / 2) pow2 *= 2;  // pow2 < n <= 2 pow2
  const int32_t step = pow2 / 8;
  return (n + step - 1) / step * step;
}

// ---- Diagnostics

// One stage 1 block's record (TreeAttentionWorkspace::enable_block_trace): %globaltimer
// nanoseconds at its start and end, the SM it ran on, its grid index, and its item's shape
// (stage 1's blocks or the decode kernel's, whichever ran the plan).
struct TreeAttentionBlockTrace {
  uint64_t start_ns = 0;
  uint64_t end_ns = 0;
  int32_t sm = 0;
  int32_t block = 0;
  int32_t item = 0;
  int32_t kv_head = 0;
  int32_t rows = 0;    // query-tile rows (item queries x gqa)
  int32_t tokens = 0;  // KV tokens of the item
};

// Bytes of K and V a plan's items read (tokens read * kv heads * head_dim * 2 * dtype bytes),
// and the unique bytes of the view (each visible run token once): the IO the kernel moves
// versus the IO lower bound.
int64_t plan_kv_bytes(const AttentionPlan& plan, int32_t num_kv_heads, int32_t head_dim,
                      int32_t dtype_bytes);
int64_t view_unique_kv_bytes(const AttentionView& view, int32_t num_kv_heads, int32_t head_dim,
                             int32_t dtype_bytes);

}  // namespace treeserve
