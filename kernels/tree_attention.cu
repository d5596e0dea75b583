// Tree-attention kernels (tree_attention.h): stage 1 runs the plan's work items, stage 2 merges
// the partials per query. Both read the plan from TreeAttentionWorkspace's device buffer
// (layout: detail/tree_attention_layout.h).
//
// Stage 1, one block of 4 warps per (work item, kv head), FlashAttention-2 style (the grid is
// one-dimensional, ordered as the plan's heads_first hint says):
//  - rows of the 64-row query tile are (item query, q head of the kv head's GQA group),
//    row = local_query * gqa + g (FastTree: GQA heads packed as rows, so one KV tile feeds
//    every head of the group), in 16-row slabs;
//  - the item's tokens (the concatenation of its page-table segments) are first resolved to
//    pool offsets in shared memory, then kKvTile-token K and V tiles stream in with cp.async,
//    kStages deep, into XOR-swizzled shared memory (ldmatrix without bank conflicts);
//  - S = Q K^T and O += P V on tensor cores (fp16/bf16 in, fp32 accumulate), online softmax
//    in base 2, mask words applied per (row, token) where the item has them;
//  - items of more than 16 rows run whole 64-row tiles, one 16-row slab per warp: with wgmma
//    on sm_90a builds (the 4 warps are one warpgroup; Q and K are read from shared memory by
//    the tensor cores, m64n64k16, and P V takes P from registers, m64nDk16; software-pipelined
//    so that the next tile's S and this tile's P V are in flight together and the next
//    softmax runs under P V, wgmma_main_loop), with mma.sync m16n8k16 and ldmatrix
//    elsewhere. Items of one slab (decode items: one query = gqa rows)
//    split each tile's tokens over the 4 warps (mma.sync), which merge their states at the
//    end. Both read the same 128-byte-swizzled tiles (swz);
//  - the partial O (fp32, normalised) and its LSE (base 2) go to the workspace, at the slot
//    the reduction map gives them (each query's partials contiguous).
//  - head pairing (AttentionPlan::pair_heads, eager launches): the decode-shaped items the plan
//    lists last (from paired_items_begin) run kTreeAttentionPairHeads (4) kv heads a block,
//    one warp a head on 16-token tiles of each, in the grid's last blocks, so four heads share
//    a block's fixed part (record, table, Q, first tile's latency, epilogue).
// The decode kernel (TreeAttentionLimits::decode_kernel, on by default) runs a plan whose
// items are all decode-shaped (at most 16 rows) instead of stage 1: the same split loop in a
// smaller kernel (3 blocks an SM), writing the partials the same way.
// Stage 2, one warp per (query, q head): log-sum-exp merge of the query's contiguous partials
// in reduction-map order, written to out in the model dtype (or, launch_tree_attention_state,
// as the query's float32 (O, LSE) state). It is launched as a programmatic dependent grid: it
// reads its plan entries while stage 1 drains, then waits for it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/detail/pdl_launch.cuh"
#include "kernels/detail/tree_attention_launch.h"
#include "kernels/detail/tree_attention_layout.h"
#include "kernels/detail/tree_attention_stage1.cuh"
#include "kernels/tree_attention.h"

namespace treeserve {
namespace {

using namespace detail;      // NOLINT: header field names
using namespace detail::ta;  // NOLINT: stage 1 device code and PTX wrappers

// kFp8Kv: the pool holds e4m3 with row scales (Stage1Params::k_scale), dequantized to T as the
// tiles are copied (copy_kv_row).
template <int D, typename T, bool kFp8Kv = false>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) tree_attention_stage1(Stage1Params p) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  const int32_t* plan = p.plan;
  const int tid = threadIdx.x;
  const uint64_t start_ns = p.trace != nullptr && tid == 0 ? global_ns() : 0;
  int item = 0, pair_begin = -1;
  ItemTile it;
  block_item(p, &item, &it.kv_head, &pair_begin);
  if (item >= p.max_items) return;  // a bucketed grid past the workspace's records
  it.gqa = p.gqa;

  // The prologue: the header (graph launches), the item's record and the batch row of this
  // thread's query-tile row lie at addresses known from the block index, so their loads go
  // out together (detail/tree_attention_layout.h), and before the wait for the previous
  // kernel: they come from the plan upload, a copy. Loads for a block past the plan's items
  // read stale but in-bounds words, and the block exits before using them.
  static_assert(kThreads == 2 * kTileRows, "two threads per query-tile row");
  static_assert(kThreads <= 128, "the table stride is a multiple of 128 tokens");
  const int32_t* rec = plan + kHeaderWords + int64_t(item) * kItemRecordWords;
  const int4 rec_a = *reinterpret_cast<const int4*>(rec);
  const int4 rec_b = *reinterpret_cast<const int4*>(rec + 4);
  // This thread's query-tile row is the item's row q_item_row of kv head kv_head + q_head_off:
  // q_row itself, or where the block runs a paired item (kPairHeads kv heads, one 16-row slab
  // each), row q_row % 16 of head kv_head + q_row / 16.
  const bool paired = pair_begin >= 0 && item >= pair_begin;
  const int q_row = tid >> 1;
  const int q_item_row = paired ? q_row & 15 : q_row;
  const int q_head_off = paired ? q_row >> 4 : 0;
  const int32_t q_batch_row = rec[kRecQueryRows + q_item_row / it.gqa];
  const PlanHeaderArg h = load_header(p.header, plan, p.header_on_device);
  if (item >= h.w[kNumItems]) return;
  read_item_tile(it, rec_a, rec_b, plan, h);
  if (paired) it.num_tiles = (it.num_tokens + kKvTile / kPairHeads - 1) / (kKvTile / kPairHeads);
  const uint32_t* mask_words = reinterpret_cast<const uint32_t*>(plan + h.w[kMaskWords]);
  const int table_mode = h.w[kTokenTable];
  const int page_size = p.page_size;

  // Tiles start on 1024-byte boundaries (the 128-byte swizzle atoms of swz()); the launch
  // adds 1 KB of slack for the round-up.
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* s_q = reinterpret_cast<T*>(smem);
  T* s_k = s_q + kTileRows * D;  // [kStages][kKvTile][D]
  T* s_v = s_k + kStages * kKvTile * D;
  // An e4m3 pool's row scales (kFp8ScaleBytes) between the tiles and the segment scratch.
  float* s_ks = reinterpret_cast<float*>(s_v + kStages * kKvTile * D);
  float* s_vs = s_ks + kStages * kKvTile;
  int32_t* seg_start = reinterpret_cast<int32_t*>(kFp8Kv ? s_vs + kStages * kKvTile : s_ks);
  int32_t* seg_slot = seg_start + kSegBatch;
  int32_t* seg_page = seg_slot + kSegBatch;
  int32_t* warp_sums = seg_page + kSegBatch;
  int32_t* tok = warp_sums + 2 * kWarps;  // [max_item_tokens]

  // Everything above reads only the uploaded plan. Q and the K/V pages (this step's tokens)
  // are the previous kernel's output, and the token table is a kernel's (fill_token_table,
  // which may be the previous one where a launch follows its upload directly), so they are
  // read after the wait. In the fixed-stride mode the entry of token tid goes out with Q.
  pdl_wait();
  const int32_t first_entry =
      item < p.table_items ? p.token_table[int64_t(item) * p.table_stride + tid] : 0;

  // Q tile: row r = local query r / gqa, q head kv_head * gqa + r % gqa; pad rows are zero.
  // Two threads per row, alternating 16-byte chunks, so each copy instruction reads 32
  // contiguous bytes of 16 rows.
  {
    const T* q = static_cast<const T*>(p.q);
    const T* src = q_row_source<D, T>(p, it, q_item_row, q_batch_row, q_head_off);
    const bool valid = src != nullptr;
#pragma unroll
    for (int j = 0; j < kChunks / 2; ++j) {
      const int c = (tid & 1) + 2 * j;
      cp_async_16(smem_u32(s_q + swz<D>(q_row, c)), valid ? src + c * 8 : q, valid);
    }
  }

  // tok[t] = pool row of item token t for this block's kv head (table_pool_row); int32 rows
  // halve the table.
  const int rows_per_page = p.num_kv_heads * page_size;
  const int head_row = it.kv_head * page_size;
  auto table_row = [&](int32_t e) { return table_pool_row(e, rows_per_page, head_row); };
  int rest_begin = 0;  // tokens from here on are read from the table after the first tiles go out
  const int32_t* entries = p.token_table;
  if (table_mode == kTableFixedStride) {
    entries += int64_t(item) * p.table_stride;
    if (tid < it.num_tokens) tok[tid] = table_row(first_entry);
    rest_begin = kThreads;
    __syncthreads();
  } else if (table_mode == kTablePacked) {
    entries += rec_b.x;
    for (int t = tid; t < it.num_tokens; t += kThreads) tok[t] = table_row(entries[t]);
    rest_begin = it.num_tokens;
    __syncthreads();
  } else {
    resolve_tokens(
        plan, h, rec_b.y, rec_b.z, page_size, seg_start, seg_slot, seg_page, warp_sums,
        [&](int t, int32_t page, int slot) { tok[t] = page * rows_per_page + head_row + slot; });
    rest_begin = it.num_tokens;
  }

