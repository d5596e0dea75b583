// AttentionPlan: the work list of one tree-attention launch, built on the CPU from an
// AttentionView (kernels/attention_view.h) and executed either by the CPU executor
// (kernels/attention_cpu.h) or by the CUDA kernel. Both executors read only this struct.
//
// A work item is (KV chunk, query tile): up to `kv_chunk_tokens` KV tokens, given as a few
// page-table segments, against up to `query_tile_rows / gqa_group_size` queries (the kernel
// packs the GQA group's query heads as extra rows of the tile, FastTree-style). Every item
// writes one partial (O, LSE) per (item query, q head); the reduction map then lists, per
// query, the partials to merge with the log-sum-exp merge (FlashInfer merge_state).
//
// How items are chosen (plan_builder.cpp): FastTree's greedy edge assignment over the run
// tree decides which runs are read once for all their queries and which are folded into
// their children's items; small subtrees (speculative token trees, short branches) are packed
// into one masked item, DeFT-Flatten style; long contexts are split into even chunks, more
// finely when there are too few items to fill the SMs. The result is deterministic.
//
// Layout: structure of arrays of int32 (plus uint32 mask words), CSR-style offsets, no
// pointers, so the whole plan is a handful of memcpys into a fixed device workspace and the
// launch can be captured in a CUDA graph (bound the sizes with the max_* config fields).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/attention_view.h"

namespace treeserve {

// Items of at most this many query-tile rows (queries x gqa, one 16-row MMA slab) are
// decode-shaped: the GPU runs a plan of only such items in its decode kernel, and head
// pairing (AttentionPlanConfig::pair_heads) pairs them.
inline constexpr int32_t kDecodeShapedRows = 16;

// Stage 1's block model, as the plan builder's span simulation (and the sequence-parallel
// split's block cost) count a block: a fixed part of this many quarter K/V tiles plus 4 a tile.
// The fixed part, 2.75 tiles, is a fit to a traced block's time before and after its tiles
// against its time a 64-token tile, for wide and decode-shaped blocks alike (see
// docs/tree-attention.md).
inline constexpr int64_t kBlockFixedQuarterTiles = 11;

struct AttentionPlanConfig {
  // Kernel tile shape.
  int32_t query_tile_rows = 64;    // rows of one query tile = queries * gqa_group_size
  int32_t kv_tile_tokens = 64;     // KV tokens per kernel iteration; chunks are multiples
  int32_t kv_chunk_tokens = 1024;  // most KV tokens one work item reads (DeFT-Flatten chunk)
  int32_t gqa_group_size = 1;      // num_q_heads / num_kv_heads
  int32_t head_dim = 128;          // only used by the cost model

  // Machine: long-context splitting makes at least num_sms * min_items_per_sm items when it
  // can, never cutting a chunk below min_split_tokens.
  int32_t num_sms = 132;
  int32_t min_items_per_sm = 1;
  int32_t min_split_tokens = 128;
  // Chunk growth, where the plan has at least num_sms * min_items_per_sm items of
  // kv_chunk_tokens: chunks of 1x, 2x, 3x or 4x kv_chunk_tokens (at most max_chunk_tokens),
  // whichever gives the shortest simulated span: the items, each costing a block's fixed part
  // (2.75 KV tiles) plus its KV tiles, list-scheduled longest first on num_sms slots (ties:
  // the smaller chunk). Fewer, longer items cost fewer block prologues, partials and merges,
  // and fill the slots' waves differently; the simulation keeps the chunk where longer items
  // would lengthen the critical path. 0: no growth (the struct's default);
  // tree_attention_plan_config sets 4 x its 512-token chunk. TreeAttentionLimits::apply_to
  // caps it at the workspace's max_item_tokens. Long shared prompts under many branches run
  // fastest with longer chunks (docs/tree-attention.md).
  int32_t max_chunk_tokens = 0;

