// PTX wrappers for the tree-attention kernels (kernels/tree_attention.cu; device code):
// cp.async, ldmatrix, ex2, mma.sync m16n8k16 per dtype, wgmma (sm_90a) with its shared-memory
// descriptors and fences, mbarriers, and the 128-byte swizzle of the 64-row tiles. The FP8
// GEMM (engine/cuda_fp8_gemm.cu) uses its mbarrier and wgmma fence/commit/wait wrappers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace treeserve::detail::ta {

// ---------------------------------------------------------------------------------------------
// PTX wrappers.

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 fills the destination with zeros (tile tails, pad rows).
// .L2::128B: a miss fetches the whole 128-byte line into L2, so the copies of a K/V row's other
// 16-byte chunks (the row is 256 bytes at head_dim 128) find it there; faster than the plain
// copy on the tree plans and the baseline's alike. .L2::256B is slower at GQA 4.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
// 4 bytes (a float), zero-filled where !valid.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
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
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The transpose of an 8 x 8 b16 matrix held one 32-bit pair a lane (lane holds row lane / 4,
// columns 2 (lane % 4) and + 1; so does the result, of the transpose).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// The global nanosecond timer (%globaltimer; block traces).
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// 2^x by the SFU (ex2.approx: ~2 ulp, -inf -> 0); exp2f adds range handling we do not need.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
struct Dtype;

// One dtype's conversions and m16n8k16 MMA (d += a * b, fp32 accumulators): TY its PTX type
// name, T2 its two-element vector, TO2 / TO1 the rounding conversions from float.
// clang-format off
#define TS_DTYPE_DEFINE(T, TY, T2, TO2, TO1) \
  template <> \
  struct Dtype<T> { \
    __device__ static uint32_t pack(float lo, float hi) { \
      const T2 h = TO2(lo, hi); \
      return *reinterpret_cast<const uint32_t*>(&h); \
    } \
    __device__ static T from_float(float x) { return TO1(x); } \
    __device__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { \
      asm volatile( \
          "mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0, %1, %2, %3}, " \
          "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n" \
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1)); \
    } \
  };
TS_DTYPE_DEFINE(__half, "f16", __half2, __floats2half2_rn, __float2half_rn)
TS_DTYPE_DEFINE(__nv_bfloat16, "bf16", __nv_bfloat162, __floats2bfloat162_rn, __float2bfloat16_rn)
#undef TS_DTYPE_DEFINE
// clang-format on

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

// Shared-memory matrix descriptors, 128-byte swizzle, in two parts: the low word (start
// address >> 4; leading-dimension byte offset >> 4, which K-major operands ignore and MN-major
// ones use as the distance between 64-element column groups) and the descriptor from it (stride
// byte offset 1024: between 8-row groups of 128-byte rows; the swizzle mode). Shared addresses
// are below 2^18, so a byte offset inside a tile (a multiple of 16) adds its >> 4 to the low
// word without carrying into the leading-dimension field: each k-step's descriptor is one add
// (building each from its address takes five instructions more a wgmma).
__device__ __forceinline__ uint32_t sw128_desc_lo(uint32_t addr, uint32_t lbo) {
  return ((addr & 0x3FFFF) >> 4) | ((lbo >> 4) << 16);
}
__device__ __forceinline__ uint64_t sw128_desc_from_lo(uint32_t lo) {
  return (uint64_t((1024 >> 4) | (1u << 30)) << 32) | lo;
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
// Shared-memory mbarriers (sm_90): a ring's "full" and "empty" barriers between a producer
// warp and consumer warpgroups (the wide kernel).
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared.b64 st, [%0];\n}\n" ::"r"(smem_u32(bar))
               : "memory");
}
// Arrives on bar once all of this thread's earlier cp.async copies have landed (the
// barrier's expected count includes this arrival: .noinc).
__device__ __forceinline__ void mbar_arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
// Waits until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}
// A named barrier among `threads` threads (whole warps).
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
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
// kRows: the tile's rows (the decode kernel's query tile has 16; it is never a wgmma operand).
template <int D, int kRows = kSwzRows>
__device__ __forceinline__ int swz(int row, int chunk) {
  return (chunk >> 3) * (kRows * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// The two products of a 64-row tile against a 64-token K/V tile (sm_90a; swizzled tiles at
// shared addresses), each committed as one wgmma group:
// S (64 x 64) = Q K^T: D / 16 k-steps of 16 head dims (32 bytes inside a 128-byte swizzled row;
// steps 4-7 in the second 64-column half). The caller zeroes s before its wgmma_fence
// (accumulator registers written after the fence make ptxas serialise).
template <int D, typename T>
__device__ __forceinline__ void wgmma_scores(float (&s)[8][4], uint32_t q_tile, uint32_t k_tile) {
  const uint32_t q_lo = sw128_desc_lo(q_tile, 16), k_lo = sw128_desc_lo(k_tile, 16);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t off = ((kk >> 2) * kSwzHalfBytes + (kk & 3) * 32) >> 4;
    Wgmma<T>::ss_n64(s, sw128_desc_from_lo(q_lo + off), sw128_desc_from_lo(k_lo + off), kk > 0);
  }
  wgmma_commit();
}
// O (64 x D) += P V: k-steps of 16 tokens (2048 bytes of V rows; P's A fragments in pa), V
// MN-major (head dims contiguous), its two 64-column halves kSwzHalfBytes apart.
template <int D, typename T>
__device__ __forceinline__ void wgmma_pv(float (&o)[D / 8][4], const uint32_t (&pa)[4][4],
                                         uint32_t v_tile) {
  const uint32_t v_lo = sw128_desc_lo(v_tile, kSwzHalfBytes);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t b = sw128_desc_from_lo(v_lo + ((kk * 16 * 128) >> 4));
    if constexpr (D == 128) {
      Wgmma<T>::rs_n128(o, pa[kk], b);
    } else {
      Wgmma<T>::rs_n64(o, pa[kk], b);
    }
  }
  wgmma_commit();
}

// The pipelined loop's schedule over n >= 1 K/V tiles (P as wgmma_pv's A fragments),
// P_0 already in pa0: step(t, cur, nxt) for t < n - 1 (P_t in cur, P_{t+1} packed into nxt),
// the buffers alternating two steps at a time (a copy would let ptxas coalesce them and
// serialise the products), then last(P_{n-1}).
// Stage 1 and the wide kernel's consumers run their steps by it (PA: the P buffers' type,
// uint32_t[4][4] for 64-token tiles, [8][4] for 128-token ones).
template <typename PA, typename Step, typename Last>
__device__ __forceinline__ void run_tile_steps(int n, PA& pa0, PA& pa1, Step&& step, Last&& last) {
  int t = 0;
  for (; t + 2 < n; t += 2) {
    step(t, pa0, pa1);
    step(t + 1, pa1, pa0);
  }
  if (t + 1 < n) {  // one more step: the last tile's P lands in pa1
    step(t, pa0, pa1);
    last(pa1);
  } else {
    last(pa0);
  }
}

}  // namespace treeserve::detail::ta
