// A small Prometheus metrics registry: counters, gauges and histograms with lock-free
// updates, rendered in the text exposition format. The scheduler updates them; server/
// serves them over HTTP (--metrics-listen). Names follow vLLM's ("treeserve:" prefix).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace treeserve {

class Counter {
 public:
  void inc(double v = 1.0) { add(value_, v); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  friend class Gauge;
  static void add(std::atomic<double>& a, double v) {
    double cur = a.load(std::memory_order_relaxed);
    while (!a.compare_exchange_weak(cur, cur + v, std::memory_order_relaxed)) {
    }
  }
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void set(double v) { value_.store(v, std::memory_order_relaxed); }
  void add(double v) { Counter::add(value_, v); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double v);
  // Cumulative counts per bucket (last = +Inf), sum and count, read consistently.
  void snapshot(std::vector<uint64_t>* cumulative, double* sum, uint64_t* count) const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; last = +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

class MetricsRegistry {
 public:
  Counter* counter(const std::string& name, const std::string& help);
  Gauge* gauge(const std::string& name, const std::string& help);
  Histogram* histogram(const std::string& name, const std::string& help,
                       std::vector<double> upper_bounds);
  // Prometheus text exposition format (version 0.0.4).
  std::string render() const;

 private:
  struct Entry {
    std::string name, help, type;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::unique_ptr<Histogram> histogram;
  };
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_;
};

// The server's metrics (the names its API documents), registered once.
struct ServerMetrics {
  explicit ServerMetrics(MetricsRegistry* registry);
  Gauge* num_requests_running;
  Gauge* num_requests_waiting;
  Histogram* time_to_first_token_seconds;
  Histogram* inter_token_latency_seconds;
  Histogram* e2e_request_latency_seconds;
  Counter* prompt_tokens_total;
  Counter* generation_tokens_total;
  Gauge* kv_cache_usage_perc;
  Counter* prefix_cache_hit_tokens_total;
  Gauge* live_branches;
  Counter* fork_total;
  Counter* prune_total;
  Gauge* radix_nodes;
  Counter* shared_kv_tokens_saved_total;
  Histogram* verify_accepted_tokens;
  Counter* tree_search_total;          // TreeSearch calls that passed validation
  Counter* tree_search_levels_total;   // levels they generated and scored
  Histogram* step_forward_seconds;     // the backend's forward per engine step
  Histogram* step_host_seconds;        // the scheduler's own work per engine step
  Counter* tree_leases_expired_total;  // trees deleted because their idle lease ran out
  Counter* misrouted_calls_total;      // calls naming a tree of another replica
};

}  // namespace treeserve
