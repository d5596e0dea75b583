// Row and elementwise kernels of the CUDA backend: embedding, fused residual-add + RMSNorm,
// RoPE with the K/V append into the paged pool, SwiGLU, page copies and slot moves, weight
// conversion. Each is memory-bound; one block per row where a row reduction is needed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "engine/cuda_fp8.h"
#include "engine/cuda_ops.h"
#include "kernels/detail/p2p_barrier.cuh"
#include "kernels/detail/pdl_launch.cuh"

namespace treeserve::cuda {
namespace {

template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

constexpr int kRowThreads = 256;

template <typename T>
__global__ void embed_kernel(const int32_t* ids, const T* table, int64_t hidden, float* out) {
  const int64_t r = blockIdx.x;
  const T* src = table + int64_t(ids[r]) * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) out[r * hidden + i] = to_f(src[i]);
}

// A vocabulary shard's rows: ids outside [vocab_begin, vocab_begin + vocab_count) give zeros
// (another rank holds them; the all-reduce of the residual adds them in exactly).
template <typename T>
__global__ void embed_range_kernel(const int32_t* ids, const T* table, int64_t hidden,
                                   int64_t vocab_begin, int64_t vocab_count, float* out) {
  const int64_t r = blockIdx.x;
  const int64_t local = int64_t(ids[r]) - vocab_begin;
  const bool mine = local >= 0 && local < vocab_count;
  const T* src = table + (mine ? local : 0) * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    out[r * hidden + i] = mine ? to_f(src[i]) : 0.0f;
  }
}

// The block's reduction of v by op (every thread gets it; all threads call it).
template <typename Op>
__device__ float block_reduce(float v, Op op) {
  __shared__ float warp_vals[32];
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_vals[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) / 32;
  v = threadIdx.x < warps ? warp_vals[threadIdx.x] : op.identity;
  if (warp == 0) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) warp_vals[0] = v;
  }
  __syncthreads();
  const float total = warp_vals[0];
  __syncthreads();
  return total;
}
struct SumOp {
  float identity = 0.0f;
  __device__ float operator()(float a, float b) const { return a + b; }
};
// fmaxf: exact in any order (NaNs dropped, as quantize_rows_fp8's row maximum drops them).
struct MaxOp {
  float identity = 0.0f;
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
__device__ float block_sum(float v) { return block_reduce(v, SumOp{}); }

// Eight consecutive values as floats: 16-byte loads (one of T, two of float) and stores.
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = to_f(e[i]);
}
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = from_f<T>(v[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}

using detail::pdl_wait;

// The block's row (chunks of 8 values per thread, as loaded by the row kernels below; ss: this
// thread's sum of squares) normalised, cast to the dtype, times the weight: out_row. All the
// block's threads call it (block reduction).
// A block's row in e4m3 with its scale (*q_scale), from its values o (V chunks of 8 a thread,
// chunk k at column (threadIdx.x + k blockDim.x) 8; amax: this thread's largest |o|):
// scale = amax / 448 (1 for a zero row), q = e4m3(value / scale), every division an IEEE
// float32 division (cuda_fp8.cu's quantize_rows_kernel, bit for bit). All threads call it.
template <int V>
__device__ __forceinline__ void write_e4m3_row(const float (&o)[V][8], float amax, int64_t cols,
                                               uint8_t* __restrict__ q_row,
                                               float* __restrict__ q_scale) {
  amax = block_reduce(amax, MaxOp{});
  const float s = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
  if (threadIdx.x == 0) *q_scale = s;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t c = (threadIdx.x + int64_t(k) * blockDim.x) * 8;
    if (c >= cols) continue;
    uint8_t b[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      b[i] = uint8_t(__nv_cvt_float_to_fp8(__fdiv_rn(o[k][i], s), __NV_SATFINITE, __NV_E4M3));
    }
    *reinterpret_cast<uint2*>(q_row + c) = *reinterpret_cast<const uint2*>(b);
  }
}

// With q_row set, also the row's e4m3 copy and its scale (*q_scale) from the T values as
// written (write_e4m3_row).
template <typename T, int V>
__device__ __forceinline__ void write_rms_normed(const float (&v)[V][8], const float (&wv)[V][8],
                                                 float ss, float eps, int64_t hidden,
                                                 T* __restrict__ out_row,
                                                 uint8_t* __restrict__ q_row = nullptr,
                                                 float* __restrict__ q_scale = nullptr) {
  const float inv = rsqrtf(block_sum(ss) / float(hidden) + eps);
  float o[V][8];
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t c = (threadIdx.x + int64_t(k) * blockDim.x) * 8;
    if (c >= hidden) continue;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      o[k][i] = to_f(from_f<T>(to_f(from_f<T>(v[k][i] * inv)) * wv[k][i]));
      amax = fmaxf(amax, fabsf(o[k][i]));
    }
    store8(out_row + c, o[k]);
  }
  if (q_row != nullptr) write_e4m3_row<V>(o, amax, hidden, q_row, q_scale);
}

