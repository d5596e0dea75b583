// Runs the real treeserve binary as a child process for end-to-end tests: a free loopback
// port, captured output, health-wait, SIGTERM and exit-code checks.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace treeserve::testing {

// {"--backend", B} with B from $TREESERVE_E2E_BACKEND (default "cpu"), plus
// {"--model", M} when $TREESERVE_E2E_MODEL is set, {"--tensor-parallel", N} when
// $TREESERVE_E2E_TENSOR_PARALLEL is, and --cuda-graphs when $TREESERVE_E2E_CUDA_GRAPHS=1
// (--no-cuda-graphs for another value): the same e2e tests then run against the CUDA backend
// on a GPU machine, on one GPU or N, with or without CUDA graphs.
std::vector<std::string> backend_args();

// A loopback port that was free a moment ago (bind to port 0, read it back, close).
int pick_free_port();

// Output (stdout+stderr) and exit code of a treeserve run that is expected to end by itself.
struct RunResult {
  int exit_code = -1;
  std::string output;
};
RunResult run_treeserve_to_exit(const std::vector<std::string>& args, int timeout_s = 60);

class ServerProcess {
 public:
  // Starts treeserve with `args` plus --listen 127.0.0.1:<free port>. channel() and wait_ready
  // use `credentials` (null: plaintext), e.g. grpc::SslCredentials for a server with TLS.
  explicit ServerProcess(std::vector<std::string> args,
                         std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);
  ~ServerProcess();

  // Waits until the health service answers SERVING; false on timeout or early exit.
  bool wait_ready(int timeout_s = 60);
  // Sends SIGTERM and waits; returns the exit code (-1 on timeout, then SIGKILL).
  int terminate(int timeout_s = 30);
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  std::string address() const { return address_; }
  std::string output() const;  // what the server printed so far
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  std::string address_;
  std::string log_path_;
  std::shared_ptr<grpc::Channel> channel_;
};

// A suite sharing one server (started once with backend_args()): a fresh ClientT per test
// and, after each, ClientT::expect_idle() (the pool back to its idle state).
template <typename ClientT>
class SharedServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new ServerProcess(backend_args());
    ASSERT_TRUE(server_->wait_ready()) << server_->output();
  }
  static void TearDownTestSuite() {
    EXPECT_EQ(server_->terminate(), 0) << server_->output();
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { client_ = std::make_unique<ClientT>(server_->channel()); }
  void TearDown() override { client_->expect_idle(); }

  static inline ServerProcess* server_ = nullptr;
  std::unique_ptr<ClientT> client_;
};

}  // namespace treeserve::testing
