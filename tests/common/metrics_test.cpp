// Metrics registry: values, histogram buckets and the Prometheus text format.
#include "common/metrics.h"

#include <gtest/gtest.h>

#include <thread>

namespace treeserve {
namespace {

TEST(Metrics, CounterGaugeRender) {
  MetricsRegistry r;
  Counter* c = r.counter("treeserve:fork_total", "forks");
  Gauge* g = r.gauge("treeserve:live_branches", "live");
  c->inc();
  c->inc(2);
  g->set(7);
  g->add(-2);
  std::string text = r.render();
  EXPECT_NE(text.find("# TYPE treeserve:fork_total counter\ntreeserve:fork_total 3\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("treeserve:live_branches 5\n"), std::string::npos) << text;
}

TEST(Metrics, HistogramBucketsAreCumulative) {
  MetricsRegistry r;
  Histogram* h = r.histogram("lat", "latency", {0.1, 1.0});
  h->observe(0.05);
  h->observe(0.5);
  h->observe(0.5);
  h->observe(3.0);
  std::string text = r.render();
  EXPECT_NE(text.find("lat_bucket{le=\"0.1\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lat_bucket{le=\"1\"} 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lat_bucket{le=\"+Inf\"} 4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lat_count 4\n"), std::string::npos) << text;
  EXPECT_NE(text.find("lat_sum 4.05"), std::string::npos) << text;
}

TEST(Metrics, ConcurrentIncrementsAreNotLost) {
  MetricsRegistry r;
  Counter* c = r.counter("c", "c");
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([c] {
      for (int i = 0; i < 10000; ++i) c->inc();
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(c->value(), 40000.0);
}

TEST(Metrics, ServerMetricsHaveTheApiNames) {
  MetricsRegistry r;
  ServerMetrics m(&r);
  std::string text = r.render();
  for (const char* name :
       {"num_requests_running", "num_requests_waiting", "time_to_first_token_seconds",
        "inter_token_latency_seconds", "e2e_request_latency_seconds", "prompt_tokens_total",
        "generation_tokens_total", "kv_cache_usage_perc", "prefix_cache_hit_tokens_total",
        "live_branches", "fork_total", "prune_total", "radix_nodes", "shared_kv_tokens_saved_total",
        "verify_accepted_tokens", "tree_search_total", "tree_search_levels_total",
        "step_forward_seconds", "step_host_seconds"}) {
    EXPECT_NE(text.find(std::string("# TYPE treeserve:") + name), std::string::npos) << name;
  }
}

}  // namespace
}  // namespace treeserve
