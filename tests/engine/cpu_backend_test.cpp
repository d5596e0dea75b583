// The CPU backend against the naive reference forward (tests/engine/reference_model.h):
// prefill and decode of one sequence, a prompt forked into a tree of 8 branches decoding in
// one batch, prefill chunks mixed with decode rows, page copies and slot moves, and batch /
// thread-count invariance. Slots, copies, moves and views come from kvcache/'s KvCache, as
// the scheduler will produce them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <vector>

#include "engine/backend.h"
#include "engine/cpu_weights.h"
#include "tests/engine/engine_test_util.h"

namespace treeserve::testing {
namespace {

constexpr float kTolerance = 1e-4f;           // backend (float32) vs reference (double)
constexpr float kInvariantTolerance = 1e-5f;  // one branch in different batches

class CpuBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = tiny_model();
    ASSERT_NE(model_, nullptr);
    vocab_ = model_->config.vocab_size;
  }

  // Reference logits of every position of a sequence that starts with `prefix`: a cached
  // forward of a longer sequence serves every prefix of it (causal attention).
  const float* reference(const std::vector<int32_t>& prefix) {
    for (const auto& [tokens, logits] : reference_cache_) {
      if (tokens.size() >= prefix.size() &&
          std::equal(prefix.begin(), prefix.end(), tokens.begin())) {
        return logits.data();
      }
    }
    return reference_cache_.emplace(prefix, model_->reference->forward(prefix))
        .first->second.data();
  }

  // Expects logits row `row` of `out` to equal the reference's prediction after the first
  // `length` tokens of `tokens`. Checked in TearDown, longest sequences first, so that one
  // reference forward per branch serves all its steps.
  void expect_matches(const Logits& out, int32_t row, const std::vector<int32_t>& tokens,
                      int32_t length, const std::string& what) {
    ASSERT_LT(row, out.num_rows);
    checks_.push_back({std::vector<int32_t>(tokens.begin(), tokens.begin() + length),
                       std::vector<float>(out.row(row), out.row(row) + vocab_), what});
  }

  void TearDown() override {
    std::stable_sort(checks_.begin(), checks_.end(), [](const Check& a, const Check& b) {
      return a.tokens.size() > b.tokens.size();
    });
    float worst = 0.0f;
    for (const Check& c : checks_) {
      const float* ref = reference(c.tokens) + int64_t(c.tokens.size() - 1) * vocab_;
      const float diff = max_abs_diff(c.logits.data(), ref, vocab_);
      EXPECT_LE(diff, kTolerance) << c.what << " (position " << c.tokens.size() - 1 << ")";
      worst = std::max(worst, diff);
    }
    if (!checks_.empty()) {
      std::printf("[ %zu rows, max |logit - reference| = %.3g ]\n", checks_.size(), double(worst));
    }
  }

  static int32_t argmax(const float* row, int64_t n) {
    return int32_t(std::max_element(row, row + n) - row);
  }

  const TinyModel* model_ = nullptr;
  int64_t vocab_ = 0;
  struct Check {
    std::vector<int32_t> tokens;  // the prediction after these
    std::vector<float> logits;
    std::string what;
  };
  std::vector<Check> checks_;
  std::map<std::vector<int32_t>, std::vector<float>> reference_cache_;
};

// (a) One sequence: the whole prompt in one batch (logits of every row), then greedy decode
// one token per step.
TEST_F(CpuBackendTest, PrefillThenDecodeMatchesReference) {
  auto backend = make_cpu_backend(*model_, /*page_size=*/16, /*num_pages=*/32);
  ASSERT_NE(backend, nullptr);
  TreeDriver driver(backend.get(), 16, 32);
  std::vector<int32_t> seq = test_tokens(37, 1, vocab_);
  const BranchId b = driver.start(seq);
  Logits out;
  ASSERT_TRUE(driver.step(std::vector<BranchId>{b}, /*all_logits=*/true, &out).ok());
  ASSERT_EQ(out.num_rows, 37);
  const Logits prefill = out;
  std::vector<Logits> decode;
  int32_t next = argmax(out.row(36), vocab_);
  for (int step = 0; step < 10; ++step) {
    seq.push_back(next);
    driver.append(b, std::vector<int32_t>{next});
    ASSERT_TRUE(driver.step(std::vector<BranchId>{b}, false, &out).ok());
    ASSERT_EQ(out.num_rows, 1);
    decode.push_back(out);
    next = argmax(out.row(0), vocab_);
  }
  ASSERT_EQ(driver.tokens(b), seq);
  // Causal attention: the reference of the whole sequence holds every prefix's prediction.
  for (int32_t t = 0; t < 37; ++t) expect_matches(prefill, t, seq, t + 1, "prefill row");
  for (int step = 0; step < 10; ++step) {
    expect_matches(decode[step], 0, seq, 38 + step, "decode step " + std::to_string(step));
  }
}

