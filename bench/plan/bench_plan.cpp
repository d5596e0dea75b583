// bench_plan: CPU time to build an attention plan for the benchmark workload shapes
// (kernels/testing/random_tree.h; target: <= 50 us for 256 leaves over a 4k prefix on one
// core), and the CPU plan executor on a small case next to the naive reference (the baseline
// in the same binary). Counters report the plan's
// size: work items, partials, mask words, groups after greedy assignment, the longest item
// (tokens) and the paired items. The *Server cases build with the server's config.
#include <benchmark/benchmark.h>

#include <cmath>
#include <random>

#include "kernels/attention_cpu.h"
#include "kernels/attention_plan.h"
#include "kernels/testing/random_tree.h"
#include "kernels/tree_attention.h"

namespace treeserve {
namespace {

void build_plan_loop(benchmark::State& state, const testing::TreeCase& c,
                     const AttentionPlanConfig& config) {
  AttentionPlan plan;
  for (auto _ : state) {
    Status s = build_attention_plan(c.view, config, &plan);
    if (!s.ok()) state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(plan.item_num_tokens.data());
  }
  state.counters["items"] = plan.num_items();
  state.counters["partials"] = plan.num_partials();
  state.counters["mask_words"] = double(plan.mask_words.size());
  state.counters["groups"] = plan.num_groups;
  state.counters["nodes"] = double(c.view.nodes.size());
  state.counters["longest_item"] = plan.max_item_tokens;
  state.counters["paired"] = plan.num_paired_items();
}

void build_plan_loop(benchmark::State& state, const testing::TreeCase& c, int32_t gqa) {
  AttentionPlanConfig config;
  config.gqa_group_size = gqa;
  build_plan_loop(state, c, config);
}

// The server's config (what engine/cuda_backend.cpp builds every step with):
// tree_attention_plan_config for Llama-3-8B heads (32 query, 8 kv, head_dim 128) on an H100's
// 132 SMs. Unlike the struct's defaults it grows chunks by simulated span and pairs heads.
AttentionPlanConfig server_config() { return tree_attention_plan_config(32, 8, 128, 132); }

// 4k prefix with `leaves` branches of 200 tokens (few-shot b = 20, 30, 50; 256 leaves).
void BM_PlanFewShot(benchmark::State& state) {
  const auto c = testing::few_shot_case(4000, int32_t(state.range(0)), 200, 16, 1);
  build_plan_loop(state, c, int32_t(state.range(1)));
}
BENCHMARK(BM_PlanFewShot)->ArgsProduct({{20, 30, 50, 256}, {1, 4}})->ArgNames({"leaves", "gqa"});

void BM_PlanFewShotServer(benchmark::State& state) {
  const auto c = testing::few_shot_case(4000, int32_t(state.range(0)), 200, 16, 1);
  build_plan_loop(state, c, server_config());
}
BENCHMARK(BM_PlanFewShotServer)->Arg(20)->Arg(30)->Arg(50)->Arg(256)->ArgName("leaves");

void BM_PlanFastTree(benchmark::State& state) {
  static const std::vector<std::vector<int32_t>> kN = {{1, 10}, {1, 4, 16}, {1, 2, 4, 8}};
  static const std::vector<std::vector<int32_t>> kC = {
      {4000, 400}, {1024, 256, 64}, {512, 128, 128, 128}};
  const auto c = testing::fasttree_case(kN[state.range(0)], kC[state.range(0)], 16, 1);
  build_plan_loop(state, c, int32_t(state.range(1)));
}
BENCHMARK(BM_PlanFastTree)->ArgsProduct({{0, 1, 2}, {1, 4, 16}})->ArgNames({"shape", "gqa"});

// Medusa-like token tree of t candidates over a 4000-token prefix.
void BM_PlanSpeculative(benchmark::State& state) {
  const int32_t t = int32_t(state.range(0));
  const auto c = testing::speculative_case(4000, testing::medusa_like_paths(t - 1), 16, 1);
  build_plan_loop(state, c, 4);
}
BENCHMARK(BM_PlanSpeculative)->Arg(32)->Arg(64)->Arg(128)->Arg(256)->ArgName("t");

void BM_PlanSpeculativeServer(benchmark::State& state) {
  const int32_t t = int32_t(state.range(0));
  const auto c = testing::speculative_case(4000, testing::medusa_like_paths(t - 1), 16, 1);
  build_plan_loop(state, c, server_config());
}
BENCHMARK(BM_PlanSpeculativeServer)->Arg(32)->Arg(256)->ArgName("t");

// Small executor case: 512-token prefix, 8 branches of 64 tokens, 8 q heads over 2 kv heads,
// head_dim 64, page 16. range(0): 0 = plan executor (1 thread), 1 = naive reference.
void BM_CpuExecutor(benchmark::State& state) {
  const auto c = testing::few_shot_case(512, 8, 64, 16, 1);
  KvLayout layout;
  layout.num_layers = 1;
  layout.num_kv_heads = 2;
  layout.head_dim = 64;
  layout.page_size = 16;
  layout.num_pages = c.num_pages;
  layout.dtype_bytes = 4;
  const int32_t num_q_heads = 8;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> q(size_t(c.num_rows) * num_q_heads * 64), k(layout.layer_elems()),
      v(layout.layer_elems()), out(q.size());
  for (auto* buf : {&q, &k, &v}) {
    for (float& x : *buf) x = dist(rng);
  }
  AttentionPlanConfig config;
  config.gqa_group_size = 4;
  AttentionPlan plan;
  if (!build_attention_plan(c.view, config, &plan).ok()) state.SkipWithError("plan");
  AttentionCpuWorkspace ws;
  const float scale = 0.125f;
  for (auto _ : state) {
    Status s =
        state.range(0) == 0
            ? execute_attention_plan_cpu(plan, c.view, layout, q.data(), c.num_rows, k.data(),
                                         v.data(), num_q_heads, scale, out.data(), &ws, 1)
            : naive_tree_attention_cpu(c.view, layout, q.data(), c.num_rows, k.data(), v.data(),
                                       num_q_heads, scale, out.data());
    if (!s.ok()) state.SkipWithError(s.message().c_str());
    benchmark::DoNotOptimize(out.data());
  }
  // Unique KV the step must read (every token once, K and V, fp32).
  const double unique_bytes = double(512 + 8 * 64) * 2 * layout.num_kv_heads * 64 * 4;
  state.counters["unique_kv_bytes"] = unique_bytes;
  state.counters["kv_GBps"] =
      benchmark::Counter(unique_bytes, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_CpuExecutor)->Arg(0)->Arg(1)->ArgName("naive");

}  // namespace
}  // namespace treeserve

BENCHMARK_MAIN();
