// FP8 (e4m3) quantization kernels of the CUDA backend (cuda_fp8.cu), with models/fp8.h's rule
// bit for bit: scale = amax / 448 (1 when amax is 0), q = e4m3(x / scale), round to nearest
// even and saturating, every division an IEEE float32 division. Plain C++ launchers, like
// cuda_ops.h; none allocates.
#pragma once

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

}  // namespace treeserve::cuda
