// Tokenizer over the tiny model's tokenizer.model (BPE, byte fallback, identity
// normalization, like Llama-2's): exact encode/decode round trips, special ids,
// pieces, and clear errors for missing or garbage model files.
#include "models/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "tests/models/test_util.h"

namespace treeserve {
namespace {

using testing::status_is;
using testing::TempDir;
using testing::write_file;

const std::string kModel = std::string(TREESERVE_TINY_MODEL_DIR) + "/tokenizer.model";
constexpr int32_t kFirstBytePiece = 3;  // <unk> <s> </s>, then <0x00> .. <0xFF>

class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto loaded = Tokenizer::load(kModel);
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    tokenizer_ = loaded->release();
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  static const Tokenizer& tok() { return *tokenizer_; }

  static std::vector<int32_t> encode(const std::string& text) {
    auto ids = tok().encode(text);
    EXPECT_TRUE(ids.ok()) << ids.status().ToString();
    return ids.ok() ? *ids : std::vector<int32_t>{};
  }
  static std::string decode(const std::vector<int32_t>& ids) {
    auto text = tok().decode(ids);
    EXPECT_TRUE(text.ok()) << text.status().ToString();
    return text.ok() ? *text : "";
  }

  static Tokenizer* tokenizer_;
};

Tokenizer* TokenizerTest::tokenizer_ = nullptr;

TEST_F(TokenizerTest, SpecialIdsAndVocab) {
  EXPECT_EQ(tok().vocab_size(), 512);
  EXPECT_EQ(tok().bos_id(), 1);
  EXPECT_EQ(tok().eos_id(), 2);
  EXPECT_EQ(tok().id_to_piece(0), "<unk>");
  EXPECT_EQ(tok().id_to_piece(1), "<s>");
  EXPECT_EQ(tok().id_to_piece(2), "</s>");
  EXPECT_EQ(tok().id_to_piece(kFirstBytePiece), "<0x00>");
  EXPECT_EQ(tok().id_to_piece(kFirstBytePiece + 0x0A), "<0x0A>");
  EXPECT_EQ(tok().id_to_piece(kFirstBytePiece + 0xFF), "<0xFF>");
  EXPECT_EQ(tok().id_to_piece(-1), "");
  EXPECT_EQ(tok().id_to_piece(512), "");
  // BOS/EOS are control symbols: they decode to nothing.
  EXPECT_EQ(decode({1, 2}), "");
}

TEST_F(TokenizerTest, RoundTripsExactly) {
  const std::vector<std::string> texts = {
      "The old oak at the bottom of the garden has watched three generations of children.",
      "\"Is the oven hot yet?\" asked Mara.",
      "Thirteen times sixteen is two hundred and eight (13 x 16 = 208).",
      "[23:28:31] The parser recovered from a crash; the web server ran out of memory.",
      "  two leading spaces, three   inside and two trailing  ",
      "tabs\tand\nnewlines\n\nand\r\nwindows line ends\n",
      "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xE2\x80\x94 ok "
      "\xF0\x9F\x98\x80",
      "~`{}|\\^ @#$%&*_+<>",
      "x",
      " ",
      "",
  };
  for (const std::string& text : texts) {
    const std::vector<int32_t> ids = encode(text);
    for (int32_t id : ids) {
      EXPECT_GE(id, 3) << "no control or unknown ids in: " << text;
      EXPECT_LT(id, 512);
    }
    EXPECT_EQ(decode(ids), text);
  }
  EXPECT_TRUE(encode("").empty());
}

TEST_F(TokenizerTest, PiecesSpellTheTextWithTheDummyPrefix) {
  // For text in the vocabulary's alphabet, the pieces concatenated, with U+2581 as space,
  // are " " + text (sentencepiece's dummy prefix). Nothing is lost or normalized.
  const std::string text = "The creek flooded the lower meadow, and Tom watched it.";
  std::string spelled;
  for (int32_t id : encode(text)) {
    const std::string piece = tok().id_to_piece(id);
    ASSERT_NE(piece.rfind("<0x", 0), 0u) << "unexpected byte piece " << piece;
    for (size_t i = 0; i < piece.size(); ++i) {
      if (piece.compare(i, 3, "\xE2\x96\x81") == 0) {
        spelled += ' ';
        i += 2;
      } else {
        spelled += piece[i];
      }
    }
  }
  EXPECT_EQ(spelled, " " + text);
}

TEST_F(TokenizerTest, ByteFallbackForCharactersOutsideTheVocabulary) {
  // U+65E5 (E6 97 A5) never occurs in the ASCII training corpus.
  const std::vector<int32_t> ids = encode("\xE6\x97\xA5");
  ASSERT_GE(ids.size(), 3u);
  const std::vector<int32_t> tail(ids.end() - 3, ids.end());
  EXPECT_EQ(tail, (std::vector<int32_t>{kFirstBytePiece + 0xE6, kFirstBytePiece + 0x97,
                                        kFirstBytePiece + 0xA5}));
  EXPECT_EQ(tok().id_to_piece(tail[0]), "<0xE6>");
  // A newline is a byte piece too (identity normalization keeps it).
  const std::vector<int32_t> nl = encode("a\nb");
  EXPECT_NE(std::find(nl.begin(), nl.end(), kFirstBytePiece + 0x0A), nl.end());
  // Decoding byte pieces alone reassembles the character.
  EXPECT_EQ(decode(tail), "\xE6\x97\xA5");
}

TEST_F(TokenizerTest, DigitsAreSplit) {
  const std::vector<int32_t> ids = encode("2017");
  std::string last_four;
  for (size_t i = ids.size() - 4; i < ids.size(); ++i) last_four += tok().id_to_piece(ids[i]);
  EXPECT_EQ(last_four.substr(last_four.size() - 4), "2017");
  for (size_t i = ids.size() - 3; i < ids.size(); ++i) {
    EXPECT_EQ(tok().id_to_piece(ids[i]).size(), 1u) << i;
  }
}

TEST_F(TokenizerTest, InvalidUtf8InputIsEncodedNotRejected) {
  // Clients may send any bytes; sentencepiece maps invalid UTF-8 to U+FFFD pieces.
  auto ids = tok().encode(std::string("ok \xFF\xC3 end", 9));
  ASSERT_TRUE(ids.ok()) << ids.status().ToString();
  auto text = tok().decode(*ids);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(text->substr(0, 3), "ok ");
  EXPECT_EQ(text->substr(text->size() - 4), " end");
  EXPECT_NE(text->find("\xEF\xBF\xBD"), std::string::npos) << *text;
}

TEST_F(TokenizerTest, DecodeRejectsIdsOutsideTheVocabulary) {
  EXPECT_TRUE(status_is(tok().decode({5, 512}).status(), StatusCode::kInvalidArgument,
                        {"512", "position 1", "[0, 512)"}));
  EXPECT_TRUE(status_is(tok().decode({-3}).status(), StatusCode::kInvalidArgument, {"-3"}));
}

TEST_F(TokenizerTest, ConcurrentUseIsSafe) {
  const std::string text = "May 11, 2017: On a hot July noon, Tom measured the olive tree.";
  const std::vector<int32_t> want = encode(text);
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) {
        auto ids = tok().encode(text);
        auto back = tok().decode(want);
        ok[t] += ids.ok() && *ids == want && back.ok() && *back == text;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(ok[t], 50);
}

TEST(TokenizerLoadTest, TwoInstancesAreIndependent) {
  auto a = Tokenizer::load(kModel);
  auto b = Tokenizer::load(kModel);
  ASSERT_TRUE(a.ok() && b.ok());
  a->reset();  // freeing one leaves the other working
  auto ids = (*b)->encode("hello");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*(*b)->decode(*ids), "hello");
}