// HF LlamaRMSNorm: float statistics, normalised value cast to the dtype, times the weight.
// A thread owns V chunks of 8 consecutive values (hidden % 8 == 0, hidden <= 8192 V), and
// every load of the row — residual, delta, weight — is issued before the first use: the
// kernel is one memory round trip plus the block reduction.
//
// D: the delta's type, T or float. A float delta (tensor parallel: the all-reduced sum of the
// ranks' float partial GEMM outputs; split-K: `parts` slabs part_stride apart, the K slices'
// products, added in slab order after the first slab's loads) is rounded to T first, as the
// unsharded GEMM's output is. A T delta has one part.
template <typename T, typename D, int V>
__global__ void __launch_bounds__(1024)
    add_rms_norm_kernel(float* __restrict__ residual, const D* __restrict__ delta, int32_t parts,
                        int64_t part_stride, const T* __restrict__ weight, float eps,
                        int64_t hidden, T* __restrict__ out, Fp8Rows fp8) {
  const int64_t r = blockIdx.x;
  float* x = residual + r * hidden;
  float v[V][8], dv[V][8], wv[V][8];
  pdl_wait();
  // The next kernel may be scheduled now: the FP8 GEMM (a programmatic launch) loads its first
  // weight stages before its own wait for this grid.
  detail::pdl_trigger();
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t c = (threadIdx.x + int64_t(k) * blockDim.x) * 8;
    if (c < hidden) {
      load8(x + c, v[k]);
      if (delta) load8(delta + r * hidden + c, dv[k]);
      if (out) load8(weight + c, wv[k]);
    }
  }
  if constexpr (std::is_same_v<D, float>) {
    for (int32_t s = 1; delta && s < parts; ++s) {
      const float* part = delta + s * part_stride + r * hidden;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t c = (threadIdx.x + int64_t(k) * blockDim.x) * 8;
        if (c >= hidden) continue;
        float pv[8];
        load8(part + c, pv);
#pragma unroll
        for (int i = 0; i < 8; ++i) dv[k][i] += pv[i];
      }
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t c = (threadIdx.x + int64_t(k) * blockDim.x) * 8;
    if (c >= hidden) continue;
    if (delta) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if constexpr (std::is_same_v<D, float>) dv[k][i] = to_f(from_f<T>(dv[k][i]));
        v[k][i] += dv[k][i];
      }
      store8(x + c, v[k]);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) ss += v[k][i] * v[k][i];
  }
  if (!out) return;
  write_rms_normed<T, V>(v, wv, ss, eps, hidden, out + r * hidden,
                         fp8.q ? fp8.q + r * hidden : nullptr, fp8.q ? fp8.scale + r : nullptr);
}

// Peer-to-peer all-reduce fused with the residual add and RMSNorm (cuda_ops.h). Block b first
// meets block b of every peer (detail::p2p_block_barrier). The partial sums of this call were
// written by the kernel before this one on each rank (stream order; pdl_wait covers a
// programmatic launch), so once a peer has arrived, its buffer is complete. Then the block does
// rows b, b + kP2PBlocks, .. as add_rms_norm_kernel does, the peers' rows loaded with
// ld.global.cg (never a stale L1 line from an earlier call's read of the same buffer).
static_assert(kMaxP2PRanks == detail::kMaxP2PRanks);

__device__ __forceinline__ void load8_cg(const float* p, float (&v)[8]) {
  const float4 a = __ldcg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldcg(reinterpret_cast<const float4*>(p) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

template <typename T, int V>
__global__ void __launch_bounds__(1024)
    p2p_all_reduce_norm_kernel(float* __restrict__ residual, const P2PAllReduce ar,
                               const T* __restrict__ weight, float eps, int64_t rows,
                               int64_t hidden, T* __restrict__ out, Fp8Rows fp8) {
  pdl_wait();
  detail::p2p_block_barrier(ar.flags, ar.counters, ar.rank, ar.world);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float* x = residual + r * hidden;
    float v[V][8], dv[V][8], wv[V][8];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t c = (threadIdx.x + int64_t(k) * blockDim.x) * 8;
      if (c < hidden) {
        load8(x + c, v[k]);
        load8_cg(ar.deltas[0] + r * hidden + c, dv[k]);
        if (out) load8(weight + c, wv[k]);
      }
    }
    for (int s = 1; s < ar.world; ++s) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t c = (threadIdx.x + int64_t(k) * blockDim.x) * 8;
        if (c >= hidden) continue;
        float pv[8];
        load8_cg(ar.deltas[s] + r * hidden + c, pv);
#pragma unroll
        for (int i = 0; i < 8; ++i) dv[k][i] += pv[i];
      }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t c = (threadIdx.x + int64_t(k) * blockDim.x) * 8;
      if (c >= hidden) continue;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[k][i] += to_f(from_f<T>(dv[k][i]));
        ss += v[k][i] * v[k][i];
      }
      store8(x + c, v[k]);
    }
    if (!out) continue;
    write_rms_normed<T, V>(v, wv, ss, eps, hidden, out + r * hidden,
                           fp8.q ? fp8.q + r * hidden : nullptr, fp8.q ? fp8.scale + r : nullptr);
  }
}

__global__ void gather_rows_kernel(const float* src, const int32_t* rows, int64_t hidden,
                                   float* out) {
  const int64_t i = blockIdx.x;
  const float* s = src + int64_t(rows[i]) * hidden;
  for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) out[i * hidden + j] = s[j];
}

// Rotates the 4 pairs (i + e, i + e + half), e < 4, of one head's row src (two 8-byte loads)
// into dst (two 8-byte stores), rounded to T.
template <typename T>
__device__ __forceinline__ void rope_4_pairs(const T* src, T* dst, int32_t i, int32_t half,
                                             const float* __restrict__ inv_freq, float pos) {
  const uint2 lo_raw = *reinterpret_cast<const uint2*>(src + i);
  const uint2 hi_raw = *reinterpret_cast<const uint2*>(src + i + half);
  const float4 freq = *reinterpret_cast<const float4*>(inv_freq + i);
  const T* lo_in = reinterpret_cast<const T*>(&lo_raw);
  const T* hi_in = reinterpret_cast<const T*>(&hi_raw);
  const float f[4] = {freq.x, freq.y, freq.z, freq.w};
  uint2 lo_out, hi_out;
  T* lo = reinterpret_cast<T*>(&lo_out);
  T* hi = reinterpret_cast<T*>(&hi_out);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    // Same op order as the CPU reference: float angle, then cos/sin of it.
    float sn, cs;
    sincosf(pos * f[e], &sn, &cs);
    const float a = to_f(lo_in[e]), b = to_f(hi_in[e]);
    lo[e] = from_f<T>(a * cs - b * sn);
    hi[e] = from_f<T>(b * cs + a * sn);
  }
  *reinterpret_cast<uint2*>(dst + i) = lo_out;
  *reinterpret_cast<uint2*>(dst + i + half) = hi_out;
}

