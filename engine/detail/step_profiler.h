// Where a CUDA step's time goes, without a profiler: with TREESERVE_PROFILE=1 the backend
// records a CUDA event after each phase of the step on its stream, and host clocks around
// plan building, enqueueing and the final wait. Phases of the same name add up over layers
// and steps of the same row count; one table per row count is printed to stderr when the
// backend is destroyed. Off (no events, no cost) otherwise.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace treeserve::detail {

class StepProfiler {
 public:
  StepProfiler() {
    const char* env = std::getenv("TREESERVE_PROFILE");
    on_ = env && std::string(env) == "1";
  }
  ~StepProfiler() {
    if (on_ && steps_ > 0) print();
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  }
  bool on() const { return on_; }

  // Start of a step on `stream` (host clock starts too).
  void begin(cudaStream_t stream, int64_t rows) {
    if (!on_) return;
    rows_ = rows;
    used_ = 0;
    names_.clear();
    host_start_ = Clock::now();
    record("", stream);
  }
  // Host-side phase boundary (no event).
  void host(const char* name) {
    if (!on_) return;
    const auto now = Clock::now();
    by_rows_[rows_].host_ms[name] +=
        std::chrono::duration<double, std::milli>(now - host_mark()).count();
    host_last_ = now;
  }
  // The GPU work enqueued since the previous mark belongs to `name`.
  void mark(const char* name, cudaStream_t stream) {
    if (on_) record(name, stream);
  }
  // After the step's stream synchronize: adds up the GPU phases.
  void end() {
    if (!on_) return;
    cudaEventSynchronize(pool_[used_ - 1]);
    for (size_t i = 1; i < names_.size(); ++i) {
      float ms = 0;
      cudaEventElapsedTime(&ms, pool_[i - 1], pool_[i]);
      by_rows_[rows_].gpu_ms[names_[i]] += ms;
    }
    by_rows_[rows_].host_ms["wall"] +=
        std::chrono::duration<double, std::milli>(Clock::now() - host_start_).count();
    ++by_rows_[rows_].steps;
    ++steps_;
  }

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point host_mark() const {
    return host_last_ > host_start_ ? host_last_ : host_start_;
  }
  void record(const char* name, cudaStream_t stream) {
    if (used_ == pool_.size()) {
      cudaEvent_t e;
      cudaEventCreate(&e);
      pool_.push_back(e);
    }
    cudaEventRecord(pool_[used_++], stream);
    names_.push_back(name);
  }
  void print() const {
    for (const auto& [rows, t] : by_rows_) {
      std::fprintf(stderr, "\nTREESERVE_PROFILE: %lld steps of %lld rows, mean per step (ms)\n",
                   (long long)t.steps, (long long)rows);
      double gpu_total = 0;
      for (auto& [n, ms] : t.gpu_ms) gpu_total += ms;
      for (auto& [n, ms] : t.gpu_ms) {
        std::fprintf(stderr, "  gpu  %-14s %9.3f  %5.1f%%\n", n.c_str(), ms / t.steps,
                     100.0 * ms / gpu_total);
      }
      std::fprintf(stderr, "  gpu  %-14s %9.3f\n", "total", gpu_total / t.steps);
      for (auto& [n, ms] : t.host_ms) {
        std::fprintf(stderr, "  host %-14s %9.3f\n", n.c_str(), ms / t.steps);
      }
    }
  }

  struct Totals {
    int64_t steps = 0;
    std::map<std::string, double> gpu_ms, host_ms;
  };
  bool on_ = false;
  int64_t steps_ = 0;
  std::vector<cudaEvent_t> pool_;
  size_t used_ = 0;
  std::vector<std::string> names_;
  int64_t rows_ = 0;
  std::map<int64_t, Totals> by_rows_;
  Clock::time_point host_start_, host_last_;
};

}  // namespace treeserve::detail
