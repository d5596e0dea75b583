// The CPU backend's dense operators, float32 throughout: embedding gather, RMSNorm, RoPE
// (HF Llama rotate-half convention), GEMM against HF-layout [out][in] weights, SwiGLU, and
// the FP8 quantize-dequantize of linear layers' inputs.
// Plain functions over raw pointers with the shapes in comments, so the layer loop in
// cpu_backend.cpp reads like the model and each op can be tested alone.
#pragma once

#include <cstdint>

namespace treeserve {

class ThreadPool;

// out[r][:] = table[token_ids[r]][:].  table [vocab][hidden], out [rows][hidden].
void embed_rows(const float* table, const int32_t* token_ids, int64_t rows, int64_t hidden,
                float* out);

// HF LlamaRMSNorm in float32: out = weight * (x * rsqrt(mean(x^2) + eps)).
// x, out [rows][hidden] (may alias), weight [hidden].
void rms_norm(const float* x, const float* weight, int64_t rows, int64_t hidden, float eps,
              float* out);

// cos/sin of position * inv_freq, as HF computes them: the angle is rounded to float32
// first (HF multiplies in float32), then cos/sin are taken.
// positions [rows], inv_freq [half], cos_out / sin_out [rows][half].
void rope_cos_sin(const int32_t* positions, int64_t rows, const float* inv_freq, int64_t half,
                  float* cos_out, float* sin_out);

// In-place rotate-half RoPE of `heads` heads of each row: with d = head_dim, h = d/2,
//   x'[i]     = x[i] * cos[i] - x[i + h] * sin[i]
//   x'[i + h] = x[i + h] * cos[i] + x[i] * sin[i]        for i in [0, h).
// x: row r, head j starts at x + r * row_stride + j * head_dim. cos/sin [rows][h].
void apply_rope(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                const float* cos, const float* sin);

// y = x · Wᵀ: y[m][n] = sum_k x[m][k] * w[n][k].  x [M][K] (row stride ldx), w [N][K]
// (row-major, HF nn.Linear layout), y [M][N] (row stride ldy). Multi-threaded over n.
// Batch invariant: y[m][n] depends only on row m of x and row n of w (a fixed 8-lane
// accumulation order over k), never on M, the tiling or the thread count, so a sequence's
// logits do not change with what else is in the batch.
void gemm_xwt(ThreadPool* pool, const float* x, int64_t ldx, const float* w, float* y, int64_t ldy,
              int64_t M, int64_t N, int64_t K);

// SwiGLU: out[m][i] = silu(gu[m][i]) * gu[m][I + i], silu(g) = g / (1 + exp(-g)).
// gu [M][2I] (gate then up, as the fused gate_up GEMM writes it), out [M][I].
void swiglu(const float* gu, int64_t M, int64_t I, float* out);

// x[i] += delta[i], i in [0, n).
void add_inplace(float* x, const float* delta, int64_t n);

// FP8 emulation of a linear layer's input (models/fp8.h's rule): each row of x [rows][cols]
// quantized with its own scale s = fp8_scale(amax of the row) (dynamic per token) and
// dequantized: out = e4m3_to_float(float_to_e4m3(x / s)) * s. x and out may alias.
void fp8_fake_quantize_rows(const float* x, int64_t rows, int64_t cols, float* out);

// The FP8 KV cache's emulation: the same per row with fp8_kv_scale (a power of two) instead.
void fp8_kv_fake_quantize_rows(const float* x, int64_t rows, int64_t cols, float* out);

// The same with one static scale (the checkpoint's input_scale) for all n values.
void fp8_fake_quantize_static(const float* x, int64_t n, float scale, float* out);

}  // namespace treeserve