// One block per row. Unit u < (nh + nkv) * d / 8 rotates 4 pairs (i, i + d/2) of head
// u / (d / 8), i = 4 (u % (d / 8)) .. + 3 (two 8-byte loads, two stores); the next nkv * d / 8
// units copy 8 values of V each. Q goes to q_out, K and V into the row's pool slot.
template <typename T>
__global__ void __launch_bounds__(1024)
    rope_store_kernel(const T* __restrict__ qkv, const int32_t* positions,
                      const float* __restrict__ inv_freq, const int64_t* kv_slots, int32_t nh,
                      int32_t nkv, int32_t d, int32_t page_size, T* __restrict__ q_out, T* k_pool,
                      T* v_pool) {
  const int64_t r = blockIdx.x;
  // The step's metadata (uploaded before the step's first kernel) is read while the QKV GEMM
  // drains; its output only after the wait.
  const float pos = float(positions[r]);
  const int64_t slot_id = kv_slots[r];
  pdl_wait();
  // The next kernel (tree attention's stage 1, a programmatic launch) may start now: its
  // blocks read their plan until their own griddepcontrol.wait, which waits for this grid.
  detail::pdl_trigger();
  const int32_t half = d / 2, per_head = d / 8;
  const int64_t stride = int64_t(nh + 2 * nkv) * d;
  const T* row = qkv + r * stride;
  const int64_t page = slot_id / page_size;
  const int32_t slot = int32_t(slot_id % page_size);
  const int64_t page_elems = int64_t(nkv) * page_size * d;
  const int32_t rope_units = (nh + nkv) * per_head;
  const int32_t units = rope_units + nkv * per_head;
  for (int32_t u = threadIdx.x; u < units; u += blockDim.x) {
    if (u >= rope_units) {  // V: 8 values
      const int32_t t = (u - rope_units) * 8;
      const int32_t kh = t / d, j = t % d;
      *reinterpret_cast<uint4*>(v_pool + page * page_elems + (int64_t(kh) * page_size + slot) * d +
                                j) =
          *reinterpret_cast<const uint4*>(row + int64_t(nh + nkv) * d + t);
      continue;
    }
    const int32_t head = u / per_head, i = 4 * (u % per_head);
    T* dst;
    if (head < nh) {
      dst = q_out + (r * nh + head) * d;
    } else {
      dst = k_pool + page * page_elems + (int64_t(head - nh) * page_size + slot) * d;
    }
    rope_4_pairs(row + int64_t(head) * d, dst, i, half, inv_freq, pos);
  }
}

// rope_store_kernel for an e4m3 pool (k_scale set): Q as there; each (row, kv head)'s K (rotated,
// rounded to T as the T pool stores it) and V are quantized with the row's own scale by
// models/fp8.h's KV rule (fp8_kv_scale: amax / 448 over its d values, rounded up to a power of
// two), one warp a row: lane l holds K's pairs
// (i, i + d/2) for i in [l * d/64, (l + 1) * d/64) and V's d/32 values from l * d/32. The
// block's warps take the Q units' warps, then nkv K rows, then nkv V rows, in turn.
template <typename T>
__global__ void __launch_bounds__(1024)
    rope_store_fp8_kernel(const T* __restrict__ qkv, const int32_t* positions,
                          const float* __restrict__ inv_freq, const int64_t* kv_slots, int32_t nh,
                          int32_t nkv, int32_t d, int32_t page_size, T* __restrict__ q_out,
                          uint8_t* k_pool, uint8_t* v_pool, float* k_scale, float* v_scale) {
  const int64_t r = blockIdx.x;
  const float pos = float(positions[r]);
  const int64_t slot_id = kv_slots[r];
  pdl_wait();
  detail::pdl_trigger();  // as rope_store_kernel
  const int32_t half = d / 2, per_head = d / 8;
  const int64_t stride = int64_t(nh + 2 * nkv) * d;
  const T* row = qkv + r * stride;
  const int64_t page = slot_id / page_size;
  const int32_t slot = int32_t(slot_id % page_size);
  const int32_t lane = threadIdx.x & 31;
  const int32_t q_units = nh * per_head;
  const int32_t q_warps = (q_units + 31) / 32;
  const int32_t warps = q_warps + 2 * nkv;
  for (int32_t w = threadIdx.x / 32; w < warps; w += blockDim.x / 32) {
    if (w < q_warps) {
      const int32_t u = w * 32 + lane;
      if (u >= q_units) continue;
      const int32_t head = u / per_head, i = 4 * (u % per_head);
      rope_4_pairs(row + int64_t(head) * d, q_out + (r * nh + head) * d, i, half, inv_freq, pos);
      continue;
    }
    // One K or V row of head kh: at most 4 values a lane (d <= 128).
    const bool is_k = w < q_warps + nkv;
    const int32_t kh = is_k ? w - q_warps : w - q_warps - nkv;
    const int32_t per_lane = d / 32;
    float x[4];
    int32_t at[4];
    if (is_k) {
      const T* src = row + int64_t(nh + kh) * d;
      const int32_t pairs = per_lane / 2;
      for (int32_t e = 0; e < pairs; ++e) {
        const int32_t i = lane * pairs + e;
        float sn, cs;
        sincosf(pos * inv_freq[i], &sn, &cs);
        const float a = to_f(src[i]), b = to_f(src[i + half]);
        x[2 * e] = to_f(from_f<T>(a * cs - b * sn));
        x[2 * e + 1] = to_f(from_f<T>(b * cs + a * sn));
        at[2 * e] = i;
        at[2 * e + 1] = i + half;
      }
    } else {
      const T* src = row + int64_t(nh + nkv + kh) * d;
      for (int32_t e = 0; e < per_lane; ++e) {
        at[e] = lane * per_lane + e;
        x[e] = to_f(src[at[e]]);
      }
    }
    float amax = 0.0f;
    for (int32_t e = 0; e < per_lane; ++e) amax = fmaxf(amax, fabsf(x[e]));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    // fp8_kv_scale (models/fp8.h): amax / 448 rounded up to a power of two.
    uint32_t sb = __float_as_uint(__fdiv_rn(amax, 448.0f));
    if ((sb & 0x7fffffffu) == 0) sb = 0x800000u;  // a quotient that rounds to zero: 2^-126
    if ((sb & 0x7fffffu) != 0) sb = (sb & 0x7f800000u) + 0x800000u;
    const float sc = amax > 0.0f ? __uint_as_float(sb) : 1.0f;
    const int64_t row_id = (page * nkv + kh) * page_size + slot;  // (page, head, slot)
    uint8_t* dst = (is_k ? k_pool : v_pool) + row_id * d;
    for (int32_t e = 0; e < per_lane; ++e) {
      dst[at[e]] = uint8_t(__nv_cvt_float_to_fp8(__fdiv_rn(x[e], sc), __NV_SATFINITE, __NV_E4M3));
    }
    if (lane == 0) (is_k ? k_scale : v_scale)[row_id] = sc;
  }
}

