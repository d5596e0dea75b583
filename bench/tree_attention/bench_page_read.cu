// bench_page_read: the floors under tree attention's figures, measured the way
// bench_tree_attention measures (cudaEvent time around the launches, L2 flushed by reading
// before each repetition, median):
//  - launch floors: empty grids alone and followed by a programmatic dependent grid (stage 1
//    and the merge grid's shape);
//  - page-read floors: reading a few-shot tree's KV pages (the unit of a read is one page of
//    one kv head: 16 slots x 128 dims x fp16 = 4 KB, K and V apart, pages shuffled over a pool
//    4x the tree's) with plain loads, cp.async or bulk copies, once each, and with the prompt's
//    pages read once per 64-row query tile as stage 1's wide items read them;
//  - with --cluster, the same reads in clusters of 4 CTAs, the prompt's pages multicast to the
//    4 (bulk copies with .multicast::cluster), against each CTA reading for itself.
// No kernel here attends: these are the costs any kernel reading the same bytes pays.
//
// With --in-order, the pool's pages hold the tree's in order (no shuffle, no unused pages).
//
// usage: bench_page_read [--reps N] [--cluster] [--in-order]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/tree_attention/bench_util.h"
#include "kernels/detail/pdl_launch.cuh"
#include "kernels/testing/gpu_attention_harness.h"

