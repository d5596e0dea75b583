// End-to-end: checkpoints generated from the tiny model, served by the real binary.
//  - Tied embeddings (tie_word_embeddings, as Llama 3.2 1B/3B ship them): a checkpoint with
//    no lm_head.weight generates exactly what the same weights untied (lm_head.weight a copy
//    of the embedding) generate; untied without lm_head.weight is refused naming it.
//  - Mistral's sliding_window: treeserve attends over whole sequences, so sequences are capped
//    at the window (logged at load); a longer prompt or append is refused naming the window,
//    and generation stops at it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/safetensors.h"
#include "proto/treeserve.grpc.pb.h"
#include "tests/common/temp_dir.h"
#include "tests/e2e/server_process.h"
#include "tests/models/test_util.h"

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;
namespace fs = std::filesystem;

nlohmann::json tiny_config() {
  std::ifstream in(fs::path(TREESERVE_TINY_MODEL_DIR) / "config.json");
  return nlohmann::json::parse(in);
}

// <tmp>/<name>: the tiny model's tokenizer, `config`, and its tensors with lm_head.weight
// replaced by a copy of the embedding (`lm_head` "copy"), or left out ("none").
std::string write_model(const std::string& name, const nlohmann::json& config,
                        const std::string& lm_head) {
  const fs::path dir = fs::path(treeserve::testing_support::test_temp_dir()) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(fs::path(TREESERVE_TINY_MODEL_DIR) / "tokenizer.model", dir / "tokenizer.model");
  std::ofstream(dir / "config.json") << config.dump(2);
  auto reader = SafetensorsReader::open_dir(TREESERVE_TINY_MODEL_DIR);
  EXPECT_TRUE(reader.ok()) << reader.status().ToString();
  std::vector<TestTensor> tensors;
  for (const std::string& tensor : reader->tensor_names()) {
    std::string source = tensor;
    if (tensor == "lm_head.weight") {
      if (lm_head == "none") continue;
      source = "model.embed_tokens.weight";
    }
    auto view = reader->tensor(source);
    EXPECT_TRUE(view.ok());
    tensors.push_back({tensor, dtype_name(view->dtype), view->shape,
                       std::string(static_cast<const char*>(view->data), view->nbytes)});
  }
  write_file((dir / "model.safetensors").string(), safetensors_bytes(tensors));
  return dir.string();
}

std::vector<int32_t> greedy(ServerProcess* server, const std::string& text) {
  auto stub = v1::TreeServe::NewStub(server->channel());
  grpc::ClientContext ctx;
  v1::GenerateRequest req;
  req.mutable_prompt()->set_text(text);
  req.mutable_sampling()->set_max_tokens(24);
  auto reader = stub->Generate(&ctx, req);
  std::vector<int32_t> tokens;
  v1::GenerateResponse r;
  while (reader->Read(&r)) {
    if (r.token_id() >= 0) tokens.push_back(r.token_id());
  }
  const grpc::Status s = reader->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  return tokens;
}

TEST(TiedEmbeddings, CheckpointWithoutLmHeadUsesTheEmbedding) {
  nlohmann::json untied = tiny_config();
  untied["tie_word_embeddings"] = false;
  nlohmann::json tied = tiny_config();
  tied["tie_word_embeddings"] = true;
  const std::string untied_dir = write_model("untied-model", untied, "copy");
  const std::string tied_dir = write_model("tied-model", tied, "none");

  std::vector<std::vector<int32_t>> runs;
  for (const std::string& dir : {untied_dir, tied_dir}) {
    ServerProcess server({"--model", dir, "--backend", "cpu"});
    ASSERT_TRUE(server.wait_ready()) << server.output();
    runs.push_back(greedy(&server, "Once upon a time there was"));
    runs.push_back(greedy(&server, "The tree"));
    EXPECT_EQ(server.terminate(), 0);
  }
  ASSERT_EQ(runs[0].size(), 24u);
  EXPECT_EQ(runs[0], runs[2]);
  EXPECT_EQ(runs[1], runs[3]);

  const std::string missing = write_model("untied-no-head", untied, "none");
  RunResult r = run_treeserve_to_exit({"--model", missing, "--backend", "cpu"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("lm_head.weight"), std::string::npos) << r.output;
}

class SlidingWindow : public ::testing::Test {
 protected:
  static constexpr int32_t kWindow = 40;

  void SetUp() override {
    nlohmann::json config = tiny_config();
    config["architectures"] = {"MistralForCausalLM"};
    config["model_type"] = "mistral";
    config["sliding_window"] = kWindow;  // max_position_embeddings stays 2048
    dir_ = write_model("sliding-window-model", config, "copy");
    server_ = std::make_unique<ServerProcess>(
        std::vector<std::string>{"--model", dir_, "--backend", "cpu"});
    ASSERT_TRUE(server_->wait_ready()) << server_->output();
    stub_ = v1::TreeServe::NewStub(server_->channel());
  }
  void TearDown() override {
    if (server_) EXPECT_EQ(server_->terminate(), 0) << server_->output();
  }

  grpc::Status create(int32_t tokens, v1::CreateTreeResponse* out) {
    grpc::ClientContext ctx;
    v1::CreateTreeRequest req;
    for (int32_t i = 0; i < tokens; ++i) req.mutable_prompt()->mutable_tokens()->add_ids(40 + i);
    return stub_->CreateTree(&ctx, req, out);
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::TreeServe::Stub> stub_;
};

TEST_F(SlidingWindow, SequencesAreCappedAtTheWindow) {
  EXPECT_NE(server_->output().find("sequences are capped at 40 tokens"), std::string::npos)
      << server_->output();
  v1::CreateTreeResponse tree;
  grpc::Status s = create(kWindow, &tree);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("context of 40 tokens"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("sliding_window"), std::string::npos) << s.error_message();

  s = create(30, &tree);
  ASSERT_TRUE(s.ok()) << s.error_message();
  // An append past the window is refused; generation stops at it.
  {
    grpc::ClientContext ctx;
    v1::GenerateRequest req;
    req.set_tree_id(tree.tree_id());
    req.add_branch_ids(tree.root_branch_id());
    for (int32_t i = 0; i < 15; ++i) req.mutable_append()->mutable_tokens()->add_ids(50);
    auto reader = stub_->Generate(&ctx, req);
    v1::GenerateResponse r;
    while (reader->Read(&r)) {
    }
    const grpc::Status gs = reader->Finish();
    EXPECT_EQ(gs.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << gs.error_message();
  }
  grpc::ClientContext ctx;
  v1::GenerateRequest req;
  req.set_tree_id(tree.tree_id());
  req.add_branch_ids(tree.root_branch_id());
  req.mutable_sampling()->set_max_tokens(50);
  auto reader = stub_->Generate(&ctx, req);
  v1::GenerateResponse r;
  int32_t generated = 0;
  v1::FinishReason finish = v1::FINISH_NONE;
  while (reader->Read(&r)) {
    if (r.token_id() >= 0) ++generated;
    if (r.finish_reason() != v1::FINISH_NONE) finish = r.finish_reason();
  }
  ASSERT_TRUE(reader->Finish().ok());
  if (finish != v1::FINISH_EOS) {
    EXPECT_EQ(finish, v1::FINISH_LENGTH);
    EXPECT_EQ(30 + generated, kWindow);
  }
  EXPECT_LE(30 + generated, kWindow);
}

}  // namespace
}  // namespace treeserve::testing