// 8 outputs a thread (im % 8 == 0): 16-byte loads of gate and up, one 16-byte store.
template <typename T>
__global__ void swiglu_kernel(const T* __restrict__ gu, int64_t rows, int64_t im,
                              T* __restrict__ out) {
  pdl_wait();
  const int64_t n = rows * im / 8;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = idx * 8 / im, j = idx * 8 % im;
    float g[8], u[8], o[8];
    load8(gu + r * 2 * im + j, g);
    load8(gu + r * 2 * im + im + j, u);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      // silu in float, cast like torch (act(gate) in dtype, then * up in dtype).
      const T act = from_f<T>(g[e] / (1.0f + __expf(-g[e])));
      o[e] = to_f(act) * u[e];
    }
    store8(out + r * im + j, o);
  }
}

// swiglu_kernel one row a block, with the row's e4m3 copy for the FP8 down projection
// (write_e4m3_row): V chunks of 8 values a thread.
template <typename T, int V>
__global__ void __launch_bounds__(1024)
    swiglu_fp8_kernel(const T* __restrict__ gu, int64_t im, T* __restrict__ out, Fp8Rows fp8) {
  pdl_wait();
  detail::pdl_trigger();  // as add_rms_norm_kernel: the FP8 GEMM's weights load meanwhile
  const int64_t r = blockIdx.x;
  float o[V][8];
  float amax = 0.0f;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int64_t j = (threadIdx.x + int64_t(k) * blockDim.x) * 8;
    if (j >= im) continue;
    float g[8], u[8];
    load8(gu + r * 2 * im + j, g);
    load8(gu + r * 2 * im + im + j, u);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const T act = from_f<T>(g[e] / (1.0f + __expf(-g[e])));
      o[k][e] = to_f(from_f<T>(to_f(act) * u[e]));
      amax = fmaxf(amax, fabsf(o[k][e]));
    }
    store8(out + r * im + j, o[k]);
  }
  write_e4m3_row<V>(o, amax, im, fp8.q + r * im, fp8.scale + r);
}

// grid (copy, layer, K|V); threads over the head-major slots of the page.
template <typename T>
__global__ void copy_pages_kernel(T* k_all, T* v_all, int64_t layer_elems, int64_t page_elems,
                                  int32_t nkv, int32_t page_size, int32_t d, const int32_t* src,
                                  const int32_t* dst, const int32_t* num_slots) {
  const int32_t c = blockIdx.x, l = blockIdx.y;
  T* base = (blockIdx.z == 0 ? k_all : v_all) + int64_t(l) * layer_elems;
  const T* s = base + int64_t(src[c]) * page_elems;
  T* t = base + int64_t(dst[c]) * page_elems;
  const int64_t per_head = int64_t(num_slots[c]) * d;
  for (int64_t idx = threadIdx.x; idx < per_head * nkv; idx += blockDim.x) {
    const int64_t h = idx / per_head, j = idx % per_head;
    t[h * page_size * d + j] = s[h * page_size * d + j];
  }
}

// grid (layer, K|V): one block walks the moves in order.
template <typename T>
__global__ void move_slots_kernel(T* k_all, T* v_all, int64_t layer_elems, int64_t page_elems,
                                  int32_t nkv, int32_t page_size, int32_t d, const int64_t* src,
                                  const int64_t* dst, int32_t n) {
  const int32_t l = blockIdx.x;
  T* base = (blockIdx.y == 0 ? k_all : v_all) + int64_t(l) * layer_elems;
  for (int32_t m = 0; m < n; ++m) {
    const int64_t sp = src[m] / page_size, dp = dst[m] / page_size;
    const int32_t ss = int32_t(src[m] % page_size), ds = int32_t(dst[m] % page_size);
    for (int32_t idx = threadIdx.x; idx < nkv * d; idx += blockDim.x) {
      const int32_t h = idx / d, j = idx % d;
      base[dp * page_elems + (int64_t(h) * page_size + ds) * d + j] =
          base[sp * page_elems + (int64_t(h) * page_size + ss) * d + j];
    }
    __syncthreads();
  }
}

