// bench_tree_attention: the tree-attention kernels on the kernel-shape and decoding workloads
// (kernels/testing/random_tree.h), one layer, fp16, Llama-3-8B heads (32 q / 8 kv, head_dim
// 128) and GQA 1 (32/32).
// Per case: median kernel time (stage 1 + merge, L2 flushed before each repetition), the IO
// lower bound (unique KV bytes / device-to-device copy bandwidth measured in this run), the
// achieved unique-KV bandwidth, the prefix-unaware baseline (per-query split-KV flash
// decoding, same kernels) and the speedup over it, CPU plan-build time, and the max abs error
// against a float32 CPU reference (the plan executor, or the naive reference on a sample of
// queries for large cases).
//
// usage: bench_tree_attention [--json PATH] [--reps N] [--filter SUBSTR] [--no-flush]
//                             [--chunk TOKENS] [--max-chunk TOKENS] [--min-split TOKENS]
//                             (--max-chunk: chunk growth's cap, AttentionPlanConfig::
//                             max_chunk_tokens; 0 = no growth, default 4 x the chunk)
//                             [--pack-max TOKENS]  (AttentionPlanConfig::pack_max_tokens)
//                             [--pair-margin N]  (AttentionPlanConfig::pair_margin: pair where
//                                                the simulated span is 1/N shorter; 32)
//                             [--decode-chunk TOKENS]  (AttentionPlanConfig::
//                                                     decode_chunk_tokens: paired plans' decode-
//                                                     shaped units in chunks of TOKENS)
//                             [--paired-kv-order]  (AttentionPlanConfig::paired_longest_first
//                                                  false: paired items in kv-major order)
//                             [--no-balance-tiles]  (full query tiles and a remainder:
//                                                   AttentionPlanConfig::balance_query_tiles)
//                             [--items-per-sm X]
//                             [--order kv|mixed|plan|longest|interleaved]   (launch order of the
//                             items)
//                             [--table fixed|packed|none]  (token table layout the workspace
//                                                          allows; --no-token-table = none)
//                             [--grid]   (bucketed grids reading the header on the device, as
//                                         the engine's CUDA graphs launch)
//                             [--graph]  (--grid, each launch captured once into a CUDA graph
//                                         and the graph replayed, as the engine's decode step
//                                         runs it; timed on the graph's stream)
//                             [--no-decode-kernel]  (stage 1 runs every plan: the comparison
//                                                   for TreeAttentionLimits::decode_kernel)
//                             [--depth-slots]  (runs start at slot depth % page size, as the
//                                              server's KV cache lays them out; default: a
//                                              random first slot per run)
//                             [--fresh-pages]  (physical pages as a fresh server's pool hands
//                                              them out while the tree grows: the prompt's
//                                              contiguous, branches' interleaved; default:
//                                              shuffled over a pool with unused pages)
//                             [--few-shot P,B,S]...  (only these cases: a P-token prompt with
//                                                     B branches of S tokens; repeatable; S = 0:
//                                                     B queries at the prompt's end, no tokens
//                                                     of their own, as a sequence-parallel
//                                                     rank's share of a prompt)
//                             [--speculative P,T]...  (only these cases, with --few-shot's: a
//                                                     Medusa-like tree of T queries over a
//                                                     P-token prompt; repeatable)
//                             [--trace PATH]  (after timing, one more flushed launch of each
//                                              case's plan with the stage 1 block trace on:
//                                              a CSV row per block, times in ns from the first
//                                              block's start)
//                             [--no-pair]  (no head pairing: AttentionPlanConfig::pair_heads 0)
//                             [--pair-all]  (head pairing offered at every GQA where the kv
//                                           heads come in groups of 4, not only at GQA >= 4;
//                                           the builder's simulation still decides)
//                             [--plan-only]  (no GPU: each case's plan only, as it would be
//                                            built for an H100's 132 SMs)
//                             [--no-tail | --tail-always]  (TreeAttentionLimits::tail_kernel:
//                                            never, or always, instead of where
//                                            tree_attention_tail_pays)
//                             [--no-wide | --wide-always]  (TreeAttentionLimits::wide_kernel:
//                                            never, or wherever the plan has wide pairs,
//                                            instead of where tree_attention_wide_pays)
//                             [--kv-heads N]  (only 32 query heads over N kv heads, a divisor
//                                            of 32, instead of 32/8 and 32/32)
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/tree_attention/bench_util.h"
#include "kernels/attention_plan.h"
#include "kernels/detail/tree_attention_launch.h"
#include "kernels/testing/gpu_attention_harness.h"
#include "kernels/testing/random_tree.h"
#include "kernels/tree_attention.h"

