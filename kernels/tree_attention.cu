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
// Stage 2, one warp per (query, q head): log-sum-exp merge of the query's contiguous partials
// in reduction-map order, written to out in the model dtype (or, launch_tree_attention_state,
// as the query's float32 (O, LSE) state). It is launched as a programmatic dependent grid: it
// reads its plan entries while stage 1 drains, then waits for it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/detail/pdl_launch.cuh"
#include "kernels/detail/tree_attention_layout.h"
#include "kernels/tree_attention.h"

namespace treeserve {
namespace {

using namespace detail;  // NOLINT: header field names

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileRows = kTreeAttentionTileRows;  // 16 rows per warp
// 64-token tiles, double-buffered: 2 blocks (8 warps) per SM at ~86 KB of shared memory and
// 177 registers (head_dim 128, no spills). Measured on H100 (mma.sync, before wgmma) the same
// as 32-token tiles 4 deep for the tree plans, and faster for decode-shaped items (4-way token
// split needs 64-token tiles); 32-token tiles 3 deep at 3 blocks per SM (168 registers) were
// 5-20% slower. wgmma's scores tile (m64n64) and swz() assume 64.
constexpr int kKvTile = 64;  // tokens per K/V tile
// Two stages at 2 blocks per SM beat 3, 4 and 6 stages at 1 block per SM on every bench case
// (H100, with wgmma: e.g. few-shot b=50 GQA 4 46 vs 59 us): a block is mostly ramp (plan,
// table, first tiles) and two blocks interleave theirs. Three stages at 2 blocks per SM (Q held
// in registers, its buffer the third stage) measured no better: -1% on few-shot b=50 and
// P=16000, +3-5% on small trees (H100, 2026-11-25).
constexpr int kStages = 2;  // K/V tiles resident (kStages - 1 in flight)
constexpr int kMinBlocksPerSm = 2;
constexpr int kSegBatch = kThreads;  // segments resolved per pass
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kTileRows == 16 * kWarps, "one 16-row MMA slab per warp");
static_assert(kTileRows == 64 && kKvTile == 64, "swizzled tiles (swz) have 64 rows");

// ---------------------------------------------------------------------------------------------
// PTX wrappers.

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 fills the destination with zeros (tile tails, pad rows).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 2^x by the SFU (ex2.approx: ~2 ulp, -inf -> 0); exp2f adds range handling we do not need.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
struct Dtype;

template <>
struct Dtype<__half> {
  __device__ static uint32_t pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
  // d += a * b, 16x8x16, fp32 accumulators.
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Dtype<__nv_bfloat16> {
  __device__ static uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, "
        "%7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// P's A fragment for the 16-token k-step kk of O += P V: the score accumulators of n-tiles
// 2 kk and 2 kk + 1 (m16n8 C layout) are m16n8k16's A layout, packed to the model dtype.
template <typename T, int kN>
__device__ __forceinline__ void pack_p(const float (&s)[kN][4], int kk, uint32_t (&a)[4]) {
  a[0] = Dtype<T>::pack(s[2 * kk][0], s[2 * kk][1]);
  a[1] = Dtype<T>::pack(s[2 * kk][2], s[2 * kk][3]);
  a[2] = Dtype<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = Dtype<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// ---------------------------------------------------------------------------------------------
// wgmma (sm_90a): one warpgroup (the block's 4 warps) multiplies a 64-row tile at once, with
// operands read from shared memory by the tensor cores (no ldmatrix issue). The accumulator
// layout per warp is mma.sync m16n8's (warp w owns rows 16w..16w+15; per 8-column block j a
// thread holds d[j][0..1] at row lane/4 and d[j][2..3] at row lane/4 + 8, columns
// 8j + 2 (lane % 4) + {0, 1}), and a register A operand is mma.sync m16n8k16's A fragment, so
// the softmax between the two products is the same code as the mma.sync path.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TS_WGMMA 1
#else
#define TS_WGMMA 0
#endif

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading-dimension byte
// offset (K-major: unused; MN-major: distance between 64-element column groups), stride byte
// offset (distance between 8-row groups: 1024 bytes for 128-byte rows).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32) |
         (uint64_t(1) << 62);
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N committed wgmma groups are still in flight (they complete in order).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written through the generic proxy (cp.async) made visible to wgmma's reads.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of accumulator registers across wgmma issue/wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])::"memory");
  }
}

// S (64 x 64) [+]= A (64 x 16, shared, K-major) * B (16 x 64, shared, K-major), and
// O (64 x N) += A (64 x 16, registers) * B (16 x N, shared, MN-major: V rows as stored).
template <typename T>
struct Wgmma {
  __device__ static void ss_n64(float (&d)[8][4], uint64_t a, uint64_t b, int accumulate);
  __device__ static void rs_n64(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b);
  __device__ static void rs_n128(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b);
};
#if TS_WGMMA
// clang-format off
// Accumulator operands of the wgmma forms below: 32 registers for N = 64, 64 for N = 128.
#define TS_WGMMA_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define TS_WGMMA_REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define TS_WGMMA_D8 \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
    "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
    "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define TS_WGMMA_D16 TS_WGMMA_D8, \
    "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
    "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
    "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
    "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
// O (N columns, G = N / 8 accumulator groups) += A (registers) * B: register A occupies the
// operands after the accumulators (A_OPS names them, then B's descriptor).
#define TS_WGMMA_RS(T, TY, N, G, REGS, D_OPS, A_OPS) \
  template <> \
  __device__ __forceinline__ void Wgmma<T>::rs_n##N(float (&d)[G][4], const uint32_t (&a)[4], \
                                                    uint64_t b) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS \
                 ", " A_OPS ", p, 1, 1, 1;\n}\n" \
                 : D_OPS : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)); \
  }
