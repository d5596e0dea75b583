// Sampling: greedy, determinism of the counter-based draws, distribution sanity at
// temperature 1 (chi-square over many positions), top-k and top-p supports, logprobs, and
// parameter validation.
#include "engine/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace treeserve {
namespace {

std::vector<double> softmax(const std::vector<float>& logits, double temperature = 1.0) {
  const double mx = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0.0;
  for (size_t i = 0; i < p.size(); ++i) sum += (p[i] = std::exp((logits[i] - mx) / temperature));
  for (double& x : p) x /= sum;
  return p;
}

// Counts of tokens drawn at positions [0, n) with one seed and stream.
std::vector<int64_t> histogram(const std::vector<float>& logits, const SamplingParams& params,
                               int64_t n, uint64_t stream = 7) {
  SamplingScratch scratch;
  std::vector<int64_t> counts(logits.size(), 0);
  for (int64_t pos = 0; pos < n; ++pos) {
    ++counts[sample_token(logits.data(), int64_t(logits.size()), params, stream, pos, &scratch)
                 .token];
  }
  return counts;
}

// Pearson chi-square of counts against expected probabilities (zero-probability tokens must
// have zero counts).
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& p, int64_t n) {
  double chi = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has probability 0";
      continue;
    }
    const double e = p[i] * double(n);
    chi += (double(counts[i]) - e) * (double(counts[i]) - e) / e;
  }
  return chi;
}

const std::vector<float> kSmall = {1.0f, 2.5f, 0.3f, -1.0f, 2.0f, 0.0f, 1.5f, -0.5f};

TEST(SamplingTest, GreedyPicksArgmaxLowestIdOnTies) {
  SamplingParams p;
  p.temperature = 0.0f;
  SamplingScratch s;
  EXPECT_EQ(sample_token(kSmall.data(), 8, p, 1, 0, &s).token, 1);
  const std::vector<float> tied = {0.0f, 3.0f, 1.0f, 3.0f, 3.0f};
  for (int64_t pos = 0; pos < 20; ++pos)
    EXPECT_EQ(sample_token(tied.data(), 5, p, 9, pos, &s).token, 1);
  // top_k = 1 is greedy too, whatever the temperature.
  p.temperature = 2.0f;
  p.top_k = 1;
  for (int64_t pos = 0; pos < 20; ++pos)
    EXPECT_EQ(sample_token(tied.data(), 5, p, 9, pos, &s).token, 1);
}

TEST(SamplingTest, DrawsAreAFunctionOfSeedStreamAndPosition) {
  SamplingParams p;
  p.seed = 1234;
  SamplingScratch s1, s2;
  std::vector<int32_t> forward, backward(200);
  for (int64_t pos = 0; pos < 200; ++pos) {
    forward.push_back(sample_token(kSmall.data(), 8, p, 42, pos, &s1).token);
  }
  // Reverse order, other draws interleaved (other streams, other seeds): same tokens.
  for (int64_t pos = 199; pos >= 0; --pos) {
    SamplingParams other = p;
    other.seed = 99;
    (void)sample_token(kSmall.data(), 8, other, 42, pos, &s2);
    (void)sample_token(kSmall.data(), 8, p, 43, pos, &s2);
    backward[pos] = sample_token(kSmall.data(), 8, p, 42, pos, &s2).token;
  }
  EXPECT_EQ(forward, backward);
  // Another stream or seed gives another sequence.
  std::vector<int32_t> other_stream, other_seed;
  SamplingParams q = p;
  q.seed = 1235;
  for (int64_t pos = 0; pos < 200; ++pos) {
    other_stream.push_back(sample_token(kSmall.data(), 8, p, 43, pos, &s1).token);
    other_seed.push_back(sample_token(kSmall.data(), 8, q, 42, pos, &s1).token);
  }
  EXPECT_NE(forward, other_stream);
  EXPECT_NE(forward, other_seed);
  EXPECT_EQ(sampling_uniform(1, 2, 3), sampling_uniform(1, 2, 3));
  EXPECT_NE(sampling_uniform(1, 2, 3), sampling_uniform(1, 2, 4));
}

