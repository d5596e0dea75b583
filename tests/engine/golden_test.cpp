// The CPU backend against Hugging Face transformers: tests/golden/tiny_llama_golden.json,
// written by tests/golden/make_golden.py (its docstring describes the fields). Max abs logit
// error <= 1e-3 and identical greedy continuations, and the tree case: 8 suffixes
// forked from one shared prompt, all in one batch, give each sequence's own logits.
// The environment variable TREESERVE_GOLDEN_JSON overrides the file (e.g. a freshly made one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/engine/engine_test_util.h"

namespace treeserve::testing {
namespace {

constexpr float kGoldenTolerance = 1e-3f;
constexpr int32_t kPage = 16;
constexpr int32_t kPages = 256;

using nlohmann::json;

class GoldenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* env = std::getenv("TREESERVE_GOLDEN_JSON");
    path_ = env != nullptr && *env != '\0' ? env : TREESERVE_GOLDEN_JSON;
    if (!std::filesystem::exists(path_)) {
      GTEST_SKIP() << path_ << " is missing: make it on a machine with torch + transformers with "
                   << "`python3 tests/golden/make_golden.py <build>/tiny-llama` (see its "
                   << "docstring) and commit it";
    }
    std::ifstream in(path_);
    golden_ = json::parse(in, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(golden_.is_discarded()) << path_ << " is not valid JSON";
    model_ = tiny_model();
    ASSERT_NE(model_, nullptr);
    vocab_ = model_->config.vocab_size;
    ASSERT_EQ(golden_["reference"].value("vocab_size", int64_t(0)), vocab_)
        << path_ << " was made for another model: regenerate it for this tiny model";
    backend_ = make_cpu_backend(*model_, kPage, kPages);
    ASSERT_NE(backend_, nullptr);
    driver_ = std::make_unique<TreeDriver>(backend_.get(), kPage, kPages);
  }

  void TearDown() override {
    if (checked_ > 0) {
      std::printf("[ %d golden rows, max |logit - transformers| = %.3g ]\n", checked_,
                  double(worst_));
    }
  }

  // Expects `row` to equal the golden logits `want` (a JSON array of vocab floats).
  void expect_logits(const float* row, const json& want, const std::string& what) {
    ASSERT_TRUE(want.is_array() && int64_t(want.size()) == vocab_) << what << ": bad golden row";
    float diff = 0.0f;
    for (int64_t i = 0; i < vocab_; ++i) {
      const float d = std::fabs(row[i] - want[size_t(i)].get<float>());
      if (!(d <= diff)) diff = d;
    }
    EXPECT_LE(diff, kGoldenTolerance) << what;
    worst_ = std::max(worst_, diff);
    ++checked_;
  }

  static std::vector<int32_t> ids(const json& j) { return j.get<std::vector<int32_t>>(); }

