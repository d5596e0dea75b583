// Sampling of one token from one row of logits: greedy, temperature, top-k, top-p, with the
// logprob of the sampled token and of the most likely alternatives.
//
// Randomness is counter-based and stateless: the one uniform a draw uses is a hash of
// (seed, stream_key, position), so a branch (the scheduler passes a stable per-branch
// stream_key) gets the same token at the same position with the same seed whatever else is
// in the batch, in whatever order steps run, and after a restart.
//
// Logprobs are the log-softmax of the unmodified logits (temperature 1, no top-k / top-p
// filtering), as OpenAI and vLLM report them, whatever the sampling parameters.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace treeserve {

inline constexpr int32_t kMaxLogprobs = 20;

struct SamplingParams {
  float temperature = 1.0f;  // 0 (or below 1e-5) = greedy: argmax, ties to the lowest id
  int32_t top_k = 0;         // keep the k most likely tokens; 0 = off (k >= vocab: off)
  float top_p = 1.0f;        // keep the smallest most-likely set with mass >= top_p; 1 = off
  uint64_t seed = 0;
  int32_t logprobs = 0;  // number of top alternatives to report, [0, kMaxLogprobs]
};

// INVALID_ARGUMENT naming the field: temperature negative, NaN or infinite; top_k < 0;
// top_p outside (0, 1] (or NaN); logprobs outside [0, kMaxLogprobs].
Status validate_sampling_params(const SamplingParams& params);

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
  bool operator==(const TokenLogprob&) const = default;
};

struct SampledToken {
  int32_t token = 0;
  float logprob = 0.0f;  // log-softmax of the unmodified logits at `token`
  // The params.logprobs most likely tokens by unmodified logit, most likely first (ties:
  // lower id first).
  std::vector<TokenLogprob> top;
};

struct SamplingCandidate {
  float logit = 0.0f;
  int32_t id = 0;
};

// Reused between calls so that steady-state sampling does not allocate.
struct SamplingScratch {
  std::vector<float> weights;                 // [vocab] unnormalised probabilities
  std::vector<double> block_sums;             // [vocab / 256] sums of weights
  std::vector<SamplingCandidate> candidates;  // top-k / nucleus / logprob candidates
  std::vector<SamplingCandidate> selection;   // the nucleus search's working copy
};

// The uniform in [0, 1) a draw at (seed, stream_key, position) uses (53 random bits of a
// splitmix64-style hash of the three). Exposed for tests and for callers that need further
// independent streams (pass a derived stream_key).
double sampling_uniform(uint64_t seed, uint64_t stream_key, int64_t position);

// Samples one token from logits [vocab] (vocab >= 1) with validated params. Cost: a few
// vectorised passes over the row whatever the params (the logprob normaliser is always
// computed); top-k adds a heap selection of k, top-p a weighted quickselect of the nucleus
// among the tokens heavy enough to be in it. A row with no finite maximum gives its argmax
// and NaN logprobs.
SampledToken sample_token(const float* logits, int64_t vocab, const SamplingParams& params,
                          uint64_t stream_key, int64_t position, SamplingScratch* scratch);

}  // namespace treeserve
