// Device token sampling (see cuda_sampling.h). Each logit row is sampled by a cluster of
// kCluster blocks of 512 threads (sm_90 thread-block clusters; one block on older GPUs),
// which split the row between them and combine their partial results through distributed
// shared memory; every pass re-reads the row from L2:
//   1. max (lowest id on ties) and the log-softmax normaliser;
//   2. top-k: radix select (four 8-bit digit passes, integer counts) of the k-th best key,
//      ties at the threshold kept lowest ids first;
//   3. top-p: the same radix select weighted by the kept tokens' 2^-40 fixed-point weights,
//      for the smallest best-first set whose weight reaches top_p of the kept total;
//   4. the draw: the kept weights' prefix sums in id order (cluster scan), walked to
//      u * total;
//   5. logprob alternatives: radix select of the N-th best key, then the N sorted.
// Keys are the floats' order-preserving bit patterns (NaN counts as -inf), so "best" is
// higher logit, then lower id, as on the host. A cluster's blocks compute every selection
// from the same combined histograms and sums, so they agree; integer sums make the results
// independent of how the row is split.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/cuda_sampling.h"

namespace treeserve::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// Blocks a row is split over where the GPU has thread-block clusters (sm_90): 8 is the
// portable cluster size. 50 rows are 400 blocks of 512 threads (3 an SM by registers: about
// one wave on 132 SMs), faster than one 1024-thread block a row on flat rows. The kernel is
// bound by its instructions per element and pass, not by its thread count: what speeds it up
// is fewer or cheaper passes, not more threads.
constexpr int kCluster = 8;
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
  unsigned long long hist[256];    // this block's digit histogram (read by the cluster)
  unsigned long long merged[256];  // the cluster's
  unsigned long long warp_u64[kWarps];
  float warp_f[kWarps];
  int32_t warp_i[kWarps];
  // This block's part of a cluster-wide reduction, read by every block after a cluster sync.
  float x_f;
  int32_t x_i;
  unsigned long long x_u64;
  unsigned long long sel_cum;
  int32_t sel_bucket;
  int32_t num_top;
  int32_t top_ids[kDeviceMaxLogprobs];
};

// The row's cluster: this block's rank and the cluster's size (1 without clusters).
struct Cluster {
  int rank = 0;
  int size = 1;
  // The cluster's threads as one range: this thread's index and their count.
  __device__ int thread() const { return rank * kThreads + int(threadIdx.x); }
  __device__ int threads() const { return size * kThreads; }
};

__device__ Cluster this_cluster() {
  Cluster c;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const cg::cluster_group g = cg::this_cluster();
  c.rank = int(g.block_rank());
  c.size = int(g.num_blocks());
#endif
  return c;
}

// Every thread of every block of the cluster has arrived (and its shared-memory writes are
// visible to the cluster).
__device__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cg::this_cluster().sync();
#else
  __syncthreads();
#endif
}

// Block `rank`'s copy of this block's shared struct.
__device__ const Shared* peer(const Shared& s, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cg::this_cluster().map_shared_rank(&s, rank);
#else
  (void)rank;
  return &s;
#endif
}

// Sum over the block (every thread gets it).
__device__ float block_sum(float v, Shared& s) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) s.warp_f[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? s.warp_f[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) s.warp_f[0] = v;
  }
  __syncthreads();
  const float total = s.warp_f[0];
  __syncthreads();
  return total;
}

// Sum over the cluster, blocks added in rank order (every thread gets it).
__device__ float cluster_sum(float v, Shared& s, const Cluster& c) {
  v = block_sum(v, s);
  if (threadIdx.x == 0) s.x_f = v;
  cluster_sync();
  float total = 0.0f;
  for (int r = 0; r < c.size; ++r) total += peer(s, r)->x_f;
  cluster_sync();  // x_f may be rewritten after this
  return total;
}

