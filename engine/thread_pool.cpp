// Fork-join thread pool over a WorkerGroup of num_threads - 1 workers; the caller runs
// share 0.
#include "engine/thread_pool.h"

#include <algorithm>
#include <thread>

namespace treeserve {
namespace {

int resolve_threads(int num_threads) {
  return num_threads > 0 ? num_threads : int(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(resolve_threads(num_threads)), workers_(num_threads_ - 1) {}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (num_threads_ == 1 || n <= grain) {
    fn(0, n);
    return;
  }
  // Share `index` of num_threads_ even shares, rounded to whole grains.
  const int64_t grains = (n + grain - 1) / grain;
  auto share = [&](int64_t index) {
    const int64_t begin = std::min(n, grains * index / num_threads_ * grain);
    const int64_t end = std::min(n, grains * (index + 1) / num_threads_ * grain);
    if (begin < end) fn(begin, end);
  };
  workers_.run([&](int32_t worker) { share(worker + 1); }, [&] { share(0); });
}

}  // namespace treeserve
