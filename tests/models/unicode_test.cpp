// The tokenizer's text primitives: UTF-8 validation, lossy decoding as Rust and WHATWG do it,
// incomplete-suffix detection, character classes, normalization, the PCRE2 wrapper (Llama 3's
// split pattern, \s as Unicode White_Space, long inputs) and the byte-level alphabet.
#include "models/detail/unicode.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace treeserve::detail {
namespace {

const std::string kFffd = "\xEF\xBF\xBD";

TEST(Utf8Test, FirstInvalid) {
  EXPECT_EQ(first_invalid_utf8(""), 0u);
  EXPECT_EQ(first_invalid_utf8("abc \xE6\x97\xA5 \xF0\x9F\x98\x80"), 12u);
  EXPECT_EQ(first_invalid_utf8("ab\x80"), 2u);             // stray continuation
  EXPECT_EQ(first_invalid_utf8("a\xC0\xAF"), 1u);          // overlong lead
  EXPECT_EQ(first_invalid_utf8("a\xED\xA0\x80"), 1u);      // surrogate
  EXPECT_EQ(first_invalid_utf8("a\xF4\x90\x80\x80"), 1u);  // past U+10FFFF
  EXPECT_EQ(first_invalid_utf8("a\xE6\x97"), 1u);          // truncated
}

TEST(Utf8Test, LossyReplacesMaximalSubparts) {
  // The examples of Unicode's "U+FFFD substitution of maximal subparts" (table 3-8).
  EXPECT_EQ(utf8_lossy("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            "a" + kFffd + kFffd + kFffd + "b" + kFffd + "c" + kFffd + kFffd + "d");
  EXPECT_EQ(utf8_lossy("\xE6\x97"), kFffd);  // one truncated sequence: one U+FFFD
  EXPECT_EQ(utf8_lossy("\xE6\x97\xA5"), "\xE6\x97\xA5");
  EXPECT_EQ(utf8_lossy("\xFF\xFE"), kFffd + kFffd);
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), kFffd + kFffd + kFffd);  // surrogate: byte by byte
  EXPECT_EQ(utf8_lossy("ok"), "ok");
}

TEST(Utf8Test, IncompleteSuffix) {
  EXPECT_EQ(incomplete_utf8_suffix(""), 0u);
  EXPECT_EQ(incomplete_utf8_suffix("abc"), 0u);
  EXPECT_EQ(incomplete_utf8_suffix("a\xE6"), 1u);
  EXPECT_EQ(incomplete_utf8_suffix("a\xE6\x97"), 2u);
  EXPECT_EQ(incomplete_utf8_suffix("a\xE6\x97\xA5"), 0u);
  EXPECT_EQ(incomplete_utf8_suffix("\xF0\x9F\x98"), 3u);
  EXPECT_EQ(incomplete_utf8_suffix("\xE0\x80"), 0u);  // can never complete: not held
  EXPECT_EQ(incomplete_utf8_suffix("\xFF"), 0u);
  EXPECT_EQ(incomplete_utf8_suffix("\x97"), 0u);
}

TEST(Utf8Test, DecodeAndAppendRoundTrip) {
  for (uint32_t cp : {0x41u, 0xE9u, 0x65E5u, 0x1F600u, 0x10FFFFu}) {
    std::string s;
    append_utf8(cp, &s);
    size_t pos = 0;
    EXPECT_EQ(next_char(s, &pos), cp);
    EXPECT_EQ(pos, s.size());
    size_t length = 0;
    EXPECT_EQ(last_char("x" + s, &length), cp);
    EXPECT_EQ(length, s.size());
  }
}

TEST(CharClassTest, WhiteSpaceNumericAlphanumeric) {
  for (uint32_t cp : {0x20u, 0x09u, 0x0Au, 0x85u, 0xA0u, 0x1680u, 0x2003u, 0x2028u, 0x3000u}) {
    EXPECT_TRUE(is_white_space(cp)) << cp;
  }
  for (uint32_t cp : {0x180Eu, 0x200Bu, 0xFEFFu, 0x41u, 0x1Cu}) EXPECT_FALSE(is_white_space(cp));
  for (uint32_t cp : {0x30u, 0x663u, 0xFF11u, 0xB2u, 0x2162u, 0xBDu}) EXPECT_TRUE(is_numeric(cp));
  EXPECT_FALSE(is_numeric('a'));
  EXPECT_TRUE(is_alphanumeric(0x65E5));
  EXPECT_TRUE(is_alphanumeric('7'));
  EXPECT_FALSE(is_alphanumeric('_'));
}

TEST(NormalizeTest, Forms) {
  const std::string decomposed = "e\xCC\x81";  // e + COMBINING ACUTE
  const std::string composed = "\xC3\xA9";     // é
  EXPECT_EQ(*normalize_unicode(decomposed, NormalForm::kNfc), composed);
  EXPECT_EQ(*normalize_unicode(composed, NormalForm::kNfd), decomposed);
  EXPECT_EQ(*normalize_unicode("\xEF\xAC\x81", NormalForm::kNfkc), "fi");  // ligature ﬁ
  EXPECT_EQ(*normalize_unicode("\xEF\xAC\x81", NormalForm::kNfc), "\xEF\xAC\x81");
}

std::vector<std::string> split(const Regex& re, const std::string& text) {
  std::vector<std::pair<size_t, size_t>> matches;
  EXPECT_TRUE(re.find_all(text, &matches).ok());
  std::vector<std::string> out;
  for (const auto& [b, e] : matches) out.push_back(text.substr(b, e - b));
  return out;
}

const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

TEST(RegexTest, Llama3Pattern) {
  auto re = Regex::compile(kLlama3Pattern);
  ASSERT_TRUE(re.ok()) << re.status().ToString();
  EXPECT_EQ(
      split(**re, "Hello world! It's 12345 ok"),
      (std::vector<std::string>{"Hello", " world", "!", " It", "'s", " ", "123", "45", " ok"}));
  EXPECT_EQ(split(**re, "a  \n\n  b"), (std::vector<std::string>{"a", "  \n\n", " ", " b"}));
  EXPECT_EQ(split(**re, "x   "), (std::vector<std::string>{"x", "   "}));
  EXPECT_EQ(split(**re, "WE'LL"), (std::vector<std::string>{"WE", "'LL"}));
  EXPECT_EQ(split(**re, "日本語テキスト"), (std::vector<std::string>{"日本語テキスト"}));
}

TEST(RegexTest, WhiteSpaceIsUnicodes) {
  // PCRE2's own \s takes U+180E MONGOLIAN VOWEL SEPARATOR; Unicode's White_Space (and
  // Oniguruma's \s, which tokenizer.json patterns are written for) does not.
  auto re = Regex::compile(R"(\s+|\S+)");
  ASSERT_TRUE(re.ok());
  EXPECT_EQ(split(**re, " \xE1\xA0\x8E "), (std::vector<std::string>{" ", "\xE1\xA0\x8E", " "}));
  EXPECT_EQ(split(**re,
                  "a\xC2\x85"
                  "b"),
            (std::vector<std::string>{"a", "\xC2\x85", "b"}));
  auto in_class = Regex::compile(R"([^\s]+)");
  ASSERT_TRUE(in_class.ok());
  EXPECT_EQ(split(**in_class, "\xE1\xA0\x8E x"), (std::vector<std::string>{"\xE1\xA0\x8E", "x"}));
}

TEST(RegexTest, PossessiveAndLookahead) {
  auto re = Regex::compile(R"(\p{N}{1,3}+|\s+(?!\S)|\s)");
  ASSERT_TRUE(re.ok()) << re.status().ToString();
  EXPECT_EQ(split(**re, "1234  x"), (std::vector<std::string>{"123", "4", " ", " "}));
}

TEST(RegexTest, EmptyMatchesAdvanceOneCharacter) {
  auto re = Regex::compile("x*");
  ASSERT_TRUE(re.ok());
  std::vector<std::pair<size_t, size_t>> matches;
  ASSERT_TRUE((*re)->find_all("a\xE6\x97\xA5x", &matches).ok());
  EXPECT_EQ(matches, (std::vector<std::pair<size_t, size_t>>{{0, 0}, {1, 1}, {4, 5}, {5, 5}}));
}

TEST(RegexTest, LongRunsStayLinear) {
  auto re = Regex::compile(kLlama3Pattern);
  ASSERT_TRUE(re.ok());
  for (const std::string& text : {std::string(200000, ' '), std::string(200000, '\n'),
                                  std::string(100000, 'a'), std::string(50000, '9')}) {
    std::vector<std::pair<size_t, size_t>> matches;
    ASSERT_TRUE((*re)->find_all(text, &matches).ok());
    size_t covered = 0;
    for (const auto& [b, e] : matches) covered += e - b;
    EXPECT_EQ(covered, text.size());
  }
}

TEST(RegexTest, BadPatternNamesPcre2) {
  auto re = Regex::compile("(unclosed");
  ASSERT_FALSE(re.ok());
  EXPECT_NE(re.status().message().find("PCRE2"), std::string::npos);
  EXPECT_NE(re.status().message().find("(unclosed"), std::string::npos);
}

TEST(ByteLevelTest, AlphabetIsABijection) {
  std::set<uint32_t> seen;
  for (int b = 0; b < 256; ++b) {
    const uint32_t cp = byte_to_char()[size_t(b)];
    EXPECT_TRUE(seen.insert(cp).second);
    EXPECT_EQ(char_to_byte(cp), b);
  }
  EXPECT_EQ(byte_to_char()[' '], 0x120u);   // "Ġ"
  EXPECT_EQ(byte_to_char()['\n'], 0x10Au);  // "Ċ"
  EXPECT_EQ(byte_to_char()['a'], uint32_t('a'));
  EXPECT_EQ(char_to_byte(0x2581), -1);
}

}  // namespace
}  // namespace treeserve::detail
