// Device token sampling (see cuda_sampling.h). One block of 1024 threads per logit row; the
// row is re-read from L2 by each pass:
//   1. max (lowest id on ties) and the log-softmax normaliser;
//   2. top-k: radix select (four 8-bit digit passes, integer counts) of the k-th best key,
//      ties at the threshold kept lowest ids first;
//   3. top-p: the same radix select weighted by the kept tokens' 2^-40 fixed-point weights,
//      for the smallest best-first set whose weight reaches top_p of the kept total;
//   4. the draw: the kept weights' prefix sums in id order (block scan), walked to u * total;
//   5. logprob alternatives: radix select of the N-th best key, then the N sorted.
// Keys are the floats' order-preserving bit patterns (NaN counts as -inf), so "best" is
// higher logit, then lower id, as on the host.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "engine/cuda_sampling.h"

namespace treeserve::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr float kMinTemperature = 1e-5f;       // engine/sampling.cpp's greedy bound
constexpr float kFixedOne = 1099511627776.0f;  // 2^40: weights (<= 1) in fixed point

__device__ __forceinline__ float clean(float x) { return x != x ? -INFINITY : x; }

// Larger float (NaN as -inf) -> larger key.
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(clean(x));
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// engine/sampling.cpp's splitmix64 finaliser and sampling_uniform, bit for bit.
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ double uniform(uint64_t seed, uint64_t stream_key, int64_t position) {
  uint64_t h = mix64(seed);
  h = mix64(h ^ stream_key);
  h = mix64(h ^ uint64_t(position));
  return double(h >> 11) * 0x1.0p-53;
}

struct Shared {
  unsigned long long hist[256];
  unsigned long long warp_u64[kWarps];
  float warp_f[kWarps];
  int32_t warp_i[kWarps];
  unsigned long long sel_cum;
  int32_t sel_bucket;
  int32_t cut;
  int32_t token;
  int32_t num_top;
  int32_t top_ids[kDeviceMaxLogprobs];
};

__device__ float block_sum(float v, Shared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) s.warp_f[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = s.warp_f[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) s.warp_f[0] = v;
  }
  __syncthreads();
  const float total = s.warp_f[0];
  __syncthreads();
  return total;
}

// Block-wide exclusive prefix sum in thread order; *total gets the sum.
__device__ unsigned long long block_scan(unsigned long long v, Shared& s,
                                         unsigned long long* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long x = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += x;
  }
  if (lane == 31) s.warp_u64[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const unsigned long long w = s.warp_u64[lane];
    unsigned long long wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long x = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += x;
    }
    s.warp_u64[lane] = wi - w;  // exclusive prefix of the warp totals
    if (lane == 31) s.sel_cum = wi;
  }
  __syncthreads();
  const unsigned long long before = s.warp_u64[warp] + incl - v;
  *total = s.sel_cum;
  __syncthreads();
  return before;
}

// The best (value, id): higher value, then lower id.
__device__ void block_argmax(float* value, int32_t* id, Shared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float v = *value;
  int32_t i = *id;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
  if (lane == 0) s.warp_f[warp] = v, s.warp_i[warp] = i;
  __syncthreads();
  if (warp == 0) {
    v = s.warp_f[lane];
    i = s.warp_i[lane];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int32_t oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
    }
    if (lane == 0) s.warp_f[0] = v, s.warp_i[0] = i;
  }
  __syncthreads();
  *value = s.warp_f[0];
  *id = s.warp_i[0];
  __syncthreads();
}