  // Head pairing (a kernel's option: kTreeAttentionPairHeads, detail/tree_attention_launch.h):
  // where > 1, the GPU kernel may run each decode-shaped item (a query tile of at most 16 rows) for
  // pair_heads kv heads in one block, each head's tiles pair_heads times shorter, which shares
  // the block's fixed part (record, table, Q, first tile's latency, epilogue) among them. Chunk
  // growth then also simulates the chunk it picks with pairing (a paired item costs the fixed
  // part plus ceil(tokens * pair_heads / kv_tile_tokens) tiles on 1 / pair_heads of an item
  // slot) and pairs where that span is at least 1 / pair_margin shorter, then tries 2 smaller
  // chunks paired; plans outside chunk growth stay unpaired. Only with the kKvMajor item order
  // (the paired items go last). 0 or 1: never (the struct's default); tree_attention_plan_config
  // sets it at GQA >= 4, where the decode-shaped items' fixed part is a large share of their
  // time.
  int32_t pair_heads = 0;
  // Pairing (whole, or with the decode-shaped units cut shorter) is kept where its simulated
  // span is at least 1 / pair_margin shorter than unpaired's (the simulation is good to about
  // 5%). 32 lets the long-prompt few-shot trees pair, whose spans shorten by a few percent,
  // while the plans of engine decode and verify steps stay the same. Must be >= 2.
  int32_t pair_margin = 32;
  // Where > 0 and the plan pairs heads, the decode-shaped units are cut into chunks of this
  // many tokens (rounded up to whole KV tiles, split evenly) instead of the simulation's pick.
  // 0: the builder's choice (the default). For comparisons only (bench_tree_attention
  // --decode-chunk).
  int32_t decode_chunk_tokens = 0;
  // Paired plans list their paired items longest first (pair_decode_items' longest_first;
  // false: in kv-major order like the rest), so the kernels that hand them out in order (the
  // wide kernel's tail units, stage 1's paired blocks) end on the short ones and the last
  // units do not leave SMs idle (bench_tree_attention --paired-kv-order runs false).
  bool paired_longest_first = true;

  // Subtrees with at most pack_max_tokens KV tokens and one query tile of queries are read
  // by a single masked item (and consecutive such siblings share one).
  int32_t pack_max_tokens = 128;

  // FastTree cost model (section 4.2): alpha * query-tile padding + beta * KV-tile padding
  // (both in wasted row*token*head_dim work) against gamma * extra partial (O, LSE) elements.
  double cost_alpha = 1.0;
  double cost_beta = 1.0;
  double cost_gamma = 256.0;

  // A chunk's queries spread evenly over its query tiles (50 queries at 16 a tile: 13, 13,
  // 12, 12) instead of full tiles and a remainder (16, 16, 16, 2). Same tile count, but no
  // narrow remainder item: at GQA 4 a remainder of 2 queries is 8 rows, which the kernel runs
  // on its slow one-slab path over the whole chunk, as long as a wide block.
  // tree_attention_plan_config sets it (bench_tree_attention --no-balance-tiles turns it off).
  bool balance_query_tiles = false;
  bool greedy_grouping = true;     // false: every run is its own group (no folding)
  bool pack_subtrees = true;       // false: no masked packing of small subtrees
  bool long_context_split = true;  // false: chunks are always kv_chunk_tokens
  // Launch order of the items. Cost = tokens x (query_tile_rows + rows), an estimate of an
  // item's time. kKvMajor (default): by the KV position an item starts at (node, then token),
  // stable, so the query tiles that read the same chunk of a shared run are launched side by
  // side: their blocks run together and all but the first read of each KV tile hit L2 (as
  // built, a group's chunks come first, so a tile's re-reads would come a wave later, from
  // DRAM).
  // kPlan: as built (groups in tree order, chunks in order). kLongestFirst: by
  // cost, longest first (stable), so the long items do not start last and leave SMs idle at
  // the tail. kInterleaved: by cost, alternating from both ends (longest, shortest, second
  // longest, ...), so the SMs' resident blocks mix compute-heavy items (many query rows) with
  // memory-heavy ones (decode-shaped) instead of all of one kind at a time. kKvMixed: the
  // wide items (more than narrow_rows rows) and the narrow ones (decode branches) each in
  // kKvMajor order, merged in proportion to their counts, so the tensor-bound wide blocks
  // and the latency-bound narrow ones share the SMs throughout instead of running in two
  // phases (a shared run's query tiles stay within a few dozen blocks of each other).
  // kKvMajor is the default: kKvMixed helps the longest prompts but slows the short-prompt and
  // tree-of-thought trees (bench_tree_attention --order mixed; docs/tree-attention.md).
  enum class ItemOrder : uint8_t { kPlan, kLongestFirst, kInterleaved, kKvMajor, kKvMixed };
  ItemOrder item_order = ItemOrder::kKvMajor;
  int32_t narrow_rows = 16;  // kKvMixed: items of at most this many rows are narrow

