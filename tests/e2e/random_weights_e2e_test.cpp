// End-to-end: a model directory with only config.json + tokenizer.model served with random
// weights (--random-weights), whose vocab_size (1024) is larger than its tokenizer's (the tiny
// model's 512, as with checkpoints whose embeddings are padded). Random weights give the
// padded ids about half the probability mass, so every mode of generation — greedy (the
// device-argmax path on CUDA), sampling, top-k/top-p, logprob alternatives, beam search —
// would produce ids the tokenizer cannot decode if the vocab limit were not applied.
// $TREESERVE_E2E_BACKEND picks the backend (default cpu), $TREESERVE_TINY_MODEL_DIR the tiny
// model's directory.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "proto/treeserve.grpc.pb.h"
#include "tests/common/temp_dir.h"
#include "tests/e2e/server_process.h"

#ifndef TREESERVE_TINY_MODEL_DIR
#error "TREESERVE_TINY_MODEL_DIR must name the tiny model's build directory"
#endif

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;
namespace fs = std::filesystem;

constexpr int32_t kTokenizerVocab = 512;  // the tiny tokenizer's
constexpr int32_t kModelVocab = 1024;

// The build's tiny model, or $TREESERVE_TINY_MODEL_DIR (a copy carried to a GPU machine).
std::string tiny_dir() {
  const char* env = std::getenv("TREESERVE_TINY_MODEL_DIR");
  return env != nullptr && *env != '\0' ? env : TREESERVE_TINY_MODEL_DIR;
}

std::string e2e_backend() {
  const char* b = std::getenv("TREESERVE_E2E_BACKEND");
  return b != nullptr && *b != '\0' ? b : "cpu";
}

// <tmp>/<name>: the tiny model's tokenizer.model and its config.json with vocab_size 1024,
// and no weights.
std::string make_shape_only_model(const std::string& name) {
  const fs::path dir = fs::path(treeserve::testing_support::test_temp_dir()) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path tiny = tiny_dir();
  fs::copy_file(tiny / "tokenizer.model", dir / "tokenizer.model");
  std::ifstream in(tiny / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["vocab_size"] = kModelVocab;
  std::ofstream(dir / "config.json") << config.dump(2);
  return dir.string();
}

class RandomWeightsServer : public ::testing::Test {
 protected:
  void SetUp() override {
    model_dir_ = make_shape_only_model("random-weights-model");
    server_ = std::make_unique<ServerProcess>(std::vector<std::string>{
        "--model", model_dir_, "--random-weights", "11", "--backend", e2e_backend()});
    ASSERT_TRUE(server_->wait_ready()) << server_->output();
    stub_ = v1::TreeServe::NewStub(server_->channel());
  }
  void TearDown() override {
    if (server_) {
      EXPECT_EQ(server_->terminate(), 0) << server_->output();
    }
  }

  v1::ServerInfo info() {
    grpc::ClientContext ctx;
    v1::ServerInfo out;
    EXPECT_TRUE(stub_->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &out).ok());
    return out;
  }

  // One-shot generation; every token is checked against the tokenizer's vocabulary, and each
  // branch's ids must detokenize to exactly the text streamed for them.
  void generate_and_check(const v1::GenerateRequest& req, int32_t* tokens_seen) {
    grpc::ClientContext ctx;
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateResponse r;
    std::map<std::string, std::vector<int32_t>> ids;
    std::map<std::string, std::string> text;
    while (reader->Read(&r)) {
      if (r.token_id() < 0) continue;
      EXPECT_LT(r.token_id(), kTokenizerVocab) << "sampled a padded id";
      EXPECT_LE(r.logprob(), 0.0f);
      for (const v1::TopLogprob& t : r.top_logprobs()) {
        EXPECT_LT(t.token_id(), kTokenizerVocab) << "a padded id among the alternatives";
      }
      ids[r.branch_id()].push_back(r.token_id());
      text[r.branch_id()] += r.text();
      ++*tokens_seen;
    }
    const grpc::Status s = reader->Finish();
    ASSERT_TRUE(s.ok()) << s.error_message() << "\n" << server_->output();
    for (const auto& [branch, branch_ids] : ids) {
      grpc::ClientContext dctx;
      v1::DetokenizeRequest dreq;
      for (int32_t id : branch_ids) dreq.add_ids(id);
      v1::DetokenizeResponse dresp;
      const grpc::Status ds = stub_->Detokenize(&dctx, dreq, &dresp);
      ASSERT_TRUE(ds.ok()) << ds.error_message();
      // Streamed text is the incremental decode of the same ids (a trailing incomplete
      // character may be held back).
      EXPECT_EQ(dresp.text().substr(0, text[branch].size()), text[branch]);
    }
  }

  std::string model_dir_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::TreeServe::Stub> stub_;
};