TEST(TokenizerLoadTest, MissingFileIsNotFound) {
  TempDir dir;
  EXPECT_TRUE(status_is(Tokenizer::load(dir.file("tokenizer.model")).status(),
                        StatusCode::kNotFound, {dir.file("tokenizer.model")}));
  EXPECT_TRUE(status_is(Tokenizer::load(dir.path()).status(), StatusCode::kNotFound, {dir.path()}));
}

TEST(TokenizerLoadTest, GarbageFilesAreInvalidArgument) {
  TempDir dir;
  std::string random(4096, '\0');
  uint32_t x = 12345;
  for (char& c : random) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  const std::vector<std::string> garbage = {
      "",
      "this is not a sentencepiece model\n",
      random,
      std::string("\x0a\x05\x0a\x03<s>", 8),
      R"({"model": {"type": "BPE"}})",  // a tokenizer.json is not a tokenizer.model
  };
  for (size_t i = 0; i < garbage.size(); ++i) {
    const std::string path = dir.file("bad" + std::to_string(i) + ".model");
    write_file(path, garbage[i]);
    EXPECT_TRUE(status_is(Tokenizer::load(path).status(), StatusCode::kInvalidArgument,
                          {path, "not a valid sentencepiece model"}))
        << i;
  }
}

}  // namespace
}  // namespace treeserve
