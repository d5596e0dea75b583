// bench_kv_cache: CPU time of KvCache's hot paths, page size 16, on one core.
// Targets: prefix match + insert of 4k-token prompts >= 20 M tokens/s; append one
// token to each of 1,000 branches <= 100 us; attention view for 256 leaves over a 4k-token
// shared prefix <= 50 us. Each benchmark names its target in a counter so a run prints the
// figure next to the bound it must meet; fork 64 ways has no target and is reported as is.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "kvcache/kv_cache.h"

namespace treeserve {
namespace {

constexpr int32_t kPageSize = 16;
constexpr int32_t kPrompt = 4096;

std::unique_ptr<KvCache> make_cache(int32_t num_pages) {
  KvCacheConfig config;
  config.page_size = kPageSize;
  config.num_pages = num_pages;
  return KvCache::create(config).value();
}

std::vector<int32_t> random_tokens(std::mt19937& rng, int32_t n) {
  std::vector<int32_t> v(n);
  for (int32_t& t : v) t = static_cast<int32_t>(rng() % 32000);
  return v;
}

// create_branch (match the cached prefix, lock it, allocate the rest) + finish (insert the
// new tokens into the radix tree) of 4096-token prompts whose first range(0)% are a shared
// system prompt; the rest is new to the cache every time. Items = prompt tokens.
void BM_MatchInsert4k(benchmark::State& state) {
  constexpr int32_t kPrompts = 64;
  const int32_t shared = kPrompt * static_cast<int32_t>(state.range(0)) / 100;
  std::mt19937 rng(1);
  const std::vector<int32_t> system = random_tokens(rng, shared);
  std::vector<std::vector<int32_t>> prompts(kPrompts);
  for (auto& p : prompts) {
    p = system;
    const std::vector<int32_t> rest = random_tokens(rng, kPrompt - shared);
    p.insert(p.end(), rest.begin(), rest.end());
    if (shared == kPrompt) p.back() = static_cast<int32_t>(rng() % 32000);
  }
  auto cache = make_cache((kPrompts + 2) * kPrompt / kPageSize);
  int64_t i = 0;
  int64_t cached = 0;
  for (auto _ : state) {
    if (i % kPrompts == 0 && i > 0 && shared < kPrompt) {
      state.PauseTiming();  // start over so every prompt's suffix is new again
      cache->evict_all();
      state.ResumeTiming();
    }
    StatusOr<NewBranch> b = cache->create_branch(prompts[i % kPrompts]);
    if (!b.ok()) {
      state.SkipWithError(b.status().message().c_str());
      break;
    }
    cached += b->cached_tokens;
    benchmark::DoNotOptimize(cache->finish(b->id));
    ++i;
  }
  state.SetItemsProcessed(state.iterations() * kPrompt);
  state.counters["cached_frac"] = i > 0 ? double(cached) / double(i * kPrompt) : 0;
  state.counters["target_tok_s"] = 20e6;
}
BENCHMARK(BM_MatchInsert4k)->Arg(0)->Arg(50)->Arg(90)->Arg(100)->ArgName("shared_pct");

// match_prefix_length of a fully cached 4k prompt (the read-only half). Items = tokens.
void BM_MatchPrefix4k(benchmark::State& state) {
  std::mt19937 rng(2);
  const std::vector<int32_t> prompt = random_tokens(rng, kPrompt);
  auto cache = make_cache(2 * kPrompt / kPageSize);
  // Cache it in pieces so the match crosses several radix nodes, like a multi-level prompt.
  for (int32_t cut : {459, 497, 1081, 3193, kPrompt}) {
    const std::vector<int32_t> part(prompt.begin(), prompt.begin() + cut);
    (void)cache->finish(cache->create_branch(part)->id);
  }
  for (auto _ : state) benchmark::DoNotOptimize(cache->match_prefix_length(prompt));
  state.SetItemsProcessed(state.iterations() * kPrompt);
}
BENCHMARK(BM_MatchPrefix4k);

// fork(branch, 64) of a 4k-token branch; range(0) = 1: the fork point is mid-page (64 page
// copies), 0: page-aligned (no copy). The 64 children are pruned outside the timing.
void BM_Fork64(benchmark::State& state) {
  std::mt19937 rng(3);
  const int32_t length = kPrompt + (state.range(0) ? 5 : 0);
  auto cache = make_cache(2 * kPrompt / kPageSize + 128);
  const BranchId parent = cache->create_branch(random_tokens(rng, length))->id;
  for (auto _ : state) {
    StatusOr<ForkResult> f = cache->fork(parent, 64);
    if (!f.ok()) {
      state.SkipWithError(f.status().message().c_str());
      break;
    }
    state.PauseTiming();
    for (BranchId c : f->branches) (void)cache->prune(c, false);
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * 64);
}
BENCHMARK(BM_Fork64)->Arg(0)->Arg(1)->ArgName("mid_page");

// One decode step's bookkeeping: append one token to each of 1,000 branches forked from a
// 4k prompt (a new page every 16th step). Branches are rewound outside the timing every 256
// steps. Target <= 100 us per step.
void BM_Append1000(benchmark::State& state) {
  constexpr int32_t kBranches = 1000, kRewind = 256;
  std::mt19937 rng(4);
  auto cache = make_cache(kPrompt / kPageSize + kBranches * (kRewind / kPageSize + 2));
  const BranchId parent = cache->create_branch(random_tokens(rng, kPrompt))->id;
  std::vector<BranchId> branches = cache->fork(parent, kBranches).value().branches;
  std::vector<KvSlot> slots;
  slots.reserve(kBranches);
  const std::vector<int32_t> token{7};
  int64_t step = 0;
  for (auto _ : state) {
    slots.clear();
    for (BranchId b : branches) {
      if (!cache->append(b, token, &slots).ok()) {
        state.SkipWithError("append failed");
        break;
      }
    }
    benchmark::DoNotOptimize(slots.data());
    if (++step % kRewind == 0) {
      state.PauseTiming();
      for (BranchId b : branches) (void)cache->truncate(b, kPrompt);
      state.ResumeTiming();
    }
  }
  state.SetItemsProcessed(state.iterations() * kBranches);
  state.counters["target_us"] = 100;
}
BENCHMARK(BM_Append1000)->Unit(benchmark::kMicrosecond);

// Allocation under memory pressure, the steady state of a serving cache: the pool is full of
// range(0) unlocked cached prompts (16 tokens, one page each), so every create_branch of a new
// 16-token prompt must evict; finish() caches it again and the pool stays full.
void BM_CreateUnderPressure(benchmark::State& state) {
  const int32_t cached = static_cast<int32_t>(state.range(0));
  std::mt19937 rng(6);
  auto cache = make_cache(cached);
  std::vector<std::vector<int32_t>> prompts(cached + 4096);
  for (auto& p : prompts) p = random_tokens(rng, kPageSize);
  int64_t i = 0;
  for (; i < cached; ++i) (void)cache->finish(cache->create_branch(prompts[i])->id);
  for (auto _ : state) {
    StatusOr<NewBranch> b = cache->create_branch(prompts[i++ % prompts.size()]);
    if (!b.ok()) {
      state.SkipWithError(b.status().message().c_str());
      break;
    }
    benchmark::DoNotOptimize(cache->finish(b->id));
  }
  state.counters["radix_nodes"] = double(cache->stats().radix_nodes);
}
BENCHMARK(BM_CreateUnderPressure)
    ->Arg(1024)
    ->Arg(16384)
    ->ArgName("cached")
    ->Unit(benchmark::kMicrosecond);

// build_attention_view for `leaves` decode queries over a 4k-token shared prefix, each leaf
// with its own tail of 1..64 tokens (range(1) = 1: the leaves hang off 16 mid-level nodes of
// 100 tokens instead of the prefix directly). Target <= 50 us for 256 leaves.
void BM_AttentionView(benchmark::State& state) {
  const int32_t leaves = static_cast<int32_t>(state.range(0));
  const bool two_level = state.range(1) != 0;
  std::mt19937 rng(5);
  auto cache = make_cache(kPrompt / kPageSize + leaves * 8 + 64);
  const BranchId root = cache->create_branch(random_tokens(rng, kPrompt))->id;
  std::vector<BranchId> mids{root};
  if (two_level) {
    mids = cache->fork(root, 16).value().branches;
    std::vector<KvSlot> slots;
    for (BranchId m : mids) (void)cache->append(m, random_tokens(rng, 100), &slots);
  }
  std::vector<ViewQuery> queries;
  std::vector<KvSlot> slots;
  for (int32_t i = 0; i < leaves; ++i) {
    const BranchId from = mids[i % mids.size()];
    const BranchId leaf = cache->fork(from, 1).value().branches[0];
    (void)cache->append(leaf, random_tokens(rng, 1 + static_cast<int32_t>(rng() % 64)), &slots);
    queries.push_back({leaf, 1});
  }
  AttentionView view;
  for (auto _ : state) {
    Status st = cache->build_attention_view(queries, &view);
    if (!st.ok()) {
      state.SkipWithError(st.message().c_str());
      break;
    }
    benchmark::DoNotOptimize(view.nodes.data());
  }
  state.counters["nodes"] = double(view.nodes.size());
  state.counters["pages"] = double(view.pages.size());
  state.counters["target_us"] = leaves == 256 ? 50 : 0;
}
BENCHMARK(BM_AttentionView)
    ->ArgsProduct({{20, 50, 256}, {0, 1}})
    ->ArgNames({"leaves", "two_level"})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace treeserve

BENCHMARK_MAIN();
