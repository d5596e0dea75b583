// The EOS list from a model directory to the end of a generation: the tiny model's files plus
// a generation_config.json whose eos_token_id is a list, loaded as the server loads them
// (load_model_config -> CPU backend -> Scheduler). A greedy run ends FINISH_EOS on the first
// token that is any id of the list, and runs on through ids that are not in it.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"
#include "scheduler/scheduler.h"
#include "tests/models/test_util.h"

namespace treeserve {
namespace {

using testing::TempDir;
using testing::write_file;

struct Generated {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::kNone;
};

// The tiny model's files linked into `dir`, with `generation_config` written beside them
// (none when empty); then a greedy one-shot generation of up to max_tokens from `prompt`.
Generated generate_in(const TempDir& dir, const std::string& generation_config,
                      const std::vector<int32_t>& prompt, int max_tokens) {
  namespace fs = std::filesystem;
  for (const char* name : {"config.json", "model.safetensors", "tokenizer.model"}) {
    if (!fs::exists(dir.file(name))) {
      fs::create_symlink(fs::path(TREESERVE_TINY_MODEL_DIR) / name, dir.file(name));
    }
  }
  std::error_code ec;
  fs::remove(dir.file("generation_config.json"), ec);
  if (!generation_config.empty()) write_file(dir.file("generation_config.json"), generation_config);

  Generated run;
  auto config = load_model_config(dir.path());
  EXPECT_TRUE(config.ok()) << config.status().ToString();
  auto reader = SafetensorsReader::open_dir(dir.path());
  auto weights = load_llama_weights(*config, *reader);
  CpuBackendOptions options;
  options.num_pages = 64;
  options.page_size = 16;
  options.num_threads = 1;
  auto backend = create_cpu_backend(*config, *weights, options);
  auto tokenizer = Tokenizer::load_model_dir(dir.path());
  EXPECT_TRUE(backend.ok() && tokenizer.ok());
  SchedulerOptions sched;
  sched.max_sequence_tokens = config->max_position_embeddings;
  auto scheduler = Scheduler::create(backend->get(), tokenizer->get(), sched, nullptr);
  EXPECT_TRUE(scheduler.ok());
  GenerateSpec spec;
  spec.prompt = prompt;
  spec.sampling.temperature = 0;
  spec.max_tokens = max_tokens;
  auto stream = (*scheduler)->generate(spec);
  EXPECT_TRUE(stream.ok());
  TokenEvent ev;
  Status status;
  while ((*stream)->next(&ev, &status, std::chrono::milliseconds(30000)) ==
         GenerateStream::Wait::kEvent) {
    if (ev.token_id >= 0 && ev.finish != FinishReason::kCancelled)
      run.tokens.push_back(ev.token_id);
    if (ev.finish != FinishReason::kNone) run.finish = ev.finish;
  }
  EXPECT_TRUE(status.ok()) << status.ToString();
  return run;
}

TEST(EosListTest, GenerationEndsOnAnyIdOfTheList) {
  TempDir dir;
  const std::vector<int32_t> prompt = {1, 40, 41, 42, 43, 44, 45};
  // An EOS id the tiny model never produces from this prompt: the run goes to max_tokens.
  const Generated free_run = generate_in(dir, R"({"eos_token_id": 511})", prompt, 12);
  ASSERT_EQ(free_run.finish, FinishReason::kLength);
  ASSERT_EQ(free_run.tokens.size(), 12u);
  // The first token that did not appear before it: ending on it proves the list is read.
  size_t k = 1;
  while (k < free_run.tokens.size() &&
         std::find(free_run.tokens.begin(), free_run.tokens.begin() + std::ptrdiff_t(k),
                   free_run.tokens[k]) != free_run.tokens.begin() + std::ptrdiff_t(k)) {
    ++k;
  }
  ASSERT_LT(k, free_run.tokens.size());
  const int32_t target = free_run.tokens[k];
  // A list with the target second (after an id that never comes), as Llama 3.1 Instruct
  // lists <|end_of_text|>, <|eom_id|>, <|eot_id|>.
  const Generated stopped =
      generate_in(dir, R"({"eos_token_id": [511, )" + std::to_string(target) + "]}", prompt, 12);
  EXPECT_EQ(stopped.finish, FinishReason::kEos);
  ASSERT_EQ(stopped.tokens.size(), k + 1);
  EXPECT_EQ(stopped.tokens.back(), target);
  EXPECT_TRUE(std::equal(stopped.tokens.begin(), stopped.tokens.end(), free_run.tokens.begin()));
}

}  // namespace
}  // namespace treeserve
