// Incremental detokenization: deltas concatenate to the full decode, never end inside
// a UTF-8 sequence, and hold byte-fallback characters back until they are complete.
#include "models/detokenizer.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "tests/models/test_util.h"

namespace treeserve {
namespace {

using testing::status_is;

constexpr int32_t kFirstBytePiece = 3;
int32_t byte_id(int b) { return kFirstBytePiece + b; }

// Structurally valid UTF-8 (no partial sequence at either end).
bool is_valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto lead = static_cast<unsigned char>(s[i]);
    const size_t len = lead < 0x80           ? 1
                       : (lead >> 5) == 0x6  ? 2
                       : (lead >> 4) == 0xE  ? 3
                       : (lead >> 3) == 0x1E ? 4
                                             : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += len;
  }
  return true;
}

class DetokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto loaded = Tokenizer::load(std::string(TREESERVE_TINY_MODEL_DIR) + "/tokenizer.model");
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    tokenizer_ = loaded->release();
    vocab_ = new DetokenizerVocab(*tokenizer_);
  }
  static void TearDownTestSuite() {
    delete vocab_;
    vocab_ = nullptr;
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  static const Tokenizer& tok() { return *tokenizer_; }

  // Streams ids through both detokenizer forms; checks every delta is whole UTF-8 (when
  // the ids spell valid text) and that deltas + flush equal decode(ids), and that the
  // table-driven stream (DetokenizerVocab) gives exactly the same deltas. Returns deltas.
  static std::vector<std::string> stream(const std::vector<int32_t>& ids, bool valid_text) {
    IncrementalDetokenizer detok(tok());
    IncrementalDetokenizer fast(tok(), vocab_);
    std::vector<std::string> deltas;
    std::string joined, joined_stateless;
    std::vector<int32_t> prefix;
    for (int32_t id : ids) {
      auto delta = detok.push(id);
      EXPECT_TRUE(delta.ok()) << delta.status().ToString();
      auto fast_delta = fast.push(id);
      EXPECT_TRUE(fast_delta.ok());
      if (delta.ok() && fast_delta.ok()) {
        EXPECT_EQ(*fast_delta, *delta) << "table-driven delta after id " << id;
      }
      auto stateless = decode_new_text(tok(), prefix, id);
      EXPECT_TRUE(stateless.ok()) << stateless.status().ToString();
      prefix.push_back(id);
      if (!delta.ok() || !stateless.ok()) return deltas;
      if (valid_text) {
        EXPECT_TRUE(is_valid_utf8(*delta)) << "partial UTF-8 after id " << id;
        EXPECT_EQ(*delta, *stateless) << "after id " << id;
      }
      deltas.push_back(*delta);
      joined += *delta;
      joined_stateless += *stateless;
    }
    EXPECT_EQ(detok.ids(), ids);
    auto rest = detok.flush();
    EXPECT_TRUE(rest.ok());
    auto fast_rest = fast.flush();
    EXPECT_TRUE(fast_rest.ok());
    if (rest.ok() && fast_rest.ok()) {
      EXPECT_EQ(*fast_rest, *rest);
    }
    if (valid_text) {
      EXPECT_EQ(*rest, "");
    }
    joined += *rest;
    auto full = tok().decode(ids);
    EXPECT_TRUE(full.ok());
    EXPECT_EQ(joined, *full);
    if (valid_text) {
      EXPECT_EQ(joined_stateless, *full);
    }
    return deltas;
  }

  static Tokenizer* tokenizer_;
  static DetokenizerVocab* vocab_;
};

Tokenizer* DetokenizerTest::tokenizer_ = nullptr;
DetokenizerVocab* DetokenizerTest::vocab_ = nullptr;

