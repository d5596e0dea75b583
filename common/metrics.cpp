// Prometheus registry and text rendering.
#include "common/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace treeserve {
namespace {

std::string format_value(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  // Shortest text that reads back as the same double (0.1, not 0.10000000000000001).
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  if (ec != std::errc()) return "NaN";
  return std::string(buf, end);
}

// Engine step phases: 10 us to 1 s.
std::vector<double> step_buckets() {
  return {1e-5, 2.5e-5, 5e-5,   1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
          5e-3, 1e-2,   2.5e-2, 5e-2, 0.1,    0.25, 0.5,  1.0};
}

std::vector<double> latency_buckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25, 0.5,
          0.75,  1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0};
}

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  std::sort(bounds_.begin(), bounds_.end());
  counts_.assign(bounds_.size() + 1, 0);
}

void Histogram::observe(double v) {
  size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::snapshot(std::vector<uint64_t>* cumulative, double* sum, uint64_t* count) const {
  std::lock_guard<std::mutex> lock(mu_);
  cumulative->resize(counts_.size());
  uint64_t acc = 0;
  for (size_t i = 0; i < counts_.size(); ++i) (*cumulative)[i] = acc += counts_[i];
  *sum = sum_;
  *count = count_;
}

Counter* MetricsRegistry::counter(const std::string& name, const std::string& help) {
  std::lock_guard<std::mutex> lock(mu_);
  auto e = std::make_unique<Entry>();
  e->name = name, e->help = help, e->type = "counter";
  e->counter = std::make_unique<Counter>();
  Counter* c = e->counter.get();
  entries_.push_back(std::move(e));
  return c;
}

Gauge* MetricsRegistry::gauge(const std::string& name, const std::string& help) {
  std::lock_guard<std::mutex> lock(mu_);
  auto e = std::make_unique<Entry>();
  e->name = name, e->help = help, e->type = "gauge";
  e->gauge = std::make_unique<Gauge>();
  Gauge* g = e->gauge.get();
  entries_.push_back(std::move(e));
  return g;
}

Histogram* MetricsRegistry::histogram(const std::string& name, const std::string& help,
                                      std::vector<double> upper_bounds) {
  std::lock_guard<std::mutex> lock(mu_);
  auto e = std::make_unique<Entry>();
  e->name = name, e->help = help, e->type = "histogram";
  e->histogram = std::make_unique<Histogram>(std::move(upper_bounds));
  Histogram* h = e->histogram.get();
  entries_.push_back(std::move(e));
  return h;
}

std::string MetricsRegistry::render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream out;
  for (const auto& e : entries_) {
    out << "# HELP " << e->name << " " << e->help << "\n# TYPE " << e->name << " " << e->type
        << "\n";
    if (e->counter) {
      out << e->name << " " << format_value(e->counter->value()) << "\n";
    } else if (e->gauge) {
      out << e->name << " " << format_value(e->gauge->value()) << "\n";
    } else {
      std::vector<uint64_t> cum;
      double sum = 0;
      uint64_t count = 0;
      e->histogram->snapshot(&cum, &sum, &count);
      const auto& b = e->histogram->bounds();
      for (size_t i = 0; i < cum.size(); ++i) {
        std::string le = i < b.size() ? format_value(b[i]) : "+Inf";
        out << e->name << "_bucket{le=\"" << le << "\"} " << cum[i] << "\n";
      }
      out << e->name << "_sum " << format_value(sum) << "\n";
      out << e->name << "_count " << count << "\n";
    }
  }
  return out.str();
}

ServerMetrics::ServerMetrics(MetricsRegistry* r)
    : num_requests_running(
          r->gauge("treeserve:num_requests_running", "Generate/Verify requests being decoded")),
      num_requests_waiting(
          r->gauge("treeserve:num_requests_waiting", "Requests queued for KV pages")),
      time_to_first_token_seconds(r->histogram("treeserve:time_to_first_token_seconds",
                                               "Time to first token", latency_buckets())),
      inter_token_latency_seconds(r->histogram("treeserve:inter_token_latency_seconds",
                                               "Time between tokens of a branch",
                                               latency_buckets())),
      e2e_request_latency_seconds(r->histogram("treeserve:e2e_request_latency_seconds",
                                               "Generate request latency", latency_buckets())),
      prompt_tokens_total(r->counter("treeserve:prompt_tokens_total", "Prefilled tokens")),
      generation_tokens_total(r->counter("treeserve:generation_tokens_total", "Generated tokens")),
      kv_cache_usage_perc(
          r->gauge("treeserve:kv_cache_usage_perc", "Fraction of KV pages in use (0-1)")),
      prefix_cache_hit_tokens_total(r->counter("treeserve:prefix_cache_hit_tokens_total",
                                               "Prompt tokens reused from the radix cache")),
      live_branches(r->gauge("treeserve:live_branches", "Live branches of all trees")),
      fork_total(r->counter("treeserve:fork_total", "Branches created by forks")),
      prune_total(r->counter("treeserve:prune_total", "Branches pruned")),
      radix_nodes(r->gauge("treeserve:radix_nodes", "Nodes in the radix tree")),
      shared_kv_tokens_saved_total(
          r->counter("treeserve:shared_kv_tokens_saved_total",
                     "KV tokens not re-read thanks to prefix sharing in tree attention")),
      verify_accepted_tokens(r->histogram("treeserve:verify_accepted_tokens",
                                          "Tokens accepted per Verify call",
                                          {0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32})),
      tree_search_total(
          r->counter("treeserve:tree_search_total", "Tree-of-thought searches started")),
      tree_search_levels_total(r->counter("treeserve:tree_search_levels_total",
                                          "Levels generated and scored by tree searches")),
      step_forward_seconds(r->histogram("treeserve:step_forward_seconds",
                                        "Backend forward time per engine step", step_buckets())),
      step_host_seconds(r->histogram(
          "treeserve:step_host_seconds",
          "Scheduler time per engine step outside the forward (commands, batch and view "
          "building, result handling): time the device waits for the host",
          step_buckets())),
      tree_leases_expired_total(
          r->counter("treeserve:tree_leases_expired_total",
                     "Trees deleted because no call touched them for their idle lease")),
      misrouted_calls_total(r->counter(
          "treeserve:misrouted_calls_total",
          "Calls refused FAILED_PRECONDITION because the tree they name lives on another "
          "replica (its id names it): the proxy did not route them by x-treeserve-route")) {}

}  // namespace treeserve
