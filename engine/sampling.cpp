// Token sampling (see sampling.h). Candidates are ordered by a total order — logit
// descending, then id ascending — so every selection (argmax, top-k, nucleus, logprob
// alternatives) is deterministic, and the one uniform of a draw is walked through the kept
// tokens' cumulative weights in a fixed order (inverse CDF): id order for plain and top-p
// sampling, best first for top-k.
//
// Cost with a 128k vocabulary is a few passes over the row: the max, one vectorised
// exp(logit - max) pass (the log-softmax normaliser; reused as the sampling weights at
// temperature 1), and for top-k a heap scan, for top-p a threshold filter that keeps only
// tokens that can be in the nucleus, then a weighted quickselect for its boundary.
#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

namespace treeserve {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Temperatures below this are greedy (as in vLLM): 1 / T would overflow the exponent
// arithmetic long before the distribution differs from argmax.
constexpr float kMinTemperature = 1e-5f;

// Weights are summed in float vectors over blocks of this many tokens, blocks in double.
constexpr int64_t kBlock = 256;

// Not with clang (the fuzz build, tests/fuzz): it refuses the AVX2 clone's calls of the
// always-inline vector helpers below, and the baseline clone alone gives the same tokens.
#if defined(__x86_64__) && defined(__has_attribute) && !defined(__clang__)
#if __has_attribute(target_clones)
#define TS_SAMPLING_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef TS_SAMPLING_CLONES
#define TS_SAMPLING_CLONES
#endif

// 8-lane vectors (GCC/Clang extensions); the functions using them are compiled for AVX2 and
// for baseline x86-64, where 256-bit vectors are emulated (slowly but identically).
typedef float V8 __attribute__((vector_size(32)));
typedef int32_t V8i __attribute__((vector_size(32)));

inline __attribute__((always_inline)) V8 splat(float x) { return V8{x, x, x, x, x, x, x, x}; }

// e^x for x <= 0, 8 lanes; x below -87 (and -inf, NaN) gives exactly 0. x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7), 2^n by
// building the float's exponent.
inline __attribute__((always_inline)) V8 exp_nonpositive(V8 x) {
  const V8 lo = splat(-87.0f);
  const V8 xc = x > lo ? x : lo;  // NaN compares false: clamped too
  // n = round(x log2 e): truncation toward zero of a negative value - 0.5.
  const V8i n = __builtin_convertvector(xc * splat(1.44269504f) - splat(0.5f), V8i);
  const V8 nf = __builtin_convertvector(n, V8);
  const V8 r = xc - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
  V8 p = splat(1.0f / 720);
  p = p * r + splat(1.0f / 120);
  p = p * r + splat(1.0f / 24);
  p = p * r + splat(1.0f / 6);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  const V8i bits = (n + 127) << 23;
  V8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x > lo ? p * scale : splat(0.0f);
}

inline __attribute__((always_inline)) V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// NaN logits never win a comparison and weigh nothing.
inline float key(float x) { return x != x ? kNegInf : x; }

using Candidate = SamplingCandidate;

// "a comes before b": higher logit, then lower id.
inline bool better(const Candidate& a, const Candidate& b) {
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

// splitmix64's finaliser (Steele et al.), a bijective 64-bit mix.
inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

TS_SAMPLING_CLONES
float max_logit(const float* logits, int64_t vocab) {
  V8 m = splat(kNegInf);
  int64_t i = 0;
  for (; i + 8 <= vocab; i += 8) {
    const V8 x = load8(logits + i);
    m = x > m ? x : m;  // NaN lanes keep m
  }
  float best = kNegInf;
  for (int j = 0; j < 8; ++j) best = std::max(best, m[j]);
  for (; i < vocab; ++i) best = std::max(best, key(logits[i]));
  return best;
}

// weights[i] = e^((logits[i] - max) * inv_t); block_sums[b] = the sum of block b (float
// lanes, then double). Returns the total. A block's ragged end is padded with -inf so that
// every token's weight comes from the same vector code. Compiled for AVX2 and baseline x86-64
// with identical per-lane arithmetic (no FMA), so the tokens do not depend on the machine.
TS_SAMPLING_CLONES
double exp_weights(const float* logits, int64_t vocab, float max, float inv_t, float* weights,
                   double* block_sums) {
  const V8 m = splat(max), s = splat(inv_t);
  double total = 0.0;
  for (int64_t b0 = 0, block = 0; b0 < vocab; b0 += kBlock, ++block) {
    const int64_t b1 = std::min(vocab, b0 + kBlock);
    const int64_t full = b0 + ((b1 - b0) & ~int64_t(7));
    V8 acc = splat(0.0f);
    for (int64_t i = b0; i < full; i += 8) {
      const V8 w = exp_nonpositive((load8(logits + i) - m) * s);
      acc += w;
      std::memcpy(weights + i, &w, sizeof(w));
    }
    if (full < b1) {
      float pad[8];
      std::fill(pad, pad + 8, kNegInf);
      std::copy(logits + full, logits + b1, pad);
      const V8 w = exp_nonpositive((load8(pad) - m) * s);
      acc += w;
      std::memcpy(pad, &w, sizeof(w));
      std::copy(pad, pad + (b1 - full), weights + full);
    }
    const double sum =
        (double(acc[0]) + acc[4] + acc[1] + acc[5]) + (double(acc[2]) + acc[6] + acc[3] + acc[7]);
    block_sums[block] = sum;
    total += sum;
  }
  return total;
}

// Inverse CDF over the whole vocabulary in id order: whole blocks are skipped by their
// sums, then the block holding u * total is scanned.
int32_t pick_in_vocab(const float* weights, int64_t vocab, const double* block_sums, double total,
                      double u) {
  const double target = u * total;
  double acc = 0.0;
  int64_t last_positive = 0;
  for (int64_t b0 = 0, block = 0; b0 < vocab; b0 += kBlock, ++block) {
    if (block_sums[block] <= 0.0) continue;
    const int64_t b1 = std::min(vocab, b0 + kBlock);
    if (acc + block_sums[block] <= target) {
      acc += block_sums[block];
      for (int64_t i = b1 - 1; i >= b0; --i) {
        if (weights[i] > 0.0f) {
          last_positive = i;
          break;
        }
      }
      continue;
    }
    for (int64_t i = b0; i < b1; ++i) {
      if (weights[i] <= 0.0f) continue;
      acc += weights[i];
      last_positive = i;
      if (target < acc) return int32_t(i);
    }
    return int32_t(last_positive);  // rounding left the target at the block's end
  }
  return int32_t(last_positive);
}

// Inverse CDF over the first n candidates (in their order), weights[candidate id].
int32_t pick_in_candidates(const Candidate* c, int64_t n, const float* weights, double total,
                           double u) {
  const double target = u * total;
  double acc = 0.0;
  int64_t last_positive = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float w = weights[c[j].id];
    if (w <= 0.0f) continue;
    acc += w;
    last_positive = j;
    if (target < acc) return c[j].id;
  }
  return c[last_positive].id;
}

// The k best tokens, best first, into *out. Small k: a heap of the k best so far, where
// 8 tokens at a time are skipped when none reaches the worst kept; large k: nth_element
// over all tokens.
TS_SAMPLING_CLONES
void select_best(const float* logits, int64_t vocab, int64_t k, std::vector<Candidate>* out) {
  out->clear();
  if (k <= 0) return;
  if (k * 16 <= vocab) {
    out->reserve(size_t(k));
    int32_t id = 0;
    for (; id < int32_t(k); ++id) {
      out->push_back({key(logits[id]), id});
      std::push_heap(out->begin(), out->end(), better);  // front: the worst kept
    }
    while (id < int32_t(vocab)) {
      if ((id & 7) == 0 && id + 8 <= vocab) {
        const V8i reach = load8(logits + id) >= splat(out->front().logit);  // NaN: false
        if (!((reach[0] | reach[1] | reach[2] | reach[3]) |
              (reach[4] | reach[5] | reach[6] | reach[7]))) {
          id += 8;
          continue;
        }
      }
      const Candidate c{key(logits[id]), id};
      if (better(c, out->front())) {
        std::pop_heap(out->begin(), out->end(), better);
        out->back() = c;
        std::push_heap(out->begin(), out->end(), better);
      }
      ++id;
    }
    std::sort_heap(out->begin(), out->end(), better);
    return;
  }
  out->resize(size_t(vocab));
  for (int32_t id = 0; id < int32_t(vocab); ++id) (*out)[id] = {key(logits[id]), id};
  if (k < vocab) std::nth_element(out->begin(), out->begin() + k, out->end(), better);
  out->resize(size_t(k));
  std::sort(out->begin(), out->end(), better);
}

// The nucleus's last token in the candidates' order: the first (best-first) whose cumulative
// weight reaches `target`, or the last candidate if rounding never gets there. A weighted
// quickselect (expected linear time): nth_element halves the range, the better half's weight
// says which half holds the boundary. Permutes *c.
Candidate nucleus_boundary(std::vector<Candidate>* c, const float* weights, double target) {
  int64_t lo = 0, hi = int64_t(c->size());
  double before = 0.0;  // weight of the candidates better than [lo, hi)
  while (hi - lo > 64) {
    const int64_t mid = lo + (hi - lo) / 2;
    std::nth_element(c->begin() + lo, c->begin() + mid, c->begin() + hi, better);
    double mass = 0.0;
    for (int64_t j = lo; j < mid; ++j) mass += weights[(*c)[j].id];
    if (before + mass >= target) {
      hi = mid;
    } else {
      before += mass;
      lo = mid;
    }
  }
  std::sort(c->begin() + lo, c->begin() + hi, better);
  for (int64_t j = lo; j < hi; ++j) {
    before += weights[(*c)[j].id];
    if (before >= target) return (*c)[j];
  }
  return (*c)[hi - 1];
}

int32_t argmax(const float* logits, int64_t vocab, float max) {
  for (int32_t id = 0; id < int32_t(vocab); ++id) {
    if (logits[id] == max) return id;  // the first: ties go to the lowest id
  }
  return 0;  // every logit NaN
}

}  // namespace

