// Token sampling on the device (cuda_sampling.cu): for each logit row, the token a
// SamplingParams asks for, its logprob, and the most likely alternatives, so a step returns
// a few bytes per row instead of the whole vocabulary of float logits.
//
// Same semantics as the host sampler (engine/sampling.h), same uniform per draw
// (sampling_uniform(seed, stream_key, position)), same tie rules (higher logit, then lower
// id): greedy below temperature 1e-5 (or top_k == 1, or a row without a finite maximum);
// otherwise weights exp((logit - max) / T), top-k then top-p over the kept weights, and the
// uniform walked through the kept tokens' cumulative weights. Logprobs are the log-softmax
// of the unmodified logits. The kept sets are identical to the host's; the walk runs in id
// order (the host walks top-k candidates best first), so with top_k the two backends may
// draw different tokens from the same seed — from the same distribution.
//
// Deterministic: the weights are summed in 2^-40 fixed point (integer atomics, so no
// float-order effects), and every selection is a radix select on order-preserving keys.
// Plain C++ launcher; no CUDA types but the forward-declared stream.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace treeserve::cuda {

constexpr int32_t kDeviceMaxLogprobs = 20;  // engine/sampling.h's kMaxLogprobs

struct DeviceSamplingRow {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  int32_t logprobs = 0;  // [0, kDeviceMaxLogprobs]
  uint64_t seed = 0;
  uint64_t stream_key = 0;
  int64_t position = 0;
};

struct DeviceSample {
  int32_t token = 0;
  float logprob = 0.0f;
  int32_t num_top = 0;
  int32_t top_ids[kDeviceMaxLogprobs];
  float top_logprobs[kDeviceMaxLogprobs];
};

// For rows i in [0, n): samples from logits + i * row_stride (float), considering ids
// [0, vocab) only, with params[i]; writes out[i]. A cluster of 8 blocks per row on GPUs with
// thread-block clusters (sm_90), else one block. Returns the launch's cudaError_t (0: enqueued).
int sample_rows(const float* logits, int64_t n, int64_t row_stride, int64_t vocab,
                const DeviceSamplingRow* params, DeviceSample* out, cudaStream_t stream);

}  // namespace treeserve::cuda
