// Device sampling (engine/cuda_sampling.cu) against the host sampler's semantics (label gpu):
// greedy tokens, logprobs and alternatives equal to sample_token's; sampled tokens always in
// the host's kept set (top-k, then top-p), equal to the host's draw without top-k (both walk
// id order with the same uniform) but for rare fixed-point rounding at a boundary; empirical
// frequencies matching the distribution; ties, non-finite rows, the vocab limit, and
// identical results on repeated launches. Also the greedy path's sliced argmax and the tensor-
// parallel shard summary (cuda_ops).
#include "engine/cuda_sampling.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda_backend.h"
#include "engine/cuda_ops.h"
#include "engine/detail/cuda_rank.h"
#include "engine/sampling.h"

namespace treeserve {
namespace {

#define REQUIRE_GPU()                                     \
  do {                                                    \
    if (cuda_device_count() == 0) {                       \
      GTEST_SKIP() << "no CUDA device: GPU test skipped"; \
    }                                                     \
  } while (0)

struct Row {
  std::vector<float> logits;  // [stride]
  SamplingParams params;
  uint64_t key = 0;
  int64_t position = 0;
};

// Runs the device sampler over rows (all of the same stride), vocab = the first `vocab` ids.
std::vector<cuda::DeviceSample> run_device(const std::vector<Row>& rows, int64_t vocab) {
  const int64_t stride = int64_t(rows[0].logits.size());
  std::vector<float> flat;
  std::vector<cuda::DeviceSamplingRow> params;
  for (const Row& r : rows) {
    flat.insert(flat.end(), r.logits.begin(), r.logits.end());
    params.push_back(detail::device_sampling_row(r.params, r.key, r.position));
  }
  float* d_logits = nullptr;
  cuda::DeviceSamplingRow* d_params = nullptr;
  cuda::DeviceSample* d_out = nullptr;
  EXPECT_EQ(cudaMalloc(&d_logits, flat.size() * 4), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_params, params.size() * sizeof(params[0])), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_out, rows.size() * sizeof(cuda::DeviceSample)), cudaSuccess);
  cudaMemcpy(d_logits, flat.data(), flat.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(d_params, params.data(), params.size() * sizeof(params[0]), cudaMemcpyHostToDevice);
  EXPECT_EQ(
      cuda::sample_rows(d_logits, int64_t(rows.size()), stride, vocab, d_params, d_out, nullptr),
      0);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<cuda::DeviceSample> out(rows.size());
  cudaMemcpy(out.data(), d_out, out.size() * sizeof(out[0]), cudaMemcpyDeviceToHost);
  cudaFree(d_logits);
  cudaFree(d_params);
  cudaFree(d_out);
  return out;
}

// The host's kept set: top-k best (logit desc, id asc), then the smallest best-first prefix
// whose temperature weights reach top_p of theirs.
std::vector<bool> kept_set(const std::vector<float>& logits, int64_t vocab,
                           const SamplingParams& p) {
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  auto key = [&](int32_t i) {
    const float v = logits[size_t(i)];
    return v != v ? -std::numeric_limits<float>::infinity() : v;
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return key(a) > key(b); });
  const int64_t k = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
  const double max = key(order[0]);
  double total = 0;
  for (int64_t j = 0; j < k; ++j) total += std::exp((key(order[j]) - max) / p.temperature);
  int64_t keep = k;
  if (p.top_p < 1.0f) {
    double acc = 0;
    for (int64_t j = 0; j < k; ++j) {
      acc += std::exp((key(order[j]) - max) / p.temperature);
      if (acc >= double(p.top_p) * total) {
        keep = j + 1;
        break;
      }
    }
  }
  std::vector<bool> kept(static_cast<size_t>(vocab), false);
  for (int64_t j = 0; j < keep; ++j) kept[size_t(order[j])] = true;
  return kept;
}

