// How a checkpoint's linear layers are quantized (ModelConfig::quant): read from config.json's
// quantization_config (the "fp8" layout and compressed-tensors' float-quantized FP8 schemes),
// or asked for with --quantization fp8 (model.quantization) to quantize a 16-bit checkpoint
// at load. The LM head and the embeddings always stay 16-bit. Also the KV cache's element
// type (kv_cache.dtype, --kv-cache-dtype), which the server and the tools parse alike.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace treeserve {

enum class QuantScheme {
  kNone,  // 16-bit linear layers
  kFp8,   // e4m3 weights and activations (models/fp8.h), float32 accumulation
};

enum class Fp8WeightScale {
  kChannel,  // one scale per output row: weight_scale [out] or [out, 1]
  kTensor,   // one scale per matrix: weight_scale [] or [1]
};

enum class Fp8ActivationScale {
  kDynamicPerToken,  // each row of a linear layer's input gets its own scale, per step
  kStaticPerTensor,  // the checkpoint's input_scale (a float32 scalar per linear layer)
};

struct QuantConfig {
  QuantScheme scheme = QuantScheme::kNone;
  // Whether the checkpoint holds F8_E4M3 weights with their scales (false: 16-bit weights
  // quantized at load, per channel, with dynamic per-token activations).
  bool prequantized = false;
  Fp8WeightScale weight_scale = Fp8WeightScale::kChannel;
  // Whether weight_scale above is stated (compressed-tensors' weights strategy, --quantization
  // fp8's per-channel scales). The "fp8" layout does not state it: the weight_scale tensors'
  // shape decides, at load (LlamaWeights::quant holds the result).
  bool weight_scale_stated = false;
  Fp8ActivationScale activation_scale = Fp8ActivationScale::kDynamicPerToken;
  // Where the scheme came from, for logs and messages: "config.json quantization_config
  // (fp8)", "config.json quantization_config (compressed-tensors)", "--quantization fp8".
  std::string source;
};

const char* quant_scheme_name(QuantScheme scheme);  // "none", "fp8"

enum class KvCacheDtype {
  kAuto,     // the model's: fp16 or bf16 on the CUDA backend, float32 on the CPU backend
  kFp8E4m3,  // e4m3 with one float32 scale per (token, kv head) row (kernels/kv_layout.h)
};

// Parses kv_cache.dtype / --kv-cache-dtype (`option` names it in messages): "auto", "fp8" or
// its alias "fp8_e4m3". "fp8_e5m2" is INVALID_ARGUMENT saying that only e4m3 is supported; any
// other value is INVALID_ARGUMENT naming the accepted ones.
StatusOr<KvCacheDtype> parse_kv_cache_dtype(const std::string& value, const std::string& option);
const char* kv_cache_dtype_name(KvCacheDtype dtype);  // "auto", "fp8_e4m3"

}  // namespace treeserve