  const int num_tokens = it.num_tokens;
  // Each thread copies 4 chunks (16 bytes each) of a token row per pass, so it looks the row
  // up once for 4 chunks; the row's kTpr threads are adjacent lanes, so each copy instruction
  // still reads whole 32-byte sectors (kTpr x 16 contiguous bytes of 32 / kTpr rows).
  constexpr int kTpr = kChunks / 4;              // threads per token row
  constexpr int kRowsPerPass = kThreads / kTpr;  // 32 (head_dim 128) or 64 (head_dim 64)
  static_assert(kKvTile % kRowsPerPass == 0, "whole passes per tile");
  // Copies tile `tile`'s K rows (with_k) and V rows (with_v) into buffer `stage`.
  auto load_tile = [&](int tile, int stage, bool with_k, bool with_v) {
    T* dk = s_k + stage * kKvTile * D;
    T* dv = s_v + stage * kKvTile * D;
#pragma unroll
    for (int pass = 0; pass < kKvTile / kRowsPerPass; ++pass) {
      const int r = pass * kRowsPerPass + tid / kTpr;
      const int t = tile * kKvTile + r;
      const bool valid = t < num_tokens;
      const int64_t row = valid ? int64_t(tok[t]) * D : 0;
      copy_kv_row<D, T, kFp8Kv>(dk, dv, s_ks + stage * kKvTile, s_vs + stage * kKvTile, r, row,
                                valid, p.k, p.v, p.k_scale, p.v_scale, with_k, with_v);
    }
  };
  // The same for a paired item: a tile holds kKvTile / kPairHeads tokens of each head, head
  // h's in rows [h * kKvTile / kPairHeads, (h + 1) * kKvTile / kPairHeads) (a head's pool rows
  // are page_size rows past the previous head's).
  auto load_tile_paired = [&](int tile, int stage, bool, bool) {
    constexpr int kTileTok = kKvTile / kPairHeads;
    T* dk = s_k + stage * kKvTile * D;
    T* dv = s_v + stage * kKvTile * D;
#pragma unroll
    for (int pass = 0; pass < kKvTile / kRowsPerPass; ++pass) {
      const int r = pass * kRowsPerPass + tid / kTpr;
      const int t = tile * kTileTok + r % kTileTok;
      const bool valid = t < num_tokens;
      const int64_t row = valid ? (int64_t(tok[t]) + (r / kTileTok) * page_size) * D : 0;
      copy_kv_row<D, T, kFp8Kv>(dk, dv, s_ks + stage * kKvTile, s_vs + stage * kKvTile, r, row,
                                valid, p.k, p.v, p.k_scale, p.v_scale);
    }
  };
  // Group 0: Q with the first tile. The main loops load tile 1 before their first barrier.
  static_assert(2 * kKvTile <= kThreads, "tiles 0 and 1 read the first table entries");
  if (it.num_tiles > 0) {
    if (paired) {
      load_tile_paired(0, 0, true, true);
    } else {
      load_tile(0, 0, true, true);
    }
  }
  cp_async_commit();
  // The fixed-stride table's later entries, while the first tiles are in flight: the main
  // loop's first barrier orders these writes before the load of tile 2.
  for (int t = rest_begin + tid; t < it.num_tokens; t += kThreads) tok[t] = table_row(entries[t]);
  // The tail kernel's launch (Stage1Params::early_trigger). Here rather than right after the
  // wait: a trigger placed there raises stage 1's register count (ptxas), and the tail kernel's
  // warps fit beside two stage 1 blocks only at its present count (see the tail kernel below).
  pdl_trigger_if(p.early_trigger);

  constexpr int kMaxSplit = kKvTile / 16 < kWarps ? kKvTile / 16 : kWarps;
  // Items of one slab (decode branches: gqa rows) split its tiles' tokens over the 4 warps;
  // the rest run whole 64-row tiles (wgmma on sm_90a): 17-32-row items run at least as fast in
  // whole tiles as split 2 ways, and decode items split 4 ways match whole wgmma tiles (both
  // bound by latency, not the tensor cores).
  auto convert = [&](int k_stage, int v_stage) {
    if constexpr (kFp8Kv) convert_fp8_tiles<D, T>(s_k, s_v, s_ks, s_vs, k_stage, v_stage);
  };
  if (paired) {
    attend<D, T, kWarps / kPairHeads, kTileRows, kPairHeads>(p, it, mask_words, s_q, s_k, s_v,
                                                             load_tile_paired, convert);
  } else if (it.num_rows <= kDecodeShapedRows) {
    attend<D, T, kMaxSplit>(p, it, mask_words, s_q, s_k, s_v, load_tile, convert);
  } else {
    attend<D, T, 1>(p, it, mask_words, s_q, s_k, s_v, load_tile, convert);
  }
  record_block_trace(p, start_ns, item, it);
  // The merge grid (programmatic dependent launch) may start once every block got here.
  pdl_trigger();
}

// The decode kernel: a plan whose items are all decode-shaped (at most 16 query-tile rows:
// typically one query's gqa heads against its branch's tokens; the workspace's
// runs_decode_kernel()),
// one block of 4 warps per (item, kv head) as stage 1's split path (attend<D, T, 4>: each warp
// scores a quarter of every 64-token tile, the four states merged at the end), in a kernel of
// its own: a 16-row query tile and no shared token table (each thread reads the entries of the
// rows it copies from the global table, two tiles ahead, into registers), so it takes ~69 KB
// of shared memory and at most 168 registers, and 3 blocks fit an SM where stage 1 fits 2, so
// it runs all-decode plans (the prefix-unaware baseline's) faster than stage 1. Mixed plans
// stay in stage 1: their decode-shaped items run slower in this kernel beside stage 1 on a
// second stream than in stage 1 itself.
constexpr int kDecodeMinBlocksPerSm = 3;
constexpr int kDecodeQRows = kDecodeShapedRows;
template <int D, bool kFp8Kv = false>
constexpr int decode_smem_bytes() {
  // + 1 KB to align the tiles, + an e4m3 pool's row scales
  return (2 * kStages * kKvTile + kDecodeQRows) * D * 2 + 1024 + (kFp8Kv ? kFp8ScaleBytes : 0);
}

template <int D, typename T, bool kFp8Kv = false>
__global__ void __launch_bounds__(kThreads, kDecodeMinBlocksPerSm)
    tree_attention_decode(Stage1Params p) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kSplit = kKvTile / 16 < kWarps ? kKvTile / 16 : kWarps;
  static_assert(kDecodeQRows == 16 * (kWarps / kSplit), "one 16-row slab, split over the warps");
  const int32_t* plan = p.plan;
  const int tid = threadIdx.x;
  const uint64_t start_ns = p.trace != nullptr && tid == 0 ? global_ns() : 0;
  int item = 0, pair_begin = -1;  // (the decode kernel's launches never pair)
  ItemTile it;
  block_item(p, &item, &it.kv_head, &pair_begin);
  if (item >= p.max_items) return;
  it.gqa = p.gqa;
  // The record, this thread's query row and the header (graph launches) go out together.
  static_assert(kThreads == 8 * kDecodeQRows, "8 threads per query-tile row");
  const int32_t* rec = plan + kHeaderWords + int64_t(item) * kItemRecordWords;
  const int4 rec_a = *reinterpret_cast<const int4*>(rec);
  const int4 rec_b = *reinterpret_cast<const int4*>(rec + 4);
  const int q_row = tid >> 3;
  const int q_local = q_row / it.gqa;
  const int32_t q_batch_row = rec[kRecQueryRows + q_local];
  const PlanHeaderArg h = load_header(p.header, plan, p.header_on_device);
  if (item >= h.w[kNumItems]) return;
  read_item_tile(it, rec_a, rec_b, plan, h);
  const uint32_t* mask_words = reinterpret_cast<const uint32_t*>(plan + h.w[kMaskWords]);
  // The upload picks this kernel only where it fills a token table (fixed stride or packed).
  const int32_t* entries =
      p.token_table +
      (h.w[kTokenTable] == kTableFixedStride ? int64_t(item) * p.table_stride : int64_t(rec_b.x));

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  T* s_k = reinterpret_cast<T*>(smem);  // [kStages][kKvTile][D], then V, then Q's 16 rows
  T* s_v = s_k + kStages * kKvTile * D;
  T* s_q = s_v + kStages * kKvTile * D;
  float* s_ks = reinterpret_cast<float*>(s_q + kDecodeQRows * D);  // e4m3 pool: row scales
  float* s_vs = s_ks + kStages * kKvTile;

  // Q, K, V and the token table are earlier kernels' output (a programmatic launch waits here).
  pdl_wait();

  // Each thread copies 4 chunks of a token row per pass (as stage 1's load_tile) and keeps
  // the table entries of its rows for the next two tiles in registers: the entries of tile
  // t + 2 are read when tile t's copies go out, so no copy waits for a table read after the
  // first.
  constexpr int kTpr = kChunks / 4;              // threads per token row
  constexpr int kRowsPerPass = kThreads / kTpr;  // 32 (head_dim 128) or 64 (head_dim 64)
  constexpr int kPasses = kKvTile / kRowsPerPass;
  static_assert(kKvTile % kRowsPerPass == 0, "whole passes per tile");
  const int num_tokens = it.num_tokens;
  int32_t ent0[kPasses], ent1[kPasses];  // entries of the next tile to copy, and the one after
  auto fetch = [&](int tile, int32_t(&ent)[kPasses]) {
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int t = tile * kKvTile + pass * kRowsPerPass + tid / kTpr;
      ent[pass] = t < num_tokens ? __ldg(entries + t) : 0;
    }
  };
  fetch(0, ent0);
  fetch(1, ent1);

  // Q tile (16 rows): row r = local query r / gqa, q head kv_head * gqa + r % gqa; pad rows
  // are zero.
  {
    const T* q = static_cast<const T*>(p.q);
    const T* src = q_row_source<D, T>(p, it, q_row, q_batch_row);
    const bool valid = src != nullptr;
#pragma unroll
    for (int c = tid & 7; c < kChunks; c += 8) {
      cp_async_16(smem_u32(s_q + swz<D, kDecodeQRows>(q_row, c)), valid ? src + c * 8 : q, valid);
    }
  }

  const int rows_per_page = p.num_kv_heads * p.page_size;
  const int head_row = it.kv_head * p.page_size;
  // Copies tile `tile` (the split loop asks for them in order) into buffer `stage`.
  auto load_tile = [&](int tile, int stage, bool, bool) {
    T* dk = s_k + stage * kKvTile * D;
    T* dv = s_v + stage * kKvTile * D;
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int r = pass * kRowsPerPass + tid / kTpr;
      const int t = tile * kKvTile + r;
      const bool valid = t < num_tokens;
      const int32_t e = ent0[pass];
      const int64_t row = valid ? int64_t(table_pool_row(e, rows_per_page, head_row)) * D : 0;
      copy_kv_row<D, T, kFp8Kv>(dk, dv, s_ks + stage * kKvTile, s_vs + stage * kKvTile, r, row,
                                valid, p.k, p.v, p.k_scale, p.v_scale);
      ent0[pass] = ent1[pass];
    }
    fetch(tile + 2, ent1);
  };
  if (it.num_tiles > 0) load_tile(0, 0, true, true);
  cp_async_commit();  // group 0: Q with the first tile
  auto convert = [&](int k_stage, int v_stage) {
    if constexpr (kFp8Kv) convert_fp8_tiles<D, T>(s_k, s_v, s_ks, s_vs, k_stage, v_stage);
  };
  attend<D, T, kSplit, kDecodeQRows>(p, it, mask_words, s_q, s_k, s_v, load_tile, convert);
  record_block_trace(p, start_ns, item, it);
  pdl_trigger();
}