namespace treeserve {
namespace {

using bench::copy_bandwidth;
using bench::median;
using bench::Timer;

struct Options {
  std::string json_path;
  std::string filter;
  int reps = 50;
  bool flush_l2 = true;
  int chunk = 0;         // 0: tree_attention_plan_config's default
  int max_chunk = -1;    // AttentionPlanConfig::max_chunk_tokens (0: no chunk growth; -1: config's)
  int pair_margin = 0;   // AttentionPlanConfig::pair_margin (0: config's)
  int decode_chunk = 0;  // AttentionPlanConfig::decode_chunk_tokens (0: the builder's choice)
  bool paired_kv_order = false;  // AttentionPlanConfig::paired_longest_first = false
  int min_split = 0;
  int pack_max = 0;           // AttentionPlanConfig::pack_max_tokens (0: the config's)
  bool balance_tiles = true;  // AttentionPlanConfig::balance_query_tiles (--no-balance-tiles)
  double items_per_sm = 0;
  AttentionPlanConfig::ItemOrder item_order = AttentionPlanConfig::ItemOrder::kKvMajor;
  // Token table layout the workspace allows: "fixed" (fixed stride, the default), "packed"
  // (sized so only the packed layout fits) or "none" (stage 1 resolves its tokens itself).
  std::string table = "fixed";
  bool decode_kernel = true;  // TreeAttentionLimits::decode_kernel
  bool depth_slots = false;   // runs placed as the server's KV cache places them (--depth-slots)
  bool fresh_pages = false;   // pages as a fresh pool hands them out (--fresh-pages)
  bool grid_launch = false;   // launch as the engine's CUDA graphs do (TreeAttentionGrid)
  bool graph = false;         // ... and replay them from a captured CUDA graph
  std::vector<std::array<int32_t, 3>> few_shot;     // --few-shot P,B,S: custom cases only
  std::vector<std::array<int32_t, 2>> speculative;  // --speculative P,T: custom cases only
  std::string trace_path;                           // --trace: stage 1 block trace CSV
  bool pair = true;        // AttentionPlanConfig::pair_heads as configured (--no-pair: 0)
  bool pair_all = false;   // --pair-all: offered at any GQA (kv heads in groups of 4)
  bool plan_only = false;  // --plan-only: build the plans, print their shape, no GPU
  // TreeAttentionLimits::tail_kernel (default kAuto; --no-tail: kOff, --tail-always: kAlways)
  TreeAttentionLimits::Tail tail = TreeAttentionLimits::Tail::kAuto;
  // TreeAttentionLimits::wide_kernel (default kAuto; --no-wide: kOff, --wide-always: kAlways)
  TreeAttentionLimits::Wide wide = TreeAttentionLimits::Wide::kAuto;
  int kv_heads = 0;  // --kv-heads: only 32 / kv_heads (0: 32/8 and 32/32)
};

struct Case {
  std::string name;
  std::string family;
  testing::TreeCase tree;
};

struct Result {
  std::string name, family;
  int32_t num_q_heads = 0, num_kv_heads = 0, queries = 0, items = 0, baseline_items = 0;
  int32_t chunk = 0, paired_items = 0;  // the plan's chunk; its items run kv heads paired
  int32_t decode_chunk = 0;             // the chunk its decode-shaped units were cut into
  bool wide = false;                    // the launch ran the wide kernel
  // --plan-only: the kernels an H100 launch at the defaults would run (decode, stage 1, stage 1
  // + tail, wide), from the plan's counts (tree_attention_auto_kernels).
  const char* kernels = "";
  double unique_mb = 0, plan_kv_mb = 0, plan_build_us = 0;
  double median_us = 0, bound_us = 0, tbps = 0, copy_fraction = 0;
  double baseline_us = 0, speedup = 0;
  float max_err = 0, baseline_err = 0;
  bool sampled = false;
};

// Tree-of-thought BFS tree: a prompt, then `depth` levels; each of `keep` surviving thoughts
// of a level branches `width` ways (thoughts of thought_tokens), the rest are pruned; every
// thought of the last level is a live branch decoding (one query each).
testing::TreeCase tot_case(int32_t prompt, int32_t depth, int32_t width, int32_t keep,
                           int32_t thought_tokens, uint64_t seed) {
  testing::TreeViewBuilder b(16);
  std::vector<int32_t> survivors{b.add_run(-1, prompt)};
  std::vector<int32_t> level;
  for (int32_t d = 0; d < depth; ++d) {
    level.clear();
    for (int32_t s : survivors) {
      for (int32_t w = 0; w < width; ++w) level.push_back(b.add_run(s, thought_tokens));
    }
    survivors.assign(level.begin(), level.begin() + std::min<size_t>(keep, level.size()));
  }
  for (int32_t leaf : level) b.add_query(leaf);
  return b.build(seed);
}

std::vector<Case> make_cases() {
  std::vector<Case> cases;
  cases.push_back({"fasttree N=1,10 C=4000,400", "fasttree",
                   testing::fasttree_case({1, 10}, {4000, 400}, 16, 1)});
  cases.push_back({"fasttree N=1,4,16 C=1024,256,64", "fasttree",
                   testing::fasttree_case({1, 4, 16}, {1024, 256, 64}, 16, 2)});
  cases.push_back({"fasttree N=1,2,4,8 C=512,128x3", "fasttree",
                   testing::fasttree_case({1, 2, 4, 8}, {512, 128, 128, 128}, 16, 3)});
  for (int32_t b : {20, 30, 50}) {
    cases.push_back({"few-shot P=4000 + " + std::to_string(b) + "x200", "few-shot",
                     testing::few_shot_case(4000, b, 200, 16, 4)});
  }
  cases.push_back(
      {"few-shot P=16000 + 64x200", "few-shot", testing::few_shot_case(16000, 64, 200, 16, 5)});
  cases.push_back({"tot sorting d10 w10", "tot", tot_case(600, 10, 10, 1, 120, 6)});
  cases.push_back({"tot doc-merge d3 w10 k2", "tot", tot_case(1500, 3, 10, 2, 300, 7)});
  cases.push_back({"tot keyword d5 w10 k2", "tot", tot_case(800, 5, 10, 2, 150, 8)});
  cases.push_back({"tot set-inter d8 w10", "tot", tot_case(700, 8, 10, 1, 100, 9)});
  for (int32_t t : {32, 64, 128, 256}) {
    // medusa_like_paths(t - 1) candidates plus the last accepted token: t queries.
    cases.push_back({"speculative t=" + std::to_string(t) + " over 4000", "speculative",
                     testing::speculative_case(4000, testing::medusa_like_paths(t - 1), 16, 10)});
  }
  return cases;
}

TreeAttentionLimits limits_for(const AttentionPlan& plan, int32_t num_q_heads,
                               const std::string& table, bool decode_kernel) {
  TreeAttentionLimits l;
  l.decode_kernel = decode_kernel;
  int64_t tokens = 0;
  for (int32_t n : plan.item_num_tokens) tokens += n;
  l.max_work_items = std::max(1, plan.num_items());
  l.max_item_tokens = std::max(1, plan.max_item_tokens);
  // Room for the fixed-stride table layout (what the engine's workspace gives such plans).
  const int64_t fixed = int64_t(l.max_work_items) * tree_attention_table_stride(l.max_item_tokens);
  l.max_table_tokens = table == "none"     ? 0
                       : table == "packed" ? int32_t(std::max<int64_t>(1, tokens))
                                           : int32_t(std::max<int64_t>({1, tokens, fixed}));
  l.max_partials = std::max(1, plan.num_partials());
  l.max_segments = std::max(1, plan.num_segments());
  l.max_mask_words = std::max<int32_t>(1, int32_t(plan.mask_words.size()));
  l.max_queries = std::max(1, plan.num_queries());
  l.max_view_pages = std::max<int32_t>(1, int32_t(plan.page_table.size()));
  l.max_item_tokens = std::max(1, plan.max_item_tokens);
  l.max_num_q_heads = num_q_heads;
  l.max_head_dim = 128;
  return l;
}

double plan_build_us(const testing::TreeCase& tree, const AttentionPlanConfig& config) {
  AttentionPlan plan;
  std::vector<double> us;
  for (int i = 0; i < 30; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_OK(build_attention_plan(tree.view, config, &plan));
    const auto t1 = std::chrono::steady_clock::now();
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  return median(us);
}

// Appends the stage 1 block trace of one flushed launch to path (a header line first when
// the file is new): case, heads, block, item, kv head, rows, tokens, SM, start and end ns
// from the launch's first block start.
template <typename F>
void write_trace(const std::string& path, const Result& r, TreeAttentionWorkspace* ws, Timer* timer,
                 F launch) {
  CHECK_OK(ws->enable_block_trace());
  std::vector<TreeAttentionBlockTrace> trace;
  CHECK_OK(ws->download_block_trace(&trace));  // clears what earlier launches left
  timer->median_us(1, launch);                 // the last of its 4 launches stays recorded
  CHECK_OK(ws->download_block_trace(&trace));
  if (trace.empty()) return;
  uint64_t t0 = trace[0].start_ns;
  for (const TreeAttentionBlockTrace& b : trace) t0 = std::min(t0, b.start_ns);
  FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return;
  }
  std::fseek(f, 0, SEEK_END);
  if (std::ftell(f) == 0)
    std::fprintf(f, "case,heads,block,item,kv_head,rows,tokens,sm,start_ns,end_ns\n");
  for (const TreeAttentionBlockTrace& b : trace) {
    // The case name is quoted: some hold commas ("fasttree N=1,10 C=4000,400").
    std::fprintf(f, "\"%s\",%d/%d,%d,%d,%d,%d,%d,%d,%llu,%llu\n", r.name.c_str(), r.num_q_heads,
                 r.num_kv_heads, b.block, b.item, b.kv_head, b.rows, b.tokens, b.sm,
                 static_cast<unsigned long long>(b.start_ns - t0),
                 static_cast<unsigned long long>(b.end_ns - t0));
  }
  std::fclose(f);
}

Result run_case(const Case& c, int32_t num_q_heads, int32_t num_kv_heads, int32_t num_sms,
                double copy_bw, const Options& opt, Timer* timer) {
  constexpr int32_t kHeadDim = 128;
  Result r;
  r.name = c.name;
  r.family = c.family;
  r.num_q_heads = num_q_heads;
  r.num_kv_heads = num_kv_heads;
  r.queries = int32_t(c.tree.view.queries.size());
  AttentionPlanConfig config =
      tree_attention_plan_config(num_q_heads, num_kv_heads, kHeadDim, num_sms);
  if (opt.chunk > 0) config.kv_chunk_tokens = opt.chunk;
  if (opt.max_chunk >= 0) config.max_chunk_tokens = opt.max_chunk;
  if (opt.min_split > 0) config.min_split_tokens = opt.min_split;
  if (opt.pack_max > 0) config.pack_max_tokens = opt.pack_max;
  if (opt.pair_margin > 0) config.pair_margin = opt.pair_margin;
  if (opt.decode_chunk > 0) config.decode_chunk_tokens = opt.decode_chunk;
  if (opt.paired_kv_order) config.paired_longest_first = false;
  config.balance_query_tiles = opt.balance_tiles;  // (tree_attention_plan_config's: on)
  config.item_order = opt.item_order;
  if (!opt.pair) config.pair_heads = 0;
  if (opt.pair && opt.pair_all && num_kv_heads % kTreeAttentionPairHeads == 0) {
    config.pair_heads = kTreeAttentionPairHeads;
  }
  if (opt.items_per_sm > 0)
    config.num_sms = std::max(1, int32_t(opt.items_per_sm * num_sms / num_kv_heads));
  AttentionPlan plan, baseline;
  CHECK_OK(build_attention_plan(c.tree.view, config, &plan));
  CHECK_OK(build_baseline_plan(c.tree.view, config, &baseline));
  r.plan_build_us = plan_build_us(c.tree, config);
  r.items = plan.num_items();
  r.baseline_items = baseline.num_items();
  const int64_t unique = view_unique_kv_bytes(c.tree.view, num_kv_heads, kHeadDim, 2);
  r.unique_mb = double(unique) / 1e6;
  r.plan_kv_mb = double(plan_kv_bytes(plan, num_kv_heads, kHeadDim, 2)) / 1e6;
  r.chunk = plan.split_chunk_tokens;
  r.decode_chunk = plan.decode_chunk_tokens;
  r.paired_items = plan.num_paired_items();
  if (opt.plan_only) {
    const TreeAttentionAutoKernels k = tree_attention_auto_kernels(
        plan.num_items(), tree_attention_paired_begin(plan), tree_attention_wide_pairs(plan),
        plan.max_item_tokens, num_kv_heads, num_sms);
    r.kernels = tree_attention_all_decode_shaped(plan)
                    ? "decode"
                    : (k.wide ? "wide" : (k.tail ? "tail" : "stage1"));
    return r;
  }

  testing::GpuAttentionProblem problem;
  CHECK_OK(problem.init(c.tree, num_q_heads, num_kv_heads, kHeadDim, TreeAttentionDtype::kFloat16,
                        1234, 2.f));
  TreeAttentionWorkspace ws, ws_base;
  TreeAttentionLimits plan_limits = limits_for(plan, num_q_heads, opt.table, opt.decode_kernel);
  plan_limits.tail_kernel = opt.tail;
  plan_limits.wide_kernel = opt.wide;
  CHECK_OK(ws.init(plan_limits));
  CHECK_OK(ws_base.init(limits_for(baseline, num_q_heads, opt.table, opt.decode_kernel)));
  CHECK_OK(ws.upload(plan, nullptr));
  CHECK_OK(ws_base.upload(baseline, nullptr));
  r.wide = opt.grid_launch ? tree_attention_graph_grid(ws, num_kv_heads, kHeadDim).wide
                           : tree_attention_runs_wide(ws, num_kv_heads, kHeadDim);
  CHECK_CUDA(cudaDeviceSynchronize());

  // Errors first (the timed runs below overwrite out with the same values).
  std::vector<float> gpu, gpu_base, ref;
  CHECK_OK(problem.launch_uploaded(ws_base, nullptr));
  CHECK_OK(problem.download_out(&gpu_base));
  CHECK_OK(problem.launch_uploaded(ws, nullptr));
  CHECK_OK(problem.download_out(&gpu));
  // CPU plan executor when it is cheap enough, else the naive reference on 8 queries.
  double work = 0;
  for (int32_t i = 0; i < plan.num_items(); ++i) {
    work += double(plan.item_num_tokens[i]) * (plan.item_query_end[i] - plan.item_query_begin[i]);
  }
  work *= double(num_q_heads) * kHeadDim * 4;
  std::vector<int32_t> sample;
  if (work < 4e9) {
    CHECK_OK(problem.reference_plan(plan, &ref));
  } else {
    r.sampled = true;
    for (int32_t k = 0; k < 8; ++k) sample.push_back(int32_t(int64_t(k) * r.queries / 8));
    sample.push_back(r.queries - 1);
    CHECK_OK(problem.reference_naive(sample, &ref));
  }
  r.max_err = problem.max_abs_diff(gpu, ref, sample);
  r.baseline_err = problem.max_abs_diff(gpu_base, ref, sample);

  // --grid: bucketed grids whose kernels read the plan header from the device, as the engine's
  // captured decode steps launch them.
  auto grid_for = [&](const TreeAttentionWorkspace& w) {
    return opt.grid_launch ? tree_attention_graph_grid(w, num_kv_heads, kHeadDim)
                           : TreeAttentionGrid{};
  };
  const TreeAttentionGrid grid = grid_for(ws), grid_base = grid_for(ws_base);
  // --graph: each launch captured once on the timer's stream and replayed from the graph.
  cudaStream_t stream = timer->stream();
  CHECK_CUDA(cudaDeviceSynchronize());  // the uploads and checks above went to the legacy stream
  auto timed = [&](const TreeAttentionWorkspace& w, TreeAttentionGrid g) {
    if (!opt.graph) {
      return timer->median_us(opt.reps, [&] { CHECK_OK(problem.launch_uploaded(w, stream, g)); });
    }
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    CHECK_OK(problem.launch_uploaded(w, stream, g));
    CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    const double us =
        timer->median_us(opt.reps, [&] { CHECK_CUDA(cudaGraphLaunch(exec, stream)); });
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
    return us;
  };
  r.median_us = timed(ws, grid);
  r.baseline_us = timed(ws_base, grid_base);
  if (!opt.trace_path.empty())
    write_trace(opt.trace_path, r, &ws, timer,
                [&] { CHECK_OK(problem.launch_uploaded(ws, stream, grid)); });
  r.bound_us = double(unique) / copy_bw * 1e6;
  r.tbps = double(unique) / (r.median_us * 1e-6) / 1e12;
  r.copy_fraction = double(unique) / (r.median_us * 1e-6) / copy_bw;
  r.speedup = r.baseline_us / r.median_us;
  return r;
}

void write_json(const std::string& path, const std::string& device, double copy_bw,
                const std::vector<Result>& results) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return;
  }
  std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"copy_bandwidth_tbps\": %.4f,\n  \"cases\": [\n",
               device.c_str(), copy_bw / 1e12);
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    std::fprintf(f,
                 "    {\"name\": \"%s\", \"family\": \"%s\", \"num_q_heads\": %d, "
                 "\"num_kv_heads\": %d, \"head_dim\": 128, \"dtype\": \"fp16\", \"queries\": %d, "
                 "\"items\": %d, \"baseline_items\": %d, \"unique_kv_mb\": %.3f, "
                 "\"plan_kv_mb\": %.3f, \"plan_build_us\": %.2f, \"median_us\": %.2f, "
                 "\"io_bound_us\": %.2f, \"unique_kv_tbps\": %.3f, \"copy_bw_fraction\": %.3f, "
                 "\"baseline_us\": %.2f, \"speedup\": %.2f, \"max_abs_err\": %.3g, "
                 "\"baseline_max_abs_err\": %.3g, \"wide_kernel\": %s, "
                 "\"error_reference\": \"%s\"}%s\n",
                 r.name.c_str(), r.family.c_str(), r.num_q_heads, r.num_kv_heads, r.queries,
                 r.items, r.baseline_items, r.unique_mb, r.plan_kv_mb, r.plan_build_us, r.median_us,
                 r.bound_us, r.tbps, r.copy_fraction, r.baseline_us, r.speedup, r.max_err,
                 r.baseline_err, r.wide ? "true" : "false",
                 r.sampled ? "naive fp64, 9 sampled queries" : "cpu plan executor fp32",
                 i + 1 < results.size() ? "," : "");
  }
  std::fprintf(f, "  ]\n}\n");
  std::fclose(f);
}

