// End-to-end FP8 on the CPU backend: the server on the generated FP8 checkpoints of the tiny
// model (tests/models/make_fp8_checkpoint.py) and on the float32 tiny model with --quantization
// fp8. The fp8-layout checkpoint per channel with dynamic activations and the flag give the
// same greedy tokens and logprobs (the same quantization rule); a static compressed-tensors
// checkpoint serves; --quantization none on an FP8 checkpoint and unknown values stop the
// server with a message naming the flag.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "proto/treeserve.grpc.pb.h"
#include "tests/e2e/server_process.h"

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;

const std::string kModels = TREESERVE_FP8_MODELS_DIR;

struct Greedy {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
};

Greedy greedy(ServerProcess* server, const std::string& text) {
  auto stub = v1::TreeServe::NewStub(server->channel());
  v1::GenerateRequest req;
  req.mutable_prompt()->set_text(text);
  req.mutable_sampling()->set_temperature(0.0f);
  req.mutable_sampling()->set_max_tokens(24);
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse r;
  Greedy out;
  while (reader->Read(&r)) {
    if (r.token_id() < 0) continue;
    out.ids.push_back(r.token_id());
    out.logprobs.push_back(r.logprob());
  }
  const grpc::Status s = reader->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message() << "\n" << server->output();
  return out;
}

TEST(Fp8Server, CheckpointAndQuantizationFlagServeTheSameTokens) {
  ServerProcess checkpoint({"--model", kModels + "/fp8-channel-dynamic", "--backend", "cpu"});
  ServerProcess flag(
      {"--model", TREESERVE_TINY_MODEL_DIR, "--quantization", "fp8", "--backend", "cpu"});
  ASSERT_TRUE(checkpoint.wait_ready()) << checkpoint.output();
  ASSERT_TRUE(flag.wait_ready()) << flag.output();
  EXPECT_NE(checkpoint.output().find("FP8 (e4m3) linear layers from config.json "
                                     "quantization_config (fp8)"),
            std::string::npos)
      << checkpoint.output();
  EXPECT_NE(flag.output().find("--quantization fp8: the linear layers are quantized"),
            std::string::npos)
      << flag.output();
  for (const char* text : {"Once upon a time", "The tree of thoughts"}) {
    const Greedy a = greedy(&checkpoint, text), b = greedy(&flag, text);
    EXPECT_EQ(a.ids.size(), 24u);
    EXPECT_EQ(a.ids, b.ids) << text;
    EXPECT_EQ(a.logprobs, b.logprobs) << text;
  }
  EXPECT_EQ(checkpoint.terminate(), 0) << checkpoint.output();
  EXPECT_EQ(flag.terminate(), 0) << flag.output();
}

TEST(Fp8Server, StaticCompressedTensorsCheckpointServes) {
  ServerProcess server({"--model", kModels + "/ct-tensor-tensor", "--backend", "cpu"});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  EXPECT_NE(server.output().find("activation scales static"), std::string::npos) << server.output();
  EXPECT_EQ(greedy(&server, "Once upon a time").ids.size(), 24u);
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

TEST(Fp8Server, RefusedQuantizationValues) {
  auto none = run_treeserve_to_exit(
      {"--model", kModels + "/ct-channel-token", "--quantization", "none", "--backend", "cpu"});
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.output.find("--quantization none: the checkpoint"), std::string::npos)
      << none.output;
  EXPECT_NE(none.output.find("is FP8"), std::string::npos) << none.output;
  auto unknown = run_treeserve_to_exit(
      {"--model", TREESERVE_TINY_MODEL_DIR, "--quantization", "int4", "--backend", "cpu"});
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_NE(unknown.output.find("--quantization"), std::string::npos) << unknown.output;
  EXPECT_NE(unknown.output.find("'int4'"), std::string::npos) << unknown.output;
}

}  // namespace
}  // namespace treeserve::testing
