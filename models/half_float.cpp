// F16 / BF16 / F8_E4M3 -> F32 conversion for TensorView (safetensors.h). Every half and e4m3
// value is exactly representable in float32, so these are exact bit manipulations.
#include <bit>
#include <cstring>

#include "models/fp8.h"
#include "models/safetensors.h"

namespace treeserve {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts need byte swaps here");

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {
    // Inf (mantissa 0) or NaN: keep the payload, high-aligned, so quiet stays quiet.
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;  // +-0
  } else {
    // Subnormal half: mantissa * 2^-24. Normalize: shift until the implicit bit
    // (bit 10) is set, lowering the exponent once per shift.
    int e = -1;
    do {
      mantissa <<= 1;
      ++e;
    } while ((mantissa & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mantissa & 0x3FFu) << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

float bf16_to_f32(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

void to_float(const TensorView& view, float* dst) {
  const size_t n = static_cast<size_t>(view.numel());
  switch (view.dtype) {
    case DType::kF32:
      std::memcpy(dst, view.data, n * sizeof(float));
      return;
    case DType::kF16:
    case DType::kBF16: {
      // The mapping is only guaranteed 2-byte aligned by the format's offsets (and
      // not even that): read each element with memcpy.
      const auto* src = static_cast<const unsigned char*>(view.data);
      const bool f16 = view.dtype == DType::kF16;
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, sizeof(h));
        dst[i] = f16 ? f16_to_f32(h) : bf16_to_f32(h);
      }
      return;
    }
    case DType::kF8E4M3: {
      const auto* src = static_cast<const unsigned char*>(view.data);
      for (size_t i = 0; i < n; ++i) dst[i] = e4m3_to_float(src[i]);
      return;
    }
  }
}

}  // namespace treeserve
