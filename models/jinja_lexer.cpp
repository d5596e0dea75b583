// The Jinja lexer (models/detail/jinja.h): text and tags, with the whitespace rules of
// Jinja2's lexer as transformers configures it (trim_blocks, lstrip_blocks,
// keep_trailing_newline off):
//  - "{%-", "{{-", "{#-" strip all whitespace before the tag; "-%}", "-}}", "-#}" all after;
//  - trim_blocks: the first newline after "%}" or "#}" is dropped ("+%}" keeps it);
//  - lstrip_blocks: spaces and tabs between the start of a line and "{%" or "{#" are dropped
//    ("{%+" keeps them); not before "{{";
//  - newlines are normalized to "\n" and one trailing newline is dropped.
#include <cerrno>
#include <cstring>

#include "models/detail/jinja.h"
#include "models/detail/unicode.h"

namespace treeserve::jinja {
namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string rstrip(const std::string& s) {
  size_t end = s.size();
  while (end > 0 && is_space(s[end - 1])) --end;
  return s.substr(0, end);
}

// "\r\n" and "\r" become "\n"; one trailing newline goes (Jinja's keep_trailing_newline off).
std::string normalize_newlines(const std::string& source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// A string literal's value: Python's unicode-escape decoding, as Jinja applies it. An
// unknown escape ("\d") stays as written.
std::string decode_string(const std::string& raw, int line) {
  std::string out;
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] != '\\' || i + 1 == raw.size()) {
      out += raw[i];
      continue;
    }
    const char c = raw[++i];
    switch (c) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'v':
        out += '\v';
        break;
      case 'a':
        out += '\a';
        break;
      case '\\':
      case '\'':
      case '"':
        out += c;
        break;
      case '\n':  // a backslash-newline continues the line
        break;
      case 'x':
      case 'u':
      case 'U': {
        const size_t digits = c == 'x' ? 2 : c == 'u' ? 4 : 8;
        uint32_t cp = 0;
        for (size_t k = 0; k < digits; ++k) {
          const int h = i + 1 + k < raw.size() ? hex_value(raw[i + 1 + k]) : -1;
          if (h < 0)
            throw TemplateError("line " + std::to_string(line) + ": bad \\" + c + " escape");
          cp = cp * 16 + uint32_t(h);
        }
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
          throw TemplateError("line " + std::to_string(line) + ": escape is not a character");
        }
        detail::append_utf8(cp, &out);
        i += digits;
        break;
      }
      default:
        if (c >= '0' && c <= '7') {  // octal, up to three digits
          uint32_t cp = uint32_t(c - '0');
          for (int k = 0; k < 2 && i + 1 < raw.size() && raw[i + 1] >= '0' && raw[i + 1] <= '7';
               ++k) {
            cp = cp * 8 + uint32_t(raw[++i] - '0');
          }
          detail::append_utf8(cp, &out);
        } else {
          out += '\\';
          out += c;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(const std::string& source) : src_(normalize_newlines(source)) {}

  std::vector<Token> run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      const size_t tag = find_tag(pos_);
      std::string text = src_.substr(pos_, tag - pos_);
      if (tag == src_.size()) {
        emit_text(std::move(text));
        pos_ = tag;
        break;
      }
      const char type = src_[tag + 1];  // '{', '%' or '#'
      const char sign = tag + 2 < src_.size() ? src_[tag + 2] : '\0';
      if (sign == '-') {
        text = rstrip(text);
      } else if (sign != '+' && type != '{') {
        // lstrip_blocks: only whitespace between the line's start and the tag.
        const size_t line_start = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if (line_start > 0 || line_starting) {
          bool blank = line_start < text.size();
          for (size_t i = line_start; i < text.size(); ++i) blank = blank && is_space(text[i]);
          if (blank) text.resize(line_start);
        }
      }
      line_ += count_newlines(pos_, tag);
      emit_text(std::move(text));
      pos_ = tag + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (type == '#') {
        line_starting = comment();
      } else {
        line_starting = tag_tokens(type == '{');
      }
    }
    tokens_.push_back(Token{Token::Kind::kEnd, "", line_});
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw TemplateError("line " + std::to_string(line_) + ": " + what);
  }

  size_t find_tag(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return src_.size();
  }

  int count_newlines(size_t from, size_t to) const {
    int n = 0;
    for (size_t i = from; i < to; ++i) n += src_[i] == '\n';
    return n;
  }

  void emit_text(std::string text) {
    if (!text.empty()) tokens_.push_back(Token{Token::Kind::kText, std::move(text), line_});
  }

  // After a tag's end: "-" strips all whitespace, a block or comment end (not "+") drops one
  // newline. Returns whether the consumed end finished a line (lstrip_blocks' line start).
  bool after_end(bool strip, bool trim_newline) {
    bool newline = false;
    if (strip) {
      while (pos_ < src_.size() && is_space(src_[pos_])) {
        newline = src_[pos_] == '\n';
        line_ += src_[pos_] == '\n';
        ++pos_;
      }
    } else if (trim_newline && pos_ < src_.size() && src_[pos_] == '\n') {
      newline = true;
      ++line_;
      ++pos_;
    }
    return newline;
  }

  bool comment() {
    const size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) fail("unterminated comment");
    line_ += count_newlines(pos_, end);
    const bool strip = end > pos_ && src_[end - 1] == '-';
    const bool keep = end > pos_ && src_[end - 1] == '+';
    pos_ = end + 2;
    return after_end(strip, !keep);
  }

  // The tokens of one {{ }} or {% %} tag, its begin and end included.
  bool tag_tokens(bool variable) {
    const int begin_line = line_;
    tokens_.push_back(
        Token{variable ? Token::Kind::kVarBegin : Token::Kind::kBlockBegin, "", line_});
    const char close = variable ? '}' : '%';
    while (true) {
      while (pos_ < src_.size() && is_space(src_[pos_])) {
        line_ += src_[pos_] == '\n';
        ++pos_;
      }
      if (pos_ >= src_.size()) {
        line_ = begin_line;
        fail(variable ? "unterminated '{{'" : "unterminated '{%'");
      }
      // The end: "}}" / "%}", with "-" (strip after) or, for blocks, "+" (keep the newline).
      const char c = src_[pos_];
      // Inside brackets an end is an operator ("{{ {'a': 1}}}"), as Jinja's balancing stack has it.
      const bool signed_end = depth_ == 0 && (c == '-' || (c == '+' && !variable)) &&
                              pos_ + 2 < src_.size() && src_[pos_ + 1] == close &&
                              src_[pos_ + 2] == '}';
      const bool plain_end =
          depth_ == 0 && c == close && pos_ + 1 < src_.size() && src_[pos_ + 1] == '}';
      if (signed_end || plain_end) {
        pos_ += signed_end ? 3 : 2;
        tokens_.push_back(
            Token{variable ? Token::Kind::kVarEnd : Token::Kind::kBlockEnd, "", line_});
        return after_end(signed_end && c == '-', !variable && !(signed_end && c == '+'));
      }
      next_token();
    }
  }

  void next_token() {
    const char c = src_[pos_];
    if (is_name_start(c) || (static_cast<unsigned char>(c) >= 0x80)) {
      const size_t start = pos_;
      while (pos_ < src_.size() && (is_name_start(src_[pos_]) || is_digit(src_[pos_]) ||
                                    static_cast<unsigned char>(src_[pos_]) >= 0x80)) {
        ++pos_;
      }
      tokens_.push_back(Token{Token::Kind::kName, src_.substr(start, pos_ - start), line_});
      return;
    }
    if (is_digit(c)) {
      number();
      return;
    }
    if (c == '\'' || c == '"') {
      string_literal(c);
      return;
    }
    static const char* kOperators[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                       "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                       ">",  "<",  "=",  ".",  ":",  "|",  ",", ";"};
    for (const char* op : kOperators) {
      const size_t n = std::strlen(op);
      if (src_.compare(pos_, n, op) == 0) {
        tokens_.push_back(Token{Token::Kind::kOperator, op, line_});
        pos_ += n;
        if (n == 1 && std::strchr("([{", op[0]) != nullptr) ++depth_;
        if (n == 1 && std::strchr(")]}", op[0]) != nullptr) {
          if (depth_ == 0) fail(std::string("unexpected '") + op + "'");
          --depth_;
        }
        return;
      }
    }
    fail(std::string("unexpected character '") + c + "'");
  }

  void number() {
    const size_t start = pos_;
    auto digits = [&] {
      while (pos_ < src_.size() && (is_digit(src_[pos_]) || src_[pos_] == '_')) ++pos_;
    };
    digits();
    bool is_float = false;
    // A fraction needs a digit after the point ("1.0"); "x.0" after a name is an attribute,
    // which the caller never lexes as a number since the name comes first.
    if (pos_ + 1 < src_.size() && src_[pos_] == '.' && is_digit(src_[pos_ + 1])) {
      is_float = true;
      ++pos_;
      digits();
    }
    if (pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
      size_t p = pos_ + 1;
      if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
      if (p < src_.size() && is_digit(src_[p])) {
        is_float = true;
        pos_ = p;
        digits();
      }
    }
    std::string text;
    for (size_t i = start; i < pos_; ++i) {
      if (src_[i] != '_') text += src_[i];
    }
    Token t{is_float ? Token::Kind::kFloat : Token::Kind::kInteger, text, line_};
    if (is_float) {
      t.number = std::strtod(text.c_str(), nullptr);
    } else {
      errno = 0;
      t.integer = std::strtoll(text.c_str(), nullptr, 10);
      if (errno == ERANGE) fail("integer " + text + " is out of range");
    }
    tokens_.push_back(std::move(t));
  }

  void string_literal(char quote) {
    const int start_line = line_;
    size_t i = pos_ + 1;
    std::string raw;
    while (i < src_.size() && src_[i] != quote) {
      if (src_[i] == '\\' && i + 1 < src_.size()) raw += src_[i++];
      line_ += src_[i] == '\n';
      raw += src_[i++];
    }
    if (i >= src_.size()) {
      line_ = start_line;
      fail("unterminated string");
    }
    pos_ = i + 1;
    tokens_.push_back(Token{Token::Kind::kString, decode_string(raw, start_line), start_line});
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  int depth_ = 0;  // open brackets in the current tag
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(const std::string& source) { return Lexer(source).run(); }

}  // namespace treeserve::jinja