// The warp's largest (value, id), the lowest id on ties, in every lane.
__device__ __forceinline__ void warp_argmax(float* best, int32_t* best_id) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, *best, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, *best_id, o);
    if (ov > *best || (ov == *best && oi < *best_id)) {
      *best = ov;
      *best_id = oi;
    }
  }
}

// The greedy path's argmax and log-softmax in two launches: slices of kArgmaxSlice logits
// (grid rows x slices, so a few rows still spread over the GPU), each its (max, lowest argmax,
// sum exp(x - max)); then a warp per row merges its slices.
constexpr int64_t kArgmaxSlice = 8192;
constexpr int kArgmaxThreads = 512;

// A running (max, lowest id of the max, sum of exp(x - max)) over some logits; -inf logits add
// nothing to the sum (a slice of only -inf keeps sum 0), NaN ones are never the max.
struct OnlineMax {
  float max = -INFINITY;
  int32_t id = INT32_MAX;
  float sum = 0.0f;
  __device__ __forceinline__ void add(float v, int32_t i) {
    if (v > max) {
      sum = (max == -INFINITY ? 0.0f : sum * __expf(max - v)) + 1.0f;
      max = v;
      id = i;
    } else {
      if (v == max && i < id) id = i;
      if (v != -INFINITY) sum += __expf(v - max);
    }
  }
  // Logits i, i + 1, i + 2, i + 3 from one 16-byte load.
  __device__ __forceinline__ void add4(const float4& v, int32_t i) {
    add(v.x, i);
    add(v.y, i + 1);
    add(v.z, i + 2);
    add(v.w, i + 3);
  }
  __device__ __forceinline__ void merge(const OnlineMax& o) {
    const float m = fmaxf(max, o.max);
    const float a = max == -INFINITY ? 0.0f : sum * __expf(max - m);
    const float b = o.max == -INFINITY ? 0.0f : o.sum * __expf(o.max - m);
    id = o.max > max ? o.id : max > o.max ? id : min(id, o.id);
    max = m;
    sum = a + b;
  }
};

// The block's running states merged (kThreads threads, all calling); the result is thread
// 0's.
template <int kThreads>
__device__ __forceinline__ OnlineMax block_online_max(OnlineMax st) {
  for (int o = 16; o > 0; o >>= 1) {
    OnlineMax other;
    other.max = __shfl_xor_sync(0xffffffffu, st.max, o);
    other.id = __shfl_xor_sync(0xffffffffu, st.id, o);
    other.sum = __shfl_xor_sync(0xffffffffu, st.sum, o);
    st.merge(other);
  }
  __shared__ float w_max[kThreads / 32], w_sum[kThreads / 32];
  __shared__ int32_t w_id[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    w_max[warp] = st.max;
    w_id[warp] = st.id;
    w_sum[warp] = st.sum;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) {
      OnlineMax other;
      other.max = w_max[w];
      other.id = w_id[w];
      other.sum = w_sum[w];
      st.merge(other);
    }
  }
  return st;
}

// One pass over the slice: a thread's logits come in 16-byte loads, all issued before the
// first is used, where the slice is whole and aligned (the LM head's rows: vocab % 4 == 0);
// scalar loads otherwise. Then a warp and a block reduction of the running states.
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_slices_kernel(const float* logits, int64_t stride, int64_t vocab, int32_t slices,
                         float* maxes, float* sums, int32_t* ids) {
  constexpr int kVecs = int(kArgmaxSlice / (4 * kArgmaxThreads));  // float4 loads a thread
  static_assert(kVecs * 4 * kArgmaxThreads == kArgmaxSlice, "whole float4 passes per slice");
  pdl_wait();
  const int64_t r = blockIdx.x;
  const int64_t begin = int64_t(blockIdx.y) * kArgmaxSlice;
  const int64_t len = vocab - begin < kArgmaxSlice ? vocab - begin : kArgmaxSlice;
  const float* x = logits + r * stride + begin;
  OnlineMax st;
  if (len == kArgmaxSlice && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    float4 v[kVecs];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      v[k] = reinterpret_cast<const float4*>(x)[threadIdx.x + k * kArgmaxThreads];
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      st.add4(v[k], int32_t(begin) + 4 * int32_t(threadIdx.x + k * kArgmaxThreads));
    }
  } else {
    for (int64_t i = threadIdx.x; i < len; i += kArgmaxThreads) st.add(x[i], int32_t(begin + i));
  }
  st = block_online_max<kArgmaxThreads>(st);
  if (threadIdx.x == 0) {
    const int64_t at = r * slices + blockIdx.y;
    maxes[at] = st.max;
    sums[at] = st.sum;
    ids[at] = st.id;
  }
}

__global__ void argmax_merge_kernel(int64_t n, int32_t slices, const float* maxes,
                                    const float* sums, const int32_t* ids, int32_t* out_ids,
                                    float* out_logprobs) {
  pdl_wait();
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= n) return;
  const float* m = maxes + r * slices;
  const float* l = sums + r * slices;
  const int32_t* id = ids + r * slices;
  float best = -INFINITY;
  int32_t best_id = INT32_MAX;
  for (int32_t s = lane; s < slices; s += 32) {
    if (m[s] > best || (m[s] == best && id[s] < best_id)) {
      best = m[s];
      best_id = id[s];
    }
  }
  warp_argmax(&best, &best_id);
  float sum = 0.0f;
  for (int32_t s = lane; s < slices; s += 32) {
    if (l[s] > 0.0f) sum += l[s] * __expf(m[s] - best);
  }
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane == 0) {
    out_ids[r] = best_id;
    out_logprobs[r] = -logf(sum);
  }
}

