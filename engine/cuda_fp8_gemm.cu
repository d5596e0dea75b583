// The FP8 GEMM for decode-sized row counts (engine/cuda_fp8.h fp8_gemm_rows).
//
// y [m][n] = (xq [m][k] . w [n][k]^T) * x_scale[m] * w_scale[n], e4m3 in, float32 accumulate,
// m <= 272. A decode step's GEMM is bound by its weight bytes; cublasLt's vector-scaled FP8
// kernels tile it 128 x 128 without split-K (32 CTAs for a 4096-wide output on 132 SMs), so
// this kernel streams the weights with every SM busy instead:
//   - a CTA (8 warps) owns 128 output columns (w rows), each warp 16 of them, and one K range;
//     the K ranges of one 128-column block form a thread-block cluster (up to 8 CTAs, enough
//     CTAs for two per SM), whose partial sums are added through distributed shared memory in
//     a fixed order (bit-reproducible, no float32 parts in global memory);
//   - w and x tiles of 128 bytes of K stream through a ring of 4-6 stages filled by the tensor
//     memory accelerator (2-D tensor maps, 128-byte swizzle, completion on mbarriers; the
//     LSU's 16-byte cp.async copies cannot keep enough bytes in flight for HBM3e);
//   - each warpgroup runs wgmma m64nNk32 e4m3 (w's 64 rows as A, x's rows as B in segments
//     of up to 128, both K-major from shared memory); each chunk's products start from zero
//     and are added into float32 accumulators by the CUDA cores. (mma.sync's FP8 rate on
//     Hopper cannot keep up with the weight stream beyond a few dozen rows.)
//   - it goes out as a programmatic dependent launch: the row kernel before it (the norm, SwiGLU
//     or quantize kernel writing x) lets it start at once, and the first stages' weights load
//     before it waits for x, so the launch and the first DRAM round trips overlap that kernel.
#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "engine/cuda_fp8.h"
#include "kernels/detail/pdl_launch.cuh"
#include "kernels/detail/tree_attention_mma.cuh"