// The tail kernel (TreeAttentionLimits::tail_kernel, eager launches of a plan that pairs):
// the decode-shaped items stage 1 would pair (from paired_items_begin on) run here instead,
// one warp a block per (item, kv head), in a kernel small enough to run beside two stage 1
// blocks on an SM. An SM's registers are four sub-partitions' of 16,384 and a warp takes its
// registers from one: two 202-register stage 1 blocks (8 warps, 2 per sub-partition) leave
// 3,072 in each, one warp of at most 96 registers (__maxnreg__; 128 registers would leave it
// no room beside them). Their 2 x ~92 KB of shared memory leave ~44 KB of the SM's 228 (both
// kernels ask for the largest carveout): room for four of these 11 KB blocks (10 KB and the 1 KB
// every block reserves), one a sub-partition, which the launch pads so that three fit
// (tree_attention_tail_block_smem). Stage 1 triggers the launch once its blocks' first copies
// are out, after their wait for the previous kernel, so the branches' K/V (DRAM-bound) streams
// while stage 1's wide items run on the tensor cores (compute-bound), instead of as a second
// wave after them. It reads no input before every stage 1 block has passed that wait, so it
// needs no wait of its own.
// Per warp, kTailRows (8) of the item's rows at a time, transposed so that they are the MMAs'
// n = 8 side: S^T = K Q^T (m16n8k16; K's 16 tokens and Q by ldmatrix), the online softmax on
// S^T's columns, P transposed in registers (movmatrix) into the B fragment, O^T += V^T P^T
// (V^T by ldmatrix.trans): O^T is D x 8, 32 fp32 registers at head_dim 128. One 16-token K
// tile and one V tile, refilled by cp.async as soon as each is read (K_{t+1} while step t's
// softmax and O^T product run, V_{t+1} while step t + 1's S^T does), so a warp keeps about one
// step's K/V in flight in 10 KB. One stage of each is what lets four warps fit beside stage 1:
// a two-stage ring with a P scratch and a padded Q (19 KB) fits two, deeper rings fewer, and
// MMAs keep the warp within its 96 registers where CUDA-core reductions by shuffles need 128.
constexpr int kTailRows = 8;
constexpr int kTailTok = 16;
template <int D>
__host__ __device__ constexpr int tail_smem_bytes() {
  return (2 * kTailTok + kTailRows) * D * 2;  // one K and one V tile, Q
}

// One (item, kv head) of the tail kernel's work, by one warp (lane: threadIdx.x % 32) in
// tail_smem_bytes<D>() of shared memory at tail_smem (1024-byte aligned): the tail kernel's
// blocks and the wide kernel's tail warps.
template <int D, typename T>
__device__ __forceinline__ void tail_unit(const Stage1Params& p, const PlanHeaderArg& h, int item,
                                          int kv_head, unsigned char* tail_smem,
                                          uint64_t start_ns) {
  constexpr int kChunks = D / 8;  // 16-byte chunks a K/V row
  constexpr int kRowsPerCopy = 32 / kChunks;
  constexpr int kKSteps = D / 16;
  constexpr unsigned kFull = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, qd = lane & 3;  // MMA fragment coordinates
  const int32_t* plan = p.plan;
  const int32_t* rec = plan + kHeaderWords + int64_t(item) * kItemRecordWords;
  const int query_begin = rec[kRecQueryBegin];
  const int num_rows = (rec[kRecQueryEnd] - query_begin) * p.gqa;
  const int num_tokens = rec[kRecNumTokens];
  const int mask_offset = rec[kRecMaskOffset];
  const int words_per_row = (num_tokens + 31) >> 5;
  const uint32_t* mask_words = reinterpret_cast<const uint32_t*>(plan + h.w[kMaskWords]);
  const int32_t* partial_slot = plan + h.w[kPartialSlot];
  const int32_t* entries =
      p.token_table + (h.w[kTokenTable] == kTableFixedStride ? int64_t(item) * p.table_stride
                                                             : int64_t(rec[kRecTableBegin]));
  const int rows_per_page = p.num_kv_heads * p.page_size;
  const int head_row = kv_head * p.page_size;
  auto pool_row = [&](int32_t e) { return table_pool_row(e, rows_per_page, head_row); };
  const T* k_pool = static_cast<const T*>(p.k);
  const T* v_pool = static_cast<const T*>(p.v);

  T* s_k = reinterpret_cast<T*>(tail_smem);  // K tile [kTailTok][D], swizzled
  T* s_v = s_k + kTailTok * D;               // V tile [kTailTok][D], swizzled
  T* s_q = s_v + kTailTok * D;               // Q [kTailRows][D], swizzled
  const int steps = (num_tokens + kTailTok - 1) / kTailTok;

  for (int row0 = 0; row0 < num_rows; row0 += kTailRows) {
    // Pool rows of tokens [32 k, 32 k + 32): lane i holds token 32 k + i's (rows_cur), and the
    // next 32 tokens' table entries are in flight (ent_next). (Registers, not shared memory:
    // staging a window's rows in shared memory is slower; docs/tree-attention.md.)
    int32_t rows_cur = lane < num_tokens ? pool_row(__ldg(entries + lane)) : 0;
    int32_t ent_next = 32 + lane < num_tokens ? __ldg(entries + 32 + lane) : 0;
    // Copies step t's K (k) or V rows into their tile (zeros past the item), one commit group.
    // K of step t moves to the next 32 tokens' rows, which V of step t then reads too.
    static_assert(32 % kTailTok == 0, "steps do not straddle 32-token groups");
    auto issue = [&](int t, bool k) {
      if (t < steps) {
        constexpr int kStepsPerGroup = 32 / kTailTok;
        if (k && t > 0 && t % kStepsPerGroup == 0) {
          rows_cur = pool_row(ent_next);
          const int at = (t + kStepsPerGroup) * kTailTok + lane;
          ent_next = at < num_tokens ? __ldg(entries + at) : 0;
        }
        T* dst = k ? s_k : s_v;
        const T* pool = k ? k_pool : v_pool;
#pragma unroll
        for (int i = 0; i < kTailTok / kRowsPerCopy; ++i) {
          const int j = i * kRowsPerCopy + lane / kChunks, c = lane % kChunks;
          const int tok = t * kTailTok + j;
          const int32_t r = __shfl_sync(kFull, rows_cur, (t % kStepsPerGroup) * kTailTok + j);
          const bool valid = tok < num_tokens;
          const int64_t off = valid ? int64_t(r) * D + c * 8 : 0;
          cp_async_16(smem_u32(dst + swz<D, kTailTok>(j, c)), pool + off, valid);
        }
      }
      cp_async_commit();
    };
    // The pass's Q rows (row n: q head kv_head * gqa + (row0 + n) % gqa; zeros past the
    // item's rows) with the first K tile: Q^T's B fragments are read back by ldmatrix each step.
#pragma unroll
    for (int i = 0; i < kTailRows * kChunks / 32; ++i) {
      const int n = i * kRowsPerCopy + lane / kChunks, c = lane % kChunks;
      const int row = row0 + n;
      const bool valid = row < num_rows;
      const T* src = static_cast<const T*>(p.q);
      if (valid) {
        const int32_t batch_row = rec[kRecQueryRows + row / p.gqa];
        src += (int64_t(batch_row) * p.num_q_heads + kv_head * p.gqa + row % p.gqa) * D + c * 8;
      }
      cp_async_16(smem_u32(s_q + swz<D, kTailRows>(n, c)), src, valid);
    }
    issue(0, true);
    issue(0, false);
    // This thread's score columns: rows row0 + 2 qd + e (e = 0, 1), their mask rows.
    const uint32_t* row_mask[2] = {nullptr, nullptr};
    bool row_valid[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = row0 + 2 * qd + e;
      row_valid[e] = row < num_rows;
      if (mask_offset >= 0 && row_valid[e]) {
        row_mask[e] = mask_words + mask_offset + (row / p.gqa) * words_per_row;
      }
    }
    float o[kKSteps][4];  // O^T: dims 16 mt + g (+8), rows 2 qd (+1)
#pragma unroll
    for (int mt = 0; mt < kKSteps; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    // Commit groups go K_0 (with Q), V_0, then K_{t+1} once S_t has read K_t and V_{t+1} once
    // O has read V_t: each wait lets the one group after the needed one stay in flight.
    for (int t = 0; t < steps; ++t) {
      cp_async_wait<1>();  // K_t (and Q)
      __syncwarp();
      // S^T = K Q^T: tokens lane/4 (+8) x rows 2 qd (+1).
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t a[4], b[2];
        ldmatrix_x4(a, smem_u32(s_k + swz<D, kTailTok>(lane & 15, 2 * kk + (lane >> 4))));
        ldmatrix_x2(b, smem_u32(s_q + swz<D, kTailRows>(lane & 7, 2 * kk + ((lane >> 3) & 1))));
        Dtype<T>::mma(s, a, b[0], b[1]);
      }
      __syncwarp();  // every lane's K reads are done before the next K lands
      issue(t + 1, true);
      float alpha[2], pr[2][2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x0 = s[e], x1 = s[2 + e];  // tokens g, g + 8
        const int t0 = t * kTailTok + g, t1 = t0 + 8;
        bool v0 = row_valid[e] && t0 < num_tokens, v1 = row_valid[e] && t1 < num_tokens;
        if (row_mask[e] != nullptr) {
          v0 = v0 && ((row_mask[e][t0 >> 5] >> (t0 & 31)) & 1u);
          v1 = v1 && ((row_mask[e][t1 >> 5] >> (t1 & 31)) & 1u);
        }
        x0 = v0 ? x0 * p.scale_log2 : -INFINITY;
        x1 = v1 ? x1 * p.scale_log2 : -INFINITY;
        float mx = fmaxf(x0, x1);
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 16));
        const float base = lazy_max_update(mx, m[e], alpha[e]);
        pr[e][0] = fast_exp2(x0 - base);
        pr[e][1] = fast_exp2(x1 - base);
        l[e] = l[e] * alpha[e] + pr[e][0] + pr[e][1];  // this thread's share; reduced at the end
      }
      if (__any_sync(kFull, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int mt = 0; mt < kKSteps; ++mt) {
          o[mt][0] *= alpha[0], o[mt][2] *= alpha[0];
          o[mt][1] *= alpha[1], o[mt][3] *= alpha[1];
        }
      }
      // P^T's B fragment (tokens 2 qd (+1) (+8) x row g) is the transpose of the 8 x 8 blocks
      // this thread holds (token g (+8) x rows 2 qd, 2 qd + 1): movmatrix, no shared memory.
      uint32_t pb[2];
      pb[0] = movmatrix_trans(Dtype<T>::pack(pr[0][0], pr[1][0]));
      pb[1] = movmatrix_trans(Dtype<T>::pack(pr[0][1], pr[1][1]));
      cp_async_wait<1>();  // V_t
      __syncwarp();
      // O^T += V^T P^T: V^T's A fragments by ldmatrix.trans of the [token][dim] tile.
#pragma unroll
      for (int mt = 0; mt < kKSteps; ++mt) {
        uint32_t a[4];
        const int tok = (lane & 7) + ((lane >> 4) << 3);
        ldmatrix_x4_trans(a, smem_u32(s_v + swz<D, kTailTok>(tok, 2 * mt + ((lane >> 3) & 1))));
        Dtype<T>::mma(o[mt], a, pb[0], pb[1]);
      }
      __syncwarp();  // every lane's V reads are done before the next V lands
      issue(t + 1, false);
    }
    cp_async_wait<0>();  // (empty groups past the item)

    // Normalised partials of the pass's rows and their LSE (base 2).
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      l[e] += __shfl_xor_sync(kFull, l[e], 4);
      l[e] += __shfl_xor_sync(kFull, l[e], 8);
      l[e] += __shfl_xor_sync(kFull, l[e], 16);
      const int row = row0 + 2 * qd + e;
      if (row >= num_rows) continue;
      const int64_t out_row = int64_t(partial_slot[query_begin + row / p.gqa]) * p.num_q_heads +
                              kv_head * p.gqa + row % p.gqa;
      const float inv = l[e] > 0.f ? 1.f / l[e] : 0.f;
      float* dst = p.partial_o + out_row * D + g;
