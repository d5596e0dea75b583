// Fork-join thread pool: workers sleep on a condition variable between jobs (the server
// shares the machine with other work, so no spinning), and the caller runs share 0.
#include "engine/thread_pool.h"

#include <algorithm>

namespace treeserve {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  num_threads_ = num_threads;
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::run_share(int index) {
  // Share `index` of num_threads_ even shares, rounded to whole grains.
  const int64_t grains = (job_n_ + job_grain_ - 1) / job_grain_;
  const int64_t begin = std::min(job_n_, grains * index / num_threads_ * job_grain_);
  const int64_t end = std::min(job_n_, grains * (index + 1) / num_threads_ * job_grain_);
  if (begin < end) (*job_)(begin, end);
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    run_share(index);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (num_threads_ == 1 || n <= grain) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_n_ = n;
    job_grain_ = grain;
    pending_ = num_threads_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  run_share(0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
}

}  // namespace treeserve