  // Optional bounds of a preallocated workspace (0 = unbounded): exceeding one returns
  // RESOURCE_EXHAUSTED. num_pages > 0 also checks every page id against the pool.
  int32_t max_work_items = 0;
  int32_t max_partials = 0;
  int32_t max_segments = 0;
  int32_t max_mask_words = 0;
  int64_t num_pages = 0;
};

// Scratch the builder reuses between steps (so steady-state builds do not allocate).
struct AttentionPlanScratch {
  std::vector<int32_t> subtree_end;     // [num_nodes] one past the last node of the subtree
  std::vector<int32_t> first_query;     // [num_nodes + 1] first query whose leaf >= node
  std::vector<int32_t> subtree_tokens;  // [num_nodes] KV tokens of runs some query reads
  // Units of the virtual tree: a run, or a pack of consecutive small sibling subtrees.
  std::vector<int32_t> unit_first_node, unit_end_node, unit_parent, unit_len;
  std::vector<int32_t> unit_children_begin, unit_children_end, unit_remaining;
  std::vector<uint8_t> unit_is_pack, unit_folded;
  std::vector<int32_t> chain_runs, group_queries, chunk_queries, chunk_visible;
  std::vector<int32_t> query_cursor, stack;
  std::vector<int32_t> item_order, permuted;  // AttentionPlanConfig::item_order reordering
  std::vector<int64_t> item_cost;
  std::vector<int64_t> span_item_cost, span_slot_load;  // chunk growth's simulated span
  std::vector<int64_t> span_paired_cost;                // ... its paired items (pair_heads)
  std::vector<int64_t> span_unit_runs;    // ... its units: (length, queries, count) triples
  std::vector<int64_t> chunk_row_offset;  // a chunk query's mask row (-1: its item unmasked)
};

struct AttentionPlan {
  int32_t gqa_group_size = 1;
  int32_t queries_per_tile = 1;  // query_tile_rows / gqa_group_size
  int32_t page_size = 16;
  int32_t max_item_tokens = 0;  // longest item, for sizing per-block score buffers
  // Launch-order hint for the GPU executor. true: all kv heads of item i start before item
  // i + 1, so the items listed first (the large shared groups) start first on every head,
  // not last on the highest heads. false: each kv head's items in plan order, so runs of
  // items that read the same KV (the baseline's per-query items of one chunk) share L2 in time.
  bool heads_first = true;
  // Head pairing (AttentionPlanConfig::pair_heads): pair_heads > 1 when the items from
  // paired_items_begin on (all decode-shaped: at most 16 query-tile rows) run pair_heads kv
  // heads a block; 0 otherwise. Executors that do not pair ignore it (same results).
  int32_t pair_heads = 0;
  int32_t paired_items_begin = 0;

  // Work items, [num_items] each. Item i reads KV segments [segment_begin, segment_end) in
  // order (its tokens are their concatenation, item_num_tokens in all) for the queries
  // item_queries[query_begin .. query_end). Mask: if mask_offset >= 0, the item's bit mask is
  //   mask_words[mask_offset + local_query * ceil(item_num_tokens / 32) + token / 32]
  // bit (token % 32) = 1 where the query sees the token; mask_offset = -1: all visible.
  std::vector<int32_t> item_segment_begin, item_segment_end;
  std::vector<int32_t> item_query_begin, item_query_end;
  std::vector<int32_t> item_num_tokens;
  std::vector<int32_t> item_mask_offset;

  // Segments, [num_segments] each: seg_num_tokens consecutive tokens of one run. Token j of
  // the segment is at physical page page_table[seg_page_begin + (seg_first_slot + j) /
  // page_size], slot (seg_first_slot + j) % page_size. seg_node / seg_token_begin name the
  // run and the offset inside it (positions, diagnostics, tests).
  std::vector<int32_t> seg_page_begin, seg_first_slot, seg_num_tokens;
  std::vector<int32_t> seg_node, seg_token_begin;

  // Partials: item_queries[p] is the view query index of partial slot p, so item i writes
  // partials [item_query_begin[i], item_query_end[i]); partial workspace is
  //   O [num_partials][num_q_heads][head_dim], LSE [num_partials][num_q_heads].
  std::vector<int32_t> item_queries;
  std::vector<uint32_t> mask_words;

  // Reduction map (CSR over queries, [num_queries + 1]): query q merges the partial slots
  // merge_partials[query_merge_begin[q] .. query_merge_begin[q + 1]) and writes
  // out[query_rows[q]]. Queries with one partial can be written directly.
  std::vector<int32_t> query_merge_begin;
  std::vector<int32_t> merge_partials;
  std::vector<int32_t> query_rows;  // [num_queries] batch row of each query

  std::vector<int32_t> page_table;  // copy of AttentionView::pages, [num_view_pages]