// One block per row of a vocabulary shard (tensor parallel): the shard's max, its argmax as a
// global id (id_offset + local index, lowest on ties) and sum(exp(x - max)) over the row's
// first `vocab` entries, in one pass (OnlineMax; 16-byte loads where the row allows).
// vocab == 0 gives (-inf, INT32_MAX, 0). The host merges the shards.
constexpr int kArgmaxPartialThreads = 1024;
__global__ void __launch_bounds__(kArgmaxPartialThreads)
    argmax_partial_kernel(const float* logits, int64_t stride, int64_t vocab, int64_t id_offset,
                          float* maxes, float* sums, int32_t* ids) {
  const float* x = logits + int64_t(blockIdx.x) * stride;
  OnlineMax st;
  int64_t i = threadIdx.x;
  if ((reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const int64_t vecs = vocab / 4;
    for (int64_t k = threadIdx.x; k < vecs; k += kArgmaxPartialThreads) {
      st.add4(reinterpret_cast<const float4*>(x)[k], int32_t(4 * k));
    }
    i = 4 * vecs + threadIdx.x;  // the last vocab % 4 logits
  }
  for (; i < vocab; i += kArgmaxPartialThreads) st.add(x[i], int32_t(i));
  st = block_online_max<kArgmaxPartialThreads>(st);
  if (threadIdx.x == 0) {
    maxes[blockIdx.x] = st.max;
    sums[blockIdx.x] = st.sum;
    ids[blockIdx.x] = st.id == INT32_MAX ? INT32_MAX : int32_t(id_offset + st.id);
  }
}

template <typename T>
__global__ void convert_kernel(const float* src, int64_t n, T* dst) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = from_f<T>(src[i]);
  }
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <typename T>
__global__ void fill_random_kernel(T* dst, int64_t n, uint64_t seed, float scale, float offset) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(i));
    const float u = float(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    dst[i] = from_f<T>(offset + scale * (2.0f * u - 1.0f));
  }
}

// fill_random_kernel's values for the block [row0, row0 + rows) x [col0, col0 + cols) of a
// [*][src_cols] matrix: element (r, c) hashes its index in the whole matrix, so every
// tensor-parallel shard draws the values of the unsharded weights.
template <typename T>
__global__ void fill_random_block_kernel(T* dst, int64_t rows, int64_t cols, uint64_t seed,
                                         int64_t src_cols, int64_t row0, int64_t col0, float scale,
                                         float offset) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t index = (row0 + i / cols) * src_cols + col0 + i % cols;
    const uint64_t h = mix64(seed * 0x9e3779b97f4a7c15ull + uint64_t(index));
    const float u = float(h >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    dst[i] = from_f<T>(offset + scale * (2.0f * u - 1.0f));
  }
}

template <typename S>
__device__ __forceinline__ float load_f(S v) {
  if constexpr (std::is_same_v<S, float>) {
    return v;
  } else {
    return to_f(v);
  }
}

template <typename S, typename T>
__global__ void convert_any_kernel(const S* src, int64_t n, T* dst) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = from_f<T>(load_f(src[i]));
  }
}

// Row kernels go out as programmatic dependent launches (kernels/detail/pdl_launch.cuh): each
// starts with pdl_wait(), so it may be scheduled while the previous kernel drains.
template <typename... KArgs, typename... Args>
void launch_pdl(dim3 grid, dim3 block, cudaStream_t stream, void (*kernel)(KArgs...),
                Args... args) {
  detail::launch_pdl(grid, block, 0, stream, kernel, args...);
}

int round_up_warps(int64_t threads) {
  return int(std::min<int64_t>(1024, std::max<int64_t>(32, (threads + 31) / 32 * 32)));
}

int grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return int(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

}  // namespace

#define TS_DISPATCH(dt, ...)     \
  if ((dt) == Dtype::kFloat16) { \
    using T = __half;            \
    __VA_ARGS__;                 \
  } else {                       \
    using T = __nv_bfloat16;     \
    __VA_ARGS__;                 \
  }

void embed(Dtype dt, const int32_t* ids, int64_t rows, const void* table, int64_t hidden,
           float* residual, cudaStream_t stream) {
  if (rows == 0) return;
  TS_DISPATCH(dt, embed_kernel<T><<<rows, kRowThreads, 0, stream>>>(
                      ids, static_cast<const T*>(table), hidden, residual));
}

void embed_vocab_range(Dtype dt, const int32_t* ids, int64_t rows, const void* table,
                       int64_t hidden, int64_t vocab_begin, int64_t vocab_count, float* residual,
                       cudaStream_t stream) {
  if (rows == 0) return;
  TS_DISPATCH(dt,
              embed_range_kernel<T><<<rows, kRowThreads, 0, stream>>>(
                  ids, static_cast<const T*>(table), hidden, vocab_begin, vocab_count, residual));
}

// One block per row, a thread per 8-value chunk (two chunks a thread past hidden = 8192).
template <typename T, typename D>
void launch_add_rms_norm(float* residual, const D* delta, int32_t parts, int64_t part_stride,
                         const void* weight, float eps, int64_t rows, int64_t hidden, void* out,
                         cudaStream_t stream, Fp8Rows fp8) {
  const int64_t chunks = hidden / 8;
  if (chunks <= 1024) {
    launch_pdl(dim3(rows), dim3(round_up_warps(chunks)), stream, add_rms_norm_kernel<T, D, 1>,
               residual, delta, parts, part_stride, static_cast<const T*>(weight), eps, hidden,
               static_cast<T*>(out), fp8);
  } else {
    launch_pdl(dim3(rows), dim3(round_up_warps((chunks + 1) / 2)), stream,
               add_rms_norm_kernel<T, D, 2>, residual, delta, parts, part_stride,
               static_cast<const T*>(weight), eps, hidden, static_cast<T*>(out), fp8);
  }
}

