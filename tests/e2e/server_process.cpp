// Child-process management for end-to-end tests.
#include "tests/e2e/server_process.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>
#include <utility>

#include "tests/e2e/health.grpc.pb.h"

#ifndef TREESERVE_BINARY
#error "TREESERVE_BINARY must name the treeserve executable"
#endif

namespace treeserve::testing {

std::vector<std::string> backend_args() {
  const char* backend = std::getenv("TREESERVE_E2E_BACKEND");
  std::vector<std::string> args = {"--backend", backend ? backend : "cpu"};
  if (const char* model = std::getenv("TREESERVE_E2E_MODEL")) {
    args.push_back("--model");
    args.push_back(model);
  }
  if (const char* tp = std::getenv("TREESERVE_E2E_TENSOR_PARALLEL")) {
    args.push_back("--tensor-parallel");
    args.push_back(tp);
  }
  if (const char* graphs = std::getenv("TREESERVE_E2E_CUDA_GRAPHS")) {
    args.push_back(std::string(graphs) == "1" ? "--cuda-graphs" : "--no-cuda-graphs");
  }
  return args;
}

int pick_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

namespace {

std::string temp_log_path() {
  char tmpl[] = "/tmp/treeserve-e2e-XXXXXX";
  int fd = mkstemp(tmpl);
  close(fd);
  return tmpl;
}

pid_t spawn(const std::vector<std::string>& args, const std::string& log_path) {
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log_path.c_str(), O_WRONLY | O_TRUNC);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> argv;
    // $TREESERVE_E2E_BINARY: a copy of the binary carried to another machine (GPU runs).
    const char* env_bin = std::getenv("TREESERVE_E2E_BINARY");
    std::string bin = env_bin ? env_bin : TREESERVE_BINARY;
    argv.push_back(bin.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(bin.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

// waitpid with a timeout; returns the exit code, 128+signal, or -1 on timeout.
int wait_exit(pid_t pid, int timeout_s) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// args plus --model TREESERVE_E2E_MODEL where that is set and args name no model: a model
// carried elsewhere (e.g. to a GPU machine) stands in for the build's default one.
std::vector<std::string> with_carried_model(std::vector<std::string> args) {
  const char* model = std::getenv("TREESERVE_E2E_MODEL");
  if (model != nullptr && std::find(args.begin(), args.end(), "--model") == args.end()) {
    args.push_back("--model");
    args.push_back(model);
  }
  return args;
}

}  // namespace

RunResult run_treeserve_to_exit(const std::vector<std::string>& args, int timeout_s) {
  // As ServerProcess: with a carried model, the checks past model loading (tensor parallel on
  // the cpu backend, binding the listen address) are the ones that fail, not a missing
  // build/tiny-llama.
  std::string log = temp_log_path();
  pid_t pid = spawn(with_carried_model(args), log);
  RunResult r;
  r.exit_code = wait_exit(pid, timeout_s);
  if (r.exit_code == -1) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
  r.output = read_file(log);
  unlink(log.c_str());
  return r;
}

ServerProcess::ServerProcess(std::vector<std::string> args,
                             std::shared_ptr<grpc::ChannelCredentials> credentials) {
  args = with_carried_model(std::move(args));
  address_ = "127.0.0.1:" + std::to_string(pick_free_port());
  args.push_back("--listen");
  args.push_back(address_);
  log_path_ = temp_log_path();
  pid_ = spawn(args, log_path_);
  channel_ = grpc::CreateChannel(
      address_, credentials != nullptr ? credentials : grpc::InsecureChannelCredentials());
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  unlink(log_path_.c_str());
}

bool ServerProcess::wait_ready(int timeout_s) {
  auto stub = grpc::health::v1::Health::NewStub(channel_);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return false;
    }
    // Ask only once the server says it listens: an early failed connect would put the
    // channel into gRPC's reconnect backoff (seconds).
    if (output().find(" ready: ") == std::string::npos) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    if (stub->Check(&ctx, req, &resp).ok() &&
        resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

int ServerProcess::terminate(int timeout_s) {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  int code = wait_exit(pid_, timeout_s);
  if (code == -1) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  pid_ = -1;
  return code;
}

std::string ServerProcess::output() const { return read_file(log_path_); }

}  // namespace treeserve::testing