namespace treeserve::cuda {
namespace {

namespace cg = cooperative_groups;
using ::treeserve::detail::ta::mbar_init;
using ::treeserve::detail::ta::mbar_wait;
using ::treeserve::detail::ta::smem_u32;
using ::treeserve::detail::ta::wgmma_commit;
using ::treeserve::detail::ta::wgmma_fence;
using ::treeserve::detail::ta::wgmma_wait;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockCols = kWarps * 16;  // w rows a CTA owns
constexpr int kChunk = 128;              // bytes of K a pipeline stage holds per row
constexpr int kMaxCluster = 8;
constexpr int kRedStride = kBlockCols + 4;  // floats per x row in the reduction buffer

// N: x rows a CTA holds (m rounded up to an instantiated width; rows >= m are zero).
template <int N>
__host__ __device__ constexpr int stage_bytes() {
  return (kBlockCols + N) * kChunk;
}
// x rows a TMA box holds (a box has at most 256 rows).
template <int N>
constexpr int kXBox = N <= 256 ? N : 16;
// As many stages as fit two CTAs an SM (up to 64 rows; 110 KB each), or one (beyond: twice
// the accumulator registers), at most 6.
template <int N>
__host__ __device__ constexpr int stages() {
  constexpr int budget = N <= 64 ? 110 * 1024 : 220 * 1024;
  return budget / stage_bytes<N>() < 6 ? budget / stage_bytes<N>() : 6;
}
template <int N>
__host__ __device__ constexpr int smem_bytes() {
  constexpr int pipe = stages<N>() * stage_bytes<N>();
  constexpr int red = N * kRedStride * 4;
  return (pipe > red ? pipe : red) + 1024;  // + room to align the tiles to 1024 bytes
}

// A shared-memory matrix descriptor for a K-major tile of 128-byte rows in TMA's 128-byte
// swizzle (8-row groups 1024 bytes apart; the tile 1024-byte aligned). A k32 step inside the
// rows is the start address plus 32 bytes.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

template <int N>
__device__ __forceinline__ void wgmma_e4m3(float* d, uint64_t a, uint64_t b, int accumulate);

template <>
__device__ __forceinline__ void wgmma_e4m3<8>(float* d, uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3}, "
      "%4, %5, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(a), "l"(b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<16>(float* d, uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, "
      "%8, %9, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "l"(a), "l"(b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<32>(float* d, uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<64>(float* d, uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<128>(float* d, uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
}

// The producer's arrival, announcing the bytes the stage's copies will deliver.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
// A 2-D box (x: bytes of K, y: rows) of the tensor map into shared memory, completing on bar.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int x, int y,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void store_out(__half* y, int64_t i, float v) {
  y[i] = __float2half_rn(v);
}
__device__ __forceinline__ void store_out(__nv_bfloat16* y, int64_t i, float v) {
  y[i] = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void store_out(float* y, int64_t i, float v) { y[i] = v; }

// One chunk (128 bytes of K) of a warpgroup's product, x's rows in segments of up to 128 from
// segment J on: each segment's four k32 steps into `part` (from zero), then added into `acc`.
template <int N, int J = 0>
__device__ __forceinline__ void mma_segments(float* acc, float* part, uint32_t tile, int wg) {
  if constexpr (J * 128 < N) {
    constexpr int kBase = 128 * J;
    constexpr int kWidth = N - kBase < 128 ? N - kBase : 128;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kChunk / 32; ++kk) {
      const uint64_t a = sw128_desc(tile + uint32_t(wg * 64 * kChunk + kk * 32));
      const uint64_t b = sw128_desc(tile + uint32_t((kBlockCols + kBase) * kChunk + kk * 32));
      wgmma_e4m3<kWidth>(part, a, b, kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kWidth / 2; ++i) asm volatile("" : "+f"(part[i])::"memory");
#pragma unroll
    for (int i = 0; i < kWidth / 2; ++i) acc[kBase / 2 + i] += part[i];
    mma_segments<N, J + 1>(acc, part, tile, wg);
  }
}

// Grid (n / 128, S), cluster (1, S, 1): CTA (bx, r) owns w rows [128 bx, 128 bx + 128) and the
// r-th of S near-equal runs of K's 128-byte chunks.
template <int N, typename Out>
__global__ void __launch_bounds__(kThreads, N <= 64 ? 2 : 1)
    fp8_gemm_rows_kernel(const __grid_constant__ CUtensorMap w_map,
                         const __grid_constant__ CUtensorMap x_map,
                         const float* __restrict__ x_scale, const float* __restrict__ w_scale,
                         Out* __restrict__ y, int m, int n, int k) {
  constexpr int S = stages<N>();
  constexpr uint32_t kStageBytes = uint32_t(stage_bytes<N>());
  extern __shared__ uint8_t smem_raw[];
  __shared__ uint64_t full[S];
  // 128-byte swizzled tiles need 1024-byte alignment (smem_bytes leaves room for it).
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  cg::cluster_group cluster = cg::this_cluster();
  const int split = int(cluster.block_rank());
  const int splits = int(cluster.num_blocks());
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int col0 = blockIdx.x * kBlockCols;
  const int chunks = k / kChunk;
  const int c_begin = int(int64_t(chunks) * split / splits);
  const int c_end = int(int64_t(chunks) * (split + 1) / splits);
  const int count = c_end - c_begin;
  // The CTAs of a wave would otherwise read the same 128-byte column of K at once: rows k
  // bytes apart (a power of two), so every read lands on the same few memory channels. Each
  // column block starts its run of chunks at its own place and wraps around (a fixed order
  // per CTA: the sums stay reproducible).
  const int rotate = count > 0 ? int((int64_t(blockIdx.x) * 13) % count) : 0;

  // Stage s: w's 128 rows x 128 bytes of K, then x's N rows (rows >= m read as zeros). The
  // stage's barrier expects both before either copy is issued.
  auto chunk_x = [&](int c) {
    return (c_begin + (c + rotate < count ? c + rotate : c + rotate - count)) * kChunk;
  };
  auto issue_w = [&](int c, int stage) {
    mbar_expect_tx(&full[stage], kStageBytes);
    tma_load_2d(smem + stage * kStageBytes, &w_map, chunk_x(c), col0, &full[stage]);
  };
  auto issue_x = [&](int c, int stage) {
    uint8_t* dst = smem + stage * kStageBytes + kBlockCols * kChunk;
#pragma unroll
    for (int b = 0; b < N / kXBox<N>; ++b) {
      tma_load_2d(dst + b * kXBox<N> * kChunk, &x_map, chunk_x(c), b * kXBox<N>, &full[stage]);
    }
  };
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) mbar_init(&full[s], 1);
    // The barriers' initialisation made visible to the copy engine (the async proxy).
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  // A programmatic launch (launch_n) may start while the kernel that writes x (and x_scale)
  // still runs: the weights of the first stages do not depend on it and load before the
  // wait; x, x_scale and y only after it.
  if (tid == 0) {
    for (int s = 0; s < S && s < count; ++s) issue_w(s, s);
  }
  ::treeserve::detail::pdl_wait();
  if (tid == 0) {
    for (int s = 0; s < S && s < count; ++s) issue_x(s, s);
  }

  // Hopper's FP8 tensor cores keep fewer mantissa bits than float32 while they accumulate
  // (about 2^-14 of the running sum): each chunk's four k32 steps start from zero in `part`
  // and are added into float32 `acc` by the CUDA cores (promotion every 128 of K, as cuBLAS
  // and CUTLASS do without "fast accumulation").
  // x's rows go through the tensor cores in segments of up to 128 (one wgmma n128 each, the
  // last one N % 128 wide): `part` holds one segment, `acc` every row.
  constexpr int kPart = N < 128 ? N : 128;
  float acc[N / 2], part[kPart / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < kPart / 2; ++i) part[i] = 0.0f;
  // Warpgroup wg multiplies w rows [64 wg, 64 wg + 64) of the tile.
  const int wg = warp >> 2;
  for (int c = 0; c < count; ++c) {
    const int stage = c % S;
    mbar_wait(&full[stage], (c / S) & 1);
    const uint32_t tile = smem_u32(smem + stage * kStageBytes);
    mma_segments<N>(acc, part, tile, wg);
    __syncthreads();  // every warpgroup is done with the stage: refill it
    if (tid == 0 && c + S < count) {
      issue_w(c + S, stage);
      issue_x(c + S, stage);
    }
  }
  // The next kernel (a row kernel, itself waiting for this grid) may be scheduled now.
  ::treeserve::detail::pdl_trigger();

  // Partial sums into this CTA's shared memory: red[x row][w row of the tile]. The
  // accumulators of x rows 8 j.. are acc[4 j..]: (w row, x row) (r, 2t), (r, 2t + 1),
  // (r + 8, 2t), (r + 8, 2t + 1) with r = 16 warp + g (wgmma's m64nN layout).
  float* red = reinterpret_cast<float*>(smem);
  const int wr = warp * 16 + g;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const int r0 = 8 * j + 2 * t;
    red[r0 * kRedStride + wr] = acc[4 * j];
    red[(r0 + 1) * kRedStride + wr] = acc[4 * j + 1];
    red[r0 * kRedStride + wr + 8] = acc[4 * j + 2];
    red[(r0 + 1) * kRedStride + wr + 8] = acc[4 * j + 3];
  }
  cluster.sync();
  // CTA `split` finishes x rows split, split + splits, ...: the parts summed in rank order,
  // every part's load issued before the first add (one remote round trip a cell, not one a
  // part).
  const float* parts[kMaxCluster];