void add_rms_norm(Dtype dt, float* residual, const void* delta, const void* weight, float eps,
                  int64_t rows, int64_t hidden, void* out, cudaStream_t stream, Fp8Rows fp8) {
  if (rows == 0) return;
  TS_DISPATCH(dt, launch_add_rms_norm<T, T>(residual, static_cast<const T*>(delta), 1, 0, weight,
                                            eps, rows, hidden, out, stream, fp8));
}

void add_rms_norm_f32_delta(Dtype dt, float* residual, const float* delta, int32_t parts,
                            int64_t part_stride, const void* weight, float eps, int64_t rows,
                            int64_t hidden, void* out, cudaStream_t stream, Fp8Rows fp8) {
  if (rows == 0) return;
  TS_DISPATCH(dt, launch_add_rms_norm<T, float>(residual, delta, parts, part_stride, weight, eps,
                                                rows, hidden, out, stream, fp8));
}

void p2p_all_reduce_add_rms_norm(Dtype dt, float* residual, const P2PAllReduce& ar,
                                 const void* weight, float eps, int64_t rows, int64_t hidden,
                                 void* out, cudaStream_t stream, Fp8Rows fp8) {
  // Launched even with rows == 0: every call of every rank must pass the barrier.
  const int64_t chunks = hidden / 8;
  TS_DISPATCH(dt, {
    if (chunks <= 1024) {
      launch_pdl(dim3(kP2PBlocks), dim3(round_up_warps(chunks)), stream,
                 p2p_all_reduce_norm_kernel<T, 1>, residual, ar, static_cast<const T*>(weight), eps,
                 rows, hidden, static_cast<T*>(out), fp8);
    } else {
      launch_pdl(dim3(kP2PBlocks), dim3(round_up_warps((chunks + 1) / 2)), stream,
                 p2p_all_reduce_norm_kernel<T, 2>, residual, ar, static_cast<const T*>(weight), eps,
                 rows, hidden, static_cast<T*>(out), fp8);
    }
  });
}

void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t hidden, float* out,
                 cudaStream_t stream) {
  if (n == 0) return;
  gather_rows_kernel<<<n, kRowThreads, 0, stream>>>(src, rows, hidden, out);
}

void rope_and_store_kv(Dtype dt, const void* qkv, const int32_t* positions, const float* inv_freq,
                       const int64_t* kv_slots, int64_t rows, int32_t nh, int32_t nkv, int32_t d,
                       int32_t page_size, void* q_out, void* k_pool, void* v_pool,
                       cudaStream_t stream, float* k_scale, float* v_scale) {
  if (rows == 0) return;
  if (k_scale != nullptr) {
    const int64_t warps = (int64_t(nh) * d / 8 + 31) / 32 + 2 * nkv;
    TS_DISPATCH(dt, launch_pdl(dim3(rows), dim3(int(std::min<int64_t>(warps, 32) * 32)), stream,
                               rope_store_fp8_kernel<T>, static_cast<const T*>(qkv), positions,
                               inv_freq, kv_slots, nh, nkv, d, page_size, static_cast<T*>(q_out),
                               static_cast<uint8_t*>(k_pool), static_cast<uint8_t*>(v_pool),
                               k_scale, v_scale));
    return;
  }
  const int64_t units = int64_t(nh + 2 * nkv) * d / 8;
  TS_DISPATCH(dt, launch_pdl(dim3(rows), dim3(round_up_warps(units)), stream, rope_store_kernel<T>,
                             static_cast<const T*>(qkv), positions, inv_freq, kv_slots, nh, nkv, d,
                             page_size, static_cast<T*>(q_out), static_cast<T*>(k_pool),
                             static_cast<T*>(v_pool)));
}

template <typename T>
void launch_swiglu_fp8(const void* gu, int64_t rows, int64_t im, void* out, cudaStream_t stream,
                       Fp8Rows fp8) {
  const int64_t chunks = im / 8;
  auto go = [&](auto kernel, int64_t per_thread) {
    launch_pdl(dim3(rows), dim3(round_up_warps((chunks + per_thread - 1) / per_thread)), stream,
               kernel, static_cast<const T*>(gu), im, static_cast<T*>(out), fp8);
  };
  if (chunks <= 1024) {
    go(swiglu_fp8_kernel<T, 1>, 1);
  } else if (chunks <= 2048) {
    go(swiglu_fp8_kernel<T, 2>, 2);
  } else if (chunks <= 4096) {
    go(swiglu_fp8_kernel<T, 4>, 4);
  } else {
    go(swiglu_fp8_kernel<T, 8>, 8);
  }
}

void swiglu(Dtype dt, const void* gu, int64_t rows, int64_t im, void* out, cudaStream_t stream,
            Fp8Rows fp8) {
  if (rows == 0) return;
  if (fp8.q != nullptr && im / 8 <= 8192) {
    TS_DISPATCH(dt, launch_swiglu_fp8<T>(gu, rows, im, out, stream, fp8));
    return;
  }
  TS_DISPATCH(dt, launch_pdl(dim3(grid_for(rows * im / 8)), dim3(256), stream, swiglu_kernel<T>,
                             static_cast<const T*>(gu), rows, im, static_cast<T*>(out)));
  if (fp8.q != nullptr) quantize_rows_fp8(dt, out, rows, im, fp8.q, fp8.scale, stream);
}

