// bench_p2p_floor: the floors under the peer-to-peer collectives (the sequence-parallel combine,
// kernels/sequence_parallel_combine.cu, and the tensor-parallel all-reduce, engine/cuda_ops.cu),
// measured the way bench_sequence_parallel measures a step: on every GPU a start event, one
// kernel, an end event; a repetition's time is the least over the GPUs of end - start (the
// ranks' starts differ by the host's enqueue skew, and the kernels end together at the
// barrier); the median over repetitions. Kernels, each on every GPU:
//  - empty: the launch floor (no barrier);
//  - barrier: detail::p2p_block_barrier (release stores of the call's number into every rank's
//    flags, then acquire polling of the own flags);
//  - barrier + fence: the same with __threadfence_system() before the release stores (what the
//    fence would cost; the barrier's release/acquire pairs do without it);
//  - combine P: the sequence-parallel combine itself (detail::enqueue_p2p_combine: its
//    barrier, then every rank's LSE and O of P (query, q head) pairs pulled and merged, the
//    output written in fp16), P / 32 queries of 32 q heads, head_dim 128, on its own
//    kSpP2PBlocks blocks.
// With --blocks N (default 128, the combine's grid) for the other kernels. Peer access between
// all GPUs is needed.
//
// usage: bench_p2p_floor [--world N] [--reps N] [--blocks N]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/tree_attention/bench_util.h"
#include "kernels/detail/p2p_barrier.cuh"
#include "kernels/detail/sequence_parallel_combine.h"

