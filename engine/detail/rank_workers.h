// RankWorkers: one persistent thread per tensor-parallel rank. run(fn) calls fn(rank) on
// every rank's own thread at once and returns when all have finished — each rank's CUDA
// device stays current on its thread, and the ranks' NCCL calls are issued concurrently, one
// thread per communicator (the single-process layout NCCL documents for ncclCommInitAll).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "common/status.h"

namespace treeserve::detail {

class RankWorkers {
 public:
  explicit RankWorkers(int32_t num_ranks);
  ~RankWorkers();
  RankWorkers(const RankWorkers&) = delete;
  RankWorkers& operator=(const RankWorkers&) = delete;

  int32_t num_ranks() const { return int32_t(statuses_.size()); }

  // Runs fn(rank) on every rank's thread; returns the first failure in rank order, else OK.
  // Not reentrant.
  Status run(const std::function<Status(int32_t)>& fn);

 private:
  void loop(int32_t rank);

  std::vector<std::thread> threads_;
  std::vector<Status> statuses_;
  std::mutex mutex_;
  std::condition_variable start_cv_, done_cv_;
  uint64_t generation_ = 0;
  int32_t pending_ = 0;
  bool stop_ = false;
  const std::function<Status(int32_t)>* job_ = nullptr;
};

}  // namespace treeserve::detail