TEST_F(DetokenizerTest, VocabTableKnowsPlainPiecesAndLeavesBytesAndControlOut) {
  const DetokenizerVocab& v = *vocab_;
  ASSERT_GE(v.anchor(), 0);
  // Most of the tiny vocabulary is plain pieces; byte pieces and control ids are not.
  EXPECT_GT(v.num_plain(), tok().vocab_size() / 4);
  EXPECT_EQ(v.plain_text(byte_id(0xE6)), nullptr);
  EXPECT_EQ(v.plain_text(tok().bos_id()), nullptr);
  EXPECT_EQ(v.plain_text(tok().eos_id()), nullptr);
  EXPECT_EQ(v.plain_text(-1), nullptr);
  EXPECT_EQ(v.plain_text(tok().vocab_size()), nullptr);
  // Word pieces with the U+2581 marker: their text keeps the space mid-stream.
  int32_t spaced = 0;
  for (int32_t id = 0; id < tok().vocab_size(); ++id) {
    const std::string* text = v.plain_text(id);
    if (text == nullptr) continue;
    ASSERT_FALSE(text->empty()) << id;
    spaced += (*text)[0] == ' ' && tok().id_to_piece(id).rfind("\xE2\x96\x81", 0) == 0;
  }
  EXPECT_GT(spaced, 0);
}

TEST_F(DetokenizerTest, StreamsOfRealTextEqualTheFullDecode) {
  const std::vector<std::string> texts = {
      "The old oak at the bottom of the garden has watched three generations.",
      "  spaces  before, \"quotes\"\tand\nnew lines\n",
      "16 divided by 8 equals 2, and 2 squared is 4.",
      "caf\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC \xF0\x9F\x98\x80! na\xC3\xAFve\xE2\x80\x94"
      "end",
  };
  for (const std::string& text : texts) {
    auto ids = tok().encode(text);
    ASSERT_TRUE(ids.ok());
    stream(*ids, /*valid_text=*/true);
    // With BOS in front, as a prompt + generation stream would be.
    std::vector<int32_t> with_bos = {tok().bos_id()};
    with_bos.insert(with_bos.end(), ids->begin(), ids->end());
    stream(with_bos, /*valid_text=*/true);
  }
}

TEST_F(DetokenizerTest, FirstPieceLosesItsDummySpaceLaterOnesKeepIt) {
  auto ids = tok().encode("The old");
  ASSERT_TRUE(ids.ok());
  const std::vector<std::string> deltas = stream(*ids, true);
  ASSERT_FALSE(deltas.empty());
  EXPECT_EQ(deltas[0].substr(0, 1), "T");
  std::string joined;
  for (const std::string& d : deltas) joined += d;
  EXPECT_EQ(joined, "The old");
}

TEST_F(DetokenizerTest, ControlIdsMidStreamKeepTheNextSpace) {
  // Regression: a window starting at </s> must still decode "▁the" as " the" (sentencepiece
  // strips the dummy space of the first non-control piece it sees, which would lose it).
  auto x = tok().encode("x");
  auto the = tok().encode(" the");  // "▁" "▁the" or "▁▁the": ends with a ▁-piece
  ASSERT_TRUE(x.ok() && the.ok());
  const int32_t eos = tok().eos_id(), bos = tok().bos_id();
  std::vector<int32_t> ids = *x;
  ids.push_back(eos);
  ids.push_back(the->back());
  std::string joined;
  for (const std::string& d : stream(ids, true)) joined += d;
  EXPECT_EQ(joined, "x the");
  // At the very start, control ids do not end the start state: the space is dropped.
  joined.clear();
  for (const std::string& d : stream({bos, eos, bos, the->back(), the->back()}, true)) joined += d;
  EXPECT_EQ(joined, "the the");
}

TEST_F(DetokenizerTest, HoldsBackByteFallbackCharactersUntilComplete) {
  auto x = tok().encode("x");
  ASSERT_TRUE(x.ok());
  // "x" then U+65E5 as three byte pieces, then U+1F600 as four.
  std::vector<int32_t> ids = *x;
  for (int b : {0xE6, 0x97, 0xA5, 0xF0, 0x9F, 0x98, 0x80}) ids.push_back(byte_id(b));
  const std::vector<std::string> deltas = stream(ids, true);
  const size_t n = x->size();
  ASSERT_EQ(deltas.size(), n + 7);
  EXPECT_EQ(deltas[n + 0], "");
  EXPECT_EQ(deltas[n + 1], "");
  EXPECT_EQ(deltas[n + 2], "\xE6\x97\xA5");
  EXPECT_EQ(deltas[n + 3], "");
  EXPECT_EQ(deltas[n + 4], "");
  EXPECT_EQ(deltas[n + 5], "");
  EXPECT_EQ(deltas[n + 6], "\xF0\x9F\x98\x80");
}

