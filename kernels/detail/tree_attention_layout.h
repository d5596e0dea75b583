// Layout of an AttentionPlan inside TreeAttentionWorkspace's device buffer: one int32 array,
// a header of counts and array offsets, one fixed-size record per work item, then the plan's
// other arrays packed back to back. Written by TreeAttentionWorkspace::upload
// (tree_attention_workspace.cpp), read by the kernels (tree_attention.cu). Ordinary launches
// pass the header by value; fixed-grid launches (CUDA graphs) read it from the device buffer,
// so a captured launch stays valid for every later upload.
//
// Stage 1's prologue is one round trip to memory: everything a block needs before its first
// K/V tile lies at an address fixed by its block index — item i's record at
// kHeaderWords + i * kItemRecordWords (its counts and the batch rows of its queries) and, in
// the fixed-stride table mode, its token table entries at i * table stride — so the header
// (graph launches), the record, the query rows and the first table entries are all loaded at
// once, and the first tiles' copies go out one memory latency after the block starts.
//
// Arrays the kernels read in a form of their own instead of the plan's: kPartialSlot, the
// inverse of merge_partials (stage 1 stores partial p at slot partial_slot[p], so each
// query's partials are the contiguous slots [query_merge_begin[q], query_merge_begin[q + 1])
// and the merge needs no indirection), and the record's query rows, query_rows[item_queries[i]]
// (one dependent load less per query row in stage 1). item_queries and merge_partials
// themselves are not uploaded.
//
// The token table (a separate int32 buffer of the workspace): entry t of item i =
// (physical page << 8) | slot of the item's token t, filled once per upload by a small kernel
// (all of a step's layers share it), so stage 1's prologue is one coalesced read instead of a
// segment scan and a page-table gather per token. Modes (header word kTokenTable): fixed
// stride (item i's entries from i * stride on; stride = tree_attention_table_stride of the
// workspace's max_item_tokens), packed (from the record's table_begin on: when the plan has
// more items than the fixed layout holds but its tokens fit), or none (stage 1 resolves its
// tokens from the segments and the page table).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/status.h"

namespace treeserve::detail {

enum PlanHeader : int32_t {
  kNumItems = 0,
  kNumQueries,
  kNumPartials,
  kGqaGroupSize,
  kPageSize,
  kHeadsFirst,  // 1: block b runs (item b / kv_heads, kv head b % kv_heads); 0: head-major
  kTokenTable,  // TokenTableMode of this upload
  // Offsets (in int32 words from the buffer start) of the arrays below.
  kSegPageBegin,
  kSegFirstSlot,
  kSegNumTokens,
  kQueryMergeBegin,
  kQueryRows,
  kPageTable,
  kMaskWords,
  kPartialSlot,       // [num_partials] where stage 1 stores partial p: queries' partials contiguous
  kPairedBegin,       // head pairing: the first paired item (AttentionPlan::paired_items_begin); -1
  kWidePairs,         // the wide kernel's leading item pairs (tree_attention_wide_pairs; 0: none)
  kHeaderWords = 32,  // header padded so the records start 128-byte aligned
};

enum TokenTableMode : int32_t { kTableNone = 0, kTablePacked = 1, kTableFixedStride = 2 };

// Item i's record: 8 words of counts, then the batch rows of its (at most 64) queries.
enum ItemRecord : int32_t {
  kRecQueryBegin = 0,  // first of its queries in the plan's item_queries (its first partial)
  kRecQueryEnd,
  kRecNumTokens,
  kRecMaskOffset,  // -1: no mask words
  kRecTableBegin,  // first token table entry in the packed mode
  kRecSegBegin,
  kRecSegEnd,
  // Tokens from the item's start that every one of its queries sees (item_visible_tokens,
  // kernels/attention_plan.h): stage 1 skips the per-score mask test on whole tiles inside it.
  kRecVisibleTokens,
  kRecQueryRows,  // [64] query_rows[item_queries[query_begin + j]]
  kItemRecordWords = kRecQueryRows + 64,
};
static_assert(kItemRecordWords % 8 == 0, "records stay 32-byte aligned");

// Enqueues the kernel that fills the token table for the plan just copied to device_plan
// (header: its host copy, kTokenTable set, table_stride: the fixed mode's): one block per
// item. tree_attention.cu.
// Whether this build's wide kernel has sm_90a code for the current device (its body is
// empty in builds for other targets): checked from its binary version and a probe launch.
bool wide_kernel_built();

Status enqueue_token_table_fill(const void* device_plan, const int32_t* header, void* table,
                                int32_t table_stride, int32_t num_items, cudaStream_t stream);

}  // namespace treeserve::detail
