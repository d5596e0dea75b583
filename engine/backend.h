// Backend: the model runtime the scheduler drives, one forward per step. A backend owns the
// weights on its device and the paged KV pool's memory (laid out per kernels/kv_layout.h;
// kvcache/ hands out the page ids, the backend stores the bytes). Implementations: the CPU
// reference below (float32, this folder) and the CUDA backend (cuda_backend.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "engine/step_batch.h"
#include "kernels/attention_plan.h"
#include "kernels/kv_layout.h"
#include "models/model_config.h"

namespace treeserve {

struct LlamaWeights;

// Logits of the rows a step asked for: data is [num_rows][vocab] float32, row i belonging
// to StepBatch::logit_rows[i].
struct Logits {
  int32_t num_rows = 0;
  int64_t vocab = 0;
  std::vector<float> data;  // empty when only the argmax was returned (see below)
  // Filled by backends that honour StepBatch::full_logits == false (then data is empty):
  // per logit row, the most likely token (lowest id on ties) and its log-softmax.
  std::vector<int32_t> argmax;
  std::vector<float> argmax_logprob;
  // Filled instead (data and argmax empty) when StepBatch::sampling is non-empty: per logit
  // row, the token drawn with that row's StepSampling, its logprob and the alternatives.
  std::vector<SampledToken> sampled;

  const float* row(int32_t i) const { return data.data() + int64_t(i) * vocab; }
  float* row(int32_t i) { return data.data() + int64_t(i) * vocab; }
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string_view name() const = 0;
  virtual const ModelConfig& model_config() const = 0;
  // The pool this backend allocated; kvcache/ must be created with the same page_size and
  // num_pages.
  virtual const KvLayout& kv_layout() const = 0;

  // Runs one step: slot moves, page copies, then every row through the model (its K/V
  // written at its slot), and the logits of batch.logit_rows into *out (resized; its
  // storage is reused across calls). INVALID_ARGUMENT (validate_step_batch) leaves the pool
  // untouched.
  virtual Status forward(const StepBatch& batch, Logits* out) = 0;
};

struct CpuBackendOptions {
  int64_t num_pages = 1024;  // KV pool pages (all layers, K and V: see KvLayout)
  int32_t page_size = 16;
  int32_t num_threads = 0;  // 0 = hardware concurrency; 1 = the calling thread only
  // Plan builder settings (tile shapes only shape the work split on the CPU; results agree
  // to float rounding whatever they are). gqa_group_size, head_dim and num_pages are set
  // from the model and pool.
  AttentionPlanConfig plan;
  // Per-query attention over each query's whole path (build_baseline_plan) instead of the
  // tree plan: what a prefix-unaware server does, for side-by-side measurements.
  bool baseline_attention = false;
  // FP8 KV cache (--kv-cache-dtype fp8), emulated: each K and V row (token, kv head) is
  // quantized to e4m3 with its own scale and dequantized as it is written (models/fp8.h's KV rule),
  // so attention reads what the CUDA backend's e4m3 pool holds; the pool stays float32.
  bool kv_cache_fp8 = false;
};

// Converts the weights to float32 (any of F32/F16/BF16) and allocates the pool, all zeros.
// INVALID_ARGUMENT for bad options (naming the field); RESOURCE_EXHAUSTED when the pool
// cannot be allocated.
StatusOr<std::unique_ptr<Backend>> create_cpu_backend(const ModelConfig& config,
                                                      const LlamaWeights& weights,
                                                      const CpuBackendOptions& options);

// Same model shape with random weights (random_cpu_weights in cpu_weights.h: the values the
// CUDA backend's create_cuda_backend_random draws with the same seed), for serving and load
// tests of a shape without its checkpoint.
StatusOr<std::unique_ptr<Backend>> create_cpu_backend_random(const ModelConfig& config,
                                                             const CpuBackendOptions& options,
                                                             uint64_t seed);

}  // namespace treeserve