// (b) The tree test: a shared prompt prefilled once (ending inside a page, so every fork
// copies one page), forked into 8 branches that each append different tokens and decode in
// one batch; each branch's logits equal running its whole sequence alone.
TEST_F(CpuBackendTest, TreeOfEightBranchesMatchesEachSequenceAlone) {
  constexpr int32_t kPage = 4, kPages = 64, kBranches = 8, kSteps = 3;
  auto backend = make_cpu_backend(*model_, kPage, kPages);
  ASSERT_NE(backend, nullptr);
  TreeDriver driver(backend.get(), kPage, kPages);
  const std::vector<int32_t> prompt = test_tokens(21, 3, vocab_);
  const BranchId root = driver.start(prompt);
  Logits out;
  ASSERT_TRUE(driver.step(std::vector<BranchId>{root}, false, &out).ok());
  expect_matches(out, 0, prompt, 21, "prompt");

  const std::vector<BranchId> branches = driver.fork(root, kBranches);
  ASSERT_EQ(branches.size(), size_t(kBranches));
  EXPECT_EQ(driver.pending_copies(), size_t(kBranches)) << "21 % 4 != 0: one copy per branch";
  driver.prune(root);
  std::vector<std::vector<int32_t>> seqs(kBranches, prompt);
  for (int step = 0; step < kSteps; ++step) {
    for (int i = 0; i < kBranches; ++i) {
      const int32_t token = int32_t(3 + (17 * i + 101 * step) % (vocab_ - 3));
      seqs[i].push_back(token);
      driver.append(branches[i], std::vector<int32_t>{token});
    }
    ASSERT_TRUE(driver.step(branches, false, &out).ok());
    ASSERT_EQ(out.num_rows, kBranches);
    for (int i = 0; i < kBranches; ++i) {
      expect_matches(out, i, seqs[i], int32_t(seqs[i].size()),
                     "branch " + std::to_string(i) + " step " + std::to_string(step));
    }
  }
  for (int i = 0; i < kBranches; ++i) EXPECT_EQ(driver.tokens(branches[i]), seqs[i]);
}

// engine.attention = baseline (the prefix-unaware schedule, for comparisons) computes the
// same logits for a forked tree: each branch reads its whole path instead of sharing runs.
TEST_F(CpuBackendTest, BaselineAttentionScheduleMatchesTheReference) {
  constexpr int32_t kPage = 4, kPages = 64, kBranches = 4;
  CpuBackendOptions options;
  options.page_size = kPage;
  options.num_pages = kPages;
  options.num_threads = 2;
  options.baseline_attention = true;
  auto created = create_cpu_backend(model_->config, model_->weights, options);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  TreeDriver driver(created->get(), kPage, kPages);
  const std::vector<int32_t> prompt = test_tokens(23, 5, vocab_);
  const BranchId root = driver.start(prompt);
  Logits out;
  ASSERT_TRUE(driver.step(std::vector<BranchId>{root}, false, &out).ok());
  const std::vector<BranchId> branches = driver.fork(root, kBranches);
  driver.prune(root);
  std::vector<std::vector<int32_t>> seqs(kBranches, prompt);
  for (int step = 0; step < 2; ++step) {
    for (int i = 0; i < kBranches; ++i) {
      const int32_t token = int32_t(3 + (29 * i + 7 * step) % (vocab_ - 3));
      seqs[i].push_back(token);
      driver.append(branches[i], std::vector<int32_t>{token});
    }
    ASSERT_TRUE(driver.step(branches, false, &out).ok());
    for (int i = 0; i < kBranches; ++i) {
      expect_matches(out, i, seqs[i], int32_t(seqs[i].size()),
                     "baseline branch " + std::to_string(i) + " step " + std::to_string(step));
    }
  }
}

