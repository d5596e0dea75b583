// bench_sequence_parallel: tree attention over long shared prompts, one GPU (launch_tree_attention)
// against sequence parallelism over `world` GPUs (SequenceParallelAttention: the whole step, each
// rank's stage 1 and state merge over its shard of the plan, then the combine: one peer-to-peer
// kernel per rank where the GPUs have peer access, NCCL's all-reduces with --nccl-combine or
// without peer access). Few-shot shapes: a 32k or 128k-token prompt with 8 or 64 decode
// branches of 200 tokens; one layer, Llama-3-8B attention (32 q / 8 kv heads, head_dim 128),
// fp16, page 16.
//
// Per case: unique KV MB, median times over reps with CUDA events (L2 flushed on every GPU
// before each rep, as bench_tree_attention does), achieved TB/s (unique KV bytes / time), the IO
// bound (unique KV / (GPUs x device-to-device copy bandwidth of device 0)), the speedup, and how
// the SP step splits: `local` = until the slowest rank's states are ready, `combine` = the
// all-reduces and kernels after it, each rank's local time (balance), and the max abs difference
// between the SP output (rank 0) and the one-GPU output.
//
// Timing across GPUs: every rank records start, local-done and end events on its stream. The
// ranks' starts differ by the host's enqueue skew (microseconds), which a real step would not
// have; the step is therefore measured from the latest start: min over ranks of (end - start),
// the ends being aligned by the all-reduce. combine = min over ranks of (end - local-done)
// (the rank that finished its local work last), local = step - combine.
//
// `--wide-always` / `--no-wide` set the wide kernel's mode (TreeAttentionLimits::wide_kernel:
// kAlways / kOff; default kAuto) for the one-GPU launch and every rank alike;
// `--split-cost blocks` weighs the split's items by stage 1's block model
// (SequenceParallelCost::kBlocks) instead of tokens x rows. `--step-only` records no event
// between a rank's local work and its combine, so the combine's programmatic launch can
// overlap the local merge as in a real step (the local / combine split then reads 0).
// `--no-pair-shards` leaves the shards of a plan the builder did not pair unpaired (the split's
// pair_heads 0).
//
// usage: bench_sequence_parallel [--world N] [--reps N] [--filter SUBSTR] [--no-flush]
//        [--json PATH] [--nccl-combine] [--wide-always | --no-wide] [--split-cost rows|blocks]
//        [--step-only] [--no-pair-shards]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench/tree_attention/bench_util.h"
#include "kernels/attention_plan.h"
#include "kernels/detail/tree_attention_launch.h"
#include "kernels/sequence_parallel.h"
#include "kernels/sequence_parallel_attention.h"
#include "kernels/testing/gpu_attention_harness.h"
#include "kernels/testing/random_tree.h"
#include "kernels/tree_attention.h"

