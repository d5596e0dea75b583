// FP8 (e4m3) quantization kernels of the CUDA backend (cuda_fp8.cu), with models/fp8.h's rule
// bit for bit: scale = amax / 448 (1 when amax is 0), q = e4m3(x / scale), round to nearest
// even and saturating, every division an IEEE float32 division. Plain C++ launchers, like
// cuda_ops.h (the GEMM's returns cudaError_t); none allocates.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "engine/cuda_ops.h"

namespace treeserve::cuda {

// Per row r of x (T [rows][cols], T the model dtype):
// scale[r] = amax(|x[r]|) / 448 (1 for a zero row), q[r][c] = e4m3(x[r][c] / scale[r]).
// Weights at load (one scale per output channel) and activations per token.
void quantize_rows_fp8(Dtype dt, const void* x, int64_t rows, int64_t cols, uint8_t* q,
                       float* scale, cudaStream_t stream);

// The same for float32 rows (tests compare it with models/fp8.h's quantize_fp8_rows).
void quantize_rows_fp8_f32(const float* x, int64_t rows, int64_t cols, uint8_t* q, float* scale,
                           cudaStream_t stream);

// A static activation scale (*s, a device scalar, the checkpoint's input_scale):
// q[r][c] = e4m3(x[r][c] / *s) and row_scale[r] = *s, so the GEMM's per-row scales serve
// both schemes.
void quantize_rows_fp8_static(Dtype dt, const void* x, int64_t rows, int64_t cols, const float* s,
                              uint8_t* q, float* row_scale, cudaStream_t stream);

// x (float [n]) = e4m3 value of q[i] times scale[i / cols]: dequantized rows (tests).
void dequantize_rows_fp8(const uint8_t* q, const float* scale, int64_t rows, int64_t cols, float* x,
                         cudaStream_t stream);

// The FP8 GEMM for decode-sized row counts (cuda_fp8_gemm.cu):
// y [m][n] = (x [m][k] . w [n][k]^T) * x_scale[m] * w_scale[n], x and w e4m3, float32
// accumulation, y fp16, bf16 or float32 (row-major, ld n). Each 128-column block of y is
// computed by `splits` CTAs (a thread-block cluster) over near-equal runs of K, their partial
// sums added in a fixed order: the same inputs and splits give the same bits.
enum class Fp8Out : int32_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };
// Up to the GEMM tuner's 272-row bucket (a speculative tree of 256 and its root).
inline constexpr int64_t kFp8GemmRowsMaxM = 272;
// Without tuning the kernel runs up to this many rows, where it measured at least as fast as
// cublasLt's heuristic choice on every Llama-3-8B projection (H200); beyond, cublasLt's
// 128 x 128 tiles keep the tensor cores busier than its one wgmma chain per chunk.
inline constexpr int64_t kFp8GemmRowsDefaultMaxM = 64;
// Whether the kernel serves the shape: 1 <= m <= kFp8GemmRowsMaxM, n a multiple of 128, k of
// 128, every pointer 16-byte aligned.
bool fp8_gemm_rows_fits(int64_t m, int64_t n, int64_t k, const void* x, const void* w,
                        const void* y);
// The most K ranges a column block may be cut into: 8 (a portable cluster), at most k / 128.
int fp8_gemm_rows_max_splits(int64_t k);
// The split count the kernel is meant to run with for (n, k): 128-column blocks times splits
// near two CTAs per SM, at most fp8_gemm_rows_max_splits(k).
int fp8_gemm_rows_splits(int64_t n, int64_t k);
// cudaErrorInvalidValue when the shape does not fit or splits is outside
// [1, fp8_gemm_rows_max_splits(k)]; otherwise the launch's error.
cudaError_t fp8_gemm_rows(const uint8_t* x, const float* x_scale, const uint8_t* w,
                          const float* w_scale, void* y, Fp8Out out, int64_t m, int64_t n,
                          int64_t k, int splits, cudaStream_t stream);

}  // namespace treeserve::cuda
