// RankWorkers: one persistent thread per tensor-parallel rank. run(fn) calls fn(rank) on
// every rank's own thread at once and returns when all have finished — each rank's CUDA
// device stays current on its thread, and the ranks' NCCL calls are issued concurrently, one
// thread per communicator (the single-process layout NCCL documents for ncclCommInitAll).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "common/status.h"
#include "engine/worker_group.h"

namespace treeserve::detail {

class RankWorkers {
 public:
  explicit RankWorkers(int32_t num_ranks)
      : workers_(num_ranks), statuses_(size_t(num_ranks), Status::Ok()) {}

  int32_t num_ranks() const { return workers_.size(); }

  // Runs fn(rank) on every rank's thread; returns the first failure in rank order, else OK.
  // Not reentrant.
  Status run(const std::function<Status(int32_t)>& fn) {
    workers_.run([&](int32_t rank) { statuses_[size_t(rank)] = fn(rank); });
    for (const Status& s : statuses_) {
      if (!s.ok()) return s;
    }
    return Status::Ok();
  }

 private:
  WorkerGroup workers_;
  std::vector<Status> statuses_;  // each written by its rank's thread only
};

}  // namespace treeserve::detail
