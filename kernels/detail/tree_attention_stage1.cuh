// Stage 1 of the tree-attention kernel (kernels/tree_attention.cu; device code, one
// includer): its launch parameters, block shape and pipeline constants, the token resolution,
// and attend(): the main loops (wgmma on sm_90a for whole 64-row tiles, mma.sync with a token
// split for one-slab items) and the partials' epilogue. The kernel itself, the merge and the
// launchers stay in the .cu; the file comment there describes the whole scheme.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/detail/tree_attention_launch.h"
#include "kernels/detail/tree_attention_layout.h"
#include "kernels/detail/tree_attention_mma.cuh"
#include "kernels/tree_attention.h"

namespace treeserve::detail::ta {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = kTreeAttentionTileRows;  // 16 rows per warp
// 64-token tiles, double-buffered: 2 blocks (8 warps) per SM at ~90 KB of shared memory
// (head_dim 128, no spills). For the tree plans they run as fast as 32-token tiles 4 deep, and
// faster for decode-shaped items (the 4-way token split needs 64-token tiles); 32-token tiles
// 3 deep at 3 blocks per SM (168 registers) are slower. wgmma's scores tile (m64n64) and swz()
// assume 64.
constexpr int kKvTile = 64;  // tokens per K/V tile
// Two stages at 2 blocks per SM rather than 3, 4 or 6 stages at 1 block per SM: a block is
// mostly ramp (plan, table, first tiles) and two blocks interleave theirs. A third stage at 2
// blocks per SM (Q held in registers, its buffer the third stage) gains nothing on long
// prompts and slows small trees.
constexpr int kStages = 2;  // K/V tiles resident (kStages - 1 in flight)
constexpr int kMinBlocksPerSm = kTreeAttentionStage1BlocksPerSm;
// Kv heads a block runs a paired (decode-shaped) item for (AttentionPlan::pair_heads).
constexpr int kPairHeads = kTreeAttentionPairHeads;
static_assert(kKvTile / kPairHeads == 16 && kWarps == kPairHeads,
              "a paired block: one warp a head, 16-token tiles of each");
constexpr int kSegBatch = kThreads;  // segments resolved per pass
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kTileRows == 16 * kWarps, "one 16-row MMA slab per warp");
static_assert(kTileRows == 64 && kKvTile == 64, "swizzled tiles (swz) have 64 rows");

// The plan header (counts and array offsets), by value or read from the device buffer.
struct PlanHeaderArg {
  int32_t w[kHeaderWords];
};
static_assert(kHeaderWords == TreeAttentionWorkspace::kPlanHeaderWords, "header size");

__device__ __forceinline__ PlanHeaderArg load_header(const PlanHeaderArg& arg, const int32_t* plan,
                                                     bool on_device) {
  if (!on_device) return arg;
  PlanHeaderArg h;
#pragma unroll
  for (int i = 0; i < kHeaderWords; ++i) h.w[i] = plan[i];
  return h;
}

struct Stage1Params {
  PlanHeaderArg header;
  int32_t header_on_device;  // TreeAttentionGrid launches: read the header from plan
  const int32_t* plan;
  const void* q;  // [rows][num_q_heads][D]
  const void* k;  // [pages][num_kv_heads][page_size][D], T or e4m3 (k_scale set)
  const void* v;
  // An e4m3 pool's scales, one float a (page, kv head, slot) row (kernels/kv_layout.h); null
  // for a T pool. The kernels instantiated for e4m3 (kFp8Kv) read them.
  const float* k_scale;
  const float* v_scale;
  const int32_t* token_table;  // the workspace's (used when the header's kTokenTable is set)
  float* partial_o;            // [partials][num_q_heads][D]
  float* partial_lse;          // [partials][num_q_heads]
  int32_t num_q_heads;
  int32_t num_kv_heads;
  float scale_log2;  // sm_scale * log2(e)
  // Known to the launcher, so no block waits for the header to learn them: the plan's GQA
  // group (num_q_heads / num_kv_heads) and page size (checked against the upload's), its
  // launch-order hint (a graph replays its capture's: any order covers every block), the
  // records the plan buffer holds, and the fixed-stride table's stride and item capacity.
  int32_t gqa;
  int32_t page_size;
  int32_t heads_first;
  int32_t max_items;
  int32_t table_stride;
  int32_t table_items;
  // Head pairing (a plan that pairs): the items from pair_begin on (all decode-shaped) run
  // kPairHeads kv heads a block, in the grid's blocks past pair_begin * num_kv_heads. -1: none;
  // kPairFromHeader: the header's kPairedBegin says (TreeAttentionGrid::paired launches).
  int32_t pair_begin;
  // Trigger the next grid once the block's first copies are out (after its wait for the
  // previous kernel) instead of at its end: set where the next grid is the tail kernel
  // (tree_attention_tail), which then runs beside stage 1's blocks.
  int32_t early_trigger;
  // Eager launches without head pairing: the grid's blocks run the items from item_offset on
  // (the wide kernel ran the ones before). kWideFromHeader (with kTailFromHeader): from 2 x the
  // header's kWidePairs on (TreeAttentionGrid::wide launches). 0 elsewhere.
  int32_t item_offset;
  TreeAttentionBlockTrace* trace;  // null unless the workspace's block trace is enabled
};

// An e4m3 pool's row scales in shared memory: a float per tile row, K's kStages tiles then V's.
constexpr int kFp8ScaleBytes = 2 * kStages * kKvTile * 4;

