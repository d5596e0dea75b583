// Layout of an AttentionPlan inside TreeAttentionWorkspace's device buffer: one int32 array,
// a header of counts and array offsets, then the plan's arrays packed back to back. Written by
// TreeAttentionWorkspace::upload (tree_attention_workspace.cpp), read by the kernels
// (tree_attention.cu). Ordinary launches pass the header by value (one dependent load less per
// block); fixed-grid launches read it from the device buffer, so a captured launch stays valid
// for every later upload.
//
// Besides the plan's own arrays the upload adds kPartialSlot, the inverse of merge_partials:
// stage 1 stores partial p at slot partial_slot[p], so each query's partials are the
// contiguous slots [query_merge_begin[q], query_merge_begin[q + 1]) and the merge needs no
// indirection.
#pragma once

#include <cstdint>

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
  kItemQueries,
  kQueryMergeBegin,
  kMergePartials,
  kQueryRows,
  kPageTable,
  kMaskWords,
  kPartialSlot,       // [num_partials] where stage 1 stores partial p: queries' partials contiguous
  kHeaderWords = 32,  // header padded so arrays start 128-byte aligned
};

}  // namespace treeserve::detail
