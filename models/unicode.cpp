// UTF-8, character classes (utf8proc), normalization (utf8proc) and PCRE2 regexes for the
// tokenizer.json tokenizer.
#include "models/detail/unicode.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <cstdlib>

namespace treeserve::detail {

// ---- UTF-8 ---------------------------------------------------------------------------

uint32_t next_char(std::string_view text, size_t* pos) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  size_t i = *pos;
  const uint32_t b = s[i];
  if (b < 0x80) {
    *pos = i + 1;
    return b;
  }
  if (b < 0xE0) {
    *pos = i + 2;
    return ((b & 0x1F) << 6) | (s[i + 1] & 0x3F);
  }
  if (b < 0xF0) {
    *pos = i + 3;
    return ((b & 0x0F) << 12) | ((s[i + 1] & 0x3F) << 6) | (s[i + 2] & 0x3F);
  }
  *pos = i + 4;
  return ((b & 0x07) << 18) | ((s[i + 1] & 0x3F) << 12) | ((s[i + 2] & 0x3F) << 6) |
         (s[i + 3] & 0x3F);
}

uint32_t last_char(std::string_view text, size_t* length) {
  size_t begin = text.size() - 1;
  while (begin > 0 && (static_cast<unsigned char>(text[begin]) & 0xC0) == 0x80) --begin;
  *length = text.size() - begin;
  size_t pos = begin;
  return next_char(text, &pos);
}

void append_utf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {

// Unicode table 3-7: the length of the sequence `lead` starts (0: not a lead byte) and the
// range its second byte must fall in; later bytes are always 0x80-0xBF.
struct LeadInfo {
  int length;
  unsigned char second_lo, second_hi;
};

LeadInfo lead_info(unsigned char b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// How many bytes from text[i] form a valid prefix of the sequence text[i] leads (1 for an
// ASCII byte; 0 for a byte that cannot lead), and whether that prefix is the whole sequence.
size_t valid_prefix(const unsigned char* s, size_t n, size_t i, bool* complete) {
  const LeadInfo lead = lead_info(s[i]);
  *complete = false;
  if (lead.length == 0) return 0;
  size_t k = 1;
  for (; k < size_t(lead.length) && i + k < n; ++k) {
    const unsigned char c = s[i + k];
    const unsigned char lo = k == 1 ? lead.second_lo : 0x80, hi = k == 1 ? lead.second_hi : 0xBF;
    if (c < lo || c > hi) return k;
  }
  *complete = k == size_t(lead.length);
  return k;
}

}  // namespace

size_t first_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    if (s[i] < 0x80) {
      ++i;
      continue;
    }
    bool complete = false;
    const size_t k = valid_prefix(s, n, i, &complete);
    if (!complete) return i;
    i += k;
  }
  return n;
}

std::string utf8_lossy(std::string_view bytes) {
  const size_t bad = first_invalid_utf8(bytes);
  if (bad == bytes.size()) return std::string(bytes);
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  std::string out(bytes.substr(0, bad));
  size_t i = bad;
  while (i < n) {
    bool complete = false;
    const size_t k = valid_prefix(s, n, i, &complete);
    if (complete) {
      out.append(bytes.substr(i, k));
    } else {
      out += "\xEF\xBF\xBD";  // one U+FFFD per maximal ill-formed subsequence
    }
    i += k == 0 ? 1 : k;
  }
  return out;
}

size_t incomplete_utf8_suffix(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const size_t i = n - back;
    if ((s[i] & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    bool complete = false;
    const size_t k = valid_prefix(s, n, i, &complete);
    return k == back && !complete ? back : 0;
  }
  return 0;
}

// ---- character classes -----------------------------------------------------------------

bool is_white_space(uint32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool is_numeric(uint32_t cp) {
  const utf8proc_category_t c = utf8proc_category(utf8proc_int32_t(cp));
  return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

bool is_alphanumeric(uint32_t cp) {
  const utf8proc_category_t c = utf8proc_category(utf8proc_int32_t(cp));
  return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) || is_numeric(cp);
}

// ---- normalization --------------------------------------------------------------------

StatusOr<std::string> normalize_unicode(std::string_view text, NormalForm form) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNfd:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNfkc:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNfkd:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   utf8proc_ssize_t(text.size()), &out, utf8proc_option_t(options));
  if (n < 0) {
    return InvalidArgument(std::string("unicode normalization failed: ") + utf8proc_errmsg(n));
  }
  std::string result(reinterpret_cast<const char*>(out), size_t(n));
  std::free(out);
  return result;
}

// ---- regular expressions --------------------------------------------------------------

namespace {

// \s -> \p{White_Space}, \S -> \P{White_Space}, inside and outside classes; every other
// escape is copied as it is.
std::string rewrite_white_space(std::string_view pattern) {
  std::string out;
  out.reserve(pattern.size() + 32);
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      if (e == 's') {
        out += "\\p{White_Space}";
      } else if (e == 'S') {
        out += "\\P{White_Space}";
      } else {
        out += pattern.substr(i, 2);
      }
      ++i;
      continue;
    }
    out.push_back(pattern[i]);
  }
  return out;
}

// Per thread: match data (one pair: only whole-match offsets are read; a pattern with groups
// then gets rc 0, "ovector too small", which still sets them) and a JIT stack that grows to
// 8 MiB, so long runs of one character class do not exhaust the default 32 KiB.
struct ThreadMatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadMatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (context != nullptr && stack != nullptr) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

ThreadMatchState& thread_match_state() {
  thread_local ThreadMatchState state;
  return state;
}

}  // namespace

StatusOr<std::unique_ptr<Regex>> Regex::compile(std::string_view pattern) {
  const std::string rewritten = rewrite_white_space(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return InvalidArgument("regex /" + std::string(pattern) +
                           "/ does not compile (PCRE2: " + reinterpret_cast<const char*>(message) +
                           " at offset " + std::to_string(offset) + ")");
  }
  std::unique_ptr<Regex> regex(new Regex);
  regex->code_ = code;
  regex->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return regex;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

Status Regex::find_all(std::string_view text,
                       std::vector<std::pair<size_t, size_t>>* matches) const {
  auto* code = static_cast<pcre2_code*>(code_);
  ThreadMatchState& state = thread_match_state();
  pcre2_match_data* data = state.data;
  if (data == nullptr) return Internal("regex: out of memory");
  pcre2_match_context* context = jit_ ? state.context : nullptr;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  Status status;
  while (start <= text.size()) {
    // The text was validated once by the caller: no per-call UTF check (it would scan the
    // whole subject on every call and make this loop quadratic).
    const int rc =
        pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, data, context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      status = Internal(std::string("regex match failed (PCRE2: ") +
                        reinterpret_cast<const char*>(message) + ")");
      break;
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
    const size_t begin = ovector[0], end = ovector[1];
    matches->emplace_back(begin, end);
    if (end > begin) {
      start = end;
    } else if (end < text.size()) {
      size_t next = end;
      next_char(text, &next);
      start = next;
    } else {
      break;
    }
  }
  return status;
}

// ---- byte-level (GPT-2) alphabet -------------------------------------------------------

const std::array<uint32_t, 256>& byte_to_char() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

int char_to_byte(uint32_t cp) {
  static const std::array<int, 324> inverse = [] {
    std::array<int, 324> inv;
    inv.fill(-1);
    for (int b = 0; b < 256; ++b) inv[byte_to_char()[size_t(b)]] = b;
    return inv;
  }();
  return cp < inverse.size() ? inverse[cp] : -1;
}

}  // namespace treeserve::detail