namespace {

constexpr int kUnit = 4096;  // one page of one kv head: 16 slots x 128 dims x 2 bytes
constexpr int kHeads = 8;    // Llama-3-8B's kv heads
constexpr uint32_t kNever = 0x9e3779b9u;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__global__ void empty_grid(int) {}
__global__ void empty_dependent_grid(int) { treeserve::detail::pdl_wait(); }

// Block b reads units [n b / grid, n (b + 1) / grid): 256 threads, 16 bytes each a unit, R
// units in flight a thread.
template <int R>
__global__ void __launch_bounds__(256)
    read_ldg(const char* base, const int64_t* units, int n, uint32_t* sink) {
  const int u0 = int(int64_t(n) * blockIdx.x / gridDim.x);
  const int u1 = int(int64_t(n) * (blockIdx.x + 1) / gridDim.x);
  uint32_t acc = 0;
  for (int u = u0; u < u1; u += R) {
    uint4 v[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      v[r] = u + r < u1 ? __ldg(reinterpret_cast<const uint4*>(base + units[u + r]) + threadIdx.x)
                        : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc ^= v[r].x ^ v[r].y ^ v[r].z ^ v[r].w;
  }
  if (acc == kNever) *sink = acc;
}

// cp.async (16 bytes a thread a copy) into a ring of S stages of G units, 128 threads, as
// stage 1 loads (S = 2, G = 8: two 32 KB stages, one in flight while the other is read).
template <int S, int G>
__global__ void __launch_bounds__(128)
    read_cp_async(const char* base, const int64_t* units, int n, uint32_t* sink) {
  extern __shared__ __align__(1024) char ring[];
  const int u0 = int(int64_t(n) * blockIdx.x / gridDim.x);
  const int u1 = int(int64_t(n) * (blockIdx.x + 1) / gridDim.x);
  const int steps = (u1 - u0 + G - 1) / G;
  auto issue = [&](int step) {
    if (step < steps) {
      char* dst = ring + (step % S) * G * kUnit;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int u = u0 + step * G + g;
        if (u >= u1) break;
        const char* src = base + units[u];
#pragma unroll
        for (int c = 0; c < kUnit / 16 / 128; ++c) {
          const int off = (c * 128 + threadIdx.x) * 16;
          asm volatile(
              "cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst + g * kUnit + off)),
              "l"(src + off));
        }
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  for (int s = 0; s < S - 1; ++s) issue(s);
  uint32_t acc = 0;
  for (int step = 0; step < steps; ++step) {
    issue(step + S - 1);
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 1));
    __syncthreads();
    acc ^= reinterpret_cast<const uint32_t*>(ring + (step % S) * G * kUnit)[threadIdx.x];
    __syncthreads();
  }
  if (acc == kNever) *sink = acc;
}

__device__ __forceinline__ void wait_parity(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::
          "r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// Bulk copies (cp.async.bulk, one 4 KB unit a copy, one thread issuing) into a ring of S stages
// of G units, an mbarrier a stage.
template <int S, int G>
__global__ void __launch_bounds__(128)
    read_bulk(const char* base, const int64_t* units, int n, uint32_t* sink) {
  extern __shared__ __align__(1024) char ring[];
  __shared__ __align__(8) uint64_t full[S];
  const int u0 = int(int64_t(n) * blockIdx.x / gridDim.x);
  const int u1 = int(int64_t(n) * (blockIdx.x + 1) / gridDim.x);
  const int steps = (u1 - u0 + G - 1) / G;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s)
      asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(smem_u32(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  auto issue = [&](int step) {
    const int s = step % S, count = min(G, u1 - (u0 + step * G));
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(smem_u32(&full[s])),
                 "r"(count * kUnit));
    for (int g = 0; g < count; ++g) {
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
          "[%3];" ::"r"(smem_u32(ring + (s * G + g) * kUnit)),
          "l"(base + units[u0 + step * G + g]), "r"(kUnit), "r"(smem_u32(&full[s]))
          : "memory");
    }
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < S && s < steps; ++s) issue(s);
  }
  uint32_t acc = 0;
  for (int step = 0; step < steps; ++step) {
    wait_parity(&full[step % S], (step / S) & 1);
    acc ^= reinterpret_cast<const uint32_t*>(ring + (step % S) * G * kUnit)[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0 && step + S < steps) issue(step + S);
  }
  if (acc == kNever) *sink = acc;
}

// Clusters of 4 CTAs: the first `prompt_clusters` read the prompt's units (the first
// `prompt_units` of the list; each cluster a range, all 4 CTAs consuming every unit of it, as
// stage 1's query tiles of one chunk), the other CTAs the branches' units alone. multicast: the
// 4 CTAs split each stage's copies and multicast them to all 4 (the prompt read once), with an
// empty barrier a stage that all 4 release; else each CTA copies its range itself (4 reads).
// Bulk copies, 2 stages of 8 units.
__global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(128)
    read_cluster(const char* base, const int64_t* units, int prompt_units, int branch_units,
                 int prompt_clusters, int multicast, uint32_t* sink) {
  constexpr int S = 2, G = 8;
  extern __shared__ __align__(1024) char ring[];
  __shared__ __align__(8) uint64_t full[S], empty[S];
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  const int cluster = blockIdx.x / 4;
  const bool prompt = cluster < prompt_clusters;
  int u0, u1;
  if (prompt) {
    u0 = int(int64_t(prompt_units) * cluster / prompt_clusters);
    u1 = int(int64_t(prompt_units) * (cluster + 1) / prompt_clusters);
  } else {
    const int blocks = gridDim.x - 4 * prompt_clusters, b = blockIdx.x - 4 * prompt_clusters;
    u0 = prompt_units + int(int64_t(branch_units) * b / blocks);
    u1 = prompt_units + int(int64_t(branch_units) * (b + 1) / blocks);
  }
  const bool mc = prompt && multicast != 0;
  const int steps = (u1 - u0 + G - 1) / G;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(smem_u32(&full[s])));
      asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem_u32(&empty[s])),
                   "r"(mc ? 4 : 1));
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  // Every CTA's barriers are set before a peer's copy or arrive reaches them.
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
  auto issue = [&](int step) {
    const int s = step % S, count = min(G, u1 - (u0 + step * G));
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(smem_u32(&full[s])),
                 "r"(count * kUnit));
    for (int g = 0; g < count; ++g) {
      const uint32_t dst = smem_u32(ring + (s * G + g) * kUnit);
      const char* src = base + units[u0 + step * G + g];
      if (!mc) {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(dst),
            "l"(src), "r"(kUnit), "r"(smem_u32(&full[s]))
            : "memory");
      } else if (g % 4 == int(rank)) {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
            "[%0], [%1], %2, [%3], %4;" ::"r"(dst),
            "l"(src), "r"(kUnit), "r"(smem_u32(&full[s])), "h"(uint16_t(0xF))
            : "memory");
      }
    }
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < S && s < steps; ++s) issue(s);
  }
  uint32_t acc = 0;
  for (int step = 0; step < steps; ++step) {
    const int s = step % S;
    const uint32_t parity = (step / S) & 1;
    wait_parity(&full[s], parity);
    acc ^= reinterpret_cast<const uint32_t*>(ring + s * G * kUnit)[threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
      // This CTA is done with stage s: release it to every CTA that writes into it.
      for (uint32_t r = 0; r < (mc ? 4u : 1u); ++r) {
        uint32_t bar = smem_u32(&empty[s]);
        if (mc) asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(bar) : "r"(bar), "r"(r));
        asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(bar)
                     : "memory");
      }
      if (step + S < steps) {
        wait_parity(&empty[s], parity);
        issue(step + S);
      }
    }
  }
  // No CTA exits while a peer may still copy into it or arrive on its barriers.
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
  if (acc == kNever) *sink = acc;
}