int main_impl(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--json") {
      opt.json_path = next();
    } else if (a == "--reps") {
      opt.reps = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--filter") {
      opt.filter = next();
    } else if (a == "--no-flush") {
      opt.flush_l2 = false;
    } else if (a == "--chunk") {
      opt.chunk = std::atoi(next().c_str());
    } else if (a == "--pack-max") {
      opt.pack_max = std::atoi(next().c_str());
    } else if (a == "--max-chunk") {
      opt.max_chunk = std::atoi(next().c_str());
    } else if (a == "--pair-margin") {
      opt.pair_margin = std::atoi(next().c_str());
    } else if (a == "--decode-chunk") {
      opt.decode_chunk = std::atoi(next().c_str());
    } else if (a == "--paired-kv-order") {
      opt.paired_kv_order = true;
    } else if (a == "--min-split") {
      opt.min_split = std::atoi(next().c_str());
    } else if (a == "--items-per-sm") {
      opt.items_per_sm = std::atof(next().c_str());
    } else if (a == "--no-balance-tiles") {
      opt.balance_tiles = false;
    } else if (a == "--depth-slots") {
      opt.depth_slots = true;
    } else if (a == "--fresh-pages") {
      opt.fresh_pages = true;
    } else if (a == "--no-pair") {
      opt.pair = false;
    } else if (a == "--pair-all") {
      opt.pair_all = true;
    } else if (a == "--plan-only") {
      opt.plan_only = true;
    } else if (a == "--no-tail") {
      opt.tail = TreeAttentionLimits::Tail::kOff;
    } else if (a == "--tail-always") {
      opt.tail = TreeAttentionLimits::Tail::kAlways;
    } else if (a == "--kv-heads") {
      opt.kv_heads = std::atoi(next().c_str());
      if (opt.kv_heads < 1 || opt.kv_heads > 32 || 32 % opt.kv_heads != 0) {
        std::fprintf(stderr, "--kv-heads takes a divisor of 32 (1-32)\n");
        return 2;
      }
    } else if (a == "--no-wide") {
      opt.wide = TreeAttentionLimits::Wide::kOff;
    } else if (a == "--wide-always") {
      opt.wide = TreeAttentionLimits::Wide::kAlways;
    } else if (a == "--no-decode-kernel") {
      opt.decode_kernel = false;
    } else if (a == "--no-token-table") {
      opt.table = "none";
    } else if (a == "--table") {
      opt.table = next();
      if (opt.table != "fixed" && opt.table != "packed" && opt.table != "none") {
        std::fprintf(stderr, "--table: fixed, packed or none, not %s\n", opt.table.c_str());
        return 2;
      }
    } else if (a == "--trace") {
      opt.trace_path = next();
    } else if (a == "--grid") {
      opt.grid_launch = true;
    } else if (a == "--graph") {
      opt.grid_launch = opt.graph = true;
    } else if (a == "--few-shot") {
      const std::string v = next();
      std::array<int32_t, 3> f{};
      if (std::sscanf(v.c_str(), "%d,%d,%d", &f[0], &f[1], &f[2]) != 3 || f[0] < 1 || f[1] < 1 ||
          f[2] < 0) {
        std::fprintf(stderr, "--few-shot: P,B,S (positive P and B, S >= 0), not %s\n", v.c_str());
        return 2;
      }
      opt.few_shot.push_back(f);
    } else if (a == "--speculative") {
      const std::string v = next();
      std::array<int32_t, 2> f{};
      if (std::sscanf(v.c_str(), "%d,%d", &f[0], &f[1]) != 2 || f[0] < 1 || f[1] < 2) {
        std::fprintf(stderr, "--speculative: P,T (a positive prompt, at least 2 queries), not %s\n",
                     v.c_str());
        return 2;
      }
      opt.speculative.push_back(f);
    } else if (a == "--order") {
      const std::string o = next();
      if (o == "kv") {
        opt.item_order = AttentionPlanConfig::ItemOrder::kKvMajor;
      } else if (o == "plan") {
        opt.item_order = AttentionPlanConfig::ItemOrder::kPlan;
      } else if (o == "longest") {
        opt.item_order = AttentionPlanConfig::ItemOrder::kLongestFirst;
      } else if (o == "mixed") {
        opt.item_order = AttentionPlanConfig::ItemOrder::kKvMixed;
      } else if (o == "interleaved") {
        opt.item_order = AttentionPlanConfig::ItemOrder::kInterleaved;
      } else {
        std::fprintf(stderr, "--order: kv, mixed, plan, longest or interleaved, not %s\n",
                     o.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--json PATH] [--reps N] [--filter SUBSTR] [--no-flush] "
                   "[--chunk TOKENS] [--max-chunk TOKENS] [--pack-max TOKENS] [--pair-margin N] "
                   "[--decode-chunk TOKENS] "
                   "[--paired-kv-order] "
                   "[--min-split TOKENS] "
                   "[--items-per-sm X] "
                   "[--order kv|mixed|plan|longest|interleaved] [--table fixed|packed|none] "
                   "[--grid] [--graph] [--no-decode-kernel] [--depth-slots] [--fresh-pages] "
                   "[--no-balance-tiles] "
                   "[--few-shot P,B,S] [--speculative P,T] [--trace PATH] [--no-pair] [--pair-all] "
                   "[--plan-only] "
                   "[--no-tail | --tail-always] [--no-wide | --wide-always] [--kv-heads N]\n",
                   argv[0]);
      return 2;
    }
  }
  std::vector<Case> cases;
  for (const auto& [prompt, branches, tokens] : opt.few_shot) {
    cases.push_back({"few-shot P=" + std::to_string(prompt) + " + " + std::to_string(branches) +
                         "x" + std::to_string(tokens),
                     "custom", testing::few_shot_case(prompt, branches, tokens, 16, 4)});
  }
  for (const auto& [prompt, queries] : opt.speculative) {
    cases.push_back(
        {"speculative t=" + std::to_string(queries) + " over " + std::to_string(prompt), "custom",
         testing::speculative_case(prompt, testing::medusa_like_paths(queries - 1), 16, 10)});
  }
  if (cases.empty()) cases = make_cases();
  if (opt.depth_slots) {
    for (Case& c : cases) testing::place_runs_at_depth_slots(&c.tree, 7);
  }
  if (opt.fresh_pages) {
    for (Case& c : cases) testing::place_pages_as_fresh_pool(&c.tree);
  }
  auto selected = [&](const Case& c) {
    return opt.filter.empty() || c.name.find(opt.filter) != std::string::npos;
  };
  std::vector<std::pair<int32_t, int32_t>> head_shapes = {{32, 8}, {32, 32}};
  if (opt.kv_heads > 0) head_shapes = {{32, opt.kv_heads}};
  if (opt.plan_only) {
    std::printf("plans for 132 SMs (an H100), head pairing %s\n\n",
                !opt.pair ? "off" : (opt.pair_all ? "offered at every GQA" : "on"));
    std::printf("%-34s %5s %5s %6s %6s %7s %7s %8s %8s %7s %s\n", "case", "heads", "q", "items",
                "chunk", "dchunk", "paired", "uniqMB", "planMB", "plan_us", "kernels");
    for (const Case& c : cases) {
      if (!selected(c)) continue;
      for (const auto& [q_heads, kv_heads] : head_shapes) {
        const Result r = run_case(c, q_heads, kv_heads, 132, 0, opt, nullptr);
        std::printf("%-34s %2d/%-2d %5d %6d %6d %7d %7d %8.2f %8.2f %7.1f %s\n", r.name.c_str(),
                    r.num_q_heads, r.num_kv_heads, r.queries, r.items, r.chunk, r.decode_chunk,
                    r.paired_items, r.unique_mb, r.plan_kv_mb, r.plan_build_us, r.kernels);
      }
    }
    return 0;
  }
  if (!testing::cuda_device_available()) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const double copy_bw = copy_bandwidth(10);
  std::printf("device: %s, %d SMs, L2 %.0f MB; d2d copy bandwidth %.3f TB/s (read + write)\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, copy_bw / 1e12);
  std::printf(
      "fp16, head_dim 128, one layer, page 16, L2 %s before each rep, median of %d; decode "
      "kernel %s, run slots %s, pages %s; launches %s; tail kernel %s; wide kernel %s\n\n",
      opt.flush_l2 ? "flushed" : "NOT flushed", opt.reps, opt.decode_kernel ? "on" : "off",
      opt.depth_slots ? "at depth % page" : "random",
      opt.fresh_pages ? "as a fresh pool hands them out" : "shuffled",
      opt.graph ? "replayed from CUDA graphs (--graph)"
                : (opt.grid_launch ? "eager, bucketed grids (--grid)" : "eager"),
      opt.tail == TreeAttentionLimits::Tail::kOff
          ? "off (--no-tail)"
          : (opt.tail == TreeAttentionLimits::Tail::kAuto ? "where it pays"
                                                          : "always (--tail-always)"),
      opt.wide == TreeAttentionLimits::Wide::kOff
          ? "off (--no-wide)"
          : (opt.wide == TreeAttentionLimits::Wide::kAuto ? "where it pays"
                                                          : "wherever the plan pairs tiles "
                                                            "(--wide-always)"));
  std::printf("%-34s %5s %5s %6s %8s %8s %7s %8s %8s %6s %5s %9s %7s %9s %9s %6s %6s\n", "case",
              "heads", "q", "items", "uniqMB", "planMB", "plan_us", "us", "bound", "TB/s", "%cp",
              "base_us", "speedup", "max_err", "base_err", "chunk", "paired");
  cudaStream_t stream = nullptr;  // --graph: a stream of its own (the legacy one cannot capture)
  if (opt.graph) CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Timer timer(opt.flush_l2, stream);
  std::vector<Result> results;
  for (const Case& c : cases) {
    if (!selected(c)) continue;
    for (const auto& [q_heads, kv_heads] : head_shapes) {
      const Result r =
          run_case(c, q_heads, kv_heads, prop.multiProcessorCount, copy_bw, opt, &timer);
      std::printf(
          "%-34s %2d/%-2d %5d %6d %8.2f %8.2f %7.1f %8.2f %8.2f %6.2f %5.0f %9.2f %7.2f %9.2e "
          "%9.2e %6d %6d%s%s\n",
          r.name.c_str(), r.num_q_heads, r.num_kv_heads, r.queries, r.items, r.unique_mb,
          r.plan_kv_mb, r.plan_build_us, r.median_us, r.bound_us, r.tbps, 100 * r.copy_fraction,
          r.baseline_us, r.speedup, r.max_err, r.baseline_err, r.chunk, r.paired_items,
          r.sampled ? " (s)" : "", r.wide ? " (w)" : "");
      std::fflush(stdout);
      results.push_back(r);
    }
  }
  std::printf(
      "\n(s): error vs the naive fp64 reference on 9 sampled queries; else vs the CPU "
      "plan executor (fp32) on all queries. bound = unique KV bytes / copy bandwidth;\n"
      "planMB = KV bytes the plan's items read (shared runs read once per query tile);\n"
      "(w): the wide kernel ran the plan's pairs of query tiles "
      "(TreeAttentionLimits::wide_kernel).\n");
  if (!opt.json_path.empty()) write_json(opt.json_path, prop.name, copy_bw, results);
  if (stream != nullptr) CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace
}  // namespace treeserve

int main(int argc, char** argv) { return treeserve::main_impl(argc, argv); }
