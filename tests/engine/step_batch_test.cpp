// validate_step_batch and the backend's boundary: every malformed field is INVALID_ARGUMENT
// naming the field, and a rejected batch leaves the KV pool untouched (its page copies and
// slot moves, which would overwrite the prompt's KV, are not performed).
#include "engine/step_batch.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "tests/engine/engine_test_util.h"

namespace treeserve::testing {
namespace {

constexpr int32_t kPage = 4;
constexpr int32_t kPages = 32;

struct Malformation {
  std::string name;
  std::function<void(StepBatch*)> mutate;
  std::string field;  // expected in the message
};

class StepBatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = tiny_model();
    ASSERT_NE(model_, nullptr);
    backend_ = make_cpu_backend(*model_, kPage, kPages);
    ASSERT_NE(backend_, nullptr);
    driver_ = std::make_unique<TreeDriver>(backend_.get(), kPage, kPages);
    const BranchId root = driver_->start(test_tokens(10, 21, model_->config.vocab_size));
    Logits out;
    ASSERT_TRUE(driver_->step(std::vector<BranchId>{root}, false, &out).ok());
    // The probe: two branches forked from the prompt, one decode row each. Running it again
    // rewrites the same K/V at the same slots, so its logits are reproducible exactly as long
    // as nothing else touched the pool.
    branches_ = driver_->fork(root, 2);
    driver_->append(branches_[0], std::vector<int32_t>{33});
    driver_->append(branches_[1], std::vector<int32_t>{34});
    driver_->build_step(branches_, false, &probe_);
    ASSERT_EQ(probe_.page_copies.size(), 2u);
    ASSERT_TRUE(backend_->forward(probe_, &expected_).ok());
    probe_.page_copies.clear();  // done; the probe's rows alone are idempotent
    ASSERT_TRUE(backend_->forward(probe_, &out).ok());
    ASSERT_EQ(out.data, expected_.data);
  }

  // A valid page copy and slot move that would overwrite the prompt's first page with zeros.
  void add_harmful_copy_and_move(StepBatch* batch) const {
    const int32_t prompt_page = probe_.view.pages[0];
    batch->page_copies.push_back({kPages - 1, prompt_page, kPage});
    batch->slot_moves.push_back({int64_t(kPages - 1) * kPage, int64_t(prompt_page) * kPage + 1});
  }

  const TinyModel* model_ = nullptr;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<TreeDriver> driver_;
  std::vector<BranchId> branches_;
  StepBatch probe_;
  Logits expected_;
};

TEST_F(StepBatchTest, TheHarmfulCopyIsHarmful) {
  StepBatch batch = probe_;
  add_harmful_copy_and_move(&batch);
  Logits out;
  ASSERT_TRUE(backend_->forward(batch, &out).ok());
  EXPECT_NE(out.data, expected_.data) << "the pool check below would prove nothing";
}