#pragma unroll
  for (int q = 0; q < kMaxCluster; ++q)
    parts[q] = q < splits ? cluster.map_shared_rank(red, q) : red;
  const int rows_here = m > split ? (m - split + splits - 1) / splits : 0;
  for (int i = tid; i < rows_here * kBlockCols; i += kThreads) {
    const int xr = split + (i / kBlockCols) * splits;
    const int wc = i % kBlockCols;
    const int at = xr * kRedStride + wc;
    float v[kMaxCluster];
#pragma unroll
    for (int q = 0; q < kMaxCluster; ++q) v[q] = q < splits ? parts[q][at] : 0.0f;
    float sum = v[0];
#pragma unroll
    for (int q = 1; q < kMaxCluster; ++q) {
      if (q < splits) sum += v[q];
    }
    const int col = col0 + wc;
    store_out(y, int64_t(xr) * n + col, sum * x_scale[xr] * w_scale[col]);
  }
  cluster.sync();  // the others' shared memory stays until every CTA has read it
}

// cuTensorMapEncodeTiled from the driver (the runtime has no wrapper; no link to libcuda).
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A row-major byte matrix [rows][cols] read in boxes of box_rows x 128 bytes, 128-byte swizzle;
// rows past the end read as zeros.
bool byte_matrix_map(CUtensorMap* map, const void* base, int64_t rows, int64_t cols,
                     uint32_t box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(cols)};
  const cuuint32_t box[2] = {uint32_t(kChunk), box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int N, typename Out>
cudaError_t launch_n(const uint8_t* x, const float* xs, const uint8_t* w, const float* ws, Out* y,
                     int64_t m, int64_t n, int64_t k, int splits, cudaStream_t stream) {
  CUtensorMap w_map, x_map;
  if (!byte_matrix_map(&w_map, w, n, k, kBlockCols) ||
      !byte_matrix_map(&x_map, x, m, k, kXBox<N>)) {
    return cudaErrorInvalidValue;
  }
  auto kernel = fp8_gemm_rows_kernel<N, Out>;
  constexpr int smem = smem_bytes<N>();
  // The shared-memory limit is raised once per device (a host call on every launch would
  // cost more than the smaller GEMMs take).
  static std::atomic<uint64_t> raised{0};
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const uint64_t bit = uint64_t(1) << (device & 63);
  if ((raised.load(std::memory_order_acquire) & bit) == 0) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    raised.fetch_or(bit, std::memory_order_acq_rel);
  }
  // A cluster of the column block's K ranges, as a programmatic dependent launch: the kernel
  // waits for the previous one before it touches x, so its prologue and first weight loads
  // overlap it.
  return ::treeserve::detail::launch_pdl_cluster(
      dim3(unsigned(n / kBlockCols), unsigned(splits), 1), dim3(kThreads, 1, 1), size_t(smem),
      stream, dim3(1, unsigned(splits), 1), kernel, w_map, x_map, xs, ws, y, int(m), int(n),
      int(k));
}

