// models/fp8.h against an independent reference: e4m3 decoded from the OCP definition
// (value = (-1)^s * 2^(e-7) * (1 + m/8), subnormals 2^-6 * m/8, 0x7f/0xff NaN), and float to
// e4m3 as the nearest of the 254 finite values found by searching them (ties to the even
// mantissa, |x| >= 448 saturating, NaN to NaN). quantize_fp8_rows / quantize_fp8_tensor are
// checked bit for bit against the same reference applied elementwise.
#include "models/fp8.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "models/quantization.h"

namespace treeserve {
namespace {

uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }
float from_bits(uint32_t b) { return std::bit_cast<float>(b); }

// The OCP 8-bit floating point specification's E4M3 value of a code, in double.
double ocp_e4m3(uint8_t code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -magnitude : magnitude;
}

// Nearest e4m3 by search: the finite codes 0x00..0x7e, sign applied after. Distances in double
// are exact for the two codes that bracket |x| (they lie within a factor of 2 of |x|, or one
// is 0), so ties are real ties.
uint8_t reference_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return sign | 0x7f;
  const double a = std::fabs(double(x));
  if (a >= 448.0) return sign | 0x7e;  // saturating (infinity included)
  int best = 0;
  double best_distance = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    const double d = std::fabs(a - ocp_e4m3(uint8_t(c)));
    if (d < best_distance || (d == best_distance && c % 2 == 0)) {
      best = c;
      best_distance = d;
    }
  }
  return sign | uint8_t(best);
}

void expect_converts(float x) {
  ASSERT_EQ(int(float_to_e4m3(x)), int(reference_e4m3(x)))
      << "x = " << x << " (bits 0x" << std::hex << bits(x) << ")";
}

TEST(Fp8, DecodesEveryCodeAsTheOcpDefinition) {
  for (int c = 0; c < 256; ++c) {
    const double want = ocp_e4m3(uint8_t(c));
    const float got = e4m3_to_float(uint8_t(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
      EXPECT_EQ(std::signbit(got), c >= 0x80) << c;
      continue;
    }
    EXPECT_EQ(double(got), want) << "code " << c;
    EXPECT_EQ(std::signbit(got), c >= 0x80) << "code " << c;
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
}

TEST(Fp8, EncodesEveryValueMidpointAndNeighbour) {
  for (int c = 0; c < 256; ++c) {
    const double v = ocp_e4m3(uint8_t(c));
    if (std::isnan(v)) continue;
    // Every finite value maps to its own code (0x80 is -0).
    EXPECT_EQ(int(float_to_e4m3(float(v))), c) << v;
    expect_converts(float(v));
    expect_converts(std::nextafter(float(v), 0.0f));
    expect_converts(std::nextafter(float(v), float(v < 0 ? -1e9 : 1e9)));
  }
  for (int c = 0; c < 0x7e; ++c) {
    // Midpoints of neighbours (exact in float32: 5 significant bits), and the floats on
    // either side of each.
    for (const double sign : {1.0, -1.0}) {
      const float mid = float(sign * (ocp_e4m3(uint8_t(c)) + ocp_e4m3(uint8_t(c + 1))) / 2.0);
      expect_converts(mid);
      expect_converts(std::nextafter(mid, 0.0f));
      expect_converts(std::nextafter(mid, mid * 2.0f));
    }
  }
  // Ties go to the even mantissa: 1 + 1/16 is between 1 (0x38) and 1.125 (0x39).
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3a);                 // between 0x39 and 0x3a
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);   // half the smallest subnormal
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.5f, -9)), 0x02);    // between 0x01 and 0x02
  EXPECT_EQ(float_to_e4m3(std::ldexp(15.0f, -10)), 0x08);  // 7.5 * 2^-9 -> 2^-6
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
}

