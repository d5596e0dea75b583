// FP8 (OCP e4m3, "float8_e4m3fn": 1 sign, 4 exponent, 3 mantissa bits, bias 7, no infinities,
// 0x7f / 0xff NaN, largest finite 448) for the weights of linear layers and their
// activations, and the quantization rule every part of treeserve applies identically (the
// loader's quantize-at-load, the CUDA kernels, the CPU backend's emulation, the test
// checkpoints' generator), so that the same matrix gives the same bytes everywhere:
//
//   scale = amax / 448           (float32; amax = the largest |x| of the row or tensor;
//                                 scale = 1 when amax is 0)
//   q     = e4m3(x / scale)      (float32 division, then round to nearest even, saturating
//                                 to +-448; NaN stays NaN)
//   x     ~ float(q) * scale
//
// It is what PyTorch computes with (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn) for
// scale = x.abs().amax(...).float() / 448.
#pragma once

#include <cstdint>

namespace treeserve {

inline constexpr float kFp8E4m3Max = 448.0f;

// x to e4m3, round to nearest even, saturating finite values to +-448; NaN to 0x7f (sign
// kept).
uint8_t float_to_e4m3(float x);
// Exact (every e4m3 value is a float32).
float e4m3_to_float(uint8_t bits);

// The scale of a row or tensor whose largest |x| is amax (amax / 448; 1 for 0).
float fp8_scale(float amax);

// The FP8 KV cache's rule (kernels/kv_layout.h): one scale per (token, kv head) row of K or V,
// the smallest power of two at or above amax / 448 (the float32 quotient; 1 for amax 0, 2^-126
// where the quotient is below that), and q = e4m3(x / scale), saturating. A power-of-two scale
// costs no precision inside e4m3's normal range (the row's largest value quantizes into
// [224, 448]) and makes float(q) * scale exact in fp16 whenever the product is a normal fp16
// value, so attention dequantizes an fp16 pool's tiles with one packed fp16 multiply.
float fp8_kv_scale(float amax);
// Per-row quantization of x [rows][cols] by that rule.
void quantize_fp8_kv_rows(const float* x, int64_t rows, int64_t cols, uint8_t* q, float* scale);

// Per-row ("channel") quantization of w [rows][cols]: scale[r] = fp8_scale(amax of row r),
// q[r][c] = float_to_e4m3(w[r][c] / scale[r]).
void quantize_fp8_rows(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scale);
// Per-tensor: one scale for the whole matrix.
void quantize_fp8_tensor(const float* w, int64_t n, uint8_t* q, float* scale);

}  // namespace treeserve
