// A naive Llama forward for the engine tests, written independently of engine/: plain loops,
// double arithmetic, full causal attention over one whole sequence, no paging, no plan. It
// follows Hugging Face LlamaForCausalLM; only the RoPE inverse frequencies (a float32 formula
// checked against transformers by the models/ tests and the golden test) come from models/.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "models/llama_weights.h"
#include "models/model_config.h"

namespace treeserve::testing {

class ReferenceModel {
 public:
  ReferenceModel(const ModelConfig& config, const LlamaWeights& weights);

  // Logits of every position of `tokens`: [tokens.size()][vocab], row t = the model's
  // prediction after tokens[0..t].
  std::vector<float> forward(std::span<const int32_t> tokens) const;

  int64_t vocab() const { return config_.vocab_size; }

 private:
  struct Layer {
    std::vector<float> input_norm, q, k, v, o, post_norm, gate, up, down;
  };
  ModelConfig config_;
  std::vector<float> embed_, norm_, lm_head_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
};

}  // namespace treeserve::testing
