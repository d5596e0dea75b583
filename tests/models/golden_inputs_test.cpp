// tests/golden/golden_inputs.json holds the token ids the golden logits were computed for
// (make_golden.py). They must be what this build's tokenizer gives for the stored texts:
// a tokenizer change (spm_train flags, corpus) must regenerate the inputs and the golden
// data, or the engine tests would compare logits of different token sequences.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/tokenizer.h"

namespace treeserve {
namespace {

using nlohmann::json;

TEST(GoldenInputsTest, StoredIdsAreThisTokenizersIds) {
  std::ifstream in(TREESERVE_GOLDEN_INPUTS);
  ASSERT_TRUE(in) << TREESERVE_GOLDEN_INPUTS;
  const json inputs = json::parse(in);
  auto tok = Tokenizer::load(std::string(TREESERVE_TINY_MODEL_DIR) + "/tokenizer.model");
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const int32_t bos = inputs.at("bos_id").get<int32_t>();
  EXPECT_EQ(bos, (*tok)->bos_id());

  auto expect_ids = [&](const std::string& text, bool with_bos, const json& stored) {
    auto ids = (*tok)->encode(text);
    ASSERT_TRUE(ids.ok()) << ids.status().ToString();
    std::vector<int32_t> want;
    if (with_bos) want.push_back(bos);
    want.insert(want.end(), ids->begin(), ids->end());
    EXPECT_EQ(stored.get<std::vector<int32_t>>(), want)
        << "'" << text << "': rerun tests/golden/make_golden.py MODEL_DIR --write-inputs "
        << "and regenerate the golden data";
  };
  ASSERT_EQ(inputs.at("prompts").size(), 4u);
  for (const json& p : inputs.at("prompts")) {
    expect_ids(p.at("text").get<std::string>(), true, p.at("ids"));
  }
  const json& tree = inputs.at("tree");
  expect_ids(tree.at("prompt_text").get<std::string>(), true, tree.at("prompt_ids"));
  ASSERT_EQ(tree.at("suffixes").size(), 8u);
  for (const json& s : tree.at("suffixes")) {
    expect_ids(s.at("text").get<std::string>(), false, s.at("ids"));
    EXPECT_GE(s.at("ids").size(), 1u);
    EXPECT_LE(s.at("ids").size(), 6u);
  }
}

}  // namespace
}  // namespace treeserve
