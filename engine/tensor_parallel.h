// Tensor-parallel sharding of a Llama model over N ranks (Megatron layout), as plain numbers:
// which query heads, KV heads, intermediate columns and vocabulary rows rank r holds. The CUDA
// backend slices its weights and sizes its KV pool share from a TensorParallelShard; the CPU
// code here is what the unit tests check.
//
//   QKV, gate/up   split by output rows (columns of y): each rank its heads / intermediate slice
//   O, down        split by input columns; each rank's partial sums are all-reduced
//   embed, LM head split by vocabulary rows; logits gathered (see cuda_backend.cpp)
//
// GQA with fewer KV heads than ranks replicates KV heads: rank r keeps KV head
// r * num_kv_heads / N, and all of its query heads belong to that head.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "models/model_config.h"

namespace treeserve {

struct TensorParallelShard {
  int32_t rank = 0;
  int32_t world = 1;
  int64_t q_head_begin = 0;  // query heads [q_head_begin, + num_q_heads)
  int64_t num_q_heads = 0;
  int64_t kv_head_begin = 0;  // KV heads [kv_head_begin, + num_kv_heads)
  int64_t num_kv_heads = 0;
  int64_t im_begin = 0;  // intermediate (gate/up rows, down columns) [im_begin, + im_size)
  int64_t im_size = 0;
  int64_t vocab_begin = 0;  // embedding / LM head rows [vocab_begin, + vocab_size)
  int64_t vocab_size = 0;

  int64_t q_size(int64_t head_dim) const { return num_q_heads * head_dim; }
  int64_t kv_size(int64_t head_dim) const { return num_kv_heads * head_dim; }
};

// INVALID_ARGUMENT naming the field when the model cannot be split over `world` ranks:
// world < 1; num_attention_heads, intermediate_size or vocab_size not divisible by world;
// num_key_value_heads neither a multiple nor a divisor of world.
Status check_tensor_parallel(const ModelConfig& config, int32_t world);

// Rank `rank`'s share (the config must pass check_tensor_parallel). world = 1: everything.
TensorParallelShard tensor_parallel_shard(const ModelConfig& config, int32_t rank, int32_t world);

// One vocabulary shard's greedy summary of n logit rows (cuda::argmax_partial's output):
// per row its max, sum of exp(x - max) over its ids (0: none under the vocab limit) and
// its argmax as a global id (lowest on ties).
struct ArgmaxShard {
  const float* maxes = nullptr;  // [n]
  const float* sums = nullptr;   // [n]
  const int32_t* ids = nullptr;  // [n]
};

// Merges the shards (in vocabulary order) into each row's global argmax (the lowest id on
// ties) and its log-softmax, -log(sum_s sums[s] * exp(maxes[s] - max)).
void merge_argmax_shards(const std::vector<ArgmaxShard>& shards, int64_t n, int32_t* ids,
                         float* logprobs);

}  // namespace treeserve