  std::string path_;
  json golden_;
  const TinyModel* model_ = nullptr;
  int64_t vocab_ = 0;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<TreeDriver> driver_;
  float worst_ = 0.0f;
  int checked_ = 0;
};

TEST_F(GoldenTest, PromptLogits) {
  Logits out;
  for (const json& p : golden_["prompts"]) {
    const std::string name = p["name"].get<std::string>();
    const BranchId b = driver_->start(ids(p["ids"]));
    ASSERT_TRUE(driver_->step(std::vector<BranchId>{b}, false, &out).ok());
    expect_logits(out.row(0), p["last_logits"], "prompt " + name + " last position");
    driver_->prune(b);
  }
  const json& all = golden_["all_positions"];
  const std::vector<int32_t> prompt = ids(all["ids"]);
  // A fresh cache: no prefix reuse, every position computed in this one batch.
  TreeDriver fresh(backend_.get(), kPage, kPages);
  const BranchId b = fresh.start(prompt);
  ASSERT_TRUE(fresh.step(std::vector<BranchId>{b}, true, &out).ok());
  ASSERT_EQ(out.num_rows, int32_t(prompt.size()));
  for (int32_t t = 0; t < out.num_rows; ++t) {
    expect_logits(out.row(t), all["logits"][size_t(t)], "all_positions row " + std::to_string(t));
  }
}

TEST_F(GoldenTest, GreedyContinuation) {
  const json& g = golden_["greedy"];
  const std::vector<int32_t> want = ids(g["tokens"]);
  const BranchId b = driver_->start(ids(g["prompt_ids"]));
  Logits out;
  ASSERT_TRUE(driver_->step(std::vector<BranchId>{b}, false, &out).ok());
  std::vector<int32_t> got;
  for (size_t k = 0; k < want.size(); ++k) {
    expect_logits(out.row(0), g["step_logits"][k], "greedy step " + std::to_string(k));
    const int32_t token = int32_t(std::max_element(out.row(0), out.row(0) + vocab_) - out.row(0));
    got.push_back(token);
    // Continue with the golden token so one divergence does not hide the later steps.
    driver_->append(b, std::vector<int32_t>{want[k]});
    if (k + 1 < want.size()) {
      ASSERT_TRUE(driver_->step(std::vector<BranchId>{b}, false, &out).ok());
    }
  }
  EXPECT_EQ(got, want) << "greedy continuation differs from transformers";
}

// The tree: the shared prompt prefilled once, forked 8 ways, each suffix run as one chunk,
// all 8 chunks in one batch.
TEST_F(GoldenTest, TreeOfSuffixesInOneBatch) {
  const json& tree = golden_["tree"];
  const BranchId root = driver_->start(ids(tree["prompt_ids"]));
  Logits out;
  ASSERT_TRUE(driver_->step(std::vector<BranchId>{root}, false, &out).ok());
  const size_t n = tree["suffixes"].size();
  const std::vector<BranchId> branches = driver_->fork(root, int32_t(n));
  ASSERT_EQ(branches.size(), n);
  for (size_t j = 0; j < n; ++j) driver_->append(branches[j], ids(tree["suffixes"][j]["ids"]));
  ASSERT_TRUE(driver_->step(branches, true, &out).ok());
  int32_t row = 0;
  for (size_t j = 0; j < n; ++j) {
    const json& s = tree["suffixes"][j];
    const std::string what = "suffix '" + s["text"].get<std::string>() + "'";
    for (size_t p = 0; p < s["ids"].size(); ++p, ++row) {
      expect_logits(out.row(row), s["suffix_logits"][p], what + " position " + std::to_string(p));
    }
    expect_logits(out.row(row - 1), s["last_logits"], what + " last");
  }
  EXPECT_EQ(row, out.num_rows);

  // Tree attention == per-sequence attention: each full sequence prefilled alone (one causal
  // run, a fresh pool) gives the tree's logits to float rounding.
  float worst = 0.0f;
  row = 0;
  for (size_t j = 0; j < n; ++j) {
    std::vector<int32_t> seq = ids(tree["prompt_ids"]);
    const std::vector<int32_t> suffix = ids(tree["suffixes"][j]["ids"]);
    seq.insert(seq.end(), suffix.begin(), suffix.end());
    auto alone_backend = make_cpu_backend(*model_, kPage, kPages);
    ASSERT_NE(alone_backend, nullptr);
    TreeDriver alone(alone_backend.get(), kPage, kPages);
    const BranchId b = alone.start(seq);
    Logits single;
    ASSERT_TRUE(alone.step(std::vector<BranchId>{b}, true, &single).ok());
    for (size_t p = 0; p < suffix.size(); ++p, ++row) {
      const int32_t t = int32_t(seq.size() - suffix.size() + p);
      worst = std::max(worst, max_abs_diff(out.row(row), single.row(t), vocab_));
    }
  }
  EXPECT_LE(worst, 1e-5f) << "tree vs each sequence alone";
  std::printf("[ tree vs each sequence alone: max |diff| = %.3g ]\n", double(worst));
}

// The same tree decoded one token per branch per step (branches drop out as their suffix
// ends), as the scheduler runs n-way generation.
TEST_F(GoldenTest, TreeOfSuffixesDecodedTogether) {
  const json& tree = golden_["tree"];
  const BranchId root = driver_->start(ids(tree["prompt_ids"]));
  Logits out;
  ASSERT_TRUE(driver_->step(std::vector<BranchId>{root}, false, &out).ok());
  const size_t n = tree["suffixes"].size();
  const std::vector<BranchId> branches = driver_->fork(root, int32_t(n));
  ASSERT_EQ(branches.size(), n);
  for (size_t p = 0;; ++p) {
    std::vector<BranchId> live;
    std::vector<size_t> which;
    for (size_t j = 0; j < n; ++j) {
      const json& s = tree["suffixes"][j];
      if (p < s["ids"].size()) {
        driver_->append(branches[j], std::vector<int32_t>{s["ids"][p].get<int32_t>()});
        live.push_back(branches[j]);
        which.push_back(j);
      }
    }
    if (live.empty()) break;
    ASSERT_TRUE(driver_->step(live, false, &out).ok());
    for (size_t i = 0; i < live.size(); ++i) {
      const json& s = tree["suffixes"][which[i]];
      expect_logits(out.row(int32_t(i)), s["suffix_logits"][p],
                    "suffix '" + s["text"].get<std::string>() + "' step " + std::to_string(p));
    }
  }
}

}  // namespace
}  // namespace treeserve::testing