template <int D, bool kFp8Kv = false>
constexpr int stage1_smem_bytes_fixed() {
  // Q tile, kStages K and V tiles, segment scratch (start, first slot, page, warp sums x2),
  // 1 KB to align the tiles, an e4m3 pool's scales; the token table (4 bytes a token) comes on
  // top.
  return (kTileRows + 2 * kStages * kKvTile) * D * 2 + (3 * kSegBatch + 2 * kWarps) * 4 + 1024 +
         (kFp8Kv ? kFp8ScaleBytes : 0);
}

// Eight e4m3 values times scale, as T: what a T pool holding float(e4m3) * scale rounded to T
// reads. The KV rule's scales are powers of two (models/fp8.h fp8_kv_scale), so for fp16 the
// exact e4m3 -> fp16 conversion and one packed fp16 multiply by the scale round the exact
// product once, as that float32 product rounded to fp16 does; a scale below fp16's range (a row
// whose values are all below ~1.3e-5) takes the float32 path, as bf16 does.
template <typename T>
__device__ __forceinline__ uint4 dequant_e4m3x8(uint2 bits, float scale) {
  const uint32_t w[2] = {bits.x, bits.y};
  uint32_t out[4];
  if constexpr (std::is_same_v<T, __half>) {
    const __half hs = __float2half_rn(scale);
    if (__half2float(hs) == scale) {
      const __half2 s2 = __half2half2(hs);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __nv_fp8x2_storage_t pair = __nv_fp8x2_storage_t(w[i / 2] >> (16 * (i % 2)));
        const __half2 h = __hmul2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)), s2);
        out[i] = *reinterpret_cast<const uint32_t*>(&h);
      }
      return make_uint4(out[0], out[1], out[2], out[3]);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8x2_storage_t pair = __nv_fp8x2_storage_t(w[i / 2] >> (16 * (i % 2)));
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
    if constexpr (std::is_same_v<T, __half>) {
      const __half2 h = __floats2half2_rn(f.x * scale, f.y * scale);
      out[i] = *reinterpret_cast<const uint32_t*>(&h);
    } else {
      const __nv_bfloat162 h = __floats2bfloat162_rn(f.x * scale, f.y * scale);
      out[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Where a stage's e4m3 tile waits for convert_fp8_tiles: the upper half of its T tile.
template <int D, typename T>
__device__ __forceinline__ unsigned char* fp8_staging(T* tile) {
  return reinterpret_cast<unsigned char*>(tile) + kKvTile * D;
}

// A thread's share of copying one token's K row (with_k) and V row (with_v) into tile row r
// of dk and dv: its 4 16-byte chunks (the row's D / 32 threads are adjacent lanes, so each copy
// instruction reads whole 32-byte sectors) from pool element offset `row`; zero-filled where
// !valid.
// kFp8: the pools hold e4m3 (a byte a value) and a float32 scale a row (k_scale, v_scale at
// row / D). The row's D bytes go to the upper half of its stage's T tile (row r at byte
// kKvTile * D + r * D: fp8_staging), its scale to dks[r] / dvs[r], all by cp.async in the same
// commit groups; convert_fp8_tiles expands a landed tile in place before it is read.
template <int D, typename T, bool kFp8 = false>
__device__ __forceinline__ void copy_kv_row(T* dk, T* dv, float* dks, float* dvs, int r,
                                            int64_t row, bool valid, const void* k_pool,
                                            const void* v_pool, const float* k_scale,
                                            const float* v_scale, bool with_k = true,
                                            bool with_v = true) {
  constexpr int kTpr = D / 32;  // threads per token row
  if constexpr (kFp8) {
    const uint8_t* k8 = static_cast<const uint8_t*>(k_pool);
    const uint8_t* v8 = static_cast<const uint8_t*>(v_pool);
    static_assert(D / 16 == 2 * kTpr, "two 16-byte e4m3 chunks a thread");
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int c = threadIdx.x % kTpr + kTpr * j;
      const int64_t off = valid ? row + c * 16 : 0;
      if (with_k) cp_async_16(smem_u32(fp8_staging<D>(dk) + r * D + c * 16), k8 + off, valid);
      if (with_v) cp_async_16(smem_u32(fp8_staging<D>(dv) + r * D + c * 16), v8 + off, valid);
    }
    if (threadIdx.x % kTpr == 0) {
      const int64_t at = valid ? row / D : 0;
      if (with_k) cp_async_4(smem_u32(dks + r), k_scale + at, valid);
      if (with_v) cp_async_4(smem_u32(dvs + r), v_scale + at, valid);
    }
  } else {
    const T* kp = static_cast<const T*>(k_pool);
    const T* vp = static_cast<const T*>(v_pool);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = threadIdx.x % kTpr + kTpr * j;
      const int64_t off = valid ? row + c * 8 : 0;
      if (with_k) cp_async_16(smem_u32(dk + swz<D>(r, c)), kp + off, valid);
      if (with_v) cp_async_16(smem_u32(dv + swz<D>(r, c)), vp + off, valid);
    }
  }
}