#pragma unroll
      for (int mt = 0; mt < kKSteps; ++mt) {
        dst[16 * mt] = o[mt][e] * inv;
        dst[16 * mt + 8] = o[mt][2 + e] * inv;
      }
      if (g == 0) p.partial_lse[out_row] = l[e] > 0.f ? m[e] + log2f(l[e]) : -INFINITY;
    }
    __syncwarp();
  }
  if (p.trace != nullptr && lane == 0)
    write_trace(p, start_ns, item, kv_head, num_rows, num_tokens);
}

template <int D, typename T>
__global__ void __maxnreg__(96) tree_attention_tail(Stage1Params p, int32_t tail_begin) {
  const int lane = threadIdx.x & 31;
  const int32_t* plan = p.plan;
  const uint64_t start_ns = p.trace != nullptr && lane == 0 ? global_ns() : 0;
  // Eager launches pass where the paired items begin; grids (tail_begin < 0) read it, and the
  // rest of the header, from the plan buffer.
  const PlanHeaderArg h = load_header(p.header, plan, p.header_on_device);
  const int begin = tail_begin >= 0 ? tail_begin : h.w[kPairedBegin];
  if (begin < 0 || h.w[kTokenTable] == kTableNone) return;  // stage 1 runs every item
  // Where stage 1 runs no item, none of its blocks waited for the previous kernel before
  // triggering this launch.
  if (begin == 0) pdl_wait();
  const int item = begin + int(blockIdx.x) / p.num_kv_heads;
  const int kv_head = int(blockIdx.x) % p.num_kv_heads;
  if (item >= h.w[kNumItems]) return;
  extern __shared__ __align__(1024) unsigned char tail_smem[];
  tail_unit<D, T>(p, h, item, kv_head, tail_smem, start_ns);
}

// The wide kernel (TreeAttentionLimits::wide_kernel; eager launches at head_dim 128): the
// plan's leading pairs of wide items over the same tokens (tree_attention_wide_pairs) in
// FlashAttention-3's shape (warp-specialized: a producer warp and two consumer warpgroups).
// One block of three warpgroups an SM, each looping over units (pair, kv head):
//  - warpgroups 1 and 2 (consumers) each run one item of the pair: its query tile (GQA heads
//    as rows) by stage 1's pipelined wgmma step (S_{t+1} and P_t V_t in flight together, the
//    softmax of t + 1 under P_t V_t), both reading every K/V tile of one ring of kWideStages
//    64-token stages, and write its partials as stage 1 does;
//  - warp 0 of warpgroup 0 (producer) fills the ring from the token table by cp.async, each
//    lane's copies arriving on the stage's "full" barrier as they land; the consumers free a
//    stage through its "empty" barrier once their P V of it is done;
//  - warps 1-3 of warpgroup 0 run the plan's head-paired (decode-shaped) items from
//    tail_begin on, one (item, kv head) at a time as the tail kernel's warps do (tail_unit),
//    so the branches' K/V stream from DRAM while the tensor cores run the wide pairs.
//  - once a block's wide units are done, its producer and consumer warps take tail units too
//    (in 10 KB slots of the freed ring); tail units go to warps as they ask (an atomic counter
//    that the grid's last block resets), so the branches' work ends about together.
// Registers (setmaxnreg): warpgroup 0 keeps 152 a thread, the consumers take 176, of the
// launch's 168, and give them back to 152 before their tail units (ptxas: nothing spills at
// 152 / 176; warpgroup 0 spills at 120). Of the splits that do not spill, 152 / 176 is the
// fastest (docs/tree-attention.md). The split must keep 152 + 2 x 176 <= 3 x 168, the pool the
// launch holds: a larger request makes setmaxnreg.inc wait forever (a hang, not an error),
// which kWideLaunchRegs' static_assert guards.
// Shared memory: two Q tiles, the ring, three tail warps' 10 KB, the header (227 KB in all).
constexpr int kWideStages = 5;
constexpr int kWideThreads = 384;
constexpr int kWideTailWarps = 3;
constexpr int kWideWg0Regs = 152, kWideConsumerRegs = 176;  // setmaxnreg, a thread
// The registers a thread the launch holds (the register file over the block, in steps of 8).
constexpr int kWideLaunchRegs = 65536 / kWideThreads / 8 * 8;
static_assert(kWideWg0Regs + 2 * kWideConsumerRegs <= 3 * kWideLaunchRegs,
              "setmaxnreg.inc past the launch's pool waits forever");
template <int D>
constexpr int wide_smem_bytes() {
  return 1024 + (2 * kTileRows + 2 * kWideStages * kKvTile) * D * 2 +
         kWideTailWarps * tail_smem_bytes<D>() + 2 * kWideStages * 8 + kHeaderWords * 4;
}

