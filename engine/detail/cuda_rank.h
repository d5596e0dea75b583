// The seam between the CUDA backend's per-GPU model runtime and tensor parallelism:
// CudaRank is one rank's shard (detail/cuda_backend_impl.h's CudaBackend: its slices of the
// weights, its heads' share of the KV pool, its stream and workspace), and the tensor-parallel
// backend (cuda_tensor_parallel.cpp) drives N of them, one thread per GPU.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "engine/backend.h"
#include "engine/cuda_backend.h"
#include "engine/cuda_sampling.h"
#include "engine/step_batch.h"
#include "kernels/attention_plan.h"
#include "kernels/attention_view.h"
#include "models/model_config.h"

typedef struct ncclComm* ncclComm_t;  // same declaration as nccl.h

namespace treeserve::detail {

// Where a rank's step output goes (pinned host memory of the tensor-parallel backend): full
// logits into its vocabulary columns of [rows][vocab]; for greedy steps its shard's per-row
// max, sum of exp(x - max) and argmax id (tensor_parallel.h's ArgmaxShard); for sampling
// steps rank 0's device draws (the other ranks send it their shards).
struct ShardOutput {
  float* logits = nullptr;                // float [n][vocab]
  float* maxes = nullptr;                 // [n]
  float* sums = nullptr;                  // [n]
  int32_t* ids = nullptr;                 // [n]
  cuda::DeviceSample* sampled = nullptr;  // [n], rank 0
};

// The row of a draw as SamplingParams gives it, with the stream key and position of its
// uniform (sampling_uniform).
inline cuda::DeviceSamplingRow device_sampling_row(const SamplingParams& params,
                                                   uint64_t stream_key, int64_t position) {
  cuda::DeviceSamplingRow r;
  r.temperature = params.temperature;
  r.top_k = params.top_k;
  r.top_p = params.top_p;
  r.logprobs = params.logprobs;
  r.seed = params.seed;
  r.stream_key = stream_key;
  r.position = position;
  return r;
}

// The device sampler's rows as the Backend returns them.
inline void append_device_samples(const cuda::DeviceSample* got, int64_t n,
                                  std::vector<SampledToken>* out) {
  out->resize(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    SampledToken& t = (*out)[size_t(i)];
    t.token = got[i].token;
    t.logprob = got[i].logprob;
    t.top.clear();
    for (int32_t a = 0; a < got[i].num_top; ++a) {
      t.top.push_back({got[i].top_ids[a], got[i].top_logprobs[a]});
    }
  }
}

class CudaRank {
 public:
  virtual ~CudaRank() = default;
  // Device, stream, weight buffers, pool, workspace (on the calling thread's device, which
  // it sets).
  virtual Status init() = 0;
  // This rank's slices: from the checkpoint, or random (the global weights' values).
  virtual Status load(const LlamaWeights& weights) = 0;
  virtual Status randomize(uint64_t seed) = 0;
  // The step's attention plan; every rank's is the same (same head counts), so one is built.
  virtual Status build_plan(const AttentionView& view, AttentionPlan* plan) const = 0;
  // Grows the step's buffers; before any rank starts the step's collectives.
  virtual Status reserve_scratch(const StepBatch& batch) = 0;
  // The step on this rank (its all-reduces included), its logits shard into `out`, waited for.
  virtual Status forward_shard(const StepBatch& batch, const AttentionPlan& plan,
                               const ShardOutput& out) = 0;

  // Peer-to-peer all-reduce (cuda_ops.h P2PAllReduce), set up after every rank's init() when
  // all devices reach each other's memory: this rank's two partial-sum buffers and its barrier
  // flags (allocated by init() when options.p2p_all_reduce and world > 1; nulls otherwise),
  // then every rank's endpoint in rank order, which turns the path on.
  struct P2PEndpoint {
    float* partials[2] = {nullptr, nullptr};
    uint32_t* flags = nullptr;
  };
  virtual P2PEndpoint p2p_endpoint() const = 0;
  virtual void set_p2p_peers(const std::vector<P2PEndpoint>& ranks) = 0;
};

// Rank `rank` of `world` on device options.device + rank, all-reducing over `comm`.
std::unique_ptr<CudaRank> make_cuda_rank(const ModelConfig& config,
                                         const CudaBackendOptions& options, int32_t rank,
                                         int32_t world, ncclComm_t comm);

// The tensor-parallel backend (options.tensor_parallel > 1; options already checked): the
// checkpoint's weights, or random weights from `seed` when weights is null.
StatusOr<std::unique_ptr<Backend>> create_tensor_parallel_backend(const ModelConfig& config,
                                                                  const CudaBackendOptions& options,
                                                                  const LlamaWeights* weights,
                                                                  uint64_t seed);

}  // namespace treeserve::detail