// Expands the landed e4m3 tiles of K stage k_stage and V stage v_stage (-1: none) in place into
// their T tiles (swizzled as the 16-bit pool's copies lay them out), each value times its row's
// scale (dequant_e4m3x8). For each tile every thread first reads its chunks of the staging half,
// then (after a barrier: the T rows overwrite staging bytes) writes them expanded; one tile at a
// time, so that the main loop's live accumulators and the chunks fit the registers. A proxy
// fence and a barrier make them visible to wgmma and ldmatrix. All threads of the block call it.
template <int D, typename T>
__device__ __forceinline__ void convert_fp8_tiles(T* s_k, T* s_v, const float* s_ks,
                                                  const float* s_vs, int k_stage, int v_stage) {
  constexpr int kChunks8 = D / 16;                     // 16-byte e4m3 chunks a row
  constexpr int kPer = kKvTile * kChunks8 / kThreads;  // a thread's chunks a tile
  static_assert(kKvTile * kChunks8 % kThreads == 0, "whole chunks a thread");
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    const int stage = which == 0 ? k_stage : v_stage;
    if (stage < 0) continue;
    T* tile = (which == 0 ? s_k : s_v) + stage * kKvTile * D;
    const float* scale = (which == 0 ? s_ks : s_vs) + stage * kKvTile;
    uint4 x[kPer];
    float sc[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = threadIdx.x + i * kThreads, r = idx / kChunks8, c = idx % kChunks8;
      x[i] = *reinterpret_cast<const uint4*>(fp8_staging<D>(tile) + r * D + c * 16);
      sc[i] = scale[r];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int idx = threadIdx.x + i * kThreads, r = idx / kChunks8, c = idx % kChunks8;
      *reinterpret_cast<uint4*>(tile + swz<D>(r, 2 * c)) =
          dequant_e4m3x8<T>(make_uint2(x[i].x, x[i].y), sc[i]);
      *reinterpret_cast<uint4*>(tile + swz<D>(r, 2 * c + 1)) =
          dequant_e4m3x8<T>(make_uint2(x[i].z, x[i].w), sc[i]);
    }
  }
  fence_proxy_async_smem();
  __syncthreads();
}

// Calls emit(t, physical page, slot in page) for every token t of segments
// [seg_begin, seg_end) (an item's tokens, in order), spread over the block's threads; the
// scratch arrays hold kSegBatch segments. Returns the item's token count; every emit is done
// (and the scratch free) when it returns.
template <typename Emit>
__device__ int resolve_tokens(const int32_t* plan, const PlanHeaderArg& h, int seg_begin,
                              int seg_end, int page_size, int32_t* seg_start, int32_t* seg_slot,
                              int32_t* seg_page, int32_t* warp_sums, Emit&& emit) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int32_t* seg_page_begin = plan + h.w[kSegPageBegin];
  const int32_t* seg_first_slot = plan + h.w[kSegFirstSlot];
  const int32_t* seg_num_tokens = plan + h.w[kSegNumTokens];
  const int32_t* page_table = plan + h.w[kPageTable];
  int pos = 0;
  for (int base = seg_begin; base < seg_end; base += kSegBatch) {
    const int count = min(kSegBatch, seg_end - base);
    int len = 0, slot = 0, page = 0;
    if (tid < count) {
      len = seg_num_tokens[base + tid];
      slot = seg_first_slot[base + tid];
      page = seg_page_begin[base + tid];
    }
    int incl = len;  // block-wide inclusive scan of the segment lengths
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += x;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int before = 0, total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      before += w < warp ? warp_sums[w] : 0;
      total += warp_sums[w];
    }
    if (tid < count) {
      seg_start[tid] = pos + before + incl - len;
      seg_slot[tid] = slot;
      seg_page[tid] = page;
    }
    __syncthreads();
#pragma unroll 4
    for (int t = pos + tid; t < pos + total; t += kThreads) {
      int lo = 0, hi = count - 1;  // last segment starting at or before t
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (seg_start[mid] <= t) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      const int s = seg_slot[lo] + (t - seg_start[lo]);
      emit(t, page_table[seg_page[lo] + s / page_size], s % page_size);
    }
    pos += total;
    __syncthreads();  // scratch reused by the next pass; tok complete for the caller
  }
  return pos;
}

// Row of a token table entry ((page << 8) | slot, detail/tree_attention_layout.h) in the K (or
// V) pool viewed as [rows][head_dim], for the kv head whose rows start head_row rows into each
// page (rows_per_page: num_kv_heads * page_size); int32 rows: a pool of 2^31 rows is 512 GB of
// fp16 at head_dim 128, far beyond one layer.
__device__ __forceinline__ int32_t table_pool_row(int32_t e, int rows_per_page, int head_row) {
  return (e >> 8) * rows_per_page + head_row + (e & 0xff);
}

// What the main loop needs about its block's item.
struct ItemTile {
  int num_rows;     // valid rows of the query tile
  int num_tokens;   // tokens of the item
  int num_tiles;    // K/V tiles
  int query_begin;  // first partial slot
  int kv_head;
  int gqa;
  int mask_offset;  // -1: no mask
  int words_per_row;
  int visible_tokens;           // leading tokens every query of the item sees (kRecVisibleTokens)
  const int32_t* partial_slot;  // where partial (query_begin + local query) is stored
};