TEST(SamplingTest, UniformIsUniform) {
  std::vector<int64_t> bins(16, 0);
  constexpr int64_t kN = 64000;
  for (int64_t pos = 0; pos < kN; ++pos) {
    const double u = sampling_uniform(5, 6, pos);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    ++bins[size_t(u * 16)];
  }
  std::vector<double> p(16, 1.0 / 16);
  // 15 degrees of freedom: P(chi2 > 37.7) = 0.001.
  EXPECT_LT(chi_square(bins, p, kN), 37.7);
}

TEST(SamplingTest, TemperatureOneFollowsSoftmax) {
  constexpr int64_t kN = 40000;
  SamplingParams p;
  p.seed = 3;
  // 7 degrees of freedom: P(chi2 > 24.3) = 0.001.
  EXPECT_LT(chi_square(histogram(kSmall, p, kN), softmax(kSmall), kN), 24.3);
  p.temperature = 0.5f;
  EXPECT_LT(chi_square(histogram(kSmall, p, kN), softmax(kSmall, 0.5), kN), 24.3);
}

TEST(SamplingTest, TopKNeverLeavesTheKBest) {
  constexpr int64_t kN = 30000;
  SamplingParams p;
  p.top_k = 3;  // tokens 1 (2.5), 4 (2.0), 6 (1.5)
  p.seed = 11;
  const std::vector<int64_t> counts = histogram(kSmall, p, kN);
  std::vector<float> kept(8, -INFINITY);
  for (int t : {1, 4, 6}) kept[t] = kSmall[t];
  std::vector<double> expected = softmax(kept);
  // 2 degrees of freedom: P(chi2 > 13.8) = 0.001.
  EXPECT_LT(chi_square(counts, expected, kN), 13.8);
  // A large vocabulary with a flat tail: still only the k best.
  std::vector<float> big(50000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = float((i * 7919) % 1000) * 1e-3f;
  p.top_k = 5;
  SamplingScratch s;
  std::vector<int32_t> best(big.size());
  std::iota(best.begin(), best.end(), 0);
  std::stable_sort(best.begin(), best.end(), [&](int32_t a, int32_t b) { return big[a] > big[b]; });
  best.resize(5);
  for (int64_t pos = 0; pos < 100; ++pos) {
    const int32_t t = sample_token(big.data(), int64_t(big.size()), p, 1, pos, &s).token;
    EXPECT_NE(std::find(best.begin(), best.end(), t), best.end()) << t;
  }
}

TEST(SamplingTest, TopPKeepsTheSmallestNucleus) {
  // Probabilities 0.5, 0.25, 0.125, 0.0625, ...: top_p = 0.8 keeps exactly the first three
  // (0.875 >= 0.8 > 0.75).
  std::vector<float> logits;
  for (int i = 0; i < 10; ++i) logits.push_back(float(-i * std::log(2.0)));
  constexpr int64_t kN = 30000;
  SamplingParams p;
  p.top_p = 0.8f;
  p.seed = 5;
  const std::vector<int64_t> counts = histogram(logits, p, kN);
  std::vector<double> expected(10, 0.0);
  expected[0] = 4.0 / 7;
  expected[1] = 2.0 / 7;
  expected[2] = 1.0 / 7;
  EXPECT_LT(chi_square(counts, expected, kN), 13.8);
  // Top-k then top-p over the renormalised k: k = 2 gives 2/3, 1/3; top_p 0.6 keeps one.
  p.top_k = 2;
  p.top_p = 0.6f;
  const std::vector<int64_t> only_first = histogram(logits, p, 2000);
  EXPECT_EQ(only_first[0], 2000);
  // A nucleus bigger than the first sorted batch (64) of a large flat vocabulary.
  std::vector<float> flat(1000, 0.0f);
  p.top_k = 0;
  p.top_p = 0.5f;
  const std::vector<int64_t> half = histogram(flat, p, 5000);
  for (size_t i = 500; i < flat.size(); ++i) ASSERT_EQ(half[i], 0) << i;
  // 5000 draws over 500 equally likely tokens: each is missed with probability e^-10.
  EXPECT_EQ(std::count_if(half.begin(), half.begin() + 500, [](int64_t c) { return c > 0; }), 500);
}

// Random logits with a ragged vocabulary (not a multiple of the 8-lane or 256-token blocks):
// every draw lies in the brute-force nucleus (sort, accumulate), with the nucleus's
// renormalised distribution.
TEST(SamplingTest, TopPMatchesBruteForceNucleus) {
  constexpr int64_t kVocab = 1003;
  std::vector<float> logits(kVocab);
  uint64_t st = 99;
  for (float& x : logits) {
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    const double u1 = (double(st >> 11) + 0.5) * 0x1.0p-53;
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    const double u2 = double(st >> 11) * 0x1.0p-53;
    x = float(1.5 * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_p = 0.7f;
  p.seed = 17;
  const std::vector<double> prob = softmax(logits, 0.8);
  std::vector<int32_t> order(kVocab);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  std::vector<double> expected(kVocab, 0.0);
  double mass = 0.0;
  size_t size = 0;
  while (mass < 0.7 * (1 - 1e-9)) {  // float top_p 0.7 is 0.69999999
    mass += prob[order[size]];
    ++size;
  }
  for (size_t j = 0; j < size; ++j) expected[order[j]] = prob[order[j]] / mass;
  ASSERT_GT(size, 64u) << "the nucleus should exceed the quickselect's sorted tail";
  constexpr int64_t kN = 40000;
  const std::vector<int64_t> counts = histogram(logits, p, kN);
  // df = size - 1 ~ 100s: mean df, sd sqrt(2 df); 5 sd is far out.
  const double df = double(size - 1);
  EXPECT_LT(chi_square(counts, expected, kN), df + 5 * std::sqrt(2 * df));
}

TEST(SamplingTest, LogprobsAreLogSoftmaxOfTheUnmodifiedLogits) {
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 4;
  p.top_p = 0.9f;
  p.logprobs = 5;
  p.seed = 8;
  SamplingScratch s;
  const std::vector<double> prob = softmax(kSmall);
  for (int64_t pos = 0; pos < 50; ++pos) {
    const SampledToken t = sample_token(kSmall.data(), 8, p, 3, pos, &s);
    EXPECT_NEAR(t.logprob, std::log(prob[t.token]), 1e-6);
    ASSERT_EQ(t.top.size(), 5u);
    const std::vector<int32_t> order = {1, 4, 6, 0, 2};
    for (size_t i = 0; i < 5; ++i) {
      EXPECT_EQ(t.top[i].token, order[i]);
      EXPECT_NEAR(t.top[i].logprob, std::log(prob[order[i]]), 1e-6);
      if (i > 0) {
        EXPECT_GE(t.top[i - 1].logprob, t.top[i].logprob);
      }
    }
  }
  // All alternatives of a small vocabulary: probabilities sum to 1; ties by id.
  p.logprobs = 20;
  const std::vector<float> tied = {1.0f, 2.0f, 2.0f, 0.5f};
  const SampledToken t = sample_token(tied.data(), 4, p, 3, 0, &s);
  ASSERT_EQ(t.top.size(), 4u);
  EXPECT_EQ(t.top[0].token, 1);
  EXPECT_EQ(t.top[1].token, 2);
  double sum = 0.0;
  for (const TokenLogprob& a : t.top) sum += std::exp(double(a.logprob));
  EXPECT_NEAR(sum, 1.0, 1e-6);
  p.logprobs = 0;
  EXPECT_TRUE(sample_token(tied.data(), 4, p, 3, 0, &s).top.empty());
}

TEST(SamplingTest, LargeVocabulary) {
  // 128k vocabulary, a few strong tokens: every mode returns a valid, plausible token.
  std::vector<float> logits(128256);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = float((i * 2654435761u) % 997) * 1e-3f;
  logits[77] = 20.0f;
  logits[1000] = 19.0f;
  SamplingScratch s;
  SamplingParams p;
  p.logprobs = 3;
  for (float top_p : {1.0f, 0.95f}) {
    for (int32_t top_k : {0, 50}) {
      p.top_p = top_p;
      p.top_k = top_k;
      const SampledToken t = sample_token(logits.data(), int64_t(logits.size()), p, 1, 0, &s);
      EXPECT_TRUE(t.token == 77 || t.token == 1000) << t.token;
      EXPECT_EQ(t.top[0].token, 77);
      EXPECT_EQ(t.top[1].token, 1000);
    }
  }
}

// A padded row (model vocab_size past the tokenizer's vocabulary): sampling the first `limit`
// logits of it, as the scheduler does, never looks at the padding, which here holds the
// largest logits of all. Every mode gives exactly the tokens and logprobs of the row cut to
// `limit` (601: not a multiple of the 8-lane vectors, so the ragged end is exercised too).
TEST(SamplingTest, VocabLimitIgnoresThePaddedTail) {
  constexpr int64_t kLimit = 601;
  std::vector<float> padded(1000);
  for (size_t i = 0; i < padded.size(); ++i) {
    padded[i] = i < size_t(kLimit) ? float((i * 2654435761u) % 1009) * 4e-3f : 30.0f + float(i);
  }
  const std::vector<float> cut(padded.begin(), padded.begin() + kLimit);
  const std::vector<double> p = softmax(cut);
  SamplingScratch s1, s2;
  for (float temperature : {0.0f, 0.7f, 1.0f}) {
    for (int32_t top_k : {0, 5, 700}) {
      for (float top_p : {1.0f, 0.9f}) {
        SamplingParams params;
        params.temperature = temperature;
        params.top_k = top_k;
        params.top_p = top_p;
        params.logprobs = 5;
        for (int64_t pos = 0; pos < 50; ++pos) {
          const SampledToken a = sample_token(padded.data(), kLimit, params, 3, pos, &s1);
          const SampledToken b = sample_token(cut.data(), kLimit, params, 3, pos, &s2);
          ASSERT_LT(a.token, kLimit);
          EXPECT_EQ(a.token, b.token);
          EXPECT_EQ(a.logprob, b.logprob);
          EXPECT_EQ(a.top, b.top);
          // Normalised over the first kLimit logits.
          EXPECT_NEAR(a.logprob, std::log(p[size_t(a.token)]), 1e-4);
          for (const TokenLogprob& t : a.top) EXPECT_LT(t.token, kLimit);
        }
      }
    }
  }
}

TEST(SamplingTest, RowsWithoutADistribution) {
  // NaN logits are never picked while a finite one exists, and weigh nothing.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> some_nan = {nan, 1.0f, nan, 0.5f, -inf};
  SamplingParams p;
  p.logprobs = 2;
  SamplingScratch s;
  for (int64_t pos = 0; pos < 200; ++pos) {
    const SampledToken t = sample_token(some_nan.data(), 5, p, 1, pos, &s);
    EXPECT_TRUE(t.token == 1 || t.token == 3) << t.token;
    EXPECT_TRUE(std::isfinite(t.logprob));
  }
  // No finite maximum: the argmax, with NaN logprobs; never a crash or an out-of-range id.
  const std::vector<float> all_nan(5, nan), all_neg_inf(5, -inf), pos_inf = {0.0f, inf, 1.0f};
  for (const std::vector<float>* row : {&all_nan, &all_neg_inf, &pos_inf}) {
    const SampledToken t = sample_token(row->data(), int64_t(row->size()), p, 1, 0, &s);
    EXPECT_GE(t.token, 0);
    EXPECT_LT(t.token, int32_t(row->size()));
    EXPECT_TRUE(std::isnan(t.logprob));
  }
  EXPECT_EQ(sample_token(pos_inf.data(), 3, p, 1, 0, &s).token, 1);
}

TEST(SamplingTest, ValidateNamesTheField) {
  EXPECT_TRUE(validate_sampling_params(SamplingParams{}).ok());
  auto expect_bad = [](SamplingParams p, const char* field) {
    const Status s = validate_sampling_params(p);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
  };
  SamplingParams p;
  p.temperature = -0.1f;
  expect_bad(p, "temperature");
  p.temperature = NAN;
  expect_bad(p, "temperature");
  p.temperature = INFINITY;
  expect_bad(p, "temperature");
  p = SamplingParams{};
  p.top_k = -1;
  expect_bad(p, "top_k");
  p = SamplingParams{};
  for (float bad : {0.0f, -0.5f, 1.01f, float(NAN)}) {
    p.top_p = bad;
    expect_bad(p, "top_p");
  }
  p = SamplingParams{};
  p.logprobs = -1;
  expect_bad(p, "logprobs");
  p.logprobs = kMaxLogprobs + 1;
  expect_bad(p, "logprobs");
  p.logprobs = kMaxLogprobs;
  p.temperature = 0.0f;
  p.top_p = 1.0f;
  EXPECT_TRUE(validate_sampling_params(p).ok());
}

}  // namespace
}  // namespace treeserve