TEST(Fp8, SubnormalsSaturationAndNan) {
  // Every subnormal step of e4m3 and the values between, both signs.
  for (int i = 0; i <= 8 * 16; ++i) {
    const float x = std::ldexp(float(i), -13);  // steps of 2^-13 across [0, 2^-6]
    expect_converts(x);
    expect_converts(-x);
  }
  for (float x : {std::ldexp(1.0f, -149), std::ldexp(1.0f, -126), std::ldexp(1.0f, -12),
                  std::ldexp(1.0f, -11), std::nextafter(std::ldexp(1.0f, -10), 1.0f)}) {
    expect_converts(x);
    expect_converts(-x);
  }
  for (float x : {448.0f, 449.0f, 464.0f, 465.0f, 480.0f, 1e6f, 3.4e38f,
                  std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(float_to_e4m3(x), 0x7e) << x;
    EXPECT_EQ(float_to_e4m3(-x), 0xfe) << x;
    expect_converts(x);
    expect_converts(-x);
  }
  EXPECT_EQ(float_to_e4m3(std::nextafter(448.0f, 0.0f)), 0x7e);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(float_to_e4m3(nan), 0x7f);
  EXPECT_EQ(float_to_e4m3(-nan), 0xff);
  EXPECT_EQ(float_to_e4m3(from_bits(0x7f800001u)), 0x7f);  // signalling NaN
  EXPECT_EQ(float_to_e4m3(from_bits(0xffc00000u)), 0xff);
}

TEST(Fp8, EncodesMillionsOfRandomFloats) {
  std::mt19937_64 rng(0xf8e4);
  // Any bit pattern (mostly far outside e4m3's range: saturation and flush to zero).
  for (int i = 0; i < 1'000'000; ++i) expect_converts(from_bits(uint32_t(rng())));
  // Magnitudes across e4m3's range and a little beyond, every mantissa bit random.
  std::uniform_int_distribution<int> exponent(-13, 9);
  for (int i = 0; i < 3'000'000; ++i) {
    const uint64_t r = rng();
    const uint32_t b = uint32_t(r & 0x807fffffu) | (uint32_t(exponent(rng) + 127) << 23);
    expect_converts(from_bits(b));
  }
}

TEST(Fp8, ScaleRule) {
  EXPECT_EQ(fp8_scale(0.0f), 1.0f);
  EXPECT_EQ(fp8_scale(448.0f), 1.0f);
  EXPECT_EQ(fp8_scale(1.0f), 1.0f / 448.0f);
  EXPECT_EQ(bits(fp8_scale(3.0f)), bits(3.0f / 448.0f));
  EXPECT_STREQ(quant_scheme_name(QuantScheme::kNone), "none");
  EXPECT_STREQ(quant_scheme_name(QuantScheme::kFp8), "fp8");
}

// A random matrix whose rows span magnitudes from 1e-4 to 1e3, with one all-zero row.
std::vector<float> random_matrix(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_gain(-4.0f, 3.0f);
  std::vector<float> w(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float gain = r == 3 ? 0.0f : std::pow(10.0f, log_gain(rng));
    for (int64_t c = 0; c < cols; ++c) w[size_t(r * cols + c)] = gain * normal(rng);
  }
  return w;
}

// The rule computed independently: amax, amax / 448 (1 for 0) and x / scale in double, each
// rounded once to float32 (a float32 quotient computed in double and rounded is the
// correctly rounded float32 quotient), then the search reference.
float reference_scale(const float* x, int64_t n) {
  double amax = 0.0;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(double(x[i])));
  return amax == 0.0 ? 1.0f : float(amax / 448.0);
}

TEST(Fp8, QuantizeRowsMatchesTheReferenceBitForBit) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{17, 64}, {64, 33}, {5, 1}}) {
    const std::vector<float> w = random_matrix(rows, cols, uint64_t(rows * 131 + cols));
    std::vector<uint8_t> q(w.size());
    std::vector<float> scale(static_cast<size_t>(rows));
    quantize_fp8_rows(w.data(), rows, cols, q.data(), scale.data());
    for (int64_t r = 0; r < rows; ++r) {
      const float s = reference_scale(w.data() + r * cols, cols);
      ASSERT_EQ(bits(scale[size_t(r)]), bits(s)) << "row " << r;
      for (int64_t c = 0; c < cols; ++c) {
        const float x = w[size_t(r * cols + c)];
        ASSERT_EQ(int(q[size_t(r * cols + c)]), int(reference_e4m3(float(double(x) / s))))
            << "row " << r << " col " << c << " x " << x;
      }
    }
    if (rows > 3) {  // the all-zero row: scale 1, codes 0
      EXPECT_EQ(scale[3], 1.0f);
      for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(e4m3_to_float(q[size_t(3 * cols + c)]), 0.0f);
    }
  }
}