// The block's work item (index of its record) and kv head in the one-dimensional grid of
// items x kv heads (TreeAttentionGrid launches: grid.items items), in the order the plan asks
// for (AttentionPlan::heads_first).
// *pair_begin: the first paired item (-1: none). Where it comes from the header, the blocks
// past the paired items' get an item past the plan's (they exit).
constexpr int32_t kPairFromHeader = -2;
// TreeAttentionGrid::tail launches: stage 1 runs the items before the header's kPairedBegin
// (the tail kernel runs the rest), or every item where the upload has no token table, in the
// grid's last blocks; the blocks before them exit at once (dispatched first, so they are gone
// before the wide blocks take the SMs).
constexpr int32_t kTailFromHeader = -3;
// Stage1Params::item_offset of TreeAttentionGrid::wide launches (pair_begin kTailFromHeader):
// stage 1 runs the items from the header's wide pairs to its paired items.
constexpr int32_t kWideFromHeader = -1;
__device__ __forceinline__ void block_item(const Stage1Params& p, int* item, int* kv_head,
                                           int* pair_begin) {
  int pb = p.pair_begin, num_items = p.header.w[kNumItems];
  if (pb == kTailFromHeader) {
    const int tail_begin = __ldg(p.plan + kPairedBegin);
    const bool table = __ldg(p.plan + kTokenTable) != kTableNone;
    num_items = __ldg(p.plan + kNumItems);
    *pair_begin = -1;
    const int first = p.item_offset == kWideFromHeader ? 2 * __ldg(p.plan + kWidePairs) : 0;
    const int run = (table && tail_begin >= 0 ? tail_begin : num_items) - first;
    const int b = int(blockIdx.x) - (int(gridDim.x) - run * p.num_kv_heads);
    *item = b < 0 ? num_items : first + (p.heads_first ? b / p.num_kv_heads : b % run);
    *kv_head = b < 0 ? 0 : (p.heads_first ? b % p.num_kv_heads : b / run);
    return;
  }
  if (pb == kPairFromHeader) {
    pb = __ldg(p.plan + kPairedBegin);
    num_items = __ldg(p.plan + kNumItems);
  }
  *pair_begin = pb;
  if (pb >= 0) {
    const int wide_blocks = pb * p.num_kv_heads;
    if (int(blockIdx.x) >= wide_blocks) {
      const int b = blockIdx.x - wide_blocks, per = p.num_kv_heads / kPairHeads;
      const int n = max(1, num_items - pb);
      *item = b >= n * per ? num_items : pb + (p.heads_first ? b / per : b % n);
      *kv_head = (p.heads_first ? b % per : b / n) * kPairHeads;
      return;
    }
    *item = p.heads_first ? blockIdx.x / p.num_kv_heads : blockIdx.x % pb;
    *kv_head = p.heads_first ? blockIdx.x % p.num_kv_heads : blockIdx.x / pb;
    return;
  }
  const int grid_items = gridDim.x / p.num_kv_heads;
  *item =
      p.item_offset + int(p.heads_first ? blockIdx.x / p.num_kv_heads : blockIdx.x % grid_items);
  *kv_head = p.heads_first ? blockIdx.x % p.num_kv_heads : blockIdx.x / grid_items;
}

// The item's counts from the first eight words of its record (rec_a: kRecQueryBegin ..
// kRecMaskOffset, rec_b: kRecTableBegin .. kRecVisibleTokens) and the header: everything of
// `it` but kv_head and gqa.
__device__ __forceinline__ void read_item_tile(ItemTile& it, const int4& rec_a, const int4& rec_b,
                                               const int32_t* plan, const PlanHeaderArg& h) {
  it.query_begin = rec_a.x;
  it.num_rows = (rec_a.y - rec_a.x) * it.gqa;
  it.num_tokens = rec_a.z;
  it.num_tiles = (it.num_tokens + kKvTile - 1) / kKvTile;
  it.mask_offset = rec_a.w;
  it.words_per_row = (it.num_tokens + 31) >> 5;
  it.visible_tokens = rec_b.w;
  it.partial_slot = plan + h.w[kPartialSlot];
}

// Where query-tile row `row` of the item (local query row / gqa, whose batch row is
// batch_row; q head (kv_head + head_off) * gqa + row % gqa) starts in Stage1Params::q; null
// for a pad row. head_off: a paired block's slab (its kv head past it.kv_head).
template <int D, typename T>
__device__ __forceinline__ const T* q_row_source(const Stage1Params& p, const ItemTile& it, int row,
                                                 int32_t batch_row, int head_off = 0) {
  if (row >= it.num_rows) return nullptr;
  const int head = (it.kv_head + head_off) * it.gqa + row % it.gqa;
  return static_cast<const T*>(p.q) + (int64_t(batch_row) * p.num_q_heads + head) * D;
}

// The block trace record of (item, kv_head) (TreeAttentionWorkspace::enable_block_trace),
// written by one thread once the partials are: from start_ns to now, on this SM.
__device__ __forceinline__ void write_trace(const Stage1Params& p, uint64_t start_ns, int item,
                                            int kv_head, int rows, int tokens) {
  TreeAttentionBlockTrace r;
  r.start_ns = start_ns;
  r.end_ns = global_ns();
  asm volatile("mov.u32 %0, %smid;" : "=r"(r.sm));
  r.block = blockIdx.x;
  r.item = item;
  r.kv_head = kv_head;
  r.rows = rows;
  r.tokens = tokens;
  p.trace[int64_t(item) * p.num_kv_heads + kv_head] = r;
}

// Thread 0's block trace record, once the block's partials are written.
__device__ __forceinline__ void record_block_trace(const Stage1Params& p, uint64_t start_ns,
                                                   int item, const ItemTile& it) {
  if (p.trace == nullptr || threadIdx.x != 0) return;
  write_trace(p, start_ns, item, it.kv_head, it.num_rows, it.num_tokens);
}

// Lazy rescaling (FlashAttention-4's), in softmax_tile and the tail units: a row's running
// max moves only where a score passes it by more than this (base 2), so once the first tiles
// set it O is seldom rescaled (at random scores, as the bench's, eager rescaling would rescale
// most steps); probabilities stay below 2^8, which fp16 / bf16 P and the fp32 sums hold
// exactly as well.
constexpr float kRescaleSlack = 8.f;

