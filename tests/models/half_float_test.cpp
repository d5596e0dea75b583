// F16 / BF16 -> F32 conversion: all 65,536 bit patterns of each against the IEEE
// definition evaluated with ldexp (zeros, subnormals, normals, infinities, NaNs), and
// to_float on every dtype, from unaligned memory.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "models/fp8.h"
#include "models/safetensors.h"

namespace treeserve {
namespace {

uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }

// binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
double f16_reference(uint16_t h) {
  const int sign = h >> 15;
  const int exponent = (h >> 10) & 0x1F;
  const int mantissa = h & 0x3FF;
  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -24);  // subnormal: mantissa * 2^-14 / 2^10
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else {
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return sign ? -magnitude : magnitude;
}

// bfloat16: 1 sign, 8 exponent (bias 127), 7 mantissa bits.
double bf16_reference(uint16_t b) {
  const int sign = b >> 15;
  const int exponent = (b >> 7) & 0xFF;
  const int mantissa = b & 0x7F;
  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -133);  // 2^-126 / 2^7
  } else if (exponent == 255) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else {
    magnitude = std::ldexp(128 + mantissa, exponent - 134);
  }
  return sign ? -magnitude : magnitude;
}

TEST(HalfFloatTest, EveryF16PatternIsExact) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float got = f16_to_f32(static_cast<uint16_t>(h));
    const double want = f16_reference(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << h;
      ASSERT_EQ(std::signbit(got), (h & 0x8000) != 0) << std::hex << h;
      // The payload moves to the top of the float32 mantissa: quiet stays quiet.
      ASSERT_EQ(bits_of(got) & 0x7FFFFF, (h & 0x3FFu) << 13) << std::hex << h;
    } else {
      // Every half value is a float32 value: compare bits (this also checks -0).
      ASSERT_EQ(bits_of(got), bits_of(static_cast<float>(want))) << std::hex << h;
      ASSERT_EQ(static_cast<double>(got), want) << std::hex << h;
    }
  }
}

TEST(HalfFloatTest, F16SpecialValues) {
  EXPECT_EQ(f16_to_f32(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xC000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7BFF), 65504.0f);                  // largest finite
  EXPECT_EQ(f16_to_f32(0x0400), std::ldexp(1.0f, -14));     // smallest normal
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));     // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x03FF), std::ldexp(1023.0f, -24));  // largest subnormal
  EXPECT_EQ(f16_to_f32(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(bits_of(f16_to_f32(0x8000)), 0x80000000u);  // -0
  EXPECT_EQ(f16_to_f32(0x7C00), INFINITY);
  EXPECT_EQ(f16_to_f32(0xFC00), -INFINITY);
  EXPECT_EQ(bits_of(f16_to_f32(0x7E00)), 0x7FC00000u);  // the canonical quiet NaN
}

TEST(HalfFloatTest, EveryBf16PatternIsExact) {
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    const float got = bf16_to_f32(static_cast<uint16_t>(b));
    ASSERT_EQ(bits_of(got), b << 16) << std::hex << b;
    const double want = bf16_reference(static_cast<uint16_t>(b));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << b;
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << std::hex << b;
    }
  }
  EXPECT_EQ(bf16_to_f32(0x3F80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0x0001), std::ldexp(1.0f, -133));  // a float32 subnormal
  EXPECT_EQ(bf16_to_f32(0xFF80), -INFINITY);
}

TEST(HalfFloatTest, ToFloatEveryDtypeFromUnalignedMemory) {
  const std::vector<uint16_t> halves = {0x3C00, 0x0001, 0x83FF, 0x7C00, 0xFC00, 0x7E00, 0x0000};
  const std::vector<float> floats = {1.5f, -0.0f, std::ldexp(1.0f, -149), INFINITY, NAN};
  // One spare leading byte: data + 1 is misaligned for both element sizes.
  std::vector<unsigned char> buffer(1 + floats.size() * 4);

  TensorView view;
  view.shape = {static_cast<int64_t>(halves.size())};
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    std::memcpy(buffer.data() + 1, halves.data(), halves.size() * 2);
    view.dtype = dtype;
    view.data = buffer.data() + 1;
    view.nbytes = halves.size() * 2;
    std::vector<float> out(halves.size());
    to_float(view, out.data());
    for (size_t i = 0; i < halves.size(); ++i) {
      const float want = dtype == DType::kF16 ? f16_to_f32(halves[i]) : bf16_to_f32(halves[i]);
      EXPECT_EQ(bits_of(out[i]), bits_of(want)) << dtype_name(dtype) << " " << i;
    }
  }

  std::memcpy(buffer.data() + 1, floats.data(), floats.size() * 4);
  view.dtype = DType::kF32;
  view.shape = {static_cast<int64_t>(floats.size())};
  view.nbytes = floats.size() * 4;
  std::vector<float> out(floats.size());
  to_float(view, out.data());
  for (size_t i = 0; i < floats.size(); ++i) EXPECT_EQ(bits_of(out[i]), bits_of(floats[i])) << i;
}

TEST(HalfFloatTest, DtypeNamesAndSizes) {
  EXPECT_STREQ(dtype_name(DType::kF32), "F32");
  EXPECT_STREQ(dtype_name(DType::kF16), "F16");
  EXPECT_STREQ(dtype_name(DType::kBF16), "BF16");
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_STREQ(dtype_name(DType::kF8E4M3), "F8_E4M3");
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
}

TEST(HalfFloatTest, ToFloatF8E4M3IsEachCodesValue) {
  std::vector<unsigned char> codes(256);
  for (int c = 0; c < 256; ++c) codes[size_t(c)] = static_cast<unsigned char>(c);
  TensorView view;
  view.dtype = DType::kF8E4M3;
  view.shape = {16, 16};
  view.data = codes.data();
  view.nbytes = codes.size();
  std::vector<float> out(256);
  to_float(view, out.data());
  for (int c = 0; c < 256; ++c) {
    EXPECT_EQ(bits_of(out[size_t(c)]), bits_of(e4m3_to_float(uint8_t(c)))) << c;
  }
}

}  // namespace
}  // namespace treeserve