Status validate_sampling_params(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || std::isinf(p.temperature)) {
    return InvalidArgument("temperature = " + std::to_string(p.temperature) +
                           " must be a finite number >= 0 (0 = greedy)");
  }
  if (p.top_k < 0) {
    return InvalidArgument("top_k = " + std::to_string(p.top_k) + " must be >= 0 (0 = off)");
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return InvalidArgument("top_p = " + std::to_string(p.top_p) + " must be in (0, 1] (1 = off)");
  }
  if (p.logprobs < 0 || p.logprobs > kMaxLogprobs) {
    return InvalidArgument("logprobs = " + std::to_string(p.logprobs) + " must be in [0, " +
                           std::to_string(kMaxLogprobs) + "]");
  }
  return Status::Ok();
}

double sampling_uniform(uint64_t seed, uint64_t stream_key, int64_t position) {
  uint64_t h = mix64(seed);
  h = mix64(h ^ stream_key);
  h = mix64(h ^ uint64_t(position));
  return double(h >> 11) * 0x1.0p-53;
}

SampledToken sample_token(const float* logits, int64_t vocab, const SamplingParams& params,
                          uint64_t stream_key, int64_t position, SamplingScratch* s) {
  SampledToken out;
  s->weights.resize(size_t(vocab));
  s->block_sums.resize(size_t((vocab + kBlock - 1) / kBlock));
  const float max = max_logit(logits, vocab);
  // Log-softmax normaliser of the unmodified logits; the weights are the temperature-1 ones.
  // A row without a finite maximum (all -inf or NaN, or a +inf) has no distribution: its
  // argmax is returned with NaN logprobs.
  const bool any = std::isfinite(max);
  const double z =
      any ? exp_weights(logits, vocab, max, 1.0f, s->weights.data(), s->block_sums.data()) : 0.0;
  const double log_z = double(max) + std::log(z);
  auto logprob = [&](int32_t id) {
    return any ? float(double(key(logits[id])) - log_z) : std::numeric_limits<float>::quiet_NaN();
  };

  const int64_t k = (params.top_k > 0 && params.top_k < vocab) ? params.top_k : vocab;
  if (params.temperature < kMinTemperature || !any || k == 1) {
    out.token = argmax(logits, vocab, max);
  } else {
    const double u = sampling_uniform(params.seed, stream_key, position);
    const float inv_t = 1.0f / params.temperature;
    const double top_p = params.top_p;
    if (k < vocab) {
      // Top-k, then top-p over the k renormalised (the HF and vLLM order).
      select_best(logits, vocab, k, &s->candidates);
      const float cmax = s->candidates[0].logit;
      double total = 0.0;
      for (const Candidate& c : s->candidates) {
        total += s->weights[c.id] = std::exp((c.logit - cmax) * inv_t);
      }
      int64_t kept = k;
      if (top_p < 1.0) {
        double acc = 0.0;
        for (int64_t j = 0; j < k; ++j) {
          acc += s->weights[s->candidates[j].id];
          if (acc >= top_p * total) {
            kept = j + 1;
            total = acc;
            break;
          }
        }
      }
      out.token = pick_in_candidates(s->candidates.data(), kept, s->weights.data(), total, u);
    } else {
      const double total = inv_t == 1.0f ? z
                                         : exp_weights(logits, vocab, max, inv_t, s->weights.data(),
                                                       s->block_sums.data());
      if (top_p >= 1.0) {
        out.token = pick_in_vocab(s->weights.data(), vocab, s->block_sums.data(), total, u);
      } else {
        // Tokens weighing at most (1 - top_p) / vocab of the total cannot all together make
        // up the (1 - top_p) the nucleus leaves out, so the nucleus lies among the others.
        // (Half the bound leaves room for rounding.) Its members, in id order, are then the
        // candidates no worse than its boundary token.
        const float threshold = float(0.5 * (1.0 - top_p) / double(vocab) * total);
        s->candidates.clear();
        for (int32_t id = 0; id < int32_t(vocab); ++id) {
          if (s->weights[id] > threshold) s->candidates.push_back({key(logits[id]), id});
        }
        s->selection = s->candidates;
        const Candidate last = nucleus_boundary(&s->selection, s->weights.data(), top_p * total);
        int64_t kept = 0;
        double kept_weight = 0.0;
        for (const Candidate& c : s->candidates) {
          if (better(last, c)) continue;
          s->candidates[kept++] = c;
          kept_weight += s->weights[c.id];
        }
        out.token =
            pick_in_candidates(s->candidates.data(), kept, s->weights.data(), kept_weight, u);
      }
    }
  }
  out.logprob = logprob(out.token);
  select_best(logits, vocab, std::min<int64_t>(params.logprobs, vocab), &s->candidates);
  for (const Candidate& c : s->candidates) out.top.push_back({c.id, logprob(c.id)});
  return out;
}

}  // namespace treeserve