TEST_F(DetokenizerTest, IncompleteUtf8Tail) {
  auto a = tok().encode("a");
  ASSERT_TRUE(a.ok());
  auto with = [&](std::vector<int> bytes) {
    std::vector<int32_t> ids = *a;
    for (int b : bytes) ids.push_back(byte_id(b));
    return incomplete_utf8_tail(tok(), ids);
  };
  EXPECT_EQ(with({}), 0);
  EXPECT_EQ(with({0x41}), 0);              // ASCII byte piece
  EXPECT_EQ(with({0xC3}), 1);              // 2-byte lead
  EXPECT_EQ(with({0xC3, 0xA9}), 0);        // complete
  EXPECT_EQ(with({0xE6, 0x97}), 2);        // 3-byte lead + 1
  EXPECT_EQ(with({0xF0, 0x9F, 0x98}), 3);  // 4-byte lead + 2
  EXPECT_EQ(with({0xF0, 0x9F, 0x98, 0x80}), 0);
  EXPECT_EQ(with({0x97}), 0);  // stray continuation: cannot become valid, emit now
  EXPECT_EQ(with({0xC3, 0xA9, 0xE6}), 1);
  EXPECT_EQ(incomplete_utf8_tail(tok(), {}), 0);
}

TEST_F(DetokenizerTest, FlushEmitsAnIncompleteTailAsReplacement) {
  IncrementalDetokenizer detok(tok());
  auto x = tok().encode("x");
  ASSERT_TRUE(x.ok());
  for (int32_t id : *x) ASSERT_TRUE(detok.push(id).ok());
  auto held = detok.push(byte_id(0xE6));
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(*held, "");
  auto rest = detok.flush();
  ASSERT_TRUE(rest.ok());
  EXPECT_EQ(*rest, "\xEF\xBF\xBD");  // U+FFFD, never a raw 0xE6
  auto again = detok.flush();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, "");
}

TEST_F(DetokenizerTest, RejectsIdsOutsideTheVocabulary) {
  IncrementalDetokenizer detok(tok());
  EXPECT_TRUE(status_is(detok.push(512).status(), StatusCode::kInvalidArgument, {"512"}));
  EXPECT_TRUE(status_is(detok.push(-1).status(), StatusCode::kInvalidArgument, {"-1"}));
  EXPECT_TRUE(detok.ids().empty());
  EXPECT_TRUE(
      status_is(decode_new_text(tok(), {}, 600).status(), StatusCode::kInvalidArgument, {"600"}));
}

TEST_F(DetokenizerTest, RandomStreamsEqualTheFullDecode) {
  // Random ids over the whole vocabulary, biased towards byte pieces and control ids
  // (<unk>, <s>, </s>) so that broken and complete UTF-8 sequences, control ids and
  // normal pieces all interleave.
  std::mt19937 rng(20261123);
  std::uniform_int_distribution<int32_t> any(0, 511), byte(0x80, 0xFF), control(0, 2), dice(0, 7);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<int32_t> ids(1 + trial % 40);
    for (int32_t& id : ids) {
      const int roll = dice(rng);
      id = roll < 2 ? byte_id(byte(rng)) : roll == 2 ? control(rng) : any(rng);
    }
    stream(ids, /*valid_text=*/false);
  }
}

TEST_F(DetokenizerTest, RandomValidTextNeverSplitsACharacter) {
  // Random strings of 1-4 byte characters (all byte-fallback for non-ASCII).
  std::mt19937 rng(7);
  const std::vector<std::string> alphabet = {
      "a", "The", " ", "\n", "\xC3\xA9", "\xE2\x82\xAC", "\xE6\x97\xA5", "\xF0\x9F\x98\x80",
      "7", "\t"};
  std::uniform_int_distribution<size_t> pick(0, alphabet.size() - 1);
  for (int trial = 0; trial < 100; ++trial) {
    std::string text;
    for (int i = 0; i < 1 + trial % 25; ++i) text += alphabet[pick(rng)];
    auto ids = tok().encode(text);
    ASSERT_TRUE(ids.ok());
    std::string joined;
    for (const std::string& d : stream(*ids, /*valid_text=*/true)) joined += d;
    EXPECT_EQ(joined, text);
  }
}

}  // namespace
}  // namespace treeserve
