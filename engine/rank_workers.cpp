// RankWorkers (engine/detail/rank_workers.h).
#include "engine/detail/rank_workers.h"

namespace treeserve::detail {

RankWorkers::RankWorkers(int32_t num_ranks) : statuses_(size_t(num_ranks), Status::Ok()) {
  for (int32_t r = 0; r < num_ranks; ++r) threads_.emplace_back([this, r] { loop(r); });
}

RankWorkers::~RankWorkers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

Status RankWorkers::run(const std::function<Status(int32_t)>& fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    pending_ = num_ranks();
    ++generation_;
  }
  start_cv_.notify_all();
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  job_ = nullptr;
  for (const Status& s : statuses_) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

void RankWorkers::loop(int32_t rank) {
  uint64_t seen = 0;
  while (true) {
    const std::function<Status(int32_t)>* job = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    Status s = (*job)(rank);
    std::lock_guard<std::mutex> lock(mutex_);
    statuses_[size_t(rank)] = std::move(s);
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

}  // namespace treeserve::detail