// (c) Prefill chunks, multi-token appends and decode rows of several trees in one batch,
// including a prompt that reuses a cached prefix ending inside a page.
TEST_F(CpuBackendTest, MixedPrefillChunksAndDecodeRows) {
  constexpr int32_t kPage = 8, kPages = 64;
  auto backend = make_cpu_backend(*model_, kPage, kPages);
  ASSERT_NE(backend, nullptr);
  TreeDriver driver(backend.get(), kPage, kPages);
  std::vector<int32_t> a = test_tokens(30, 4, vocab_);
  std::vector<int32_t> b_prompt = test_tokens(19, 5, vocab_);
  std::vector<int32_t> b(b_prompt.begin(), b_prompt.begin() + 11);

  // Step 1: A's whole prompt and B's first chunk.
  const BranchId ba = driver.start(a);
  const BranchId bb = driver.start(b);
  Logits out;
  ASSERT_TRUE(driver.step(std::vector<BranchId>{ba, bb}, true, &out).ok());
  ASSERT_EQ(out.num_rows, 30 + 11);
  for (int32_t t = 0; t < 30; ++t) expect_matches(out, t, a, t + 1, "A prompt");
  for (int32_t t = 0; t < 11; ++t) expect_matches(out, 30 + t, b, t + 1, "B chunk 1");

  // Step 2: A forked in two, one decode row each, with B's second chunk between them.
  const std::vector<BranchId> forks = driver.fork(ba, 2);
  ASSERT_EQ(forks.size(), 2u);
  std::vector<int32_t> a1 = a, a2 = a;
  a1.push_back(7);
  a2.push_back(8);
  driver.append(forks[0], std::vector<int32_t>{7});
  driver.append(forks[1], std::vector<int32_t>{8});
  driver.append(bb, std::span<const int32_t>(b_prompt).subspan(11));
  b = b_prompt;
  ASSERT_TRUE(driver.step(std::vector<BranchId>{forks[0], bb, forks[1]}, true, &out).ok());
  ASSERT_EQ(out.num_rows, 1 + 8 + 1);
  expect_matches(out, 0, a1, 31, "A1 decode");
  for (int32_t t = 0; t < 8; ++t) expect_matches(out, 1 + t, b, 12 + t, "B chunk 2");
  expect_matches(out, 9, a2, 31, "A2 decode");

  // Step 3: a 3-token append on A1, decode on A2 and B, and a new prompt C that shares A's
  // first 20 tokens (cached in the radix tree: a mid-page match, so one page copy).
  const std::vector<int32_t> extra = {11, 12, 13};
  a1.insert(a1.end(), extra.begin(), extra.end());
  driver.append(forks[0], extra);
  a2.push_back(9);
  driver.append(forks[1], std::vector<int32_t>{9});
  b.push_back(10);
  driver.append(bb, std::vector<int32_t>{10});
  std::vector<int32_t> c(a.begin(), a.begin() + 20);
  const std::vector<int32_t> c_tail = test_tokens(6, 6, vocab_);
  c.insert(c.end(), c_tail.begin(), c_tail.end());
  EXPECT_EQ(driver.kv().match_prefix_length(c), 20);
  const BranchId bc = driver.start(c);
  EXPECT_EQ(driver.pending_copies(), 1u);
  ASSERT_TRUE(driver.step(std::vector<BranchId>{bc, forks[1], forks[0], bb}, true, &out).ok());
  ASSERT_EQ(out.num_rows, 6 + 1 + 3 + 1);
  for (int32_t t = 0; t < 6; ++t) expect_matches(out, t, c, 21 + t, "C after cached prefix");
  expect_matches(out, 6, a2, 32, "A2 decode");
  for (int32_t t = 0; t < 3; ++t) expect_matches(out, 7 + t, a1, 32 + t, "A1 append");
  expect_matches(out, 10, b, 20, "B decode");
}

