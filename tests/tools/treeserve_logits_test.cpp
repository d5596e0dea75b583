// treeserve_logits (the HF-comparison tool) run as a process on the tiny model: its first-token
// logits and greedy continuation equal the Hugging Face golden data (tests/golden/), its vocab
// limit holds, random weights are reproducible, FP8 checkpoints, --quantization fp8 and
// --kv-cache-dtype fp8 run (and agree bit for bit where they should), and bad input (broken FP8
// checkpoints included) exits non-zero with a message.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/common/temp_dir.h"

namespace treeserve::testing {
namespace {

using nlohmann::json;

constexpr float kGoldenTolerance = 1e-3f;  // as tests/engine/golden_test.cpp

struct ToolRun {
  int exit_code = -1;
  std::string output;  // stdout + stderr
  json result;         // the --out file, when it was written
};

std::string join(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

// Runs the tool with `args` (plus --out FILE and --threads 2), capturing its output.
ToolRun run_tool(const std::vector<std::string>& args) {
  // ctest runs each test in its own process, concurrently: the pid keeps the files apart.
  static int counter = 0;
  const std::string out = treeserve::testing_support::test_temp_dir() + "/treeserve_logits_" +
                          std::to_string(getpid()) + "_" + std::to_string(++counter) + ".json";
  std::filesystem::remove(out);
  std::string cmd =
      std::string("'") + TREESERVE_LOGITS_BINARY + "' --threads 2 --out '" + out + "'";
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " 2>&1";
  ToolRun r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (std::ifstream in(out); in) r.result = json::parse(in, nullptr, false);
  return r;
}

float max_abs_diff(const json& got, const json& want) {
  EXPECT_EQ(got.size(), want.size());
  float m = 0.0f;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const float d = std::fabs(got[i].get<float>() - want[i].get<float>());
    if (!(d <= m)) m = d;  // NaN fails
  }
  return m;
}

class TreeserveLogits : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ifstream in(TREESERVE_GOLDEN_JSON);
    ASSERT_TRUE(in) << TREESERVE_GOLDEN_JSON << " is missing (see tests/golden/README.md)";
    golden_ = json::parse(in, nullptr, false);
    ASSERT_FALSE(golden_.is_discarded());
  }
  json golden_;
};

TEST_F(TreeserveLogits, GreedyContinuationMatchesTransformers) {
  const json& g = golden_["greedy"];
  const auto prompt = g["prompt_ids"].get<std::vector<int32_t>>();
  const auto want = g["tokens"].get<std::vector<int32_t>>();
  ToolRun r = run_tool({"--model", TREESERVE_TINY_MODEL_DIR, "--backend", "cpu", "--ids",
                        join(prompt), "--greedy", std::to_string(want.size())});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_TRUE(r.result.is_object()) << r.output;
  EXPECT_EQ(r.result["prompt_ids"].get<std::vector<int32_t>>(), prompt);
  const float err = max_abs_diff(r.result["first_logits"], g["step_logits"][0]);
  EXPECT_LE(err, kGoldenTolerance) << "first-token logits vs transformers";
  EXPECT_EQ(r.result["greedy"]["tokens"].get<std::vector<int32_t>>(), want);
  const json& margins = r.result["greedy"]["top2_margin"];
  ASSERT_EQ(margins.size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_NEAR(margins[k].get<float>(), g["top2_margin"][k].get<float>(), 2 * kGoldenTolerance)
        << "step " << k;
  }
  std::printf("[ first-token max |logit - transformers| = %.3g ]\n", double(err));
}

TEST_F(TreeserveLogits, PromptLogitsMatchTransformers) {
  for (const json& p : golden_["prompts"]) {
    SCOPED_TRACE(p["name"].get<std::string>());
    const auto ids = p["ids"].get<std::vector<int32_t>>();
    // The prompt from a file, as hf_compare.py passes it.
    const std::string file = treeserve::testing_support::test_temp_dir() + "/ids.json";
    std::ofstream(file) << json(ids).dump();
    ToolRun r =
        run_tool({"--model", TREESERVE_TINY_MODEL_DIR, "--ids-file", file, "--greedy", "1"});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_LE(max_abs_diff(r.result["first_logits"], p["last_logits"]), kGoldenTolerance);
  }
}

