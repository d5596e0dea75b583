// config.json parsing: real Llama-2, Llama-3.x and Mistral configs (as published on the
// Hugging Face hub), defaults, token id forms, generation_config.json's EOS ids, and errors
// that name the file and field.
#include "models/model_config.h"

#include <gtest/gtest.h>

#include <string>

#include "tests/models/test_util.h"

namespace treeserve {
namespace {

using testing::status_is;
using testing::TempDir;
using testing::write_file;

constexpr const char* kLlama2_7b = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
  "tie_word_embeddings": false, "torch_dtype": "float16",
  "transformers_version": "4.31.0.dev0", "use_cache": true, "vocab_size": 32000})";

constexpr const char* kLlama31_8b = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
  "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0", "use_cache": true, "vocab_size": 128256})";

constexpr const char* kLlama32_1b = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": 128001,
  "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
  "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 32,
  "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "vocab_size": 128256})";

constexpr const char* kMistral_7b = R"({
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
  "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
  "vocab_size": 32000})";

// Mistral-Nemo style: head_dim given and different from hidden_size / heads.
constexpr const char* kMistralNemo = R"({
  "architectures": ["MistralForCausalLM"], "head_dim": 128, "hidden_size": 5120,
  "intermediate_size": 14336, "model_type": "mistral", "num_attention_heads": 32,
  "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0, "sliding_window": null, "vocab_size": 131072,
  "bos_token_id": 1, "eos_token_id": 2})";

// A minimal valid config the error tests edit one field of.
std::string minimal(const std::string& extra = "") {
  return R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
             "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4)" +
         extra + "}";
}

TEST(ModelConfigTest, Llama2) {
  auto c = parse_model_config(kLlama2_7b, "llama2/config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");
  EXPECT_EQ(c->model_type, "llama");
  EXPECT_EQ(c->vocab_size, 32000);
  EXPECT_EQ(c->hidden_size, 4096);
  EXPECT_EQ(c->intermediate_size, 11008);
  EXPECT_EQ(c->num_hidden_layers, 32);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 32);
  EXPECT_EQ(c->head_dim, 128);  // default: hidden_size / num_attention_heads
  EXPECT_EQ(c->max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);             // default when absent
  EXPECT_EQ(c->rope_scaling.type, RopeType::kDefault);  // "rope_scaling": null
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(c->torch_dtype, "float16");
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_EQ(c->q_size(), 4096);
  EXPECT_EQ(c->kv_size(), 4096);
}

TEST(ModelConfigTest, Llama31WithRopeScalingAndEosList) {
  auto c = parse_model_config(kLlama31_8b, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->kv_size(), 1024);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeType::kLlama3);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 8.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c->bos_token_id, 128000);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{128001, 128008, 128009}));
  EXPECT_EQ(c->torch_dtype, "bfloat16");
}

TEST(ModelConfigTest, Llama32TiedEmbeddingsAndExplicitHeadDim) {
  auto c = parse_model_config(kLlama32_1b, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_DOUBLE_EQ(c->rope_scaling.factor, 32.0);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{128001});
}

TEST(ModelConfigTest, Mistral) {
  auto c = parse_model_config(kMistral_7b, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "MistralForCausalLM");
  EXPECT_EQ(c->model_type, "mistral");
  EXPECT_EQ(c->num_key_value_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->sliding_window, 4096);
  EXPECT_EQ(c->max_position_embeddings, 32768);
  // Full attention equals the window's only within it: sequences stop at the window.
  EXPECT_EQ(c->max_sequence_tokens(), 4096);
}

TEST(ModelConfigTest, SlidingWindowCapsSequencesOnlyWhenSmaller) {
  auto c = parse_model_config(
      minimal(R"(, "max_position_embeddings": 512, "sliding_window": 4096)"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->max_sequence_tokens(), 512);
  c = parse_model_config(minimal(R"(, "max_position_embeddings": 512, "sliding_window": 100)"),
                         "config.json");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->max_sequence_tokens(), 100);
  c = parse_model_config(kMistralNemo, "config.json");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->max_sequence_tokens(), c->max_position_embeddings);
}

