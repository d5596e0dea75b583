// CpuModelWeights: the model's weights as float32 host arrays in the shapes the CPU layer
// loop wants: HF [out][in] layouts, with Q/K/V fused into one [q + 2 kv][hidden] matrix and
// gate/up into one [2 * intermediate][hidden] matrix, so a layer runs 4 GEMMs, not 7.
//
// FP8 models (ModelConfig::quant.scheme == kFp8) are emulated: the projections hold their e4m3
// weights dequantized (float(q) * scale of the row), from the checkpoint's F8_E4M3 weights and
// weight_scale or quantized at load from 16-bit weights by models/fp8.h's per-channel rule, and
// the backend quantizes and dequantizes each projection's input before its GEMM
// (engine/cpu_ops.h, fp8_fake_quantize_*), which is what an FP8 GEMM computes up to the
// order of its float32 accumulation.
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
  // FP8 with static activation scales: the scale each fused matrix's input is quantized with,
  // the largest of its parts' input_scale (q/k/v, gate/up), as the CUDA backend quantizes the
  // shared input once; 0 otherwise.
  float qkv_input_scale = 0.0f;
  float o_input_scale = 0.0f;
  float gate_up_input_scale = 0.0f;
  float down_input_scale = 0.0f;
};

struct CpuModelWeights {
  std::vector<float> embed;  // [vocab][hidden]
  std::vector<CpuLayerWeights> layers;
  std::vector<float> norm;     // [hidden]
  std::vector<float> lm_head;  // [vocab][hidden]; empty when tied to embed
  // FP8 emulation: the projections' inputs are quantized per row (dynamic per token) or, with
  // fp8_static, with the layers' static input scales. The LM head stays float32.
  bool fp8 = false;
  bool fp8_static = false;
  const float* lm_head_data() const { return lm_head.empty() ? embed.data() : lm_head.data(); }
};

// Random weights of the config's shape, the values the CUDA backend's random weights have
// (cuda::fill_random's hash of (seed, index), drawn in the same order): matrices uniform in
// +-1/sqrt(fan_in), the embedding in +-1, norms of ones. Under FP8 the projections are
// quantized per channel and the activations per token (random weights draw no static input
// scales). RESOURCE_EXHAUSTED when the host memory cannot be allocated.
StatusOr<CpuModelWeights> random_cpu_weights(const ModelConfig& config, uint64_t seed);

// Shape-checks every tensor against the config (INVALID_ARGUMENT naming the tensor) and
// converts it (FP8: dequantizes the checkpoint's e4m3 weights, or quantizes 16-bit ones at
// load). RESOURCE_EXHAUSTED when the host memory cannot be allocated.
StatusOr<CpuModelWeights> convert_weights_to_f32(const ModelConfig& config,
                                                 const LlamaWeights& weights);

}  // namespace treeserve