// Block-wide exclusive prefix sum in thread order; *total gets the block's sum.
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
    const unsigned long long w = lane < kWarps ? s.warp_u64[lane] : 0ull;
    unsigned long long wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long x = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += x;
    }
    if (lane < kWarps) s.warp_u64[lane] = wi - w;  // exclusive prefix of the warp totals
    if (lane == kWarps - 1) s.sel_cum = wi;
  }
  __syncthreads();
  const unsigned long long before = s.warp_u64[warp] + incl - v;
  *total = s.sel_cum;
  __syncthreads();
  return before;
}

// Cluster-wide exclusive prefix sum in Cluster::thread() order; *total gets the cluster's sum.
__device__ unsigned long long cluster_scan(unsigned long long v, Shared& s, const Cluster& c,
                                           unsigned long long* total) {
  unsigned long long block_total = 0;
  const unsigned long long before = block_scan(v, s, &block_total);
  if (threadIdx.x == 0) s.x_u64 = block_total;
  cluster_sync();
  unsigned long long offset = 0, sum = 0;
  for (int r = 0; r < c.size; ++r) {
    const unsigned long long t = peer(s, r)->x_u64;
    if (r < c.rank) offset += t;
    sum += t;
  }
  cluster_sync();  // x_u64 may be rewritten after this
  *total = sum;
  return offset + before;
}

// The better of two (value, id): higher value, then lower id.
__device__ __forceinline__ void keep_better(float* v, int32_t* i, float ov, int32_t oi) {
  if (ov > *v || (ov == *v && oi < *i)) *v = ov, *i = oi;
}

// The best (value, id) over the cluster: higher value, then lower id (every thread gets it).
__device__ void cluster_argmax(float* value, int32_t* id, Shared& s, const Cluster& c) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float v = *value;
  int32_t i = *id;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    keep_better(&v, &i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
  }
  if (lane == 0) s.warp_f[warp] = v, s.warp_i[warp] = i;
  __syncthreads();
  if (warp == 0) {
    v = lane < kWarps ? s.warp_f[lane] : -INFINITY;
    i = lane < kWarps ? s.warp_i[lane] : INT_MAX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      keep_better(&v, &i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    }
    if (lane == 0) s.x_f = v, s.x_i = i;
  }
  cluster_sync();
  v = -INFINITY;
  i = INT_MAX;
  for (int r = 0; r < c.size; ++r) {
    const Shared* o = peer(s, r);
    keep_better(&v, &i, o->x_f, o->x_i);
  }
  cluster_sync();  // x_f, x_i may be rewritten after this
  *value = v;
  *id = i;
}

// The smallest id any block of the cluster proposes (INT_MAX from a block without one).
__device__ int32_t cluster_min(int32_t proposal, Shared& s, const Cluster& c) {
  if (threadIdx.x == 0) s.x_i = INT_MAX;
  __syncthreads();
  if (proposal != INT_MAX) atomicMin(&s.x_i, proposal);
  cluster_sync();
  int32_t m = INT_MAX;
  for (int r = 0; r < c.size; ++r) m = min(m, peer(s, r)->x_i);
  cluster_sync();  // x_i may be rewritten after this
  return m;
}

// The first id, in id order, at which the running sum of amount(i) over [0, vocab) reaches
// goal(total) (total: the sum over the whole row), or INT_MAX where it never does (a goal of 0
// or past the total). Each cluster thread sums a contiguous id range, a cluster scan places
// the ranges, and the block holding the id proposes it.
template <typename Amount, typename Goal>
__device__ int32_t cluster_first_reaching(int vocab, Amount amount, Goal goal, Shared& s,
                                          const Cluster& c) {
  const int per = (vocab + c.threads() - 1) / c.threads();
  const int begin = min(vocab, c.thread() * per), end = min(vocab, begin + per);
  unsigned long long local = 0;
  for (int i = begin; i < end; ++i) local += amount(i);
  unsigned long long total = 0;
  const unsigned long long before = cluster_scan(local, s, c, &total);
  const unsigned long long g = goal(total);
  int32_t proposal = INT_MAX;
  if (g > 0 && before < g && before + local >= g) {
    unsigned long long acc = before;
    for (int i = begin; i < end; ++i) {
      acc += amount(i);
      if (acc >= g) {
        proposal = i;
        break;
      }
    }
  }
  return cluster_min(proposal, s, c);
}