template <int D, typename T>
__global__ void __launch_bounds__(kWideThreads, 1)
    tree_attention_wide(Stage1Params p, int32_t* counters) {
#if TS_WGMMA
  static_assert(tail_smem_bytes<D>() % 1024 == 0, "tail warps' regions stay 1024-byte aligned");
  constexpr int kTileElems = kKvTile * D;
  const int32_t* plan = p.plan;
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int lane = tid & 31, warp = tid >> 5;
  extern __shared__ __align__(1024) unsigned char wide_smem[];
  unsigned char* base = wide_smem + ((1024 - (smem_u32(wide_smem) & 1023)) & 1023);
  T* s_q = reinterpret_cast<T*>(base);  // [2][kTileRows][D], swizzled
  T* s_k = s_q + 2 * kTileRows * D;     // [kWideStages][kKvTile][D]
  T* s_v = s_k + kWideStages * kTileElems;
  unsigned char* s_tail = reinterpret_cast<unsigned char*>(s_v + kWideStages * kTileElems);
  uint64_t* full = reinterpret_cast<uint64_t*>(s_tail + kWideTailWarps * tail_smem_bytes<D>());
  uint64_t* empty = full + kWideStages;
  // The header in shared memory (from the plan buffer in grid launches, whose host copy is the
  // capture's), read there rather than held in registers: the pairs (items 2 i, 2 i + 1) and
  // where the paired items begin (-1: none).
  PlanHeaderArg& h = *reinterpret_cast<PlanHeaderArg*>(empty + kWideStages);
  if (threadIdx.x < kHeaderWords) {
    h.w[threadIdx.x] = p.header_on_device ? plan[threadIdx.x] : p.header.w[threadIdx.x];
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kWideStages; ++s) {
      mbar_init(&full[s], 32);  // the producer's lanes, each once its copies landed
      mbar_init(&empty[s], 8);  // the consumers' warps
    }
  }
  __syncthreads();
  const int pairs = h.w[kWidePairs], tail_begin = h.w[kPairedBegin];
  // Q, the K/V pages and the token table are earlier kernels' output.
  pdl_wait();
  const int units = pairs * p.num_kv_heads;
  const int rows_per_page = p.num_kv_heads * p.page_size;
  const T* k_pool = static_cast<const T*>(p.k);
  const T* v_pool = static_cast<const T*>(p.v);
  // Tail units (paired item, kv head) go to warps as they ask (counters[0]): the tail warps
  // from the start, the producer and consumer warps once the block's wide units are done.
  const int tail_units = tail_begin >= 0 ? (h.w[kNumItems] - tail_begin) * p.num_kv_heads : 0;
  auto run_tail_units = [&](unsigned char* smem) {
    while (tail_units > 0) {
      int u = 0;
      if (lane == 0) u = atomicAdd(counters, 1);
      u = __shfl_sync(0xffffffffu, u, 0);
      if (u >= tail_units) break;
      const uint64_t start_ns = p.trace != nullptr && lane == 0 ? global_ns() : 0;
      tail_unit<D, T>(p, h, tail_begin + u / p.num_kv_heads, u % p.num_kv_heads, smem, start_ns);
    }
  };
  // The ring is free once the producer and both consumers are past their wide units (named
  // barrier 1: the producer warp and the consumers' 8); then their warps take tail units in
  // 10 KB slots of it.
  constexpr int kRingUsers = 32 + 256;
  static_assert(9 * tail_smem_bytes<D>() <= 2 * kWideStages * kTileElems * int(sizeof(T)),
                "nine tail slots fit in the ring");
  auto ring_slot = [&](int k) {
    return reinterpret_cast<unsigned char*>(s_k) + k * tail_smem_bytes<D>();
  };
  auto item_entries = [&](int item, const int32_t* rec) {
    return p.token_table + (h.w[kTokenTable] == kTableFixedStride ? int64_t(item) * p.table_stride
                                                                  : int64_t(rec[kRecTableBegin]));
  };

  unsigned char* tail_slot;  // this warp's 10 KB for tail units
  if (wg == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWideWg0Regs));
    if (warp == 0) {
      // Producer. Lane l copies rows 8 pass + l / 4 of a tile (pass 0..7), 16-byte chunks
      // l % 4 + 4 j of each, so an instruction reads 64 contiguous bytes of 8 rows; it holds the
      // table entries of rows l and l + 32 of the next tile.
      int g = 0;  // tiles issued so far (ring position)
      for (int u = blockIdx.x; u < units; u += gridDim.x) {
        const int item = 2 * (u / p.num_kv_heads), kv_head = u % p.num_kv_heads;
        const int32_t* rec = plan + kHeaderWords + int64_t(item) * kItemRecordWords;
        const int num_tokens = rec[kRecNumTokens];
        const int32_t* entries = item_entries(item, rec);
        const int head_row = kv_head * p.page_size;
        const int n = (num_tokens + kKvTile - 1) / kKvTile;
        int32_t e_next[2] = {lane < num_tokens ? entries[lane] : 0,
                             32 + lane < num_tokens ? entries[32 + lane] : 0};
        for (int t = 0; t < n; ++t, ++g) {
          const int st = g % kWideStages;
          int32_t rows[2];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            rows[i] = table_pool_row(e_next[i], rows_per_page, head_row);
            const int next = (t + 1) * kKvTile + 32 * i + lane;
            e_next[i] = next < num_tokens ? entries[next] : 0;
          }
          if (g >= kWideStages) mbar_wait(&empty[st], ((g / kWideStages) - 1) & 1);
          T* dk = s_k + st * kTileElems;
          T* dv = s_v + st * kTileElems;
#pragma unroll
          for (int pass = 0; pass < kKvTile / 8; ++pass) {
            const int r = pass * 8 + lane / 4;
            const int32_t row = __shfl_sync(0xffffffffu, rows[pass / 4], r % 32);
            const bool valid = t * kKvTile + r < num_tokens;
            const int64_t off = valid ? int64_t(row) * D : 0;
#pragma unroll
            for (int j = 0; j < D / 32; ++j) {
              const int c = lane % 4 + 4 * j;
              cp_async_16(smem_u32(dk + swz<D>(r, c)), k_pool + off + c * 8, valid);
              cp_async_16(smem_u32(dv + swz<D>(r, c)), v_pool + off + c * 8, valid);
            }
          }
          mbar_arrive_on_copies(&full[st]);
        }
      }
      cp_async_wait<0>();
      named_sync(1, kRingUsers);
    }
    // Every warp reaches the tail units through the one call site below, so one inlined copy
    // of tail_unit: a copy per role (the producer's, the tail warps', the consumers') makes
    // warpgroup 0 spill and the kernel's code about a third larger, for no speed.
    tail_slot = warp == 0 ? ring_slot(8) : s_tail + (warp - 1) * tail_smem_bytes<D>();
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWideConsumerRegs));
    const int w = wg - 1;
    T* q_tile = s_q + w * kTileRows * D;
    int g = 0;  // tiles consumed so far (ring position)
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const uint64_t start_ns = p.trace != nullptr && tid == 0 ? global_ns() : 0;
      const int item = 2 * (u / p.num_kv_heads) + w;
      const int32_t* rec = plan + kHeaderWords + int64_t(item) * kItemRecordWords;
      ItemTile it;
      it.gqa = p.gqa;
      it.kv_head = u % p.num_kv_heads;
      read_item_tile(it, *reinterpret_cast<const int4*>(rec),
                     *reinterpret_cast<const int4*>(rec + 4), plan, h);
      // Q tile (row r: local query r / gqa; pad rows zero), once every warp of the warpgroup is
      // done with the previous unit's.
      named_sync(2 + w, 128);
#pragma unroll
      for (int i = 0; i < kTileRows * (D / 8) / 128; ++i) {
        const int idx = tid + 128 * i, r = idx / (D / 8), c = idx % (D / 8);
        const int32_t batch_row = r < it.num_rows ? rec[kRecQueryRows + r / it.gqa] : 0;
        const T* src = q_row_source<D, T>(p, it, r, batch_row);
        cp_async_16(smem_u32(q_tile + swz<D>(r, c)), src != nullptr ? src + c * 8 : p.q,
                    src != nullptr);
      }
      cp_async_commit();
      cp_async_wait<0>();
      fence_proxy_async_smem();
      named_sync(2 + w, 128);

      const uint32_t* const row_mask[2] = {nullptr, nullptr};  // pairs have no masks
      float o_acc[D / 8][4];
#pragma unroll
      for (int j = 0; j < D / 8; ++j) o_acc[j][0] = o_acc[j][1] = o_acc[j][2] = o_acc[j][3] = 0.f;
      float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
      float s[8][4];
      uint32_t pa0[kKvTile / 16][4], pa1[kKvTile / 16][4];
      const int n = it.num_tiles;
      auto stage = [&](int t) { return (g + t) % kWideStages; };
      auto wait_full = [&](int t) {
        mbar_wait(&full[stage(t)], ((g + t) / kWideStages) & 1);
        fence_proxy_async_smem();  // cp.async (generic proxy) -> wgmma's reads
      };
      auto release = [&](int t) {
        if (lane == 0) mbar_arrive(&empty[stage(t)]);
      };
      auto zero_s = [&]() {
#pragma unroll
        for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      };
      auto issue_scores = [&](int t) {
        wgmma_scores<D, T>(s, smem_u32(q_tile), smem_u32(s_k + stage(t) * kTileElems));
      };
      auto issue_pv = [&](const uint32_t(&pa)[kKvTile / 16][4], int t) {
        wgmma_pv<D, T>(o_acc, pa, smem_u32(s_v + stage(t) * kTileElems));
      };
      wait_full(0);
      zero_s();
      wgmma_fence();
      issue_scores(0);
      wgmma_wait<0>();
      fence_regs(s);
      {
        float alpha[2];  // O is still zero
        softmax_tile(s, it, 0, 0, row_mask, p.scale_log2, row_max, row_sum, alpha);
#pragma unroll
        for (int kk = 0; kk < kKvTile / 16; ++kk) pack_p<T>(s, kk, pa0[kk]);
      }
      auto step = [&](int t, const uint32_t(&cur)[kKvTile / 16][4],
                      uint32_t(&nxt)[kKvTile / 16][4]) {
        wait_full(t + 1);
        float alpha[2];
        wgmma_step<D, T>(s, o_acc, smem_u32(q_tile), smem_u32(s_k + stage(t + 1) * kTileElems),
                         smem_u32(s_v + stage(t) * kTileElems), cur, nxt, it, (t + 1) * kKvTile,
                         row_mask, p.scale_log2, row_max, row_sum, alpha);
        release(t);
        rescale_o<D>(o_acc, alpha);
      };
      auto last = [&](const uint32_t(&cur)[kKvTile / 16][4]) {
        wgmma_fence();
        issue_pv(cur, n - 1);
        wgmma_wait<0>();
        fence_regs(o_acc);
        release(n - 1);
      };
      run_tile_steps(n, pa0, pa1, step, last);
      g += n;

      // The valid rows' normalised partials (rows 16 warp + lane / 4 and + 8), as stage 1.
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float sum = row_sum[i];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int r = warp * 16 + (lane >> 2) + 8 * i;
        if (r < it.num_rows) write_partial_row<D>(p, it, r, it.kv_head, o_acc, i, sum, row_max[i]);
      }
      if (p.trace != nullptr && tid == 0) {
        write_trace(p, start_ns, item, it.kv_head, it.num_rows, it.num_tokens);
      }
    }
    named_sync(1, kRingUsers);
    // The consumers' registers back to warpgroup 0's count, so that every warp runs the one
    // inlined copy of the tail units below.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWideWg0Regs));
    tail_slot = ring_slot(4 * w + warp);
  }
  run_tail_units(tail_slot);
  // The last block to finish resets the counters for the next launch: every block's warps have
  // stopped asking for units by then.
  __syncthreads();
  if (threadIdx.x == 0 && tail_units > 0 && atomicAdd(counters + 1, 1) == int(gridDim.x) - 1) {
    counters[0] = 0;
    counters[1] = 0;
  }
  // The merge grid (or stage 1's blocks for the remaining items) may start once every block
  // got here.
  pdl_trigger();
#endif
}

// Writes this build's TS_WGMMA for the device it runs on (wide_kernel_built).
__global__ void wide_probe(int* out) { *out = TS_WGMMA; }