// The three products for one dtype (TY: its PTX type name).
#define TS_WGMMA_DEFINE(T, TY) \
  template <> \
  __device__ __forceinline__ void Wgmma<T>::ss_n64(float (&d)[8][4], uint64_t a, uint64_t b, \
                                                   int accumulate) { \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " TS_WGMMA_REGS32 \
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n" \
                 : TS_WGMMA_D8 : "l"(a), "l"(b), "r"(accumulate)); \
  } \
  TS_WGMMA_RS(T, TY, 64, 8, TS_WGMMA_REGS32, TS_WGMMA_D8, "{%32, %33, %34, %35}, %36") \
  TS_WGMMA_RS(T, TY, 128, 16, TS_WGMMA_REGS64, TS_WGMMA_D16, "{%64, %65, %66, %67}, %68")
TS_WGMMA_DEFINE(__half, "f16")
TS_WGMMA_DEFINE(__nv_bfloat16, "bf16")
#undef TS_WGMMA_DEFINE
#undef TS_WGMMA_RS
// clang-format on
#endif  // TS_WGMMA

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled 64-row tile of D
// columns. The tile is stored as D / 64 column halves of [64 rows][64 elements] (128-byte
// rows), and chunk c of a row sits at position c ^ (row % 8) of its half: the 8 rows one
// ldmatrix reads hit 8 different banks, and each 8-row x 128-byte block is exactly the
// 128-byte-swizzle atom that wgmma's shared-memory descriptors address (tile bases are
// 1024-byte aligned).
constexpr int kSwzRows = 64;                   // rows of every swizzled tile (Q, K, V)
constexpr int kSwzHalfBytes = kSwzRows * 128;  // one 64-column half of a tile
template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return (chunk >> 3) * (kSwzRows * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

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
  const void* k;  // [pages][num_kv_heads][page_size][D]
  const void* v;
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
  TreeAttentionBlockTrace* trace;  // null unless the workspace's block trace is enabled
};

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

