// e4m3 conversion by bit manipulation and the quantization rule of models/fp8.h.
#include "models/fp8.h"

#include <bit>
#include <cmath>

namespace treeserve {
namespace {

// value >> shift, rounded to nearest, ties to even (shift in [1, 63]).
uint64_t shift_round_even(uint64_t value, int shift) {
  const uint64_t kept = value >> shift;
  const uint64_t rest = value & ((uint64_t{1} << shift) - 1);
  const uint64_t half = uint64_t{1} << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1))) ? 1 : 0);
}

}  // namespace

uint8_t float_to_e4m3(float x) {
  const uint32_t b = std::bit_cast<uint32_t>(x);
  const uint8_t sign = uint8_t((b >> 24) & 0x80u);
  const uint32_t magnitude = b & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7f;  // NaN
  // 448 and above (infinity included) saturate; below, round to nearest even can reach 448
  // at most, never the NaN code.
  if (magnitude >= std::bit_cast<uint32_t>(kFp8E4m3Max)) return sign | 0x7e;
  const int exponent = int(magnitude >> 23) - 127;
  if (exponent >= -6) {
    // Normal in e4m3: keep 3 of the 23 mantissa bits; a carry out of the mantissa raises the
    // exponent, which the subtraction below carries along. (127 - 7) rebiases 8 -> 4 bits.
    const uint32_t rounded = uint32_t(shift_round_even(magnitude, 20));
    return sign | uint8_t(rounded - ((127u - 7u) << 3));
  }
  // Subnormal in e4m3 (|x| < 2^-6): the code is |x| / 2^-9 rounded to an integer, 0..8 (8 is
  // the smallest normal, 0x08). Float32 subnormals are far below half of 2^-9: zero.
  if ((magnitude >> 23) == 0) return sign;
  const uint64_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;  // |x| = mantissa * 2^(e-23)
  const int shift = 23 - 9 - exponent;                            // >= 21
  if (shift > 25) return sign;                                    // |x| < 2^-11: rounds to 0
  return sign | uint8_t(shift_round_even(mantissa, shift));
}

float e4m3_to_float(uint8_t bits) {
  const uint32_t sign = uint32_t(bits & 0x80u) << 24;
  const uint32_t exponent = (bits >> 3) & 0xfu;
  const uint32_t mantissa = bits & 0x7u;
  if (exponent == 0xf && mantissa == 0x7) return std::bit_cast<float>(sign | 0x7fc00000u);  // NaN
  if (exponent == 0) {
    // mantissa * 2^-9: exact in float32.
    const float v = float(mantissa) * (1.0f / 512.0f);
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exponent - 7 + 127) << 23) | (mantissa << 20));
}

float fp8_scale(float amax) { return amax == 0.0f ? 1.0f : amax / kFp8E4m3Max; }

namespace {

// Per-row quantization with the row scale scale_of(amax of the row).
void quantize_rows_with(float (*scale_of)(float), const float* x, int64_t rows, int64_t cols,
                        uint8_t* q, float* scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    float amax = 0.0f;
    for (int64_t c = 0; c < cols; ++c) amax = std::fmax(amax, std::fabs(row[c]));
    const float s = scale_of(amax);
    scale[r] = s;
    uint8_t* out = q + r * cols;
    for (int64_t c = 0; c < cols; ++c) out[c] = float_to_e4m3(row[c] / s);
  }
}

}  // namespace

void quantize_fp8_rows(const float* w, int64_t rows, int64_t cols, uint8_t* q, float* scale) {
  quantize_rows_with(fp8_scale, w, rows, cols, q, scale);
}

float fp8_kv_scale(float amax) {
  if (amax == 0.0f) return 1.0f;
  // Round the quotient up to a power of two: keep its exponent, and add one where any mantissa
  // bit is set (a subnormal quotient becomes 2^-126, and so does one that rounds to zero).
  uint32_t bits = std::bit_cast<uint32_t>(amax / kFp8E4m3Max);
  if ((bits & 0x7fffffffu) == 0) return 0x1p-126f;
  if ((bits & 0x7fffffu) != 0) bits = (bits & 0x7f800000u) + 0x800000u;
  return std::bit_cast<float>(bits);
}

void quantize_fp8_kv_rows(const float* x, int64_t rows, int64_t cols, uint8_t* q, float* scale) {
  quantize_rows_with(fp8_kv_scale, x, rows, cols, q, scale);
}

void quantize_fp8_tensor(const float* w, int64_t n, uint8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(w[i]));
  const float s = fp8_scale(amax);
  *scale = s;
  for (int64_t i = 0; i < n; ++i) q[i] = float_to_e4m3(w[i] / s);
}

}  // namespace treeserve
