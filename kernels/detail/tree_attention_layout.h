// Layout of an AttentionPlan inside TreeAttentionWorkspace's device buffer: one int32 array,
// a header of counts and array offsets, then the plan's arrays packed back to back. Written by
// TreeAttentionWorkspace::upload (tree_attention_workspace.cpp), read by the kernels
// (tree_attention.cu). Ordinary launches pass the header by value (one dependent load less per
// block); fixed-grid launches read it from the device buffer, so a captured launch stays valid
// for every later upload.
//
// Arrays the kernels read in a form of their own instead of the plan's: kPartialSlot, the
// inverse of merge_partials (stage 1 stores partial p at slot partial_slot[p], so each
// query's partials are the contiguous slots [query_merge_begin[q], query_merge_begin[q + 1])
// and the merge needs no indirection), and kItemQueryRows, query_rows[item_queries[i]] (one
// dependent load less per query row in stage 1). item_queries and merge_partials themselves
// are not uploaded.
//
// The token table (a separate int32 buffer of the workspace, when the plan fits it): entry
// item_table_begin[i] + t = (physical page << 8) | slot of item i's token t, filled once per
// upload by a small kernel (all of a step's layers share it), so stage 1's prologue is one
// coalesced read instead of a segment scan and a page-table gather per token.
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
  // Offsets (in int32 words from the buffer start) of the arrays below.
  kItemSegmentBegin,
  kItemSegmentEnd,
  kItemQueryBegin,
  kItemQueryEnd,
  kItemNumTokens,
  kItemMaskOffset,
  kSegPageBegin,
  kSegFirstSlot,
  kSegNumTokens,
  kQueryMergeBegin,
  kQueryRows,
  kPageTable,
  kMaskWords,
  kPartialSlot,     // [num_partials] where stage 1 stores partial p: queries' partials contiguous
  kItemQueryRows,   // [num_partials] query_rows[item_queries[i]]: the batch row of each item query
  kItemTableBegin,  // [num_items] item i's first entry in the workspace's token table
  kTokenTable,      // 1: the token table is filled for this plan (else stage 1 resolves tokens)
  kHeaderWords = 32,  // header padded so arrays start 128-byte aligned
};

// Enqueues the kernel that fills the token table for the plan just copied to device_plan
// (header: its host copy, kTokenTable set): one block per item. tree_attention.cu.
Status enqueue_token_table_fill(const void* device_plan, const int32_t* header, void* table,
                                int32_t num_items, cudaStream_t stream);

}  // namespace treeserve::detail
