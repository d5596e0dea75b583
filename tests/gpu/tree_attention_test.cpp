// GPU tests of the tree-attention kernels (ctest label `gpu`): the CUDA kernels against the
// CPU plan executor on the same plan and the same dtype-rounded inputs, over random trees
// (depth 1-10, width 1-256, runs of 1-8000 tokens, head_dim 64/128, GQA 1/4/8/16, page sizes
// 1/16/64, causal prefill chunks and speculative token trees, so masked items), the
// benchmark workload shapes with Llama-3-8B heads, the prefix-unaware baseline plan against
// the naive reference, CUDA-graph replay of a fixed-grid launch, head pairing and the tail
// kernel, and the launcher's checks. An e4m3 pool (TreeAttentionKvScales) gives exactly what a
// dtype pool holding its dequantized values gives, through stage 1 (wgmma, split and paired
// paths, resolved tokens), the decode kernel and graph grids.
// Without a CUDA device every test is skipped with a message (never a silent pass).
#include "kernels/tree_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention_plan.h"
#include "kernels/detail/tree_attention_launch.h"
#include "kernels/testing/gpu_attention_harness.h"
#include "kernels/testing/random_tree.h"
#include "models/fp8.h"

namespace treeserve {
namespace {

using testing::GpuAttentionProblem;
using testing::TreeCase;

#define SKIP_WITHOUT_GPU()                                                                     \
  do {                                                                                         \
    if (!testing::cuda_device_available()) GTEST_SKIP() << "no CUDA device: GPU test skipped"; \
  } while (0)

constexpr float kFp16Tolerance = 2e-3f;
constexpr float kBf16Tolerance = 1e-2f;  // bf16 keeps 8 mantissa bits: output rounding alone
                                         // is up to 2^-9 of |o|

struct Shape {
  int32_t num_kv_heads = 1;
  int32_t gqa = 1;
  int32_t head_dim = 128;
  TreeAttentionDtype dtype = TreeAttentionDtype::kFloat16;
};

std::string describe(const Shape& s) {
  return "kv_heads=" + std::to_string(s.num_kv_heads) + " gqa=" + std::to_string(s.gqa) +
         " head_dim=" + std::to_string(s.head_dim) +
         (s.dtype == TreeAttentionDtype::kFloat16 ? " fp16" : " bf16");
}

// Runs the plan on the GPU (eagerly, or in `grid` after an upload) and on the CPU executor;
// returns the max abs error (and checks rows no query names are untouched).
float gpu_vs_cpu(const TreeCase& tree, const Shape& shape, const AttentionPlan& plan,
                 TreeAttentionWorkspace* ws, uint64_t seed, TreeAttentionGrid grid = {}) {
  GpuAttentionProblem problem;
  Status s = problem.init(tree, shape.num_kv_heads * shape.gqa, shape.num_kv_heads, shape.head_dim,
                          shape.dtype, seed, 2.f);
  EXPECT_TRUE(s.ok()) << s.ToString();
  if (grid.items > 0) {
    s = ws->upload(plan, nullptr);
    EXPECT_TRUE(s.ok()) << s.ToString();
    s = problem.launch_uploaded(*ws, nullptr, grid);
  } else {
    s = problem.launch(plan, ws, nullptr);
  }
  EXPECT_TRUE(s.ok()) << s.ToString();
  std::vector<float> gpu, cpu;
  s = problem.download_out(&gpu);
  EXPECT_TRUE(s.ok()) << s.ToString();
  if (!s.ok()) return INFINITY;
  s = problem.reference_plan(plan, &cpu);
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(problem.untouched_rows_kept(gpu)) << "kernel wrote rows no query names";
  return problem.max_abs_diff(gpu, cpu);
}

// Builds the plan and runs it as gpu_vs_cpu does.
float gpu_vs_cpu_plan(const TreeCase& tree, const Shape& shape, const AttentionPlanConfig& config,
                      TreeAttentionWorkspace* ws, uint64_t seed) {
  AttentionPlan plan;
  const Status s = build_attention_plan(tree.view, config, &plan);
  EXPECT_TRUE(s.ok()) << s.ToString();
  if (!s.ok()) return INFINITY;
  return gpu_vs_cpu(tree, shape, plan, ws, seed);
}

AttentionPlanConfig config_for(const Shape& shape) {
  return tree_attention_plan_config(shape.num_kv_heads * shape.gqa, shape.num_kv_heads,
                                    shape.head_dim);
}

// A bucketed stage 1 grid for plan (as the engine's graphs launch it), pairing or running the
// tail kernel as asked.
TreeAttentionGrid bucket_grid(const AttentionPlan& plan, bool paired, bool tail = false) {
  return TreeAttentionGrid{tree_attention_grid_bucket(plan.num_items()),
                           tree_attention_grid_bucket(plan.num_queries()), false, paired, tail};
}

// A tail grid whose stage 1 grid covers only the items stage 1 runs
// (TreeAttentionGrid::wide_items), as the engine's graphs launch it: the plan's wide items, or
// every item where it pairs none or the workspace has no token table.
TreeAttentionGrid wide_tail_grid(const AttentionPlan& plan, bool with_table) {
  TreeAttentionGrid grid = bucket_grid(plan, false, true);
  const int32_t run =
      plan.paired_items_begin >= 0 && with_table ? plan.paired_items_begin : plan.num_items();
  grid.wide_items = tree_attention_wide_bucket(run);
  return grid;
}

TreeAttentionWorkspace& shared_workspace() {
  static TreeAttentionWorkspace ws;
  if (!ws.initialized()) {
    const Status s = ws.init(TreeAttentionLimits{});
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return ws;
}

// A workspace whose token table holds only small plans (max_table_tokens = 0: none), so
// stage 1 resolves the other plans' tokens itself.
TreeAttentionWorkspace& small_table_workspace(int32_t max_table_tokens) {
  static TreeAttentionWorkspace ws[2];
  TreeAttentionWorkspace& w = ws[max_table_tokens == 0 ? 0 : 1];
  if (!w.initialized()) {
    TreeAttentionLimits limits;
    limits.max_table_tokens = max_table_tokens;
    const Status s = w.init(limits);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  EXPECT_EQ(w.limits().max_table_tokens, max_table_tokens);
  return w;
}

testing::RandomTreeOptions random_options(uint64_t seed) {
  testing::RandomTreeOptions o;
  o.depth = 1 + int32_t(seed % 10);
  o.max_width = std::vector<int32_t>{1, 3, 8, 32, 256}[seed % 5];
  o.max_runs = 160;
  o.max_run_tokens = std::vector<int32_t>{8, 64, 400}[(seed / 5) % 3];
  o.page_size = std::vector<int32_t>{1, 16, 64}[seed % 3];
  o.prefill_prob = 0.2;
  o.speculative_prob = 0.3;
  o.internal_query_prob = 0.15;
  o.dead_leaf_prob = 0.05;
  return o;
}

TEST(TreeAttentionGpu, RandomTreesMatchPlanExecutorFp16) {
  SKIP_WITHOUT_GPU();
  int fitted = 0, spilled = 0, fixed_stride = 0;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    const TreeCase tree = testing::random_tree_case(seed * 104729, random_options(seed));
    Shape shape;
    shape.gqa = std::vector<int32_t>{1, 4, 8, 16}[seed % 4];
    shape.num_kv_heads = seed % 3 == 0 ? 2 : 1;
    shape.head_dim = (seed / 2) % 2 ? 64 : 128;
    AttentionPlanConfig config = config_for(shape);
    config.kv_chunk_tokens = std::vector<int32_t>{512, 128, 1024}[seed % 3];
    config.greedy_grouping = seed % 7 != 0;
    config.pack_subtrees = seed % 11 != 0;
    // Token table (default), none, or one that only small plans fit.
    TreeAttentionWorkspace* ws = seed % 3 == 0   ? &shared_workspace()
                                 : seed % 3 == 1 ? &small_table_workspace(0)
                                                 : &small_table_workspace(3000);
    const float err = gpu_vs_cpu_plan(tree, shape, config, ws, seed);
    EXPECT_LE(err, kFp16Tolerance) << "seed " << seed << " " << describe(shape);
    if (seed % 3 == 1) {
      EXPECT_FALSE(ws->uses_token_table());
    }
    if (seed % 3 == 0) {
      EXPECT_TRUE(ws->uses_token_table()) << "seed " << seed;
      fixed_stride += ws->uses_fixed_table_stride();
    }
    fitted += seed % 3 == 2 && ws->uses_token_table();
    spilled += seed % 3 == 2 && !ws->uses_token_table();
  }
  // The small table both held some plans (packed) and turned some away; the default one held
  // plans at its fixed stride.
  EXPECT_GT(fitted, 0);
  EXPECT_GT(spilled, 0);
  EXPECT_GT(fixed_stride, 0);
}

TEST(TreeAttentionGpu, RandomTreesMatchPlanExecutorBf16) {
  SKIP_WITHOUT_GPU();
  for (uint64_t seed = 101; seed <= 112; ++seed) {
    const TreeCase tree = testing::random_tree_case(seed * 7919, random_options(seed));
    Shape shape;
    shape.gqa = std::vector<int32_t>{1, 4, 8, 16}[seed % 4];
    shape.head_dim = seed % 2 ? 64 : 128;
    shape.dtype = TreeAttentionDtype::kBFloat16;
    const float err = gpu_vs_cpu_plan(tree, shape, config_for(shape), &shared_workspace(), seed);
    EXPECT_LE(err, kBf16Tolerance) << "seed " << seed << " " << describe(shape);
  }
}

TEST(TreeAttentionGpu, LongRunsAndWideTrees) {
  SKIP_WITHOUT_GPU();
  struct Case {
    std::string name;
    testing::RandomTreeOptions options;
    Shape shape;
  };
  std::vector<Case> cases;
  {  // deep chains of long runs (up to 8000 tokens), few queries
    testing::RandomTreeOptions o;
    o.depth = 10;
    o.max_width = 2;
    o.max_runs = 14;
    o.min_run_tokens = 1;
    o.max_run_tokens = 8000;
    o.page_size = 16;
    o.prefill_prob = 0.3;
    cases.push_back({"deep long runs", o, Shape{1, 4, 128}});
    o.page_size = 64;
    cases.push_back({"deep long runs hd64 gqa16", o, Shape{1, 16, 64}});
  }
  {  // 256 leaves under an 8000-token root
    testing::RandomTreeOptions o;
    o.depth = 2;
    o.max_width = 256;
    o.max_runs = 257;
    o.root_tokens = 8000;
    o.max_run_tokens = 40;
    o.page_size = 1;
    o.speculative_prob = 0.1;
    cases.push_back({"8000 root x 256 leaves gqa1", o, Shape{2, 1, 128}});
    o.page_size = 16;
    cases.push_back({"8000 root x 256 leaves gqa8", o, Shape{1, 8, 64}});
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    const TreeCase tree = testing::random_tree_case(31 + i, cases[i].options);
    const float err = gpu_vs_cpu_plan(tree, cases[i].shape, config_for(cases[i].shape),
                                      &shared_workspace(), 500 + i);
    EXPECT_LE(err, kFp16Tolerance) << cases[i].name << " " << describe(cases[i].shape);
  }
}

TEST(TreeAttentionGpu, WorkloadShapesWithLlamaHeads) {
  SKIP_WITHOUT_GPU();
  struct Case {
    std::string name;
    TreeCase tree;
  };
  std::vector<Case> cases;
  cases.push_back({"few-shot 4000+20x200", testing::few_shot_case(4000, 20, 200, 16, 1)});
  cases.push_back({"fasttree 1,4,16", testing::fasttree_case({1, 4, 16}, {1024, 256, 64}, 16, 2)});
  cases.push_back({"speculative 64 over 4000",
                   testing::speculative_case(4000, testing::medusa_like_paths(63), 16, 3)});
  for (const Case& c : cases) {
    for (int32_t kv_heads : {8, 32}) {  // Llama-3-8B (GQA 4) and GQA 1
      const Shape shape{kv_heads, 32 / kv_heads, 128};
      const float err = gpu_vs_cpu_plan(c.tree, shape, config_for(shape), &shared_workspace(), 9);
      EXPECT_LE(err, kFp16Tolerance) << c.name << " " << describe(shape);
    }
  }
}

// The stage 1 block trace (bench_tree_attention --trace): off until enabled; then one record
// per (item, kv head) block of a launch, on a real SM, with the item's shape; downloading
// clears it; and the traced launch still matches the CPU executor.
TEST(TreeAttentionGpu, BlockTraceRecordsEveryBlockOnce) {
  SKIP_WITHOUT_GPU();
  const TreeCase tree = testing::few_shot_case(1000, 6, 100, 16, 4);
  const Shape shape{8, 4, 128};
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(tree.view, config_for(shape), &plan).ok());
  TreeAttentionWorkspace ws;
  ASSERT_TRUE(ws.init(testing::workspace_limits_for({plan}, 32, 128)).ok());
  std::vector<TreeAttentionBlockTrace> trace;
  EXPECT_EQ(ws.download_block_trace(&trace).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(ws.enable_block_trace().ok());
  // The same config builds the same plan (deterministic), so the trace's items are plan's.
  EXPECT_LE(gpu_vs_cpu_plan(tree, shape, config_for(shape), &ws, 5), kFp16Tolerance);
  ASSERT_TRUE(ws.download_block_trace(&trace).ok());
  ASSERT_EQ(trace.size(), size_t(plan.num_items()) * size_t(shape.num_kv_heads));
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  std::set<std::pair<int32_t, int32_t>> seen;
  for (const TreeAttentionBlockTrace& r : trace) {
    ASSERT_GE(r.item, 0);
    ASSERT_LT(r.item, plan.num_items());
    EXPECT_TRUE(seen.insert({r.item, r.kv_head}).second) << "item " << r.item;
    EXPECT_GE(r.kv_head, 0);
    EXPECT_LT(r.kv_head, shape.num_kv_heads);
    EXPECT_LE(r.start_ns, r.end_ns);
    EXPECT_GE(r.sm, 0);
    EXPECT_LT(r.sm, sms);
    const size_t i = size_t(r.item);
    EXPECT_EQ(r.rows, (plan.item_query_end[i] - plan.item_query_begin[i]) * shape.gqa);
    EXPECT_EQ(r.tokens, plan.item_num_tokens[i]);
  }
  ASSERT_TRUE(ws.download_block_trace(&trace).ok());
  EXPECT_TRUE(trace.empty());

  // Head pairing: a paired item's block records once, at its first kv head of each group.
  pair_decode_items(&plan, kTreeAttentionPairHeads);
  const int32_t wide = plan.paired_items_begin, paired = plan.num_items() - wide;
  ASSERT_EQ(paired, 6) << "the six branches";
  EXPECT_LE(gpu_vs_cpu(tree, shape, plan, &ws, 5), kFp16Tolerance);
  EXPECT_EQ(ws.paired_items_begin(), wide);
  ASSERT_TRUE(ws.download_block_trace(&trace).ok());
  ASSERT_EQ(trace.size(), size_t(wide * shape.num_kv_heads +
                                 paired * shape.num_kv_heads / kTreeAttentionPairHeads));
  seen.clear();
  for (const TreeAttentionBlockTrace& r : trace) {
    EXPECT_TRUE(seen.insert({r.item, r.kv_head}).second) << "item " << r.item;
    if (r.item >= wide) {
      EXPECT_EQ(r.kv_head % kTreeAttentionPairHeads, 0) << "item " << r.item;
    }
    EXPECT_EQ(r.tokens, plan.item_num_tokens[size_t(r.item)]);
  }
}

// The plan of tree at shape, with a KV chunk picked by seed and every decode-shaped item
// paired (pair_decode_items), as the head-pairing and tail-kernel tests run random trees.
AttentionPlan paired_plan_for(const TreeCase& tree, const Shape& shape, uint64_t seed) {
  AttentionPlanConfig config = config_for(shape);
  config.kv_chunk_tokens = std::vector<int32_t>{512, 128, 1024}[seed % 3];
  AttentionPlan plan;
  EXPECT_TRUE(build_attention_plan(tree.view, config, &plan).ok());
  pair_decode_items(&plan, kTreeAttentionPairHeads);
  EXPECT_TRUE(validate_attention_plan(plan).ok());
  return plan;
}

float tolerance(const Shape& shape) {
  return shape.dtype == TreeAttentionDtype::kFloat16 ? kFp16Tolerance : kBf16Tolerance;
}

// Head pairing (AttentionPlanConfig::pair_heads): decode-shaped items run 4 kv heads a block.
// Random trees (masks from speculative query trees, packs, internal queries) with every plan's
// decode-shaped items paired, at GQA 1, 4 and 8, 4 or 8 kv heads, both head dims and dtypes;
// few-shot b=50 at Llama-3-8B heads, which the builder pairs itself; grids (as the engine's
// graphs launch): one without TreeAttentionGrid::paired runs a paired plan one kv head a block,
// a paired one runs paired plans paired and unpaired plans as they are.
TEST(TreeAttentionGpu, PairedDecodeItemsMatchPlanExecutor) {
  SKIP_WITHOUT_GPU();
  int paired_plans = 0;
  for (uint64_t seed = 201; seed <= 224; ++seed) {
    const TreeCase tree = testing::random_tree_case(seed * 6151, random_options(seed));
    Shape shape;
    shape.gqa = std::vector<int32_t>{1, 4, 8}[seed % 3];
    shape.num_kv_heads = shape.gqa == 8 || seed % 4 < 2 ? 4 : 8;  // at most 32 q heads
    shape.head_dim = (seed / 3) % 2 ? 64 : 128;
    shape.dtype = seed % 5 == 0 ? TreeAttentionDtype::kBFloat16 : TreeAttentionDtype::kFloat16;
    const AttentionPlan plan = paired_plan_for(tree, shape, seed);
    paired_plans += plan.paired_items_begin < plan.num_items();
    TreeAttentionWorkspace* ws = seed % 2 ? &shared_workspace() : &small_table_workspace(0);
    // Every third plan in a paired grid (blocks read where the paired items begin), every
    // third in the grid the engine's graphs would capture it with (tree_attention_graph_grid:
    // stage 1 sized by the items before the paired ones and the paired ones).
    TreeAttentionGrid grid = seed % 3 == 2 ? bucket_grid(plan, true) : TreeAttentionGrid{};
    if (seed % 3 == 1) {
      ASSERT_TRUE(ws->upload(plan, nullptr).ok());
      grid = tree_attention_graph_grid(*ws, shape.num_kv_heads, shape.head_dim);
    }
    EXPECT_LE(gpu_vs_cpu(tree, shape, plan, ws, seed, grid), tolerance(shape))
        << "seed " << seed << " " << describe(shape);
  }
  EXPECT_GT(paired_plans, 12);

  const TreeCase b50 = testing::few_shot_case(4000, 50, 200, 16, 3);
  const Shape llama{8, 4, 128};
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(b50.view, config_for(llama), &plan).ok());
  ASSERT_EQ(plan.pair_heads, kTreeAttentionPairHeads);
  ASSERT_EQ(plan.num_items() - plan.paired_items_begin, 50);
  EXPECT_LE(gpu_vs_cpu(b50, llama, plan, &shared_workspace(), 11), kFp16Tolerance);
  EXPECT_EQ(shared_workspace().paired_items_begin(), plan.paired_items_begin);
  const TreeAttentionGrid grid{tree_attention_grid_bucket(plan.num_items()),
                               tree_attention_grid_bucket(plan.num_queries()), false};
  EXPECT_LE(gpu_vs_cpu(b50, llama, plan, &shared_workspace(), 12, grid), kFp16Tolerance);
  // A paired grid (as the engine's graphs capture it) pairs the same plan, runs an unpaired
  // plan one kv head a block, and a baseline plan (head-major, every item decode-shaped)
  // with every item paired.
  TreeAttentionGrid paired_grid = grid;
  paired_grid.paired = true;
  EXPECT_LE(gpu_vs_cpu(b50, llama, plan, &shared_workspace(), 13, paired_grid), kFp16Tolerance);
  AttentionPlanConfig off = config_for(llama);
  off.pair_heads = 0;
  AttentionPlan unpaired;
  ASSERT_TRUE(build_attention_plan(b50.view, off, &unpaired).ok());
  EXPECT_LE(gpu_vs_cpu(b50, llama, unpaired, &shared_workspace(), 14, paired_grid), kFp16Tolerance);
  EXPECT_EQ(shared_workspace().paired_items_begin(), -1);
  AttentionPlan baseline;
  ASSERT_TRUE(build_baseline_plan(b50.view, config_for(llama), &baseline).ok());
  ASSERT_FALSE(baseline.heads_first);
  pair_decode_items(&baseline, kTreeAttentionPairHeads);
  ASSERT_EQ(baseline.paired_items_begin, 0);
  EXPECT_LE(gpu_vs_cpu(b50, llama, baseline, &shared_workspace(), 15, bucket_grid(baseline, true)),
            kFp16Tolerance);

  // The graph grid of the paired upload sizes stage 1 by the items before the paired ones and
  // the paired ones (TreeAttentionGrid::paired_items: 24 x 8 + 56 x 2 blocks for 20 + 50 items,
  // against 72 x 8): it runs the plan; it is refused, before any launch, for the unpaired twin
  // (70 x 8 blocks), where it does not cover the plan, and with paired_items outside a paired
  // grid or not a multiple of 4.
  TreeAttentionWorkspace& ws = shared_workspace();
  ASSERT_TRUE(ws.upload(plan, nullptr).ok());
  const TreeAttentionGrid sized = tree_attention_graph_grid(ws, llama.num_kv_heads, 128);
  EXPECT_TRUE(sized.paired && !sized.tail && !sized.wide && !sized.decode_kernel);
  EXPECT_EQ(sized.wide_items, tree_attention_wide_bucket(plan.paired_items_begin));
  EXPECT_EQ(sized.paired_items, tree_attention_wide_bucket(50));
  EXPECT_LE(gpu_vs_cpu(b50, llama, plan, &ws, 16, sized), kFp16Tolerance);
  testing::GpuAttentionProblem problem;
  ASSERT_TRUE(problem
                  .init(b50, llama.num_kv_heads * llama.gqa, llama.num_kv_heads, llama.head_dim,
                        TreeAttentionDtype::kFloat16, 17)
                  .ok());
  ASSERT_TRUE(ws.upload(unpaired, nullptr).ok());
  Status refused = problem.launch_uploaded(ws, nullptr, sized);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  EXPECT_NE(refused.message().find("paired_items"), std::string::npos) << refused.ToString();
  ASSERT_TRUE(ws.upload(plan, nullptr).ok());
  for (const int32_t paired_items : {8, 58}) {
    TreeAttentionGrid bad = sized;
    bad.paired_items = paired_items;
    refused = problem.launch_uploaded(ws, nullptr, bad);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << paired_items;
  }
  TreeAttentionGrid bad = sized;
  bad.paired = false;
  EXPECT_EQ(problem.launch_uploaded(ws, nullptr, bad).code(), StatusCode::kInvalidArgument);
  bad = sized;
  bad.paired_items = -4;
  EXPECT_EQ(problem.launch_uploaded(ws, nullptr, bad).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(problem.launch_uploaded(ws, nullptr, sized).ok());
}

// Workspaces whose eager launches always run paired items in the tail kernel
// (TreeAttentionLimits::Tail::kAlways): with the default token table, or without one (then
// stage 1 runs them as before: the tail kernel reads the table).
TreeAttentionWorkspace& tail_workspace(bool with_table) {
  static TreeAttentionWorkspace ws[2];
  TreeAttentionWorkspace& w = ws[with_table ? 0 : 1];
  if (!w.initialized()) {
    TreeAttentionLimits limits;
    limits.tail_kernel = TreeAttentionLimits::Tail::kAlways;
    limits.wide_kernel = TreeAttentionLimits::Wide::kOff;  // WideKernelMatchesPlanExecutor's
    if (!with_table) limits.max_table_tokens = 0;
    const Status s = w.init(limits);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return w;
}

// The tail kernel: a plan's paired items in a kernel of their own beside stage 1, one warp per
// (item, kv head), 8 rows a pass. Random trees with every plan's decode-shaped items paired
// (masks from speculative query trees, packs, internal queries; GQA 1, 4, 8 and 16, so items of
// 1-32 rows and up to 4 passes; page sizes 1, 16 and 64; both head dims and dtypes; fixed-stride
// and packed tables, and no table); then few-shot b=50 at Llama-3-8B heads traced: one record
// per (wide item, kv head) and per (paired item, kv head), so the tail kernel ran every paired
// item's heads.
TEST(TreeAttentionGpu, TailKernelMatchesPlanExecutor) {
  SKIP_WITHOUT_GPU();
  int tail_plans = 0;
  for (uint64_t seed = 301; seed <= 328; ++seed) {
    const TreeCase tree = testing::random_tree_case(seed * 7333, random_options(seed));
    Shape shape;
    shape.gqa = std::vector<int32_t>{1, 4, 8, 16}[seed % 4];
    shape.num_kv_heads = shape.gqa == 16 ? 2 : (shape.gqa == 8 || seed % 3 == 0 ? 4 : 8);
    shape.head_dim = (seed / 4) % 2 ? 64 : 128;
    shape.dtype = seed % 5 == 0 ? TreeAttentionDtype::kBFloat16 : TreeAttentionDtype::kFloat16;
    const AttentionPlan plan = paired_plan_for(tree, shape, seed);
    tail_plans += plan.paired_items_begin >= 1 && plan.paired_items_begin < plan.num_items();
    // Every third plan in a tail grid (TreeAttentionGrid::tail: where the paired items begin
    // read from the header, as the engine's graphs launch it), half of them with stage 1's
    // grid over the items it runs only (wide_items).
    const bool table = seed % 7 != 0;
    const TreeAttentionGrid grid =
        seed % 3 != 1 ? TreeAttentionGrid{}
                      : (seed % 2 ? wide_tail_grid(plan, table) : bucket_grid(plan, false, true));
    EXPECT_LE(gpu_vs_cpu(tree, shape, plan, &tail_workspace(table), seed, grid), tolerance(shape))
        << "seed " << seed << " " << describe(shape);
  }
  EXPECT_GT(tail_plans, 12);

  const TreeCase b50 = testing::few_shot_case(4000, 50, 200, 16, 3);
  const Shape llama{8, 4, 128};
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(b50.view, config_for(llama), &plan).ok());
  const int32_t wide = plan.paired_items_begin, paired = plan.num_items() - wide;
  ASSERT_EQ(paired, 50);
  TreeAttentionWorkspace& ws = tail_workspace(true);
  if (ws.block_trace() == nullptr) {
    ASSERT_TRUE(ws.enable_block_trace().ok());
  }
  EXPECT_LE(gpu_vs_cpu(b50, llama, plan, &ws, 16), kFp16Tolerance);
  std::vector<TreeAttentionBlockTrace> trace;
  ASSERT_TRUE(ws.download_block_trace(&trace).ok());
  ASSERT_EQ(trace.size(), size_t(plan.num_items()) * size_t(llama.num_kv_heads));
  std::set<std::pair<int32_t, int32_t>> seen;
  for (const TreeAttentionBlockTrace& r : trace) {
    EXPECT_TRUE(seen.insert({r.item, r.kv_head}).second) << "item " << r.item;
    EXPECT_EQ(r.tokens, plan.item_num_tokens[size_t(r.item)]);
    EXPECT_EQ(
        r.rows,
        (plan.item_query_end[size_t(r.item)] - plan.item_query_begin[size_t(r.item)]) * llama.gqa);
  }
  EXPECT_EQ(seen.size(), size_t(wide + paired) * size_t(llama.num_kv_heads));

  // Tail grids run any plan: this one, its unpaired twin (stage 1 runs every item), the
  // baseline's plan with every item paired (the tail kernel runs every item, waiting for the
  // previous kernel itself), and this plan where the workspace has no token table (stage 1).
  const TreeAttentionGrid tail_grid = bucket_grid(plan, false, true);
  EXPECT_LE(gpu_vs_cpu(b50, llama, plan, &ws, 17, tail_grid), kFp16Tolerance);
  ASSERT_TRUE(ws.download_block_trace(&trace).ok());
  EXPECT_EQ(trace.size(), size_t(plan.num_items()) * size_t(llama.num_kv_heads));
  // Stage 1's grid over the wide items only (its padding blocks exit first): every (item, kv
  // head) traced once again. One that does not cover them, or is negative or larger than the
  // grid's items, is refused before any launch.
  const TreeAttentionGrid wide_grid = wide_tail_grid(plan, true);
  ASSERT_LT(wide_grid.wide_items, wide_grid.items);
  EXPECT_LE(gpu_vs_cpu(b50, llama, plan, &ws, 21, wide_grid), kFp16Tolerance);
  ASSERT_TRUE(ws.download_block_trace(&trace).ok());
  seen.clear();
  for (const TreeAttentionBlockTrace& r : trace) seen.insert({r.item, r.kv_head});
  EXPECT_EQ(trace.size(), size_t(plan.num_items()) * size_t(llama.num_kv_heads));
  EXPECT_EQ(seen.size(), trace.size());
  {
    testing::GpuAttentionProblem problem;
    ASSERT_TRUE(problem
                    .init(b50, llama.num_kv_heads * llama.gqa, llama.num_kv_heads, llama.head_dim,
                          TreeAttentionDtype::kFloat16, 22)
                    .ok());
    TreeAttentionGrid short_grid = wide_grid;
    short_grid.wide_items = wide - 1;
    const Status refused = problem.launch_uploaded(ws, nullptr, short_grid);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
    EXPECT_NE(refused.message().find("wide_items"), std::string::npos) << refused.ToString();
    short_grid.wide_items = -8;
    EXPECT_EQ(problem.launch_uploaded(ws, nullptr, short_grid).code(),
              StatusCode::kInvalidArgument);
    short_grid.wide_items = wide_grid.items + 8;
    EXPECT_EQ(problem.launch_uploaded(ws, nullptr, short_grid).code(),
              StatusCode::kInvalidArgument);
    ASSERT_TRUE(ws.download_block_trace(&trace).ok());
    EXPECT_TRUE(trace.empty());
  }
  AttentionPlanConfig off = config_for(llama);
  off.pair_heads = 0;
  AttentionPlan unpaired;
  ASSERT_TRUE(build_attention_plan(b50.view, off, &unpaired).ok());
  EXPECT_LE(gpu_vs_cpu(b50, llama, unpaired, &ws, 18, tail_grid), kFp16Tolerance);
  AttentionPlan baseline;
  ASSERT_TRUE(build_baseline_plan(b50.view, config_for(llama), &baseline).ok());
  pair_decode_items(&baseline, kTreeAttentionPairHeads);
  ASSERT_EQ(baseline.paired_items_begin, 0);
  EXPECT_LE(gpu_vs_cpu(b50, llama, baseline, &ws, 19, bucket_grid(baseline, false, true)),
            kFp16Tolerance);
  EXPECT_LE(gpu_vs_cpu(b50, llama, plan, &tail_workspace(false), 20, tail_grid), kFp16Tolerance);
  // Eager launches decide by the workspace's mode: kAlways runs the b=50 plan's paired items
  // in the tail kernel, kAuto (the default) does not (tree_attention_tail_pays).
  ASSERT_TRUE(ws.upload(plan, nullptr).ok());
  EXPECT_TRUE(tree_attention_runs_tail(ws, llama.num_kv_heads));
  // The graph grid (tree_attention_graph_grid) asks for what the eager launch runs (paired
  // says the plan pairs; the tail kernel takes those items).
  TreeAttentionGrid tail_expected = wide_grid;
  tail_expected.paired = true;
  EXPECT_EQ(tree_attention_graph_grid(ws, llama.num_kv_heads, 128), tail_expected);
  ASSERT_TRUE(shared_workspace().upload(plan, nullptr).ok());
  EXPECT_FALSE(tree_attention_runs_tail(shared_workspace(), llama.num_kv_heads));
  TreeAttentionGrid paired_only = bucket_grid(plan, true);
  paired_only.wide_items = tree_attention_wide_bucket(wide);
  paired_only.paired_items = tree_attention_wide_bucket(paired);
  EXPECT_EQ(tree_attention_graph_grid(shared_workspace(), llama.num_kv_heads, 128), paired_only);
  ASSERT_TRUE(tail_workspace(false).upload(plan, nullptr).ok());
  EXPECT_FALSE(tree_attention_runs_tail(tail_workspace(false), llama.num_kv_heads));
}

// A workspace whose eager launches run the wide kernel wherever the plan has wide pairs
// (TreeAttentionLimits::Wide::kAlways), with its trace on.
TreeAttentionWorkspace& wide_workspace() {
  static TreeAttentionWorkspace ws;
  if (!ws.initialized()) {
    TreeAttentionLimits limits;
    limits.wide_kernel = TreeAttentionLimits::Wide::kAlways;
    Status s = ws.init(limits);
    EXPECT_TRUE(s.ok()) << s.ToString();
    s = ws.enable_block_trace();
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return ws;
}

// Runs plan eagerly in the wide workspace and checks it against the CPU executor and the block
// trace: one record per (item, kv head), whichever kernel ran it (the wide kernel's consumers
// and tail warps, stage 1 after it). Returns whether the wide kernel ran.
bool check_wide(const TreeCase& tree, const Shape& shape, const AttentionPlan& plan, uint64_t seed,
                const std::string& what) {
  TreeAttentionWorkspace& ws = wide_workspace();
  std::vector<TreeAttentionBlockTrace> trace;
  EXPECT_TRUE(ws.download_block_trace(&trace).ok());  // clears it
  EXPECT_LE(gpu_vs_cpu(tree, shape, plan, &ws, seed), tolerance(shape)) << what;
  const bool ran = tree_attention_runs_wide(ws, shape.num_kv_heads, shape.head_dim);
  EXPECT_EQ(ws.wide_pairs(), tree_attention_wide_pairs(plan)) << what;
  EXPECT_TRUE(ws.download_block_trace(&trace).ok());
  std::set<std::pair<int32_t, int32_t>> seen;
  for (const TreeAttentionBlockTrace& r : trace) {
    EXPECT_TRUE(seen.insert({r.item, r.kv_head}).second) << what << " item " << r.item;
    EXPECT_EQ(r.tokens, plan.item_num_tokens[size_t(r.item)]) << what;
  }
  // Paired items run kTreeAttentionPairHeads kv heads a stage 1 block (one record for them).
  if (ran || plan.num_paired_items() == 0) {
    EXPECT_EQ(seen.size(), size_t(plan.num_items()) * size_t(shape.num_kv_heads)) << what;
  }
  return ran;
}

// The wide kernel (TreeAttentionLimits::wide_kernel): the plan's leading pairs of query tiles
// over one chunk in one block of two consumer warpgroups sharing a K/V ring, the paired items
// in its tail warps, stage 1 for the items between. Random trees at head_dim 128 (GQA 1-16,
// page sizes 1, 16 and 64, both dtypes, paired and unpaired plans; masked items go to stage 1),
// then the workload shapes with Llama-3-8B heads: few-shot P=4000 + 50 x 200 (pairs and paired
// items), P=3000 + 64 x 200 in both dtypes, a speculative tree (its prompt's tiles paired, the
// masked tree items in stage 1), at GQA 4 and 1 (where the few-shot prompts are one tile). head_dim
// 64, kOff and graph grids run stage 1.
TEST(TreeAttentionGpu, WideKernelMatchesPlanExecutor) {
  SKIP_WITHOUT_GPU();
  ASSERT_TRUE(wide_workspace().wide_kernel_built()) << "this build has no sm_90a wide kernel";
  int wide_plans = 0;
  for (uint64_t seed = 401; seed <= 428; ++seed) {
    testing::RandomTreeOptions options = random_options(seed);
    options.max_width = std::vector<int32_t>{32, 256}[seed % 2];
    const TreeCase tree = testing::random_tree_case(seed * 9173, options);
    Shape shape;
    shape.gqa = std::vector<int32_t>{1, 4, 8, 16}[seed % 4];
    shape.num_kv_heads = shape.gqa == 16 ? 2 : (shape.gqa == 8 || seed % 3 == 0 ? 4 : 8);
    shape.dtype = seed % 5 == 0 ? TreeAttentionDtype::kBFloat16 : TreeAttentionDtype::kFloat16;
    AttentionPlan plan;
    if (seed % 2) {
      plan = paired_plan_for(tree, shape, seed);
    } else {
      ASSERT_TRUE(build_attention_plan(tree.view, config_for(shape), &plan).ok());
    }
    wide_plans +=
        check_wide(tree, shape, plan, seed, "seed " + std::to_string(seed) + " " + describe(shape));
  }
  EXPECT_GT(wide_plans, 6);

  struct Case {
    std::string name;
    TreeCase tree;
  };
  std::vector<Case> cases;
  cases.push_back({"few-shot 4000+50x200", testing::few_shot_case(4000, 50, 200, 16, 3)});
  cases.push_back({"few-shot 3000+64x200", testing::few_shot_case(3000, 64, 200, 16, 4)});
  cases.push_back({"speculative 128 over 4000",
                   testing::speculative_case(4000, testing::medusa_like_paths(127), 16, 5)});
  for (const Case& c : cases) {
    for (int32_t kv_heads : {8, 32}) {
      for (TreeAttentionDtype dtype :
           {TreeAttentionDtype::kFloat16, TreeAttentionDtype::kBFloat16}) {
        const Shape shape{kv_heads, 32 / kv_heads, 128, dtype};
        AttentionPlan plan;
        ASSERT_TRUE(build_attention_plan(c.tree.view, config_for(shape), &plan).ok());
        const std::string what = c.name + " " + describe(shape);
        // At GQA 1 a few-shot prompt's 50 or 64 queries are one query tile: nothing to pair.
        const bool two_tiles = plan.num_queries() * shape.gqa > kTreeAttentionTileRows;
        EXPECT_EQ(tree_attention_wide_pairs(plan) > 0, two_tiles) << what;
        EXPECT_EQ(check_wide(c.tree, shape, plan, 31, what), two_tiles) << what;
      }
    }
  }

  // launch_tree_attention_state through it (stage 2's state grid after the wide kernel, or
  // after stage 1 for the speculative tree) against the CPU executor's states.
  for (size_t ci : {size_t(1), size_t(2)}) {
    const Case& c = cases[ci];
    const Shape shape{8, 4, 128};
    AttentionPlan plan;
    ASSERT_TRUE(build_attention_plan(c.tree.view, config_for(shape), &plan).ok());
    GpuAttentionProblem problem;
    ASSERT_TRUE(problem.init(c.tree, 32, 8, 128, TreeAttentionDtype::kFloat16, 41, 2.f).ok());
    TreeAttentionWorkspace& ws = wide_workspace();
    ASSERT_TRUE(ws.upload(plan, nullptr).ok());
    ASSERT_TRUE(tree_attention_runs_wide(ws, 8, 128)) << c.name;
    const size_t pairs = c.tree.view.queries.size() * 32;
    float *d_o = nullptr, *d_lse = nullptr;
    ASSERT_EQ(cudaMalloc(&d_o, pairs * 128 * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_lse, pairs * 4), cudaSuccess);
    const Status launched =
        launch_tree_attention_state(problem.device_q(), problem.device_k(), problem.device_v(), d_o,
                                    d_lse, TreeAttentionDtype::kFloat16, 32, 8, 128,
                                    c.tree.view.page_size, problem.sm_scale(), ws, nullptr);
    EXPECT_TRUE(launched.ok()) << launched.ToString();
    std::vector<float> o(pairs * 128), lse(pairs), want_o, want_lse;
    ASSERT_EQ(cudaMemcpy(o.data(), d_o, o.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(d_o);
    cudaFree(d_lse);
    ASSERT_TRUE(problem.reference_plan_state(plan, &want_o, &want_lse).ok());
    float worst_o = 0.f, worst_lse = 0.f;
    for (size_t e = 0; e < o.size(); ++e) {
      const float d = std::fabs(o[e] - want_o[e]);
      worst_o = std::isnan(d) ? INFINITY : std::max(worst_o, d);
    }
    for (size_t pr = 0; pr < pairs; ++pr) {
      const float d = std::fabs(lse[pr] - want_lse[pr] * 1.4426950408889634f);  // base 2
      worst_lse = std::isnan(d) ? INFINITY : std::max(worst_lse, d);
    }
    EXPECT_LE(worst_o, kFp16Tolerance) << c.name;
    EXPECT_LE(worst_lse, 1e-3f) << c.name;
    std::vector<TreeAttentionBlockTrace> trace;
    ASSERT_TRUE(ws.download_block_trace(&trace).ok());
  }

  // Grids, as the engine's graphs launch them (tree_attention_graph_grid asks for the wide
  // kernel where an eager launch runs it; the kernels read the pairs and where the paired items
  // begin from the header): the few-shot plans (nothing after the wide kernel) and the
  // speculative tree (stage 1's grid over the items after the pairs), every (item, kv head)
  // traced once; the speculative tree's grid, widened to hold them, runs the few-shot plans too
  // (its stage 1 blocks exit). A grid whose wide_rest does not cover stage 1's items, or is
  // negative, is refused before any launch.
  {
    const Shape shape{8, 4, 128};
    TreeAttentionWorkspace& ws = wide_workspace();
    std::vector<TreeAttentionBlockTrace> trace;
    TreeAttentionGrid spec_grid;
    for (const Case& c : cases) {
      AttentionPlan plan;
      ASSERT_TRUE(build_attention_plan(c.tree.view, config_for(shape), &plan).ok());
      ASSERT_TRUE(ws.upload(plan, nullptr).ok());
      const TreeAttentionGrid grid = tree_attention_graph_grid(ws, shape.num_kv_heads, 128);
      EXPECT_TRUE(grid.wide) << c.name;
      EXPECT_EQ(grid.wide_rest > 0, tree_attention_wide_rest(ws) > 0) << c.name;
      if (grid.wide_rest > 0) spec_grid = grid;
      ASSERT_TRUE(ws.download_block_trace(&trace).ok());
      EXPECT_LE(gpu_vs_cpu(c.tree, shape, plan, &ws, 51, grid), kFp16Tolerance) << c.name;
      ASSERT_TRUE(ws.download_block_trace(&trace).ok());
      std::set<std::pair<int32_t, int32_t>> seen;
      for (const TreeAttentionBlockTrace& r : trace) seen.insert({r.item, r.kv_head});
      EXPECT_EQ(trace.size(), seen.size()) << c.name;
      EXPECT_EQ(seen.size(), size_t(plan.num_items()) * 8) << c.name;
    }
    ASSERT_TRUE(spec_grid.wide);
    ASSERT_GT(spec_grid.wide_rest, 0);
    for (size_t ci : {size_t(0), size_t(1)}) {
      AttentionPlan plan;
      ASSERT_TRUE(build_attention_plan(cases[ci].tree.view, config_for(shape), &plan).ok());
      TreeAttentionGrid grid = spec_grid;
      grid.items = std::max(grid.items, tree_attention_grid_bucket(plan.num_items()));
      grid.queries = std::max(grid.queries, tree_attention_grid_bucket(plan.num_queries()));
      EXPECT_LE(gpu_vs_cpu(cases[ci].tree, shape, plan, &ws, 52, grid), kFp16Tolerance)
          << cases[ci].name;
    }
    ASSERT_TRUE(ws.download_block_trace(&trace).ok());  // clears the launches' above
    AttentionPlan spec;
    ASSERT_TRUE(build_attention_plan(cases[2].tree.view, config_for(shape), &spec).ok());
    ASSERT_TRUE(ws.upload(spec, nullptr).ok());
    GpuAttentionProblem problem;
    ASSERT_TRUE(problem.init(cases[2].tree, 32, 8, 128, TreeAttentionDtype::kFloat16, 53).ok());
    TreeAttentionGrid short_grid = tree_attention_graph_grid(ws, 8, 128);
    short_grid.wide_rest = tree_attention_wide_rest(ws) - 1;
    const Status refused = problem.launch_uploaded(ws, nullptr, short_grid);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
    EXPECT_NE(refused.message().find("wide_rest"), std::string::npos) << refused.ToString();
    short_grid.wide_rest = -8;
    EXPECT_EQ(problem.launch_uploaded(ws, nullptr, short_grid).code(),
              StatusCode::kInvalidArgument);
    ASSERT_TRUE(ws.download_block_trace(&trace).ok());
    EXPECT_TRUE(trace.empty());
  }

  // Where it does not run: head_dim 64, kOff (the default workspace at kAuto runs it only where
  // the tail kernel would run: not for b=50); a grid without wide runs stage 1.
  const TreeCase& b50 = cases[0].tree;
  const Shape llama{8, 4, 128};
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(b50.view, config_for(llama), &plan).ok());
  const Shape small_heads{8, 4, 64};
  AttentionPlan plan64;
  ASSERT_TRUE(build_attention_plan(b50.view, config_for(small_heads), &plan64).ok());
  EXPECT_FALSE(check_wide(b50, small_heads, plan64, 32, "head_dim 64"));
  EXPECT_LE(gpu_vs_cpu(b50, llama, plan, &wide_workspace(), 33, bucket_grid(plan, true)),
            kFp16Tolerance);
  ASSERT_TRUE(shared_workspace().upload(plan, nullptr).ok());
  EXPECT_GT(shared_workspace().wide_pairs(), 0);
  EXPECT_FALSE(tree_attention_runs_wide(shared_workspace(), llama.num_kv_heads, 128));
  ASSERT_TRUE(tail_workspace(true).upload(plan, nullptr).ok());
  EXPECT_FALSE(tree_attention_runs_wide(tail_workspace(true), llama.num_kv_heads, 128));
  // Nor at kAuto where stage 1 would run items after it: few-shot P=4000 + 80 x 100 has 5
  // query tiles a chunk, so each chunk's fifth is left. Nor does the tail kernel (its 160 wide
  // blocks leave 104 of 264 slots to the paired ones): stage 1 runs the whole plan.
  const TreeCase odd = testing::few_shot_case(4000, 80, 100, 16, 34);
  AttentionPlan odd_plan;
  ASSERT_TRUE(build_attention_plan(odd.view, config_for(llama), &odd_plan).ok());
  ASSERT_TRUE(shared_workspace().upload(odd_plan, nullptr).ok());
  EXPECT_GT(shared_workspace().wide_pairs(), 0);
  EXPECT_GT(tree_attention_wide_rest(shared_workspace()), 0);
  EXPECT_FALSE(tree_attention_runs_tail(shared_workspace(), llama.num_kv_heads));
  EXPECT_FALSE(tree_attention_runs_wide(shared_workspace(), llama.num_kv_heads, 128));
  EXPECT_FALSE(tree_attention_graph_grid(shared_workspace(), llama.num_kv_heads, 128).wide);
  EXPECT_FALSE(tree_attention_graph_grid(shared_workspace(), llama.num_kv_heads, 128).tail);
  EXPECT_LE(gpu_vs_cpu(odd, llama, odd_plan, &shared_workspace(), 35), kFp16Tolerance);
  // At kAuto where its units take more than one pass of the grid (few-shot P=4000 + 160 x 100:
  // 20 pairs x 8 kv heads on 132 SMs, 320 wide blocks, more than stage 1's one wave), eagerly
  // and from a graph's grid.
  const TreeCase many = testing::few_shot_case(4000, 160, 100, 16, 36);
  AttentionPlan many_plan;
  ASSERT_TRUE(build_attention_plan(many.view, config_for(llama), &many_plan).ok());
  ASSERT_TRUE(shared_workspace().upload(many_plan, nullptr).ok());
  EXPECT_EQ(tree_attention_wide_rest(shared_workspace()), 0);
  EXPECT_GT(int64_t(shared_workspace().wide_pairs()) * llama.num_kv_heads,
            shared_workspace().num_sms());
  EXPECT_TRUE(tree_attention_runs_wide(shared_workspace(), llama.num_kv_heads, 128));
  const TreeAttentionGrid many_grid =
      tree_attention_graph_grid(shared_workspace(), llama.num_kv_heads, 128);
  EXPECT_TRUE(many_grid.wide);
  EXPECT_LE(gpu_vs_cpu(many, llama, many_plan, &shared_workspace(), 36), kFp16Tolerance);
  EXPECT_LE(gpu_vs_cpu(many, llama, many_plan, &shared_workspace(), 37, many_grid), kFp16Tolerance);
  // At kAuto for a plan of pairs alone (no paired items; a sequence-parallel rank's share of a
  // long prompt is one): 64 queries at the end of an 8000-token prompt, 16 pairs of 1024-token
  // chunks, 256 wide blocks (tree_attention_wide_alone_pays), eagerly and from a graph's grid.
  const TreeCase alone = testing::few_shot_case(8000, 64, 0, 16, 38);
  AttentionPlan alone_plan;
  ASSERT_TRUE(build_attention_plan(alone.view, config_for(llama), &alone_plan).ok());
  ASSERT_TRUE(shared_workspace().upload(alone_plan, nullptr).ok());
  EXPECT_EQ(shared_workspace().paired_items_begin(), -1);
  EXPECT_EQ(2 * shared_workspace().wide_pairs(), alone_plan.num_items());
  EXPECT_TRUE(tree_attention_runs_wide(shared_workspace(), llama.num_kv_heads, 128));
  const TreeAttentionGrid alone_grid =
      tree_attention_graph_grid(shared_workspace(), llama.num_kv_heads, 128);
  EXPECT_TRUE(alone_grid.wide);
  EXPECT_EQ(alone_grid.wide_rest, 0);
  EXPECT_LE(gpu_vs_cpu(alone, llama, alone_plan, &shared_workspace(), 38), kFp16Tolerance);
  EXPECT_LE(gpu_vs_cpu(alone, llama, alone_plan, &shared_workspace(), 39, alone_grid),
            kFp16Tolerance);
  // Without a token table there are no wide pairs.
  ASSERT_TRUE(small_table_workspace(0).upload(plan, nullptr).ok());
  EXPECT_EQ(small_table_workspace(0).wide_pairs(), 0);
}

// TreeAttentionLimits::decode_kernel: a plan of only decode-shaped items (at most 16 rows: the
// baseline's at gqa <= 16, a tree of 4 branches at gqa 4) runs in the decode kernel, any other
// (a tree with a shared prompt, the baseline's at gqa 32) in stage 1; with it off, or without
// a token table, stage 1 runs every plan. Every way matches the CPU executor, and the two
// kernels each other.
TEST(TreeAttentionGpu, DecodeKernelRunsAllDecodeShapedPlans) {
  SKIP_WITHOUT_GPU();
  TreeAttentionLimits on_limits, off_limits;
  off_limits.decode_kernel = false;
  TreeAttentionWorkspace on, off;
  ASSERT_TRUE(on.init(on_limits).ok());
  ASSERT_TRUE(off.init(off_limits).ok());
  TreeAttentionWorkspace& no_table = small_table_workspace(0);
  struct Run {
    const TreeCase& tree;
    Shape shape;
    bool baseline;
    bool decode_shaped;  // every item of the plan has at most 16 rows
  };
  const TreeCase many = testing::few_shot_case(1200, 9, 150, 16, 12);
  const TreeCase four = testing::few_shot_case(2100, 4, 300, 16, 13);
  const std::vector<Run> runs = {
      {many, Shape{2, 4, 128}, true, true},
      {many, Shape{1, 16, 64}, true, true},
      {many, Shape{2, 1, 128}, true, true},
      {many, Shape{2, 8, 128, TreeAttentionDtype::kBFloat16}, true, true},
      {four, Shape{2, 4, 128}, false, true},
      {four, Shape{1, 4, 64, TreeAttentionDtype::kBFloat16}, false, true},
      {many, Shape{2, 4, 128}, false, false},
      {many, Shape{1, 32, 64}, true, false},
  };
  for (const Run& run : runs) {
    const Shape& shape = run.shape;
    const AttentionPlanConfig config = config_for(shape);
    AttentionPlan plan;
    ASSERT_TRUE((run.baseline ? build_baseline_plan(run.tree.view, config, &plan)
                              : build_attention_plan(run.tree.view, config, &plan))
                    .ok());
    bool all_decode_shaped = plan.num_items() > 0;
    for (int32_t i = 0; i < plan.num_items(); ++i) {
      all_decode_shaped &= (plan.item_query_end[size_t(i)] - plan.item_query_begin[size_t(i)]) *
                               plan.gqa_group_size <=
                           16;
    }
    const std::string what = describe(shape) + (run.baseline ? " baseline" : " tree") + " of " +
                             std::to_string(run.tree.view.queries.size()) + " queries";
    EXPECT_EQ(all_decode_shaped, run.decode_shaped) << what;
    const float tolerance =
        shape.dtype == TreeAttentionDtype::kBFloat16 ? kBf16Tolerance : kFp16Tolerance;
    GpuAttentionProblem problem;
    ASSERT_TRUE(problem
                    .init(run.tree, shape.num_kv_heads * shape.gqa, shape.num_kv_heads,
                          shape.head_dim, shape.dtype, 17, 2.f)
                    .ok());
    std::vector<float> cpu, gpu[3];
    ASSERT_TRUE(problem.reference_plan(plan, &cpu).ok());
    TreeAttentionWorkspace* spaces[3] = {&on, &off, &no_table};
    for (int w = 0; w < 3; ++w) {
      ASSERT_TRUE(problem.reset_out().ok());
      const Status s = problem.launch(plan, spaces[w], nullptr);
      ASSERT_TRUE(s.ok()) << s.ToString();
      ASSERT_TRUE(problem.download_out(&gpu[w]).ok());
      EXPECT_LE(problem.max_abs_diff(gpu[w], cpu), tolerance) << what << " workspace " << w;
      EXPECT_TRUE(problem.untouched_rows_kept(gpu[w])) << what << " workspace " << w;
    }
    EXPECT_EQ(on.runs_decode_kernel(), all_decode_shaped) << what;
    EXPECT_FALSE(off.runs_decode_kernel()) << what;
    EXPECT_FALSE(no_table.runs_decode_kernel()) << what;
    EXPECT_LE(problem.max_abs_diff(gpu[0], gpu[1]), tolerance) << what;
  }
}

// The graph tests' problem: a few-shot tree (8 q / 2 kv heads, head_dim 128) on a workspace of
// 512 items, a stream, and the graph captured on it.
class TreeAttentionGraph : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    TreeAttentionLimits limits;
    limits.max_work_items = 512;
    limits.max_partials = 1024;
    ASSERT_TRUE(ws_.init(limits).ok());
    ASSERT_TRUE(problem_.init(tree_, 8, 2, 128, shape_.dtype, 3, 2.f).ok());
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Captures `grid`'s launch of the uploaded plan in a CUDA graph (exec_).
  void capture(const TreeAttentionGrid& grid) {
    ASSERT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    const Status launched = problem_.launch_uploaded(ws_, stream_, grid);
    ASSERT_EQ(cudaStreamEndCapture(stream_, &graph_), cudaSuccess);
    ASSERT_TRUE(launched.ok()) << launched.ToString();
    ASSERT_EQ(cudaGraphInstantiate(&exec_, graph_, 0), cudaSuccess);
  }

  // Waits for the stream and checks the output against the CPU executor's for plan.
  void expect_output_matches(const AttentionPlan& plan, const std::string& what) {
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<float> gpu, cpu;
    ASSERT_TRUE(problem_.download_out(&gpu).ok());
    ASSERT_TRUE(problem_.reference_plan(plan, &cpu).ok());
    EXPECT_LE(problem_.max_abs_diff(gpu, cpu), kFp16Tolerance) << what;
  }

  // Uploads plan, replays the captured graph, and checks the output.
  void expect_replay_matches(const AttentionPlan& plan, const std::string& what) {
    ASSERT_TRUE(problem_.reset_out().ok());
    ASSERT_TRUE(ws_.upload(plan, stream_).ok());
    ASSERT_EQ(cudaGraphLaunch(exec_, stream_), cudaSuccess);
    expect_output_matches(plan, what);
  }

  const TreeCase tree_ = testing::few_shot_case(1500, 12, 90, 16, 6);
  const Shape shape_{2, 4, 128};
  TreeAttentionWorkspace ws_;
  GpuAttentionProblem problem_;
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// A graph captured with the decode kernel (TreeAttentionGrid::decode_kernel) replays later
// all-decode-shaped plans correctly; a decode-kernel grid for a plan stage 1 must run is
// refused, while a stage 1 grid runs an all-decode-shaped plan too.
TEST_F(TreeAttentionGraph, DecodeKernelGridReplaysLaterPlans) {
  AttentionPlan tree_plan, first;
  ASSERT_TRUE(build_attention_plan(tree_.view, config_for(shape_), &tree_plan).ok());
  ASSERT_TRUE(build_baseline_plan(tree_.view, config_for(shape_), &first).ok());
  const TreeAttentionGrid grid{512, tree_attention_grid_bucket(int32_t(tree_.view.queries.size())),
                               true};
  ASSERT_TRUE(ws_.upload(tree_plan, stream_).ok());
  ASSERT_FALSE(ws_.runs_decode_kernel());
  EXPECT_EQ(problem_.launch_uploaded(ws_, stream_, grid).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(ws_.upload(first, stream_).ok());
  ASSERT_TRUE(ws_.runs_decode_kernel());
  TreeAttentionGrid stage1_grid = grid;
  stage1_grid.decode_kernel = false;
  ASSERT_TRUE(problem_.reset_out().ok());
  const Status staged = problem_.launch_uploaded(ws_, stream_, stage1_grid);
  ASSERT_TRUE(staged.ok()) << staged.ToString();
  expect_output_matches(first, "stage 1 grid");
  capture(grid);
  ASSERT_FALSE(HasFatalFailure());
  // The baseline's plans at other chunk sizes and split targets (head-major, fewer items).
  for (int32_t chunk : {0, 256, 1024, 64}) {
    AttentionPlanConfig config = config_for(shape_);
    if (chunk > 0) config.kv_chunk_tokens = chunk;
    if (chunk == 64) config.num_sms = 4;
    AttentionPlan plan;
    ASSERT_TRUE(build_baseline_plan(tree_.view, config, &plan).ok());
    ASSERT_LE(plan.num_items(), grid.items) << "chunk " << chunk;
    expect_replay_matches(plan, "chunk " + std::to_string(chunk));
    EXPECT_TRUE(ws_.runs_decode_kernel()) << "chunk " << chunk;
  }
}

TEST(TreeAttentionGpu, BaselinePlanMatchesNaive) {
  SKIP_WITHOUT_GPU();
  std::vector<TreeCase> trees;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    testing::RandomTreeOptions o = random_options(seed);
    o.max_runs = 40;
    trees.push_back(testing::random_tree_case(seed * 31, o));
  }
  trees.push_back(testing::few_shot_case(1000, 8, 100, 16, 4));
  trees.push_back(testing::speculative_case(700, testing::medusa_like_paths(31), 64, 5));
  for (size_t i = 0; i < trees.size(); ++i) {
    const Shape shape{2, i % 2 ? 4 : 1, i % 3 ? 128 : 64};
    AttentionPlan plan;
    Status s = build_baseline_plan(trees[i].view, config_for(shape), &plan);
    ASSERT_TRUE(s.ok()) << s.ToString();
    GpuAttentionProblem problem;
    s = problem.init(trees[i], shape.num_kv_heads * shape.gqa, shape.num_kv_heads, shape.head_dim,
                     shape.dtype, 77 + i, 2.f);
    ASSERT_TRUE(s.ok()) << s.ToString();
    s = problem.launch(plan, &shared_workspace(), nullptr);
    ASSERT_TRUE(s.ok()) << s.ToString();
    std::vector<float> gpu, naive;
    ASSERT_TRUE(problem.download_out(&gpu).ok());
    std::vector<int32_t> all(trees[i].view.queries.size());
    for (size_t q = 0; q < all.size(); ++q) all[q] = int32_t(q);
    ASSERT_TRUE(problem.reference_naive(all, &naive).ok());
    EXPECT_LE(problem.max_abs_diff(gpu, naive), kFp16Tolerance)
        << "tree " << i << " " << describe(shape);
    EXPECT_TRUE(problem.untouched_rows_kept(gpu));
  }
}

// A launch with a TreeAttentionGrid captured once in a CUDA graph stays correct when later
// plans (other chunkings of the same problem, fewer items than the grid) are uploaded into the
// same workspace and the graph replayed; a grid smaller than the plan is refused.
TEST_F(TreeAttentionGraph, GridReplaysLaterPlans) {
  AttentionPlan first;
  ASSERT_TRUE(build_attention_plan(tree_.view, config_for(shape_), &first).ok());
  ASSERT_TRUE(ws_.upload(first, stream_).ok());
  const TreeAttentionGrid grid{512, tree_attention_grid_bucket(ws_.num_queries())};
  EXPECT_EQ(problem_.launch_uploaded(ws_, stream_, TreeAttentionGrid{1, 1024}).code(),
            StatusCode::kInvalidArgument);
  capture(grid);
  ASSERT_FALSE(HasFatalFailure());
  // Other chunkings (heads-first plans), then the baseline's head-major plan (heads_first =
  // false: blocks past its items sit inside every head's range of the padded grid).
  for (int32_t chunk : {512, 128, 1024, 0}) {
    AttentionPlanConfig config = config_for(shape_);
    AttentionPlan plan;
    if (chunk > 0) {
      config.kv_chunk_tokens = chunk;
      ASSERT_TRUE(build_attention_plan(tree_.view, config, &plan).ok());
    } else {
      ASSERT_TRUE(build_baseline_plan(tree_.view, config, &plan).ok());
      ASSERT_FALSE(plan.heads_first);
    }
    ASSERT_LT(plan.num_items(), grid.items) << "chunk " << chunk;
    ASSERT_LE(plan.num_queries(), grid.queries);
    expect_replay_matches(plan, "chunk " + std::to_string(chunk));
  }
}

// The workspace's longest item caps the plan's chunk growth (no device needed).
// An e4m3 copy of a problem's K and V pools (kernels/kv_layout.h's FP8 layout: each (page, kv
// head, slot) row quantized with its own scale by models/fp8.h's KV rule) and a dtype pool holding
// the dequantized values, float(e4m3) * scale rounded to dtype: what the kernels' tiles must
// hold either way.
class Fp8KvPools {
 public:
  ~Fp8KvPools() {
    for (void* p : {k8_, v8_, ks_, vs_, kt_, vt_}) cudaFree(p);
  }
  Status init(const GpuAttentionProblem& problem) {
    const KvLayout& layout = problem.layout();
    const size_t n = size_t(layout.layer_elems());
    const int32_t d = layout.head_dim;
    const bool bf16 = problem.dtype() == TreeAttentionDtype::kBFloat16;
    for (int i = 0; i < 2; ++i) {
      std::vector<float> x;
      TS_RETURN_IF_ERROR(testing::download_as_float(
          i == 0 ? problem.device_k() : problem.device_v(), n, problem.dtype(), &x));
      std::vector<uint8_t> q(n);
      std::vector<float> scale(n / size_t(d));
      quantize_fp8_kv_rows(x.data(), int64_t(n) / d, d, q.data(), scale.data());
      std::vector<uint16_t> deq(n);
      for (size_t j = 0; j < n; ++j) {
        const float v = e4m3_to_float(q[j]) * scale[j / size_t(d)];
        deq[j] = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v))
                      : __half_as_ushort(__float2half_rn(v));
      }
      void** bytes = i == 0 ? &k8_ : &v8_;
      void** scales = i == 0 ? &ks_ : &vs_;
      void** dtype_pool = i == 0 ? &kt_ : &vt_;
      if (cudaMalloc(bytes, n) != cudaSuccess ||
          cudaMalloc(scales, scale.size() * 4) != cudaSuccess ||
          cudaMalloc(dtype_pool, n * 2) != cudaSuccess ||
          cudaMemcpy(*bytes, q.data(), n, cudaMemcpyHostToDevice) != cudaSuccess ||
          cudaMemcpy(*scales, scale.data(), scale.size() * 4, cudaMemcpyHostToDevice) !=
              cudaSuccess ||
          cudaMemcpy(*dtype_pool, deq.data(), n * 2, cudaMemcpyHostToDevice) != cudaSuccess) {
        return Internal("Fp8KvPools: device allocation or copy failed");
      }
    }
    return Status::Ok();
  }
  const void* k8() const { return k8_; }
  const void* v8() const { return v8_; }
  TreeAttentionKvScales scales() const {
    return {static_cast<const float*>(ks_), static_cast<const float*>(vs_)};
  }
  const void* k_dequantized() const { return kt_; }
  const void* v_dequantized() const { return vt_; }

 private:
  void *k8_ = nullptr, *v8_ = nullptr, *ks_ = nullptr, *vs_ = nullptr;
  void *kt_ = nullptr, *vt_ = nullptr;
};

// Runs the uploaded plan (in grid; {}: eagerly) over the dequantized dtype pool and over the
// e4m3 pool; expects identical outputs and returns the e4m3 run's largest error against the
// CPU executor on the unquantized inputs.
float fp8_pool_vs_dequantized(const GpuAttentionProblem& problem, const Fp8KvPools& pools,
                              const AttentionPlan& plan, const TreeAttentionWorkspace& ws,
                              TreeAttentionGrid grid, const std::string& what) {
  std::vector<float> from_dtype, from_fp8, cpu;
  const KvLayout& layout = problem.layout();
  for (const bool fp8 : {false, true}) {
    EXPECT_TRUE(problem.reset_out().ok());
    const Status s = launch_tree_attention(
        problem.device_q(), fp8 ? pools.k8() : pools.k_dequantized(),
        fp8 ? pools.v8() : pools.v_dequantized(), problem.device_out(), problem.dtype(),
        problem.num_q_heads(), layout.num_kv_heads, layout.head_dim, layout.page_size,
        problem.sm_scale(), ws, nullptr, grid, fp8 ? pools.scales() : TreeAttentionKvScales{});
    EXPECT_TRUE(s.ok()) << what << ": " << s.ToString();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    EXPECT_TRUE(problem.download_out(fp8 ? &from_fp8 : &from_dtype).ok());
  }
  EXPECT_TRUE(from_dtype == from_fp8) << what << ": the e4m3 pool's output differs from the "
                                      << "dequantized pool's";
  EXPECT_TRUE(problem.untouched_rows_kept(from_fp8)) << what;
  EXPECT_TRUE(problem.reference_plan(plan, &cpu).ok());
  return problem.max_abs_diff(from_fp8, cpu);
}

// The workspaces an engine with an e4m3 pool runs (no tail or wide kernel), with the default
// token table or none (stage 1 resolves tokens from the segments).
TreeAttentionWorkspace& fp8_workspace(bool with_table) {
  static TreeAttentionWorkspace ws[2];
  TreeAttentionWorkspace& w = ws[with_table ? 0 : 1];
  if (!w.initialized()) {
    TreeAttentionLimits limits;
    limits.tail_kernel = TreeAttentionLimits::Tail::kOff;
    limits.wide_kernel = TreeAttentionLimits::Wide::kOff;
    if (!with_table) limits.max_table_tokens = 0;
    const Status s = w.init(limits);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return w;
}

// e4m3 K/V bound for values in [-1, 1] and q in [-2, 2]: each K and V element is within an
// e4m3 half-step (1/16 relative) of its value, which moves the softmax weights by a few percent.
constexpr float kFp8KvTolerance = 0.08f;

// Random trees (masks, packs, internal queries, page sizes 1/16/64, both head dims and dtypes,
// GQA 1/4/8), with and without a token table, eager and in the engine's graph grid; few-shot
// b=50 at Llama-3-8B heads (paired decode items beside wide items), its baseline plan (the
// decode kernel) and a speculative token tree: every output bit-identical to the dequantized
// pool's. Grids with the tail or wide kernel and a lone scale array are refused.
TEST(TreeAttentionGpu, Fp8KvPoolEqualsItsDequantizedPool) {
  SKIP_WITHOUT_GPU();
  float worst = 0.0f;
  for (uint64_t seed = 301; seed <= 316; ++seed) {
    const TreeCase tree = testing::random_tree_case(seed * 7919, random_options(seed));
    Shape shape;
    shape.gqa = std::vector<int32_t>{1, 4, 8}[seed % 3];
    shape.num_kv_heads = seed % 4 < 2 ? 4 : 2;
    shape.head_dim = (seed / 2) % 2 ? 64 : 128;
    shape.dtype = seed % 5 == 0 ? TreeAttentionDtype::kBFloat16 : TreeAttentionDtype::kFloat16;
    const std::string what = "seed " + std::to_string(seed) + " " + describe(shape);
    GpuAttentionProblem problem;
    ASSERT_TRUE(problem
                    .init(tree, shape.num_kv_heads * shape.gqa, shape.num_kv_heads, shape.head_dim,
                          shape.dtype, seed, 2.f)
                    .ok());
    Fp8KvPools pools;
    ASSERT_TRUE(pools.init(problem).ok());
    const AttentionPlan plan = paired_plan_for(tree, shape, seed);
    TreeAttentionWorkspace& ws = fp8_workspace(seed % 3 != 0);
    ASSERT_TRUE(ws.upload(plan, nullptr).ok());
    const TreeAttentionGrid grid =
        seed % 2 ? tree_attention_graph_grid(ws, shape.num_kv_heads, shape.head_dim)
                 : TreeAttentionGrid{};
    const float err = fp8_pool_vs_dequantized(problem, pools, plan, ws, grid, what);
    if (shape.dtype == TreeAttentionDtype::kFloat16) worst = std::max(worst, err);
    EXPECT_LE(err, kFp8KvTolerance + (shape.dtype == TreeAttentionDtype::kFloat16 ? 0.f : 0.02f))
        << what;
  }
  std::printf("  e4m3 pool against the float32 executor on unquantized K/V (fp16): %.4f\n", worst);

  const Shape llama{8, 4, 128};
  const TreeCase b50 = testing::few_shot_case(4000, 50, 200, 16, 3);
  const TreeCase spec = testing::speculative_case(3000, testing::medusa_like_paths(64), 16, 4);
  for (const TreeCase* tree : {&b50, &spec}) {
    GpuAttentionProblem problem;
    ASSERT_TRUE(problem
                    .init(*tree, llama.num_kv_heads * llama.gqa, llama.num_kv_heads, llama.head_dim,
                          llama.dtype, 21, 2.f)
                    .ok());
    Fp8KvPools pools;
    ASSERT_TRUE(pools.init(problem).ok());
    AttentionPlan plan, baseline;
    ASSERT_TRUE(build_attention_plan(tree->view, config_for(llama), &plan).ok());
    ASSERT_TRUE(build_baseline_plan(tree->view, config_for(llama), &baseline).ok());
    TreeAttentionWorkspace& ws = fp8_workspace(true);
    for (const AttentionPlan* p : {&plan, &baseline}) {
      const std::string what = std::string(tree == &b50 ? "few-shot b=50" : "speculative t=64") +
                               (p == &baseline ? " baseline" : " tree plan");
      ASSERT_TRUE(ws.upload(*p, nullptr).ok());
      if (p == &baseline) {
        EXPECT_TRUE(ws.runs_decode_kernel()) << what;
      }
      EXPECT_LE(fp8_pool_vs_dequantized(problem, pools, *p, ws, {}, what), kFp8KvTolerance) << what;
      const TreeAttentionGrid grid = tree_attention_graph_grid(ws, llama.num_kv_heads, 128);
      EXPECT_FALSE(grid.tail || grid.wide) << what;
      EXPECT_LE(fp8_pool_vs_dequantized(problem, pools, *p, ws, grid, what + " (grid)"),
                kFp8KvTolerance)
          << what;
    }

    // Refused before any launch: a grid with the tail kernel, a lone scale array.
    ASSERT_TRUE(ws.upload(plan, nullptr).ok());
    TreeAttentionGrid tail_grid = tree_attention_graph_grid(ws, llama.num_kv_heads, 128);
    tail_grid.tail = true;
    tail_grid.paired = false;
    tail_grid.paired_items = 0;
    Status refused =
        launch_tree_attention(problem.device_q(), pools.k8(), pools.v8(), problem.device_out(),
                              llama.dtype, problem.num_q_heads(), llama.num_kv_heads, 128, 16,
                              problem.sm_scale(), ws, nullptr, tail_grid, pools.scales());
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
    EXPECT_NE(refused.message().find("e4m3"), std::string::npos) << refused.ToString();
    TreeAttentionKvScales lone = pools.scales();
    lone.v = nullptr;
    refused =
        launch_tree_attention(problem.device_q(), pools.k8(), pools.v8(), problem.device_out(),
                              llama.dtype, problem.num_q_heads(), llama.num_kv_heads, 128, 16,
                              problem.sm_scale(), ws, nullptr, {}, lone);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  }
}

TEST(TreeAttentionLimits, ApplyToCapsChunkGrowth) {
  AttentionPlanConfig config = tree_attention_plan_config(32, 8, 128, 132);
  EXPECT_EQ(config.max_chunk_tokens, 2048) << "4 x the 512-token chunk by default";
  TreeAttentionLimits limits;
  limits.max_item_tokens = 1024;
  limits.apply_to(&config);
  EXPECT_EQ(config.max_chunk_tokens, 1024);
  const TreeCase tree = testing::few_shot_case(16000, 64, 200, 16, 7);
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(tree.view, config, &plan).ok());
  EXPECT_EQ(plan.split_chunk_tokens, 1024);
  EXPECT_LE(plan.max_item_tokens, 1024);
}

TEST(TreeAttentionGpu, RejectsPlansAndShapesOutsideTheWorkspace) {
  SKIP_WITHOUT_GPU();
  const TreeCase tree = testing::few_shot_case(3000, 40, 50, 16, 7);
  TreeAttentionLimits limits;
  limits.max_work_items = 4;
  TreeAttentionWorkspace ws;
  ASSERT_TRUE(ws.init(limits).ok());
  AttentionPlan plan;
  ASSERT_TRUE(build_attention_plan(tree.view, config_for(Shape{1, 4, 128}), &plan).ok());
  Status s = ws.upload(plan, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  // Limits copied into the config make the builder refuse first.
  AttentionPlanConfig config = config_for(Shape{1, 4, 128});
  limits.apply_to(&config);
  EXPECT_EQ(build_attention_plan(tree.view, config, &plan).code(), StatusCode::kResourceExhausted);

  TreeAttentionWorkspace big;
  ASSERT_TRUE(big.init(TreeAttentionLimits{}).ok());
  ASSERT_TRUE(build_attention_plan(tree.view, config_for(Shape{1, 4, 128}), &plan).ok());
  ASSERT_TRUE(big.upload(plan, nullptr).ok());
  GpuAttentionProblem problem;
  ASSERT_TRUE(problem.init(tree, 4, 1, 128, TreeAttentionDtype::kFloat16, 1).ok());
  int dummy_storage[4];
  void* dummy = dummy_storage;
  s = launch_tree_attention(dummy, dummy, dummy, dummy, TreeAttentionDtype::kFloat16, 4, 1, 96, 16,
                            1.f, big, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "head_dim 96";
  s = launch_tree_attention(dummy, dummy, dummy, dummy, TreeAttentionDtype::kFloat16, 8, 1, 128, 16,
                            1.f, big, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "gqa differs from the plan's";
  s = launch_tree_attention(dummy, dummy, dummy, dummy, TreeAttentionDtype::kFloat16, 4, 1, 128, 64,
                            1.f, big, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "page size differs from the plan's";

  // A plan that pairs wide items, or from a negative index, is refused at upload.
  ASSERT_GT(plan.num_items(), 1);
  plan.pair_heads = kTreeAttentionPairHeads;
  plan.paired_items_begin = 0;
  s = big.upload(plan, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  plan.paired_items_begin = -1;
  s = big.upload(plan, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

}  // namespace
}  // namespace treeserve