std::vector<float> random_logits(std::mt19937& rng, int64_t n, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

TEST(DeviceSampling, GreedyAndAlternativesMatchHost) {
  REQUIRE_GPU();
  std::mt19937 rng(1);
  for (int64_t vocab : {7, 1000, 128256}) {
    std::vector<Row> rows;
    for (int i = 0; i < 8; ++i) {
      Row r;
      r.logits = random_logits(rng, vocab, 3.0f);
      if (i == 1) std::fill(r.logits.begin() + vocab / 2, r.logits.end(), r.logits[0]);  // ties
      if (i == 2) std::fill(r.logits.begin(), r.logits.end(), 0.5f);                     // all tied
      r.params.temperature = 0.0f;
      r.params.logprobs = int32_t(std::min<int64_t>(vocab, i * 2));
      rows.push_back(std::move(r));
    }
    const auto dev = run_device(rows, vocab);
    SamplingScratch scratch;
    for (size_t i = 0; i < rows.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "vocab " << vocab << " row " << i);
      const SampledToken host =
          sample_token(rows[i].logits.data(), vocab, rows[i].params, 0, 0, &scratch);
      EXPECT_EQ(dev[i].token, host.token);
      EXPECT_NEAR(dev[i].logprob, host.logprob, 1e-4f * std::max(1.0f, std::abs(host.logprob)));
      ASSERT_EQ(size_t(dev[i].num_top), host.top.size());
      for (size_t a = 0; a < host.top.size(); ++a) {
        EXPECT_EQ(dev[i].top_ids[a], host.top[a].token) << "alternative " << a;
        EXPECT_NEAR(dev[i].top_logprobs[a], host.top[a].logprob,
                    1e-4f * std::max(1.0f, std::abs(host.top[a].logprob)));
      }
    }
  }
}

TEST(DeviceSampling, SampledTokensStayInTheHostKeptSet) {
  REQUIRE_GPU();
  std::mt19937 rng(2);
  const int64_t vocab = 5000;
  struct P {
    float t;
    int32_t k;
    float p;
  };
  int same = 0, total = 0;
  for (const P& pp : {P{1.0f, 0, 1.0f}, P{0.7f, 0, 0.9f}, P{1.3f, 50, 1.0f}, P{1.0f, 40, 0.8f},
                      P{0.5f, 3, 1.0f}, P{2.0f, 0, 0.3f}, P{1.0f, 4999, 0.95f}}) {
    std::vector<Row> rows;
    for (int i = 0; i < 64; ++i) {
      Row r;
      r.logits = random_logits(rng, vocab, 2.5f);
      if (i % 8 == 0) {
        // Plateaus: many equal logits at the top-k / top-p boundaries.
        for (int64_t j = 0; j < vocab; j += 3) r.logits[size_t(j)] = 4.0f;
      }
      r.params.temperature = pp.t;
      r.params.top_k = pp.k;
      r.params.top_p = pp.p;
      r.params.seed = 99;
      r.key = uint64_t(i);
      r.position = 1000 + i;
      rows.push_back(std::move(r));
    }
    const auto dev = run_device(rows, vocab);
    const auto again = run_device(rows, vocab);
    SamplingScratch scratch;
    for (size_t i = 0; i < rows.size(); ++i) {
      SCOPED_TRACE(::testing::Message()
                   << "T=" << pp.t << " k=" << pp.k << " p=" << pp.p << " row " << i);
      EXPECT_EQ(dev[i].token, again[i].token) << "not deterministic";
      const std::vector<bool> kept = kept_set(rows[i].logits, vocab, rows[i].params);
      ASSERT_GE(dev[i].token, 0);
      ASSERT_LT(dev[i].token, vocab);
      EXPECT_TRUE(kept[size_t(dev[i].token)]) << "token " << dev[i].token << " not kept";
      if (pp.k == 0) {
        const SampledToken host = sample_token(rows[i].logits.data(), vocab, rows[i].params,
                                               rows[i].key, rows[i].position, &scratch);
        same += host.token == dev[i].token;
        ++total;
      }
    }
  }
  // Without top-k both walk the kept tokens in id order with the same uniform: only
  // rounding at a boundary may differ.
  EXPECT_GE(same, total * 97 / 100) << same << " of " << total << " draws equal the host's";
}

TEST(DeviceSampling, FrequenciesFollowTheDistribution) {
  REQUIRE_GPU();
  const std::vector<float> logits = {1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 2.0f, 0.0f, -3.0f};
  const int64_t vocab = int64_t(logits.size());
  for (int32_t top_k : {0, 3}) {
    SamplingParams p;
    p.temperature = 0.8f;
    p.top_k = top_k;
    p.seed = 7;
    std::vector<Row> rows;
    const int draws = 20000;
    for (int i = 0; i < draws; ++i) rows.push_back({logits, p, 3, int64_t(i)});
    const auto dev = run_device(rows, vocab);
    std::vector<double> expect(static_cast<size_t>(vocab), 0.0);
    const std::vector<bool> kept = kept_set(logits, vocab, p);
    double z = 0;
    for (int64_t i = 0; i < vocab; ++i) {
      if (kept[size_t(i)]) z += expect[size_t(i)] = std::exp(logits[size_t(i)] / p.temperature);
    }
    std::vector<int> count(static_cast<size_t>(vocab), 0);
    for (const auto& s : dev) ++count[size_t(s.token)];
    for (int64_t i = 0; i < vocab; ++i) {
      const double q = expect[size_t(i)] / z;
      const double sigma = std::sqrt(draws * q * (1 - q)) + 1;
      EXPECT_NEAR(count[size_t(i)], draws * q, 5 * sigma) << "token " << i << " top_k " << top_k;
    }
  }
}

