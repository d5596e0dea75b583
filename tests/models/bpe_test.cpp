// The BPE model: the heap-based merge loop against the plain quadratic reference on random
// vocabularies and words (cache on, off, and shared by threads), ignore_merges, byte
// fallback, unknown characters, and merges that name pieces outside the vocabulary.
#include "models/detail/bpe.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/models/test_util.h"

namespace treeserve::detail {
namespace {

using Merges = std::vector<std::pair<std::string, std::string>>;

std::vector<int32_t> encode(const BpeModel& model, const std::string& word) {
  std::vector<int32_t> ids;
  model.encode_word(word, &ids);
  return ids;
}

std::vector<int32_t> reference(const BpeModel& model, const std::string& word) {
  std::vector<int32_t> ids;
  model.encode_word_reference(word, &ids);
  return ids;
}

// The letters a..e, then `n` merges of random existing pieces, each adding its result.
std::unique_ptr<BpeModel> random_model(std::mt19937* rng, int n, bool ignore_merges) {
  StringMap<int32_t> vocab;
  std::vector<std::string> pieces;
  for (char c = 'a'; c <= 'e'; ++c) {
    vocab[std::string(1, c)] = int32_t(pieces.size());
    pieces.push_back(std::string(1, c));
  }
  Merges merges;
  for (int i = 0; i < n; ++i) {
    const std::string& l = pieces[(*rng)() % pieces.size()];
    const std::string& r = pieces[(*rng)() % pieces.size()];
    if (l.size() + r.size() > 8) continue;
    merges.emplace_back(l, r);
    if (vocab.emplace(l + r, int32_t(pieces.size())).second) pieces.push_back(l + r);
  }
  BpeOptions options;
  options.ignore_merges = ignore_merges;
  auto model = BpeModel::build(std::move(vocab), merges, options);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return std::move(*model);
}

TEST(BpeTest, HeapMatchesReferenceOnRandomVocabularies) {
  std::mt19937 rng(45);
  for (int trial = 0; trial < 40; ++trial) {
    auto model = random_model(&rng, 10 + int(rng() % 120), trial % 2 == 1);
    model->set_cache_enabled(trial % 3 != 0);
    for (int w = 0; w < 300; ++w) {
      std::string word(1 + rng() % 40, 'a');
      for (char& c : word) c = char('a' + rng() % 5);
      const auto expected = reference(*model, word);
      ASSERT_EQ(encode(*model, word), expected) << "trial " << trial << " word " << word;
      ASSERT_EQ(encode(*model, word), expected) << "cached, trial " << trial << " " << word;
    }
  }
}

TEST(BpeTest, LowestRankFirstLeftmostOnTies) {
  StringMap<int32_t> vocab = {{"a", 0}, {"b", 1}, {"ab", 2}, {"ba", 3}, {"aa", 4}};
  auto model = BpeModel::build(vocab, {{"b", "a"}, {"a", "b"}, {"a", "a"}}, {});
  ASSERT_TRUE(model.ok());
  EXPECT_EQ(encode(**model, "aba"), (std::vector<int32_t>{0, 3}));      // "ba" outranks "ab"
  EXPECT_EQ(encode(**model, "aaa"), (std::vector<int32_t>{4, 0}));      // leftmost "aa"
  EXPECT_EQ(encode(**model, "abab"), (std::vector<int32_t>{0, 3, 1}));  // a, ba, b
}

TEST(BpeTest, IgnoreMergesTakesWholeWords) {
  // "abc" is in the vocabulary, but no merge sequence reaches it.
  StringMap<int32_t> vocab = {{"a", 0}, {"b", 1}, {"c", 2}, {"bc", 3}, {"abc", 4}};
  BpeOptions options;
  auto plain = BpeModel::build(vocab, {{"b", "c"}}, options);
  options.ignore_merges = true;
  auto whole = BpeModel::build(vocab, {{"b", "c"}}, options);
  ASSERT_TRUE(plain.ok() && whole.ok());
  EXPECT_EQ(encode(**plain, "abc"), (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(encode(**whole, "abc"), (std::vector<int32_t>{4}));
  EXPECT_EQ(encode(**whole, "abcc"), (std::vector<int32_t>{0, 3, 2}));
}

TEST(BpeTest, ByteLevelWordsAreBytes) {
  StringMap<int32_t> vocab;
  for (int b = 0; b < 256; ++b) vocab[std::string(1, char(b))] = b;
  vocab["\xE6\x97"] = 256;
  vocab["\xE6\x97\xA5"] = 257;
  BpeOptions options;
  options.byte_level = true;
  auto model = BpeModel::build(vocab, {{"\xE6", "\x97"}, {"\xE6\x97", "\xA5"}}, options);
  ASSERT_TRUE(model.ok());
  EXPECT_EQ(encode(**model, "\xE6\x97\xA5\xE6\x97"), (std::vector<int32_t>{257, 256}));
  EXPECT_EQ(encode(**model, "a b"), (std::vector<int32_t>{'a', ' ', 'b'}));
}

TEST(BpeTest, ByteFallbackAndUnknowns) {
  StringMap<int32_t> vocab = {{"<unk>", 0}, {"a", 1}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = 2 + b;
  }
  BpeOptions options;
  options.byte_fallback = true;
  options.unk_id = 0;
  auto fallback = BpeModel::build(vocab, {}, options);
  ASSERT_TRUE(fallback.ok());
  EXPECT_EQ(encode(**fallback, "a\xC3\xA9"), (std::vector<int32_t>{1, 2 + 0xC3, 2 + 0xA9}));

  StringMap<int32_t> small = {{"<unk>", 0}, {"a", 1}};
  options.byte_fallback = false;
  auto unk = BpeModel::build(small, {}, options);
  options.fuse_unk = true;
  auto fused = BpeModel::build(small, {}, options);
  options.unk_id = -1;
  auto dropped = BpeModel::build(small, {}, options);
  ASSERT_TRUE(unk.ok() && fused.ok() && dropped.ok());
  EXPECT_EQ(encode(**unk, "xya"), (std::vector<int32_t>{0, 0, 1}));
  EXPECT_EQ(encode(**fused, "xya"), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(encode(**dropped, "xya"), (std::vector<int32_t>{1}));
}

TEST(BpeTest, MergeOutsideTheVocabularyIsAnError) {
  StringMap<int32_t> vocab = {{"a", 0}, {"b", 1}};
  auto model = BpeModel::build(vocab, {{"a", "b"}}, {});
  ASSERT_FALSE(model.ok());
  EXPECT_TRUE(testing::status_is(model.status(), StatusCode::kInvalidArgument,
                                 {"merges[0]", "'ab' is not in the vocabulary"}));
}

TEST(BpeTest, CacheIsSharedSafelyBetweenThreads) {
  std::mt19937 rng(7);
  auto model = random_model(&rng, 150, false);
  std::vector<std::string> words;
  for (int w = 0; w < 2000; ++w) {
    std::string word(1 + rng() % 20, 'a');
    for (char& c : word) c = char('a' + rng() % 5);
    words.push_back(word);
  }
  std::vector<std::vector<int32_t>> expected;
  for (const std::string& w : words) expected.push_back(reference(*model, w));
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        for (size_t i = 0; i < words.size(); ++i)
          wrong[t] += encode(*model, words[i]) != expected[i];
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(wrong[t], 0);
}

}  // namespace
}  // namespace treeserve::detail
