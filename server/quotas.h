// The tenant quotas the server counts itself: streams in flight (Generate and TreeSearch calls)
// and requests per second (a token bucket with a burst). The scheduler counts the others (live
// trees, live branches, KV pages; scheduler.h, "Tenants"). Refusals, whoever makes them, are
// counted in treeserve:quota_refusals_total.
//
// Thread-safe and cheap: the tenant table is built once and only read; a stream slot is one
// atomic compare-and-swap, a request one short lock of the tenant's own bucket. Tenants the
// table does not list have no limits here.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "server/keys_file.h"

namespace treeserve {

class TenantGate {
 public:
  using Clock = std::chrono::steady_clock;

  // `registry` (may be null) gets treeserve:quota_refusals_total.
  TenantGate(const std::vector<TenantConfig>& tenants, MetricsRegistry* registry);

  // One request of `tenant` at `now`: RESOURCE_EXHAUSTED naming the tenant, its rate and the
  // quota when its bucket is empty (a refused request takes nothing from it).
  Status admit_request(const std::string& tenant, Clock::time_point now = Clock::now());

  // A stream slot, held until the StreamSlot goes.
  class StreamSlot {
   public:
    StreamSlot() = default;
    StreamSlot(StreamSlot&& other) noexcept : in_flight_(other.in_flight_) {
      other.in_flight_ = nullptr;
    }
    StreamSlot& operator=(StreamSlot&& other) noexcept;
    ~StreamSlot() { release(); }

   private:
    friend class TenantGate;
    explicit StreamSlot(std::atomic<int32_t>* in_flight) : in_flight_(in_flight) {}
    void release();
    std::atomic<int32_t>* in_flight_ = nullptr;
  };
  // RESOURCE_EXHAUSTED naming the tenant, its streams and the quota when it has
  // max_concurrent_streams in flight.
  StatusOr<StreamSlot> open_stream(const std::string& tenant);
  int32_t streams_in_flight(const std::string& tenant) const;

  // Counts a refusal made elsewhere (the scheduler's) when it is a tenant quota's; returns it.
  const Status& count(const Status& status);
  int64_t refusals() const { return refusals_.load(); }

 private:
  struct Tenant {
    TenantQuotas quotas;
    std::atomic<int32_t> streams{0};
    std::mutex mu;  // the bucket
    double tokens = 0;
    Clock::time_point refilled{};
    int32_t burst = 0;
  };
  Status refuse(Status status);

  std::unordered_map<std::string, std::unique_ptr<Tenant>> tenants_;  // fixed after construction
  Counter* refusals_metric_ = nullptr;
  std::atomic<int64_t> refusals_{0};
};

}  // namespace treeserve
