// bench_engine: CPU backend throughput on the tiny model (models/tiny): decode of 1, 8 and 32
// branches forked from one shared 256-token prompt (the tree case), next to the same number
// of unrelated 256-token sequences (the baseline: no KV shared), and prefill of a 512-token
// prompt. Each iteration re-runs one fixed step (same rows, slots and positions), so the
// figure is the steady-state cost of a step at that context length. Also: sampling cost per
// token over a 128k vocabulary.
//
// Counters: tokens/s; FLOP/s (2 per multiply-add: GEMMs, attention, LM head); bytes/s, the
// bytes a step must read at least — float32 weights plus the unique KV tokens attended —
// over its time (the memory-bound limit of a decode step is that byte count over the
// machine's bandwidth).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/backend.h"
#include "engine/sampling.h"
#include "kvcache/kv_cache.h"
#include "models/llama_weights.h"
#include "models/model_config.h"

namespace treeserve {
namespace {

constexpr int32_t kPageSize = 16;
constexpr int32_t kPromptTokens = 256;

struct Model {
  ModelConfig config;
  LlamaWeights weights;
};

const Model* tiny_model() {
  static std::unique_ptr<Model> model = []() -> std::unique_ptr<Model> {
    const std::string dir = TREESERVE_TINY_MODEL_DIR;
    StatusOr<ModelConfig> config = load_model_config(dir);
    if (!config.ok()) return nullptr;
    SafetensorsOptions options;
    options.progress = false;
    StatusOr<SafetensorsReader> reader = SafetensorsReader::open_dir(dir, options);
    if (!reader.ok()) return nullptr;
    StatusOr<LlamaWeights> weights = load_llama_weights(*config, *reader);
    if (!weights.ok()) return nullptr;
    return std::unique_ptr<Model>(new Model{*config, std::move(weights).value()});
  }();
  return model.get();
}

std::vector<int32_t> tokens(int32_t n, uint64_t seed, int64_t vocab) {
  std::vector<int32_t> out;
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int32_t i = 0; i < n; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    out.push_back(int32_t(3 + (s >> 33) % uint64_t(vocab - 3)));
  }
  return out;
}

// One backend + KvCache, driven the way the scheduler drives them.
struct Engine {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<KvCache> kv;
  StepBatch batch;
  Logits logits;
};

bool make_engine(const Model& m, int32_t threads, int32_t num_pages, Engine* e) {
  CpuBackendOptions options;
  options.num_threads = threads;
  options.page_size = kPageSize;
  options.num_pages = num_pages;
  StatusOr<std::unique_ptr<Backend>> backend = create_cpu_backend(m.config, m.weights, options);
  StatusOr<std::unique_ptr<KvCache>> kv = KvCache::create({kPageSize, num_pages});
  if (!backend.ok() || !kv.ok()) return false;
  e->backend = std::move(backend).value();
  e->kv = std::move(kv).value();
  return true;
}

// The step running the last `counts[i]` tokens of each branch (whose slots are `slots[i]`),
// logits for each branch's last token.
bool build_step(Engine* e, const std::vector<BranchId>& branches,
                const std::vector<int32_t>& counts, const std::vector<std::vector<KvSlot>>& slots) {
  std::vector<ViewQuery> queries;
  for (size_t i = 0; i < branches.size(); ++i) queries.push_back({branches[i], counts[i]});
  StepBatch& b = e->batch;
  b.clear();
  if (!e->kv->build_attention_view(queries, &b.view).ok()) return false;
  std::vector<int32_t> seq;
  for (size_t i = 0; i < branches.size(); ++i) {
    if (!e->kv->branch_tokens(branches[i], &seq).ok()) return false;
    const int32_t n = counts[i], length = int32_t(seq.size());
    for (int32_t j = 0; j < n; ++j) {
      b.token_ids.push_back(seq[length - n + j]);
      b.positions.push_back(length - n + j);
      const KvSlot& s = slots[i][slots[i].size() - n + j];
      b.kv_slots.push_back(int64_t(s.page) * kPageSize + s.slot);
    }
    b.logit_rows.push_back(b.num_rows() - 1);
  }
  return true;
}

// Prefills `prompts` (one branch each) in one step; returns the branch ids.
std::vector<BranchId> prefill(Engine* e, const std::vector<std::vector<int32_t>>& prompts) {
  std::vector<BranchId> ids;
  std::vector<int32_t> counts;
  std::vector<std::vector<KvSlot>> slots;
  for (const auto& p : prompts) {
    StatusOr<NewBranch> nb = e->kv->create_branch(p);
    if (!nb.ok()) return {};
    ids.push_back(nb->id);
    counts.push_back(int32_t(p.size()) - nb->cached_tokens);
    slots.push_back(nb->slots);
  }
  if (!build_step(e, ids, counts, slots) || !e->backend->forward(e->batch, &e->logits).ok()) {
    return {};
  }
  return ids;
}

struct StepCost {
  double flops = 0;  // per step
  double bytes = 0;  // weights + unique KV tokens read, per step
};

StepCost step_cost(const ModelConfig& c, int64_t rows, int64_t logit_rows, int64_t attended,
                   int64_t unique_kv_tokens) {
  const double h = double(c.hidden_size), q = double(c.q_size()), kv = double(c.kv_size());
  const double layer_params = h * (q + 2 * kv) + q * h + 3 * h * double(c.intermediate_size);
  const double layers = double(c.num_hidden_layers), vocab = double(c.vocab_size);
  StepCost s;
  s.flops = 2 * double(rows) * layer_params * layers + 2 * double(logit_rows) * vocab * h +
            4 * double(attended) * q * layers;  // QK and PV per attended (query, token) pair
  const double kv_bytes_per_token = layers * 2 * kv * 4;
  s.bytes = 4 * (layer_params * layers + vocab * h) + double(unique_kv_tokens) * kv_bytes_per_token;
  return s;
}

// Printed as rates: tokens=…/s, FLOP=…/s, bytes=…/s (1000-based prefixes).
void report(benchmark::State& state, int64_t tokens_per_step, const StepCost& cost) {
  using benchmark::Counter;
  state.counters["tokens"] = Counter(double(tokens_per_step), Counter::kIsIterationInvariantRate);
  state.counters["FLOP"] = Counter(cost.flops, Counter::kIsIterationInvariantRate);
  state.counters["bytes"] = Counter(cost.bytes, Counter::kIsIterationInvariantRate);
}

// range(0) branches decode one token each over 256 prompt tokens; range(1) = 1: one shared
// prompt forked range(0) ways (tree), 0: range(0) unrelated prompts (baseline); range(2)
// engine threads.
void BM_Decode(benchmark::State& state) {
  const Model* m = tiny_model();
  if (m == nullptr) return state.SkipWithError("tiny model missing: build the tiny_model target");
  const int32_t branches = int32_t(state.range(0));
  const bool shared = state.range(1) != 0;
  const int64_t vocab = m->config.vocab_size;
  Engine e;
  // Pages for every branch's own copy of the prompt plus one, as the baseline needs.
  const int32_t pages = branches * (kPromptTokens / kPageSize + 2);
  if (!make_engine(*m, int32_t(state.range(2)), pages, &e))
    return state.SkipWithError("cannot create the engine");
  std::vector<BranchId> ids;
  if (shared) {
    const std::vector<BranchId> root = prefill(&e, {tokens(kPromptTokens, 1, vocab)});
    StatusOr<ForkResult> f =
        root.empty() ? StatusOr<ForkResult>(Internal("prefill")) : e.kv->fork(root[0], branches);
    if (!f.ok()) return state.SkipWithError("prefill or fork failed");
    ids = f->branches;
  } else {
    for (int32_t i = 0; i < branches; i += 4) {  // prefill 4 prompts per step
      std::vector<std::vector<int32_t>> prompts;
      for (int32_t j = i; j < std::min(branches, i + 4); ++j) {
        prompts.push_back(tokens(kPromptTokens, 100 + j, vocab));
      }
      const std::vector<BranchId> got = prefill(&e, prompts);
      if (got.empty()) return state.SkipWithError("prefill failed");
      ids.insert(ids.end(), got.begin(), got.end());
    }
  }
  std::vector<std::vector<KvSlot>> slots(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t t = int32_t(3 + (i * 37) % (vocab - 3));
    if (!e.kv->append(ids[i], std::vector<int32_t>{t}, &slots[i]).ok()) {
      return state.SkipWithError("append failed");
    }
  }
  if (!build_step(&e, ids, std::vector<int32_t>(ids.size(), 1), slots)) {
    return state.SkipWithError("build_step failed");
  }
  for (auto _ : state) {
    if (!e.backend->forward(e.batch, &e.logits).ok()) return state.SkipWithError("forward failed");
    benchmark::DoNotOptimize(e.logits.data.data());
  }
  const int64_t context = kPromptTokens + 1;
  report(state, branches,
         step_cost(m->config, branches, branches, int64_t(branches) * context,
                   shared ? kPromptTokens + branches : int64_t(branches) * context));
}
BENCHMARK(BM_Decode)
    ->ArgsProduct({{1, 8, 32}, {1, 0}, {1, 2}})
    ->ArgNames({"branches", "shared", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// One prompt of range(0) tokens in one step (causal), logits of its last token; range(1)
// engine threads.
void BM_Prefill(benchmark::State& state) {
  const Model* m = tiny_model();
  if (m == nullptr) return state.SkipWithError("tiny model missing: build the tiny_model target");
  const int32_t n = int32_t(state.range(0));
  Engine e;
  if (!make_engine(*m, int32_t(state.range(1)), n / kPageSize + 2, &e))
    return state.SkipWithError("cannot create the engine");
  if (prefill(&e, {tokens(n, 7, m->config.vocab_size)}).empty()) {
    return state.SkipWithError("prefill failed");
  }
  for (auto _ : state) {
    if (!e.backend->forward(e.batch, &e.logits).ok()) return state.SkipWithError("forward failed");
    benchmark::DoNotOptimize(e.logits.data.data());
  }
  report(state, n, step_cost(m->config, n, 1, int64_t(n) * (n + 1) / 2, n));
}
BENCHMARK(BM_Prefill)
    ->ArgsProduct({{512}, {1, 2}})
    ->ArgNames({"tokens", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// sample_token on one row of a Llama-3-sized vocabulary (128256): range(0) selects greedy,
// temperature 1, top-k 50, top-p 0.9, top-k 50 + top-p 0.9 + 20 logprobs. Logits are
// Gaussian with sd 3 (the tiny model's spread): a wide distribution, whose top-p nucleus
// holds thousands of tokens (peaked real distributions make top-p cheaper).
void BM_Sample(benchmark::State& state) {
  constexpr int64_t kVocab = 128256;
  std::vector<float> logits(kVocab);
  uint64_t s = 12345;
  auto uniform = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return (double(s >> 11) + 0.5) * 0x1.0p-53;
  };
  for (float& x : logits) {
    const double u1 = uniform(), u2 = uniform();
    x = float(3.0 * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  SamplingParams p;
  switch (state.range(0)) {
    case 0:
      p.temperature = 0.0f;
      break;
    case 1:
      break;
    case 2:
      p.top_k = 50;
      break;
    case 3:
      p.top_p = 0.9f;
      break;
    default:
      p.top_k = 50;
      p.top_p = 0.9f;
      p.logprobs = 20;
  }
  SamplingScratch scratch;
  int64_t position = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(sample_token(logits.data(), kVocab, p, 1, position++, &scratch));
  }
  state.counters["tokens"] = benchmark::Counter(1, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Sample)->DenseRange(0, 4)->ArgName("mode")->Unit(benchmark::kMicrosecond);

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

}  // namespace
}  // namespace treeserve

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("device", "CPU: " + treeserve::cpu_name());
  benchmark::AddCustomContext("hardware_threads",
                              std::to_string(std::thread::hardware_concurrency()));
  benchmark::AddCustomContext("model", "tiny Llama (4 layers, hidden 256, 4/2 heads, vocab 512)");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
