// The CUDA backend against the float32 CPU backend on the tiny test model (label gpu): the
// same step batches (built by one KvCache, so both pools hold the same pages) must give
// logits within 2e-2 in fp16 and the same greedy tokens — for one sequence (prefill + 32
// decode steps), a forked tree decoding in one batch, and a speculative token tree with its
// accept (slot moves) followed by more decoding. Also: CUDA graph replay against eager steps
// (fp16 and bf16; full logits, device argmax and device sampling) — bit-identical. Split-K
// forced (gemm_split_k = 2 and 4: the O and down GEMMs as float parts summed by the norm) meets
// the same bounds, and its graph replays are bit-identical to its eager steps. With the FP8
// KV cache (kv_cache_fp8 on both: the CPU backend emulates it) the same scenarios within the
// looser bounds e4m3 K/V allow, graph replays bit-identical, the pool's bytes a token halved.
#include "engine/cuda_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "engine/backend.h"
#include "engine/sampling.h"
#include "kernels/kv_layout.h"
#include "kvcache/kv_cache.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "tests/gpu/gpu_test_util.h"

namespace treeserve {
namespace {

constexpr int64_t kPages = 256;
constexpr int32_t kPageSize = 16;

struct Models {
  ModelConfig config;
  std::unique_ptr<Backend> cpu, gpu;
};

// GTEST_SKIP returns from the function it is in: a macro, so it leaves the test itself.
#define REQUIRE_GPU()                                                                 \
  do {                                                                                \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU test skipped"; \
  } while (0)

using testing::StepBuilder;
using testing::tiny_model_dir;

// split_k: CudaBackendOptions::gemm_split_k (0: auto, the default); fp8_kv: the FP8 KV cache on
// both backends.
Models load(bool bf16, int32_t split_k = 0, bool fp8_kv = false) {
  Models m;
  const auto ckpt = testing::load_tiny_checkpoint();
  if (!ckpt) return m;
  m.config = ckpt->config;
  CpuBackendOptions co;
  co.num_pages = kPages;
  co.page_size = kPageSize;
  co.kv_cache_fp8 = fp8_kv;
  auto cpu = create_cpu_backend(m.config, ckpt->weights, co);
  EXPECT_TRUE(cpu.ok()) << cpu.status().message();
  m.cpu = std::move(*cpu);
  CudaBackendOptions go;
  go.num_pages = kPages;
  go.page_size = kPageSize;
  go.bfloat16 = bf16;
  go.gemm_split_k = split_k;
  go.kv_cache_fp8 = fp8_kv;
  auto gpu = create_cuda_backend(m.config, ckpt->weights, go);
  EXPECT_TRUE(gpu.ok()) << gpu.status().message();
  m.gpu = std::move(*gpu);
  return m;
}

// Step batches from one KvCache, run on both backends.
class Lockstep : public StepBuilder {
 public:
  explicit Lockstep(Models* m) : StepBuilder(kPages, kPageSize), m_(m) {}

  // Runs the step on both; returns max |cpu - gpu| over all logits and checks argmaxes.
  float run(std::vector<int32_t>* greedy_cpu, std::vector<int32_t>* greedy_gpu) {
    EXPECT_TRUE(build_view().ok());
    Logits a, b;
    Status sa = m_->cpu->forward(batch(), &a);
    Status sb = m_->gpu->forward(batch(), &b);
    EXPECT_TRUE(sa.ok()) << sa.message();
    EXPECT_TRUE(sb.ok()) << sb.message();
    float err = 0.0f;
    greedy_cpu->clear();
    greedy_gpu->clear();
    for (int32_t r = 0; r < a.num_rows; ++r) {
      const float* x = a.row(r);
      const float* y = b.row(r);
      for (int64_t v = 0; v < a.vocab; ++v) err = std::max(err, std::fabs(x[v] - y[v]));
      greedy_cpu->push_back(int32_t(std::max_element(x, x + a.vocab) - x));
      greedy_gpu->push_back(int32_t(std::max_element(y, y + b.vocab) - y));
      rows_ += 1;
      agree_ += greedy_cpu->back() == greedy_gpu->back();
    }
    worst_ = std::max(worst_, err);
    clear();
    return err;
  }
  // Over every run so far: the largest logit difference, logit rows, rows whose greedy tokens
  // agree.
  float worst() const { return worst_; }
  int rows() const { return rows_; }
  int agree() const { return agree_; }

 private:
  Models* m_;
  float worst_ = 0.0f;
  int rows_ = 0, agree_ = 0;
};

std::vector<int32_t> prompt_tokens(int n) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(1 + (i * 53 + 7) % 500);
  return p;
}

// same_greedy: every decode step's greedy token must agree (else only the logits' bound holds).
void run_single_sequence(bool bf16, float tol, int32_t split_k = 0, bool fp8_kv = false,
                         bool same_greedy = true) {
  Models m = load(bf16, split_k, fp8_kv);
  ASSERT_TRUE(m.gpu && m.cpu);
  Lockstep ls(&m);
  std::vector<int32_t> prompt = prompt_tokens(37);
  auto nb = ls.kv().create_branch(prompt);
  ASSERT_TRUE(nb.ok());
  ls.add_rows(nb->id, prompt, nb->slots, 0, true);
  std::vector<int32_t> gc, gg;
  float err = ls.run(&gc, &gg);
  EXPECT_LE(err, tol) << "prefill";
  int32_t pos = int32_t(prompt.size());
  int mismatches = 0;
  for (int step = 0; step < 32; ++step) {
    mismatches += gc[0] != gg[0];
    const int32_t next = gc[0];  // both follow the CPU's greedy token
    std::vector<KvSlot> slots;
    ASSERT_TRUE(ls.kv().append(nb->id, std::vector<int32_t>{next}, &slots).ok());
    ls.add_rows(nb->id, {next}, slots, pos++, true);
    err = ls.run(&gc, &gg);
    EXPECT_LE(err, tol) << "decode step " << step;
  }
  if (!bf16 && same_greedy) {
    EXPECT_EQ(mismatches, 0) << "greedy tokens differ";
  }
  if (fp8_kv) {
    std::printf("  FP8 KV, one sequence: max |cpu - gpu| logit %.4f, greedy agrees %d of %d\n",
                ls.worst(), ls.agree(), ls.rows());
  }
}

TEST(CudaBackend, SingleSequenceMatchesCpuFp16) {
  REQUIRE_GPU();
  run_single_sequence(false, 2e-2f);
}

TEST(CudaBackend, SingleSequenceMatchesCpuBf16) {
  REQUIRE_GPU();
  run_single_sequence(true, 1.5e-1f);
}

// Split-K forced: every decode step (1 row) splits its O and down GEMMs; the 37-token prefill
// too (at most 256 rows). Same bounds and greedy tokens as one GEMM.
TEST(CudaBackend, SplitKForcedMatchesCpu) {
  REQUIRE_GPU();
  for (int32_t split_k : {2, 4}) {
    SCOPED_TRACE("gemm_split_k " + std::to_string(split_k));
    run_single_sequence(false, 2e-2f, split_k);
    run_single_sequence(true, 1.5e-1f, split_k);
  }
}

// attention_max_chunk_tokens outside [0, the workspace's longest item] and
// attention_pair_margin outside [2, 1024] are refused by name.
TEST(CudaBackend, RejectsAttentionOptionsOutOfRange) {
  REQUIRE_GPU();
  const auto ckpt = testing::load_tiny_checkpoint();
  ASSERT_TRUE(ckpt);
  auto expect_refused = [&](const char* name, int32_t bad, auto set) {
    CudaBackendOptions go;
    go.num_pages = kPages;
    go.page_size = kPageSize;
    set(go, bad);
    auto gpu = create_cuda_backend(ckpt->config, ckpt->weights, go);
    ASSERT_FALSE(gpu.ok()) << name << " " << bad;
    EXPECT_EQ(gpu.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(gpu.status().message().find(name), std::string::npos) << gpu.status().message();
  };
  for (int32_t bad : {-1, 4096}) {
    expect_refused("attention_max_chunk_tokens", bad,
                   [](CudaBackendOptions& o, int32_t v) { o.attention_max_chunk_tokens = v; });
  }
  for (int32_t bad : {1, 0, 1025}) {
    expect_refused("attention_pair_margin", bad,
                   [](CudaBackendOptions& o, int32_t v) { o.attention_pair_margin = v; });
  }
}

// Greedy-only steps return each row's argmax and logprob computed on the device.
TEST(CudaBackend, ArgmaxOnlyStepsMatchCpuGreedy) {
  REQUIRE_GPU();
  Models m = load(false);
  ASSERT_TRUE(m.gpu && m.cpu);
  StepBuilder sb(kPages, kPageSize);
  std::vector<int32_t> prompt = prompt_tokens(21);
  auto nb = sb.kv().create_branch(prompt);
  ASSERT_TRUE(nb.ok());
  auto forked = sb.kv().fork(nb->id, 3);
  ASSERT_TRUE(forked.ok());
  sb.add_rows(nb->id, prompt, nb->slots, 0, false);
  sb.add_page_copies(forked->copies);
  // The three forks each decode one different token in the same step.
  for (int i = 0; i < 3; ++i) {
    std::vector<KvSlot> slots;
    ASSERT_TRUE(sb.kv().append(forked->branches[i], std::vector<int32_t>{50 + i}, &slots).ok());
    sb.add_rows(forked->branches[i], {50 + i}, slots, int32_t(prompt.size()), true);
  }
  ASSERT_TRUE(sb.build_view().ok());
  StepBatch& batch = sb.batch();
  batch.full_logits = false;
  Logits a, b;
  ASSERT_TRUE(m.cpu->forward(batch, &a).ok());
  ASSERT_TRUE(m.gpu->forward(batch, &b).ok());
  ASSERT_TRUE(b.data.empty());
  ASSERT_EQ(b.argmax.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    const float* x = a.row(r);
    const int32_t best = int32_t(std::max_element(x, x + a.vocab) - x);
    double sum = 0;
    for (int64_t v = 0; v < a.vocab; ++v) sum += std::exp(double(x[v]) - double(x[best]));
    EXPECT_EQ(b.argmax[r], best) << "row " << r;
    EXPECT_NEAR(b.argmax_logprob[r], -std::log(sum), 2e-2) << "row " << r;
  }
}

// With StepBatch::vocab_limit the device argmax and its logprob cover only the first
// vocab_limit ids (a tokenizer smaller than the model's padded vocab_size).
TEST(CudaBackend, ArgmaxOnlyStepsHonourTheVocabLimit) {
  REQUIRE_GPU();
  Models m = load(false);
  ASSERT_TRUE(m.gpu && m.cpu);
  constexpr int64_t kLimit = 200;
  StepBuilder sb(kPages, kPageSize);
  const std::vector<int32_t> prompt = prompt_tokens(40);
  auto nb = sb.kv().create_branch(prompt);
  ASSERT_TRUE(nb.ok());
  sb.add_rows(nb->id, prompt, nb->slots, 0, false);
  StepBatch& batch = sb.batch();
  for (size_t i = 0; i < prompt.size(); ++i) {
    batch.logit_rows.push_back(int32_t(i));  // every position: many different rows
  }
  ASSERT_TRUE(sb.build_view().ok());
  Logits a, b;
  ASSERT_TRUE(m.cpu->forward(batch, &a).ok());
  batch.full_logits = false;
  batch.vocab_limit = kLimit;
  ASSERT_TRUE(m.gpu->forward(batch, &b).ok());
  ASSERT_EQ(b.argmax.size(), prompt.size());
  int32_t limited = 0;  // rows whose unlimited argmax is past the limit
  for (int32_t r = 0; r < a.num_rows; ++r) {
    const float* x = a.row(r);
    const int32_t best = int32_t(std::max_element(x, x + kLimit) - x);
    limited += std::max_element(x, x + a.vocab) - x >= kLimit;
    double sum = 0;
    for (int64_t v = 0; v < kLimit; ++v) sum += std::exp(double(x[v]) - double(x[best]));
    EXPECT_EQ(b.argmax[r], best) << "row " << r;
    EXPECT_NEAR(b.argmax_logprob[r], -std::log(sum), 2e-2) << "row " << r;
  }
  EXPECT_GT(limited, 0) << "no row needed the limit: the test proves nothing";
}

// create_cuda_backend_random draws the values create_cpu_backend_random does (the same hash
// of seed and index), so the two agree to fp16 rounding: a GPU random-weights run can be
// checked on the CPU.
TEST(CudaBackend, RandomWeightsMatchTheCpuBackendsRandomWeights) {
  REQUIRE_GPU();
  Models m;
  auto config = load_model_config(tiny_model_dir());
  ASSERT_TRUE(config.ok()) << config.status().message();
  m.config = *config;
  CpuBackendOptions co;
  co.num_pages = kPages;
  co.page_size = kPageSize;
  auto cpu = create_cpu_backend_random(m.config, co, 9);
  ASSERT_TRUE(cpu.ok()) << cpu.status().message();
  m.cpu = std::move(*cpu);
  CudaBackendOptions go;
  go.num_pages = kPages;
  go.page_size = kPageSize;
  auto gpu = create_cuda_backend_random(m.config, go, 9);
  ASSERT_TRUE(gpu.ok()) << gpu.status().message();
  m.gpu = std::move(*gpu);
  Lockstep ls(&m);
  const std::vector<int32_t> prompt = prompt_tokens(29);
  auto nb = ls.kv().create_branch(prompt);
  ASSERT_TRUE(nb.ok());
  ls.add_rows(nb->id, prompt, nb->slots, 0, true);
  std::vector<int32_t> gc, gg;
  EXPECT_LE(ls.run(&gc, &gg), 2e-2f) << "prefill";
  int32_t pos = int32_t(prompt.size());
  for (int step = 0; step < 8; ++step) {
    std::vector<KvSlot> slots;
    ASSERT_TRUE(ls.kv().append(nb->id, std::vector<int32_t>{gc[0]}, &slots).ok());
    ls.add_rows(nb->id, {gc[0]}, slots, pos++, true);
    EXPECT_LE(ls.run(&gc, &gg), 2e-2f) << "decode step " << step;
  }
}

// tol bounds each step's logits; same_greedy: every step's greedy tokens agree.
void run_forked_tree(bool fp8_kv, float tol, bool same_greedy) {
  Models m = load(false, 0, fp8_kv);
  ASSERT_TRUE(m.gpu && m.cpu);
  Lockstep ls(&m);
  std::vector<int32_t> prompt = prompt_tokens(45);  // ends mid-page: forks copy a page
  auto root = ls.kv().create_branch(prompt);
  ASSERT_TRUE(root.ok());
  ls.add_rows(root->id, prompt, root->slots, 0, false);
  std::vector<int32_t> gc, gg;
  ls.run(&gc, &gg);
  auto forked = ls.kv().fork(root->id, 6);
  ASSERT_TRUE(forked.ok());
  ls.add_page_copies(forked->copies);
  std::vector<int32_t> len(6, int32_t(prompt.size()));
  std::vector<int32_t> next(6);
  for (int i = 0; i < 6; ++i) next[i] = 10 + 17 * i;
  for (int step = 0; step < 12; ++step) {
    for (int i = 0; i < 6; ++i) {
      std::vector<KvSlot> slots;
      std::vector<int32_t> toks = {next[i]};
      if (step == 0 && i % 2 == 1) toks.push_back(300 + i);  // some branches append two
      ASSERT_TRUE(ls.kv().append(forked->branches[i], toks, &slots).ok());
      ls.add_rows(forked->branches[i], toks, slots, len[i], true);
      len[i] += int32_t(toks.size());
    }
    float err = ls.run(&gc, &gg);
    EXPECT_LE(err, tol) << "step " << step;
    if (same_greedy) {
      EXPECT_EQ(gc, gg) << "step " << step;
    }
    next = gc;
  }
  if (fp8_kv) {
    std::printf("  FP8 KV, forked tree: max |cpu - gpu| logit %.4f, greedy agrees %d of %d\n",
                ls.worst(), ls.agree(), ls.rows());
  }
}

TEST(CudaBackend, ForkedTreeMatchesCpu) {
  REQUIRE_GPU();
  run_forked_tree(false, 2e-2f, true);
}

void run_speculative(bool fp8_kv, float tol, bool same_greedy) {
  Models m = load(false, 0, fp8_kv);
  ASSERT_TRUE(m.gpu && m.cpu);
  Lockstep ls(&m);
  std::vector<int32_t> prompt = prompt_tokens(30);
  // The prompt but its last token first; then the last token with a token tree of drafts.
  std::vector<int32_t> head(prompt.begin(), prompt.end() - 1);
  auto b = ls.kv().create_branch(head);
  ASSERT_TRUE(b.ok());
  ls.add_rows(b->id, head, b->slots, 0, false);
  std::vector<int32_t> gc, gg;
  ls.run(&gc, &gg);
  std::vector<KvSlot> slots;
  ASSERT_TRUE(ls.kv().append(b->id, std::vector<int32_t>{prompt.back()}, &slots).ok());
  ls.add_rows(b->id, {prompt.back()}, slots, int32_t(head.size()), true);
  ASSERT_TRUE(ls.add_token_tree(b->id, {5, 6, 7, 8, 9, 10, 11}, {-1, -1, 0, 0, 2, 1, 4},
                                int32_t(prompt.size()))
                  .ok());
  float err = ls.run(&gc, &gg);
  EXPECT_LE(err, tol);
  if (same_greedy) {
    EXPECT_EQ(gc, gg);
  }
  // Accept the chain 0 -> 2 -> 4 -> 6; its KV moves into place; decoding continues.
  std::vector<SlotMove> moves;
  ASSERT_TRUE(ls.kv().accept(b->id, std::vector<int32_t>{0, 2, 4, 6}, &moves).ok());
  ls.add_slot_moves(moves);
  int32_t pos = int32_t(prompt.size()) + 4;
  for (int step = 0; step < 8; ++step) {
    std::vector<KvSlot> s;
    const int32_t tok = 40 + step;
    ASSERT_TRUE(ls.kv().append(b->id, std::vector<int32_t>{tok}, &s).ok());
    ls.add_rows(b->id, {tok}, s, pos++, true);
    err = ls.run(&gc, &gg);
    EXPECT_LE(err, tol) << "after accept, step " << step;
    if (same_greedy) {
      EXPECT_EQ(gc, gg);
    }
  }
  if (fp8_kv) {
    std::printf("  FP8 KV, token tree + accept: max |cpu - gpu| logit %.4f, greedy %d of %d\n",
                ls.worst(), ls.agree(), ls.rows());
  }
}

TEST(CudaBackend, SpeculativeTokenTreeAndAcceptMatchCpu) {
  REQUIRE_GPU();
  run_speculative(false, 2e-2f, true);
}

// CUDA graphs against the same backend run eagerly: a forked tree decoding
// (its shape repeats: captured on the second step, replayed after), interrupted by one-off
// steps of other shapes (a longer append; a 300-token prefill that grows the step buffers,
// so the graphs of the old buffers no longer match) — every step's logits bit-identical.
// Steps cycle through the three ways a step returns its rows (full logits, device argmax,
// device sampling), all behind the same captured layers; every result must be identical.
void run_graph_replay(bool bf16, int32_t split_k = 0, bool fp8_kv = false) {
  const auto ckpt = testing::load_tiny_checkpoint();
  ASSERT_TRUE(ckpt);
  CudaBackendOptions go;
  go.num_pages = kPages;
  go.page_size = kPageSize;
  go.bfloat16 = bf16;
  go.gemm_split_k = split_k;
  go.kv_cache_fp8 = fp8_kv;
  go.cuda_graphs = true;
  auto graphs = create_cuda_backend(ckpt->config, ckpt->weights, go);
  go.cuda_graphs = false;
  auto eager = create_cuda_backend(ckpt->config, ckpt->weights, go);
  ASSERT_TRUE(graphs.ok() && eager.ok());
  StepBuilder sb(kPages, kPageSize);
  SamplingParams sampling;
  sampling.temperature = 0.8f;
  sampling.top_p = 0.9f;
  sampling.seed = 5;
  sampling.logprobs = 3;
  auto run = [&](const char* what, int step) {
    ASSERT_TRUE(sb.build_view().ok());
    StepBatch& batch = sb.batch();
    const int mode = step % 3;  // 0 full logits, 1 argmax only, 2 sampled
    batch.full_logits = mode == 0;
    if (mode == 2) {
      for (size_t r = 0; r < batch.logit_rows.size(); ++r) {
        batch.sampling.push_back({sampling, 1000 + r, int64_t(step)});
      }
    }
    Logits a, b;
    const Status ga = (*graphs)->forward(batch, &a);
    const Status eb = (*eager)->forward(batch, &b);
    sb.clear();  // (before any ASSERT: a failed step must not poison the next one's view)
    ASSERT_TRUE(ga.ok()) << what << " " << step << ": graphs backend: " << ga.ToString();
    ASSERT_TRUE(eb.ok()) << what << " " << step << ": eager backend: " << eb.ToString();
    ASSERT_EQ(a.data.size(), b.data.size());
    float err = 0.f;
    for (size_t i = 0; i < a.data.size(); ++i) {
      err = std::max(err, std::fabs(a.data[i] - b.data[i]));
    }
    EXPECT_EQ(err, 0.f) << what << " step " << step;
    EXPECT_EQ(a.argmax, b.argmax) << what << " step " << step;
    EXPECT_EQ(a.argmax_logprob, b.argmax_logprob) << what << " step " << step;
    ASSERT_EQ(a.sampled.size(), b.sampled.size());
    for (size_t r = 0; r < a.sampled.size(); ++r) {
      EXPECT_EQ(a.sampled[r].token, b.sampled[r].token) << what << " step " << step;
      EXPECT_EQ(a.sampled[r].logprob, b.sampled[r].logprob) << what << " step " << step;
      ASSERT_EQ(a.sampled[r].top.size(), b.sampled[r].top.size());
      for (size_t k = 0; k < a.sampled[r].top.size(); ++k) {
        EXPECT_EQ(a.sampled[r].top[k].token, b.sampled[r].top[k].token);
        EXPECT_EQ(a.sampled[r].top[k].logprob, b.sampled[r].top[k].logprob);
      }
    }
    EXPECT_EQ(!a.sampled.empty(), mode == 2) << what << " step " << step;
  };
  const std::vector<int32_t> prompt = prompt_tokens(45);
  auto root = sb.kv().create_branch(prompt);
  ASSERT_TRUE(root.ok());
  sb.add_rows(root->id, prompt, root->slots, 0, true);
  run("prompt", 0);
  auto forked = sb.kv().fork(root->id, 5);
  ASSERT_TRUE(forked.ok());
  sb.add_page_copies(forked->copies);
  std::vector<int32_t> len(5, int32_t(prompt.size()));
  for (int step = 0; step < 24; ++step) {
    for (int i = 0; i < 5; ++i) {
      std::vector<int32_t> toks = {1 + (step * 31 + i * 7) % 500};
      if (step == 9 && i == 2) toks = {5, 6, 7};  // a one-off shape
      std::vector<KvSlot> slots;
      ASSERT_TRUE(sb.kv().append(forked->branches[i], toks, &slots).ok());
      sb.add_rows(forked->branches[i], toks, slots, len[i], true);
      len[i] += int32_t(toks.size());
    }
    if (step == 15) {  // a long prefill alongside: the step buffers grow
      const std::vector<int32_t> other = prompt_tokens(300);
      auto b = sb.kv().create_branch(other);
      ASSERT_TRUE(b.ok());
      // It shares the first prompt's opening tokens: only the rest is computed.
      ASSERT_GT(b->cached_tokens, 0);
      sb.add_page_copies(b->copies);
      const std::vector<int32_t> rest(other.begin() + b->cached_tokens, other.end());
      sb.add_rows(b->id, rest, b->slots, b->cached_tokens, true);
    }
    run("decode", step);
  }
}

TEST(CudaBackend, GraphReplayMatchesEagerSteps) {
  REQUIRE_GPU();
  // A failed capture falls back to eager steps (and says so): that would pass unnoticed.
  ::testing::internal::CaptureStderr();
  run_graph_replay(false);
  run_graph_replay(true);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(log.find("capture failed"), std::string::npos) << log;
}

// The same with split-K forced: the decode steps (5 rows) replay split O and down GEMMs.
TEST(CudaBackend, GraphReplayMatchesEagerStepsWithSplitK) {
  REQUIRE_GPU();
  ::testing::internal::CaptureStderr();
  run_graph_replay(false, 2);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(log.find("capture failed"), std::string::npos) << log;
}

// The FP8 KV cache against the CPU backend's emulation of it (the same quantization rule on
// float32 K and V): the GPU quantizes K and V after rounding them to the model dtype, so a value
// near an e4m3 rounding boundary lands on the other side, a whole e4m3 step (1/8 relative),
// and the model amplifies it, as with FP8 weights (fp8_test.cpp). Measured on an H200: 0.12 at
// most over the three scenarios; wrong scales, rows or pages give errors of the logits' own size
// (they are within +-10 here).
constexpr float kFp8KvTolerance = 0.3f;

TEST(CudaBackend, Fp8KvCacheTracksTheCpuEmulation) {
  REQUIRE_GPU();
  run_single_sequence(false, kFp8KvTolerance, 0, true, false);
  run_forked_tree(true, kFp8KvTolerance, false);
  run_speculative(true, kFp8KvTolerance, false);
}

// The FP8 pool holds a token in (head_dim + 4) / (2 head_dim) of the bytes, and its logits are
// not the 16-bit pool's (the cache is really e4m3) but stay near them.
TEST(CudaBackend, Fp8KvCacheHalvesThePoolAndStaysNearFp16) {
  REQUIRE_GPU();
  Models fp16 = load(false);
  Models fp8 = load(false, 0, true);
  ASSERT_TRUE(fp16.gpu && fp8.gpu);
  const KvLayout& a = fp16.gpu->kv_layout();
  const KvLayout& b = fp8.gpu->kv_layout();
  EXPECT_EQ(b.dtype_bytes, 1);
  EXPECT_EQ(b.scale_bytes, 4);
  EXPECT_EQ(b.bytes_per_token() * 2 * a.head_dim, a.bytes_per_token() * (a.head_dim + 4));
  StepBuilder sb(kPages, kPageSize);
  const std::vector<int32_t> prompt = prompt_tokens(70);
  auto nb = sb.kv().create_branch(prompt);
  ASSERT_TRUE(nb.ok());
  sb.add_rows(nb->id, prompt, nb->slots, 0, true);
  int32_t pos = int32_t(prompt.size());
  float worst = 0.0f;
  int differ = 0;
  for (int step = 0; step < 8; ++step) {
    ASSERT_TRUE(sb.build_view().ok());
    Logits x, y;
    ASSERT_TRUE(fp16.gpu->forward(sb.batch(), &x).ok());
    ASSERT_TRUE(fp8.gpu->forward(sb.batch(), &y).ok());
    sb.clear();
    ASSERT_EQ(x.data.size(), y.data.size());
    for (size_t i = 0; i < x.data.size(); ++i) {
      worst = std::max(worst, std::fabs(x.data[i] - y.data[i]));
      differ += x.data[i] != y.data[i];
    }
    const float* r = x.row(x.num_rows - 1);
    const int32_t next = int32_t(std::max_element(r, r + x.vocab) - r);
    std::vector<KvSlot> slots;
    ASSERT_TRUE(sb.kv().append(nb->id, std::vector<int32_t>{next}, &slots).ok());
    sb.add_rows(nb->id, {next}, slots, pos++, true);
  }
  std::printf("  FP8 KV against the fp16 pool: max |logit difference| %.4f, %d logits differ\n",
              worst, differ);
  EXPECT_GT(differ, 0);
  EXPECT_LE(worst, kFp8KvTolerance);
}

TEST(CudaBackend, GraphReplayMatchesEagerStepsWithFp8KvCache) {
  REQUIRE_GPU();
  ::testing::internal::CaptureStderr();
  run_graph_replay(false, 0, true);
  run_graph_replay(true, 0, true);
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(log.find("capture failed"), std::string::npos) << log;
}

}  // namespace
}  // namespace treeserve