TEST_F(RandomWeightsServer, SaysSoAndNeverSamplesPastTheTokenizer) {
  const v1::ServerInfo before = info();
  EXPECT_EQ(before.model(), "random-weights-model (random weights)");
  EXPECT_NE(server_->output().find("RANDOM WEIGHTS"), std::string::npos) << server_->output();

  int32_t seen = 0;
  struct Mode {
    float temperature;
    int32_t top_k;
    float top_p;
    int32_t logprobs;
  };
  for (const Mode& m : {Mode{0.0f, 0, 1.0f, 0}, Mode{1.0f, 0, 1.0f, 0}, Mode{1.5f, 50, 0.95f, 0},
                        Mode{0.8f, 0, 0.9f, 5}, Mode{0.0f, 0, 1.0f, 5}}) {
    SCOPED_TRACE("temperature " + std::to_string(m.temperature) + " top_k " +
                 std::to_string(m.top_k) + " top_p " + std::to_string(m.top_p));
    v1::GenerateRequest req;
    req.mutable_prompt()->set_text("Once upon a time");
    req.set_n(4);
    v1::SamplingParams* p = req.mutable_sampling();
    p->set_temperature(m.temperature);
    p->set_top_k(m.top_k);
    p->set_top_p(m.top_p);
    p->set_logprobs(m.logprobs);
    p->set_seed(3);
    p->set_max_tokens(40);
    generate_and_check(req, &seen);
  }
  v1::GenerateRequest beam;
  beam.mutable_prompt()->set_text("A tree of thoughts");
  beam.mutable_beam_search()->set_beam_width(3);
  beam.mutable_sampling()->set_max_tokens(12);
  generate_and_check(beam, &seen);
  EXPECT_GT(seen, 600);

  // Nothing leaked: every page is free or evictable cache again.
  const v1::ServerInfo after = info();
  EXPECT_EQ(after.kv_pages_free() + after.kv_pages_evictable(), after.kv_pages_total());
  EXPECT_EQ(after.live_trees(), 0);
}

TEST(RandomWeightsCli, CheckpointWeightsAreIgnoredWithAWarning) {
  // The tiny model's own directory has model.safetensors: served random all the same.
  ServerProcess server(
      {"--model", tiny_dir(), "--random-weights", "2", "--backend", e2e_backend()});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  EXPECT_NE(server.output().find("ignoring the checkpoint's weights"), std::string::npos)
      << server.output();
  EXPECT_EQ(server.terminate(), 0);
}

TEST(RandomWeightsCli, WithoutTheFlagAShapeOnlyDirIsRefused) {
  const std::string dir = make_shape_only_model("shape-only-model");
  auto r = run_treeserve_to_exit({"--model", dir, "--backend", "cpu"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--random-weights"), std::string::npos) << r.output;
}

TEST(RandomWeightsCli, NegativeSeedIsRefused) {
  auto r = run_treeserve_to_exit({"--random-weights", "-3", "--backend", "cpu"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--random-weights"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace treeserve::testing
