// WorkerGroup (engine/worker_group.h).
#include "engine/worker_group.h"

namespace treeserve {

WorkerGroup::WorkerGroup(int32_t num_workers) {
  for (int32_t i = 0; i < num_workers; ++i) threads_.emplace_back([this, i] { loop(i); });
}

WorkerGroup::~WorkerGroup() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void WorkerGroup::run(const std::function<void(int32_t)>& fn,
                      const std::function<void()>& caller_share) {
  if (!threads_.empty()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      pending_ = size();
      ++generation_;
    }
    start_cv_.notify_all();
  }
  if (caller_share) caller_share();
  if (threads_.empty()) return;
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
}

void WorkerGroup::loop(int32_t index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int32_t)>* job = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    (*job)(index);
    std::lock_guard<std::mutex> lock(mutex_);
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

}  // namespace treeserve
