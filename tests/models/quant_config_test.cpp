// config.json's quantization_config (models/model_config.h): the FP8 layouts treeserve serves,
// as published checkpoints write them (AutoFP8's "fp8", llm-compressor's compressed-tensors
// FP8 static and dynamic), and the schemes it refuses (block-wise FP8, AWQ, GPTQ,
// bitsandbytes, INT8, 4-bit groups, weight-only FP8, ignore lists naming a projection), each
// with a message naming the file, the field and what is supported; --quantization's values.
#include <gtest/gtest.h>

#include <string>

#include "models/model_config.h"
#include "tests/models/test_util.h"

namespace treeserve {
namespace {

using testing::status_is;

constexpr char kFile[] = "/models/x/config.json";

// A small Llama config with the given quantization_config (a JSON value).
std::string with_quant(const std::string& quantization_config) {
  return R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 3, "vocab_size": 100, "torch_dtype": "bfloat16",
    "quantization_config": )" +
         quantization_config + "}";
}

StatusOr<ModelConfig> parse(const std::string& quantization_config) {
  return parse_model_config(with_quant(quantization_config), kFile);
}

// compressed-tensors' FP8 group, with the weights' and input activations' strategy/dynamic.
std::string ct(const std::string& weights, const std::string& inputs,
               const std::string& extra = R"("format": "float-quantized", "ignore": ["lm_head"])") {
  return R"({"quant_method": "compressed-tensors", "quantization_status": "compressed",
    "kv_cache_scheme": null, "global_compression_ratio": 1.24,
    "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": null,
      "weights": )" +
         weights + R"(, "input_activations": )" + inputs + "}}, " + extra + "}";
}

std::string args(const std::string& strategy, bool dynamic, const std::string& more = "") {
  return R"({"num_bits": 8, "type": "float", "symmetric": true, "group_size": null,
    "block_structure": null, "actorder": null, "observer": "minmax", "observer_kwargs": {},
    "strategy": ")" +
         strategy + R"(", "dynamic": )" + (dynamic ? "true" : "false") + more + "}";
}

TEST(QuantConfigTest, NoQuantizationConfigIsSixteenBit) {
  auto c = parse_model_config(with_quant("null"), kFile);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->quant.scheme, QuantScheme::kNone);
  EXPECT_FALSE(c->quant.prequantized);
}

// neuralmagic/Meta-Llama-3-8B-Instruct-FP8 (AutoFP8).
TEST(QuantConfigTest, Fp8LayoutStaticLeavesGranularityToTheTensors) {
  auto c = parse(R"({"activation_scheme": "static", "ignored_layers": ["lm_head"],
                     "quant_method": "fp8"})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->quant.scheme, QuantScheme::kFp8);
  EXPECT_TRUE(c->quant.prequantized);
  EXPECT_FALSE(c->quant.weight_scale_stated);
  EXPECT_EQ(c->quant.activation_scale, Fp8ActivationScale::kStaticPerTensor);
  EXPECT_EQ(c->quant.source, "config.json quantization_config (fp8)");

  c = parse(R"({"activation_scheme": "dynamic", "quant_method": "fp8",
                "modules_to_not_convert": ["lm_head"], "weight_block_size": null})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->quant.activation_scale, Fp8ActivationScale::kDynamicPerToken);
}

// neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8-dynamic and -FP8 (llm-compressor).
TEST(QuantConfigTest, CompressedTensorsChannelTokenAndTensorTensor) {
  auto c = parse(ct(args("channel", false), args("token", true)));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->quant.scheme, QuantScheme::kFp8);
  EXPECT_TRUE(c->quant.prequantized);
  EXPECT_TRUE(c->quant.weight_scale_stated);
  EXPECT_EQ(c->quant.weight_scale, Fp8WeightScale::kChannel);
  EXPECT_EQ(c->quant.activation_scale, Fp8ActivationScale::kDynamicPerToken);
  EXPECT_EQ(c->quant.source, "config.json quantization_config (compressed-tensors)");

  c = parse(ct(args("tensor", false), args("tensor", false),
               R"("format": "naive-quantized", "ignore": ["lm_head"])"));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->quant.weight_scale, Fp8WeightScale::kTensor);
  EXPECT_EQ(c->quant.activation_scale, Fp8ActivationScale::kStaticPerTensor);

  // Without a format (neither at the top nor in the group) the layout is unknown.
  c = parse(ct(args("channel", false), args("token", true), R"("ignore": ["lm_head"])"));
  EXPECT_TRUE(status_is(c.status(), StatusCode::kInvalidArgument, {kFile, "'format'"}));
}