// The upload's token table: one block per item writes (page << 8) | slot for each of its
// tokens from i * table_stride (fixed-stride mode) or its record's table_begin (packed) on
// (detail/tree_attention_layout.h).
__global__ void __launch_bounds__(kThreads)
    fill_token_table(PlanHeaderArg h, const int32_t* plan, int32_t table_stride, int32_t* table) {
  __shared__ int32_t seg_start[kSegBatch], seg_slot[kSegBatch], seg_page[kSegBatch];
  __shared__ int32_t warp_sums[2 * kWarps];
  const int item = blockIdx.x;
  const int32_t* rec = plan + kHeaderWords + int64_t(item) * kItemRecordWords;
  int32_t* out = table + (h.w[kTokenTable] == kTableFixedStride ? int64_t(item) * table_stride
                                                                : int64_t(rec[kRecTableBegin]));
  resolve_tokens(plan, h, rec[kRecSegBegin], rec[kRecSegEnd], h.w[kPageSize], seg_start, seg_slot,
                 seg_page, warp_sums,
                 [&](int t, int32_t page, int slot) { out[t] = (page << 8) | slot; });
}

// One (query, q head)'s partials, which stage 1 stored in the contiguous slots [begin, end),
// merged by one warp: this lane's D / 32 columns of sum_i w_i o_i in acc, with
// w_i = 2^(lse_i - max) and the partials' running max and sum_i w_i. Up to kBatch partials'
// loads are in flight at once. Waits for stage 1 (programmatic dependent launch) first, so the
// caller reads its plan entries before calling.
template <int D>
__device__ __forceinline__ void merge_partials(const float* partial_o, const float* partial_lse,
                                               int begin, int end, int head, int num_q_heads,
                                               float (&acc)[D / 32], float& run_max,
                                               float& run_sum) {
  constexpr int kPerLane = D / 32;
  constexpr int kBatch = 8;
  const int lane = threadIdx.x & 31;
  pdl_wait();  // stage 1's partials are complete
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.f;
  run_max = -INFINITY;
  run_sum = 0.f;
  for (int base = begin; base < end; base += kBatch) {
    float lse[kBatch];
    float x[kBatch][kPerLane];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int64_t at = int64_t(base + j) * num_q_heads + head;
      const bool valid = base + j < end;
      lse[j] = valid ? partial_lse[at] : -INFINITY;
      const float* src = partial_o + at * D + lane * kPerLane;
      if constexpr (kPerLane == 4) {
        const float4 v = valid ? *reinterpret_cast<const float4*>(src) : make_float4(0, 0, 0, 0);
        x[j][0] = v.x, x[j][1] = v.y, x[j][2] = v.z, x[j][3] = v.w;
      } else {
        const float2 v = valid ? *reinterpret_cast<const float2*>(src) : make_float2(0, 0);
        x[j][0] = v.x, x[j][1] = v.y;
      }
    }
    float batch_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) batch_max = fmaxf(batch_max, lse[j]);
    const float new_max = fmaxf(run_max, batch_max);
    if (new_max == -INFINITY) continue;  // nothing visible yet (warp-uniform)
    const float rescale = fast_exp2(run_max - new_max);
    run_sum *= rescale;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) acc[e] *= rescale;
    run_max = new_max;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const float w = fast_exp2(lse[j] - new_max);  // -inf (padding, empty) -> 0
      run_sum += w;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) acc[e] += w * x[j][e];
    }
  }
}

// One warp per (query, q head): out[row][head] = sum_i w_i o_i / sum_i w_i over the query's
// partials (merge_partials), in the model dtype; zeros for a query without partials. The plan
// reads happen before the wait for stage 1.
template <int D, typename T>
__global__ void __launch_bounds__(kThreads)
    tree_attention_merge(PlanHeaderArg header, int32_t header_on_device, const int32_t* plan,
                         const float* partial_o, const float* partial_lse, T* out,
                         int num_q_heads) {
  constexpr int kPerLane = D / 32;
  const PlanHeaderArg h = load_header(header, plan, header_on_device);
  const int lane = threadIdx.x & 31;
  const int pair = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int query = pair / num_q_heads, head = pair % num_q_heads;
  if (query >= h.w[kNumQueries]) return;
  const int begin = plan[h.w[kQueryMergeBegin] + query];
  const int end = plan[h.w[kQueryMergeBegin] + query + 1];
  const int row = plan[h.w[kQueryRows] + query];
  float acc[kPerLane], run_max, run_sum;
  merge_partials<D>(partial_o, partial_lse, begin, end, head, num_q_heads, acc, run_max, run_sum);
  const float inv = run_sum > 0.f ? 1.f / run_sum : 0.f;
  T* dst = out + (int64_t(row) * num_q_heads + head) * D + lane * kPerLane;
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) dst[e] = Dtype<T>::from_float(acc[e] * inv);
}

// The same merge, writing each query's state in float32 instead (launch_tree_attention_state):
// state_o [queries][num_q_heads][D] normalised O, state_lse [queries][num_q_heads] base-2 LSE;
// O = 0, LSE = -inf for a query without partials. Templated on D only (the partials are fp32).
template <int D>
__global__ void __launch_bounds__(kThreads)
    tree_attention_merge_state(PlanHeaderArg header, int32_t header_on_device, const int32_t* plan,
                               const float* partial_o, const float* partial_lse, float* state_o,
                               float* state_lse, int num_q_heads) {
  constexpr int kPerLane = D / 32;
  // What follows (the sequence-parallel combine, launched programmatically) waits for this
  // grid's end before it reads the states: let it be scheduled now, so its launch is not on
  // the step's path.
  pdl_trigger();
  const PlanHeaderArg h = load_header(header, plan, header_on_device);
  const int lane = threadIdx.x & 31;
  const int pair = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int query = pair / num_q_heads, head = pair % num_q_heads;
  if (query >= h.w[kNumQueries]) return;
  const int begin = plan[h.w[kQueryMergeBegin] + query];
  const int end = plan[h.w[kQueryMergeBegin] + query + 1];
  float acc[kPerLane], run_max, run_sum;
  merge_partials<D>(partial_o, partial_lse, begin, end, head, num_q_heads, acc, run_max, run_sum);
  const float inv = run_sum > 0.f ? 1.f / run_sum : 0.f;
  const int64_t at = int64_t(query) * num_q_heads + head;
  float* dst = state_o + at * D + lane * kPerLane;
  if constexpr (kPerLane == 4) {
    *reinterpret_cast<float4*>(dst) =
        make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
  } else {
    *reinterpret_cast<float2*>(dst) = make_float2(acc[0] * inv, acc[1] * inv);
  }
  if (lane == 0) state_lse[at] = run_sum > 0.f ? run_max + log2f(run_sum) : -INFINITY;
}

Status launch_error(const char* what, cudaError_t e) {
  return Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

Status cuda_status(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : launch_error(what, e);
}

// Sets a kernel attribute once per (kernel, attribute, device): function attributes belong to
// the kernel in one device's context (tensor parallelism launches on several). Called before
// any launch of the kernel there, so never during a graph capture, whose eager first step
// comes first.
cudaError_t set_attribute_once(const void* kernel, cudaFuncAttribute attribute, int value) {
  static std::mutex mutex;
  static std::vector<std::tuple<const void*, int, int>> done;  // (kernel, attribute, device)
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mutex);
  const std::tuple<const void*, int, int> key(kernel, int(attribute), device);
  if (std::find(done.begin(), done.end(), key) != done.end()) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, attribute, value);
  if (e == cudaSuccess) done.push_back(key);
  return e;
}

// Stage 1's and the decode kernel's opt-in to more than 48 KB of dynamic shared memory.
cudaError_t allow_large_smem(const void* kernel) {
  return set_attribute_once(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024);
}

// Stage 1 and the tail kernel ask for the SM's largest shared-memory carveout where they run
// together, so the tail kernel's blocks find room beside two stage 1 blocks.
cudaError_t prefer_max_shared(const void* kernel) {
  return set_attribute_once(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                            cudaSharedmemCarveoutMaxShared);
}

// Where stage 2 writes: out (model dtype rows), or, when out is null, the float32 states.
struct MergeTarget {
  void* out = nullptr;
  float* state_o = nullptr;
  float* state_lse = nullptr;
};

// Stage 1's blocks where head pairing runs `paired` items kPairHeads kv heads a block after
// `unpaired` items one kv head a block.
int64_t paired_stage1_blocks(int64_t unpaired, int64_t paired, int32_t num_kv_heads) {
  return unpaired * num_kv_heads + paired * (num_kv_heads / kPairHeads);
}

