// WorkerGroup and its two users: ThreadPool's disjoint, thread-count-independent ranges and
// RankWorkers' per-rank threads and first-failure status.
#include "engine/worker_group.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/detail/rank_workers.h"
#include "engine/thread_pool.h"

namespace treeserve {
namespace {

TEST(WorkerGroup, EachIndexRunsOnceOnItsOwnThreadEveryRun) {
  WorkerGroup group(4);
  ASSERT_EQ(group.size(), 4);
  std::mutex mutex;
  std::map<int32_t, std::thread::id> first_owner;
  for (int round = 0; round < 50; ++round) {
    std::vector<std::atomic<int>> calls(4);
    std::thread::id caller_thread;
    group.run(
        [&](int32_t i) {
          calls[size_t(i)]++;
          std::lock_guard<std::mutex> lock(mutex);
          const auto it = first_owner.emplace(i, std::this_thread::get_id()).first;
          EXPECT_EQ(it->second, std::this_thread::get_id()) << "worker " << i << " moved thread";
        },
        [&] { caller_thread = std::this_thread::get_id(); });
    for (int i = 0; i < 4; ++i) EXPECT_EQ(calls[size_t(i)].load(), 1) << "round " << round;
    EXPECT_EQ(caller_thread, std::this_thread::get_id());
  }
  std::vector<std::thread::id> owners;
  for (const auto& [i, id] : first_owner) owners.push_back(id);
  for (size_t a = 0; a < owners.size(); ++a) {
    EXPECT_NE(owners[a], std::this_thread::get_id());
    for (size_t b = a + 1; b < owners.size(); ++b) EXPECT_NE(owners[a], owners[b]);
  }
}

TEST(WorkerGroup, RunsTheCallerShareConcurrentlyAndWorksWithNoWorkers) {
  WorkerGroup group(2);
  // The workers wait for the caller's share to start: only possible if they run meanwhile.
  std::atomic<bool> caller_started{false};
  std::atomic<int> done{0};
  group.run(
      [&](int32_t) {
        while (!caller_started.load()) std::this_thread::yield();
        done++;
      },
      [&] { caller_started = true; });
  EXPECT_EQ(done.load(), 2);
  WorkerGroup none(0);
  int caller_runs = 0;
  none.run([&](int32_t) { ADD_FAILURE() << "no worker should run"; }, [&] { ++caller_runs; });
  none.run([&](int32_t) { ADD_FAILURE() << "no worker should run"; });
  EXPECT_EQ(caller_runs, 1);
}

TEST(ThreadPool, RangesAreDisjointGrainAlignedAndCoverEverything) {
  for (int threads : {1, 2, 3, 7}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {int64_t(1), int64_t(5), int64_t(64), int64_t(1000), int64_t(1001)}) {
      for (int64_t grain : {int64_t(1), int64_t(4), int64_t(16)}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        std::mutex mutex;
        std::vector<std::pair<int64_t, int64_t>> ranges;
        pool.parallel_for(n, grain, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) hits[size_t(i)]++;
          std::lock_guard<std::mutex> lock(mutex);
          ranges.push_back({begin, end});
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << i;
        for (const auto& [begin, end] : ranges) {
          EXPECT_EQ(begin % grain, 0);
          if (end != n) {
            EXPECT_EQ(end % grain, 0);
          }
        }
        EXPECT_LE(int(ranges.size()), threads);
      }
    }
  }
}

TEST(RankWorkers, EveryRankRunsAndTheFirstFailureInRankOrderIsReturned) {
  detail::RankWorkers workers(4);
  EXPECT_EQ(workers.num_ranks(), 4);
  std::vector<std::atomic<int>> ran(4);
  Status s = workers.run([&](int32_t rank) {
    ran[size_t(rank)]++;
    if (rank == 3) return Internal("rank 3 failed");
    if (rank == 1) return Unavailable("rank 1 failed");
    return Status::Ok();
  });
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(ran[size_t(r)].load(), 1);
  // A later run starts from clean statuses.
  EXPECT_TRUE(workers.run([](int32_t) { return Status::Ok(); }).ok());
}

}  // namespace
}  // namespace treeserve