// (d) Page copies and slot moves. A fork's copy is not read through the tree view (the
// shared run still reads the source page), so the test points the view's last prompt page at
// the copy's destination: the copied slots must hold the source's K/V.
TEST_F(CpuBackendTest, ForkPageCopyDuplicatesTheSharedSlots) {
  constexpr int32_t kPage = 4, kPages = 32;
  std::vector<int32_t> seq = test_tokens(10, 7, vocab_);
  std::vector<float> with_copy, without_copy;
  for (bool copy : {true, false}) {
    auto backend = make_cpu_backend(*model_, kPage, kPages);
    ASSERT_NE(backend, nullptr);
    TreeDriver driver(backend.get(), kPage, kPages);
    const BranchId root = driver.start(seq);
    Logits out;
    ASSERT_TRUE(driver.step(std::vector<BranchId>{root}, false, &out).ok());
    const std::vector<BranchId> forks = driver.fork(root, 1);
    driver.append(forks[0], std::vector<int32_t>{5});
    StepBatch batch;
    driver.build_step(forks, false, &batch);
    ASSERT_EQ(batch.page_copies.size(), 1u);
    const StepPageCopy c = batch.page_copies[0];
    EXPECT_EQ(c.num_slots, 10 % kPage);
    // Node 0 is the shared prompt (pages 0..2 of the view); its last page is the copy's source.
    ASSERT_EQ(batch.view.nodes[0].num_tokens, 10);
    int32_t& last_prompt_page = batch.view.pages[batch.view.nodes[0].page_begin + 2];
    ASSERT_EQ(last_prompt_page, c.src_page);
    last_prompt_page = c.dst_page;
    if (!copy) batch.page_copies.clear();
    ASSERT_TRUE(backend->forward(batch, &out).ok());
    (copy ? with_copy : without_copy).assign(out.row(0), out.row(0) + vocab_);
  }
  seq.push_back(5);
  const float* ref = reference(seq) + 10 * vocab_;
  EXPECT_LE(max_abs_diff(with_copy.data(), ref, vocab_), kTolerance);
  EXPECT_GT(max_abs_diff(without_copy.data(), ref, vocab_), 1e-2f)
      << "reading the destination page without the copy should be wrong";
}

TEST_F(CpuBackendTest, SpeculativeTreeAndAcceptSlotMoves) {
  constexpr int32_t kPage = 4, kPages = 32;
  auto backend = make_cpu_backend(*model_, kPage, kPages);
  ASSERT_NE(backend, nullptr);
  TreeDriver driver(backend.get(), kPage, kPages);
  std::vector<int32_t> seq = test_tokens(13, 8, vocab_);
  const BranchId b = driver.start(seq);
  Logits out;
  ASSERT_TRUE(driver.step(std::vector<BranchId>{b}, false, &out).ok());

  // One decode token t0 plus a draft tree after it:   d0 - d1 - d3     d4 - d5
  //                                                        \ d2
  const std::vector<int32_t> drafts = {40, 41, 42, 43, 44, 45};
  const std::vector<int32_t> parents = {-1, 0, 0, 1, -1, 4};
  seq.push_back(30);
  driver.append(b, std::vector<int32_t>{30});
  driver.append_drafts(b, drafts, parents);
  ASSERT_TRUE(driver.step(std::vector<BranchId>{b}, false, &out).ok());
  ASSERT_EQ(out.num_rows, 1 + 6);
  expect_matches(out, 0, seq, 14, "t0");
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> path;
    for (int j = i; j >= 0; j = parents[j]) path.insert(path.begin(), drafts[j]);
    std::vector<int32_t> full = seq;
    full.insert(full.end(), path.begin(), path.end());
    expect_matches(out, 1 + i, full, int32_t(full.size()), "draft " + std::to_string(i));
  }

  // Keep d4, d5: both move down two slots (from storage positions 18, 19 to 14, 15).
  driver.accept(b, std::vector<int32_t>{4, 5});
  EXPECT_EQ(driver.pending_moves(), 2u);
  seq.push_back(44);
  seq.push_back(45);
  EXPECT_EQ(driver.tokens(b), seq);
  seq.push_back(50);
  driver.append(b, std::vector<int32_t>{50});
  // Without the moves the step reads d0, d1's K/V where d4, d5 belong: wrong logits. (The
  // step only writes its own row's slot, which the real step below rewrites.)
  StepBatch batch;
  driver.build_step(std::vector<BranchId>{b}, false, &batch);
  ASSERT_EQ(batch.slot_moves.size(), 2u);
  batch.slot_moves.clear();
  ASSERT_TRUE(backend->forward(batch, &out).ok());
  EXPECT_GT(max_abs_diff(out.row(0), reference(seq) + int64_t(seq.size() - 1) * vocab_, vocab_),
            1e-2f);
  ASSERT_TRUE(driver.step(std::vector<BranchId>{b}, false, &out).ok());
  expect_matches(out, 0, seq, int32_t(seq.size()), "decode after accept");
}

// (f) A branch's logits do not depend on what else is in the batch, nor on the thread count.
// Prompt lengths: a short one (one work item per run) and one long enough for the plan to
// split its KV into chunks, differently alone than among other queries.
class BatchInvarianceTest : public CpuBackendTest, public ::testing::WithParamInterface<int32_t> {};