template <typename Out>
cudaError_t launch_out(const uint8_t* x, const float* xs, const uint8_t* w, const float* ws, Out* y,
                       int64_t m, int64_t n, int64_t k, int splits, cudaStream_t stream) {
  if (m <= 8) return launch_n<8>(x, xs, w, ws, y, m, n, k, splits, stream);
  if (m <= 16) return launch_n<16>(x, xs, w, ws, y, m, n, k, splits, stream);
  if (m <= 32) return launch_n<32>(x, xs, w, ws, y, m, n, k, splits, stream);
  if (m <= 64) return launch_n<64>(x, xs, w, ws, y, m, n, k, splits, stream);
  if (m <= 128) return launch_n<128>(x, xs, w, ws, y, m, n, k, splits, stream);
  // The row buckets the GEMM tuner times (engine/detail/cuda_gemm.h gemm_rows_bucket) past 128:
  // t + 1 rows of a speculative tree of t = 128 or 256 fall in 144 and 272.
  if (m <= 144) return launch_n<144>(x, xs, w, ws, y, m, n, k, splits, stream);
  if (m <= 192) return launch_n<192>(x, xs, w, ws, y, m, n, k, splits, stream);
  if (m <= 256) return launch_n<256>(x, xs, w, ws, y, m, n, k, splits, stream);
  return launch_n<272>(x, xs, w, ws, y, m, n, k, splits, stream);
}

}  // namespace

bool fp8_gemm_rows_fits(int64_t m, int64_t n, int64_t k, const void* x, const void* w,
                        const void* y) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return m >= 1 && m <= kFp8GemmRowsMaxM && n >= kBlockCols && n % kBlockCols == 0 && k >= kChunk &&
         k % kChunk == 0 && n <= (int64_t(1) << 30) / 8 && k <= (int64_t(1) << 24) && aligned(x) &&
         aligned(w) && aligned(y);
}

int fp8_gemm_rows_max_splits(int64_t k) {
  return int(std::max<int64_t>(1, std::min<int64_t>(kMaxCluster, k / kChunk)));
}

int fp8_gemm_rows_splits(int64_t n, int64_t k) {
  const int64_t blocks = n / kBlockCols;
  // Two CTAs per SM on a 132-SM H100/H200: enough K ranges per column block to fill them.
  const int64_t s = blocks > 0 ? 264 / blocks : 1;
  return int(std::max<int64_t>(1, std::min<int64_t>(s, fp8_gemm_rows_max_splits(k))));
}

cudaError_t fp8_gemm_rows(const uint8_t* x, const float* x_scale, const uint8_t* w,
                          const float* w_scale, void* y, Fp8Out out, int64_t m, int64_t n,
                          int64_t k, int splits, cudaStream_t stream) {
  if (m == 0) return cudaSuccess;
  if (!fp8_gemm_rows_fits(m, n, k, x, w, y) || splits < 1 || splits > fp8_gemm_rows_max_splits(k)) {
    return cudaErrorInvalidValue;
  }
  switch (out) {
    case Fp8Out::kFloat16:
      return launch_out(x, x_scale, w, w_scale, static_cast<__half*>(y), m, n, k, splits, stream);
    case Fp8Out::kBFloat16:
      return launch_out(x, x_scale, w, w_scale, static_cast<__nv_bfloat16*>(y), m, n, k, splits,
                        stream);
    case Fp8Out::kFloat32:
      return launch_out(x, x_scale, w, w_scale, static_cast<float*>(y), m, n, k, splits, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace treeserve::cuda
