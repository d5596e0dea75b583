// Device side of the peer-to-peer collectives (tensor-parallel all-reduce in
// engine/cuda_ops.cu, sequence-parallel combine in kernels/sequence_parallel_combine.cu): one
// process owns every GPU, peer access is enabled between all of them, and a kernel reads its
// peers' buffers straight over NVLink once they are complete.
//
// The barrier pairs block b of every rank. Each rank owns flags uint32 [blocks][kMaxP2PRanks]
// (written by the peers) and counters uint32 [blocks] (its own call numbers), zeroed once.
// Block b of rank r numbers its calls (counters[b] + 1), writes the number into every rank s's
// flags[b][r] with a system-scope release store (what this rank wrote before, the buffer the
// peers will read, is visible to a peer that acquires the number) and waits until its own
// flags[b][s] carry the number for every s, with acquire loads. Release and acquire are all
// this message passing needs; a __threadfence_system() (fence.sc.sys) before the release
// stores would add more than a microsecond a call (bench_p2p_floor).
// Since blocks meet by index and call number, every rank must launch the same number of blocks
// on every call, and call as many times. A peer that never arrives (its rank failed) traps the
// kernel after ~10 s instead of hanging.
#pragma once

#include <cstdint>

namespace treeserve::detail {

inline constexpr int kMaxP2PRanks = 8;

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// All threads of the block call it; returns once every rank's block blockIdx.x has arrived.
__device__ __forceinline__ void p2p_block_barrier(uint32_t* const (&flags)[kMaxP2PRanks],
                                                  uint32_t* counters, int rank, int world) {
  __shared__ uint32_t call;
  const int b = blockIdx.x;
  if (threadIdx.x == 0) {
    call = counters[b] + 1;
    counters[b] = call;
  }
  __syncthreads();
  if (int(threadIdx.x) < world) {
    const int s = threadIdx.x;
    st_release_sys(flags[s] + b * kMaxP2PRanks + rank, call);
    const uint32_t* seen = flags[rank] + b * kMaxP2PRanks + s;
    const long long start = clock64();
    while (int32_t(ld_acquire_sys(seen) - call) < 0) {
      if (clock64() - start > 20'000'000'000LL) __trap();  // ~10 s: the peer is gone
    }
  }
  __syncthreads();
}

}  // namespace treeserve::detail