namespace treeserve {
namespace {

using bench::copy_bandwidth;
using bench::median;

constexpr int32_t kQHeads = 32, kKvHeads = 8, kHeadDim = 128;
constexpr size_t kFlushBytes = size_t(256) << 20;  // > L2 (50 MB H100, 60 MB H200)

struct Options {
  int32_t world = 2;
  int reps = 50;
  bool flush_l2 = true;
  std::string filter;
  std::string json_path;
  bool nccl_combine = false;  // force the NCCL combine (to compare with the peer-to-peer one)
  TreeAttentionLimits::Wide wide = TreeAttentionLimits::Wide::kAuto;
  SequenceParallelCost split_cost = SequenceParallelCost::kTokensRows;
  bool step_only = false;   // no local-done event (local / combine not split)
  bool pair_shards = true;  // the split pairs an unpaired plan's shards
};

// The workspace limits for plans, with the wide kernel's mode from the options.
TreeAttentionLimits limits_for(const std::vector<AttentionPlan>& plans, const Options& opt) {
  TreeAttentionLimits l = testing::workspace_limits_for(plans, kQHeads, kHeadDim);
  l.wide_kernel = opt.wide;
  return l;
}

struct Case {
  std::string name;
  testing::TreeCase tree;
};

struct Result {
  std::string name;
  int32_t queries = 0, items = 0;
  std::vector<int32_t> rank_items;
  double unique_mb = 0, bound_us = 0, sp_bound_us = 0;
  double single_us = 0, single_tbps = 0;
  double sp_us = 0, sp_tbps = 0, speedup = 0, local_us = 0, combine_us = 0;
  std::vector<double> rank_local_us;
  float max_diff = 0;
};

// Per device: events for one rep and an L2 flush buffer.
struct DeviceTiming {
  int32_t device = 0;
  cudaEvent_t start = nullptr, local_done = nullptr, end = nullptr;
  void* flush = nullptr;  // kFlushBytes + 16 (the last 16: the flush kernel's sink)
};

std::vector<DeviceTiming> make_timing(int32_t world) {
  std::vector<DeviceTiming> t(world);
  for (int32_t r = 0; r < world; ++r) {
    CHECK_CUDA(cudaSetDevice(r));
    t[r].device = r;
    CHECK_CUDA(cudaEventCreate(&t[r].start));
    CHECK_CUDA(cudaEventCreate(&t[r].local_done));
    CHECK_CUDA(cudaEventCreate(&t[r].end));
    CHECK_CUDA(cudaMalloc(&t[r].flush, kFlushBytes + 16));
    CHECK_CUDA(cudaMemset(t[r].flush, 1, kFlushBytes + 16));
  }
  CHECK_CUDA(cudaSetDevice(0));
  return t;
}

void free_timing(std::vector<DeviceTiming>* t) {
  for (DeviceTiming& d : *t) {
    CHECK_CUDA(cudaSetDevice(d.device));
    CHECK_CUDA(cudaEventDestroy(d.start));
    CHECK_CUDA(cudaEventDestroy(d.local_done));
    CHECK_CUDA(cudaEventDestroy(d.end));
    CHECK_CUDA(cudaFree(d.flush));
  }
  CHECK_CUDA(cudaSetDevice(0));
}

float elapsed_us(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
  return ms * 1e3f;
}

void flush(const DeviceTiming& d, cudaStream_t stream, bool enabled) {
  if (!enabled) return;
  CHECK_CUDA(cudaSetDevice(d.device));
  testing::flush_l2_by_reading(d.flush, kFlushBytes, static_cast<char*>(d.flush) + kFlushBytes,
                               stream);
}

// A rank's copies of the problem's tensors (the whole pool: placement is not what is timed).
struct RankCopy {
  int32_t device = 0;
  void *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
};

RankCopy copy_to(const testing::GpuAttentionProblem& problem, int32_t device) {
  RankCopy c;
  c.device = device;
  const size_t q_bytes = size_t(problem.num_rows()) * kQHeads * kHeadDim * 2;
  const size_t pool_bytes = size_t(problem.layout().layer_elems()) * 2;
  CHECK_CUDA(cudaSetDevice(device));
  CHECK_CUDA(cudaMalloc(&c.q, q_bytes));
  CHECK_CUDA(cudaMalloc(&c.k, pool_bytes));
  CHECK_CUDA(cudaMalloc(&c.v, pool_bytes));
  CHECK_CUDA(cudaMalloc(&c.out, problem.out_elems() * 2));
  CHECK_CUDA(cudaMemcpyPeer(c.q, device, problem.device_q(), 0, q_bytes));
  CHECK_CUDA(cudaMemcpyPeer(c.k, device, problem.device_k(), 0, pool_bytes));
  CHECK_CUDA(cudaMemcpyPeer(c.v, device, problem.device_v(), 0, pool_bytes));
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaSetDevice(0));
  return c;
}

void free_copy(const RankCopy& c) {
  CHECK_CUDA(cudaSetDevice(c.device));
  for (void* p : {c.q, c.k, c.v, c.out}) CHECK_CUDA(cudaFree(p));
  CHECK_CUDA(cudaSetDevice(0));
}

Result run_case(const Case& c, int32_t num_sms, double copy_bw, const Options& opt,
                std::vector<DeviceTiming>* timing) {
  const int32_t world = opt.world;
  Result r;
  r.name = c.name;
  r.queries = int32_t(c.tree.view.queries.size());
  const int64_t unique = view_unique_kv_bytes(c.tree.view, kKvHeads, kHeadDim, 2);
  r.unique_mb = double(unique) / 1e6;
  r.bound_us = double(unique) / copy_bw * 1e6;
  r.sp_bound_us = r.bound_us / world;

  CHECK_CUDA(cudaSetDevice(0));
  testing::GpuAttentionProblem problem;
  CHECK_OK(
      problem.init(c.tree, kQHeads, kKvHeads, kHeadDim, TreeAttentionDtype::kFloat16, 1234, 2.f));
  const float scale = problem.sm_scale();
  const int32_t page_size = c.tree.view.page_size;

  // One GPU: the plan for its SMs.
  AttentionPlan plan;
  CHECK_OK(build_attention_plan(
      c.tree.view, tree_attention_plan_config(kQHeads, kKvHeads, kHeadDim, num_sms), &plan));
  r.items = plan.num_items();
  TreeAttentionWorkspace ws;
  CHECK_OK(ws.init(limits_for({plan}, opt)));
  CHECK_OK(ws.upload(plan, nullptr));
  CHECK_OK(problem.launch_uploaded(ws, nullptr));
  std::vector<float> single_out;
  CHECK_OK(problem.download_out(&single_out));
  std::vector<double> us;
  DeviceTiming& t0 = (*timing)[0];
  for (int i = 0; i < opt.reps + 3; ++i) {
    flush(t0, nullptr, opt.flush_l2);
    CHECK_CUDA(cudaEventRecord(t0.start));
    CHECK_OK(problem.launch_uploaded(ws, nullptr));
    CHECK_CUDA(cudaEventRecord(t0.end));
    CHECK_CUDA(cudaEventSynchronize(t0.end));
    if (i >= 3) us.push_back(elapsed_us(t0.start, t0.end));
  }
  r.single_us = median(us);
  r.single_tbps = double(unique) / (r.single_us * 1e-6) / 1e12;
  ws.release();

  // Sequence parallel: the plan for all GPUs' SMs, split; each rank a full copy of q and KV.
  AttentionPlan sp_plan;
  const AttentionPlanConfig sp_config =
      tree_attention_plan_config(kQHeads, kKvHeads, kHeadDim, num_sms * world);
  CHECK_OK(build_attention_plan(c.tree.view, sp_config, &sp_plan));
  std::vector<AttentionPlan> shards;
  CHECK_OK(split_plan_for_sequence_parallel(sp_plan, world, &shards, opt.split_cost,
                                            opt.pair_shards ? sp_config.pair_heads : 0));
  for (const AttentionPlan& s : shards) r.rank_items.push_back(s.num_items());
  std::vector<RankCopy> copies;
  std::vector<SequenceParallelAttention::RankTensors> tensors;
  std::vector<int32_t> devices;
  for (int32_t rank = 0; rank < world; ++rank) {
    copies.push_back(copy_to(problem, rank));
    tensors.push_back({copies.back().q, copies.back().k, copies.back().v, copies.back().out});
    devices.push_back(rank);
  }
  SequenceParallelAttention sp;
  CHECK_OK(sp.init(devices, limits_for(shards, opt)));
  sp.use_nccl_combine(opt.nccl_combine);
  CHECK_OK(sp.upload(shards));
  CHECK_OK(sp.launch(tensors, TreeAttentionDtype::kFloat16, kQHeads, kKvHeads, kHeadDim, page_size,
                     scale));
  CHECK_CUDA(cudaStreamSynchronize(sp.stream(0)));
  std::vector<float> sp_out;
  CHECK_OK(testing::download_as_float(copies[0].out, problem.out_elems(),
                                      TreeAttentionDtype::kFloat16, &sp_out));
  r.max_diff = problem.max_abs_diff(sp_out, single_out);

  std::vector<double> step, combine;
  std::vector<std::vector<double>> rank_local(world);
  for (int i = 0; i < opt.reps + 3; ++i) {
    // All flushes first, so the host has enqueued the rest while they run (small start skew).
    for (int32_t rank = 0; rank < world; ++rank)
      flush((*timing)[rank], sp.stream(rank), opt.flush_l2);
    for (int32_t rank = 0; rank < world; ++rank) {
      CHECK_CUDA(cudaSetDevice(rank));
      CHECK_CUDA(cudaEventRecord((*timing)[rank].start, sp.stream(rank)));
    }
    CHECK_OK(sp.launch_local(tensors, TreeAttentionDtype::kFloat16, kQHeads, kKvHeads, kHeadDim,
                             page_size, scale));
    for (int32_t rank = 0; rank < world && !opt.step_only; ++rank) {
      CHECK_CUDA(cudaSetDevice(rank));
      CHECK_CUDA(cudaEventRecord((*timing)[rank].local_done, sp.stream(rank)));
    }
    CHECK_OK(sp.combine(tensors, TreeAttentionDtype::kFloat16, kQHeads, kHeadDim));
    for (int32_t rank = 0; rank < world; ++rank) {
      CHECK_CUDA(cudaSetDevice(rank));
      CHECK_CUDA(cudaEventRecord((*timing)[rank].end, sp.stream(rank)));
    }
    double step_us = 1e30, combine_us = opt.step_only ? 0 : 1e30;
    for (int32_t rank = 0; rank < world; ++rank) {
      const DeviceTiming& t = (*timing)[rank];
      CHECK_CUDA(cudaEventSynchronize(t.end));
      step_us = std::min<double>(step_us, elapsed_us(t.start, t.end));
      if (opt.step_only) continue;
      combine_us = std::min<double>(combine_us, elapsed_us(t.local_done, t.end));
      if (i >= 3) rank_local[rank].push_back(elapsed_us(t.start, t.local_done));
    }
    if (i >= 3) {
      step.push_back(step_us);
      combine.push_back(combine_us);
    }
  }
  CHECK_CUDA(cudaSetDevice(0));
  r.sp_us = median(step);
  r.combine_us = median(combine);
  r.local_us = opt.step_only ? 0 : r.sp_us - r.combine_us;  // step only: not split
  for (const auto& v : rank_local) r.rank_local_us.push_back(v.empty() ? 0 : median(v));
  r.sp_tbps = double(unique) / (r.sp_us * 1e-6) / 1e12;
  r.speedup = r.single_us / r.sp_us;
  sp.release();
  for (const RankCopy& copy : copies) free_copy(copy);
  return r;
}

std::string join(const std::vector<double>& v, const char* fmt) {
  std::string s;
  char buf[32];
  for (size_t i = 0; i < v.size(); ++i) {
    std::snprintf(buf, sizeof(buf), fmt, v[i]);
    if (i > 0) s += '/';
    s += buf;
  }
  return s;
}

void write_json(const std::string& path, const std::string& device, int32_t world, double copy_bw,
                const std::vector<Result>& results) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return;
  }
  std::fprintf(f,
               "{\n  \"device\": \"%s\",\n  \"world\": %d,\n  \"copy_bandwidth_tbps\": %.4f,\n"
               "  \"cases\": [\n",
               device.c_str(), world, copy_bw / 1e12);
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    std::string items, local;
    for (size_t k = 0; k < r.rank_items.size(); ++k) {
      if (k > 0) items += ", ";
      items += std::to_string(r.rank_items[k]);
    }
    local = join(r.rank_local_us, "%.2f");
    for (char& ch : local) ch = ch == '/' ? ',' : ch;
    std::fprintf(f,
                 "    {\"name\": \"%s\", \"num_q_heads\": %d, \"num_kv_heads\": %d, \"head_dim\": "
                 "%d, \"dtype\": \"fp16\", \"queries\": %d, \"items\": %d, \"rank_items\": [%s], "
                 "\"unique_kv_mb\": %.3f, \"io_bound_us\": %.2f, \"sp_io_bound_us\": %.2f, "
                 "\"single_us\": %.2f, \"single_tbps\": %.3f, \"sp_us\": %.2f, \"sp_tbps\": %.3f, "
                 "\"speedup\": %.3f, \"sp_local_us\": %.2f, \"sp_combine_us\": %.2f, "
                 "\"combine_fraction\": %.3f, \"rank_local_us\": [%s], \"max_abs_diff\": %.3g}%s\n",
                 r.name.c_str(), kQHeads, kKvHeads, kHeadDim, r.queries, r.items, items.c_str(),
                 r.unique_mb, r.bound_us, r.sp_bound_us, r.single_us, r.single_tbps, r.sp_us,
                 r.sp_tbps, r.speedup, r.local_us, r.combine_us, r.combine_us / r.sp_us,
                 local.c_str(), r.max_diff, i + 1 < results.size() ? "," : "");
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
    if (a == "--world") {
      opt.world = std::atoi(next().c_str());
    } else if (a == "--reps") {
      opt.reps = std::max(1, std::atoi(next().c_str()));
    } else if (a == "--filter") {
      opt.filter = next();
    } else if (a == "--no-flush") {
      opt.flush_l2 = false;
    } else if (a == "--json") {
      opt.json_path = next();
    } else if (a == "--nccl-combine") {
      opt.nccl_combine = true;
    } else if (a == "--wide-always") {
      opt.wide = TreeAttentionLimits::Wide::kAlways;
    } else if (a == "--no-wide") {
      opt.wide = TreeAttentionLimits::Wide::kOff;
    } else if (a == "--split-cost") {
      const std::string v = next();
      if (v != "rows" && v != "blocks") {
        std::fprintf(stderr, "--split-cost: rows or blocks, not %s\n", v.c_str());
        return 2;
      }
      opt.split_cost =
          v == "blocks" ? SequenceParallelCost::kBlocks : SequenceParallelCost::kTokensRows;
    } else if (a == "--step-only") {
      opt.step_only = true;
    } else if (a == "--no-pair-shards") {
      opt.pair_shards = false;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--world N] [--reps N] [--filter SUBSTR] [--no-flush] "
                   "[--json PATH] [--nccl-combine] [--wide-always | --no-wide] "
                   "[--split-cost rows|blocks] [--step-only] [--no-pair-shards]\n",
                   argv[0]);
      return 2;
    }
  }
  const int32_t devices = testing::cuda_device_count();
  if (opt.world < 2 || devices < opt.world) {
    std::printf(
        "sequence-parallel bench skipped: --world %d needs >= 2 and at most the %d CUDA "
        "device(s) present\n",
        opt.world, devices);
    return 0;
  }
  CHECK_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const double copy_bw = copy_bandwidth();
  std::printf("device: %s x %d, %d SMs, L2 %.0f MB; d2d copy bandwidth %.3f TB/s (device 0)\n",
              prop.name, opt.world, prop.multiProcessorCount, prop.l2CacheSize / 1e6,
              copy_bw / 1e12);
  std::printf(
      "fp16, 32 q / 8 kv heads, head_dim 128, one layer, page 16, L2 %s before each "
      "rep, median of %d; combine: %s; wide kernel %s; split cost %s%s%s\n\n",
      opt.flush_l2 ? "flushed" : "NOT flushed", opt.reps,
      opt.nccl_combine ? "NCCL all-reduces (forced)" : "peer to peer where the GPUs allow it",
      opt.wide == TreeAttentionLimits::Wide::kAlways ? "wherever a plan has pairs (--wide-always)"
      : opt.wide == TreeAttentionLimits::Wide::kOff  ? "off (--no-wide)"
                                                     : "where it pays",
      opt.split_cost == SequenceParallelCost::kBlocks ? "stage 1's blocks (--split-cost blocks)"
                                                      : "tokens x rows",
      opt.step_only ? "; step only (no local-done event: local / combine columns 0)" : "",
      opt.pair_shards ? "" : "; shards of unpaired plans left unpaired (--no-pair-shards)");
  std::printf("%-22s %5s %6s %9s %8s %9s %6s %8s %9s %6s %7s %8s %8s %6s %15s %9s\n", "case", "q",
              "items", "uniqMB", "1gpu_us", "bound", "TB/s", "sp_us", "sp_bound", "TB/s", "speedup",
              "local", "combine", "%comb", "rank_local_us", "max_diff");
  std::vector<Case> cases;
  for (int32_t prompt : {32768, 131072}) {
    for (int32_t branches : {8, 64}) {
      cases.push_back(
          {"P=" + std::to_string(prompt / 1024) + "k + " + std::to_string(branches) + "x200",
           testing::few_shot_case(prompt, branches, 200, 16, 4)});
    }
  }
  std::vector<DeviceTiming> timing = make_timing(opt.world);
  std::vector<Result> results;
  for (const Case& c : cases) {
    if (!opt.filter.empty() && c.name.find(opt.filter) == std::string::npos) continue;
    const Result r = run_case(c, prop.multiProcessorCount, copy_bw, opt, &timing);
    std::printf(
        "%-22s %5d %6d %9.2f %8.2f %9.2f %6.2f %8.2f %9.2f %6.2f %7.2f %8.2f %8.2f %6.1f "
        "%15s %9.2e\n",
        r.name.c_str(), r.queries, r.items, r.unique_mb, r.single_us, r.bound_us, r.single_tbps,
        r.sp_us, r.sp_bound_us, r.sp_tbps, r.speedup, r.local_us, r.combine_us,
        100 * r.combine_us / r.sp_us, join(r.rank_local_us, "%.1f").c_str(), r.max_diff);
    std::fflush(stdout);
    results.push_back(r);
  }
  free_timing(&timing);
  std::printf(
      "\nbound = unique KV bytes / copy bandwidth (sp_bound: / GPUs); TB/s = unique KV bytes / "
      "time; sp_us = the whole step from the latest rank's start; local = until the slowest rank's "
      "states are ready, combine = the all-reduces and kernels after it; rank_local_us = each "
      "rank's own local time; max_diff = SP (rank 0) vs one GPU.\n");
  if (!opt.json_path.empty()) write_json(opt.json_path, prop.name, opt.world, copy_bw, results);
  return 0;
}

}  // namespace
}  // namespace treeserve

int main(int argc, char** argv) { return treeserve::main_impl(argc, argv); }
