// Kernels of the sequence-parallel combine (detail/sequence_parallel_combine.h): the rescale of
// each rank's merged states by the all-reduced max LSE, and the final division into the model
// dtype at the queries' batch rows. Both are elementwise over (query, q head, 4 columns): one
// thread per float4, a few microseconds for a decode batch; the all-reduces between them
// dominate the combine.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "kernels/detail/p2p_barrier.cuh"
#include "kernels/detail/pdl_launch.cuh"
#include "kernels/detail/sequence_parallel_combine.h"

namespace treeserve::detail {
namespace {

constexpr int kThreads = 256;

// Per thread one float4 of pair i = idx / (head_dim / 4). exp2f (not ex2.approx): the weights
// are summed across ranks, so keep them exact to an ulp.
__global__ void __launch_bounds__(kThreads)
    scale_states(float4* o, const float* lse, const float* lse_max, float* w, int64_t n,
                 int vec_per_pair) {
  const int64_t idx = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (idx >= n * vec_per_pair) return;
  const int64_t pair = idx / vec_per_pair;
  const float m = lse_max[pair];
  const float scale = m == -INFINITY ? 0.f : exp2f(lse[pair] - m);  // lse = -inf -> 0
  float4 x = o[idx];
  x.x *= scale, x.y *= scale, x.z *= scale, x.w *= scale;
  o[idx] = x;
  if (idx % vec_per_pair == 0) w[pair] = scale;
}

__device__ __forceinline__ void store4(__half* dst, float4 x) {
  const __half2 lo = __floats2half2_rn(x.x, x.y), hi = __floats2half2_rn(x.z, x.w);
  reinterpret_cast<__half2*>(dst)[0] = lo;
  reinterpret_cast<__half2*>(dst)[1] = hi;
}
__device__ __forceinline__ void store4(__nv_bfloat16* dst, float4 x) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y), hi = __floats2bfloat162_rn(x.z, x.w);
  reinterpret_cast<__nv_bfloat162*>(dst)[0] = lo;
  reinterpret_cast<__nv_bfloat162*>(dst)[1] = hi;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    write_combined(const float4* o_sum, const float* w_sum, const int32_t* query_rows, T* out,
                   int64_t n, int num_q_heads, int vec_per_pair) {
  const int64_t idx = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (idx >= n * vec_per_pair) return;
  const int64_t pair = idx / vec_per_pair;
  const int v = int(idx % vec_per_pair);
  const int64_t query = pair / num_q_heads;
  const int head = int(pair % num_q_heads);
  const float w = w_sum[pair];
  const float inv = w > 0.f ? 1.f / w : 0.f;
  float4 x = o_sum[idx];
  x.x *= inv, x.y *= inv, x.z *= inv, x.w *= inv;
  const int64_t row = query_rows[query];
  store4(out + ((row * num_q_heads + head) * vec_per_pair + v) * 4, x);
}

static_assert(kSpMaxRanks == kMaxP2PRanks);

// One warp per (query, q head) pair, lane l owning float4 l of the head (head_dim / 4 <= 32).
// The peers' states come over NVLink, where a load is a round trip of microseconds: a warp
// asks for every rank's LSE and O of kRoundPairs pairs at once (one round trip a round, not
// one for the LSEs and another for each rank's O), and the grid has warps enough for the
// usual decode batch in one round (kSpP2PBlocks x 8 warps x 2 pairs: 64 queries x 32 heads).
// Launched programmatically (launch_pdl): the blocks wait for the local merge (pdl_wait)
// before the barrier, so the barrier still means every rank's state is complete.
constexpr int kRoundPairs = 2;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    p2p_combine(const SpP2PCombine a, const int32_t* query_rows, T* out, int64_t n, int num_q_heads,
                int vec_per_pair) {
  pdl_wait();
  p2p_block_barrier(a.flags, a.counters, a.rank, a.world);
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32;
  const int64_t stride = int64_t(gridDim.x) * kWarps;  // pairs apart within a round
  for (int64_t first = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; first < n;
       first += stride * kRoundPairs) {
    float lse[kRoundPairs][kSpMaxRanks];
    float4 x[kRoundPairs][kSpMaxRanks];
#pragma unroll
    for (int j = 0; j < kRoundPairs; ++j) {
      const int64_t pair = first + j * stride;
#pragma unroll
      for (int s = 0; s < kSpMaxRanks; ++s) {
        const bool valid = s < a.world && pair < n;
        lse[j][s] = valid ? __ldcg(a.lse[s] + pair) : -INFINITY;
        x[j][s] = valid && lane < vec_per_pair
                      ? __ldcg(reinterpret_cast<const float4*>(a.o[s]) + pair * vec_per_pair + lane)
                      : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
#pragma unroll
    for (int j = 0; j < kRoundPairs; ++j) {
      const int64_t pair = first + j * stride;
      if (pair >= n || lane >= vec_per_pair) continue;
      float m = -INFINITY;
#pragma unroll
      for (int s = 0; s < kSpMaxRanks; ++s) m = fmaxf(m, lse[j][s]);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      float w_sum = 0.f;
#pragma unroll
      for (int s = 0; s < kSpMaxRanks; ++s) {  // ranks in order; past world, w = 0 adds nothing
        const float w = m == -INFINITY ? 0.f : exp2f(lse[j][s] - m);  // lse = -inf -> 0
        w_sum += w;
        acc.x += w * x[j][s].x, acc.y += w * x[j][s].y, acc.z += w * x[j][s].z,
            acc.w += w * x[j][s].w;
      }
      const float inv = w_sum > 0.f ? 1.f / w_sum : 0.f;
      acc.x *= inv, acc.y *= inv, acc.z *= inv, acc.w *= inv;
      const int64_t row = query_rows[pair / num_q_heads];
      const int head = int(pair % num_q_heads);
      store4(out + ((row * num_q_heads + head) * vec_per_pair + lane) * 4, acc);
    }
  }
}

// A launch's error (e: what the launch returned) as a Status.
Status launch_status(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return Status::Ok();
  return Internal(std::string(what) + ": " + cudaGetErrorString(e));
}
// ... for a <<<>>> launch, which reports through cudaGetLastError.
Status launch_status(const char* what) { return launch_status(what, cudaGetLastError()); }

int blocks_for(int64_t threads) { return int((threads + kThreads - 1) / kThreads); }

}  // namespace

Status enqueue_scale_states(float* o, const float* lse, const float* lse_max, float* w, int64_t n,
                            int32_t head_dim, cudaStream_t stream) {
  if (head_dim % 4 != 0) return InvalidArgument("head_dim must be a multiple of 4");
  if (n == 0) return Status::Ok();
  const int vec = head_dim / 4;
  scale_states<<<blocks_for(n * vec), kThreads, 0, stream>>>(reinterpret_cast<float4*>(o), lse,
                                                             lse_max, w, n, vec);
  return launch_status("sequence-parallel scale_states launch");
}

Status enqueue_write_combined(const float* o_sum, const float* w_sum, const int32_t* query_rows,
                              void* out, TreeAttentionDtype dtype, int32_t num_queries,
                              int32_t num_q_heads, int32_t head_dim, cudaStream_t stream) {
  if (head_dim % 4 != 0) return InvalidArgument("head_dim must be a multiple of 4");
  const int64_t n = int64_t(num_queries) * num_q_heads;
  if (n == 0) return Status::Ok();
  const int vec = head_dim / 4;
  const float4* o4 = reinterpret_cast<const float4*>(o_sum);
  if (dtype == TreeAttentionDtype::kBFloat16) {
    write_combined<<<blocks_for(n * vec), kThreads, 0, stream>>>(
        o4, w_sum, query_rows, static_cast<__nv_bfloat16*>(out), n, num_q_heads, vec);
  } else {
    write_combined<<<blocks_for(n * vec), kThreads, 0, stream>>>(
        o4, w_sum, query_rows, static_cast<__half*>(out), n, num_q_heads, vec);
  }
  return launch_status("sequence-parallel write_combined launch");
}

Status enqueue_p2p_combine(const SpP2PCombine& args, const int32_t* query_rows, void* out,
                           TreeAttentionDtype dtype, int32_t num_queries, int32_t num_q_heads,
                           int32_t head_dim, cudaStream_t stream) {
  if (head_dim % 4 != 0 || head_dim > 128) {
    return InvalidArgument("head_dim must be a multiple of 4, at most 128");
  }
  // Launched even without pairs: every call of every rank must pass the barrier.
  const int64_t n = int64_t(num_queries) * num_q_heads;
  const int vec = head_dim / 4;
  const cudaError_t e =
      dtype == TreeAttentionDtype::kBFloat16
          ? launch_pdl(dim3(kSpP2PBlocks), dim3(kThreads), 0, stream, p2p_combine<__nv_bfloat16>,
                       args, query_rows, static_cast<__nv_bfloat16*>(out), n, num_q_heads, vec)
          : launch_pdl(dim3(kSpP2PBlocks), dim3(kThreads), 0, stream, p2p_combine<__half>, args,
                       query_rows, static_cast<__half*>(out), n, num_q_heads, vec);
  return launch_status("sequence-parallel p2p_combine launch", e);
}

}  // namespace treeserve::detail