TEST(DeviceSampling, NonFiniteRowsAndTheVocabLimit) {
  REQUIRE_GPU();
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<Row> rows(4);
  rows[0].logits = {nan, nan, nan, nan, nan, nan};
  rows[1].logits = {-inf, -inf, 1.0f, nan, -inf, 9.0f};
  rows[2].logits = {0.0f, inf, 1.0f, inf, 0.0f, 0.0f};
  // The limit: ids 4 and 5 are past the vocab and must never be drawn.
  rows[3].logits = {0.1f, 0.2f, 0.3f, 0.4f, 50.0f, 50.0f};
  for (Row& r : rows) {
    r.params.temperature = 1.0f;
    r.params.logprobs = 2;
  }
  const auto dev = run_device(rows, 4);
  EXPECT_EQ(dev[0].token, 0);  // no finite maximum: the argmax, NaN logprobs
  EXPECT_TRUE(std::isnan(dev[0].logprob));
  EXPECT_EQ(dev[1].token, 2);  // the only finite one below the limit
  EXPECT_NEAR(dev[1].logprob, 0.0f, 1e-6f);
  EXPECT_EQ(dev[2].token, 1);  // +inf: the first one
  EXPECT_LT(dev[3].token, 4);
  ASSERT_EQ(dev[3].num_top, 2);
  EXPECT_EQ(dev[3].top_ids[0], 3);
  EXPECT_EQ(dev[3].top_ids[1], 2);
}

}  // namespace
}  // namespace treeserve

