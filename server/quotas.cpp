// Streams in flight and request rates per tenant (server/quotas.h).
#include "server/quotas.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "scheduler/scheduler.h"

namespace treeserve {

TenantGate::TenantGate(const std::vector<TenantConfig>& tenants, MetricsRegistry* registry) {
  if (registry != nullptr) {
    refusals_metric_ = registry->counter(
        "treeserve:quota_refusals_total",
        "Calls refused RESOURCE_EXHAUSTED by a tenant quota (live trees, live branches, KV "
        "pages, concurrent streams, requests per second)");
  }
  for (const TenantConfig& t : tenants) {
    auto state = std::make_unique<Tenant>();
    state->quotas = t.quotas;
    const double rps = t.quotas.requests_per_second;
    state->burst = t.quotas.burst > 0 ? t.quotas.burst : std::max(1, int32_t(std::ceil(rps)));
    state->tokens = state->burst;  // a tenant starts with a full bucket
    tenants_.emplace(t.name, std::move(state));
  }
}

Status TenantGate::refuse(Status status) {
  ++refusals_;
  if (refusals_metric_ != nullptr) refusals_metric_->inc();
  return status;
}

const Status& TenantGate::count(const Status& status) {
  if (is_tenant_quota_refusal(status)) {
    ++refusals_;
    if (refusals_metric_ != nullptr) refusals_metric_->inc();
  }
  return status;
}

Status TenantGate::admit_request(const std::string& tenant, Clock::time_point now) {
  auto it = tenants_.find(tenant);
  if (it == tenants_.end() || it->second->quotas.requests_per_second <= 0) return Status::Ok();
  Tenant& t = *it->second;
  const double rps = t.quotas.requests_per_second;
  double wait_s = 0;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    if (t.refilled == Clock::time_point{}) t.refilled = now;  // the first request
    if (now > t.refilled) {
      const double elapsed = std::chrono::duration<double>(now - t.refilled).count();
      t.tokens = std::min<double>(t.burst, t.tokens + elapsed * rps);
      t.refilled = now;
    }
    if (t.tokens >= 1) {
      t.tokens -= 1;
      return Status::Ok();
    }
    wait_s = (1 - t.tokens) / rps;
  }
  char rate[32];
  std::snprintf(rate, sizeof(rate), "%g", rps);
  return refuse(ResourceExhausted("tenant '" + tenant + "': request rate at " + rate +
                                  " per second with its burst of " + std::to_string(t.burst) +
                                  " used (quota requests_per_second); retry in " +
                                  std::to_string(int64_t(std::ceil(wait_s * 1000))) + " ms"));
}

TenantGate::StreamSlot& TenantGate::StreamSlot::operator=(StreamSlot&& other) noexcept {
  if (this != &other) {
    release();
    in_flight_ = other.in_flight_;
    other.in_flight_ = nullptr;
  }
  return *this;
}

void TenantGate::StreamSlot::release() {
  if (in_flight_ != nullptr) in_flight_->fetch_sub(1);
  in_flight_ = nullptr;
}

StatusOr<TenantGate::StreamSlot> TenantGate::open_stream(const std::string& tenant) {
  auto it = tenants_.find(tenant);
  if (it == tenants_.end()) return StreamSlot();
  Tenant& t = *it->second;
  const int32_t max = t.quotas.max_concurrent_streams;
  int32_t cur = t.streams.load();
  do {
    if (max > 0 && cur >= max) {
      return refuse(ResourceExhausted("tenant '" + tenant + "': concurrent streams " +
                                      std::to_string(cur) + " of " + std::to_string(max) +
                                      " (quota max_concurrent_streams); wait for one to end"));
    }
  } while (!t.streams.compare_exchange_weak(cur, cur + 1));
  return StreamSlot(&t.streams);
}

int32_t TenantGate::streams_in_flight(const std::string& tenant) const {
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? 0 : it->second->streams.load();
}

}  // namespace treeserve
