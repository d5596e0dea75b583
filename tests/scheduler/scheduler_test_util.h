// Helpers shared by the scheduler tests: a scheduler over the CPU backend and the tiny
// model, deterministic prompts, and the idle-pool check every test ends with.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"
#include "scheduler/scheduler.h"

namespace treeserve::testing {

struct Served {
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Scheduler> scheduler;
};

// The tiny model on a one-thread CPU backend with `pages` KV pages of 16 tokens.
inline Served serve(int64_t pages, SchedulerOptions options = {},
                    ServerMetrics* metrics = nullptr) {
  Served s;
  auto config = load_model_config(TREESERVE_TINY_MODEL_DIR);
  EXPECT_TRUE(config.ok());
  auto reader = SafetensorsReader::open_dir(TREESERVE_TINY_MODEL_DIR);
  EXPECT_TRUE(reader.ok());
  auto weights = load_llama_weights(*config, *reader);
  EXPECT_TRUE(weights.ok());
  CpuBackendOptions co;
  co.num_pages = pages;
  co.page_size = 16;
  co.num_threads = 1;
  s.backend = std::move(create_cpu_backend(*config, *weights, co).value());
  s.tokenizer = std::move(
      Tokenizer::load(std::string(TREESERVE_TINY_MODEL_DIR) + "/tokenizer.model").value());
  options.max_sequence_tokens = config->max_position_embeddings;
  s.scheduler =
      std::move(Scheduler::create(s.backend.get(), s.tokenizer.get(), options, metrics).value());
  return s;
}

// n deterministic token ids in [3, 503).
inline std::vector<int32_t> prompt(int n, int salt = 0) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(3 + (i * 31 + salt * 7) % 500);
  return p;
}

// No trees, no branches, every page free or evictable cache.
inline void expect_idle(Scheduler& s) {
  SchedulerStats st = s.stats();
  EXPECT_EQ(st.live_trees, 0);
  EXPECT_EQ(st.live_branches, 0);
  EXPECT_EQ(st.kv_pages_free + st.kv_pages_evictable, st.kv_pages_total);
}

}  // namespace treeserve::testing