TEST_F(TreeserveLogits, VocabLimitKeepsTokensBelowIt) {
  const auto prompt = golden_["greedy"]["prompt_ids"].get<std::vector<int32_t>>();
  ToolRun r = run_tool({"--model", TREESERVE_TINY_MODEL_DIR, "--ids", join(prompt), "--greedy",
                        "24", "--vocab-limit", "100"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto tokens = r.result["greedy"]["tokens"].get<std::vector<int32_t>>();
  ASSERT_EQ(tokens.size(), 24u);
  for (int32_t t : tokens) EXPECT_LT(t, 100);
  // The unlimited continuation leaves [0, 100) (the golden tokens do), so the limit mattered.
  const auto golden = golden_["greedy"]["tokens"].get<std::vector<int32_t>>();
  EXPECT_TRUE(std::any_of(golden.begin(), golden.end(), [](int32_t t) { return t >= 100; }));
  EXPECT_EQ(r.result["first_logits"].size(), golden_["reference"]["vocab_size"].get<size_t>());
}

TEST_F(TreeserveLogits, RandomWeightsAreReproducibleAndNotTheCheckpoint) {
  const std::vector<std::string> args = {
      "--model", TREESERVE_TINY_MODEL_DIR, "--ids", "1,300,301,302", "--greedy",
      "4",       "--random-weights",       "5"};
  ToolRun a = run_tool(args), b = run_tool(args);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(a.result["first_logits"], b.result["first_logits"]);
  EXPECT_EQ(a.result["random_weights_seed"].get<int64_t>(), 5);
  ToolRun real =
      run_tool({"--model", TREESERVE_TINY_MODEL_DIR, "--ids", "1,300,301,302", "--greedy", "4"});
  ASSERT_EQ(real.exit_code, 0) << real.output;
  EXPECT_GT(max_abs_diff(a.result["first_logits"], real.result["first_logits"]), 0.1f);
}

// A prompt of `n` ids drawn from the tiny model's vocabulary (BOS first), fixed.
std::vector<int32_t> long_prompt(int32_t n) {
  std::vector<int32_t> ids{1};
  uint32_t x = 12345;
  while (int32_t(ids.size()) < n) {
    x = x * 1664525u + 1013904223u;
    ids.push_back(int32_t(3 + (x >> 8) % 500));
  }
  return ids;
}

TEST_F(TreeserveLogits, ChunkedPrefillMatchesOneStep) {
  const std::string ids = join(long_prompt(70));
  ToolRun whole = run_tool({"--model", TREESERVE_TINY_MODEL_DIR, "--ids", ids, "--greedy", "6"});
  ToolRun chunked = run_tool(
      {"--model", TREESERVE_TINY_MODEL_DIR, "--ids", ids, "--greedy", "6", "--chunk", "16"});
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  ASSERT_EQ(chunked.exit_code, 0) << chunked.output;
  EXPECT_EQ(chunked.result["chunk"].get<int32_t>(), 16);
  EXPECT_LE(max_abs_diff(chunked.result["first_logits"], whole.result["first_logits"]), 1e-4f);
  EXPECT_EQ(chunked.result["greedy"]["tokens"], whole.result["greedy"]["tokens"]);
}

// Each forked branch's logits equal its whole sequence run alone (the tree's shared prompt is
// read through the fork, the partial page copied, the branches' rows in one step).
TEST_F(TreeserveLogits, ForkedBranchesMatchEachSequenceAlone) {
  const std::vector<int32_t> prompt = long_prompt(37);
  const std::vector<std::vector<int32_t>> suffixes = {{40, 41, 42}, {7}, {300, 301, 302, 303, 9}};
  const std::string file = treeserve::testing_support::test_temp_dir() + "/branches_" +
                           std::to_string(getpid()) + ".json";
  std::ofstream(file) << json(suffixes).dump();
  ToolRun tree = run_tool({"--model", TREESERVE_TINY_MODEL_DIR, "--ids", join(prompt), "--greedy",
                           "2", "--branches", file});
  ASSERT_EQ(tree.exit_code, 0) << tree.output;
  ASSERT_EQ(tree.result["branch_logits"].size(), suffixes.size());
  for (size_t b = 0; b < suffixes.size(); ++b) {
    SCOPED_TRACE("branch " + std::to_string(b));
    std::vector<int32_t> whole = prompt;
    whole.insert(whole.end(), suffixes[b].begin(), suffixes[b].end());
    ToolRun alone =
        run_tool({"--model", TREESERVE_TINY_MODEL_DIR, "--ids", join(whole), "--greedy", "1"});
    ASSERT_EQ(alone.exit_code, 0) << alone.output;
    EXPECT_LE(max_abs_diff(tree.result["branch_logits"][b], alone.result["first_logits"]), 1e-4f);
  }
  // The prompt's own continuation is unchanged by the forks.
  ToolRun plain =
      run_tool({"--model", TREESERVE_TINY_MODEL_DIR, "--ids", join(prompt), "--greedy", "2"});
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_EQ(tree.result["greedy"]["tokens"], plain.result["greedy"]["tokens"]);
}

TEST_F(TreeserveLogits, BadInputExitsNonZeroWithMessage) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::string m = TREESERVE_TINY_MODEL_DIR;
  const std::vector<Case> cases = {
      {{"--model", m, "--ids", "1,512"}, "outside the vocabulary"},
      {{"--model", m, "--ids", "1,x"}, "not a token id"},
      {{"--model", m}, "exactly one of --ids or --ids-file"},
      {{"--model", m, "--ids-file", "/nonexistent/ids.json"}, "cannot be opened"},
      {{"--model", "/nonexistent/model", "--ids", "1"}, "/nonexistent/model"},
      {{"--model", m, "--ids", "1", "--backend", "tpu"}, "--backend must be cpu or cuda"},
      {{"--model", m, "--ids", "1", "--vocab-limit", "513"}, "--vocab-limit"},
      {{"--model", m, "--ids", "1", "--greedy", "4000"}, "max_position_embeddings"},
      {{"--model", m, "--ids", "1", "--chunk", "-1"}, "--chunk must be >= 0"},
      {{"--model", m, "--ids", "1", "--branches", "/nonexistent/b.json"}, "cannot be opened"},
      {{"--model", m, "--ids", "1", "--tensor-parallel", "9"}, "--tensor-parallel"},
  };
  for (const Case& c : cases) {
    ToolRun r = run_tool(c.args);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << r.output;
  }
}

// FP8: every layout of the generated checkpoints (tests/models/make_fp8_checkpoint.py) runs on
// the CPU backend; the fp8-layout checkpoint per channel with dynamic activations and
// --quantization fp8 on the float32 model give the same logits and tokens, bit for bit.
TEST_F(TreeserveLogits, Fp8CheckpointsAndTheQuantizationFlag) {
  const std::string ids = "1,300,301,302,17,45";
  const std::string models = TREESERVE_FP8_MODELS_DIR;
  ToolRun flag = run_tool({"--model", TREESERVE_TINY_MODEL_DIR, "--ids", ids, "--greedy", "6",
                           "--quantization", "fp8"});
  ASSERT_EQ(flag.exit_code, 0) << flag.output;
  EXPECT_EQ(flag.result["quantization"], "fp8");
  ToolRun plain = run_tool({"--model", TREESERVE_TINY_MODEL_DIR, "--ids", ids, "--greedy", "1"});
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_EQ(plain.result["quantization"], "none");
  EXPECT_NE(flag.result["first_logits"], plain.result["first_logits"]);
  for (const char* layout :
       {"fp8-channel-dynamic", "fp8-tensor-static", "ct-channel-token", "ct-tensor-tensor"}) {
    ToolRun r = run_tool({"--model", models + "/" + layout, "--ids", ids, "--greedy", "6"});
    ASSERT_EQ(r.exit_code, 0) << layout << ": " << r.output;
    EXPECT_EQ(r.result["quantization"], "fp8") << layout;
    EXPECT_LT(max_abs_diff(r.result["first_logits"], plain.result["first_logits"]), 1.5f) << layout;
    if (std::string(layout) == "fp8-channel-dynamic") {
      EXPECT_EQ(r.result["first_logits"], flag.result["first_logits"]);  // bit for bit
      EXPECT_EQ(r.result["greedy"], flag.result["greedy"]);
    }
  }
  // fp8 on an FP8 checkpoint is the checkpoint; none is refused.
  ToolRun again = run_tool({"--model", models + "/fp8-channel-dynamic", "--ids", ids, "--greedy",
                            "6", "--quantization", "fp8"});
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(again.result["first_logits"], flag.result["first_logits"]);
  ToolRun none =
      run_tool({"--model", models + "/ct-tensor-tensor", "--ids", ids, "--quantization", "none"});
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.output.find("--quantization none"), std::string::npos) << none.output;
  EXPECT_NE(none.output.find("is FP8"), std::string::npos) << none.output;
  ToolRun bad =
      run_tool({"--model", TREESERVE_TINY_MODEL_DIR, "--ids", ids, "--quantization", "int8"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--quantization must be auto, none or fp8, got 'int8'"),
            std::string::npos)
      << bad.output;
}

// --kv-cache-dtype fp8 (the server's kv_cache.dtype) on the CPU backend: K/V through e4m3,
// logits near the float32 KV ones but not equal; the alias gives the same bits; fp8_e5m2 and
// other values are refused by name.
TEST_F(TreeserveLogits, KvCacheDtypeFlag) {
  const std::string m = TREESERVE_TINY_MODEL_DIR;
  const std::string ids = "1,300,301,302,17,45,99,120";
  ToolRun plain = run_tool({"--model", m, "--ids", ids, "--greedy", "4"});
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_EQ(plain.result["kv_cache_dtype"], "float32");
  ToolRun fp8 = run_tool({"--model", m, "--ids", ids, "--greedy", "4", "--kv-cache-dtype", "fp8"});
  ASSERT_EQ(fp8.exit_code, 0) << fp8.output;
  EXPECT_EQ(fp8.result["kv_cache_dtype"], "fp8_e4m3");
  const float diff = max_abs_diff(fp8.result["first_logits"], plain.result["first_logits"]);
  EXPECT_GT(diff, 0.0f);
  EXPECT_LT(diff, 1.0f);  // as tests/engine/kv_cache_fp8_test.cpp
  ToolRun alias =
      run_tool({"--model", m, "--ids", ids, "--greedy", "4", "--kv-cache-dtype", "fp8_e4m3"});
  ASSERT_EQ(alias.exit_code, 0) << alias.output;
  EXPECT_EQ(alias.result["first_logits"], fp8.result["first_logits"]);
  EXPECT_EQ(alias.result["greedy"], fp8.result["greedy"]);
  ToolRun e5m2 = run_tool({"--model", m, "--ids", ids, "--kv-cache-dtype", "fp8_e5m2"});
  EXPECT_NE(e5m2.exit_code, 0);
  EXPECT_NE(e5m2.output.find("--kv-cache-dtype 'fp8_e5m2' is not supported: only e4m3 is"),
            std::string::npos)
      << e5m2.output;
  ToolRun junk = run_tool({"--model", m, "--ids", ids, "--kv-cache-dtype", "half"});
  EXPECT_NE(junk.exit_code, 0);
  EXPECT_NE(junk.output.find("--kv-cache-dtype must be auto, fp8 or fp8_e4m3, got 'half'"),
            std::string::npos)
      << junk.output;
}

// Broken FP8 checkpoints (the generator's test options) are refused with a message naming the
// tensor or field.
TEST_F(TreeserveLogits, BrokenFp8CheckpointsAreRefusedByName) {
  struct Case {
    std::vector<std::string> generator_args;
    std::vector<std::string> messages;
  };
  const std::vector<Case> cases = {
      {{"--layout", "fp8", "--omit", "layers.1.mlp.down_proj.weight_scale"},
       {"'model.layers.1.mlp.down_proj.weight_scale' not found",
        "weight_scale beside each e4m3 weight"}},
      {{"--layout", "compressed-tensors", "--keep-16bit", "layers.0.self_attn.k_proj.weight"},
       {"'model.layers.0.self_attn.k_proj.weight' is F32, expected F8_E4M3"}},
      {{"--layout", "fp8", "--weights", "tensor", "--activations", "static", "--omit",
        "layers.2.self_attn.q_proj.input_scale"},
       {"'model.layers.2.self_attn.q_proj.input_scale' not found", "static activation scales"}},
      {{"--layout", "fp8", "--quantization-config",
        R"({"quant_method": "awq", "bits": 4, "group_size": 128})"},
       {"quantization_config.quant_method 'awq' is not supported", "treeserve serves FP8"}},
      {{"--layout", "fp8", "--quantization-config",
        R"({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})"},
       {"quantization_config.weight_block_size [128,128] (block-wise FP8) is not supported"}},
  };
  int n = 0;
  for (const Case& c : cases) {
    const std::string dir = treeserve::testing_support::test_temp_dir() + "broken_fp8_" +
                            std::to_string(getpid()) + "_" + std::to_string(n++);
    std::string cmd = std::string("'") + TREESERVE_PYTHON3 + "' '" + TREESERVE_FP8_GENERATOR +
                      "' '" + TREESERVE_TINY_MODEL_DIR + "' '" + dir + "'";
    for (const std::string& a : c.generator_args) cmd += " '" + a + "'";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    ToolRun r = run_tool({"--model", dir, "--ids", "1,2,3", "--greedy", "1"});
    EXPECT_NE(r.exit_code, 0) << r.output;
    for (const std::string& m : c.messages) {
      EXPECT_NE(r.output.find(m), std::string::npos) << "want '" << m << "' in: " << r.output;
    }
    EXPECT_NE(r.output.find(dir), std::string::npos) << r.output;  // the file is named
    std::filesystem::remove_all(dir);
  }
}

}  // namespace
}  // namespace treeserve::testing