// One row's lazy-rescaling step: cand is the row's max over a tile's scores (scaled, base 2).
// Moves row_max only where cand passes it by more than the slack, sets alpha to the factor the
// row's O and sum must be scaled by, and returns the exponent base for the tile's probabilities
// (0 while every score so far was masked).
__device__ __forceinline__ float lazy_max_update(float cand, float& row_max, float& alpha) {
  const bool moves = cand > row_max + kRescaleSlack;
  const float new_max = moves ? cand : row_max;
  const float base = new_max == -INFINITY ? 0.f : new_max;
  alpha = moves ? fast_exp2(row_max - base) : 1.f;
  row_max = new_max;
  return base;
}

// Online-softmax step of one tile for this thread's rows r0 and r0 + 8: s holds the raw
// Q K^T scores of its kN n-tiles (tokens tile_begin + tok0 + 8 j + 2 (lane % 4) + {0, 1});
// invisible tokens (past the item's end, or masked) are dropped, s becomes the probabilities
// against the rows' new running max (base 2), row_max and row_sum are updated, and alpha gets
// the factor the rows' O accumulators must be scaled by (rescale_o). kTileTok: the tokens of
// a tile (of one kv head's, where a block runs several).
template <int kN, int kTileTok = kKvTile>
__device__ __forceinline__ void softmax_tile(float (&s)[kN][4], const ItemTile& it, int tile_begin,
                                             int tok0, const uint32_t* const (&row_mask)[2],
                                             float scale_log2, float (&row_max)[2],
                                             float (&row_sum)[2], float (&alpha)[2]) {
  const int lane = threadIdx.x & 31;
  // Whole tiles that every query of the item sees (all of an unmasked item's full tiles, a
  // masked one's before its first invisible token: the bulk of long chunks) skip the per-score
  // visibility test, which costs more issue slots than the max it feeds, and its mask-word
  // loads (block-uniform branch). (Written so, rather than as the one comparison with
  // visible_tokens it amounts to, stage 1 takes 202 registers instead of 222-238: ptxas.)
  const bool all_visible = (it.mask_offset < 0 || tile_begin + kTileTok <= it.visible_tokens) &&
                           it.num_tokens - tile_begin >= kTileTok;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!all_visible) {
      uint64_t visible = ~uint64_t(0);  // bit c: token tile_begin + c is visible
      const int remaining = it.num_tokens - tile_begin;
      if (remaining < 64) visible = (uint64_t(1) << remaining) - 1;
      if (row_mask[i] != nullptr) {
        // A tile of more than 32 tokens starts on a mask-word boundary; a smaller one lies
        // inside one word.
        const int w = tile_begin >> 5;
        uint64_t bits = row_mask[i][w];
        if (kTileTok > 32 && w + 1 < it.words_per_row) bits |= uint64_t(row_mask[i][w + 1]) << 32;
        visible &= bits >> (tile_begin & 31);
      }
      visible >>= tok0;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = 8 * j + 2 * (lane & 3) + e;
          if (!((visible >> c) & 1)) s[j][2 * i + e] = -INFINITY;
        }
      }
    }
    // Raw scores here; the scale (> 0) is folded into the exponent below.
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kN; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float base = lazy_max_update(mx * scale_log2, row_max[i], alpha[i]);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pr = fast_exp2(fmaf(s[j][2 * i + e], scale_log2, -base));
        s[j][2 * i + e] = pr;
        sum += pr;
      }
    }
    row_sum[i] = row_sum[i] * alpha[i] + sum;  // per-thread share; quad-reduced at the end
  }
}

// O *= alpha per row. It costs D / 4 multiplies per row pair: skipped (warp-uniformly) once
// the row maxima have settled, which after the first tiles is the common case.
template <int D>
__device__ __forceinline__ void rescale_o(float (&o_acc)[D / 8][4], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (__any_sync(0xffffffffu, alpha[i] != 1.f)) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o_acc[j][2 * i] *= alpha[i];
        o_acc[j][2 * i + 1] *= alpha[i];
      }
    }
  }
}

// The wgmma main loop (sm_90a; whole 64-row tiles, the block's 4 warps one warpgroup),
// software-pipelined as FlashAttention-3's intra-warpgroup overlap: step t issues
// S_{t+1} = Q K_{t+1}^T and O += P_t V_t together and runs tile t + 1's softmax while P_t V_t
// is on the tensor cores, then rescales O. K and V stream in separately, kStages (2) buffers
// each: at the top of step t, K_{t+2} and V_{t+1} go out into the buffers of K_t (read by
// S_t, done) and V_{t-1} (read by P_{t-1} V_{t-1}, done), while K_{t+1} and V_t, sent one step
// earlier, are waited for. The caller has committed the group {Q, K_0, V_0}. Scores: D / 16
// k-steps of 16 head dims (32 bytes inside a 128-byte swizzled row; steps 4-7 in the second
// column half); P V: k-steps of 16 tokens (2048 bytes of V rows), V MN-major (head dims
// contiguous), its two 64-column halves kSwzHalfBytes apart. The pipelined loop is faster than
// an unpipelined one (S, softmax, P V per tile) on plans with wide items, and no slower on the
// others.
// The partial of the item's row r (kv head `head`) from this thread's accumulator row i of
// o_acc (columns 8 j + 2 (lane % 4) + {0, 1}), normalised by the row's summed softmax
// denominator sum; LSE (base 2) by the row's quad leader. A row that saw nothing gets O = 0,
// LSE = -inf. Stage 1's unsplit epilogue and the wide kernel's consumers.
template <int D>
__device__ __forceinline__ void write_partial_row(const Stage1Params& p, const ItemTile& it, int r,
                                                  int head, const float (&o_acc)[D / 8][4], int i,
                                                  float sum, float row_max) {
  const int lane = threadIdx.x & 31;
  const int64_t out_row = int64_t(it.partial_slot[it.query_begin + r / it.gqa]) * p.num_q_heads +
                          head * it.gqa + r % it.gqa;
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  float* dst = p.partial_o + out_row * D + 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    *reinterpret_cast<float2*>(dst + 8 * j) =
        make_float2(o_acc[j][2 * i] * inv, o_acc[j][2 * i + 1] * inv);
  }
  if ((lane & 3) == 0) p.partial_lse[out_row] = sum > 0.f ? row_max + log2f(sum) : -INFINITY;
}

