// The CPU backend's FP8 KV cache (CpuBackendOptions::kv_cache_fp8, --kv-cache-dtype fp8): the
// rows a step writes hold e4m3 values times one scale per (token, kv head), the logits stay
// close to those of a float32 KV cache, and forked trees (page copies) and accepted drafts
// (slot moves) give each branch what its sequence alone gives.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <vector>

#include "engine/backend.h"
#include "engine/cpu_backend_pool.h"
#include "engine/cpu_ops.h"
#include "tests/engine/engine_test_util.h"

namespace treeserve::testing {
namespace {

// max |fp8 KV logit - float32 KV logit| on the tiny model (logits up to ~12): 0.35 over the
// test's 37-token prefill and 10 decode steps, 0.30 to 0.53 over 40 other sequences of 47
// and 410 tokens (with the argmax kept at ~97% of positions); the bound is ~3x the test's.
constexpr float kFp8LogitTolerance = 1.0f;
// The mean |difference| over all logits of that run: measured 0.062.
constexpr float kFp8MeanLogitTolerance = 0.2f;
// A branch of a forked tree against its sequence alone, both with FP8 KV: measured 0 (these
// short runs sum attention in the same order). A different order could move a K/V value of
// a later layer across an e4m3 rounding boundary, hence more room than float32's 1e-4.
constexpr float kFp8TreeTolerance = 2e-3f;

// Whether quantizing row [d] again leaves it bit for bit as it is. It does for a row of e4m3
// values times its power-of-two scale s: the largest code lies in [224, 448], so the row's new
// scale is s, or s / 2 where that code is 224 and then every code doubles exactly (all are at
// most 224); either way each value divides back to a code that dequantizes to it.
bool is_fixed_point(const float* row, int64_t d) {
  std::vector<float> again(static_cast<size_t>(d));
  fp8_kv_fake_quantize_rows(row, 1, d, again.data());
  return std::equal(row, row + d, again.begin());
}

class KvCacheFp8Test : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = tiny_model();
    ASSERT_NE(model_, nullptr);
    vocab_ = model_->config.vocab_size;
  }
  const TinyModel* model_ = nullptr;
  int64_t vocab_ = 0;
};

TEST_F(KvCacheFp8Test, PrefillWritesE4m3RowsWithOneScalePerTokenAndHead) {
  constexpr int32_t kPage = 16, kPages = 8;
  const std::vector<int32_t> prompt = test_tokens(37, 21, vocab_);
  std::unique_ptr<Backend> backends[2];
  StepBatch batch;
  for (bool fp8 : {false, true}) {
    backends[fp8] = make_cpu_backend(*model_, kPage, kPages, 2, fp8);
    ASSERT_NE(backends[fp8], nullptr);
    TreeDriver driver(backends[fp8].get(), kPage, kPages);
    const BranchId b = driver.start(prompt);
    driver.build_step(std::vector<BranchId>{b}, false, &batch);
    Logits out;
    ASSERT_TRUE(backends[fp8]->forward(batch, &out).ok());
  }
  const KvLayout& layout = backends[1]->kv_layout();
  EXPECT_EQ(layout.dtype_bytes, 4) << "the emulation keeps a float32 pool";
  EXPECT_EQ(layout.scale_bytes, 0);
  const int64_t d = layout.head_dim;
  int64_t rows = 0, changed_rows = 0, float_fixed_points = 0;
  for (int32_t l = 0; l < layout.num_layers; ++l) {
    for (bool v : {false, true}) {
      const std::span<const float> quantized = cpu_backend_kv_buffer(*backends[1], l, v);
      const std::span<const float> plain = cpu_backend_kv_buffer(*backends[0], l, v);
      ASSERT_EQ(int64_t(quantized.size()), layout.layer_elems());
      ASSERT_EQ(plain.size(), quantized.size());
      for (int64_t slot : batch.kv_slots) {
        for (int32_t h = 0; h < layout.num_kv_heads; ++h) {
          const int64_t off = layout.offset(slot / kPage, h, int32_t(slot % kPage));
          const float* row = quantized.data() + off;
          const float* ref = plain.data() + off;
          SCOPED_TRACE(::testing::Message()
                       << "layer " << l << (v ? " V" : " K") << " slot " << slot << " head " << h);
          ASSERT_TRUE(is_fixed_point(row, d));
          float_fixed_points += is_fixed_point(ref, d);
          ++rows;
          changed_rows += !std::equal(row, row + d, ref);
          if (l == 0) {
            // Layer 0's K/V come from the embeddings alone, the same in both runs: the FP8
            // row is exactly the float32 row quantized and dequantized.
            std::vector<float> expected(static_cast<size_t>(d));
            fp8_kv_fake_quantize_rows(ref, 1, d, expected.data());
            ASSERT_TRUE(std::equal(row, row + d, expected.begin()));
          }
        }
      }
    }
  }
  EXPECT_EQ(rows, int64_t(layout.num_layers) * 2 * 37 * layout.num_kv_heads);
  EXPECT_EQ(changed_rows, rows) << "every row of float32 K/V has values off the e4m3 grid";
  EXPECT_EQ(float_fixed_points, 0) << "the check must tell float32 rows from e4m3 ones";
}

