// CpuModelWeights: the model's weights as float32 host arrays in the shapes the CPU layer
// loop wants: HF [out][in] layouts, with Q/K/V fused into one [q + 2 kv][hidden] matrix and
// gate/up into one [2 * intermediate][hidden] matrix, so a layer runs 4 GEMMs, not 7.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "models/llama_weights.h"
#include "models/model_config.h"

namespace treeserve {

struct CpuLayerWeights {
  std::vector<float> input_norm;  // [hidden]
  std::vector<float> qkv;         // [q_size + 2 * kv_size][hidden]: q_proj; k_proj; v_proj
  std::vector<float> o;           // [hidden][q_size]
  std::vector<float> post_norm;   // [hidden]
  std::vector<float> gate_up;     // [2 * intermediate][hidden]: gate_proj; up_proj
  std::vector<float> down;        // [hidden][intermediate]
};

struct CpuModelWeights {
  std::vector<float> embed;  // [vocab][hidden]
  std::vector<CpuLayerWeights> layers;
  std::vector<float> norm;     // [hidden]
  std::vector<float> lm_head;  // [vocab][hidden]; empty when tied to embed
  const float* lm_head_data() const { return lm_head.empty() ? embed.data() : lm_head.data(); }
};

// Random weights of the config's shape, the values the CUDA backend's random weights have
// (cuda::fill_random's hash of (seed, index), drawn in the same order): matrices uniform in
// +-1/sqrt(fan_in), the embedding in +-1, norms of ones. RESOURCE_EXHAUSTED when the host
// memory cannot be allocated.
StatusOr<CpuModelWeights> random_cpu_weights(const ModelConfig& config, uint64_t seed);

// Shape-checks every tensor against the config (INVALID_ARGUMENT naming the tensor) and
// converts it. RESOURCE_EXHAUSTED when the host memory cannot be allocated.
StatusOr<CpuModelWeights> convert_weights_to_f32(const ModelConfig& config,
                                                 const LlamaWeights& weights);

}  // namespace treeserve
