// Helpers shared by the attention benchmarks (bench_tree_attention, bench_sequence_parallel):
// fail-fast checks, the median, and the device-to-device copy bandwidth every figure is
// compared with. Header only; needs cuda_runtime.h.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/status.h"

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

// Device-to-device copy bandwidth of the current device, bytes read + written per second (as
// the issues quote it): median of `reps` 1 GiB copies after two warm-ups.
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

}  // namespace treeserve::bench
