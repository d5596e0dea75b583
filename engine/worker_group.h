// WorkerGroup: persistent threads that run one job at a time. run(fn) calls fn(i) on worker
// thread i for every i in [0, size()) — worker i is always the same thread, so per-thread
// state (a CUDA device made current, a cache) stays with it — and returns when all have
// returned. Workers sleep on a condition variable between jobs (no spinning: the server
// shares the machine). The base of ThreadPool (CPU backend loops) and RankWorkers (one thread
// per tensor-parallel GPU).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace treeserve {

class WorkerGroup {
 public:
  explicit WorkerGroup(int32_t num_workers);
  ~WorkerGroup();
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  int32_t size() const { return int32_t(threads_.size()); }

  // Calls fn(i) on worker i for every worker, and caller_share() (when given) on the calling
  // thread meanwhile; returns when all of them have returned. fn must not throw. Not
  // reentrant.
  void run(const std::function<void(int32_t)>& fn,
           const std::function<void()>& caller_share = nullptr);

 private:
  void loop(int32_t index);

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable start_cv_, done_cv_;
  uint64_t generation_ = 0;  // bumped per run; each worker runs once per generation
  int32_t pending_ = 0;      // workers still running the current generation
  bool stop_ = false;
  const std::function<void(int32_t)>* job_ = nullptr;  // valid while pending_ > 0
};

}  // namespace treeserve
