// Tree attention on the GPU: runs an AttentionPlan (kernels/attention_plan.h) over the paged KV
// pool (kernels/kv_layout.h), the same plan the CPU executor (kernels/attention_cpu.h) runs.
// This header is what callers use; which kernel runs a plan, the kAuto rules and the grid
// capacities are in kernels/detail/tree_attention_launch.h.
//
//  - TreeAttentionWorkspace owns fixed device buffers sized from TreeAttentionLimits, so once a
//    plan is uploaded (one cudaMemcpyAsync) the launch allocates nothing and can be captured in
//    a CUDA graph (with a TreeAttentionGrid, the captured grid also serves later plans;
//    tree_attention_graph_grid gives the grid to capture).
//  - launch_tree_attention runs stage 1 (one block per (work item, kv head): the item's query
//    tile, GQA heads packed as rows, against its KV chunk with tensor-core MMA, writing a
//    partial (O, LSE) per item query and q head) and stage 2 (per query and q head, the
//    log-sum-exp merge of its partials by the reduction map, written in the model dtype).
//  - launch_tree_attention_state runs the same stage 1 and writes each query's merged state
//    (float32 O and LSE) instead of output rows, for merging with states computed elsewhere
//    (other GPUs' shares of the KV: kernels/sequence_parallel_attention.h).
//  - tree_attention_plan_config gives the plan builder the kernel's tile shape and splitting
//    target; build_baseline_plan builds the prefix-unaware schedule of a sequence server
//    (per-query paged flash-decoding over the query's whole root-to-leaf path, split-KV) as an
//    ordinary AttentionPlan, so the same kernels (and the CPU executor) run it.
//
// Plain C++: no CUDA headers. Streams are passed as cudaStream_t (forward declared below).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/attention_plan.h"
#include "kernels/attention_view.h"

typedef struct CUstream_st* cudaStream_t;  // same declaration as CUDA's driver_types.h

namespace treeserve {

enum class TreeAttentionDtype : int32_t { kFloat16 = 0, kBFloat16 = 1 };

// Capacities of a workspace. Plans are checked against them at upload
// (RESOURCE_EXHAUSTED otherwise); apply_to() copies them into a plan config so the builder
// fails early instead.
struct TreeAttentionLimits {
  int32_t max_work_items = 4096;
  int32_t max_partials = 8192;
  int32_t max_segments = 16384;
  int32_t max_mask_words = 1 << 18;
  int32_t max_queries = 4096;
  int32_t max_view_pages = 1 << 20;  // pages of one view (plan.page_table)
  int32_t max_item_tokens = 2048;    // longest item; bounds the block's token table (smem)
  // Entries of the per-upload token table (4 bytes each). A plan whose items fit it at a fixed
  // stride (items * tree_attention_table_stride(max_item_tokens) entries) uses that layout,
  // whose reads need no plan entry first; else one whose tokens fit it uses it packed; else
  // (or with a pool of 2^23 pages or more) stage 1 resolves its tokens from the segments and
  // page table itself. 0: never use one.
  int32_t max_table_tokens = 1 << 21;
  int32_t max_num_q_heads = 32;  // partial (O, LSE) buffers are sized with these two
  int32_t max_head_dim = 128;
  // Not a capacity: a plan whose items are all decode-shaped (at most 16 query-tile rows: a
  // batch of plain sequences, trees of a few branches at GQA 4, the prefix-unaware baseline)
  // runs in a kernel of its own (stage 1's split loop with a 16-row query tile and no shared
  // token table: 3 blocks an SM instead of 2), where the upload fills a token table. Off:
  // stage 1 runs every plan.
  bool decode_kernel = true;
  // Not a capacity: whether launches of a plan that pairs run its paired (decode-shaped) items
  // in the tail kernel, beside stage 1's blocks, instead of in stage 1 after its other items:
  // never, where the plan's counts say it pays (kAuto, the default), or always (tests). The
  // rule and the eager launch's choice are in kernels/detail/tree_attention_launch.h
  // (tree_attention_tail_pays, tree_attention_runs_tail); a grid (TreeAttentionGrid::tail) is
  // told.
  enum class Tail : int32_t { kOff = 0, kAuto = 1, kAlways = 2 };
  Tail tail_kernel = Tail::kAuto;
  // Not a capacity: whether launches at head_dim 128 run the plan's leading pairs of wide items
  // over the same tokens in the wide kernel (one block an SM: two consumer warpgroups, one item
  // of the pair each, sharing every K/V tile of a 5-stage ring that a producer warp fills; the
  // plan's paired items run in three more warps of the same blocks as the tail kernel runs
  // them, and stage 1 runs the remaining items after it): never, where the plan's counts say
  // it pays (kAuto, whatever tail_kernel says), or wherever the plan has such pairs (kAlways).
  // Needs an sm_90a build (TreeAttentionWorkspace::wide_kernel_built()). The rules and the
  // eager launch's choice are in kernels/detail/tree_attention_launch.h
  // (tree_attention_auto_kernels, tree_attention_runs_wide); a grid (TreeAttentionGrid::wide)
  // is told.
  enum class Wide : int32_t { kOff = 0, kAuto = 1, kAlways = 2 };
  Wide wide_kernel = Wide::kAuto;

