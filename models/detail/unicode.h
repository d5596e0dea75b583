// Text primitives of the tokenizer.json tokenizer: UTF-8 decoding and validation, the
// Unicode character classes its components test, normalization forms (utf8proc), regular
// expressions (PCRE2 in UTF + UCP mode, JIT-compiled where the platform has it) and GPT-2's
// byte-to-character table.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace treeserve::detail {

// ---- UTF-8 ---------------------------------------------------------------------------

// Decodes the character at text[*pos] and advances *pos past it. text must be valid UTF-8.
uint32_t next_char(std::string_view text, size_t* pos);
// The code point of the last character of text (valid UTF-8, not empty) and its length.
uint32_t last_char(std::string_view text, size_t* length);
void append_utf8(uint32_t cp, std::string* out);

// Offset of the first byte that is not part of a well-formed UTF-8 sequence (Unicode table
// 3-7), or text.size() when text is valid.
size_t first_invalid_utf8(std::string_view text);

// text with each maximal ill-formed subsequence replaced by U+FFFD: what Rust's
// String::from_utf8_lossy and the WHATWG decoder (TextDecoder) produce.
std::string utf8_lossy(std::string_view bytes);

// Length (0-3) of the proper prefix of a well-formed UTF-8 sequence that text ends with:
// bytes that the next bytes may still complete into a character.
size_t incomplete_utf8_suffix(std::string_view text);

// ---- character classes -----------------------------------------------------------------

bool is_white_space(uint32_t cp);   // the Unicode White_Space property (Rust char::is_whitespace)
bool is_numeric(uint32_t cp);       // general category Nd, Nl or No (Rust char::is_numeric)
bool is_alphanumeric(uint32_t cp);  // L* or Nd/Nl/No (Rust char::is_alphanumeric)

// ---- normalization --------------------------------------------------------------------

enum class NormalForm { kNfc, kNfd, kNfkc, kNfkd };
// text must be valid UTF-8.
StatusOr<std::string> normalize_unicode(std::string_view text, NormalForm form);

// ---- regular expressions --------------------------------------------------------------

// A compiled pattern in Oniguruma's dialect as tokenizer.json writes it (Unicode classes,
// inline flags, lookahead, possessive quantifiers), matched by PCRE2. PCRE2's \s also
// matches U+180E, which Unicode's White_Space (Oniguruma's \s) does not: \s and \S are
// rewritten to \p{White_Space} and \P{White_Space} before compiling. Immutable after
// compile; find_all may be called from several threads at once.
class Regex {
 public:
  // INVALID_ARGUMENT with PCRE2's message and the offset when the pattern does not compile.
  static StatusOr<std::unique_ptr<Regex>> compile(std::string_view pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Non-overlapping matches, left to right, as [begin, end) byte offsets into text (valid
  // UTF-8); after an empty match the search resumes one character later. INTERNAL when PCRE2
  // gives up (match or JIT stack limits).
  Status find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>* matches) const;

  bool jit() const { return jit_; }

 private:
  Regex() = default;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

// ---- byte-level (GPT-2) alphabet -------------------------------------------------------

// Byte b is written as the character byte_to_char()[b] (a printable code point: bytes
// 0x21-0x7E, 0xA1-0xAC and 0xAE-0xFF map to themselves, the others to U+0100 onwards).
const std::array<uint32_t, 256>& byte_to_char();
// The byte a character stands for; -1 for characters outside the alphabet.
int char_to_byte(uint32_t cp);

}  // namespace treeserve::detail