TEST_P(BatchInvarianceTest, BranchLogitsIndependentOfBatch) {
  constexpr int32_t kPage = 8, kPages = 160;
  const std::vector<int32_t> prompt = test_tokens(GetParam(), 9, vocab_);
  const std::vector<int32_t> other = test_tokens(40, 10, vocab_);
  const std::vector<int32_t> tokens = {100, 200, 300};

  // Alone: the prompt, one fork, three decode steps.
  std::vector<std::vector<float>> alone;
  {
    auto backend = make_cpu_backend(*model_, kPage, kPages);
    ASSERT_NE(backend, nullptr);
    TreeDriver driver(backend.get(), kPage, kPages);
    const BranchId root = driver.start(prompt);
    Logits out;
    ASSERT_TRUE(driver.step(std::vector<BranchId>{root}, false, &out).ok());
    alone.emplace_back(out.row(0), out.row(0) + vocab_);
    const std::vector<BranchId> x = driver.fork(root, 1);
    for (int32_t t : tokens) {
      driver.append(x[0], std::vector<int32_t>{t});
      ASSERT_TRUE(driver.step(x, false, &out).ok());
      alone.emplace_back(out.row(0), out.row(0) + vocab_);
    }
  }
  // Crowded: the same branch among an unrelated prompt, then 3 siblings and that prompt's
  // decode rows; the branch's row is placed in the middle of the batch.
  float worst = 0.0f;
  {
    auto backend = make_cpu_backend(*model_, kPage, kPages);
    ASSERT_NE(backend, nullptr);
    TreeDriver driver(backend.get(), kPage, kPages);
    const BranchId q = driver.start(other);
    const BranchId root = driver.start(prompt);
    Logits out;
    ASSERT_TRUE(driver.step(std::vector<BranchId>{q, root}, false, &out).ok());
    worst = std::max(worst, max_abs_diff(out.row(1), alone[0].data(), vocab_));
    const std::vector<BranchId> x = driver.fork(root, 4);
    for (size_t s = 0; s < tokens.size(); ++s) {
      driver.append(q, std::vector<int32_t>{int32_t(60 + s)});
      for (int i = 0; i < 4; ++i) {
        driver.append(x[i], std::vector<int32_t>{i == 2 ? tokens[s] : int32_t(70 + 5 * i + s)});
      }
      ASSERT_TRUE(driver.step(std::vector<BranchId>{x[0], q, x[1], x[2], x[3]}, false, &out).ok());
      worst = std::max(worst, max_abs_diff(out.row(3), alone[s + 1].data(), vocab_));
    }
  }
  EXPECT_LE(worst, kInvariantTolerance);
  std::printf("[ max |logit alone - logit in batch| = %.3g ]\n", double(worst));
}
INSTANTIATE_TEST_SUITE_P(PromptLengths, BatchInvarianceTest, ::testing::Values(25, 700));

TEST_F(CpuBackendTest, ThreadCountDoesNotChangeLogits) {
  constexpr int32_t kPage = 8, kPages = 64;
  const std::vector<int32_t> prompt = test_tokens(70, 11, vocab_);
  std::vector<std::vector<float>> results;
  for (int32_t threads : {1, 3}) {
    auto backend = make_cpu_backend(*model_, kPage, kPages, threads);
    ASSERT_NE(backend, nullptr);
    TreeDriver driver(backend.get(), kPage, kPages);
    const BranchId root = driver.start(prompt);
    Logits out;
    ASSERT_TRUE(driver.step(std::vector<BranchId>{root}, true, &out).ok());
    const std::vector<BranchId> x = driver.fork(root, 6);
    for (int i = 0; i < 6; ++i) driver.append(x[i], std::vector<int32_t>{int32_t(90 + i)});
    std::vector<float> all = out.data;
    ASSERT_TRUE(driver.step(x, false, &out).ok());
    all.insert(all.end(), out.data.begin(), out.data.end());
    results.push_back(std::move(all));
  }
  EXPECT_TRUE(results[0] == results[1])
      << "max diff "
      << max_abs_diff(results[0].data(), results[1].data(), int64_t(results[0].size()));
}