// The products of one pipelined step, once K_{t+1} and V_t are in shared memory (swizzled
// tiles at shared addresses): S_{t+1} = Q K_{t+1}^T (into s) and O += P_t V_t (P_t in cur)
// issued together, with no branch between a wgmma's issue and its wait, so ptxas sees which
// group each wait retires and keeps the two products in flight; the softmax of S_{t+1} (its
// tokens from tile_begin) packed into nxt under P_t V_t; then O complete. alpha gets the
// factor O must be rescaled by (rescale_o), which the caller applies (after freeing V_t's
// buffer, where it shares one). Stage 1's loop and the wide kernel's consumers.
template <int D, typename T>
__device__ __forceinline__ void wgmma_step(float (&s)[8][4], float (&o_acc)[D / 8][4],
                                           uint32_t q_tile, uint32_t k_next, uint32_t v_cur,
                                           const uint32_t (&cur)[kKvTile / 16][4],
                                           uint32_t (&nxt)[kKvTile / 16][4], const ItemTile& it,
                                           int tile_begin, const uint32_t* const (&row_mask)[2],
                                           float scale_log2, float (&row_max)[2],
                                           float (&row_sum)[2], float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  wgmma_fence();
  wgmma_scores<D, T>(s, q_tile, k_next);
  wgmma_pv<D, T>(o_acc, cur, v_cur);
  wgmma_wait<1>();  // S_{t+1}; P_t V_t may still run
  fence_regs(s);
  softmax_tile(s, it, tile_begin, 0, row_mask, scale_log2, row_max, row_sum, alpha);
#pragma unroll
  for (int kk = 0; kk < kKvTile / 16; ++kk) pack_p<T>(s, kk, nxt[kk]);
  wgmma_wait<0>();
  fence_regs(o_acc);
}

// convert(k_stage, v_stage): runs on every tile once it has landed, before it is read
// (convert_fp8_tiles for an e4m3 pool; nothing for a T pool). Every thread calls it.
template <int D, typename T, typename LoadTile, typename Convert>
__device__ __forceinline__ void wgmma_main_loop(const Stage1Params& p, const ItemTile& it,
                                                const uint32_t* const (&row_mask)[2], const T* s_q,
                                                T* s_k, T* s_v, LoadTile&& load_tile,
                                                Convert&& convert, float (&o_acc)[D / 8][4],
                                                float (&row_max)[2], float (&row_sum)[2]) {
  static_assert(kStages == 2, "K_{t+2} reuses K_t's buffer, V_{t+1} V_{t-1}'s");
  const int n = it.num_tiles;
  if (n == 0) return;
  static_assert(kKvTile / 16 == 4, "wgmma_pv: 4 k-steps of 16 tokens");
  auto issue_scores = [&](float(&s)[8][4], int tile) {
    wgmma_scores<D, T>(s, smem_u32(s_q), smem_u32(s_k + (tile % kStages) * kKvTile * D));
  };
  auto issue_pv = [&](const uint32_t(&pa)[kKvTile / 16][4], int tile) {
    wgmma_pv<D, T>(o_acc, pa, smem_u32(s_v + (tile % kStages) * kKvTile * D));
  };
  auto zero_scores = [](float(&s)[8][4]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
  };
  float s[8][4];
  // P of two consecutive tiles: P_t is the A operand of the product in flight while P_{t+1}
  // is packed, so the steps alternate the two buffers (a copy would let ptxas coalesce them
  // and serialise the products).
  uint32_t pa0[kKvTile / 16][4], pa1[kKvTile / 16][4];
  if (n > 1) load_tile(1, 1, true, false);
  cp_async_commit();
  cp_async_wait<1>();        // Q, K_0, V_0
  fence_proxy_async_smem();  // cp.async data -> wgmma's reads
  __syncthreads();
  convert(0, -1);  // K_0 (V_0 with the first step's, or the last's)
  {
    zero_scores(s);
    wgmma_fence();
    issue_scores(s, 0);
    wgmma_wait<0>();
    fence_regs(s);
    float alpha[2];  // O is still zero: nothing to rescale
    softmax_tile(s, it, 0, 0, row_mask, p.scale_log2, row_max, row_sum, alpha);
#pragma unroll
    for (int kk = 0; kk < kKvTile / 16; ++kk) pack_p<T>(s, kk, pa0[kk]);
  }
  // Step t < n - 1 (P_t in cur).
  auto step = [&](int t, const uint32_t(&cur)[kKvTile / 16][4], uint32_t(&nxt)[kKvTile / 16][4]) {
    __syncthreads();  // every warp is done with K_t and V_{t-1}: their buffers refill
    if (t + 2 < n) load_tile(t + 2, t % kStages, true, false);
    load_tile(t + 1, (t + 1) % kStages, false, true);
    cp_async_commit();
    cp_async_wait<1>();  // K_{t+1} and V_t (this thread's copies)
    fence_proxy_async_smem();
    __syncthreads();
    convert((t + 1) % kStages, t % kStages);
    float alpha[2];
    wgmma_step<D, T>(s, o_acc, smem_u32(s_q), smem_u32(s_k + ((t + 1) % kStages) * kKvTile * D),
                     smem_u32(s_v + (t % kStages) * kKvTile * D), cur, nxt, it, (t + 1) * kKvTile,
                     row_mask, p.scale_log2, row_max, row_sum, alpha);
    rescale_o<D>(o_acc, alpha);
  };
  // The last tile's P V (its V came with the previous step's group, or with Q).
  auto last = [&](const uint32_t(&cur)[kKvTile / 16][4]) {
    cp_async_wait<0>();
    fence_proxy_async_smem();
    __syncthreads();
    convert(-1, (n - 1) % kStages);
    wgmma_fence();
    issue_pv(cur, n - 1);
    wgmma_wait<0>();
    fence_regs(o_acc);
  };
  run_tile_steps(n, pa0, pa1, step, last);
}