// The threshold of the best-first set that reaches `target` of amount(i) (0 for tokens not
// in play): the key tau with sum(amount, key > tau) < target <= sum(amount, key >= tau), and
// among the tokens at tau (in id order) the last one needed, *cut. Keeping key > tau, and
// key == tau with id <= *cut, keeps exactly the smallest best-first set reaching target.
// When the amounts never reach target, everything in play is kept.
template <typename Amount>
__device__ void select_best_first(const float* row, int vocab, unsigned long long target,
                                  Amount amount, Shared& s, uint32_t* tau, int32_t* cut) {
  const int tid = threadIdx.x;
  uint32_t prefix = 0, mask = 0;
  unsigned long long rem = target;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += kThreads) s.hist[b] = 0;
    __syncthreads();
    // Whole-warp iterations (the first digit's warp reductions need every lane).
    for (int base = 0; base < vocab; base += kThreads) {
      const int i = base + tid;
      unsigned long long a = 0;
      uint32_t bucket = 0;
      if (i < vocab) {
        const uint32_t key = order_key(row[i]);
        if ((key & mask) == prefix) {
          a = amount(i, key);
          bucket = (key >> shift) & 255u;
        }
      }
      if (shift == 24) {
        // The first digit (sign and most of the exponent) is shared by most lanes: they are
        // summed first and add once. Amounts are < 2^41 (a weight of 1 is 2^40), so 32 of them
        // split in 20-bit halves sum without overflow in 32-bit lanes.
        const unsigned adding = __ballot_sync(0xffffffffu, a != 0);
        if (a != 0) {
          const unsigned group = __match_any_sync(adding, bucket);
          const unsigned lo = __reduce_add_sync(group, unsigned(a & 0xfffffu));
          const unsigned hi = __reduce_add_sync(group, unsigned(a >> 20));
          if ((threadIdx.x & 31) == __ffs(group) - 1) {
            atomicAdd(&s.hist[bucket], (static_cast<unsigned long long>(hi) << 20) + lo);
          }
        }
      } else if (a != 0) {
        // Lower digits scatter over the buckets: a reduction per distinct bucket would run
        // one after another (ncu: 36% of the kernel), plain atomics rarely collide. Integer
        // sums, so the order does not change the result.
        atomicAdd(&s.hist[bucket], a);
      }
    }
    __syncthreads();
    if (tid == 0) {
      unsigned long long cum = 0;
      int b = 255;
      for (; b > 0; --b) {
        if (cum + s.hist[b] >= rem) break;
        cum += s.hist[b];
      }
      s.sel_bucket = b;
      s.sel_cum = cum;
    }
    __syncthreads();
    rem -= s.sel_cum < rem ? s.sel_cum : rem;
    prefix |= uint32_t(s.sel_bucket) << shift;
    mask |= 0xffu << shift;
    __syncthreads();
  }
  // Ties at prefix, in id order: contiguous id ranges per thread, block scan of their sums.
  const int per = (vocab + kThreads - 1) / kThreads;
  const int begin = min(vocab, tid * per), end = min(vocab, begin + per);
  unsigned long long local = 0;
  for (int i = begin; i < end; ++i) {
    const uint32_t key = order_key(row[i]);
    if (key == prefix) local += amount(i, key);
  }
  if (tid == 0) s.cut = vocab;  // default: every tie
  __syncthreads();
  unsigned long long total = 0;
  const unsigned long long before = block_scan(local, s, &total);
  if (rem > 0 && before < rem && before + local >= rem) {
    unsigned long long acc = before;
    for (int i = begin; i < end; ++i) {
      const uint32_t key = order_key(row[i]);
      if (key != prefix) continue;
      acc += amount(i, key);
      if (acc >= rem) {
        s.cut = i;
        break;
      }
    }
  }
  __syncthreads();
  *tau = prefix;
  *cut = s.cut;
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads)
    sample_rows_kernel(const float* __restrict__ logits, int64_t row_stride, int vocab,
                       const DeviceSamplingRow* __restrict__ params, DeviceSample* out) {
  __shared__ Shared s;
  const int tid = threadIdx.x;
  const float* row = logits + int64_t(blockIdx.x) * row_stride;
  const DeviceSamplingRow p = params[blockIdx.x];

  // 1. Max (lowest id on ties) and the log-softmax normaliser of the unmodified logits.
  float best = -INFINITY;
  int32_t best_id = 0x7fffffff;
  for (int i = tid; i < vocab; i += kThreads) {
    const float v = clean(row[i]);
    if (v > best || (v == best && i < best_id)) best = v, best_id = i;
  }
  block_argmax(&best, &best_id, s);
  const float max = best;
  const bool finite = isfinite(max);
  float z = 0.0f;
  if (finite) {
    for (int i = tid; i < vocab; i += kThreads) z += __expf(clean(row[i]) - max);
  }
  z = block_sum(z, s);
  const float log_z = finite ? max + logf(z) : NAN;

  const int k = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
  int32_t token = best_id;
  if (p.temperature >= kMinTemperature && finite && k > 1) {
    const float inv_t = 1.0f / p.temperature;
    auto weight = [&](float v) -> unsigned long long {
      return static_cast<unsigned long long>(__expf((clean(v) - max) * inv_t) * kFixedOne);
    };
    // 2. Top-k.
    uint32_t tau_k = 0;
    int32_t cut_k = vocab;
    if (k < vocab) {
      select_best_first(
          row, vocab, static_cast<unsigned long long>(k),
          [](int, uint32_t) -> unsigned long long { return 1; }, s, &tau_k, &cut_k);
    }
    auto in_k = [&](int i, uint32_t key) { return key > tau_k || (key == tau_k && i <= cut_k); };
    // 3. Top-p over the top-k tokens' weights.
    uint32_t tau_p = 0;
    int32_t cut_p = vocab;
    if (p.top_p < 1.0f) {
      unsigned long long local = 0;
      for (int i = tid; i < vocab; i += kThreads) {
        const float v = row[i];
        if (in_k(i, order_key(v))) local += weight(v);
      }
      unsigned long long total = 0;
      block_scan(local, s, &total);
      unsigned long long target =
          static_cast<unsigned long long>(ceil(double(p.top_p) * double(total)));
      if (target == 0) target = 1;
      select_best_first(
          row, vocab, target,
          [&](int i, uint32_t key) -> unsigned long long {
            return in_k(i, key) ? weight(row[i]) : 0ull;
          },
          s, &tau_p, &cut_p);
    }
    auto kept = [&](int i, uint32_t key) {
      return in_k(i, key) && (key > tau_p || (key == tau_p && i <= cut_p));
    };
    // 4. The draw, in id order.
    const int per = (vocab + kThreads - 1) / kThreads;
    const int begin = min(vocab, tid * per), end = min(vocab, begin + per);
    unsigned long long local = 0;
    for (int i = begin; i < end; ++i) {
      const float v = row[i];
      if (kept(i, order_key(v))) local += weight(v);
    }
    if (tid == 0) s.token = best_id;  // if rounding leaves the target unreached
    __syncthreads();
    unsigned long long total = 0;
    const unsigned long long before = block_scan(local, s, &total);
    const double u = uniform(p.seed, p.stream_key, p.position);
    const unsigned long long target = static_cast<unsigned long long>(u * double(total));
    if (before <= target && target < before + local) {
      unsigned long long acc = before;
      for (int i = begin; i < end; ++i) {
        const float v = row[i];
        if (!kept(i, order_key(v))) continue;
        acc += weight(v);
        if (acc > target) {
          s.token = i;
          break;
        }
      }
    }
    __syncthreads();
    token = s.token;
    __syncthreads();
  }

  // 5. The N best alternatives, best first.
  const int n_top = min(p.logprobs, min(kDeviceMaxLogprobs, vocab));
  if (n_top > 0) {
    uint32_t tau = 0;
    int32_t cut = vocab;
    select_best_first(
        row, vocab, static_cast<unsigned long long>(n_top),
        [](int, uint32_t) -> unsigned long long { return 1; }, s, &tau, &cut);
    if (tid == 0) s.num_top = 0;
    __syncthreads();
    for (int i = tid; i < vocab; i += kThreads) {
      const uint32_t key = order_key(row[i]);
      if (key > tau || (key == tau && i <= cut)) {
        const int at = atomicAdd(&s.num_top, 1);
        if (at < kDeviceMaxLogprobs) s.top_ids[at] = i;
      }
    }
    __syncthreads();
  }
  if (tid == 0) {
    DeviceSample r;
    r.token = token;
    r.logprob = clean(row[token]) - log_z;
    r.num_top = n_top > 0 ? min(s.num_top, n_top) : 0;
    for (int a = 0; a < r.num_top; ++a) r.top_ids[a] = s.top_ids[a];
    // Insertion sort, best first.
    for (int a = 1; a < r.num_top; ++a) {
      const int32_t id = r.top_ids[a];
      const float v = clean(row[id]);
      int b = a - 1;
      while (b >= 0) {
        const float w = clean(row[r.top_ids[b]]);
        if (w > v || (w == v && r.top_ids[b] < id)) break;
        r.top_ids[b + 1] = r.top_ids[b];
        --b;
      }
      r.top_ids[b + 1] = id;
    }
    for (int a = 0; a < r.num_top; ++a) r.top_logprobs[a] = clean(row[r.top_ids[a]]) - log_z;
    out[blockIdx.x] = r;
  }
}

}  // namespace

void sample_rows(const float* logits, int64_t n, int64_t row_stride, int64_t vocab,
                 const DeviceSamplingRow* params, DeviceSample* out, cudaStream_t stream) {
  if (n <= 0 || vocab <= 0) return;
  sample_rows_kernel<<<unsigned(n), kThreads, 0, stream>>>(logits, row_stride, int(vocab), params,
                                                           out);
}

}  // namespace treeserve::cuda
