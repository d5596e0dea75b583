// GPU tests of sequence-parallel tree attention (kernels/sequence_parallel_attention.h, ctest
// label `gpu`): the step's plan split over 2 GPUs (and 4 when present), each rank's stage 1 and
// state merge over its shard, the NCCL combine, against launch_tree_attention of the unsplit
// plan on one GPU with the same dtype-rounded inputs. Trees: a 24000-token prompt with decode
// branches and a speculative token tree under one of them (masked packed items), a random tree
// under a 20000-token root (prefill chunks, token trees), and a 64-candidate token tree over a
// 22000-token prefix; fp16 and bf16, head_dim 128, GQA 4 (32/8 heads) and GQA 1 (32/32).
//
// Every rank's K/V pool is a copy in which each page its shard does not read
// (plan_read_pages) is NaN, so a rank that read a page of another rank's share would put NaN
// in the output; the unsplit plan run over such a pool must produce NaN (the poisoning bites).
// Also launch_tree_attention_state alone against the CPU executor's states (one GPU). Each
// case skips with a message when the machine has fewer devices than it needs.
#include "kernels/sequence_parallel.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/attention_plan.h"
#include "kernels/sequence_parallel_attention.h"
#include "kernels/testing/gpu_attention_harness.h"
#include "kernels/testing/random_tree.h"
#include "kernels/tree_attention.h"

