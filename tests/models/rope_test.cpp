// rope_inv_freq against the formulas evaluated here in long double (plain RoPE and
// Llama-3.x "llama3" scaling), plus the exact structure of the llama3 bands: high
// frequencies untouched, low frequencies divided by factor, a smooth blend between.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "models/model_config.h"

namespace treeserve {
namespace {

using Real = long double;

ModelConfig rope_config(int64_t head_dim, double theta) {
  ModelConfig c;
  c.head_dim = head_dim;
  c.rope_theta = theta;
  return c;
}

ModelConfig llama3_config(int64_t head_dim, double theta, double factor, double low, double high,
                          int64_t original_max) {
  ModelConfig c = rope_config(head_dim, theta);
  c.rope_scaling.type = RopeType::kLlama3;
  c.rope_scaling.factor = factor;
  c.rope_scaling.low_freq_factor = low;
  c.rope_scaling.high_freq_factor = high;
  c.rope_scaling.original_max_position_embeddings = original_max;
  return c;
}

// theta^(-2i/d), the RoFormer definition.
std::vector<Real> reference_plain(int64_t head_dim, Real theta) {
  std::vector<Real> out;
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    out.push_back(std::pow(theta, -Real(2 * i) / Real(head_dim)));
  }
  return out;
}

// Meta's apply_scaling from the Llama-3.1 reference code, in long double.
std::vector<Real> reference_llama3(const ModelConfig& c) {
  std::vector<Real> out = reference_plain(c.head_dim, c.rope_theta);
  const RopeScaling& s = c.rope_scaling;
  const Real old_len = Real(s.original_max_position_embeddings);
  const Real low_wavelen = old_len / s.low_freq_factor;
  const Real high_wavelen = old_len / s.high_freq_factor;
  for (Real& f : out) {
    const Real wavelen = 2 * std::acos(Real(-1)) / f;
    if (wavelen < high_wavelen) continue;
    if (wavelen > low_wavelen) {
      f /= s.factor;
      continue;
    }
    const Real smooth =
        (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    f = (1 - smooth) * f / s.factor + smooth * f;
  }
  return out;
}

// float32 evaluation in torch's op order gives a few ulps of rounding against the exact
// value; 1e-6 relative is ~8 ulps.
void expect_close(const std::vector<float>& got, const std::vector<Real>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], static_cast<double>(want[i]), 1e-6 * static_cast<double>(want[i]))
        << "i=" << i;
  }
}

TEST(RopeInvFreqTest, PlainMatchesFormula) {
  for (int64_t head_dim : {8, 64, 128}) {
    for (double theta : {10000.0, 500000.0, 1000000.0}) {
      const std::vector<float> got = rope_inv_freq(rope_config(head_dim, theta));
      ASSERT_EQ(got.size(), static_cast<size_t>(head_dim / 2));
      EXPECT_EQ(got[0], 1.0f);
      expect_close(got, reference_plain(head_dim, theta));
    }
  }
}

TEST(RopeInvFreqTest, KnownValues) {
  // 10000^(-1/64) and 10000^(-63/64), worked out by hand: 10^(-1/16) and 10^(-63/16).
  const std::vector<float> f = rope_inv_freq(rope_config(128, 10000.0));
  EXPECT_NEAR(f[1], 0.865964323360065, 1e-7);
  EXPECT_NEAR(f[63], 1.154781984689458e-4, 1e-10);
}

TEST(RopeInvFreqTest, Llama31MatchesReference) {
  const ModelConfig c = llama3_config(128, 500000.0, 8.0, 1.0, 4.0, 8192);
  expect_close(rope_inv_freq(c), reference_llama3(c));
}

TEST(RopeInvFreqTest, Llama32MatchesReference) {
  const ModelConfig c = llama3_config(64, 500000.0, 32.0, 1.0, 4.0, 8192);
  expect_close(rope_inv_freq(c), reference_llama3(c));
}

TEST(RopeInvFreqTest, Llama3BandsOnTinyModelShape) {
  // The tiny model: head_dim 64, theta 1e4, factor 8, original context 256, so
  // wavelengths below 64 are kept, above 256 divided by 8, and i = 9..12 blended.
  const ModelConfig c = llama3_config(64, 10000.0, 8.0, 1.0, 4.0, 256);
  const std::vector<float> scaled = rope_inv_freq(c);
  const std::vector<float> plain = rope_inv_freq(rope_config(64, 10000.0));
  const std::vector<Real> want = reference_llama3(c);
  expect_close(scaled, want);
  int kept = 0, divided = 0, blended = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    const double wavelen = 2 * M_PI / plain[i];
    if (wavelen < 64) {
      EXPECT_EQ(scaled[i], plain[i]) << i;
      ++kept;
    } else if (wavelen > 256) {
      EXPECT_EQ(scaled[i], plain[i] / 8.0f) << i;
      ++divided;
    } else {
      EXPECT_LT(scaled[i], plain[i]) << i;
      EXPECT_GT(scaled[i], plain[i] / 8.0f) << i;
      ++blended;
    }
  }
  EXPECT_EQ(kept, 9);
  EXPECT_EQ(blended, 4);
  EXPECT_EQ(divided, 19);
}

TEST(RopeInvFreqTest, FactorOneIsPlain) {
  const ModelConfig c = llama3_config(64, 10000.0, 1.0, 1.0, 4.0, 256);
  const std::vector<float> scaled = rope_inv_freq(c);
  const std::vector<float> plain = rope_inv_freq(rope_config(64, 10000.0));
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_NEAR(scaled[i], plain[i], 1e-7 * plain[i]);
}

}  // namespace
}  // namespace treeserve