TEST_F(StepBatchTest, RejectsEachMalformedFieldAndLeavesThePoolUntouched) {
  const int64_t vocab = model_->config.vocab_size;
  const int64_t pool_slots = int64_t(kPages) * kPage;
  const std::vector<Malformation> cases = {
      {"extra token", [](StepBatch* b) { b->token_ids.push_back(5); }, "token_ids"},
      {"missing position", [](StepBatch* b) { b->positions.pop_back(); }, "positions"},
      {"token id = vocab", [&](StepBatch* b) { b->token_ids[1] = int32_t(vocab); }, "token_ids[1]"},
      {"negative token id", [](StepBatch* b) { b->token_ids[0] = -1; }, "token_ids[0]"},
      {"negative position", [](StepBatch* b) { b->positions[0] = -1; }, "positions[0]"},
      {"position off the view", [](StepBatch* b) { b->positions[1] += 1; }, "positions[1]"},
      {"slot outside the pool", [&](StepBatch* b) { b->kv_slots[0] = pool_slots; }, "kv_slots[0]"},
      {"negative slot", [](StepBatch* b) { b->kv_slots[1] = -1; }, "kv_slots[1]"},
      {"slot off the view", [](StepBatch* b) { b->kv_slots[0] = 0; }, "kv_slots[0]"},
      {"two rows one slot", [](StepBatch* b) { b->kv_slots[1] = b->kv_slots[0]; }, "kv_slots"},
      {"logit row past the rows", [](StepBatch* b) { b->logit_rows[0] = 2; }, "logit_rows[0]"},
      {"negative logit row", [](StepBatch* b) { b->logit_rows[1] = -1; }, "logit_rows[1]"},
      {"vocab_limit past the vocab", [&](StepBatch* b) { b->vocab_limit = vocab + 1; },
       "vocab_limit"},
      {"negative vocab_limit", [](StepBatch* b) { b->vocab_limit = -1; }, "vocab_limit"},
      {"sampling for one of two logit rows", [](StepBatch* b) { b->sampling.resize(1); },
       "sampling"},
      {"sampling with a bad top_p",
       [](StepBatch* b) {
         b->sampling.resize(2);
         b->sampling[1].params.top_p = 0.0f;
       },
       "sampling[1]"},
      {"copy onto itself",
       [](StepBatch* b) {
         b->page_copies.insert(b->page_copies.begin(), {3, 3, 1});
       },
       "page_copies[0]"},
      {"copy from outside the pool",
       [](StepBatch* b) {
         b->page_copies.insert(b->page_copies.begin(), {kPages, 3, 1});
       },
       "page_copies[0]"},
      {"copy of no slots",
       [](StepBatch* b) {
         b->page_copies.insert(b->page_copies.begin(), {2, 3, 0});
       },
       "page_copies[0].num_slots"},
      {"copy of too many slots",
       [](StepBatch* b) {
         b->page_copies.insert(b->page_copies.begin(), {2, 3, kPage + 1});
       },
       "page_copies[0].num_slots"},
      {"move from outside the pool",
       [&](StepBatch* b) {
         b->slot_moves.insert(b->slot_moves.begin(), {-1, 0});
       },
       "slot_moves[0]"},
      {"move to outside the pool",
       [&](StepBatch* b) {
         b->slot_moves.insert(b->slot_moves.begin(), {0, pool_slots});
       },
       "slot_moves[0]"},
      {"view page size", [](StepBatch* b) { b->view.page_size = 2 * kPage; }, "view.page_size"},
      {"a row without a query", [](StepBatch* b) { b->view.queries.pop_back(); }, "view.queries"},
      {"two queries one row", [](StepBatch* b) { b->view.queries[1].row = b->view.queries[0].row; },
       "view.queries[1].row"},
      {"leaf outside the view",
       [](StepBatch* b) { b->view.queries[0].leaf = int32_t(b->view.nodes.size()); },
       "view.queries[0]"},
      {"leaf_tokens 0", [](StepBatch* b) { b->view.queries[1].leaf_tokens = 0; },
       "view.queries[1]"},
      {"node's parent after it", [](StepBatch* b) { b->view.nodes[0].parent = 1; }, "nodes[0]"},
      {"page outside the pool", [](StepBatch* b) { b->view.pages[0] = kPages + 3; }, "pages"},
  };
  StepBatchCheckScratch scratch;
  for (const Malformation& m : cases) {
    SCOPED_TRACE(m.name);
    StepBatch batch = probe_;
    add_harmful_copy_and_move(&batch);
    m.mutate(&batch);
    Logits out;
    const Status s = backend_->forward(batch, &out);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(m.field), std::string::npos) << s.message();
    // The pool is as it was: the probe reproduces its logits bit for bit.
    ASSERT_TRUE(backend_->forward(probe_, &out).ok());
    ASSERT_EQ(out.data, expected_.data) << "the rejected batch changed the KV pool";
  }
}

TEST_F(StepBatchTest, ValidBatchPasses) {
  StepBatchCheckScratch scratch;
  EXPECT_TRUE(
      validate_step_batch(probe_, backend_->kv_layout(), model_->config.vocab_size, &scratch).ok());
}

// StepBatch::sampling: the backend draws each logit row itself; the CPU backend's draws are
// the host sampler's on the very logits a full-logits step returns.
TEST_F(StepBatchTest, BackendSamplingDrawsWhatTheHostSamplerDraws) {
  StepBatch batch = probe_;
  batch.sampling.resize(2);
  batch.sampling[0].params.temperature = 0.0f;
  batch.sampling[0].params.logprobs = 3;
  batch.sampling[1].params.temperature = 0.9f;
  batch.sampling[1].params.top_k = 20;
  batch.sampling[1].params.top_p = 0.8f;
  batch.sampling[1].params.seed = 5;
  batch.sampling[1].stream_key = 7;
  batch.sampling[1].position = 11;
  Logits out;
  ASSERT_TRUE(backend_->forward(batch, &out).ok());
  ASSERT_EQ(out.sampled.size(), 2u);
  EXPECT_TRUE(out.data.empty());
  SamplingScratch scratch;
  for (int32_t i = 0; i < 2; ++i) {
    const StepSampling& s = batch.sampling[size_t(i)];
    const SampledToken want = sample_token(expected_.row(i), model_->config.vocab_size, s.params,
                                           s.stream_key, s.position, &scratch);
    EXPECT_EQ(out.sampled[size_t(i)].token, want.token) << "row " << i;
    EXPECT_EQ(out.sampled[size_t(i)].logprob, want.logprob) << "row " << i;
    EXPECT_EQ(out.sampled[size_t(i)].top, want.top) << "row " << i;
  }
  EXPECT_EQ(out.sampled[0].top.size(), 3u);
}

TEST_F(StepBatchTest, EmptyBatchWithOnlyCopiesRuns) {
  // A step may carry page copies and no rows (e.g. a fork right before a pause).
  StepBatch batch;
  batch.view.page_size = kPage;
  batch.page_copies.push_back({kPages - 1, kPages - 2, kPage});
  Logits out;
  const Status s = backend_->forward(batch, &out);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_EQ(out.num_rows, 0);
}

}  // namespace
}  // namespace treeserve::testing