namespace treeserve {
namespace {

// The greedy path's argmax + log-softmax (cuda::argmax_logprob, sliced over the vocabulary
// and merged per row) against a double-precision host computation: Llama-3's 128,256-entry
// rows (16 slices; whole slices are read in 16-byte loads), maxima tied across slices and
// inside one slice between threads (the lowest id wins), a vocab limit that cuts a slice, rows
// whose maximum sits in the last, partial slice, -inf logits, and an odd row stride (rows
// not 16-byte aligned: scalar loads).
void check_sliced_argmax(int64_t stride, std::initializer_list<int64_t> vocabs) {
  const int64_t n = 7;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<float> flat(size_t(n * stride));
  for (float& x : flat) x = normal(rng);
  auto row = [&](int64_t r) { return flat.data() + r * stride; };
  row(1)[9000] = 40.f;  // tie across slices 1 and 3: lowest id
  row(1)[30000] = 40.f;
  row(2)[stride - 1] = 41.f;  // in the last, partial slice
  row(3)[8191] = 42.f;        // slice boundaries
  row(3)[8192] = 42.f;
  row(4)[stride - 100] = 50.f;  // past the vocab limit below: ignored
  row(5)[2052] = 45.f;          // tie inside slice 0: thread 1's second load, thread 5's first
  row(5)[20] = 45.f;
  row(6)[0] = -INFINITY;  // -inf logits add nothing
  row(6)[8200] = -INFINITY;
  for (const int64_t vocab : vocabs) {
    float* d_logits = nullptr;
    int32_t* d_ids = nullptr;
    float* d_lp = nullptr;
    void* d_scratch = nullptr;
    ASSERT_EQ(cudaMalloc(&d_logits, flat.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_ids, n * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_lp, n * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_scratch, cuda::argmax_scratch_bytes(n, vocab)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_logits, flat.data(), flat.size() * 4, cudaMemcpyHostToDevice),
              cudaSuccess);
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    cuda::argmax_logprob(d_logits, n, stride, vocab, d_ids, d_lp, d_scratch, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    cudaStreamDestroy(stream);
    std::vector<int32_t> ids(n);
    std::vector<float> lp(n);
    ASSERT_EQ(cudaMemcpy(ids.data(), d_ids, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(lp.data(), d_lp, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int64_t r = 0; r < n; ++r) {
      const float* x = row(r);
      const int64_t best = std::max_element(x, x + vocab) - x;  // first maximum
      double sum = 0;
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(double(x[v]) - double(x[best]));
      EXPECT_EQ(ids[size_t(r)], best) << "row " << r << " vocab " << vocab;
      EXPECT_NEAR(lp[size_t(r)], -std::log(sum), 1e-4) << "row " << r << " vocab " << vocab;
    }
    cudaFree(d_logits);
    cudaFree(d_ids);
    cudaFree(d_lp);
    cudaFree(d_scratch);
  }
}

TEST(DeviceArgmax, SlicedArgmaxAndLogprobMatchHost) {
  REQUIRE_GPU();
  check_sliced_argmax(128256, {128256, 120000});
  check_sliced_argmax(32001, {32001, 20000});
}

// A vocabulary shard's summary (cuda::argmax_partial, tensor parallelism) against a host
// computation: max, lowest argmax as a global id, sum exp(x - max); ties inside a 16-byte load
// and between threads, a shard of only -inf logits (sum 0, not NaN), a NaN logit (never the
// max), an empty shard, a vocab that is not a multiple of 4 (scalar tail), and an odd row
// stride (rows not 16-byte aligned).
TEST(DeviceArgmax, ShardSummaryMatchesHost) {
  REQUIRE_GPU();
  for (const int64_t stride : {int64_t(64128), int64_t(32001)}) {
    const int64_t n = 5, id_offset = 64128;
    std::mt19937 rng(9);
    std::normal_distribution<float> normal(0.f, 3.f);
    std::vector<float> flat(size_t(n * stride));
    for (float& x : flat) x = normal(rng);
    auto row = [&](int64_t r) { return flat.data() + r * stride; };
    row(0)[4097] = 30.f;  // tie inside one float4 and with another thread's: lowest id
    row(0)[4098] = 30.f;
    row(0)[9] = 30.f;
    row(1)[stride - 1] = 33.f;  // the row's last logit (the scalar tail when vocab % 4 != 0)
    for (int64_t v = 0; v < stride; ++v) row(2)[v] = -INFINITY;
    row(3)[100] = std::numeric_limits<float>::quiet_NaN();  // never the max (sum unchecked)
    for (const int64_t vocab : {stride, stride - 3, int64_t(0)}) {
      float *d_logits = nullptr, *d_maxes = nullptr, *d_sums = nullptr;
      int32_t* d_ids = nullptr;
      ASSERT_EQ(cudaMalloc(&d_logits, flat.size() * 4), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d_maxes, n * 4), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d_sums, n * 4), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d_ids, n * 4), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_logits, flat.data(), flat.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      cuda::argmax_partial(d_logits, n, stride, vocab, id_offset, d_maxes, d_sums, d_ids, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<float> maxes(n), sums(n);
      std::vector<int32_t> ids(n);
      ASSERT_EQ(cudaMemcpy(maxes.data(), d_maxes, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(sums.data(), d_sums, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(ids.data(), d_ids, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      for (int64_t r = 0; r < n; ++r) {
        const float* x = row(r);
        float best = -INFINITY;
        int64_t best_id = -1;
        for (int64_t v = 0; v < vocab; ++v) {
          if (x[v] > best || (best_id < 0 && x[v] == best)) {
            best = x[v];
            best_id = v;
          }
        }
        double sum = 0;
        for (int64_t v = 0; v < vocab && best != -INFINITY; ++v) {
          sum += std::exp(double(x[v]) - double(best));
        }
        SCOPED_TRACE("stride " + std::to_string(stride) + " vocab " + std::to_string(vocab) +
                     " row " + std::to_string(r));
        EXPECT_EQ(maxes[size_t(r)], best);
        EXPECT_EQ(ids[size_t(r)], best_id < 0 ? INT32_MAX : int32_t(id_offset + best_id));
        // A NaN logit's effect on the sum is not specified (OnlineMax drops it when a later
        // logit becomes the first finite maximum), as in the sliced argmax.
        if (!std::isnan(sum)) {
          EXPECT_NEAR(sums[size_t(r)], sum, 1e-4 * sum + 1e-6);
        }
      }
      cudaFree(d_logits);
      cudaFree(d_maxes);
      cudaFree(d_sums);
      cudaFree(d_ids);
    }
  }
}

}  // namespace
}  // namespace treeserve
