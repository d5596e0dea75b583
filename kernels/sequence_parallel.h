// Sequence parallelism for tree attention, the CPU part: splitting one step's AttentionPlan
// over `world` GPUs along the KV (sequence) axis, as in Tree Attention
// (papers/tree-attention-multigpu.txt). Each GPU runs only its shard's work items, over only
// the pages its shard reads, and produces a partial attention state (O, LSE) per query; the
// states are merged across GPUs by log-sum-exp with all-reduces
// (kernels/sequence_parallel_attention.h), which is exact because the merge is associative.
//
// Why split the plan rather than the view: the plan already cuts long runs into even KV chunks
// and groups each chunk with the queries that share it, so dealing out whole items keeps every
// shared chunk read once (on one GPU) and needs no second planning pass per GPU.
//
// Plain C++ (no CUDA): the split and its invariants are tested on the CPU with the CPU
// executor (tests/kernels/sequence_parallel_test.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/attention_plan.h"

namespace treeserve {

// Splits plan over world ranks; (*shards)[r] is rank r's plan (the vector is resized to world,
// and its plans' vectors are reused). How:
//  - Items are grouped by the KV position they start at (their first segment's node, then
//    token offset): the items of one group (the query tiles of one chunk) stay together, so a
//    shared chunk is read on one rank only.
//  - Long runs (a node the plan cut into chunks, so it starts several groups) are cut into world
//    contiguous ranges, in KV order: each rank reads one contiguous token range of every long
//    run, the ranks in order, and a range ends at the group boundary nearest (r + 1) / world of
//    the long runs' cost (sequence_parallel_cost: by default sequence_parallel_item_cost).
//  - The short runs' groups (decode branches, token trees: a node starting one group) are then
//    dealt out costliest first, each to the rank with the least cost so far. A few-shot tree's
//    branches, which all start after the prompt, are spread over the ranks (in KV order alone
//    they would all land on the last rank and leave the others idle at the end).
//    A rank's cost exceeds total / world by at most the costliest group.
//  - Each shard is a valid plan on its own (validate_attention_plan): its own segments, mask
//    words and partial slots, renumbered; its items in the plan's launch order, so a plan that
//    pairs heads (pair_heads) pairs each shard's items from the first one it paired. Its reduction
//    map covers ALL queries of the view, in the plan's merge order; a query none of the rank's
//    items serves has an empty merge range. page_table and query_rows are the plan's.
// Ranks may get no items when the plan has fewer start positions than ranks.
//
// Build the plan with the item target of all GPUs together (AttentionPlanConfig::num_sms
// multiplied by world), so that long runs are cut finely enough for every shard to fill its GPU.
// plan must not be one of *shards. Returns INVALID_ARGUMENT for world < 1, a null shards, or a
// plan that fails validate_attention_plan.
// How the split weighs an item.
enum class SequenceParallelCost : uint8_t {
  kTokensRows,  // sequence_parallel_item_cost (the default)
  kBlocks,      // sequence_parallel_block_cost (bench_sequence_parallel --split-cost blocks)
};

// split_plan_for_sequence_parallel's pair_heads: where > 1 and the plan does not pair heads
// (pair_heads <= 1), each shard with decode-shaped items pairs them at pair_heads kv heads a block
// (pair_decode_items, longest first). Pass the config's AttentionPlanConfig::pair_heads
// (tree_attention_plan_config sets it where the kernel pairs). The plan is built for all the GPUs'
// SMs, whose simulation may leave the branches unpaired because they would spread over every GPU's
// slots; a rank has its own GPU's (a long prompt under many branches: each rank's prompt pairs
// and paired branches then run in the wide kernel). Plans that pair already are unchanged.
Status split_plan_for_sequence_parallel(
    const AttentionPlan& plan, int32_t world, std::vector<AttentionPlan>* shards,
    SequenceParallelCost cost = SequenceParallelCost::kTokensRows, int32_t pair_heads = 0);

// The split's estimate of an item's time: KV tokens x (query rows + a tile of rows), the plan
// builder's launch-order cost (AttentionPlanConfig::item_order): time grows with tokens x rows,
// and a decode item of a few rows still pays about a tile's worth of per-token work (stage 1
// is bound by each block's per-tile chain more than by DRAM).
int64_t sequence_parallel_item_cost(const AttentionPlan& plan, int32_t item);

// Stage 1's block model, as the plan builder's span simulation costs an item (in quarter K/V
// tiles of kSequenceParallelKvTile tokens, times the plan's pair_heads): a block's fixed part
// (kBlockFixedQuarterTiles) plus 4 a tile of the item's tokens, whatever its rows; a paired item
// (from paired_items_begin, where pair_heads > 1) shares its block with pair_heads - 1 others, its
// tiles pair_heads times shorter. The default cost weighs a 200-token branch item 1/19 of a
// 2048-token prompt tile's item, the block model 1/5, which is closer to the blocks' times;
// but as the split's cost it overshoots on a long prompt under many branches (the rank with
// the prompt gets more than one wave of 2048-token blocks). So not the default: neither cost
// sees waves.
constexpr int32_t kSequenceParallelKvTile = 64;
int64_t sequence_parallel_block_cost(const AttentionPlan& plan, int32_t item);

// sequence_parallel_item_cost or sequence_parallel_block_cost, as cost says.
int64_t sequence_parallel_cost(const AttentionPlan& plan, int32_t item, SequenceParallelCost cost);

// The physical page ids (plan.page_table values) holding at least one token some item of plan
// reads, sorted and unique: the pages a GPU must hold to run this plan (a shard's, after the
// split). plan must pass validate_attention_plan.
void plan_read_pages(const AttentionPlan& plan, std::vector<int32_t>* pages);

}  // namespace treeserve