// Qwen2 adds biases to q/k/v, which the engines do not: refused by name, whether the file
// names the architecture or only the model type.
TEST(ModelConfigErrorTest, Qwen2IsRefusedByName) {
  const char* kQwen25_05b = R"({
    "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "use_sliding_window": false,
    "vocab_size": 151936})";
  EXPECT_TRUE(status_is(parse_model_config(kQwen25_05b, "qwen/config.json").status(),
                        StatusCode::kInvalidArgument,
                        {"qwen/config.json", "Qwen2ForCausalLM is not supported",
                         "biases to the q, k and v projections"}));
  EXPECT_TRUE(status_is(
      parse_model_config(R"({"model_type": "qwen2", "vocab_size": 8})", "c.json").status(),
      StatusCode::kInvalidArgument, {"c.json", "Qwen2ForCausalLM is not supported"}));
  // Llama-architecture files with biases, likewise (false, as Llama's own say, loads).
  EXPECT_TRUE(
      status_is(parse_model_config(minimal(R"(, "attention_bias": true)"), "c.json").status(),
                StatusCode::kInvalidArgument, {"c.json", "attention_bias is true"}));
  EXPECT_TRUE(status_is(parse_model_config(minimal(R"(, "mlp_bias": true)"), "c.json").status(),
                        StatusCode::kInvalidArgument, {"c.json", "mlp_bias is true"}));
  EXPECT_TRUE(
      parse_model_config(minimal(R"(, "attention_bias": false, "mlp_bias": false)"), "c.json")
          .ok());
}

TEST(ModelConfigTest, HeadDimNotHiddenOverHeads) {
  auto c = parse_model_config(kMistralNemo, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->q_size(), 4096);  // != hidden_size 5120
  EXPECT_EQ(c->kv_size(), 1024);
  EXPECT_EQ(c->sliding_window, 0);  // null: full attention
}

TEST(ModelConfigTest, DefaultsForOptionalFields) {
  auto c = parse_model_config(minimal(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");  // from model_type
  EXPECT_EQ(c->num_key_value_heads, 4);            // no GQA
  EXPECT_EQ(c->head_dim, 8);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_TRUE(c->eos_token_ids.empty());
}

TEST(ModelConfigTest, HeadDimNullMeansDefault) {
  auto c = parse_model_config(minimal(R"(, "head_dim": null)"), "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->head_dim, 8);
}

TEST(ModelConfigTest, RopeParametersAndLegacyTypeKey) {
  // transformers v5 writes rope_parameters (carrying rope_theta); older llama3 configs
  // were sometimes written with "type" instead of "rope_type".
  auto v5 = parse_model_config(
      minimal(R"(, "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0})"),
      "config.json");
  ASSERT_TRUE(v5.ok()) << v5.status().ToString();
  EXPECT_DOUBLE_EQ(v5->rope_theta, 250000.0);
  EXPECT_EQ(v5->rope_scaling.type, RopeType::kDefault);

  auto v5_llama3 =
      parse_model_config(minimal(R"(, "rope_theta": 7.0, "rope_parameters": {"rope_type": "llama3",
              "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})"),
                         "config.json");
  ASSERT_TRUE(v5_llama3.ok()) << v5_llama3.status().ToString();
  EXPECT_DOUBLE_EQ(v5_llama3->rope_theta, 500000.0);  // rope_parameters wins
  EXPECT_EQ(v5_llama3->rope_scaling.type, RopeType::kLlama3);
  EXPECT_DOUBLE_EQ(v5_llama3->rope_scaling.factor, 32.0);

  auto legacy = parse_model_config(
      minimal(R"(, "rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": 1,
              "high_freq_factor": 4, "original_max_position_embeddings": 8192})"),
      "config.json");
  ASSERT_TRUE(legacy.ok()) << legacy.status().ToString();
  EXPECT_EQ(legacy->rope_scaling.type, RopeType::kLlama3);
}

TEST(ModelConfigTest, TinyModelConfig) {
  auto c = load_model_config(TREESERVE_TINY_MODEL_DIR);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->model_dir, TREESERVE_TINY_MODEL_DIR);
  EXPECT_EQ(c->vocab_size, 512);
  EXPECT_EQ(c->hidden_size, 256);
  EXPECT_EQ(c->num_hidden_layers, 4);
  EXPECT_EQ(c->num_attention_heads, 4);
  EXPECT_EQ(c->num_key_value_heads, 2);
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_EQ(c->rope_scaling.type, RopeType::kLlama3);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(c->torch_dtype, "float32");
}

// --- errors --------------------------------------------------------------------------

TEST(ModelConfigErrorTest, MissingDirAndFileAreNotFound) {
  TempDir dir;
  EXPECT_TRUE(status_is(load_model_config(dir.file("nope")).status(), StatusCode::kNotFound,
                        {dir.file("nope")}));
  EXPECT_TRUE(status_is(load_model_config(dir.path()).status(), StatusCode::kNotFound,
                        {dir.file("config.json")}));
}