// kFp8Kv: an e4m3 pool (params.k_scale set), which stage 1 and the decode kernel read (their
// kFp8Kv instances); the tail and wide kernels, which copy T tiles only, do not run.
template <int D, typename T, bool kFp8Kv>
Status launch(const Stage1Params& params, const MergeTarget& target,
              const TreeAttentionWorkspace& ws, cudaStream_t stream, TreeAttentionGrid grid) {
  const TreeAttentionLimits& limits = ws.limits();
  const int smem = stage1_smem_bytes_fixed<D, kFp8Kv>() + limits.max_item_tokens * 4;
  auto* const stage1 = tree_attention_stage1<D, T, kFp8Kv>;
  for (const void* kernel : {reinterpret_cast<const void*>(stage1),
                             reinterpret_cast<const void*>(tree_attention_decode<D, T, kFp8Kv>)}) {
    const cudaError_t attr = allow_large_smem(kernel);
    if (attr != cudaSuccess) return launch_error("cudaFuncSetAttribute", attr);
  }
  const int items = grid.items > 0 ? grid.items : ws.num_items();
  const int queries = grid.items > 0 ? grid.queries : ws.num_queries();
  if (queries == 0) return Status::Ok();
  if (int64_t(items) * params.num_kv_heads > INT32_MAX) {
    return InvalidArgument("work items x kv heads exceed one grid");
  }
  // The wide kernel (TreeAttentionLimits::wide_kernel): its pairs and the paired items in one
  // grid, then stage 1 for the items between them, if any.
  const bool wide =
      !kFp8Kv && D == 128 && items > 0 &&
      (grid.items > 0 ? grid.wide : tree_attention_runs_wide(ws, params.num_kv_heads, D));
  if constexpr (D == 128 && !kFp8Kv) {
    if (wide) {
      const void* kernel = reinterpret_cast<const void*>(tree_attention_wide<D, T>);
      const cudaError_t attr = allow_large_smem(kernel);
      if (attr != cudaSuccess) return launch_error("cudaFuncSetAttribute", attr);
      const int32_t pairs = ws.wide_pairs();
      const int32_t tail_begin = ws.paired_items_begin();  // -1: none
      const int64_t units = int64_t(pairs) * params.num_kv_heads;
      // With paired items (or in a grid, for any plan) every SM runs tail warps; else one block
      // a unit, at most one an SM.
      const int blocks = tail_begin >= 0 || grid.items > 0
                             ? ws.num_sms()
                             : int(std::min<int64_t>(units, ws.num_sms()));
      const cudaError_t e1 =
          launch_pdl(dim3(blocks), dim3(kWideThreads), size_t(wide_smem_bytes<D>()), stream,
                     tree_attention_wide<D, T>, params, static_cast<int32_t*>(ws.wide_counters()));
      if (e1 != cudaSuccess) return launch_error("tree_attention_wide launch", e1);
      // A grid's stage 1 blocks read where its items begin and end from the header (the first
      // ones exit where there are fewer).
      const int32_t rest = grid.items > 0 ? grid.wide_rest : tree_attention_wide_rest(ws);
      if (rest > 0) {
        Stage1Params p1 = params;
        p1.pair_begin = grid.items > 0 ? kTailFromHeader : -1;
        p1.item_offset = grid.items > 0 ? kWideFromHeader : 2 * pairs;
        const cudaError_t e2 = launch_pdl(dim3(rest * params.num_kv_heads), dim3(kThreads),
                                          size_t(smem), stream, tree_attention_stage1<D, T>, p1);
        if (e2 != cudaSuccess) return launch_error("tree_attention_stage1 launch", e2);
      }
    }
  }
  // A plan without items (a sequence-parallel shard's) still has its queries written.
  if (items > 0 && !wide) {
    // Programmatic dependent launch too: a block reads its plan record and query rows while
    // the previous kernel (the engine's RoPE + KV append, which triggers at its start) drains,
    // and waits for it before loading the token table, Q, K and V.
    const bool decode = grid.items > 0 ? grid.decode_kernel : ws.runs_decode_kernel();
    dim3 blocks_1(items * params.num_kv_heads);
    Stage1Params p1 = params;
    p1.pair_begin = -1;
    // Head pairing, where the plan pairs (the workspace checked that the paired items are one
    // slab): eager launches map the blocks here; a paired grid's blocks read where the paired
    // items begin from the header (the grid covers every plan's blocks: a paired item takes
    // fewer); any other grid runs every item one kv head a block.
    const int paired_begin = ws.paired_items_begin();
    // The tail kernel (TreeAttentionLimits::tail_kernel; TreeAttentionGrid::tail). It is
    // launched once every stage 1 block has triggered, which a block running an item does only
    // after its wait for the previous kernel (where none does, the tail kernel waits itself).
    const bool tail =
        !kFp8Kv &&
        (grid.items > 0 ? grid.tail && !decode : tree_attention_runs_tail(ws, params.num_kv_heads));
    if (tail) {
      for (const void* kernel : {reinterpret_cast<const void*>(stage1),
                                 reinterpret_cast<const void*>(tree_attention_tail<D, T>)}) {
        const cudaError_t attr = prefer_max_shared(kernel);
        if (attr != cudaSuccess) return launch_error("cudaFuncSetAttribute", attr);
      }
      if (grid.items > 0) {
        p1.pair_begin = kTailFromHeader;
        if (grid.wide_items > 0) blocks_1 = dim3(grid.wide_items * params.num_kv_heads);
      } else {
        blocks_1 = dim3(paired_begin * params.num_kv_heads);
      }
      p1.early_trigger = 1;
    } else if (!decode && params.num_kv_heads % kPairHeads == 0) {
      if (grid.items > 0 && grid.paired) {
        p1.pair_begin = kPairFromHeader;
        if (grid.paired_items > 0) {
          blocks_1 = dim3(unsigned(
              paired_stage1_blocks(grid.wide_items, grid.paired_items, params.num_kv_heads)));
        }
      } else if (grid.items == 0 && paired_begin >= 0) {
        p1.pair_begin = paired_begin;
        blocks_1 = dim3(unsigned(
            paired_stage1_blocks(paired_begin, items - paired_begin, params.num_kv_heads)));
      }
    }
    const cudaError_t e1 =
        decode ? launch_pdl(blocks_1, dim3(kThreads), size_t(decode_smem_bytes<D, kFp8Kv>()),
                            stream, tree_attention_decode<D, T, kFp8Kv>, p1)
               : launch_pdl(blocks_1, dim3(kThreads), size_t(smem), stream, stage1, p1);
    if (e1 != cudaSuccess) {
      return launch_error(decode ? "tree_attention_decode launch" : "tree_attention_stage1 launch",
                          e1);
    }
    if (tail) {
      // A grid covers every item of its plans (a plan's paired items start at 0 or later).
      const int64_t units =
          int64_t(grid.items > 0 ? items : items - paired_begin) * params.num_kv_heads;
      const cudaError_t e2 = launch_pdl(
          dim3(unsigned(units)), dim3(32),
          size_t(tree_attention_tail_block_smem(tail_smem_bytes<D>(), smem, ws.smem_per_sm(),
                                                ws.smem_reserved_per_block())),
          stream, tree_attention_tail<D, T>, p1, grid.items > 0 ? -1 : paired_begin);
      if (e2 != cudaSuccess) return launch_error("tree_attention_tail launch", e2);
    }
  }
  const int64_t pairs = int64_t(queries) * params.num_q_heads;
  const int blocks = int((pairs + kWarps - 1) / kWarps);
  const float* partial_o = params.partial_o;
  const float* partial_lse = params.partial_lse;
  // Programmatic dependent launch: the merge grid starts while stage 1 drains and waits on
  // griddepcontrol.wait, which hides its launch latency (also inside a CUDA graph).
  const cudaError_t e =
      target.out != nullptr
          ? launch_pdl(dim3(blocks), dim3(kThreads), 0, stream, tree_attention_merge<D, T>,
                       params.header, params.header_on_device, params.plan, partial_o, partial_lse,
                       static_cast<T*>(target.out), int(params.num_q_heads))
          : launch_pdl(dim3(blocks), dim3(kThreads), 0, stream, tree_attention_merge_state<D>,
                       params.header, params.header_on_device, params.plan, partial_o, partial_lse,
                       target.state_o, target.state_lse, int(params.num_q_heads));
  if (e != cudaSuccess) return launch_error("tree_attention_merge launch", e);
  return Status::Ok();
}

// Checks shared by both launchers and the stage 1 parameters they launch with.
Status prepare_launch(const void* q, const void* k_pool, const void* v_pool, int32_t num_q_heads,
                      int32_t num_kv_heads, int32_t head_dim, int32_t page_size, float sm_scale,
                      const TreeAttentionWorkspace& workspace, TreeAttentionGrid grid,
                      TreeAttentionKvScales fp8_kv, Stage1Params* params) {
  if (!workspace.initialized())
    return FailedPrecondition("tree attention workspace not initialized");
  if (head_dim != 64 && head_dim != 128) {
    return InvalidArgument("head_dim = " + std::to_string(head_dim) + " (supported: 64, 128)");
  }
  if (head_dim > workspace.limits().max_head_dim ||
      num_q_heads > workspace.limits().max_num_q_heads) {
    return InvalidArgument("num_q_heads = " + std::to_string(num_q_heads) + " / head_dim = " +
                           std::to_string(head_dim) + " exceed the workspace's partial buffers");
  }
  if (num_kv_heads < 1 || num_q_heads != num_kv_heads * workspace.gqa_group_size()) {
    return InvalidArgument(
        "num_q_heads = " + std::to_string(num_q_heads) +
        " != num_kv_heads * plan.gqa_group_size = " + std::to_string(num_kv_heads) + " * " +
        std::to_string(workspace.gqa_group_size()));
  }
  if (page_size != workspace.page_size()) {
    return InvalidArgument("page_size = " + std::to_string(page_size) +
                           " differs from the plan's " + std::to_string(workspace.page_size()));
  }
  if (q == nullptr || k_pool == nullptr || v_pool == nullptr) {
    return InvalidArgument("launch_tree_attention: null tensor pointer");
  }
  if (grid.items > 0 &&
      (grid.items < workspace.num_items() || grid.queries < workspace.num_queries())) {
    return InvalidArgument("launch grid of " + std::to_string(grid.items) + " items / " +
                           std::to_string(grid.queries) + " queries is smaller than the plan's " +
                           std::to_string(workspace.num_items()) + " / " +
                           std::to_string(workspace.num_queries()));
  }
  if (grid.wide_items < 0) {
    return InvalidArgument("launch grid's wide_items = " + std::to_string(grid.wide_items) +
                           " must be >= 0");
  }
  if (grid.items > 0 && grid.tail && grid.wide_items > 0) {
    const int32_t begin = workspace.paired_items_begin();
    const int32_t stage1_items =
        begin >= 0 && workspace.uses_token_table() ? begin : workspace.num_items();
    if (grid.wide_items < stage1_items || grid.wide_items > grid.items) {
      return InvalidArgument(
          "launch grid's wide_items = " + std::to_string(grid.wide_items) + " must cover the " +
          std::to_string(stage1_items) +
          " items stage 1 runs and be at most its items = " + std::to_string(grid.items));
    }
  }
  if (grid.paired_items < 0) {
    return InvalidArgument("launch grid's paired_items = " + std::to_string(grid.paired_items) +
                           " must be >= 0");
  }
  if (grid.items > 0 && grid.paired_items > 0) {
    if (!grid.paired || grid.tail || grid.wide || grid.decode_kernel ||
        num_kv_heads % kPairHeads != 0 || grid.paired_items % kPairHeads != 0) {
      return InvalidArgument(
          "launch grid's paired_items = " + std::to_string(grid.paired_items) +
          " needs a paired grid without tail, wide or decode_kernel, kv heads (" +
          std::to_string(num_kv_heads) + ") and paired_items multiples of " +
          std::to_string(kPairHeads));
    }
    const int64_t begin = workspace.paired_items_begin(), n = workspace.num_items();
    const int64_t need =
        begin >= 0 ? paired_stage1_blocks(begin, n - begin, num_kv_heads) : n * num_kv_heads;
    const int64_t have = paired_stage1_blocks(grid.wide_items, grid.paired_items, num_kv_heads);
    if (have < need || grid.wide_items > grid.items || grid.paired_items > grid.items) {
      return InvalidArgument(
          "launch grid's wide_items = " + std::to_string(grid.wide_items) +
          " and paired_items = " + std::to_string(grid.paired_items) + " give stage 1 " +
          std::to_string(have) + " blocks, the plan needs " + std::to_string(need) +
          " (each at most the grid's items = " + std::to_string(grid.items) + ")");
    }
  }
  if (grid.wide_rest < 0) {
    return InvalidArgument("launch grid's wide_rest = " + std::to_string(grid.wide_rest) +
                           " must be >= 0");
  }
  if (grid.items > 0 && grid.wide) {
    if (head_dim != 128 || !workspace.wide_kernel_built() || !workspace.uses_token_table()) {
      return InvalidArgument(
          "launch grid with wide needs head_dim 128 (have " + std::to_string(head_dim) +
          "), a build with the wide kernel for this device and an upload with a token table");
    }
    const int32_t rest = tree_attention_wide_rest(workspace);
    if (rest > grid.wide_rest) {
      return InvalidArgument("launch grid's wide_rest = " + std::to_string(grid.wide_rest) +
                             " must cover the " + std::to_string(rest) +
                             " items stage 1 runs after the wide kernel's pairs");
    }
  }
  if ((fp8_kv.k == nullptr) != (fp8_kv.v == nullptr)) {
    return InvalidArgument("an e4m3 KV pool needs both scale arrays (K and V)");
  }
  if (fp8_kv.k != nullptr && grid.items > 0 && (grid.tail || grid.wide)) {
    return InvalidArgument(
        "an e4m3 KV pool runs in stage 1 or the decode kernel: a launch grid with tail or wide "
        "cannot take it (the workspace's limits should turn both kernels off)");
  }
  if (grid.items > 0 && grid.decode_kernel && !workspace.runs_decode_kernel()) {
    return InvalidArgument(
        "launch grid with decode_kernel for a plan that is not all decode-shaped "
        "(runs_decode_kernel() is false)");
  }
  params->header_on_device = grid.items > 0 ? 1 : 0;
  for (int i = 0; i < kHeaderWords; ++i) params->header.w[i] = workspace.plan_header()[i];
  params->plan = static_cast<const int32_t*>(workspace.device_plan());
  params->q = q;
  params->k = k_pool;
  params->v = v_pool;
  params->k_scale = fp8_kv.k;
  params->v_scale = fp8_kv.v;
  params->token_table = static_cast<const int32_t*>(workspace.token_table());
  params->partial_o = static_cast<float*>(workspace.partial_o());
  params->partial_lse = static_cast<float*>(workspace.partial_lse());
  params->num_q_heads = num_q_heads;
  params->num_kv_heads = num_kv_heads;
  params->scale_log2 = sm_scale * kLog2e;
  params->gqa = num_q_heads / num_kv_heads;
  params->page_size = page_size;
  params->heads_first = workspace.plan_header()[kHeadsFirst];
  params->max_items = workspace.limits().max_work_items;
  params->table_items = workspace.table_items();
  params->table_stride = params->table_items > 0 ? workspace.table_stride() : 0;
  params->pair_begin = -1;
  params->early_trigger = 0;
  params->item_offset = 0;
  params->trace = static_cast<TreeAttentionBlockTrace*>(workspace.block_trace());
  return Status::Ok();
}

