// ThreadPool: a small fork-join pool for the CPU backend's data-parallel loops (GEMM
// columns, attention heads). parallel_for splits [0, n) into one contiguous range per
// thread, so which thread computes an element never changes its value: results do not
// depend on the thread count.
#pragma once

#include <cstdint>
#include <functional>

#include "engine/worker_group.h"

namespace treeserve {

class ThreadPool {
 public:
  // num_threads <= 0: std::thread::hardware_concurrency(). The calling thread is one of
  // them, so num_threads = 1 starts no thread at all.
  explicit ThreadPool(int num_threads);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Calls fn(begin, end) on disjoint ranges covering [0, n), each a multiple of `grain`
  // long (except the last), and returns when all are done. Not reentrant.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  int num_threads_ = 1;
  WorkerGroup workers_;  // num_threads_ - 1 threads; the caller is the first
};

}  // namespace treeserve