// tie_word_embeddings: the checkpoint has no lm_head, the LM head is the embedding (the CPU
// weights then keep no copy of it).
TEST_F(CpuBackendTest, TiedEmbeddingsUseTheEmbeddingAsLmHead) {
  ModelConfig config = model_->config;
  config.tie_word_embeddings = true;
  LlamaWeights weights = model_->weights;
  weights.lm_head = weights.embed_tokens;
  CpuBackendOptions options;
  options.page_size = 8;
  options.num_pages = 16;
  auto backend = create_cpu_backend(config, weights, options);
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  TreeDriver driver(backend->get(), 8, 16);
  const std::vector<int32_t> seq = test_tokens(12, 12, vocab_);
  const BranchId b = driver.start(seq);
  Logits out;
  ASSERT_TRUE(driver.step(std::vector<BranchId>{b}, true, &out).ok());
  const std::vector<float> ref = ReferenceModel(config, weights).forward(seq);
  EXPECT_LE(max_abs_diff(out.data.data(), ref.data(), int64_t(ref.size())), kTolerance);
}

TEST_F(CpuBackendTest, RejectsBadOptions) {
  CpuBackendOptions options;
  options.page_size = 0;
  auto r = create_cpu_backend(model_->config, model_->weights, options);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("page_size"), std::string::npos);
  options = CpuBackendOptions{};
  options.num_pages = 0;
  r = create_cpu_backend(model_->config, model_->weights, options);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("num_pages"), std::string::npos);
}

// Random weights (--random-weights): matrices uniform in +-1/sqrt(fan_in), the embedding in
// +-1, norms of ones; one seed reproduces them, another does not; the backend runs on them.
TEST(CpuRandomWeights, HaveTheDocumentedDistributionAndAreReproducible) {
  const TinyModel* model = tiny_model();
  ASSERT_NE(model, nullptr);
  const ModelConfig& c = model->config;
  StatusOr<CpuModelWeights> a = random_cpu_weights(c, 4);
  StatusOr<CpuModelWeights> b = random_cpu_weights(c, 4);
  StatusOr<CpuModelWeights> other = random_cpu_weights(c, 5);
  ASSERT_TRUE(a.ok() && b.ok() && other.ok());
  ASSERT_EQ(a->layers.size(), size_t(c.num_hidden_layers));
  EXPECT_EQ(a->embed, b->embed);
  EXPECT_EQ(a->layers[1].down, b->layers[1].down);
  EXPECT_NE(a->embed, other->embed);
  EXPECT_NE(a->layers[0].qkv, a->layers[1].qkv);  // one seed per matrix
  // Uniform(-s, s): within the bound, mean ~0, variance ~s^2/3.
  auto check_uniform = [](const std::vector<float>& w, int64_t n, double s, const char* what) {
    SCOPED_TRACE(what);
    ASSERT_EQ(int64_t(w.size()), n);
    double sum = 0, sq = 0;
    for (float x : w) {
      ASSERT_LE(std::fabs(x), s);
      sum += x;
      sq += double(x) * x;
    }
    EXPECT_NEAR(sum / double(n), 0.0, 0.02 * s);
    EXPECT_NEAR(sq / double(n), s * s / 3, 0.03 * s * s);
  };
  const int64_t h = c.hidden_size, im = c.intermediate_size;
  check_uniform(a->embed, c.vocab_size * h, 1.0, "embed");
  check_uniform(a->layers[0].qkv, (c.q_size() + 2 * c.kv_size()) * h, 1 / std::sqrt(double(h)),
                "qkv");
  check_uniform(a->layers[2].down, h * im, 1 / std::sqrt(double(im)), "down");
  check_uniform(a->lm_head, c.vocab_size * h, 1 / std::sqrt(double(h)), "lm_head");
  EXPECT_EQ(a->layers[3].post_norm, std::vector<float>(size_t(h), 1.0f));
  EXPECT_EQ(a->norm, std::vector<float>(size_t(h), 1.0f));

  CpuBackendOptions options;
  options.num_pages = 16;
  options.num_threads = 2;
  auto backend = create_cpu_backend_random(c, options, 4);
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  TreeDriver driver(backend->get(), options.page_size, int32_t(options.num_pages));
  const BranchId br = driver.start(test_tokens(20, 1, c.vocab_size));
  Logits out;
  ASSERT_TRUE(driver.step(std::vector<BranchId>{br}, false, &out).ok());
  for (int64_t v = 0; v < out.vocab; ++v) ASSERT_TRUE(std::isfinite(out.row(0)[v]));
}

}  // namespace
}  // namespace treeserve::testing
