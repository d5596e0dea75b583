// ThreadPool: a small fork-join pool for the CPU backend's data-parallel loops (GEMM
// columns, attention heads). parallel_for splits [0, n) into one contiguous range per
// thread, so which thread computes an element never changes its value: results do not
// depend on the thread count.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace treeserve {

class ThreadPool {
 public:
  // num_threads <= 0: std::thread::hardware_concurrency(). The calling thread is one of
  // them, so num_threads = 1 starts no thread at all.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Calls fn(begin, end) on disjoint ranges covering [0, n), each a multiple of `grain`
  // long (except the last), and returns when all are done. Not reentrant.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker_loop(int index);
  void run_share(int index);

  int num_threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;  // bumped per parallel_for; workers run once per generation
  int pending_ = 0;          // workers still running the current generation
  bool stop_ = false;
  // The current job (valid while pending_ > 0).
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int64_t job_grain_ = 1;
};

}  // namespace treeserve