namespace treeserve {
namespace {

using testing::GpuAttentionProblem;
using testing::TreeCase;

#define SKIP_WITHOUT_DEVICES(n)                                           \
  do {                                                                    \
    const int32_t _have = testing::cuda_device_count();                   \
    if (_have < (n)) {                                                    \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices, found " << _have \
                   << ": sequence-parallel GPU test skipped";             \
    }                                                                     \
  } while (0)

#define ASSERT_OK(expr)                                     \
  do {                                                      \
    const Status _s = (expr);                               \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s.ToString(); \
  } while (0)

#define ASSERT_CUDA(expr)                                                  \
  do {                                                                     \
    const cudaError_t _e = (expr);                                         \
    ASSERT_EQ(_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(_e); \
  } while (0)

constexpr float kFp16Tolerance = 2e-3f;
constexpr float kBf16Tolerance = 1e-2f;
constexpr int32_t kHeadDim = 128;

struct Shape {
  int32_t num_q_heads = 32;
  int32_t num_kv_heads = 8;
  TreeAttentionDtype dtype = TreeAttentionDtype::kFloat16;
};

std::string describe(const Shape& s, int32_t world) {
  return std::to_string(s.num_q_heads) + "/" + std::to_string(s.num_kv_heads) + " heads " +
         (s.dtype == TreeAttentionDtype::kFloat16 ? "fp16" : "bf16") + " world " +
         std::to_string(world);
}

// A prompt of prompt_tokens with `branches` decode branches of 200 tokens; under the first
// branch a Medusa-like token tree of `drafts` one-token runs, one query each.
TreeCase prompt_branches_and_token_tree(int32_t prompt_tokens, int32_t branches, int32_t drafts,
                                        uint64_t seed) {
  testing::TreeViewBuilder b(16);
  const int32_t prompt = b.add_run(-1, prompt_tokens);
  int32_t first_branch = -1;
  for (int32_t i = 0; i < branches; ++i) {
    const int32_t branch = b.add_run(prompt, 200);
    b.add_query(branch);
    if (i == 0) first_branch = branch;
  }
  std::map<std::vector<int32_t>, int32_t> run_of;
  for (const std::vector<int32_t>& path : testing::medusa_like_paths(drafts)) {
    const std::vector<int32_t> parent_path(path.begin(), path.end() - 1);
    const int32_t parent = parent_path.empty() ? first_branch : run_of.at(parent_path);
    run_of[path] = b.add_run(parent, 1);
    b.add_query(run_of[path]);
  }
  return b.build(seed);
}

// Device copies of the problem's tensors on one rank's device; K/V with NaN (all-ones bits:
// NaN in fp16 and bf16) in every page outside `pages`.
struct RankBuffers {
  int32_t device = 0;
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  void* out = nullptr;

  ~RankBuffers() {
    cudaSetDevice(device);
    for (void* p : {q, k, v, out}) {
      if (p != nullptr) cudaFree(p);
    }
    cudaSetDevice(0);
  }
};

Status cuda_status(cudaError_t e, const char* what) {
  return e == cudaSuccess ? Status::Ok()
                          : Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

Status make_rank_buffers(const GpuAttentionProblem& problem, int32_t device,
                         const std::vector<int32_t>& pages, RankBuffers* b) {
  b->device = device;
  const KvLayout& layout = problem.layout();
  const size_t q_bytes = size_t(problem.num_rows()) * problem.num_q_heads() * layout.head_dim * 2;
  const size_t pool_bytes = size_t(layout.layer_elems()) * 2;
  const size_t page_bytes = size_t(layout.page_elems()) * 2;
  const size_t out_bytes = problem.out_elems() * 2;
  TS_RETURN_IF_ERROR(cuda_status(cudaSetDevice(device), "cudaSetDevice"));
  TS_RETURN_IF_ERROR(cuda_status(cudaMalloc(&b->q, q_bytes), "cudaMalloc(q)"));
  TS_RETURN_IF_ERROR(cuda_status(cudaMalloc(&b->k, pool_bytes), "cudaMalloc(k)"));
  TS_RETURN_IF_ERROR(cuda_status(cudaMalloc(&b->v, pool_bytes), "cudaMalloc(v)"));
  TS_RETURN_IF_ERROR(cuda_status(cudaMalloc(&b->out, out_bytes), "cudaMalloc(out)"));
  TS_RETURN_IF_ERROR(cuda_status(cudaMemcpyPeer(b->q, device, problem.device_q(), 0, q_bytes),
                                 "cudaMemcpyPeer(q)"));
  // out starts as the problem's sentinel, so rows no query names can be checked.
  TS_RETURN_IF_ERROR(cuda_status(cudaMemcpyPeer(b->out, device, problem.device_out(), 0, out_bytes),
                                 "cudaMemcpyPeer(out)"));
  for (int which = 0; which < 2; ++which) {
    char* dst = static_cast<char*>(which == 0 ? b->k : b->v);
    const void* src = which == 0 ? problem.device_k() : problem.device_v();
    TS_RETURN_IF_ERROR(
        cuda_status(cudaMemcpyPeer(dst, device, src, 0, pool_bytes), "cudaMemcpyPeer(pool)"));
    // NaN over each run of pages between two read ones.
    int64_t next = 0;  // first page not yet known to be read
    for (size_t i = 0; i <= pages.size(); ++i) {
      const int64_t read = i < pages.size() ? pages[i] : layout.num_pages;
      if (read > next) {
        TS_RETURN_IF_ERROR(
            cuda_status(cudaMemset(dst + next * page_bytes, 0xff, size_t(read - next) * page_bytes),
                        "cudaMemset(NaN pages)"));
      }
      next = read + 1;
    }
  }
  TS_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "rank buffers"));
  return cuda_status(cudaSetDevice(0), "cudaSetDevice(0)");
}

// Runs the unsplit plan on device 0 and the split one over devices 0 .. world - 1; expects every
// rank's output to match device 0's, and the unsplit plan over the last rank's poisoned pool to
// produce NaN (when that rank does not hold every page).
void expect_sequence_parallel_matches(const TreeCase& tree, const Shape& shape, int32_t world,
                                      uint64_t seed) {
  SCOPED_TRACE(describe(shape, world));
  ASSERT_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop;
  ASSERT_CUDA(cudaGetDeviceProperties(&prop, 0));
  GpuAttentionProblem problem;
  ASSERT_OK(
      problem.init(tree, shape.num_q_heads, shape.num_kv_heads, kHeadDim, shape.dtype, seed, 2.f));
  // The item target of all the GPUs together, so each shard still fills its GPU.
  const AttentionPlanConfig config = tree_attention_plan_config(
      shape.num_q_heads, shape.num_kv_heads, kHeadDim, prop.multiProcessorCount * world);
  AttentionPlan plan;
  ASSERT_OK(build_attention_plan(tree.view, config, &plan));
  std::vector<AttentionPlan> shards;
  // Shards of an unpaired plan pair their branches (where the config pairs), as the bench runs.
  ASSERT_OK(split_plan_for_sequence_parallel(plan, world, &shards,
                                             SequenceParallelCost::kTokensRows, config.pair_heads));

  TreeAttentionWorkspace single;
  ASSERT_OK(single.init(testing::workspace_limits_for({plan}, shape.num_q_heads, kHeadDim)));
  ASSERT_OK(problem.launch(plan, &single, nullptr));
  std::vector<float> want;
  ASSERT_OK(problem.download_out(&want));
  ASSERT_OK(problem.reset_out());  // the ranks' out buffers start from the sentinel

  std::vector<std::unique_ptr<RankBuffers>> buffers;
  std::vector<SequenceParallelAttention::RankTensors> tensors;
  std::vector<int32_t> devices, pages, all_pages;
  plan_read_pages(plan, &all_pages);
  size_t last_rank_pages = 0;
  for (int32_t r = 0; r < world; ++r) {
    plan_read_pages(shards[r], &pages);
    last_rank_pages = pages.size();
    buffers.push_back(std::make_unique<RankBuffers>());
    ASSERT_OK(make_rank_buffers(problem, r, pages, buffers.back().get()));
    tensors.push_back(
        {buffers.back()->q, buffers.back()->k, buffers.back()->v, buffers.back()->out});
    devices.push_back(r);
  }
  SequenceParallelAttention sp;
  ASSERT_OK(sp.init(devices, testing::workspace_limits_for(shards, shape.num_q_heads, kHeadDim)));
  ASSERT_OK(sp.upload(shards));
  const float tolerance =
      shape.dtype == TreeAttentionDtype::kFloat16 ? kFp16Tolerance : kBf16Tolerance;
  // Both combines: peer to peer (when the devices have peer access) and NCCL's.
  for (const bool nccl : {false, true}) {
    sp.use_nccl_combine(nccl);
    SCOPED_TRACE(sp.peer_to_peer() ? "peer-to-peer combine" : "NCCL combine");
    for (int32_t r = 0; r < world; ++r) {  // outputs back to the sentinel
      ASSERT_CUDA(
          cudaMemcpyPeer(buffers[r]->out, r, problem.device_out(), 0, problem.out_elems() * 2));
      ASSERT_CUDA(cudaSetDevice(r));
      ASSERT_CUDA(cudaDeviceSynchronize());  // the ranks' streams do not wait for the copy
    }
    ASSERT_CUDA(cudaSetDevice(0));
    // Three steps: later steps reuse the state buffers earlier ones combined (nothing may
    // accumulate across steps; the peer-to-peer combine alternates two sets).
    for (int step = 0; step < 3; ++step) {
      ASSERT_OK(sp.launch(tensors, shape.dtype, shape.num_q_heads, shape.num_kv_heads, kHeadDim,
                          tree.view.page_size, problem.sm_scale()));
    }
    for (int32_t r = 0; r < world; ++r) {
      ASSERT_CUDA(cudaSetDevice(r));
      ASSERT_CUDA(cudaStreamSynchronize(sp.stream(r)));
      std::vector<float> got;
      ASSERT_OK(testing::download_as_float(tensors[r].out, problem.out_elems(), shape.dtype, &got));
      EXPECT_LE(problem.max_abs_diff(got, want), tolerance) << "rank " << r;
      EXPECT_TRUE(problem.untouched_rows_kept(got)) << "rank " << r << " wrote rows no query names";
    }
    ASSERT_CUDA(cudaSetDevice(0));
  }

  // The poisoning bites: the whole plan over the last rank's pool reads NaN pages.
  if (last_rank_pages < all_pages.size()) {
    const int32_t last = world - 1;
    ASSERT_CUDA(cudaSetDevice(last));
    TreeAttentionWorkspace ws;
    ASSERT_OK(ws.init(testing::workspace_limits_for({plan}, shape.num_q_heads, kHeadDim)));
    ASSERT_OK(ws.upload(plan, nullptr));
    ASSERT_OK(launch_tree_attention(tensors[last].q, tensors[last].k_pool, tensors[last].v_pool,
                                    buffers[last]->out, shape.dtype, shape.num_q_heads,
                                    shape.num_kv_heads, kHeadDim, tree.view.page_size,
                                    problem.sm_scale(), ws, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    std::vector<float> poisoned;
    ASSERT_OK(testing::download_as_float(buffers[last]->out, problem.out_elems(), shape.dtype,
                                         &poisoned));
    // NaN in a partial usually reaches the output; but a batch of partials that are all NaN
    // is skipped by the merge (its max ignores NaN), leaving the rest of the query's tokens:
    // an output that is off by more than the tolerance the ranks met (over 20000+ random
    // tokens, outputs are small: 0.02 seen), not NaN.
    const float diff = problem.max_abs_diff(poisoned, want);
    EXPECT_FALSE(diff <= tolerance) << "the unsplit plan over rank " << last
                                    << "'s pool read no NaN page (max diff " << diff << ")";
    ws.release();
    ASSERT_CUDA(cudaSetDevice(0));
  }
}

std::vector<Shape> shapes_for(int32_t which) {
  const Shape gqa4_fp16{32, 8, TreeAttentionDtype::kFloat16};
  const Shape gqa4_bf16{32, 8, TreeAttentionDtype::kBFloat16};
  const Shape gqa1_fp16{32, 32, TreeAttentionDtype::kFloat16};
  const Shape gqa1_bf16{32, 32, TreeAttentionDtype::kBFloat16};
  switch (which) {
    case 0:
      return {gqa4_fp16, gqa4_bf16, gqa1_fp16};
    case 1:
      return {gqa4_fp16, gqa1_bf16};
    default:
      return {gqa4_fp16, gqa1_fp16};
  }
}

void run_cases(int32_t world) {
  struct Case {
    std::string name;
    TreeCase tree;
  };
  std::vector<Case> cases;
  cases.push_back(
      {"prompt 24000 + 8x200 + token tree 16", prompt_branches_and_token_tree(24000, 8, 16, 1)});
  {
    testing::RandomTreeOptions o;
    o.depth = 4;
    o.max_width = 8;
    o.max_runs = 60;
    o.root_tokens = 20000;
    o.max_run_tokens = 300;
    o.page_size = 16;
    o.prefill_prob = 0.2;
    o.speculative_prob = 0.3;
    o.internal_query_prob = 0.1;
    cases.push_back({"random tree under a 20000-token root", testing::random_tree_case(7, o)});
  }
  cases.push_back({"token tree 64 over 22000",
                   testing::speculative_case(22000, testing::medusa_like_paths(63), 16, 3)});
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    for (const Shape& shape : shapes_for(int32_t(i))) {
      expect_sequence_parallel_matches(cases[i].tree, shape, world, 100 + i);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(SequenceParallelGpu, TwoGpusMatchOneGpu) {
  SKIP_WITHOUT_DEVICES(2);
  run_cases(2);
}

TEST(SequenceParallelGpu, FourGpusMatchOneGpu) {
  SKIP_WITHOUT_DEVICES(4);
  run_cases(4);
}

// More ranks than the plan has start positions: a rank without items still takes part (its
// queries' states are empty: O = 0, LSE = -inf) and gets the full output.
TEST(SequenceParallelGpu, RankWithoutItems) {
  SKIP_WITHOUT_DEVICES(2);
  testing::TreeViewBuilder b(16);
  b.add_query(b.add_run(-1, 40));
  const TreeCase tree = b.build(5);
  AttentionPlan plan;
  ASSERT_OK(build_attention_plan(tree.view, tree_attention_plan_config(32, 8, kHeadDim), &plan));
  ASSERT_EQ(plan.num_items(), 1);
  std::vector<AttentionPlan> shards;
  ASSERT_OK(split_plan_for_sequence_parallel(plan, 2, &shards));
  ASSERT_EQ(shards.size(), 2u);
  ASSERT_EQ(shards[0].num_items() + shards[1].num_items(), 1);  // one of them has none
  expect_sequence_parallel_matches(tree, Shape{}, 2, 9);
}

// launch_tree_attention_state against the CPU executor's states, on whole plans and on shards
// (queries without partials: O = 0, LSE = -inf exactly), head_dim 128 (float4 stores) and 64.
TEST(SequenceParallelGpu, StateMergeMatchesCpuExecutor) {
  SKIP_WITHOUT_DEVICES(1);
  ASSERT_CUDA(cudaSetDevice(0));
  int shard_empty = 0;  // (query, head) pairs some shard has no partial for, over all seeds
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    testing::RandomTreeOptions o;
    o.depth = 3;
    o.max_width = 6;
    o.max_runs = 40;
    // Odd seeds: a long root every query reads (every shard holds part of it, so every query
    // has partials everywhere); even seeds: a short root and long branches, so the shards
    // divide the branches and leave queries without partials.
    o.root_tokens = seed % 2 ? 3000 : 16;
    o.max_run_tokens = seed % 2 ? 200 : 1500;
    o.page_size = 16;
    o.prefill_prob = 0.2;
    o.speculative_prob = 0.3;
    const TreeCase tree = testing::random_tree_case(seed * 31, o);
    const int32_t kv_heads = seed % 2 ? 8 : 4, gqa = seed % 2 ? 4 : 1,
                  head_dim = seed % 3 ? 128 : 64;
    SCOPED_TRACE("seed " + std::to_string(seed));
    GpuAttentionProblem problem;
    ASSERT_OK(problem.init(tree, kv_heads * gqa, kv_heads, head_dim, TreeAttentionDtype::kFloat16,
                           seed, 2.f));
    AttentionPlan plan;
    ASSERT_OK(build_attention_plan(
        tree.view, tree_attention_plan_config(kv_heads * gqa, kv_heads, head_dim), &plan));
    std::vector<AttentionPlan> plans;
    ASSERT_OK(split_plan_for_sequence_parallel(plan, 3, &plans));
    plans.insert(plans.begin(), plan);  // the whole plan, then its 3 shards
    const size_t pairs = tree.view.queries.size() * size_t(kv_heads * gqa);
    float *d_o = nullptr, *d_lse = nullptr;
    ASSERT_CUDA(cudaMalloc(&d_o, pairs * head_dim * 4));
    ASSERT_CUDA(cudaMalloc(&d_lse, pairs * 4));
    TreeAttentionWorkspace ws;
    const TreeAttentionLimits limits =
        testing::workspace_limits_for(plans, kv_heads * gqa, head_dim);
    ASSERT_OK(ws.init(limits));
    for (size_t i = 0; i < plans.size(); ++i) {
      ASSERT_OK(ws.upload(plans[i], nullptr));
      ASSERT_OK(launch_tree_attention_state(
          problem.device_q(), problem.device_k(), problem.device_v(), d_o, d_lse,
          TreeAttentionDtype::kFloat16, kv_heads * gqa, kv_heads, head_dim, tree.view.page_size,
          problem.sm_scale(), ws, nullptr));
      std::vector<float> o(pairs * head_dim), lse(pairs), want_o, want_lse;
      ASSERT_CUDA(cudaMemcpy(o.data(), d_o, o.size() * 4, cudaMemcpyDeviceToHost));
      ASSERT_CUDA(cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost));
      ASSERT_OK(problem.reference_plan_state(plans[i], &want_o, &want_lse));
      float worst_o = 0.f, worst_lse = 0.f;
      for (size_t e = 0; e < o.size(); ++e) {
        const float d = std::fabs(o[e] - want_o[e]);
        worst_o = std::isnan(d) ? INFINITY : std::max(worst_o, d);
      }
      int empty = 0;
      for (size_t pr = 0; pr < pairs; ++pr) {
        if (want_lse[pr] == -INFINITY) {  // no partial: exactly the empty state
          ++empty;
          EXPECT_EQ(lse[pr], -INFINITY) << "plan " << i << " pair " << pr;
          EXPECT_EQ(o[pr * head_dim], 0.f) << "plan " << i << " pair " << pr;
          continue;
        }
        const float d = std::fabs(lse[pr] - want_lse[pr] * 1.4426950408889634f);  // base 2
        worst_lse = std::isnan(d) ? INFINITY : std::max(worst_lse, d);
      }
      EXPECT_LE(worst_o, kFp16Tolerance) << "plan " << i;
      EXPECT_LE(worst_lse, 1e-3f) << "plan " << i;
      if (i > 0) shard_empty += empty;
    }
    ws.release();
    cudaFree(d_o);
    cudaFree(d_lse);
  }
  EXPECT_GT(shard_empty, 0) << "no shard left a query without partials";
}

TEST(SequenceParallelGpu, RejectsBadArguments) {
  SKIP_WITHOUT_DEVICES(1);
  SequenceParallelAttention sp;
  Status s = sp.init({0, 0}, TreeAttentionLimits{});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  s = sp.init({testing::cuda_device_count()}, TreeAttentionLimits{});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  s = sp.upload({});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.ToString();
  ASSERT_OK(sp.init({0}, TreeAttentionLimits{}));
  s = sp.upload({AttentionPlan{}, AttentionPlan{}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  s = sp.launch({}, TreeAttentionDtype::kFloat16, 32, 8, kHeadDim, 16, 1.f);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
}

}  // namespace
}  // namespace treeserve