void copy_pages(Dtype dt, void* k_all, void* v_all, int32_t layers, int64_t layer_elems,
                int64_t page_elems, int32_t nkv, int32_t page_size, int32_t d, const int32_t* src,
                const int32_t* dst, const int32_t* num_slots, int32_t n, cudaStream_t stream,
                float* k_scale_all, float* v_scale_all) {
  if (n == 0) return;
  dim3 grid(n, layers, 2);
  if (k_scale_all != nullptr) {
    // e4m3 bytes, then the scales: a layout of the same pages with one value a row.
    copy_pages_kernel<uint8_t>
        <<<grid, 256, 0, stream>>>(static_cast<uint8_t*>(k_all), static_cast<uint8_t*>(v_all),
                                   layer_elems, page_elems, nkv, page_size, d, src, dst, num_slots);
    copy_pages_kernel<float><<<grid, 256, 0, stream>>>(k_scale_all, v_scale_all, layer_elems / d,
                                                       page_elems / d, nkv, page_size, 1, src, dst,
                                                       num_slots);
    return;
  }
  TS_DISPATCH(dt, copy_pages_kernel<T><<<grid, 256, 0, stream>>>(
                      static_cast<T*>(k_all), static_cast<T*>(v_all), layer_elems, page_elems, nkv,
                      page_size, d, src, dst, num_slots));
}

void move_slots(Dtype dt, void* k_all, void* v_all, int32_t layers, int64_t layer_elems,
                int64_t page_elems, int32_t nkv, int32_t page_size, int32_t d, const int64_t* src,
                const int64_t* dst, int32_t n, cudaStream_t stream, float* k_scale_all,
                float* v_scale_all) {
  if (n == 0) return;
  dim3 grid(layers, 2);
  if (k_scale_all != nullptr) {
    move_slots_kernel<uint8_t>
        <<<grid, 256, 0, stream>>>(static_cast<uint8_t*>(k_all), static_cast<uint8_t*>(v_all),
                                   layer_elems, page_elems, nkv, page_size, d, src, dst, n);
    move_slots_kernel<float><<<grid, 256, 0, stream>>>(
        k_scale_all, v_scale_all, layer_elems / d, page_elems / d, nkv, page_size, 1, src, dst, n);
    return;
  }
  TS_DISPATCH(dt, move_slots_kernel<T>
              <<<grid, 256, 0, stream>>>(static_cast<T*>(k_all), static_cast<T*>(v_all),
                                         layer_elems, page_elems, nkv, page_size, d, src, dst, n));
}

int32_t argmax_slices(int64_t vocab) {
  return int32_t(std::max<int64_t>(1, (vocab + kArgmaxSlice - 1) / kArgmaxSlice));
}

size_t argmax_scratch_bytes(int64_t n, int64_t vocab) {
  return size_t(n) * size_t(argmax_slices(vocab)) * 12;
}

void argmax_logprob(const float* logits, int64_t n, int64_t stride, int64_t vocab, int32_t* ids,
                    float* logprobs, void* scratch, cudaStream_t stream) {
  if (n == 0) return;
  const int32_t slices = argmax_slices(vocab);
  float* maxes = static_cast<float*>(scratch);
  float* sums = maxes + n * slices;
  int32_t* slice_ids = reinterpret_cast<int32_t*>(sums + n * slices);
  launch_pdl(dim3(unsigned(n), unsigned(slices)), dim3(kArgmaxThreads), stream,
             argmax_slices_kernel, logits, stride, vocab, slices, maxes, sums, slice_ids);
  launch_pdl(dim3(unsigned((n + 7) / 8)), dim3(256), stream, argmax_merge_kernel, n, slices, maxes,
             sums, slice_ids, ids, logprobs);
}

void argmax_partial(const float* logits, int64_t n, int64_t stride, int64_t vocab,
                    int64_t id_offset, float* maxes, float* sums, int32_t* ids,
                    cudaStream_t stream) {
  if (n == 0) return;
  argmax_partial_kernel<<<n, kArgmaxPartialThreads, 0, stream>>>(logits, stride, vocab, id_offset,
                                                                 maxes, sums, ids);
}

void convert_weights(Dtype dt, SrcDtype src_dt, const void* src, int64_t n, void* dst,
                     cudaStream_t stream) {
  if (n == 0) return;
  if (src_dt == SrcDtype::kFloat32) {
    TS_DISPATCH(dt, convert_any_kernel<float, T><<<grid_for(n), 256, 0, stream>>>(
                        static_cast<const float*>(src), n, static_cast<T*>(dst)));
  } else if (src_dt == SrcDtype::kFloat16) {
    TS_DISPATCH(dt, convert_any_kernel<__half, T><<<grid_for(n), 256, 0, stream>>>(
                        static_cast<const __half*>(src), n, static_cast<T*>(dst)));
  } else {
    TS_DISPATCH(dt, convert_any_kernel<__nv_bfloat16, T><<<grid_for(n), 256, 0, stream>>>(
                        static_cast<const __nv_bfloat16*>(src), n, static_cast<T*>(dst)));
  }
}

void fill_random_block(Dtype dt, void* dst, int64_t rows, int64_t cols, uint64_t seed,
                       int64_t src_cols, int64_t row0, int64_t col0, float scale, float offset,
                       cudaStream_t stream) {
  if (rows * cols == 0) return;
  TS_DISPATCH(dt, fill_random_block_kernel<T><<<grid_for(rows * cols), 256, 0, stream>>>(
                      static_cast<T*>(dst), rows, cols, seed, src_cols, row0, col0, scale, offset));
}

void convert_from_f32(Dtype dt, const float* src, int64_t n, void* dst, cudaStream_t stream) {
  if (n == 0) return;
  TS_DISPATCH(dt, convert_kernel<T><<<grid_for(n), 256, 0, stream>>>(src, n, static_cast<T*>(dst)));
}

void fill_random(Dtype dt, void* dst, int64_t n, uint64_t seed, float scale, float offset,
                 cudaStream_t stream) {
  if (n == 0) return;
  TS_DISPATCH(dt, fill_random_kernel<T>
              <<<grid_for(n), 256, 0, stream>>>(static_cast<T*>(dst), n, seed, scale, offset));
}

}  // namespace treeserve::cuda
