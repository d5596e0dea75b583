// End-to-end: the real treeserve binary over loopback gRPC (CPU backend, tiny model).
#include <gtest/gtest.h>
#include <httplib.h>

#include <fstream>

#include "proto/treeserve.grpc.pb.h"
#include "tests/common/temp_dir.h"
#include "tests/e2e/health.grpc.pb.h"
#include "tests/e2e/server_process.h"

namespace treeserve::testing {
namespace {

namespace v1 = ::treeserve::v1;

std::string write_temp(const std::string& name, const std::string& content) {
  std::string path = treeserve::testing_support::test_temp_dir() + "/" + name;
  std::ofstream(path) << content;
  return path;
}

TEST(CliErrors, MissingModelDirExitsNonZeroWithMessage) {
  auto r = run_treeserve_to_exit({"--model", "/nonexistent/model-dir", "--backend", "cpu"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("/nonexistent/model-dir"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;
}

TEST(CliErrors, BadJsonConfigExitsNonZeroWithMessage) {
  std::string path = write_temp("bad.json", "{ \"server\": { \"listen\": ");
  auto r = run_treeserve_to_exit({"--config", path});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("invalid JSON"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(path), std::string::npos) << r.output;
}

TEST(CliErrors, UnknownConfigKeyIsNamed) {
  std::string path = write_temp("typo.json", R"({"kv_cache": {"page_sise": 16}})");
  auto r = run_treeserve_to_exit({"--config", path});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("kv_cache.page_sise"), std::string::npos) << r.output;
}

TEST(CliErrors, TensorParallelNeedsTheCudaBackend) {
  std::string path = write_temp("tp.json", R"({"engine": {"tensor_parallel": 2}})");
  auto r = run_treeserve_to_exit({"--config", path, "--backend", "cpu"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("engine.tensor_parallel = 2 needs the cuda backend"), std::string::npos)
      << r.output;
  auto flag = run_treeserve_to_exit({"--tensor-parallel", "4", "--backend", "cpu"});
  EXPECT_NE(flag.exit_code, 0);
  EXPECT_NE(flag.output.find("engine.tensor_parallel = 4 needs the cuda backend"),
            std::string::npos)
      << flag.output;
}

TEST(CliErrors, MissingConfigFile) {
  auto r = run_treeserve_to_exit({"--config", "/nonexistent/treeserve.json"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("cannot be opened"), std::string::npos) << r.output;
}

TEST(CliErrors, BadListenAddressExitsNonZeroWithMessage) {
  for (const char* addr : {"localhost", "127.0.0.1:99999", ":50051", "127.0.0.1:port"}) {
    auto r = run_treeserve_to_exit({"--listen", addr, "--backend", "cpu"});
    EXPECT_NE(r.exit_code, 0) << addr;
    EXPECT_NE(r.output.find("not a valid listen address"), std::string::npos)
        << addr << ": " << r.output;
  }
}

TEST(CliErrors, UnusableListenAddressExitsNonZero) {
  // Well-formed, but not an address of this machine.
  auto r = run_treeserve_to_exit({"--listen", "203.0.113.7:50051", "--backend", "cpu"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("cannot listen on"), std::string::npos) << r.output;
}

TEST(CliErrors, BadBackendAndUnknownFlag) {
  auto r = run_treeserve_to_exit({"--backend", "tpu"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("backend must be cpu, cuda or auto"), std::string::npos) << r.output;
  auto r2 = run_treeserve_to_exit({"--no-such-flag"});
  EXPECT_EQ(r2.exit_code, 2) << r2.output;
}

TEST(CliErrors, PrintConfigShowsCliOverrides) {
  auto r =
      run_treeserve_to_exit({"--print-config", "--page-size", "32", "--listen", "127.0.0.1:6000"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("\"page_size\":32"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("127.0.0.1:6000"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"cuda_graphs\":true"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"gemm_autotune\":true"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"p2p_all_reduce\":true"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("\"gemm_split_k\":0"), std::string::npos) << r.output;
  auto g = run_treeserve_to_exit({"--print-config", "--no-cuda-graphs", "--no-gemm-autotune",
                                  "--no-p2p-all-reduce", "--gemm-split-k", "4"});
  EXPECT_EQ(g.exit_code, 0) << g.output;
  EXPECT_NE(g.output.find("\"cuda_graphs\":false"), std::string::npos) << g.output;
  EXPECT_NE(g.output.find("\"gemm_autotune\":false"), std::string::npos) << g.output;
  EXPECT_NE(g.output.find("\"p2p_all_reduce\":false"), std::string::npos) << g.output;
  EXPECT_NE(g.output.find("\"gemm_split_k\":4"), std::string::npos) << g.output;
  auto bad = run_treeserve_to_exit({"--print-config", "--gemm-split-k", "9"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("engine.gemm_split_k must be in [0, 8]"), std::string::npos)
      << bad.output;
  // A switch the command line does not name keeps the config file's value.
  const std::string path =
      write_temp("switches.json", R"({"engine": {"cuda_graphs": false, "gemm_autotune": false}})");
  auto f = run_treeserve_to_exit({"--print-config", "--config", path});
  EXPECT_NE(f.output.find("\"cuda_graphs\":false"), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("\"gemm_autotune\":false"), std::string::npos) << f.output;
  auto o = run_treeserve_to_exit({"--print-config", "--config", path, "--cuda-graphs"});
  EXPECT_NE(o.output.find("\"cuda_graphs\":true"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("\"gemm_autotune\":false"), std::string::npos) << o.output;
}

TEST(CliErrors, KvCacheDtypeFlagOverridesTheFileAndBadValuesAreNamed) {
  auto d = run_treeserve_to_exit({"--print-config"});
  EXPECT_EQ(d.exit_code, 0) << d.output;
  EXPECT_NE(d.output.find("\"dtype\":\"auto\""), std::string::npos) << d.output;
  auto f = run_treeserve_to_exit({"--print-config", "--kv-cache-dtype", "fp8"});
  EXPECT_EQ(f.exit_code, 0) << f.output;
  EXPECT_NE(f.output.find("\"dtype\":\"fp8\""), std::string::npos) << f.output;
  const std::string path = write_temp("kv_fp8.json", R"({"kv_cache": {"dtype": "fp8_e4m3"}})");
  auto file = run_treeserve_to_exit({"--print-config", "--config", path});
  EXPECT_NE(file.output.find("\"dtype\":\"fp8_e4m3\""), std::string::npos) << file.output;
  auto over =
      run_treeserve_to_exit({"--print-config", "--config", path, "--kv-cache-dtype", "auto"});
  EXPECT_EQ(over.exit_code, 0) << over.output;
  EXPECT_NE(over.output.find("\"dtype\":\"auto\""), std::string::npos) << over.output;
  auto e5m2 = run_treeserve_to_exit({"--print-config", "--kv-cache-dtype", "fp8_e5m2"});
  EXPECT_NE(e5m2.exit_code, 0);
  EXPECT_NE(e5m2.output.find("kv_cache.dtype (--kv-cache-dtype) 'fp8_e5m2' is not supported: "
                             "only e4m3 is"),
            std::string::npos)
      << e5m2.output;
  auto junk = run_treeserve_to_exit({"--print-config", "--kv-cache-dtype", "int4"});
  EXPECT_NE(junk.exit_code, 0);
  EXPECT_NE(junk.output.find("kv_cache.dtype (--kv-cache-dtype) must be auto, fp8 or fp8_e4m3, "
                             "got 'int4'"),
            std::string::npos)
      << junk.output;
}

class ServerE2E : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcess({"--backend", "cpu"});
    ASSERT_TRUE(server_->wait_ready()) << server_->output();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  std::unique_ptr<v1::TreeServe::Stub> stub() { return v1::TreeServe::NewStub(server_->channel()); }
  static ServerProcess* server_;
};
ServerProcess* ServerE2E::server_ = nullptr;

TEST_F(ServerE2E, HealthIsServing) {
  auto health = grpc::health::v1::Health::NewStub(server_->channel());
  grpc::ClientContext ctx;
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(ServerE2E, TokenizeDetokenizeRoundTrip) {
  const std::string text = "The old oak tree stood by the river, and 42 birds sang.";
  grpc::ClientContext c1;
  v1::TokenizeRequest treq;
  treq.set_text(text);
  v1::TokenizeResponse tresp;
  ASSERT_TRUE(stub()->Tokenize(&c1, treq, &tresp).ok());
  ASSERT_GT(tresp.ids_size(), 3);

  grpc::ClientContext c2;
  v1::DetokenizeRequest dreq;
  *dreq.mutable_ids() = tresp.ids();
  v1::DetokenizeResponse dresp;
  ASSERT_TRUE(stub()->Detokenize(&c2, dreq, &dresp).ok());
  EXPECT_EQ(dresp.text(), text);
}

TEST_F(ServerE2E, TokenizeRejectsEmptyTextAndDetokenizeBadIds) {
  grpc::ClientContext c1;
  v1::TokenizeResponse tresp;
  auto s = stub()->Tokenize(&c1, v1::TokenizeRequest(), &tresp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("text"), std::string::npos);

  grpc::ClientContext c2;
  v1::DetokenizeRequest dreq;
  dreq.add_ids(5);
  dreq.add_ids(1 << 30);
  v1::DetokenizeResponse dresp;
  s = stub()->Detokenize(&c2, dreq, &dresp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("ids[1]"), std::string::npos) << s.error_message();
}

TEST_F(ServerE2E, GetServerInfoDescribesModelAndPool) {
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(stub()->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_EQ(info.model(), "tiny-llama");
  EXPECT_EQ(info.page_size(), 16);
  EXPECT_EQ(info.tensor_parallel(), 1);
  EXPECT_GT(info.kv_pages_total(), 0);
  EXPECT_EQ(info.kv_pages_free(), info.kv_pages_total());
  EXPECT_EQ(info.kv_cache_dtype(), "float32");
}

// The CPU backend with an FP8 KV cache: the same pages (the pool stays float32), the dtype
// reported, and a generation runs.
TEST(ServerLifecycle, Fp8KvCacheOnTheCpuBackend) {
  ServerProcess server({"--backend", "cpu", "--kv-cache-dtype", "fp8"});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  auto stub = v1::TreeServe::NewStub(server.channel());
  grpc::ClientContext ctx;
  v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&ctx, {}, &info).ok());
  EXPECT_EQ(info.kv_cache_dtype(), "fp8_e4m3");
  EXPECT_EQ(info.kv_pages_total(), 4096) << "256 MiB of 4 KiB float32 tokens, 16 a page";
  grpc::ClientContext gen_ctx;
  v1::GenerateRequest req;
  req.mutable_prompt()->set_text("The old oak tree");
  req.mutable_sampling()->set_max_tokens(4);
  auto reader = stub->Generate(&gen_ctx, req);
  v1::GenerateResponse resp;
  int tokens = 0;
  while (reader->Read(&resp)) ++tokens;
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_GT(tokens, 0);
  EXPECT_NE(server.output().find("kv_dtype=fp8_e4m3 (emulated in the float32 pool)"),
            std::string::npos)
      << server.output();
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

TEST(ServerLifecycle, SigtermShutsDownCleanly) {
  ServerProcess server({"--backend", "cpu"});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  EXPECT_EQ(server.terminate(), 0) << server.output();
  EXPECT_NE(server.output().find("treeserve stopped"), std::string::npos) << server.output();
}

TEST(ServerLifecycle, AuthTokenIsEnforced) {
  std::string path = write_temp(
      "auth.json", R"({"server": {"auth_token": "s3cret"}, "engine": {"backend": "cpu"}})");
  ServerProcess server({"--config", path});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  auto stub = v1::TreeServe::NewStub(server.channel());
  v1::ServerInfo info;
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(stub->GetServerInfo(&ctx, {}, &info).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer wrong");
    EXPECT_EQ(stub->GetServerInfo(&ctx, {}, &info).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer s3cret");
    EXPECT_TRUE(stub->GetServerInfo(&ctx, {}, &info).ok());
  }
  EXPECT_EQ(server.terminate(), 0);
}

TEST(ServerLifecycle, OversizedRequestsAreInvalidArgument) {
  std::string path = write_temp("small.json", R"({"server": {"max_request_bytes": 1024}})");
  ServerProcess server({"--config", path, "--backend", "cpu"});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  auto stub = v1::TreeServe::NewStub(server.channel());
  grpc::ClientContext ctx;
  v1::TokenizeRequest req;
  req.set_text(std::string(3000, 'a'));
  v1::TokenizeResponse resp;
  grpc::Status s = stub->Tokenize(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("max_request_bytes"), std::string::npos) << s.error_message();
  grpc::ClientContext ok_ctx;
  req.set_text("small enough");
  EXPECT_TRUE(stub->Tokenize(&ok_ctx, req, &resp).ok());
  EXPECT_EQ(server.terminate(), 0);
}

TEST(ServerLifecycle, MetricsEndpointServesPrometheusText) {
  int port = pick_free_port();
  ServerProcess server(
      {"--backend", "cpu", "--metrics-listen", "127.0.0.1:" + std::to_string(port)});
  ASSERT_TRUE(server.wait_ready()) << server.output();
  httplib::Client http("127.0.0.1", port);
  auto res = http.Get("/metrics");
  ASSERT_TRUE(res) << server.output();
  EXPECT_EQ(res->status, 200);
  EXPECT_NE(res->body.find("# TYPE treeserve:live_branches gauge"), std::string::npos);
  EXPECT_NE(res->body.find("treeserve:time_to_first_token_seconds_bucket"), std::string::npos);
  EXPECT_EQ(server.terminate(), 0) << server.output();
}

}  // namespace
}  // namespace treeserve::testing