// Main loop and epilogue of stage 1. kSplit warps share each 16-row slab and split every
// 64-token tile between them (kKvTile / kSplit tokens each), so an item with few rows (a
// decode branch: gqa rows) still spreads its MMAs over all four warps (and the SM's four
// schedulers); their softmax states are merged through shared memory at the end. kQRows: the
// rows of s_q's swizzled tile (64; 16 in the decode kernel, whose items are one slab).
// kHeads > 1: the block runs a one-slab item for kHeads kv heads at once (it.kv_head and the
// next ones), slab h holding head h's rows of the item (at most 16, so every slab has the
// item's it.num_rows) and reading tile rows [h * kKvTile / kHeads, (h + 1) * kKvTile / kHeads):
// each tile holds kKvTile / kHeads tokens of each head (load_tile lays them out so).
// convert: as wgmma_main_loop's.
template <int D, typename T, int kSplit, int kQRows = kTileRows, int kHeads = 1, typename LoadTile,
          typename Convert>
__device__ __forceinline__ void attend(const Stage1Params& p, const ItemTile& it,
                                       const uint32_t* mask_words, T* s_q, T* s_k, T* s_v,
                                       LoadTile&& load_tile, Convert&& convert) {
  constexpr int kTileTok = kKvTile / kHeads;  // tokens of a tile per kv head
  constexpr int kTok = kTileTok / kSplit;     // tokens of a tile this warp scores
  constexpr int kN = kTok / 8;                // n-tiles of S
  static_assert(kTok % 16 == 0, "P V needs 16-token k-steps");
  static_assert(kHeads == 1 || (kWarps / kSplit == kHeads && kQRows == kTileRows),
                "one slab a kv head");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slab = warp / kSplit, part = warp % kSplit;
  const int tok0 = part * kTok;  // this warp's first token inside its head's share of a tile
  const int krow0 = (kHeads > 1 ? slab * kTileTok : 0) + tok0;  // its first row of a K/V tile
  // Per thread: query-tile rows r0 = 16 * slab + lane / 4 and r0 + 8, which are the item's
  // rows lr0 and lr0 + 8 (of kv head it.kv_head + hoff); accumulator columns 2 * (lane % 4).
  const int r0 = slab * 16 + (lane >> 2);
  const int lr0 = kHeads > 1 ? (lane >> 2) : r0;
  const int hoff = kHeads > 1 ? slab : 0;
  const bool warp_active = (kHeads > 1 ? 0 : slab * 16) < it.num_rows;
  const uint32_t* row_mask[2] = {nullptr, nullptr};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = lr0 + 8 * i;
    if (it.mask_offset >= 0 && r < it.num_rows) {
      row_mask[i] = mask_words + it.mask_offset + (r / it.gqa) * it.words_per_row;
    }
  }
  float o_acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o_acc[j][0] = o_acc[j][1] = o_acc[j][2] = o_acc[j][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  // Whole 64-row tiles (one slab per warp) multiply with wgmma where the build targets sm_90a:
  // the block's 4 warps are one warpgroup, and all of them take part (pad rows are zero).
  static_assert(kQRows == kTileRows || kQRows == 16 * (kWarps / kSplit), "one slab a warp set");
  if constexpr (TS_WGMMA != 0 && kSplit == 1 && kHeads == 1) {
    wgmma_main_loop<D, T>(p, it, row_mask, s_q, s_k, s_v, load_tile, convert, o_acc, row_max,
                          row_sum);
  } else {
    for (int tile = 0; tile < it.num_tiles; ++tile) {
      // Refill the stage consumed in the previous iteration (freed by its trailing barrier).
      const int ahead = tile + kStages - 1;
      if (ahead < it.num_tiles) load_tile(ahead, ahead % kStages, true, true);
      cp_async_commit();
      cp_async_wait<kStages - 1>();
      __syncthreads();
      convert(tile % kStages, tile % kStages);
      if (warp_active) {
        const T* k_tile = s_k + (tile % kStages) * kKvTile * D;
        const T* v_tile = s_v + (tile % kStages) * kKvTile * D;
        // S = Q K^T over this warp's kTok tokens: 16 rows x kTok, kN n-tiles of 8 tokens.
        float s[kN][4];
#pragma unroll
        for (int j = 0; j < kN; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          // Q fragments are re-read from shared memory per k-step rather than held for the
          // whole item: 32 registers less (no spills at 2 blocks per SM) for 8 ldmatrix a tile.
          uint32_t qa[4];
          {
            const int r = slab * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
            ldmatrix_x4(qa, smem_u32(s_q + swz<D, kQRows>(r, 2 * kk + (lane >> 4))));
          }
#pragma unroll
          for (int jj = 0; jj < kN / 2; ++jj) {
            uint32_t b[4];
            const int r = krow0 + 16 * jj + (lane & 7) + ((lane >> 4) << 3);
            ldmatrix_x4(b, smem_u32(k_tile + swz<D>(r, 2 * kk + ((lane >> 3) & 1))));
            Dtype<T>::mma(s[2 * jj], qa, b[0], b[1]);
            Dtype<T>::mma(s[2 * jj + 1], qa, b[2], b[3]);
          }
        }
        float alpha[2];
        softmax_tile<kN, kTileTok>(s, it, tile * kTileTok, tok0, row_mask, p.scale_log2, row_max,
                                   row_sum, alpha);
        rescale_o<D>(o_acc, alpha);
        // O += P V: P's accumulator layout is the A-fragment layout of the next MMA.
#pragma unroll
        for (int kk = 0; kk < kTok / 16; ++kk) {
          uint32_t a[4];
          pack_p<T>(s, kk, a);
#pragma unroll
          for (int jd = 0; jd < D / 16; ++jd) {
            uint32_t b[4];
            const int r = krow0 + 16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3);
            ldmatrix_x4_trans(b, smem_u32(v_tile + swz<D>(r, 2 * jd + (lane >> 4))));
            Dtype<T>::mma(o_acc[2 * jd], a, b[0], b[1]);
            Dtype<T>::mma(o_acc[2 * jd + 1], a, b[2], b[3]);
          }
        }
      }
      __syncthreads();  // this stage is overwritten by the next iteration's load
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
  }
  if constexpr (kSplit == 1) {
    // Normalise and write the valid rows' partials straight from registers.
    if (!warp_active) return;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = lr0 + 8 * i;
      if (r >= it.num_rows) continue;
      write_partial_row<D>(p, it, r, it.kv_head + hoff, o_acc, i, row_sum[i], row_max[i]);
    }
  } else {
    // Each warp parks its (unnormalised O, max, sum) in the now idle K/V buffers; then the
    // block merges the kSplit states of every row and writes the partials coalesced.
    // Floats per parked row. A half-warp's float2 stores cover rows lane/4 (4 of them) x
    // column pairs lane%4: with D + 8 the rows start 4 eight-byte slots apart, so the 16
    // stores hit 16 different slot pairs (with D + 4 they conflict about 3 ways).
    constexpr int kStride = D + 8;
    static_assert(kWarps * 16 * (kStride + 2) * 4 <= 2 * kStages * kKvTile * D * 2,
                  "the parked states fit in the idle K and V buffers");
    float* park_o = reinterpret_cast<float*>(s_k);   // [warps][16][kStride]
    float* park_m = park_o + kWarps * 16 * kStride;  // [warps][16]
    float* park_l = park_m + kWarps * 16;
    if (warp_active) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = (lane >> 2) + 8 * i;
        float* dst = park_o + (warp * 16 + row) * kStride + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          *reinterpret_cast<float2*>(dst + 8 * j) =
              make_float2(o_acc[j][2 * i], o_acc[j][2 * i + 1]);
        }
        if ((lane & 3) == 0) {
          park_m[warp * 16 + row] = row_max[i];
          park_l[warp * 16 + row] = row_sum[i];
        }
      }
    }
    __syncthreads();
    constexpr int kSlabs = kWarps / kSplit;
    constexpr int kVec = D / 4;  // float4 columns per row
    for (int idx = tid; idx < kSlabs * 16 * kVec; idx += kThreads) {
      const int v = idx % kVec, row16 = (idx / kVec) % 16, sl = idx / (16 * kVec);
      const int r = kHeads > 1 ? row16 : sl * 16 + row16;  // the item's row, of head sl
      if (r >= it.num_rows) continue;
      float m = -INFINITY;
#pragma unroll
      for (int w = 0; w < kSplit; ++w) m = fmaxf(m, park_m[(sl * kSplit + w) * 16 + row16]);
      float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
      float l = 0.f;
#pragma unroll
      for (int w = 0; w < kSplit; ++w) {
        const int at = (sl * kSplit + w) * 16 + row16;
        const float scale = park_m[at] == -INFINITY ? 0.f : exp2f(park_m[at] - m);
        const float4 x = *reinterpret_cast<const float4*>(park_o + at * kStride + 4 * v);
        o.x += scale * x.x, o.y += scale * x.y, o.z += scale * x.z, o.w += scale * x.w;
        l += scale * park_l[at];
      }
      const int64_t out_row =
          int64_t(it.partial_slot[it.query_begin + r / it.gqa]) * p.num_q_heads +
          (it.kv_head + (kHeads > 1 ? sl : 0)) * it.gqa + r % it.gqa;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      *reinterpret_cast<float4*>(p.partial_o + out_row * D + 4 * v) =
          make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
      if (v == 0) p.partial_lse[out_row] = l > 0.f ? m + log2f(l) : -INFINITY;
    }
  }
}

}  // namespace treeserve::detail::ta