template <int D, typename T>
Status launch_kv(bool fp8, const Stage1Params& params, const MergeTarget& target,
                 const TreeAttentionWorkspace& ws, cudaStream_t stream, TreeAttentionGrid grid) {
  return fp8 ? launch<D, T, true>(params, target, ws, stream, grid)
             : launch<D, T, false>(params, target, ws, stream, grid);
}

Status dispatch(const Stage1Params& params, const MergeTarget& target, TreeAttentionDtype dtype,
                int32_t head_dim, const TreeAttentionWorkspace& workspace, cudaStream_t stream,
                TreeAttentionGrid grid) {
  const bool bf16 = dtype == TreeAttentionDtype::kBFloat16;
  const bool fp8 = params.k_scale != nullptr;
  if (head_dim == 128) {
    return bf16 ? launch_kv<128, __nv_bfloat16>(fp8, params, target, workspace, stream, grid)
                : launch_kv<128, __half>(fp8, params, target, workspace, stream, grid);
  }
  return bf16 ? launch_kv<64, __nv_bfloat16>(fp8, params, target, workspace, stream, grid)
              : launch_kv<64, __half>(fp8, params, target, workspace, stream, grid);
}

}  // namespace

namespace detail {

// Probed once per device (every workspace init asks; sequence-parallel runs hold one a device).
bool wide_kernel_built() {
  static std::mutex mutex;
  static std::map<int, bool> known;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, fresh] = known.try_emplace(device, false);
  if (!fresh) return it->second;
  int* flag = nullptr;
  if (cudaMalloc(&flag, sizeof(int)) != cudaSuccess) {
    known.erase(it);  // not known: a later init probes again
    return false;
  }
  int built = 0;
  wide_probe<<<1, 1>>>(flag);
  const bool ran = cudaGetLastError() == cudaSuccess &&
                   cudaMemcpy(&built, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(flag);
  if (!ran) {
    known.erase(it);
    return false;
  }
  it->second = built == 1;
  return it->second;
}

Status enqueue_token_table_fill(const void* device_plan, const int32_t* header, void* table,
                                int32_t table_stride, int32_t num_items, cudaStream_t stream) {
  if (num_items <= 0) return Status::Ok();
  PlanHeaderArg h;
  for (int i = 0; i < kHeaderWords; ++i) h.w[i] = header[i];
  fill_token_table<<<num_items, kThreads, 0, stream>>>(h, static_cast<const int32_t*>(device_plan),
                                                       table_stride, static_cast<int32_t*>(table));
  return cuda_status("token table fill launch");
}

}  // namespace detail

namespace {

// Whether the tail kernel can take the workspace's last upload at all: a plan that runs in
// stage 1 (not the decode kernel) with a token table and paired items past the first.
bool pairs_past_first(const TreeAttentionWorkspace& workspace, int32_t num_kv_heads) {
  const int32_t begin = workspace.paired_items_begin();
  return !workspace.runs_decode_kernel() && workspace.uses_token_table() && begin >= 1 &&
         begin < workspace.num_items() && num_kv_heads >= 1;
}

TreeAttentionAutoKernels auto_kernels(const TreeAttentionWorkspace& workspace,
                                      int32_t num_kv_heads) {
  return tree_attention_auto_kernels(workspace.num_items(), workspace.paired_items_begin(),
                                     workspace.wide_pairs(), workspace.max_item_tokens(),
                                     num_kv_heads, workspace.num_sms());
}

}  // namespace

bool tree_attention_runs_wide(const TreeAttentionWorkspace& workspace, int32_t num_kv_heads,
                              int32_t head_dim) {
  const TreeAttentionLimits::Wide mode = workspace.limits().wide_kernel;
  if (mode == TreeAttentionLimits::Wide::kOff || head_dim != 128 || workspace.wide_pairs() == 0 ||
      !workspace.wide_kernel_built() || workspace.runs_decode_kernel()) {
    return false;
  }
  if (mode == TreeAttentionLimits::Wide::kAlways) return true;
  // kAuto: not where stage 1 would run items after it (a chunk's odd query tile), a launch of
  // its own after the wide kernel's, which makes such plans slower than running unpaired in
  // stage 1 alone: the counts' rule asks for pairs covering the items before the paired ones,
  // or all of them.
  return workspace.uses_token_table() && auto_kernels(workspace, num_kv_heads).wide;
}

bool tree_attention_runs_tail(const TreeAttentionWorkspace& workspace, int32_t num_kv_heads) {
  const TreeAttentionLimits::Tail mode = workspace.limits().tail_kernel;
  if (mode == TreeAttentionLimits::Tail::kOff || !pairs_past_first(workspace, num_kv_heads)) {
    return false;
  }
  return mode == TreeAttentionLimits::Tail::kAlways || auto_kernels(workspace, num_kv_heads).tail;
}

Status launch_tree_attention(const void* q, const void* k_pool, const void* v_pool, void* out,
                             TreeAttentionDtype dtype, int32_t num_q_heads, int32_t num_kv_heads,
                             int32_t head_dim, int32_t page_size, float sm_scale,
                             const TreeAttentionWorkspace& workspace, cudaStream_t stream,
                             TreeAttentionGrid grid, TreeAttentionKvScales fp8_kv) {
  Stage1Params params;
  TS_RETURN_IF_ERROR(prepare_launch(q, k_pool, v_pool, num_q_heads, num_kv_heads, head_dim,
                                    page_size, sm_scale, workspace, grid, fp8_kv, &params));
  if (out == nullptr) return InvalidArgument("launch_tree_attention: null tensor pointer");
  MergeTarget target;
  target.out = out;
  return dispatch(params, target, dtype, head_dim, workspace, stream, grid);
}

Status launch_tree_attention_state(const void* q, const void* k_pool, const void* v_pool,
                                   float* state_o, float* state_lse, TreeAttentionDtype dtype,
                                   int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                                   int32_t page_size, float sm_scale,
                                   const TreeAttentionWorkspace& workspace, cudaStream_t stream,
                                   TreeAttentionGrid grid, TreeAttentionKvScales fp8_kv) {
  Stage1Params params;
  TS_RETURN_IF_ERROR(prepare_launch(q, k_pool, v_pool, num_q_heads, num_kv_heads, head_dim,
                                    page_size, sm_scale, workspace, grid, fp8_kv, &params));
  if (state_o == nullptr || state_lse == nullptr) {
    return InvalidArgument("launch_tree_attention_state: null state pointer");
  }
  MergeTarget target;
  target.state_o = state_o;
  target.state_lse = state_lse;
  return dispatch(params, target, dtype, head_dim, workspace, stream, grid);
}

}  // namespace treeserve