template <int D>
constexpr int stage1_smem_bytes_fixed() {
  // Q tile, kStages K and V tiles, segment scratch (start, first slot, page, warp sums x2),
  // 1 KB to align the tiles; the token table (4 bytes a token) comes on top.
  return (kTileRows + 2 * kStages * kKvTile) * D * 2 + (3 * kSegBatch + 2 * kWarps) * 4 + 1024;
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
  const int32_t* partial_slot;  // where partial (query_begin + local query) is stored
};

// Online-softmax step of one tile for this thread's rows r0 and r0 + 8: s holds the raw
// Q K^T scores of its kN n-tiles (tokens tile_begin + tok0 + 8 j + 2 (lane % 4) + {0, 1});
// invisible tokens (past the item's end, or masked) are dropped, s becomes the probabilities
// against the rows' new running max (base 2), row_max and row_sum are updated, and alpha gets
// the factor the rows' O accumulators must be scaled by (rescale_o).
template <int kN>
__device__ __forceinline__ void softmax_tile(float (&s)[kN][4], const ItemTile& it, int tile_begin,
                                             int tok0, const uint32_t* const (&row_mask)[2],
                                             float scale_log2, float (&row_max)[2],
                                             float (&row_sum)[2], float (&alpha)[2]) {
  const int lane = threadIdx.x & 31;
  // Full tiles of unmasked items (the bulk of long chunks) skip the per-score visibility
  // test: it costs more issue slots than the max it feeds (block-uniform branch).
  const bool all_visible = it.mask_offset < 0 && it.num_tokens - tile_begin >= kKvTile;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!all_visible) {
      uint64_t visible = ~uint64_t(0);  // bit c: token tile_begin + c is visible
      const int remaining = it.num_tokens - tile_begin;
      if (remaining < 64) visible = (uint64_t(1) << remaining) - 1;
      if (row_mask[i] != nullptr) {
        const int w = tile_begin >> 5;  // tiles start on mask-word boundaries
        uint64_t bits = row_mask[i][w];
        if (kKvTile > 32 && w + 1 < it.words_per_row) bits |= uint64_t(row_mask[i][w + 1]) << 32;
        visible &= bits;
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
    const float new_max = fmaxf(row_max[i], mx * scale_log2);
    const float base = new_max == -INFINITY ? 0.f : new_max;  // all masked so far
    alpha[i] = fast_exp2(row_max[i] - base);
    row_max[i] = new_max;
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
// contiguous), its two 64-column halves kSwzHalfBytes apart. Measured on H100 against the
// unpipelined loop (S, softmax, P V per tile), same run: 1-3% faster on the cases with wide
// items (speculative t=256 GQA 4 89.3 -> 87.3 us), none slower.
template <int D, typename T, typename LoadTile>
__device__ __forceinline__ void wgmma_main_loop(const Stage1Params& p, const ItemTile& it,
                                                const uint32_t* const (&row_mask)[2], const T* s_q,
                                                T* s_k, T* s_v, LoadTile&& load_tile,
                                                float (&o_acc)[D / 8][4], float (&row_max)[2],
                                                float (&row_sum)[2]) {
  static_assert(kStages == 2, "K_{t+2} reuses K_t's buffer, V_{t+1} V_{t-1}'s");
  const int n = it.num_tiles;
  if (n == 0) return;
  // S = Q K_tile^T into s, committed as one group. The caller zeroes s before its
  // wgmma_fence (accumulator registers written after the fence make ptxas serialise).
  auto issue_scores = [&](float(&s)[8][4], int tile) {
    const T* k_tile = s_k + (tile % kStages) * kKvTile * D;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk >> 2) * kSwzHalfBytes + (kk & 3) * 32;
      Wgmma<T>::ss_n64(s, sw128_desc(smem_u32(s_q) + off, 16, 1024),
                       sw128_desc(smem_u32(k_tile) + off, 16, 1024), kk > 0);
    }
    wgmma_commit();
  };
  // O += P V_tile, committed as one group.
  auto issue_pv = [&](const uint32_t(&pa)[kKvTile / 16][4], int tile) {
    const T* v_tile = s_v + (tile % kStages) * kKvTile * D;
#pragma unroll
    for (int kk = 0; kk < kKvTile / 16; ++kk) {
      const uint64_t b = sw128_desc(smem_u32(v_tile) + kk * 16 * 128, kSwzHalfBytes, 1024);
      if constexpr (D == 128) {
        Wgmma<T>::rs_n128(o_acc, pa[kk], b);
      } else {
        Wgmma<T>::rs_n64(o_acc, pa[kk], b);
      }
    }
    wgmma_commit();
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
  // Step t < n - 1 (P_t in cur): no branch between a wgmma's issue and its wait, so ptxas
  // sees which group each wait retires (and keeps the two products in flight together).
  auto step = [&](int t, const uint32_t(&cur)[kKvTile / 16][4], uint32_t(&nxt)[kKvTile / 16][4]) {
    __syncthreads();  // every warp is done with K_t and V_{t-1}: their buffers refill
    if (t + 2 < n) load_tile(t + 2, t % kStages, true, false);
    load_tile(t + 1, (t + 1) % kStages, false, true);
    cp_async_commit();
    cp_async_wait<1>();  // K_{t+1} and V_t (this thread's copies)
    fence_proxy_async_smem();
    __syncthreads();
    zero_scores(s);
    wgmma_fence();
    issue_scores(s, t + 1);
    issue_pv(cur, t);
    wgmma_wait<1>();  // S_{t+1}; P_t V_t may still run
    fence_regs(s);
    float alpha[2];
    softmax_tile(s, it, (t + 1) * kKvTile, 0, row_mask, p.scale_log2, row_max, row_sum, alpha);
#pragma unroll
    for (int kk = 0; kk < kKvTile / 16; ++kk) pack_p<T>(s, kk, nxt[kk]);
    wgmma_wait<0>();
    fence_regs(o_acc);
    rescale_o<D>(o_acc, alpha);
  };
  int t = 0;
  for (; t + 2 < n; t += 2) {
    step(t, pa0, pa1);
    step(t + 1, pa1, pa0);
  }
  // The last tile's P V (its V came with the previous step's group, or with Q).
  auto last = [&](const uint32_t(&cur)[kKvTile / 16][4]) {
    cp_async_wait<0>();
    fence_proxy_async_smem();
    __syncthreads();
    wgmma_fence();
    issue_pv(cur, n - 1);
    wgmma_wait<0>();
    fence_regs(o_acc);
  };
  if (t + 1 < n) {  // one more step: the last tile's P lands in pa1
    step(t, pa0, pa1);
    last(pa1);
  } else {
    last(pa0);
  }
}

// Main loop and epilogue of stage 1. kSplit warps share each 16-row slab and split every
// 64-token tile between them (kKvTile / kSplit tokens each), so an item with few rows (a
// decode branch: gqa rows) still spreads its MMAs over all four warps (and the SM's four
// schedulers); their softmax states are merged through shared memory at the end.
template <int D, typename T, int kSplit, typename LoadTile>
__device__ __forceinline__ void attend(const Stage1Params& p, const ItemTile& it,
                                       const uint32_t* mask_words, T* s_q, T* s_k, T* s_v,
                                       LoadTile&& load_tile) {
  constexpr int kTok = kKvTile / kSplit;  // tokens of a tile this warp scores
  constexpr int kN = kTok / 8;            // n-tiles of S
  static_assert(kTok % 16 == 0, "P V needs 16-token k-steps");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int slab = warp / kSplit, part = warp % kSplit;
  const int tok0 = part * kTok;  // this warp's first token inside a tile
  // Per thread: rows r0 = 16 * slab + lane / 4 and r0 + 8; accumulator columns 2 * (lane % 4).
  const int r0 = slab * 16 + (lane >> 2);
  const bool warp_active = slab * 16 < it.num_rows;
  const uint32_t* row_mask[2] = {nullptr, nullptr};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + 8 * i;
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
  if constexpr (TS_WGMMA != 0 && kSplit == 1) {
    wgmma_main_loop<D, T>(p, it, row_mask, s_q, s_k, s_v, load_tile, o_acc, row_max, row_sum);
  } else {
    for (int tile = 0; tile < it.num_tiles; ++tile) {
      // Refill the stage consumed in the previous iteration (freed by its trailing barrier).
      const int ahead = tile + kStages - 1;
      if (ahead < it.num_tiles) load_tile(ahead, ahead % kStages, true, true);
      cp_async_commit();
      cp_async_wait<kStages - 1>();
      __syncthreads();
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
            ldmatrix_x4(qa, smem_u32(s_q + swz<D>(r, 2 * kk + (lane >> 4))));
          }
#pragma unroll
          for (int jj = 0; jj < kN / 2; ++jj) {
            uint32_t b[4];
            const int r = tok0 + 16 * jj + (lane & 7) + ((lane >> 4) << 3);
            ldmatrix_x4(b, smem_u32(k_tile + swz<D>(r, 2 * kk + ((lane >> 3) & 1))));
            Dtype<T>::mma(s[2 * jj], qa, b[0], b[1]);
            Dtype<T>::mma(s[2 * jj + 1], qa, b[2], b[3]);
          }
        }
        float alpha[2];
        softmax_tile(s, it, tile * kKvTile, tok0, row_mask, p.scale_log2, row_max, row_sum, alpha);
        rescale_o<D>(o_acc, alpha);
        // O += P V: P's accumulator layout is the A-fragment layout of the next MMA.
#pragma unroll
        for (int kk = 0; kk < kTok / 16; ++kk) {
          uint32_t a[4];
          pack_p<T>(s, kk, a);
#pragma unroll
          for (int jd = 0; jd < D / 16; ++jd) {
            uint32_t b[4];
            const int r = tok0 + 16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3);
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
      const float sum = row_sum[i];
      const int r = r0 + 8 * i;
      if (r >= it.num_rows) continue;
      const int64_t out_row =
          int64_t(it.partial_slot[it.query_begin + r / it.gqa]) * p.num_q_heads +
          it.kv_head * it.gqa + r % it.gqa;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      float* dst = p.partial_o + out_row * D + 2 * (lane & 3);
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        *reinterpret_cast<float2*>(dst + 8 * j) =
            make_float2(o_acc[j][2 * i] * inv, o_acc[j][2 * i + 1] * inv);
      }
      if ((lane & 3) == 0) {
        p.partial_lse[out_row] = sum > 0.f ? row_max[i] + log2f(sum) : -INFINITY;
      }
    }
  } else {
    // Each warp parks its (unnormalised O, max, sum) in the now idle K/V buffers; then the
    // block merges the kSplit states of every row and writes the partials coalesced.
    // Floats per parked row. A half-warp's float2 stores cover rows lane/4 (4 of them) x
    // column pairs lane%4: with D + 8 the rows start 4 eight-byte slots apart, so the 16
    // stores hit 16 different slot pairs (ncu measured 3.3-way conflicts with D + 4).
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
      const int r = sl * 16 + row16;
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
          it.kv_head * it.gqa + r % it.gqa;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      *reinterpret_cast<float4*>(p.partial_o + out_row * D + 4 * v) =
          make_float4(o.x * inv, o.y * inv, o.z * inv, o.w * inv);
      if (v == 0) p.partial_lse[out_row] = l > 0.f ? m + log2f(l) : -INFINITY;
    }
  }
}