TEST(ModelConfigErrorTest, BadJsonNamesTheFile) {
  TempDir dir;
  write_file(dir.file("config.json"), R"({"model_type": "llama", "vocab_size": )");
  EXPECT_TRUE(status_is(load_model_config(dir.path()).status(), StatusCode::kInvalidArgument,
                        {dir.file("config.json"), "invalid JSON"}));
  write_file(dir.file("config.json"), "[1, 2]");
  EXPECT_TRUE(status_is(load_model_config(dir.path()).status(), StatusCode::kInvalidArgument,
                        {dir.file("config.json"), "object"}));
}

TEST(ModelConfigErrorTest, MissingRequiredFieldNamesFileAndField) {
  TempDir dir;
  for (const char* field : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads"}) {
    std::string text = minimal();
    const size_t at = text.find(std::string("\"") + field + "\"");
    ASSERT_NE(at, std::string::npos);
    text.replace(at, 1, "\"x_");  // rename the key: the field is now missing
    write_file(dir.file("config.json"), text);
    EXPECT_TRUE(status_is(load_model_config(dir.path()).status(), StatusCode::kInvalidArgument,
                          {dir.file("config.json"), std::string("'") + field + "'", "missing"}))
        << field;
  }
}

TEST(ModelConfigErrorTest, WrongTypesNameTheField) {
  struct Case {
    std::string extra;
    std::string field;
  };
  const Case cases[] = {
      {R"(, "num_key_value_heads": "2")", "'num_key_value_heads' must be an integer"},
      {R"(, "head_dim": 8.5)", "'head_dim' must be an integer"},
      {R"(, "rms_norm_eps": "1e-5")", "'rms_norm_eps' must be a number"},
      {R"(, "rope_theta": [1])", "'rope_theta' must be a number"},
      {R"(, "tie_word_embeddings": 1)", "'tie_word_embeddings' must be a boolean"},
      {R"(, "eos_token_id": "2")", "'eos_token_id'"},
      {R"(, "eos_token_id": [2, "3"])", "'eos_token_id'"},
      {R"(, "eos_token_id": -1)", "'eos_token_id'"},
      {R"(, "bos_token_id": [1, 2])", "'bos_token_id'"},
      {R"(, "torch_dtype": 16)", "'torch_dtype' must be a string"},
      {R"(, "sliding_window": "4096")", "'sliding_window' must be an integer"},
      {R"(, "rope_scaling": "llama3")", "'rope_scaling' must be an object"},
      {R"(, "architectures": "LlamaForCausalLM")", "'architectures'"},
  };
  for (const Case& c : cases) {
    EXPECT_TRUE(status_is(parse_model_config(minimal(c.extra), "m/config.json").status(),
                          StatusCode::kInvalidArgument, {"m/config.json", c.field}))
        << c.extra;
  }
  // A required field with the wrong type.
  EXPECT_TRUE(status_is(
      parse_model_config(R"({"model_type": "llama", "vocab_size": "64"})", "m/config.json")
          .status(),
      StatusCode::kInvalidArgument, {"m/config.json", "'vocab_size' must be an integer"}));
}

TEST(ModelConfigErrorTest, RopeScalingErrors) {
  EXPECT_TRUE(
      status_is(parse_model_config(minimal(R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8,
                                    "low_freq_factor": 1, "high_freq_factor": 4})"),
                                   "c.json")
                    .status(),
                StatusCode::kInvalidArgument,
                {"c.json", "rope_scaling", "original_max_position_embeddings"}));
  EXPECT_TRUE(
      status_is(parse_model_config(
                    minimal(R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4})"), "c.json")
                    .status(),
                StatusCode::kInvalidArgument, {"c.json", "yarn", "not supported"}));
  EXPECT_TRUE(status_is(
      parse_model_config(minimal(R"(, "rope_scaling": {"factor": 4})"), "c.json").status(),
      StatusCode::kInvalidArgument, {"c.json", "rope_type"}));
  EXPECT_TRUE(
      status_is(parse_model_config(minimal(R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8,
              "low_freq_factor": 4, "high_freq_factor": 1,
              "original_max_position_embeddings": 8192})"),
                                   "c.json")
                    .status(),
                StatusCode::kInvalidArgument, {"c.json", "low_freq_factor < high_freq_factor"}));
}

