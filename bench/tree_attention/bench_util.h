// Helpers shared by the attention benchmarks (bench_tree_attention, bench_sequence_parallel,
// bench_page_read): fail-fast checks, the median, the device-to-device copy bandwidth every
// figure is compared with, and the event timer. Header only; needs cuda_runtime.h.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/status.h"
#include "kernels/testing/gpu_attention_harness.h"

#define CHECK_CUDA(expr)                                                                         \
  do {                                                                                           \
    const cudaError_t _e = (expr);                                                               \
    if (_e != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(_e)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

#define CHECK_OK(expr)                                                                          \
  do {                                                                                          \
    const ::treeserve::Status _s = (expr);                                                      \
    if (!_s.ok()) {                                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, _s.ToString().c_str()); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

namespace treeserve::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Device-to-device copy bandwidth of the current device, bytes read + written per second:
// median of `reps` 1 GiB copies after two warm-ups.
inline double copy_bandwidth(int reps = 10) {
  const size_t bytes = size_t(1) << 30;
  void *a, *b;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> times;
  for (int i = 0; i < reps + 2; ++i) {
    CHECK_CUDA(cudaEventRecord(start));
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 2) times.push_back(ms * 1e-3);
  }
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return 2.0 * double(bytes) / median(times);
}

// Event time of launches as the attention benchmarks report it: cudaEvent records around
// launch() on `stream`, each repetition behind a read of a 256 MB buffer where `flush` (L2
// evicted without dirty lines); median of reps after 3 warm-ups.
class Timer {
 public:
  // The flush, the events and the launches all go to `stream` (null: the legacy stream).
  Timer(bool flush, cudaStream_t stream) : flush_(flush), stream_(stream) {
    CHECK_CUDA(cudaEventCreate(&start_));
    CHECK_CUDA(cudaEventCreate(&stop_));
    if (flush_) {
      CHECK_CUDA(cudaMalloc(&scratch_, kFlushBytes + 16));
      CHECK_CUDA(cudaMemset(scratch_, 1, kFlushBytes + 16));
    }
  }
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;
  ~Timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    if (scratch_ != nullptr) cudaFree(scratch_);
  }
  cudaStream_t stream() const { return stream_; }
  // Median microseconds of launch() over reps (after 3 warm-ups).
  template <typename F>
  double median_us(int reps, F launch) {
    std::vector<double> us;
    for (int i = 0; i < reps + 3; ++i) {
      // Flushing L2 (50 MB on an H100) makes every repetition read KV from HBM, as a decode
      // step does after the rest of the layer; it also queues the launches behind the flush.
      if (flush_) {
        ::treeserve::testing::flush_l2_by_reading(
            scratch_, kFlushBytes, static_cast<char*>(scratch_) + kFlushBytes, stream_);
      }
      CHECK_CUDA(cudaEventRecord(start_, stream_));
      launch();
      CHECK_CUDA(cudaEventRecord(stop_, stream_));
      CHECK_CUDA(cudaEventSynchronize(stop_));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
      if (i >= 3) us.push_back(ms * 1e3);
    }
    return median(us);
  }

 private:
  static constexpr size_t kFlushBytes = size_t(256) << 20;
  bool flush_;
  cudaStream_t stream_;
  cudaEvent_t start_, stop_;
  void* scratch_ = nullptr;
};

}  // namespace treeserve::bench