template <int D, typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) tree_attention_stage1(Stage1Params p) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  const int32_t* plan = p.plan;
  const int tid = threadIdx.x;
  const uint64_t start_ns = p.trace != nullptr && tid == 0 ? global_ns() : 0;
  // One-dimensional grid of items x kv heads (TreeAttentionGrid launches: grid.items items),
  // in the order the plan asks for (AttentionPlan::heads_first).
  const int grid_items = gridDim.x / p.num_kv_heads;
  const int item = p.heads_first ? blockIdx.x / p.num_kv_heads : blockIdx.x % grid_items;
  if (item >= p.max_items) return;  // a bucketed grid past the workspace's records
  ItemTile it;
  it.kv_head = p.heads_first ? blockIdx.x % p.num_kv_heads : blockIdx.x / grid_items;
  it.gqa = p.gqa;

  // The prologue's one round trip: the header (graph launches), the item's record, the batch
  // row of this thread's query-tile row and, in the fixed-stride table mode, the entry of
  // token tid all lie at addresses known from the block index, so their loads go out together
  // (detail/tree_attention_layout.h). Loads for a block past the plan's items read stale but
  // in-bounds words, and the block exits before using them.
  static_assert(kThreads == 2 * kTileRows, "two threads per query-tile row");
  static_assert(kThreads <= 128, "the table stride is a multiple of 128 tokens");
  const int32_t* rec = plan + kHeaderWords + int64_t(item) * kItemRecordWords;
  const int4 rec_a = *reinterpret_cast<const int4*>(rec);
  const int4 rec_b = *reinterpret_cast<const int4*>(rec + 4);
  const int q_row = tid >> 1;  // this thread's query-tile row
  const int q_local = q_row / it.gqa;
  const int32_t q_batch_row = rec[kRecQueryRows + q_local];
  const int32_t first_entry =
      item < p.table_items ? p.token_table[int64_t(item) * p.table_stride + tid] : 0;
  const PlanHeaderArg h = load_header(p.header, plan, p.header_on_device);
  if (item >= h.w[kNumItems]) return;
  it.query_begin = rec_a.x;
  it.num_rows = (rec_a.y - rec_a.x) * it.gqa;
  it.num_tokens = rec_a.z;
  it.num_tiles = (it.num_tokens + kKvTile - 1) / kKvTile;
  it.mask_offset = rec_a.w;
  it.words_per_row = (it.num_tokens + 31) >> 5;
  it.partial_slot = plan + h.w[kPartialSlot];
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
  int32_t* seg_start = reinterpret_cast<int32_t*>(s_v + kStages * kKvTile * D);
  int32_t* seg_slot = seg_start + kSegBatch;
  int32_t* seg_page = seg_slot + kSegBatch;
  int32_t* warp_sums = seg_page + kSegBatch;
  int32_t* tok = warp_sums + 2 * kWarps;  // [max_item_tokens]

  // Q tile: row r = local query r / gqa, q head kv_head * gqa + r % gqa; pad rows are zero.
  // Two threads per row, alternating 16-byte chunks, so each copy instruction reads 32
  // contiguous bytes of 16 rows.
  {
    const T* q = static_cast<const T*>(p.q);
    const bool valid = q_row < it.num_rows;
    const T* src = q;
    if (valid) {
      const int head = it.kv_head * it.gqa + (q_row - q_local * it.gqa);
      src = q + (int64_t(q_batch_row) * p.num_q_heads + head) * D;
    }
#pragma unroll
    for (int j = 0; j < kChunks / 2; ++j) {
      const int c = (tid & 1) + 2 * j;
      cp_async_16(smem_u32(s_q + swz<D>(q_row, c)), valid ? src + c * 8 : q, valid);
    }
  }

  // tok[t] = row of item token t in the K (or V) pool viewed as [rows][head_dim], for this
  // block's kv head; int32 rows halve the table (a pool of 2^31 rows is 512 GB of fp16 at
  // head_dim 128, far beyond one layer).
  const int rows_per_page = p.num_kv_heads * page_size;
  const int head_row = it.kv_head * page_size;
  auto table_row = [&](int32_t e) { return (e >> 8) * rows_per_page + head_row + (e & 0xff); };
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

  const T* k_pool = static_cast<const T*>(p.k);
  const T* v_pool = static_cast<const T*>(p.v);
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
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = tid % kTpr + kTpr * j;
        const int64_t off = valid ? row + c * 8 : 0;
        if (with_k) cp_async_16(smem_u32(dk + swz<D>(r, c)), k_pool + off, valid);
        if (with_v) cp_async_16(smem_u32(dv + swz<D>(r, c)), v_pool + off, valid);
      }
    }
  };
  // Group 0: Q with the first tile. The main loops load tile 1 before their first barrier.
  static_assert(2 * kKvTile <= kThreads, "tiles 0 and 1 read the first table entries");
  if (it.num_tiles > 0) load_tile(0, 0, true, true);
  cp_async_commit();
  // The fixed-stride table's later entries, while the first tiles are in flight: the main
  // loop's first barrier orders these writes before the load of tile 2.
  for (int t = rest_begin + tid; t < it.num_tokens; t += kThreads) tok[t] = table_row(entries[t]);

  constexpr int kMaxSplit = kKvTile / 16 < kWarps ? kKvTile / 16 : kWarps;
  // Items of one slab (decode branches: gqa rows) split its tiles' tokens over the 4 warps;
  // the rest run whole 64-row tiles (wgmma on sm_90a). Measured on H100: 17-32-row items are
  // at least as fast as whole tiles as split 2 ways (fasttree N=1,2,4,8 GQA 4 15.6 -> 13.3 us),
  // and decode items split 4 ways match whole wgmma tiles (both bound by latency, not the
  // tensor cores).
  if (it.num_rows <= 16) {
    attend<D, T, kMaxSplit>(p, it, mask_words, s_q, s_k, s_v, load_tile);
  } else {
    attend<D, T, 1>(p, it, mask_words, s_q, s_k, s_v, load_tile);
  }
  if (p.trace != nullptr && tid == 0) {
    TreeAttentionBlockTrace r;
    r.start_ns = start_ns;
    r.end_ns = global_ns();
    asm volatile("mov.u32 %0, %smid;" : "=r"(r.sm));
    r.block = blockIdx.x;
    r.item = item;
    r.kv_head = it.kv_head;
    r.rows = it.num_rows;
    r.tokens = it.num_tokens;
    p.trace[int64_t(item) * p.num_kv_heads + it.kv_head] = r;
  }
  // The merge grid (programmatic dependent launch) may start once every block got here.
  pdl_trigger();
}

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