namespace {

using treeserve::detail::kMaxP2PRanks;

constexpr int kThreads = 256;
constexpr int kHeadDim = 128;
constexpr int kQHeads = 32;
using treeserve::detail::kSpP2PBlocks;

struct Args {
  int rank = 0, world = 1;
  uint32_t* flags[kMaxP2PRanks] = {};
  uint32_t* counters = nullptr;
};

// p2p_block_barrier with a system-scope fence before the release stores (for comparison).
__device__ __forceinline__ void barrier_fenced(const Args& a) {
  __shared__ uint32_t call;
  const int b = blockIdx.x;
  if (threadIdx.x == 0) {
    call = a.counters[b] + 1;
    a.counters[b] = call;
  }
  __syncthreads();
  if (int(threadIdx.x) < a.world) {
    const int s = threadIdx.x;
    __threadfence_system();
    treeserve::detail::st_release_sys(a.flags[s] + b * kMaxP2PRanks + a.rank, call);
    const uint32_t* seen = a.flags[a.rank] + b * kMaxP2PRanks + s;
    const long long start = clock64();
    while (int32_t(treeserve::detail::ld_acquire_sys(seen) - call) < 0) {
      if (clock64() - start > 20'000'000'000LL) __trap();
    }
  }
  __syncthreads();
}

// mode 0 empty, 1 barrier, 2 barrier + fence.
__global__ void __launch_bounds__(kThreads) probe(const Args a, int mode) {
  if (mode == 0) return;
  if (mode == 2) {
    barrier_fenced(a);
    return;
  }
  treeserve::detail::p2p_block_barrier(a.flags, a.counters, a.rank, a.world);
}

struct Rank {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, end = nullptr;
  uint32_t* flags = nullptr;          // [blocks][kMaxP2PRanks] then counters [blocks]
  uint32_t* combine_flags = nullptr;  // the same for the combine's kSpP2PBlocks blocks
  float* o = nullptr;                 // the combine's state: float [pairs][128], LSE [pairs]
  float* lse = nullptr;
  void* out = nullptr;      // fp16 [queries][32][128]
  int32_t* rows = nullptr;  // the queries' output rows: 0, 1, ...
};

}  // namespace

int main(int argc, char** argv) {
  int world = 2, reps = 200, blocks = 128;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> int { return i + 1 < argc ? std::atoi(argv[++i]) : 0; };
    if (a == "--world") {
      world = next();
    } else if (a == "--reps") {
      reps = std::max(1, next());
    } else if (a == "--blocks") {
      blocks = std::max(1, next());
    } else {
      std::fprintf(stderr, "usage: %s [--world N] [--reps N] [--blocks N]\n", argv[0]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (world < 2 || world > kMaxP2PRanks || devices < world) {
    std::printf("bench_p2p_floor skipped: --world %d needs 2-%d GPUs, found %d\n", world,
                kMaxP2PRanks, devices);
    return 0;
  }
  constexpr int64_t kMaxPairs = 8192;
  std::vector<Rank> ranks(world);
  for (int r = 0; r < world; ++r) {
    CHECK_CUDA(cudaSetDevice(r));
    for (int s = 0; s < world; ++s) {
      if (s == r) continue;
      int can = 0;
      CHECK_CUDA(cudaDeviceCanAccessPeer(&can, r, s));
      if (!can) {
        std::printf("bench_p2p_floor skipped: GPU %d cannot access GPU %d\n", r, s);
        return 0;
      }
      const cudaError_t e = cudaDeviceEnablePeerAccess(s, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CHECK_CUDA(e);
      cudaGetLastError();
    }
    Rank& k = ranks[r];
    CHECK_CUDA(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
    CHECK_CUDA(cudaEventCreate(&k.start));
    CHECK_CUDA(cudaEventCreate(&k.end));
    const size_t words = size_t(blocks) * (kMaxP2PRanks + 1);
    CHECK_CUDA(cudaMalloc(&k.flags, words * 4));
    CHECK_CUDA(cudaMemset(k.flags, 0, words * 4));
    CHECK_CUDA(cudaMalloc(&k.o, kMaxPairs * kHeadDim * 4));
    CHECK_CUDA(cudaMemset(k.o, 0, kMaxPairs * kHeadDim * 4));
    CHECK_CUDA(cudaMalloc(&k.lse, kMaxPairs * 4));
    CHECK_CUDA(cudaMemset(k.lse, 0, kMaxPairs * 4));
    const size_t combine_words = size_t(kSpP2PBlocks) * (kMaxP2PRanks + 1);
    CHECK_CUDA(cudaMalloc(&k.combine_flags, combine_words * 4));
    CHECK_CUDA(cudaMemset(k.combine_flags, 0, combine_words * 4));
    CHECK_CUDA(cudaMalloc(&k.out, kMaxPairs * kHeadDim * 2));
    std::vector<int32_t> rows(kMaxPairs / kQHeads);
    for (size_t q = 0; q < rows.size(); ++q) rows[q] = int32_t(q);
    CHECK_CUDA(cudaMalloc(&k.rows, rows.size() * 4));
    CHECK_CUDA(cudaMemcpy(k.rows, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf(
      "device: %s x %d; %d blocks of %d threads (the combine: its own %d), median of %d\n\n",
      prop.name, world, blocks, kThreads, kSpP2PBlocks, reps);
  struct Variant {
    const char* name;
    int mode;
    int64_t pairs;
  };
  const Variant variants[] = {{"empty", 0, 0},           {"barrier", 1, 0},
                              {"barrier + fence", 2, 0}, {"combine 256", 3, 256},
                              {"combine 2048", 3, 2048}, {"combine 8192", 3, 8192},
                              {"empty (again)", 0, 0}};
  for (const Variant& v : variants) {
    std::vector<double> us;
    for (int i = 0; i < reps + 5; ++i) {
      for (int r = 0; r < world; ++r) {
        CHECK_CUDA(cudaSetDevice(r));
        CHECK_CUDA(cudaEventRecord(ranks[r].start, ranks[r].stream));
        if (v.mode == 3) {
          treeserve::detail::SpP2PCombine c;
          c.rank = r;
          c.world = world;
          for (int s = 0; s < world; ++s) {
            c.o[s] = ranks[s].o;
            c.lse[s] = ranks[s].lse;
            c.flags[s] = ranks[s].combine_flags;
          }
          c.counters = ranks[r].combine_flags + kSpP2PBlocks * kMaxP2PRanks;
          const treeserve::Status st = treeserve::detail::enqueue_p2p_combine(
              c, ranks[r].rows, ranks[r].out, treeserve::TreeAttentionDtype::kFloat16,
              int32_t(v.pairs / kQHeads), kQHeads, kHeadDim, ranks[r].stream);
          if (!st.ok()) {
            std::fprintf(stderr, "combine: %s\n", st.message().c_str());
            return 1;
          }
        } else {
          Args a;
          a.rank = r;
          a.world = world;
          for (int s = 0; s < world; ++s) a.flags[s] = ranks[s].flags;
          a.counters = ranks[r].flags + blocks * kMaxP2PRanks;
          probe<<<blocks, kThreads, 0, ranks[r].stream>>>(a, v.mode);
          CHECK_CUDA(cudaGetLastError());
        }
        CHECK_CUDA(cudaEventRecord(ranks[r].end, ranks[r].stream));
      }
      double best = 1e30;
      for (int r = 0; r < world; ++r) {
        CHECK_CUDA(cudaEventSynchronize(ranks[r].end));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, ranks[r].start, ranks[r].end));
        best = std::min(best, double(ms) * 1e3);
      }
      if (i >= 5) us.push_back(best);
    }
    std::sort(us.begin(), us.end());
    std::printf("%-22s %7.2f us (p10 %.2f, p90 %.2f)\n", v.name, us[us.size() / 2],
                us[us.size() / 10], us[us.size() * 9 / 10]);
  }
  return 0;
}