// A few-shot tree's pages: `pages` pages (16 tokens each) of which the first `prompt` are the
// prompt's; units listed head-major (a block reads one head's pages in order, K then V of a
// page), the prompt's `reads` times (once per query tile), then the branches'.
struct Tree {
  const char* name;
  int pages, prompt, reads;
  int prompt_clusters;  // --cluster: clusters of 4 reading the prompt (0: not run)
};

std::vector<int64_t> tree_units(const Tree& t, int reads, const std::vector<int>& slot,
                                int64_t pool_pages) {
  const int64_t page_bytes = int64_t(kHeads) * kUnit, v_base = pool_pages * page_bytes;
  std::vector<int64_t> units;
  auto add = [&](int p0, int p1) {
    for (int h = 0; h < kHeads; ++h) {
      for (int p = p0; p < p1; ++p) {
        units.push_back(slot[p] * page_bytes + h * kUnit);
        units.push_back(v_base + slot[p] * page_bytes + h * kUnit);
      }
    }
  };
  for (int r = 0; r < reads; ++r) add(0, t.prompt);
  add(t.prompt, t.pages);
  return units;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 30;
  bool cluster = false;
  bool in_order = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc) {
      reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--cluster") {
      cluster = true;
    } else if (a == "--in-order") {
      in_order = true;
    } else {
      std::fprintf(stderr, "usage: %s [--reps N] [--cluster] [--in-order]\n", argv[0]);
      return 2;
    }
  }
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const double copy_bw = treeserve::bench::copy_bandwidth();
  std::printf(
      "device: %s, %d SMs; d2d copy bandwidth %.3f TB/s (read + write); median of %d, "
      "L2 flushed before each; pages %s\n\n",
      prop.name, sms, copy_bw / 1e12, reps,
      in_order ? "in order (--in-order)" : "shuffled over a pool 4x the tree's");
  treeserve::bench::Timer timer(true, nullptr);
  // Each figure: the timer's median, then any launch error fails the run.
  auto us = [&](auto launch) {
    const double t = timer.median_us(reps, launch);
    CHECK_CUDA(cudaGetLastError());
    return t;
  };
  uint32_t* sink;
  CHECK_CUDA(cudaMalloc(&sink, 64));

  const int stage1_smem = 92 << 10;  // about stage 1's block at few-shot b=50
  CHECK_CUDA(
      cudaFuncSetAttribute(empty_grid, cudaFuncAttributeMaxDynamicSharedMemorySize, stage1_smem));
  std::printf("launch floors (event time, us)\n");
  std::printf("  one empty block                                   %6.2f\n",
              us([] { empty_grid<<<1, 128>>>(0); }));
  std::printf("  %3d empty blocks of %d KB shared                 %6.2f\n", 2 * sms,
              stage1_smem >> 10, us([&] { empty_grid<<<2 * sms, 128, stage1_smem>>>(0); }));
  std::printf("  the same + a dependent grid of 400 blocks         %6.2f\n", us([&] {
                empty_grid<<<2 * sms, 128, stage1_smem>>>(0);
                CHECK_CUDA(treeserve::detail::launch_pdl(dim3(400), dim3(128), 0, nullptr,
                                                         empty_dependent_grid, 0));
              }));

  // b=50's 40 prompt clusters are stage 1's 160 wide blocks (5 chunks x 4 query tiles x 8 kv
  // heads), the other 104 CTAs its 100 paired ones.
  const Tree trees[] = {{"few-shot P=4000 + 20x200", 500, 250, 2, 0},
                        {"few-shot P=4000 + 30x200", 625, 250, 2, 0},
                        {"few-shot P=4000 + 50x200", 875, 250, 4, 40},
                        {"few-shot P=16000 + 64x200", 1800, 1000, 4, 0}};
  int64_t pool_pages = 0;
  for (const Tree& t : trees) pool_pages = std::max<int64_t>(pool_pages, 4 * t.pages);
  char* pool;
  const size_t pool_bytes = size_t(2 * pool_pages) * kHeads * kUnit;
  CHECK_CUDA(cudaMalloc(&pool, pool_bytes));
  CHECK_CUDA(cudaMemset(pool, 3, pool_bytes));
  std::vector<int> slot(pool_pages);
  std::iota(slot.begin(), slot.end(), 0);
  if (!in_order) std::shuffle(slot.begin(), slot.end(), std::mt19937(7));
  int64_t* d_units;
  const size_t max_units = size_t(2) * kHeads * (1000 * 4 + 800);
  CHECK_CUDA(cudaMalloc(&d_units, max_units * sizeof(int64_t)));

  auto set_smem = [](const void* k, int bytes) {
    CHECK_CUDA(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  };
  set_smem(reinterpret_cast<const void*>(read_cp_async<2, 8>), 2 * 8 * kUnit);
  set_smem(reinterpret_cast<const void*>(read_cp_async<2, 4>), 2 * 4 * kUnit);
  set_smem(reinterpret_cast<const void*>(read_bulk<2, 4>), 2 * 4 * kUnit);
  set_smem(reinterpret_cast<const void*>(read_cluster), 2 * 8 * kUnit);

  std::printf("\npage reads (us; %% = unique KV bytes / time / copy bandwidth)\n");
  std::printf("%-27s %7s %7s  %-44s %8s %5s\n", "case", "uniqMB", "bound", "read", "us", "%cp");
  for (const Tree& t : trees) {
    const double unique = 2.0 * t.pages * kHeads * kUnit;
    const double bound = unique / copy_bw * 1e6;
    auto row = [&](const char* what, double us) {
      std::printf("%-27s %7.2f %7.2f  %-44s %8.2f %5.0f\n", t.name, unique / 1e6, bound, what, us,
                  100.0 * bound / us);
    };
    for (const int reads : {1, t.reads}) {
      const std::vector<int64_t> units = tree_units(t, reads, slot, pool_pages);
      CHECK_CUDA(cudaMemcpy(d_units, units.data(), units.size() * sizeof(int64_t),
                            cudaMemcpyHostToDevice));
      const int n = int(units.size());
      char what[64];
      if (reads == 1) {
        row("once: ld.global, 4 blocks an SM",
            us([&] { read_ldg<8><<<4 * sms, 256>>>(pool, d_units, n, sink); }));
        row("once: cp.async 2 x 16 KB, 4 blocks an SM", us([&] {
              read_cp_async<2, 4><<<4 * sms, 128, 2 * 4 * kUnit>>>(pool, d_units, n, sink);
            }));
        row("once: bulk 2 x 16 KB, 4 blocks an SM",
            us([&] { read_bulk<2, 4><<<4 * sms, 128, 2 * 4 * kUnit>>>(pool, d_units, n, sink); }));
      }
      std::snprintf(what, sizeof what, "prompt x%d: cp.async 2 x 32 KB, 2 blocks an SM", reads);
      if (reads == 1) std::snprintf(what, sizeof what, "once: cp.async 2 x 32 KB, 2 blocks an SM");
      row(what, us([&] {
            read_cp_async<2, 8><<<2 * sms, 128, 2 * 8 * kUnit>>>(pool, d_units, n, sink);
          }));
    }
    if (cluster && t.prompt_clusters > 0) {
      // The prompt once in the list, 4 CTAs a cluster consuming it; the rest of 2 blocks an SM
      // for the branches.
      const std::vector<int64_t> units = tree_units(t, 1, slot, pool_pages);
      CHECK_CUDA(cudaMemcpy(d_units, units.data(), units.size() * sizeof(int64_t),
                            cudaMemcpyHostToDevice));
      const int prompt_units = 2 * kHeads * t.prompt,
                branch_units = int(units.size()) - prompt_units;
      const int blocks = (2 * sms) / 4 * 4;
      for (const int mc : {0, 1}) {
        row(mc ? "clusters of 4: prompt multicast to the 4" : "clusters of 4: each CTA reads",
            us([&] {
              read_cluster<<<blocks, 128, 2 * 8 * kUnit>>>(
                  pool, d_units, prompt_units, branch_units, t.prompt_clusters, mc, sink);
            }));
      }
    }
  }
  CHECK_CUDA(cudaFree(d_units));
  CHECK_CUDA(cudaFree(pool));
  CHECK_CUDA(cudaFree(sink));
  return 0;
}