// The threshold of the best-first set that reaches `target` of amount(i) (0 for tokens not
// in play): the key tau with sum(amount, key > tau) < target <= sum(amount, key >= tau), and
// among the tokens at tau (in id order) the last one needed, *cut. Keeping key > tau, and
// key == tau with id <= *cut, keeps exactly the smallest best-first set reaching target.
// When the amounts never reach target, everything in play is kept.
template <typename Amount>
__device__ void select_best_first(const float* row, int vocab, unsigned long long target,
                                  Amount amount, Shared& s, const Cluster& c, uint32_t* tau,
                                  int32_t* cut) {
  const int tid = threadIdx.x;
  uint32_t prefix = 0, mask = 0;
  unsigned long long rem = target;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += kThreads) s.hist[b] = 0;
    __syncthreads();
    // Whole-warp iterations (the first digit's warp reductions need every lane).
    for (int base = c.rank * kThreads; base < vocab; base += c.threads()) {
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
        // one after another, while plain atomics rarely collide (summing the lanes of a
        // bucket first, even where a warp's lanes fall in at most 4 buckets, is slower on flat
        // rows). Integer sums, so the order does not change the result.
        atomicAdd(&s.hist[bucket], a);
      }
    }
    cluster_sync();  // every block's histogram is complete
    for (int b = tid; b < 256; b += kThreads) {
      unsigned long long sum = 0;
      for (int r = 0; r < c.size; ++r) sum += peer(s, r)->hist[b];
      s.merged[b] = sum;
    }
    cluster_sync();  // every block has read the histograms (they are cleared next pass)
    if (tid == 0) {
      unsigned long long cum = 0;
      int b = 255;
      for (; b > 0; --b) {
        if (cum + s.merged[b] >= rem) break;
        cum += s.merged[b];
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
  // Ties at prefix, in id order: the last one needed is where their running amount reaches rem.
  const int32_t m = cluster_first_reaching(
      vocab,
      [&](int i) -> unsigned long long {
        const uint32_t key = order_key(row[i]);
        return key == prefix ? amount(i, key) : 0ull;
      },
      [&](unsigned long long) { return rem; }, s, c);
  *tau = prefix;
  *cut = m == INT_MAX ? vocab : m;  // default: every tie
}

__global__ void __launch_bounds__(kThreads)
    sample_rows_kernel(const float* __restrict__ logits, int64_t row_stride, int vocab,
                       const DeviceSamplingRow* __restrict__ params, DeviceSample* out) {
  __shared__ Shared s;
  const Cluster c = this_cluster();
  const int tid = threadIdx.x;
  const int64_t row_index = int64_t(blockIdx.x) / c.size;
  const float* row = logits + row_index * row_stride;
  const DeviceSamplingRow p = params[row_index];

  // 1. Max (lowest id on ties) and the log-softmax normaliser of the unmodified logits.
  float best = -INFINITY;
  int32_t best_id = INT_MAX;
  for (int i = c.thread(); i < vocab; i += c.threads())
    keep_better(&best, &best_id, clean(row[i]), i);
  cluster_argmax(&best, &best_id, s, c);
  const float max = best;
  const bool finite = isfinite(max);
  float z = 0.0f;
  if (finite) {
    for (int i = c.thread(); i < vocab; i += c.threads()) z += __expf(clean(row[i]) - max);
  }
  z = cluster_sum(z, s, c);
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
          [](int, uint32_t) -> unsigned long long { return 1; }, s, c, &tau_k, &cut_k);
    }
    auto in_k = [&](int i, uint32_t key) { return key > tau_k || (key == tau_k && i <= cut_k); };
    // 3. Top-p over the top-k tokens' weights.
    uint32_t tau_p = 0;
    int32_t cut_p = vocab;
    if (p.top_p < 1.0f) {
      unsigned long long local = 0;
      for (int i = c.thread(); i < vocab; i += c.threads()) {
        const float v = row[i];
        if (in_k(i, order_key(v))) local += weight(v);
      }
      unsigned long long total = 0;
      cluster_scan(local, s, c, &total);
      unsigned long long target =
          static_cast<unsigned long long>(ceil(double(p.top_p) * double(total)));
      if (target == 0) target = 1;
      select_best_first(
          row, vocab, target,
          [&](int i, uint32_t key) -> unsigned long long {
            return in_k(i, key) ? weight(row[i]) : 0ull;
          },
          s, c, &tau_p, &cut_p);
    }
    auto kept = [&](int i, uint32_t key) {
      return in_k(i, key) && (key > tau_p || (key == tau_p && i <= cut_p));
    };
    // 4. The draw, in id order: the kept token whose weight interval holds u * total, i.e. the
    // first where the running weight exceeds it (reaches it + 1).
    const double u = uniform(p.seed, p.stream_key, p.position);
    const int32_t drawn = cluster_first_reaching(
        vocab,
        [&](int i) -> unsigned long long {
          const float v = row[i];
          return kept(i, order_key(v)) ? weight(v) : 0ull;
        },
        [&](unsigned long long total) {
          return static_cast<unsigned long long>(u * double(total)) + 1;
        },
        s, c);
    token = drawn == INT_MAX ? best_id : drawn;  // if rounding leaves the target unreached
  }

  // 5. The N best alternatives, best first: each block collects its own, the first gathers.
  const int n_top = min(p.logprobs, min(kDeviceMaxLogprobs, vocab));
  if (tid == 0) s.num_top = 0;
  __syncthreads();
  if (n_top > 0) {
    uint32_t tau = 0;
    int32_t cut = vocab;
    select_best_first(
        row, vocab, static_cast<unsigned long long>(n_top),
        [](int, uint32_t) -> unsigned long long { return 1; }, s, c, &tau, &cut);
    for (int i = c.thread(); i < vocab; i += c.threads()) {
      const uint32_t key = order_key(row[i]);
      if (key > tau || (key == tau && i <= cut)) {
        const int at = atomicAdd(&s.num_top, 1);
        if (at < kDeviceMaxLogprobs) s.top_ids[at] = i;
      }
    }
  }
  cluster_sync();  // every block's alternatives are collected
  if (c.rank == 0 && tid == 0) {
    DeviceSample r;
    r.token = token;
    r.logprob = clean(row[token]) - log_z;
    r.num_top = 0;
    for (int b = 0; b < c.size && n_top > 0; ++b) {
      const Shared* o = peer(s, b);
      const int have = min(o->num_top, kDeviceMaxLogprobs);
      for (int a = 0; a < have && r.num_top < n_top; ++a) r.top_ids[r.num_top++] = o->top_ids[a];
    }
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
    out[row_index] = r;
  }
  cluster_sync();  // no block leaves while the first still reads its shared memory
}

// The cluster size for the current device: kCluster where it has thread-block clusters
// (compute capability 9.0 or later), else 1. Cached per device.
int cluster_size() {
  static std::mutex mutex;
  static std::vector<std::pair<int, int>> known;  // (device, size)
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [d, size] : known) {
    if (d == device) return size;
  }
  int major = 0;
  const bool ok =
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess;
  const int size = ok && major >= 9 ? kCluster : 1;
  known.emplace_back(device, size);
  return size;
}

}  // namespace

int sample_rows(const float* logits, int64_t n, int64_t row_stride, int64_t vocab,
                const DeviceSamplingRow* params, DeviceSample* out, cudaStream_t stream) {
  if (n <= 0 || vocab <= 0) return cudaSuccess;
  const int cluster = cluster_size();
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(n * cluster));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = unsigned(cluster);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = cluster > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&config, sample_rows_kernel, logits, row_stride, int(vocab), params,
                            out);
}

}  // namespace treeserve::cuda