TEST(Fp8, QuantizeTensorMatchesTheReferenceBitForBit) {
  for (const int64_t n : {int64_t{1}, int64_t{1000}, int64_t{65536}}) {
    std::vector<float> w = random_matrix(1, n, uint64_t(n));
    if (n > 1) {  // the amax may be a negative value
      float amax = 0.0f;
      for (float x : w) amax = std::max(amax, std::fabs(x));
      w[0] = -2.0f * amax;
    }
    std::vector<uint8_t> q(w.size());
    float scale = 0.0f;
    quantize_fp8_tensor(w.data(), n, q.data(), &scale);
    const float s = reference_scale(w.data(), n);
    ASSERT_EQ(bits(scale), bits(s));
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(int(q[size_t(i)]), int(reference_e4m3(float(double(w[size_t(i)]) / s)))) << i;
    }
    // The largest |x| maps to +-448 exactly.
    if (n > 1) {
      EXPECT_EQ(q[0], 0xfe);
    }
  }
  std::vector<float> zeros(8, 0.0f);
  std::vector<uint8_t> q(8, 0xaa);
  float scale = 0.0f;
  quantize_fp8_tensor(zeros.data(), 8, q.data(), &scale);
  EXPECT_EQ(scale, 1.0f);
  for (uint8_t b : q) EXPECT_EQ(b, 0x00);
}

// The FP8 KV cache's scale: the smallest power of two at or above amax / 448 (1 for 0), so a
// row's largest value quantizes into [224, 448] and no value saturates beyond rounding; the
// row quantizer applies it.
TEST(Fp8, KvScaleIsThePowerOfTwoAboveTheQuotient) {
  EXPECT_EQ(fp8_kv_scale(0.0f), 1.0f);
  EXPECT_EQ(fp8_kv_scale(448.0f), 1.0f);
  EXPECT_EQ(fp8_kv_scale(224.0f), 0.5f);
  EXPECT_EQ(fp8_kv_scale(225.0f), 1.0f);
  EXPECT_EQ(fp8_kv_scale(449.0f), 2.0f);
  EXPECT_EQ(fp8_kv_scale(448.0f * 0x1p-20f), 0x1p-20f);
  EXPECT_EQ(fp8_kv_scale(1e-40f), 0x1p-126f);  // a subnormal quotient
  EXPECT_EQ(fp8_kv_scale(1e-45f), 0x1p-126f);  // a quotient that rounds to zero
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> exponent(-30.0f, 15.0f);
  for (int i = 0; i < 10000; ++i) {
    const float amax = std::exp2(exponent(rng));
    const float s = fp8_kv_scale(amax);
    int e = 0;
    EXPECT_EQ(std::frexp(s, &e), 0.5f) << amax;  // a power of two
    EXPECT_GE(s, amax / 448.0f) << amax;
    EXPECT_LT(s / 2, amax / 448.0f) << amax;
  }
  const std::vector<float> row = {0.3f, -1.7f, 0.0f, 2.9f, -0.01f, 1e-4f, 2.5f, -2.9f};
  std::vector<uint8_t> q(row.size());
  float scale = 0.0f;
  quantize_fp8_kv_rows(row.data(), 1, int64_t(row.size()), q.data(), &scale);
  EXPECT_EQ(scale, 0x1p-7f);  // 2.9 / 448 = 0.00647, the next power of two 1/128
  for (size_t c = 0; c < row.size(); ++c) {
    EXPECT_EQ(q[c], float_to_e4m3(row[c] / scale)) << c;
    EXPECT_NEAR(e4m3_to_float(q[c]) * scale, row[c], std::fabs(row[c]) / 16 + 1e-3f) << c;
  }
}

}  // namespace
}  // namespace treeserve