TEST(QuantConfigTest, RefusedSchemesNameFileFieldAndWhatIsSupported) {
  struct Case {
    std::string config;
    std::vector<std::string> fragments;
  };
  const std::string supported = "treeserve serves FP8 (e4m3)";
  const std::vector<Case> cases = {
      // Block-wise FP8 (DeepSeek-V3, Qwen3-FP8).
      {R"({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
           "weight_block_size": [128, 128]})",
       {"quantization_config.weight_block_size", "[128,128]", "block-wise"}},
      {R"({"quant_method": "fp8"})", {"'activation_scheme'"}},
      {R"({"quant_method": "fp8", "activation_scheme": "weird"})", {"activation_scheme 'weird'"}},
      {R"({"bits": 4, "group_size": 128, "quant_method": "awq", "version": "gemm",
           "zero_point": true})",
       {"quantization_config.quant_method 'awq'"}},
      {R"({"bits": 4, "desc_act": false, "group_size": 128, "quant_method": "gptq"})",
       {"quant_method 'gptq'"}},
      {R"({"load_in_4bit": true, "quant_method": "bitsandbytes"})",
       {"quant_method 'bitsandbytes'"}},
      {R"({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0})",
       {"quant_method 'fbgemm_fp8'"}},
      {R"({"bits": 4})", {"'quant_method'"}},
      // compressed-tensors W8A8 INT8.
      {ct(R"({"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel",
              "dynamic": false})",
          args("token", true)),
       {"group_0.weights.type 'int'", "8-bit int"}},
      // W4A16 (4-bit integer groups, weight-only).
      {ct(R"({"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
              "group_size": 128, "dynamic": false})",
          "null", R"("format": "pack-quantized")"),
       {"format 'pack-quantized'"}},
      {ct(R"({"num_bits": 4, "type": "float", "strategy": "tensor"})", args("token", true)),
       {"group_0.weights.num_bits 4"}},
      {ct(args("channel", false), "null"), {"group_0.input_activations null", "weight-only"}},
      {ct(args("group", false), args("token", true)), {"weights.strategy 'group'"}},
      {ct(args("block", false), args("token", true)), {"weights.strategy 'block'"}},
      {ct(args("channel", false, R"(, "group_size": 128)"), args("token", true)),
       {"weights.group_size 128"}},
      {ct(args("channel", true), args("token", true)), {"weights.dynamic true"}},
      {ct(args("channel", false), args("tensor", true)),
       {"input_activations strategy 'tensor' with dynamic true"}},
      {ct(args("channel", false), args("token", false)),
       {"input_activations strategy 'token' with dynamic false"}},
      {ct(R"({"num_bits": 8, "type": "float", "symmetric": false, "strategy": "channel"})",
          args("token", true)),
       {"weights.symmetric false"}},
      {ct(args("channel", false), args("token", true), R"("format": "int-quantized")"),
       {"quantization_config.format 'int-quantized'"}},
  };
  for (const Case& k : cases) {
    auto c = parse(k.config);
    std::vector<std::string> fragments = k.fragments;
    fragments.push_back(kFile);
    EXPECT_TRUE(status_is(c.status(), StatusCode::kInvalidArgument, fragments)) << k.config;
    // Refusals of a scheme (not of a malformed field) say what treeserve serves.
    if (k.fragments[0].find("'activation_scheme'") == std::string::npos &&
        k.fragments[0].find("'quant_method'") == std::string::npos) {
      EXPECT_TRUE(status_is(c.status(), StatusCode::kInvalidArgument, {supported})) << k.config;
    }
  }
}