  void apply_to(AttentionPlanConfig* config) const;
};

// One stage 1 block's record of the workspace's block trace (diagnostics; defined in
// kernels/detail/tree_attention_launch.h).
struct TreeAttentionBlockTrace;

class TreeAttentionWorkspace {
 public:
  TreeAttentionWorkspace() = default;
  ~TreeAttentionWorkspace();
  TreeAttentionWorkspace(const TreeAttentionWorkspace&) = delete;
  TreeAttentionWorkspace& operator=(const TreeAttentionWorkspace&) = delete;

  // Allocates the device buffers (and a pinned staging buffer) on the current device.
  Status init(const TreeAttentionLimits& limits);
  void release();
  bool initialized() const { return device_plan_ != nullptr; }
  const TreeAttentionLimits& limits() const { return limits_; }
  // SMs of the device the workspace was initialised on (and its launches run on).
  int32_t num_sms() const { return num_sms_; }
  // That device's shared memory an SM holds, and what it reserves for every block (bytes).
  int32_t smem_per_sm() const { return smem_per_sm_; }
  int32_t smem_reserved_per_block() const { return smem_reserved_; }

  // Copies the plan into the device buffers with one cudaMemcpyAsync on stream. The plan may
  // be changed or destroyed once this returns; a later upload first waits for this copy.
  Status upload(const AttentionPlan& plan, cudaStream_t stream);

  // What the last upload put there (host copies, for launch checks and grid sizes).
  int32_t num_items() const { return num_items_; }
  int32_t num_queries() const { return num_queries_; }
  int32_t num_partials() const { return num_partials_; }
  int32_t gqa_group_size() const { return gqa_group_size_; }
  int32_t page_size() const { return page_size_; }
  int32_t max_item_tokens() const { return max_item_tokens_; }

  // Device buffers (opaque here; tree_attention.cu knows their layout) and a host copy of
  // the uploaded plan's header (int32[kPlanHeaderWords]).
  static constexpr int kPlanHeaderWords = 32;
  const void* device_plan() const { return device_plan_; }
  const int32_t* plan_header() const { return header_; }
  void* partial_o() const { return partial_o_; }            // float [max_partials][heads][head_dim]
  void* partial_lse() const { return partial_lse_; }        // float [max_partials][heads], base 2
  const void* token_table() const { return token_table_; }  // int32 [max_table_tokens]
  bool uses_token_table() const { return table_filled_; }   // for the last upload
  // The last upload's table is in the fixed-stride layout (item i's tokens at i * stride).
  bool uses_fixed_table_stride() const { return table_fixed_; }
  // The fixed-stride layout: its stride, and the items it holds (0: no table).
  int32_t table_stride() const { return table_stride_; }
  int32_t table_items() const { return table_items_; }
  // The last upload's plan runs in the decode kernel (see TreeAttentionLimits::decode_kernel).
  bool runs_decode_kernel() const { return decode_kernel_; }
  // The first item the last upload's plan pairs kv heads for (AttentionPlan::pair_heads ==
  // kTreeAttentionPairHeads; stage 1 runs the items from there on kTreeAttentionPairHeads kv
  // heads a block in eager launches and TreeAttentionGrid::paired ones), or -1 where it pairs
  // none.
  int32_t paired_items_begin() const { return paired_items_begin_; }
  // The last upload's leading pairs of items that the wide kernel can run
  // (tree_attention_wide_pairs, as its header holds them; 0 where the upload has no token table).
  int32_t wide_pairs() const;
  // Whether this build's wide kernel runs on the workspace's device (sm_90a code for it),
  // found at init.
  bool wide_kernel_built() const { return wide_built_; }
  // The wide kernel's two counters (int32: the next tail unit, the blocks done), zero between
  // its launches (its last block resets them).
  void* wide_counters() const { return wide_counters_; }

  // Diagnostics (bench_tree_attention --trace): once enabled, every stage 1 launch with this
  // workspace records one TreeAttentionBlockTrace per block that ran an item (thread 0 stamps
  // %globaltimer at the block's start and after its partials are written). Off by default: a
  // launch without it only tests a null pointer.
  Status enable_block_trace();
  // Copies out the records of the blocks that ran since the last call (in no particular order)
  // and clears the buffer. Synchronises the device.
  Status download_block_trace(std::vector<TreeAttentionBlockTrace>* out);
  void* block_trace() const { return block_trace_; }

