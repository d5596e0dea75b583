// Fuzzes the Hugging Face config.json parser (models/model_config.h): parse_model_config on
// arbitrary text. A config it accepts must describe a model the engines can be built for:
// positive sizes that fit the int32 fields the KV layout and the engines keep them in, heads
// that divide evenly, an even head_dim, token ids inside the vocabulary, finite RoPE
// parameters, and finite positive RoPE frequencies.
#include <cmath>
#include <cstdint>
#include <string>

#include "models/model_config.h"
#include "tests/fuzz/fuzz_util.h"

using treeserve::fuzz::check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto parsed = treeserve::parse_model_config(text, "config.json");
  if (!parsed.ok()) {
    check(parsed.status().code() == treeserve::StatusCode::kInvalidArgument,
          "a bad config.json is INVALID_ARGUMENT");
    check(parsed.status().message().rfind("config.json", 0) == 0,
          "the message names the file first");
    return 0;
  }
  const treeserve::ModelConfig& c = *parsed;
  check(c.architecture == "LlamaForCausalLM" || c.architecture == "MistralForCausalLM",
        "a supported architecture");
  for (int64_t v : {c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                    c.num_attention_heads, c.num_key_value_heads, c.head_dim}) {
    check(v > 0 && v <= INT32_MAX, "every size is positive and fits in int32");
  }
  check(c.max_position_embeddings > 0, "max_position_embeddings is positive");
  check(c.sliding_window >= 0, "sliding_window is 0 or positive");
  check(c.num_attention_heads % c.num_key_value_heads == 0, "kv heads divide the heads");
  check(c.head_dim % 2 == 0, "head_dim is even");
  int64_t q = 0, kv = 0;
  check(!__builtin_mul_overflow(c.num_attention_heads, c.head_dim, &q) && q <= INT32_MAX,
        "heads x head_dim fits in int32");
  check(!__builtin_mul_overflow(c.num_key_value_heads, c.head_dim, &kv) && kv <= INT32_MAX,
        "kv heads x head_dim fits in int32");
  check(c.q_size() == q && c.kv_size() == kv, "q_size() and kv_size()");
  check(c.bos_token_id >= -1 && c.bos_token_id < c.vocab_size, "bos_token_id in the vocabulary");
  for (int32_t eos : c.eos_token_ids) {
    check(eos >= 0 && eos < c.vocab_size, "eos_token_id in the vocabulary");
  }
  check(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps > 0, "rms_norm_eps finite, positive");
  check(std::isfinite(c.rope_theta) && c.rope_theta > 1, "rope_theta finite, > 1");
  if (c.rope_scaling.type == treeserve::RopeType::kLlama3) {
    const treeserve::RopeScaling& s = c.rope_scaling;
    check(std::isfinite(s.factor) && std::isfinite(s.low_freq_factor) &&
              std::isfinite(s.high_freq_factor),
          "llama3 rope factors are finite");
    check(s.original_max_position_embeddings > 0, "original_max_position_embeddings > 0");
  }
  // Every head_dim an accepted config can name is computed at load time; a very large one is
  // a large (legitimate) allocation, so only the modest ones are computed here.
  if (c.head_dim <= 4096) {
    const std::vector<float> inv_freq = treeserve::rope_inv_freq(c);
    check(int64_t(inv_freq.size()) == c.head_dim / 2, "head_dim / 2 frequencies");
    for (float f : inv_freq) check(std::isfinite(f) && f >= 0, "finite frequencies");
  }
  return 0;
}