Status cuda_status(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

// Stage 1's opt-in to more than 48 KB of dynamic shared memory. The attribute belongs to the
// kernel in one device's context, so it is set once per device (tensor parallelism launches
// on several), before any launch there — so never during a graph capture, whose eager first
// step comes first.
template <int D, typename T>
cudaError_t allow_large_smem() {
  static std::mutex mutex;
  static std::vector<int> done;  // devices where the attribute is set
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mutex);
  if (std::find(done.begin(), done.end(), device) != done.end()) return cudaSuccess;
  e = cudaFuncSetAttribute(tree_attention_stage1<D, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           227 * 1024);
  if (e == cudaSuccess) done.push_back(device);
  return e;
}

// Where stage 2 writes: out (model dtype rows), or, when out is null, the float32 states.
struct MergeTarget {
  void* out = nullptr;
  float* state_o = nullptr;
  float* state_lse = nullptr;
};

template <int D, typename T>
Status launch(const Stage1Params& params, const MergeTarget& target,
              const TreeAttentionWorkspace& ws, cudaStream_t stream, TreeAttentionGrid grid) {
  const TreeAttentionLimits& limits = ws.limits();
  const int smem = stage1_smem_bytes_fixed<D>() + limits.max_item_tokens * 4;
  const cudaError_t attr = allow_large_smem<D, T>();
  if (attr != cudaSuccess) {
    return Internal(std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(attr));
  }
  const int items = grid.items > 0 ? grid.items : ws.num_items();
  const int queries = grid.items > 0 ? grid.queries : ws.num_queries();
  if (queries == 0) return Status::Ok();
  if (int64_t(items) * params.num_kv_heads > INT32_MAX) {
    return InvalidArgument("work items x kv heads exceed one grid");
  }
  // A plan without items (a sequence-parallel shard's) still has its queries written.
  if (items > 0) {
    const dim3 grid1(items * params.num_kv_heads);
    tree_attention_stage1<D, T><<<grid1, kThreads, smem, stream>>>(params);
    TS_RETURN_IF_ERROR(cuda_status("tree_attention_stage1 launch"));
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
  if (e != cudaSuccess) {
    return Internal(std::string("tree_attention_merge launch: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

// Checks shared by both launchers and the stage 1 parameters they launch with.
Status prepare_launch(const void* q, const void* k_pool, const void* v_pool, int32_t num_q_heads,
                      int32_t num_kv_heads, int32_t head_dim, int32_t page_size, float sm_scale,
                      const TreeAttentionWorkspace& workspace, TreeAttentionGrid grid,
                      Stage1Params* params) {
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
  params->header_on_device = grid.items > 0 ? 1 : 0;
  for (int i = 0; i < kHeaderWords; ++i) params->header.w[i] = workspace.plan_header()[i];
  params->plan = static_cast<const int32_t*>(workspace.device_plan());
  params->q = q;
  params->k = k_pool;
  params->v = v_pool;
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
  params->trace = static_cast<TreeAttentionBlockTrace*>(workspace.block_trace());
  return Status::Ok();
}

Status dispatch(const Stage1Params& params, const MergeTarget& target, TreeAttentionDtype dtype,
                int32_t head_dim, const TreeAttentionWorkspace& workspace, cudaStream_t stream,
                TreeAttentionGrid grid) {
  const bool bf16 = dtype == TreeAttentionDtype::kBFloat16;
  if (head_dim == 128) {
    return bf16 ? launch<128, __nv_bfloat16>(params, target, workspace, stream, grid)
                : launch<128, __half>(params, target, workspace, stream, grid);
  }
  return bf16 ? launch<64, __nv_bfloat16>(params, target, workspace, stream, grid)
              : launch<64, __half>(params, target, workspace, stream, grid);
}

}  // namespace

namespace detail {

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

Status launch_tree_attention(const void* q, const void* k_pool, const void* v_pool, void* out,
                             TreeAttentionDtype dtype, int32_t num_q_heads, int32_t num_kv_heads,
                             int32_t head_dim, int32_t page_size, float sm_scale,
                             const TreeAttentionWorkspace& workspace, cudaStream_t stream,
                             TreeAttentionGrid grid) {
  Stage1Params params;
  TS_RETURN_IF_ERROR(prepare_launch(q, k_pool, v_pool, num_q_heads, num_kv_heads, head_dim,
                                    page_size, sm_scale, workspace, grid, &params));
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
                                   TreeAttentionGrid grid) {
  Stage1Params params;
  TS_RETURN_IF_ERROR(prepare_launch(q, k_pool, v_pool, num_q_heads, num_kv_heads, head_dim,
                                    page_size, sm_scale, workspace, grid, &params));
  if (state_o == nullptr || state_lse == nullptr) {
    return InvalidArgument("launch_tree_attention_state: null state pointer");
  }
  MergeTarget target;
  target.state_o = state_o;
  target.state_lse = state_lse;
  return dispatch(params, target, dtype, head_dim, workspace, stream, grid);
}

}  // namespace treeserve