// The same tokens through float32 and FP8 KV: a 37-token prefill (every row's logits), then
// 10 decode steps.
TEST_F(KvCacheFp8Test, LogitsStayCloseToFloat32Kv) {
  constexpr int32_t kPage = 16, kPages = 16;
  const std::vector<int32_t> prompt = test_tokens(37, 22, vocab_);
  const std::vector<int32_t> decode = test_tokens(10, 23, vocab_);
  std::vector<float> logits[2];
  for (bool fp8 : {false, true}) {
    auto backend = make_cpu_backend(*model_, kPage, kPages, 2, fp8);
    ASSERT_NE(backend, nullptr);
    TreeDriver driver(backend.get(), kPage, kPages);
    const BranchId b = driver.start(prompt);
    Logits out;
    ASSERT_TRUE(driver.step(std::vector<BranchId>{b}, true, &out).ok());
    logits[fp8] = out.data;
    for (int32_t token : decode) {
      driver.append(b, std::vector<int32_t>{token});
      ASSERT_TRUE(driver.step(std::vector<BranchId>{b}, false, &out).ok());
      logits[fp8].insert(logits[fp8].end(), out.data.begin(), out.data.end());
    }
  }
  ASSERT_EQ(logits[0].size(), size_t((37 + 10) * vocab_));
  ASSERT_EQ(logits[1].size(), logits[0].size());
  const float diff = max_abs_diff(logits[1].data(), logits[0].data(), int64_t(logits[0].size()));
  double sum = 0.0;
  for (size_t i = 0; i < logits[0].size(); ++i) sum += std::fabs(logits[1][i] - logits[0][i]);
  const double mean = sum / double(logits[0].size());
  std::printf("[ |logit fp8 KV - logit float32 KV|: max %.3g, mean %.3g ]\n", double(diff), mean);
  EXPECT_LE(diff, kFp8LogitTolerance);
  EXPECT_LE(mean, kFp8MeanLogitTolerance);
  EXPECT_GT(diff, 0.0f) << "FP8 KV must change the logits (is kv_cache_fp8 applied?)";
}