TEST(ModelConfigErrorTest, InconsistentShapesAndArchitectures) {
  const std::pair<std::string, std::string> cases[] = {
      {R"(, "num_key_value_heads": 3)", "not divisible by num_key_value_heads"},
      {R"(, "head_dim": 7)", "must be even"},
      {R"(, "bos_token_id": 64)", "bos_token_id 64 is outside vocab_size 64"},
      {R"(, "eos_token_id": [2, 99])", "eos_token_id 99"},
      {R"(, "num_hidden_layers": 0)", "'num_hidden_layers' must be positive"},
      {R"(, "rms_norm_eps": 0)", "'rms_norm_eps' must be positive"},
      {R"(, "architectures": ["GPT2LMHeadModel"])", "GPT2LMHeadModel"},
  };
  for (const auto& [extra, fragment] : cases) {
    // minimal() already sets num_hidden_layers; a later duplicate key wins in nlohmann.
    EXPECT_TRUE(status_is(parse_model_config(minimal(extra), "c.json").status(),
                          StatusCode::kInvalidArgument, {"c.json", fragment}))
        << extra;
  }
  EXPECT_TRUE(
      status_is(parse_model_config(R"({"model_type": "gpt2", "vocab_size": 8})", "c.json").status(),
                StatusCode::kInvalidArgument, {"c.json", "architectures", "gpt2"}));
  EXPECT_TRUE(status_is(parse_model_config(R"({"hidden_size": 64, "num_attention_heads": 3,
      "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
      "model_type": "llama"})",
                                           "c.json")
                            .status(),
                        StatusCode::kInvalidArgument, {"c.json", "not divisible"}));
}

// Found by tests/fuzz (fuzz_model_config): sizes past int32 were accepted, and the KV layout and
// the engines, which keep them in int32, would have truncated them.
TEST(ModelConfigErrorTest, SizesPastInt32AreRefused) {
  const std::pair<std::string, std::string> cases[] = {
      {R"(, "intermediate_size": 58888888888812)", "'intermediate_size' is 58888888888812"},
      {R"(, "num_hidden_layers": 4294967300)", "'num_hidden_layers' is 4294967300"},
      {R"(, "vocab_size": 2147483648)", "'vocab_size' is 2147483648"},
      {R"(, "head_dim": 1073741824)", "num_attention_heads x head_dim (4 x 1073741824)"},
      {R"(, "num_attention_heads": 65536, "num_key_value_heads": 65536, "head_dim": 65536)",
       "num_attention_heads x head_dim (65536 x 65536)"},
  };
  for (const auto& [extra, fragment] : cases) {
    EXPECT_TRUE(status_is(parse_model_config(minimal(extra), "c.json").status(),
                          StatusCode::kInvalidArgument, {"c.json", fragment, "2147483647"}))
        << extra;
  }
  auto largest = parse_model_config(minimal(R"(, "intermediate_size": 2147483647)"), "c.json");
  ASSERT_TRUE(largest.ok()) << largest.status().ToString();
  EXPECT_EQ(largest->intermediate_size, 2147483647);
}

// generation_config.json: its eos_token_id (an int or a list) replaces config.json's, as
// transformers' generate() uses it; a file without one changes nothing.
TEST(GenerationConfigTest, EosIdsComeFromGenerationConfig) {
  TempDir dir;
  write_file(dir.file("config.json"), kLlama32_1b);  // eos_token_id 128001
  auto c = load_model_config(dir.path());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{128001});
  EXPECT_EQ(c->eos_token_ids_source, "config.json");

  write_file(dir.file("generation_config.json"),
             R"({"bos_token_id": 128000, "do_sample": true,
                 "eos_token_id": [128001, 128008, 128009], "temperature": 0.6, "top_p": 0.9})");
  c = load_model_config(dir.path());
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{128001, 128008, 128009}));
  EXPECT_EQ(c->eos_token_ids_source, "generation_config.json");

  write_file(dir.file("generation_config.json"), R"({"eos_token_id": 128009})");
  c = load_model_config(dir.path());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{128009});

  write_file(dir.file("generation_config.json"), R"({"temperature": 0.7})");
  c = load_model_config(dir.path());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{128001});
  EXPECT_EQ(c->eos_token_ids_source, "config.json");
}

TEST(GenerationConfigTest, ErrorsNameTheFileAndField) {
  TempDir dir;
  write_file(dir.file("config.json"), kLlama32_1b);
  const std::string file = dir.file("generation_config.json");
  write_file(file, "{ nope");
  EXPECT_TRUE(status_is(load_model_config(dir.path()).status(), StatusCode::kInvalidArgument,
                        {file, "invalid JSON"}));
  write_file(file, R"({"eos_token_id": [128001, 200000]})");
  EXPECT_TRUE(status_is(load_model_config(dir.path()).status(), StatusCode::kInvalidArgument,
                        {file, "eos_token_id 200000", "vocab_size 128256"}));
  write_file(file, R"({"eos_token_id": "</s>"})");
  EXPECT_TRUE(status_is(load_model_config(dir.path()).status(), StatusCode::kInvalidArgument,
                        {file, "'eos_token_id'"}));
  write_file(file, R"([1, 2])");
  EXPECT_TRUE(status_is(load_model_config(dir.path()).status(), StatusCode::kInvalidArgument,
                        {file, "JSON object"}));
}

}  // namespace
}  // namespace treeserve