 private:
  TreeAttentionLimits limits_;
  void* device_plan_ = nullptr;  // int32 header + arrays at offsets fixed by limits_
  void* host_staging_ = nullptr;
  void* staging_done_ = nullptr;  // cudaEvent_t
  void* partial_o_ = nullptr;
  void* partial_lse_ = nullptr;
  void* token_table_ = nullptr;
  void* wide_counters_ = nullptr;
  void* block_trace_ = nullptr;  // TreeAttentionBlockTrace [max_work_items * max_num_q_heads]
  int64_t plan_words_ = 0;
  int32_t header_[kPlanHeaderWords] = {};
  int32_t num_items_ = 0, num_queries_ = 0, num_partials_ = 0;
  int32_t gqa_group_size_ = 0, page_size_ = 0, max_item_tokens_ = 0;
  int32_t table_stride_ = 0, table_items_ = 0;
  int32_t num_sms_ = 0, smem_per_sm_ = 0, smem_reserved_ = 0;
  int32_t paired_items_begin_ = -1;
  bool wide_built_ = false;
  bool table_filled_ = false, table_fixed_ = false, decode_kernel_ = false;
};

// The grid of a launch that a CUDA graph captures and replays after later uploads: blocks for
// `items` work items and `queries` queries, at least the counts of every plan it runs with
// (blocks past a plan's counts exit at once; the kernels read the plan's counts from device
// memory). {0, 0}: exactly the uploaded plan's counts, read from the host copy.
struct TreeAttentionGrid {
  int32_t items = 0;
  int32_t queries = 0;
  // The launch runs the decode kernel instead of stage 1: only for uploads whose
  // runs_decode_kernel() is true, the one it is captured with (checked) and every one it is
  // replayed after (the engine keys its graphs on it). A stage 1 grid runs any plan.
  bool decode_kernel = false;
  // Stage 1 pairs kv heads for the items the uploaded plan pairs (paired_items_begin() >= 0):
  // each block first reads where they begin, one more dependent load, so a grid without it
  // runs them one kv head a block (the same results). Any plan runs in either grid; the engine
  // keys its graphs on it.
  bool paired = false;
  // The tail kernel runs the items from the header's paired_items_begin on, stage 1 the others
  // (its blocks for those exit), where the upload has a token table; with none, or a plan that
  // pairs none, stage 1 runs every item one kv head a block. Any plan runs in either grid; the
  // engine keys its graphs on tree_attention_runs_tail().
  bool tail = false;
  // With tail: stage 1's grid covers this many items (0: items) and the tail kernel's covers
  // items (with paired_items, below: the items before the paired ones). Stage 1's blocks for items
  // it does not run (the grid's padding past the plan's wide items, or everything past them where
  // wide_items is 0) come first in the grid and exit at once, so the wide items' blocks, and the
  // tail launch behind them, do not wait for their dispatch; a grid sized by
  // tree_attention_wide_bucket keeps them few. It must cover the items stage 1 runs:
  // paired_items_begin() (all items where that is -1 or the upload has no token table).
  int32_t wide_items = 0;
  // The wide kernel (TreeAttentionLimits::wide_kernel) runs the header's wide pairs and its
  // tail warps the paired items from the header's paired_items_begin on, then stage 1 the items
  // between (at most wide_rest of them: its grid; 0: no stage 1 launch), instead of stage 1 and
  // the tail kernel. Only at head_dim 128 in an sm_90a build, for uploads with a token table
  // whose items between fit wide_rest (checked); tail, wide_items and decode_kernel are then
  // unused. The engine keys its graphs on it (tree_attention_graph_grid).
  bool wide = false;
  int32_t wide_rest = 0;
  // With paired (not tail, wide or decode_kernel), where > 0: stage 1's grid holds wide_items
  // x kv heads blocks for the items before the paired ones and paired_items x (kv heads / 4)
  // for the paired ones (kv heads a multiple of kTreeAttentionPairHeads, paired_items of 4),
  // instead of items x kv heads, so a paired plan's launch has few padding blocks: they run
  // after the plan's blocks, each one dependent load, and end the launch (few-shot b=50 at
  // Llama-3-8B heads: 576 blocks for 260). It must cover the upload's stage 1 blocks (an upload
  // that pairs none runs items x kv heads). 0: items x kv heads.
  int32_t paired_items = 0;
  // Every field (nvcc does not take a defaulted comparison here).
  bool operator==(const TreeAttentionGrid& o) const {
    return items == o.items && queries == o.queries && decode_kernel == o.decode_kernel &&
           paired == o.paired && tail == o.tail && wide_items == o.wide_items && wide == o.wide &&
           wide_rest == o.wide_rest && paired_items == o.paired_items;
  }
};

// The grid to capture a CUDA graph of the workspace's last upload with (the engine keys its
// decode-step graphs on it; bench_tree_attention --grid / --graph launch it): items and
// queries bucketed, the decode kernel, head pairing, the tail kernel and the wide kernel as an
// eager launch of that upload at head_dim would run them, with the tail kernel stage 1's grid
// over the wide items only, with the wide kernel stage 1's over the items after its pairs,
// with head pairing in stage 1 its grid over the items before the paired ones and the paired
// ones, each count bucketed (wide_items, paired_items).
TreeAttentionGrid tree_attention_graph_grid(const TreeAttentionWorkspace& workspace,
                                            int32_t num_kv_heads, int32_t head_dim);

// An e4m3 KV pool's scales (kernels/kv_layout.h: one float32 a (page, kv head, slot) row, at
// the row's element offset / head_dim), both set or both null. Set: k_pool and v_pool hold
// e4m3 bytes, which stage 1 and the decode kernel dequantize to dtype as they copy each tile
// (value * its row's scale in float32, rounded to dtype: the results equal a dtype pool
// holding those values bit for bit); the tail and wide kernels do not run (a workspace for such
// a pool turns them off in its limits; a grid that asks for them is refused, and an eager launch
// runs stage 1 for every item whatever the limits say).
struct TreeAttentionKvScales {
  const float* k = nullptr;
  const float* v = nullptr;
};

// q:      [num_rows][num_q_heads][head_dim]   batch rows; only the plan's query rows are read
// k_pool, v_pool: one layer's K / V buffer    [num_pages][num_kv_heads][page_size][head_dim]
// out:    [num_rows][num_q_heads][head_dim]   only the plan's query rows are written
// All in dtype; head_dim 64 or 128; num_q_heads / num_kv_heads must equal the plan's
// gqa_group_size and page_size the plan's. sm_scale multiplies q.k (usually 1/sqrt(head_dim)).
// Enqueues two kernels on stream, stage 1 or the decode kernel and the merge (only the merge
// for a plan without items: its queries get zeros); returns INVALID_ARGUMENT for unsupported
// shapes, a grid smaller than the uploaded plan or one with decode_kernel for a plan that
// stage 1 must run, INTERNAL with CUDA's message if a launch fails.
Status launch_tree_attention(const void* q, const void* k_pool, const void* v_pool, void* out,
                             TreeAttentionDtype dtype, int32_t num_q_heads, int32_t num_kv_heads,
                             int32_t head_dim, int32_t page_size, float sm_scale,
                             const TreeAttentionWorkspace& workspace, cudaStream_t stream,
                             TreeAttentionGrid grid = {}, TreeAttentionKvScales fp8_kv = {});

// launch_tree_attention with stage 2 writing each plan query's merged attention state instead
// of output rows (same inputs and checks; q, k_pool, v_pool as above):
// state_o:   float [num_queries][num_q_heads][head_dim]  normalised O
// state_lse: float [num_queries][num_q_heads]            log2 of the softmax denominator
//                                                        (base 2, as the kernel's partials)
// indexed by the plan's query index (not the batch row). A query without partials (a
// sequence-parallel shard's) gets O = 0, LSE = -inf.
Status launch_tree_attention_state(const void* q, const void* k_pool, const void* v_pool,
                                   float* state_o, float* state_lse, TreeAttentionDtype dtype,
                                   int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                                   int32_t page_size, float sm_scale,
                                   const TreeAttentionWorkspace& workspace, cudaStream_t stream,
                                   TreeAttentionGrid grid = {}, TreeAttentionKvScales fp8_kv = {});

// Plan config for this kernel on a GPU with num_sms multiprocessors: the kernel's tile shape
// (64 query rows, 64-token KV tiles), and num_sms as the *item* target of long-context
// splitting: the grid is items x num_kv_heads and two blocks fit an SM, so
// 2 * num_sms / num_kv_heads items already fill the GPU.
AttentionPlanConfig tree_attention_plan_config(int32_t num_q_heads, int32_t num_kv_heads,
                                               int32_t head_dim, int32_t num_sms = 132);

// The prefix-unaware baseline's plan: per query one item per KV chunk of its root-to-leaf path
// (no sharing between queries, no masks), chunks of at most config.kv_chunk_tokens, shrunk
// (not below config.min_split_tokens) until there are config.num_sms items (split-KV).
// Uses config.gqa_group_size, kv_tile_tokens, kv_chunk_tokens, num_sms, min_split_tokens.
Status build_baseline_plan(const AttentionView& view, const AttentionPlanConfig& config,
                           AttentionPlan* out);

}  // namespace treeserve