// A prompt ending inside a page, forked into 4 branches (one page copy each) that decode in
// one batch; each branch's logits equal its whole sequence prefilled alone, with FP8 KV both.
TEST_F(KvCacheFp8Test, ForkedTreeMatchesEachSequenceAlone) {
  constexpr int32_t kPage = 4, kPages = 64, kBranches = 4, kSteps = 3;
  auto backend = make_cpu_backend(*model_, kPage, kPages, 2, true);
  ASSERT_NE(backend, nullptr);
  TreeDriver driver(backend.get(), kPage, kPages);
  const std::vector<int32_t> prompt = test_tokens(21, 24, vocab_);
  const BranchId root = driver.start(prompt);
  Logits out;
  ASSERT_TRUE(driver.step(std::vector<BranchId>{root}, false, &out).ok());
  const std::vector<BranchId> branches = driver.fork(root, kBranches);
  ASSERT_EQ(branches.size(), size_t(kBranches));
  EXPECT_EQ(driver.pending_copies(), size_t(kBranches)) << "21 % 4 != 0: one copy per branch";
  driver.prune(root);
  std::vector<std::vector<int32_t>> seqs(kBranches, prompt);
  for (int step = 0; step < kSteps; ++step) {
    for (int i = 0; i < kBranches; ++i) {
      const int32_t token = int32_t(3 + (31 * i + 53 * step) % (vocab_ - 3));
      seqs[i].push_back(token);
      driver.append(branches[i], std::vector<int32_t>{token});
    }
    ASSERT_TRUE(driver.step(branches, false, &out).ok());
  }
  ASSERT_EQ(out.num_rows, kBranches);
  float worst = 0.0f;
  for (int i = 0; i < kBranches; ++i) {
    auto alone = make_cpu_backend(*model_, kPage, kPages, 2, true);
    ASSERT_NE(alone, nullptr);
    TreeDriver single(alone.get(), kPage, kPages);
    const BranchId b = single.start(seqs[i]);
    Logits ref;
    ASSERT_TRUE(single.step(std::vector<BranchId>{b}, false, &ref).ok());
    const float diff = max_abs_diff(out.row(i), ref.row(0), vocab_);
    EXPECT_LE(diff, kFp8TreeTolerance) << "branch " << i;
    worst = std::max(worst, diff);
    if (i == 0) {
      // The tree ran with FP8 KV: float32 KV gives other logits.
      auto plain = make_cpu_backend(*model_, kPage, kPages, 2, false);
      ASSERT_NE(plain, nullptr);
      TreeDriver plain_driver(plain.get(), kPage, kPages);
      const BranchId p = plain_driver.start(seqs[i]);
      ASSERT_TRUE(plain_driver.step(std::vector<BranchId>{p}, false, &ref).ok());
      EXPECT_GT(max_abs_diff(out.row(i), ref.row(0), vocab_), 1e-2f);
    }
  }
  std::printf("[ max |logit in tree - logit alone| with fp8 KV = %.3g ]\n", double(worst));
}

// Drafts after a decode token; accepting d4, d5 moves their K/V down two slots. The next
// step must read the moved rows: its logits equal the accepted sequence prefilled alone.
TEST_F(KvCacheFp8Test, AcceptedDraftSlotMovesKeepTheRows) {
  constexpr int32_t kPage = 4, kPages = 32;
  auto backend = make_cpu_backend(*model_, kPage, kPages, 2, true);
  ASSERT_NE(backend, nullptr);
  TreeDriver driver(backend.get(), kPage, kPages);
  std::vector<int32_t> seq = test_tokens(13, 25, vocab_);
  const BranchId b = driver.start(seq);
  Logits out;
  ASSERT_TRUE(driver.step(std::vector<BranchId>{b}, false, &out).ok());
  const std::vector<int32_t> drafts = {40, 41, 42, 43, 44, 45};
  const std::vector<int32_t> parents = {-1, 0, 0, 1, -1, 4};
  seq.push_back(30);
  driver.append(b, std::vector<int32_t>{30});
  driver.append_drafts(b, drafts, parents);
  ASSERT_TRUE(driver.step(std::vector<BranchId>{b}, false, &out).ok());
  driver.accept(b, std::vector<int32_t>{4, 5});
  EXPECT_EQ(driver.pending_moves(), 2u);
  seq.insert(seq.end(), {44, 45, 50});
  driver.append(b, std::vector<int32_t>{50});
  ASSERT_TRUE(driver.step(std::vector<BranchId>{b}, false, &out).ok());
  ASSERT_EQ(driver.tokens(b), seq);

  auto alone = make_cpu_backend(*model_, kPage, kPages, 2, true);
  ASSERT_NE(alone, nullptr);
  TreeDriver single(alone.get(), kPage, kPages);
  const BranchId s = single.start(seq);
  Logits ref;
  ASSERT_TRUE(single.step(std::vector<BranchId>{s}, false, &ref).ok());
  EXPECT_LE(max_abs_diff(out.row(0), ref.row(0), vocab_), kFp8TreeTolerance);
}

}  // namespace
}  // namespace treeserve::testing
