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
template <typename T>
__global__ void __launch_bounds__(kThreads)
    p2p_combine(const SpP2PCombine a, const int32_t* query_rows, T* out, int64_t n, int num_q_heads,
                int vec_per_pair) {
  p2p_block_barrier(a.flags, a.counters, a.rank, a.world);
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t pair = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; pair < n;
       pair += int64_t(gridDim.x) * kWarps) {
    float m = -INFINITY;
    for (int s = 0; s < a.world; ++s) m = fmaxf(m, __ldcg(a.lse[s] + pair));
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float w_sum = 0.f;
    for (int s = 0; s < a.world; ++s) {
      const float lse = __ldcg(a.lse[s] + pair);
      const float w = m == -INFINITY ? 0.f : exp2f(lse - m);  // lse = -inf -> 0
      w_sum += w;
      if (lane < vec_per_pair) {
        const float4 x =
            __ldcg(reinterpret_cast<const float4*>(a.o[s]) + pair * vec_per_pair + lane);
        acc.x += w * x.x, acc.y += w * x.y, acc.z += w * x.z, acc.w += w * x.w;
      }
    }
    if (lane >= vec_per_pair) continue;
    const float inv = w_sum > 0.f ? 1.f / w_sum : 0.f;
    acc.x *= inv, acc.y *= inv, acc.z *= inv, acc.w *= inv;
    const int64_t row = query_rows[pair / num_q_heads];
    const int head = int(pair % num_q_heads);
    store4(out + ((row * num_q_heads + head) * vec_per_pair + lane) * 4, acc);
  }
}

Status launch_status(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

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
  if (dtype == TreeAttentionDtype::kBFloat16) {
    p2p_combine<<<kSpP2PBlocks, kThreads, 0, stream>>>(
        args, query_rows, static_cast<__nv_bfloat16*>(out), n, num_q_heads, vec);
  } else {
    p2p_combine<<<kSpP2PBlocks, kThreads, 0, stream>>>(args, query_rows, static_cast<__half*>(out),
                                                       n, num_q_heads, vec);
  }
  return launch_status("sequence-parallel p2p_combine launch");
}

}  // namespace treeserve::detail