TEST(QuantConfigTest, IgnoreListsMayOnlySpareLmHead) {
  const std::string w = args("channel", false), in = args("token", true);
  auto c = parse(ct(w, in, R"("format": "float-quantized", "ignore": ["lm_head", "re:vision.*"])"));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  c = parse(
      ct(w, in, R"("format": "float-quantized", "ignore": ["model.layers.2.mlp.down_proj"])"));
  EXPECT_TRUE(status_is(
      c.status(), StatusCode::kInvalidArgument,
      {kFile, "quantization_config.ignore", "'model.layers.2.mlp.down_proj'", "only lm_head"}));
  c = parse(ct(w, in, R"("format": "float-quantized", "ignore": ["re:.*self_attn.*"])"));
  EXPECT_TRUE(status_is(c.status(), StatusCode::kInvalidArgument,
                        {"'re:.*self_attn.*'", "model.layers.0.self_attn.q_proj"}));
  c = parse(ct(w, in, R"("format": "float-quantized", "ignore": ["Linear"])"));
  EXPECT_TRUE(status_is(c.status(), StatusCode::kInvalidArgument, {"'Linear'"}));
  c = parse(ct(w, in, R"("format": "float-quantized", "ignore": ["re:(unclosed"])"));
  EXPECT_TRUE(status_is(c.status(), StatusCode::kInvalidArgument, {"'re:(unclosed'"}));
  c = parse(R"({"quant_method": "fp8", "activation_scheme": "static",
                "ignored_layers": ["lm_head", "model.layers.1.self_attn.o_proj"]})");
  EXPECT_TRUE(
      status_is(c.status(), StatusCode::kInvalidArgument,
                {"quantization_config.ignored_layers", "'model.layers.1.self_attn.o_proj'"}));
}

TEST(QuantConfigTest, MalformedFieldsAreNamed) {
  EXPECT_TRUE(status_is(parse("[1]").status(), StatusCode::kInvalidArgument,
                        {kFile, "'quantization_config' must be an object"}));
  EXPECT_TRUE(status_is(parse(R"({"quant_method": 8})").status(), StatusCode::kInvalidArgument,
                        {"'quant_method' must be a string"}));
  EXPECT_TRUE(status_is(parse(R"({"quant_method": "compressed-tensors",
                                   "format": "float-quantized"})")
                            .status(),
                        StatusCode::kInvalidArgument, {"'config_groups'"}));
  EXPECT_TRUE(status_is(parse(R"({"quant_method": "compressed-tensors", "format":
                                   "float-quantized", "config_groups": {"a": {}, "b": {}}})")
                            .status(),
                        StatusCode::kInvalidArgument, {"config_groups with 2 groups"}));
  EXPECT_TRUE(status_is(parse(ct(args("channel", false), args("token", true),
                                 R"("format": "float-quantized", "ignore": "lm_head")"))
                            .status(),
                        StatusCode::kInvalidArgument,
                        {"'quantization_config.ignore' must be a list"}));
}

TEST(QuantConfigTest, QuantizationOption) {
  auto sixteen = parse_model_config(with_quant("null"), kFile);
  ASSERT_TRUE(sixteen.ok());
  ModelConfig c = *sixteen;
  ASSERT_TRUE(apply_quantization_option("auto", "--quantization", &c).ok());
  EXPECT_EQ(c.quant.scheme, QuantScheme::kNone);
  ASSERT_TRUE(apply_quantization_option("none", "--quantization", &c).ok());
  EXPECT_EQ(c.quant.scheme, QuantScheme::kNone);
  ASSERT_TRUE(apply_quantization_option("fp8", "--quantization", &c).ok());
  EXPECT_EQ(c.quant.scheme, QuantScheme::kFp8);
  EXPECT_FALSE(c.quant.prequantized);
  EXPECT_TRUE(c.quant.weight_scale_stated);
  EXPECT_EQ(c.quant.weight_scale, Fp8WeightScale::kChannel);
  EXPECT_EQ(c.quant.activation_scale, Fp8ActivationScale::kDynamicPerToken);
  EXPECT_EQ(c.quant.source, "--quantization fp8");
  EXPECT_TRUE(status_is(apply_quantization_option("int8", "--quantization", &c),
                        StatusCode::kInvalidArgument,
                        {"--quantization", "'int8'", "auto, none or fp8"}));

  auto fp8 = parse(ct(args("tensor", false), args("tensor", false)));
  ASSERT_TRUE(fp8.ok());
  c = *fp8;
  c.model_dir = "/models/x";
  ASSERT_TRUE(apply_quantization_option("fp8", "--quantization", &c).ok());  // already FP8
  EXPECT_TRUE(c.quant.prequantized);
  EXPECT_EQ(c.quant.activation_scale, Fp8ActivationScale::kStaticPerTensor);
  ASSERT_TRUE(apply_quantization_option("auto", "model.quantization", &c).ok());
  EXPECT_TRUE(status_is(apply_quantization_option("none", "model.quantization", &c),
                        StatusCode::kInvalidArgument,
                        {"model.quantization none", "/models/x", "is FP8", "compressed-tensors"}));
}

}  // namespace
}  // namespace treeserve
