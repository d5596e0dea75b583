// Helpers shared by the scheduler tests: a scheduler over the CPU backend and the tiny
// model, deterministic prompts, draining a stream, and the idle-pool check every test ends with.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <map>
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

// What a Generate stream carried, per branch.
struct Drained {
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, FinishReason> finish;
  Status status;
};

// Reads the stream to its end; cancels it after `cancel_after` events (-1: never).
inline Drained drain(GenerateStream& stream, int cancel_after = -1) {
  Drained d;
  TokenEvent ev;
  int events = 0;
  for (;;) {
    GenerateStream::Wait w = stream.next(&ev, &d.status, std::chrono::milliseconds(5000));
    if (w == GenerateStream::Wait::kEnd) break;
    EXPECT_NE(w, GenerateStream::Wait::kTimeout);
    if (w == GenerateStream::Wait::kTimeout) break;
    if (ev.token_id >= 0) d.tokens[ev.branch_id].push_back(ev.token_id);
    if (ev.finish != FinishReason::kNone) d.finish[ev.branch_id] = ev.finish;
    if (++events == cancel_after) stream.cancel();
  }
  return d;
}

// A beam search of `width` from one branch, up to `max_tokens` steps.
inline GenerateSpec beam_spec(const std::string& tree, const std::string& branch, int width,
                              int max_tokens) {
  GenerateSpec g;
  g.tree_id = tree;
  g.branch_ids = {branch};
  g.beam_width = width;
  g.max_tokens = max_tokens;
  return g;
}

// No trees, no branches, every page free or evictable cache.
inline void expect_idle(Scheduler& s) {
  SchedulerStats st = s.stats();
  EXPECT_EQ(st.live_trees, 0);
  EXPECT_EQ(st.live_branches, 0);
  EXPECT_EQ(st.kv_pages_free + st.kv_pages_evictable, st.kv_pages_total);
}

}  // namespace treeserve::testing
