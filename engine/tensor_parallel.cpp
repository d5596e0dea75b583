// Megatron sharding arithmetic (tensor_parallel.h).
#include "engine/tensor_parallel.h"

#include <cmath>
#include <string>

namespace treeserve {

Status check_tensor_parallel(const ModelConfig& config, int32_t world) {
  const std::string tp = "tensor_parallel = " + std::to_string(world);
  if (world < 1) return InvalidArgument(tp + ": must be >= 1");
  auto divisible = [&](const char* field, int64_t value) -> Status {
    if (value % world == 0) return Status::Ok();
    return InvalidArgument(tp + ": the model's " + field + " (" + std::to_string(value) +
                           ") is not divisible by " + std::to_string(world));
  };
  TS_RETURN_IF_ERROR(divisible("num_attention_heads", config.num_attention_heads));
  TS_RETURN_IF_ERROR(divisible("intermediate_size", config.intermediate_size));
  TS_RETURN_IF_ERROR(divisible("vocab_size", config.vocab_size));
  const int64_t nkv = config.num_key_value_heads;
  if (nkv < 1 || (nkv % world != 0 && world % nkv != 0)) {
    return InvalidArgument(tp + ": the model's num_key_value_heads (" + std::to_string(nkv) +
                           ") must be a multiple of it or divide it (fewer KV heads than ranks "
                           "are replicated)");
  }
  return Status::Ok();
}

TensorParallelShard tensor_parallel_shard(const ModelConfig& config, int32_t rank, int32_t world) {
  TensorParallelShard s;
  s.rank = rank;
  s.world = world;
  s.num_q_heads = config.num_attention_heads / world;
  s.q_head_begin = rank * s.num_q_heads;
  const int64_t nkv = config.num_key_value_heads;
  if (nkv >= world) {
    s.num_kv_heads = nkv / world;
    s.kv_head_begin = rank * s.num_kv_heads;
  } else {
    // Replicated: world / nkv ranks share each KV head, each holding a copy.
    s.num_kv_heads = 1;
    s.kv_head_begin = int64_t(rank) * nkv / world;
  }
  s.im_size = config.intermediate_size / world;
  s.im_begin = rank * s.im_size;
  s.vocab_size = config.vocab_size / world;
  s.vocab_begin = rank * s.vocab_size;
  return s;
}

void merge_argmax_shards(const std::vector<ArgmaxShard>& shards, int64_t n, int32_t* ids,
                         float* logprobs) {
  for (int64_t i = 0; i < n; ++i) {
    // Strictly larger only: an equal max in a later shard has a larger id.
    float best = 0.0f;
    int32_t id = -1;
    for (const ArgmaxShard& s : shards) {
      if (s.sums[i] > 0.0f && (id < 0 || s.maxes[i] > best)) {
        best = s.maxes[i];
        id = s.ids[i];
      }
    }
    double total = 0.0;
    for (const ArgmaxShard& s : shards) {
      if (s.sums[i] > 0.0f) total += double(s.sums[i]) * std::exp(double(s.maxes[i] - best));
    }
    ids[i] = id;
    logprobs[i] = float(-std::log(total));
  }
}

}  // namespace treeserve
