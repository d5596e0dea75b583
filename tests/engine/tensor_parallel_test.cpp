// Megatron sharding arithmetic (engine/tensor_parallel.h): the ranks' slices tile every
// dimension exactly once, query heads stay with their KV head (also when KV heads are
// replicated), shapes that do not split are refused naming the field, and the greedy merge of
// vocabulary shards gives the unsharded argmax and log-softmax.
#include "engine/tensor_parallel.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace treeserve {
namespace {

ModelConfig shape(int64_t heads, int64_t kv_heads, int64_t im, int64_t vocab) {
  ModelConfig c;
  c.hidden_size = heads * 64;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 64;
  c.intermediate_size = im;
  c.vocab_size = vocab;
  return c;
}

TEST(TensorParallelShard, SlicesTileEveryDimension) {
  for (const ModelConfig& c : {shape(32, 8, 14336, 128256), shape(4, 2, 512, 512)}) {
    for (int32_t world : {1, 2, 4}) {
      ASSERT_TRUE(check_tensor_parallel(c, world).ok());
      int64_t q = 0, im = 0, vocab = 0;
      for (int32_t r = 0; r < world; ++r) {
        const TensorParallelShard s = tensor_parallel_shard(c, r, world);
        EXPECT_EQ(s.q_head_begin, q);
        EXPECT_EQ(s.im_begin, im);
        EXPECT_EQ(s.vocab_begin, vocab);
        q += s.num_q_heads;
        im += s.im_size;
        vocab += s.vocab_size;
        // Every query head of the rank belongs to one of its KV heads.
        const int64_t group = c.num_attention_heads / c.num_key_value_heads;
        for (int64_t h = s.q_head_begin; h < s.q_head_begin + s.num_q_heads; ++h) {
          EXPECT_GE(h / group, s.kv_head_begin) << "rank " << r << " head " << h;
          EXPECT_LT(h / group, s.kv_head_begin + s.num_kv_heads) << "rank " << r;
        }
        // The rank's GQA group is whole: its q heads are num_kv_heads whole groups or part of one.
        EXPECT_EQ(s.num_q_heads % s.num_kv_heads, 0);
      }
      EXPECT_EQ(q, c.num_attention_heads);
      EXPECT_EQ(im, c.intermediate_size);
      EXPECT_EQ(vocab, c.vocab_size);
    }
  }
}

TEST(TensorParallelShard, FewerKvHeadsThanRanksAreReplicated) {
  const ModelConfig c = shape(4, 2, 512, 512);
  const int64_t expected_kv[4] = {0, 0, 1, 1};
  for (int32_t r = 0; r < 4; ++r) {
    const TensorParallelShard s = tensor_parallel_shard(c, r, 4);
    EXPECT_EQ(s.num_q_heads, 1);
    EXPECT_EQ(s.num_kv_heads, 1);
    EXPECT_EQ(s.kv_head_begin, expected_kv[r]) << "rank " << r;
  }
}

TEST(TensorParallelShard, RefusesShapesThatDoNotSplitNamingTheField) {
  struct Case {
    ModelConfig config;
    int32_t world;
    const char* field;
  };
  const Case cases[] = {
      {shape(32, 8, 14336, 128256), 3, "num_attention_heads"},
      {shape(32, 8, 14337, 128256), 2, "intermediate_size"},
      {shape(32, 8, 14336, 128257), 2, "vocab_size"},
      {shape(12, 6, 1200, 1200), 4, "num_key_value_heads"},
      {shape(32, 8, 14336, 128256), 0, "must be >= 1"},
  };
  for (const Case& k : cases) {
    Status s = check_tensor_parallel(k.config, k.world);
    ASSERT_FALSE(s.ok()) << k.field;
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find(k.field), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("tensor_parallel"), std::string::npos) << s.message();
  }
}

// What cuda::argmax_partial computes for one row of a shard (ids [begin, begin + count),
// those at or past `limit` left out).
void shard_summary(const std::vector<float>& row, int64_t begin, int64_t count, int64_t limit,
                   float* max, float* sum, int32_t* id) {
  *max = -INFINITY;
  *id = INT32_MAX;
  for (int64_t v = begin; v < std::min(begin + count, limit); ++v) {
    if (row[size_t(v)] > *max) {
      *max = row[size_t(v)];
      *id = int32_t(v);
    }
  }
  double s = 0;
  for (int64_t v = begin; v < std::min(begin + count, limit); ++v) {
    s += std::exp(double(row[size_t(v)]) - double(*max));
  }
  *sum = float(s);
}

TEST(TensorParallelShard, MergedArgmaxShardsMatchTheWholeRow) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t vocab = 1024, n = 40;
  std::vector<std::vector<float>> rows(static_cast<size_t>(n),
                                       std::vector<float>(static_cast<size_t>(vocab)));
  for (auto& row : rows) {
    for (float& x : row) x = normal(rng);
  }
  // Ties across shard boundaries: the lowest id must win.
  rows[0][100] = rows[0][700] = 50.0f;
  rows[1][300] = rows[1][900] = 50.0f;
  for (int64_t limit : {vocab, int64_t(600), int64_t(257)}) {
    for (int32_t world : {1, 2, 4}) {
      const int64_t per = vocab / world;
      std::vector<float> maxes(size_t(world * n)), sums(size_t(world * n));
      std::vector<int32_t> shard_ids(size_t(world * n));
      std::vector<ArgmaxShard> shards;
      for (int32_t r = 0; r < world; ++r) {
        for (int64_t i = 0; i < n; ++i) {
          const size_t k = size_t(r * n + i);
          shard_summary(rows[size_t(i)], r * per, per, limit, &maxes[k], &sums[k], &shard_ids[k]);
        }
        shards.push_back({&maxes[size_t(r * n)], &sums[size_t(r * n)], &shard_ids[size_t(r * n)]});
      }
      std::vector<int32_t> ids(static_cast<size_t>(n));
      std::vector<float> logprobs(static_cast<size_t>(n));
      merge_argmax_shards(shards, n, ids.data(), logprobs.data());
      for (int64_t i = 0; i < n; ++i) {
        const std::vector<float>& row = rows[size_t(i)];
        const int32_t best =
            int32_t(std::max_element(row.begin(), row.begin() + limit) - row.begin());
        double s = 0;
        for (int64_t v = 0; v < limit; ++v)
          s += std::exp(double(row[size_t(v)] - row[size_t(best)]));
        EXPECT_EQ(ids[size_t(i)], best) << "row " << i << " world " << world << " limit " << limit;
        EXPECT_NEAR(logprobs[size_t(i)], -std::log(s), 1e-5) << "row " << i << " world " << world;
      }
    }
  }
}

}  // namespace
}  // namespace treeserve