  // Statistics of the last build (not needed by executors).
  int32_t num_groups = 0;          // context-queries groups after greedy assignment
  int32_t num_folded_edges = 0;    // edges assigned 1 (parent read inside child's items)
  int32_t num_packs = 0;           // packed (masked) subtree units
  int32_t split_chunk_tokens = 0;  // chunk size actually used
  // Chunk the decode-shaped units (one query tile of at most 16 rows) were cut into: the same
  // as split_chunk_tokens, or shorter where chunk growth's simulation pairs them cut shorter.
  int32_t decode_chunk_tokens = 0;

  AttentionPlanScratch scratch;

  int32_t num_items() const { return int32_t(item_num_tokens.size()); }
  int32_t num_segments() const { return int32_t(seg_num_tokens.size()); }
  int32_t num_partials() const { return int32_t(item_queries.size()); }
  int32_t num_queries() const { return int32_t(query_rows.size()); }
  // Query-tile rows of item i: its queries x gqa_group_size.
  int64_t item_rows(int32_t i) const {
    return int64_t(item_query_end[size_t(i)] - item_query_begin[size_t(i)]) * gqa_group_size;
  }
  // Items run pair_heads kv heads a block (head pairing): those from paired_items_begin.
  int32_t num_paired_items() const { return pair_heads > 1 ? num_items() - paired_items_begin : 0; }
  static int32_t mask_words_per_row(int32_t num_tokens) { return (num_tokens + 31) / 32; }
};

// Checks the view against the AttentionView contract (preorder, query ranges, pages, ...).
// Returns INVALID_ARGUMENT naming the first offending field.
Status validate_attention_view(const AttentionView& view, int64_t num_pages = 0);
// Same, reusing scratch (fills scratch->subtree_end, which the builder then uses).
Status validate_attention_view(const AttentionView& view, int64_t num_pages,
                               AttentionPlanScratch* scratch);

// Builds the plan for one step. Reuses out's vectors: no allocations once they have grown.
Status build_attention_plan(const AttentionView& view, const AttentionPlanConfig& config,
                            AttentionPlan* out);

// Head pairing (AttentionPlanConfig::pair_heads): moves the plan's decode-shaped items (at
// most 16 query-tile rows) after the others, each kind in its order, and marks them paired
// (pair_heads, paired_items_begin = the first of them). Partial slots and the reduction map
// stay valid: they do not depend on the item order. The builder calls it where chunk growth
// pairs; it pairs any plan (tests). longest_first: the paired items by decreasing token count
// (stable: kv-major among equals) instead of in their order.
void pair_decode_items(AttentionPlan* plan, int32_t pair_heads, bool longest_first = false);

// Item `item`'s leading tokens that every one of its queries sees: item_num_tokens without a
// mask, else the fewest leading set bits over its queries' mask rows; 0 where those rows lie
// outside mask_words (a plan validate_attention_plan refuses). The GPU kernel skips the
// per-score mask test on the whole KV tiles inside it (TreeAttentionWorkspace::upload puts it
// in the item's record), which matters for masked items whose long prompt chunks are packed
// with a few query-tree tokens (speculative token trees).
int32_t item_visible_tokens(const AttentionPlan& plan, int32_t item);

// List scheduling of n items of cost c, each to a least-loaded slot, on slot loads kept in
// ascending order (they stay so): chunk growth's simulated span (AttentionPlanConfig::
// max_chunk_tokens) places its items so, cost by cost, longest first. Nothing happens for
// n <= 0 or c <= 0.
void place_equal_items(std::vector<int64_t>* loads, int64_t n, int64_t c);

// Checks a plan's internal consistency, as the executors rely on it: array sizes, every item's
// segments, partial range and mask words in bounds, segments' pages inside page_table (and page
// ids inside a pool of num_pages when > 0), each partial owned by exactly one item, and the
// reduction map a permutation of the partials that sends each to its own query. A query may
// have no partials (a sequence-parallel shard's, kernels/sequence_parallel.h); coverage of the
// view is not checked here (tests expand plans for that). Returns INVALID_ARGUMENT naming the
// first offending field.
Status validate_attention_plan(const AttentionPlan& plan, int64_t num_pages = 0);

// Head pairing's part of it (where pair_heads > 1): paired_items_begin inside [0, num_items]
// and every item from there on decode-shaped, as a pairing kernel runs them one 16-row slab a
// kv head. TreeAttentionWorkspace::upload checks the plans it pairs with it too.
Status validate_paired_items(const AttentionPlan& plan);

}  // namespace treeserve
