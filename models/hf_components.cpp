// Normalizers, pre-tokenizers and decoders of tokenizer.json, after Hugging Face tokenizers
// (the Rust crate): the split behaviours, Metaspace's prepend schemes, ByteFallback's one
// U+FFFD per byte of an invalid run and the Metaspace decoder's first-token rule follow it.
#include "models/detail/hf_components.h"

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>

#include "models/detail/unicode.h"

namespace treeserve::detail {

const char* const kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

namespace {

using nlohmann::json;
using Ranges = std::vector<std::pair<size_t, size_t>>;

Status unsupported(const std::string& where, const std::string& type, const char* supported) {
  return InvalidArgument(where + ": type '" + type + "' is not supported (supported: " + supported +
                         ")");
}

// Reads an optional field of the expected JSON type; absent or null keeps *out.
template <typename T>
Status read(const json& object, const char* field, const std::string& where, T* out) {
  auto it = object.find(field);
  if (it == object.end() || it->is_null()) return Status::Ok();
  try {
    *out = it->get<T>();
  } catch (const json::exception&) {
    return InvalidArgument(where + "." + field + ": unexpected value " + it->dump());
  }
  return Status::Ok();
}

// A {"String": s} or {"Regex": r} pattern.
class Pattern {
 public:
  static StatusOr<Pattern> make(const json& config, const std::string& where) {
    Pattern p;
    if (!config.is_object())
      return InvalidArgument(where + ": expected {\"String\"|\"Regex\": ...}");
    if (config.contains("String") && config.at("String").is_string()) {
      p.literal_ = config.at("String").get<std::string>();
      if (p.literal_.empty()) return InvalidArgument(where + ".String: must not be empty");
      return p;
    }
    if (config.contains("Regex") && config.at("Regex").is_string()) {
      auto regex = Regex::compile(config.at("Regex").get<std::string>());
      if (!regex.ok()) return InvalidArgument(where + ".Regex: " + regex.status().message());
      p.regex_ = std::shared_ptr<Regex>(std::move(*regex));
      return p;
    }
    return InvalidArgument(where + ": expected {\"String\"|\"Regex\": ...}, got " + config.dump());
  }

  Status find_all(std::string_view text, Ranges* out) const {
    out->clear();
    if (regex_) return regex_->find_all(text, out);
    for (size_t at = text.find(literal_); at != std::string_view::npos;
         at = text.find(literal_, at + literal_.size())) {
      out->emplace_back(at, at + literal_.size());
    }
    return Status::Ok();
  }

 private:
  std::string literal_;
  std::shared_ptr<Regex> regex_;
};

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

StatusOr<Behavior> parse_behavior(const json& config, const std::string& where) {
  std::string name = "Isolated";
  TS_RETURN_IF_ERROR(read(config, "behavior", where, &name));
  if (name == "Removed") return Behavior::kRemoved;
  if (name == "Isolated") return Behavior::kIsolated;
  if (name == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::kMergedWithNext;
  if (name == "Contiguous") return Behavior::kContiguous;
  return InvalidArgument(where + ".behavior: '" + name + "' is not a split behaviour");
}

// Hugging Face's NormalizedString::split: the matches and the text between them as
// alternating segments, flipped when inverted, then combined as `behavior` says.
std::vector<std::pair<size_t, size_t>> split_segments(size_t length, const Ranges& matches,
                                                      bool invert, Behavior behavior) {
  struct Segment {
    size_t begin, end;
    bool match;
  };
  std::vector<Segment> segs;
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (b > prev) segs.push_back({prev, b, invert});
    segs.push_back({b, e, !invert});
    prev = e;
  }
  if (prev < length) segs.push_back({prev, length, invert});

  std::vector<std::pair<size_t, size_t>> out;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::kRemoved:
      for (const Segment& s : segs) {
        if (!s.match) out.emplace_back(s.begin, s.end);
      }
      break;
    case Behavior::kIsolated:
      for (const Segment& s : segs) out.emplace_back(s.begin, s.end);
      break;
    case Behavior::kMergedWithPrevious:
      for (const Segment& s : segs) {
        if (s.match && !previous_match && !out.empty()) {
          out.back().second = s.end;
        } else {
          out.emplace_back(s.begin, s.end);
        }
        previous_match = s.match;
      }
      break;
    case Behavior::kMergedWithNext:
      for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
        if (it->match && !previous_match && !out.empty()) {
          out.back().first = it->begin;
        } else {
          out.emplace_back(it->begin, it->end);
        }
        previous_match = it->match;
      }
      std::reverse(out.begin(), out.end());
      break;
    case Behavior::kContiguous:
      for (size_t i = 0; i < segs.size(); ++i) {
        if (i > 0 && segs[i].match == previous_match) {
          out.back().second = segs[i].end;
        } else {
          out.emplace_back(segs[i].begin, segs[i].end);
        }
        previous_match = segs[i].match;
      }
      break;
  }
  return out;
}

// Replaces every piece by its segments (empty ones dropped); only a segment at offset 0 of a
// piece at the start of the text keeps at_start.
Status split_pieces(std::vector<Piece>* pieces, bool invert, Behavior behavior,
                    const std::function<Status(std::string_view, Ranges*)>& find) {
  // Per-thread scratch: encoding splits every text, and the vectors keep their capacity.
  thread_local std::vector<Piece> out;
  thread_local Ranges matches;
  out.clear();
  for (Piece& piece : *pieces) {
    TS_RETURN_IF_ERROR(find(piece.text, &matches));
    for (const auto& [b, e] : split_segments(piece.text.size(), matches, invert, behavior)) {
      if (e > b) out.push_back(Piece{piece.text.substr(b, e - b), piece.at_start && b == 0});
    }
  }
  std::swap(*pieces, out);
  return Status::Ok();
}

std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  size_t prev = 0;
  for (size_t at = text.find(from); at != std::string_view::npos; at = text.find(from, prev)) {
    out.append(text.substr(prev, at - prev));
    out.append(to);
    prev = at + from.size();
  }
  out.append(text.substr(prev));
  return out;
}

// ---- normalizers ------------------------------------------------------------------------

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm form) : form_(form) {}
  Status apply(std::string* text) const override {
    auto normalized = normalize_unicode(*text, form_);
    if (!normalized.ok()) return normalized.status();
    *text = std::move(*normalized);
    return Status::Ok();
  }

 private:
  NormalForm form_;
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  Status apply(std::string* text) const override {
    Ranges matches;
    TS_RETURN_IF_ERROR(pattern_.find_all(*text, &matches));
    if (matches.empty()) return Status::Ok();
    std::string out;
    size_t prev = 0;
    for (const auto& [b, e] : matches) {
      out.append(*text, prev, b - prev);
      out += content_;
      prev = e;
    }
    out.append(*text, prev);
    *text = std::move(out);
    return Status::Ok();
  }

 private:
  Pattern pattern_;
  std::string content_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  Status apply(std::string* text) const override {
    if (!text->empty()) text->insert(0, prefix_);
    return Status::Ok();
  }

 private:
  std::string prefix_;
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  Status apply(std::string* text) const override {
    size_t begin = 0, end = text->size();
    while (left_ && begin < end) {
      size_t next = begin;
      if (!is_white_space(next_char(*text, &next))) break;
      begin = next;
    }
    while (right_ && end > begin) {
      size_t length = 0;
      if (!is_white_space(last_char(std::string_view(*text).substr(begin, end - begin), &length))) {
        break;
      }
      end -= length;
    }
    *text = text->substr(begin, end - begin);
    return Status::Ok();
  }

 private:
  bool left_, right_;
};

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps)
      : steps_(std::move(steps)) {}
  Status apply(std::string* text) const override {
    for (const auto& step : steps_) TS_RETURN_IF_ERROR(step->apply(text));
    return Status::Ok();
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

// ---- pre-tokenizers ---------------------------------------------------------------------

class SplitPreTokenizer : public PreTokenizer {
 public:
  SplitPreTokenizer(Pattern pattern, Behavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  Status apply(std::vector<Piece>* pieces) const override {
    return split_pieces(pieces, invert_, behavior_, [this](std::string_view text, Ranges* out) {
      return pattern_.find_all(text, out);
    });
  }

 private:
  Pattern pattern_;
  Behavior behavior_;
  bool invert_;
};

// Only the splitting half of ByteLevel: words stay raw bytes (see BpeOptions::byte_level).
class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::unique_ptr<Regex> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}
  Status apply(std::vector<Piece>* pieces) const override {
    if (add_prefix_space_) {
      for (Piece& p : *pieces) {
        if (p.text.empty() || p.text[0] != ' ') p.text = " " + p.text;
      }
    }
    if (!regex_) return Status::Ok();
    return split_pieces(pieces, false, Behavior::kIsolated,
                        [this](std::string_view text, Ranges* out) {
                          out->clear();
                          return regex_->find_all(text, out);
                        });
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Regex> regex_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

StatusOr<PrependScheme> parse_prepend_scheme(const json& config, const std::string& where) {
  // Older files carry add_prefix_space instead of prepend_scheme.
  bool add_prefix_space = true;
  TS_RETURN_IF_ERROR(read(config, "add_prefix_space", where, &add_prefix_space));
  std::string scheme = add_prefix_space ? "always" : "never";
  TS_RETURN_IF_ERROR(read(config, "prepend_scheme", where, &scheme));
  if (scheme == "always") return PrependScheme::kAlways;
  if (scheme == "first") return PrependScheme::kFirst;
  if (scheme == "never") return PrependScheme::kNever;
  return InvalidArgument(where + ".prepend_scheme: '" + scheme + "' is not always/first/never");
}

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  Status apply(std::vector<Piece>* pieces) const override {
    for (Piece& p : *pieces) {
      p.text = replace_all(p.text, " ", replacement_);
      const bool starts = p.text.compare(0, replacement_.size(), replacement_) == 0;
      if (!starts &&
          (scheme_ == PrependScheme::kAlways || (scheme_ == PrependScheme::kFirst && p.at_start))) {
        p.text.insert(0, replacement_);
      }
    }
    if (!split_) return Status::Ok();
    return split_pieces(pieces, false, Behavior::kMergedWithNext,
                        [this](std::string_view text, Ranges* out) {
                          out->clear();
                          for (size_t at = text.find(replacement_); at != std::string_view::npos;
                               at = text.find(replacement_, at + replacement_.size())) {
                            out->emplace_back(at, at + replacement_.size());
                          }
                          return Status::Ok();
                        });
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

class DigitsPreTokenizer : public PreTokenizer {
 public:
  explicit DigitsPreTokenizer(bool individual) : individual_(individual) {}
  Status apply(std::vector<Piece>* pieces) const override {
    // Every numeric character is a match of its own; Contiguous then joins runs.
    return split_pieces(pieces, false, individual_ ? Behavior::kIsolated : Behavior::kContiguous,
                        [](std::string_view text, Ranges* out) {
                          out->clear();
                          for (size_t pos = 0; pos < text.size();) {
                            const size_t begin = pos;
                            if (is_numeric(next_char(text, &pos))) out->emplace_back(begin, pos);
                          }
                          return Status::Ok();
                        });
  }

 private:
  bool individual_;
};

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps)
      : steps_(std::move(steps)) {}
  Status apply(std::vector<Piece>* pieces) const override {
    for (const auto& step : steps_) TS_RETURN_IF_ERROR(step->apply(pieces));
    return Status::Ok();
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

// ---- decoders ---------------------------------------------------------------------------

class ByteLevelDecoder : public Decoder {
 public:
  void apply(std::vector<std::string>* tokens) const override {
    std::string bytes;
    for (const std::string& token : *tokens) {
      const size_t mark = bytes.size();
      bool mapped = true;
      for (size_t pos = 0; pos < token.size() && mapped;) {
        const int b = char_to_byte(next_char(token, &pos));
        if (b < 0) {
          mapped = false;
        } else {
          bytes.push_back(char(b));
        }
      }
      if (!mapped) bytes.replace(mark, std::string::npos, token);  // taken as it is
    }
    *tokens = {utf8_lossy(bytes)};
  }
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, PrependScheme scheme)
      : replacement_(std::move(replacement)), scheme_(scheme) {}
  void apply(std::vector<std::string>* tokens) const override {
    for (size_t i = 0; i < tokens->size(); ++i) {
      // The first token loses every replacement character, the others turn them into spaces.
      const bool drop = i == 0 && scheme_ != PrependScheme::kNever;
      (*tokens)[i] = replace_all((*tokens)[i], replacement_, drop ? "" : " ");
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(Pattern pattern, std::string content)
      : normalizer_(std::move(pattern), std::move(content)) {}
  void apply(std::vector<std::string>* tokens) const override {
    for (std::string& token : *tokens) (void)normalizer_.apply(&token);
  }

 private:
  ReplaceNormalizer normalizer_;
};

int byte_piece(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return -1;
  int value = 0;
  for (int i = 3; i < 5; ++i) {
    const char c = token[size_t(i)];
    const int digit = c >= '0' && c <= '9'   ? c - '0'
                      : c >= 'A' && c <= 'F' ? c - 'A' + 10
                      : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                             : -1;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

class ByteFallbackDecoder : public Decoder {
 public:
  void apply(std::vector<std::string>* tokens) const override {
    std::vector<std::string> out;
    std::string run;
    size_t run_tokens = 0;
    auto flush = [&] {
      if (run_tokens == 0) return;
      if (first_invalid_utf8(run) == run.size()) {
        out.push_back(run);
      } else {
        for (size_t i = 0; i < run_tokens; ++i) out.push_back("\xEF\xBF\xBD");
      }
      run.clear();
      run_tokens = 0;
    };
    for (std::string& token : *tokens) {
      const int b = byte_piece(token);
      if (b >= 0) {
        run.push_back(char(b));
        ++run_tokens;
        continue;
      }
      flush();
      out.push_back(std::move(token));
    }
    flush();
    *tokens = std::move(out);
  }
};

class FuseDecoder : public Decoder {
 public:
  void apply(std::vector<std::string>* tokens) const override {
    std::string all;
    for (const std::string& t : *tokens) all += t;
    *tokens = {std::move(all)};
  }
};

class StripDecoder : public Decoder {
 public:
  StripDecoder(uint32_t content, size_t start, size_t stop)
      : content_(content), start_(start), stop_(stop) {}
  void apply(std::vector<std::string>* tokens) const override {
    for (std::string& token : *tokens) {
      size_t begin = 0, end = token.size();
      for (size_t i = 0; i < start_ && begin < end; ++i) {
        size_t next = begin;
        if (next_char(token, &next) != content_) break;
        begin = next;
      }
      for (size_t i = 0; i < stop_ && end > begin; ++i) {
        size_t length = 0;
        if (last_char(std::string_view(token).substr(begin, end - begin), &length) != content_) {
          break;
        }
        end -= length;
      }
      token = token.substr(begin, end - begin);
    }
  }

 private:
  uint32_t content_;
  size_t start_, stop_;
};

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps)
      : steps_(std::move(steps)) {}
  void apply(std::vector<std::string>* tokens) const override {
    for (const auto& step : steps_) step->apply(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

StatusOr<std::string> type_of(const json& config, const std::string& where) {
  if (!config.is_object() || !config.contains("type") || !config.at("type").is_string()) {
    return InvalidArgument(where + ": expected an object with a string 'type'");
  }
  return config.at("type").get<std::string>();
}

StatusOr<const json*> list_field(const json& config, const char* field, const std::string& where) {
  auto it = config.find(field);
  if (it == config.end() || !it->is_array()) {
    return InvalidArgument(where + "." + field + ": expected a list");
  }
  return &*it;
}

}  // namespace

StatusOr<std::unique_ptr<Normalizer>> make_normalizer(const json& config,
                                                      const std::string& where) {
  if (config.is_null()) return std::unique_ptr<Normalizer>();
  auto type = type_of(config, where);
  if (!type.ok()) return type.status();
  if (*type == "NFC") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfc));
  if (*type == "NFD") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfd));
  if (*type == "NFKC") {
    return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfkc));
  }
  if (*type == "NFKD") {
    return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfkd));
  }
  if (*type == "Replace") {
    auto pattern = Pattern::make(config.value("pattern", json()), where + ".pattern");
    if (!pattern.ok()) return pattern.status();
    std::string content;
    TS_RETURN_IF_ERROR(read(config, "content", where, &content));
    return std::unique_ptr<Normalizer>(new ReplaceNormalizer(std::move(*pattern), content));
  }
  if (*type == "Prepend") {
    std::string prefix;
    TS_RETURN_IF_ERROR(read(config, "prepend", where, &prefix));
    return std::unique_ptr<Normalizer>(new PrependNormalizer(prefix));
  }
  if (*type == "Strip") {
    bool left = true, right = true;
    TS_RETURN_IF_ERROR(read(config, "strip_left", where, &left));
    TS_RETURN_IF_ERROR(read(config, "strip_right", where, &right));
    return std::unique_ptr<Normalizer>(new StripNormalizer(left, right));
  }
  if (*type == "Sequence") {
    auto list = list_field(config, "normalizers", where);
    if (!list.ok()) return list.status();
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (size_t i = 0; i < (*list)->size(); ++i) {
      auto step = make_normalizer((**list)[i], where + ".normalizers[" + std::to_string(i) + "]");
      if (!step.ok()) return step.status();
      if (*step) steps.push_back(std::move(*step));
    }
    return std::unique_ptr<Normalizer>(new SequenceNormalizer(std::move(steps)));
  }
  return unsupported(where, *type, "NFC, NFD, NFKC, NFKD, Replace, Prepend, Strip, Sequence");
}

StatusOr<std::unique_ptr<PreTokenizer>> make_pre_tokenizer(const json& config,
                                                           const std::string& where,
                                                           bool* byte_level) {
  *byte_level = false;
  if (config.is_null()) return std::unique_ptr<PreTokenizer>();
  auto type = type_of(config, where);
  if (!type.ok()) return type.status();
  if (*type == "Split") {
    auto pattern = Pattern::make(config.value("pattern", json()), where + ".pattern");
    if (!pattern.ok()) return pattern.status();
    auto behavior = parse_behavior(config, where);
    if (!behavior.ok()) return behavior.status();
    bool invert = false;
    TS_RETURN_IF_ERROR(read(config, "invert", where, &invert));
    return std::unique_ptr<PreTokenizer>(
        new SplitPreTokenizer(std::move(*pattern), *behavior, invert));
  }
  if (*type == "ByteLevel") {
    bool add_prefix_space = true, use_regex = true;
    TS_RETURN_IF_ERROR(read(config, "add_prefix_space", where, &add_prefix_space));
    TS_RETURN_IF_ERROR(read(config, "use_regex", where, &use_regex));
    std::unique_ptr<Regex> regex;
    if (use_regex) {
      auto compiled = Regex::compile(kGpt2SplitPattern);
      if (!compiled.ok()) return compiled.status();
      regex = std::move(*compiled);
    }
    *byte_level = true;
    return std::unique_ptr<PreTokenizer>(
        new ByteLevelPreTokenizer(add_prefix_space, std::move(regex)));
  }
  if (*type == "Metaspace") {
    std::string replacement = "\xE2\x96\x81";
    TS_RETURN_IF_ERROR(read(config, "replacement", where, &replacement));
    auto scheme = parse_prepend_scheme(config, where);
    if (!scheme.ok()) return scheme.status();
    bool split = true;
    TS_RETURN_IF_ERROR(read(config, "split", where, &split));
    if (replacement.empty()) return InvalidArgument(where + ".replacement: must not be empty");
    return std::unique_ptr<PreTokenizer>(new MetaspacePreTokenizer(replacement, *scheme, split));
  }
  if (*type == "Digits") {
    bool individual = false;
    TS_RETURN_IF_ERROR(read(config, "individual_digits", where, &individual));
    return std::unique_ptr<PreTokenizer>(new DigitsPreTokenizer(individual));
  }
  if (*type == "Sequence") {
    auto list = list_field(config, "pretokenizers", where);
    if (!list.ok()) return list.status();
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (size_t i = 0; i < (*list)->size(); ++i) {
      const std::string step_where = where + ".pretokenizers[" + std::to_string(i) + "]";
      if (*byte_level) {
        return InvalidArgument(step_where + ": a pre-tokenizer after ByteLevel is not supported");
      }
      bool step_byte_level = false;
      auto step = make_pre_tokenizer((**list)[i], step_where, &step_byte_level);
      if (!step.ok()) return step.status();
      *byte_level = step_byte_level;
      if (*step) steps.push_back(std::move(*step));
    }
    return std::unique_ptr<PreTokenizer>(new SequencePreTokenizer(std::move(steps)));
  }
  return unsupported(where, *type, "Split, ByteLevel, Metaspace, Digits, Sequence");
}

StatusOr<std::unique_ptr<Decoder>> make_decoder(const json& config, const std::string& where) {
  if (config.is_null()) return std::unique_ptr<Decoder>();
  auto type = type_of(config, where);
  if (!type.ok()) return type.status();
  if (*type == "ByteLevel") return std::unique_ptr<Decoder>(new ByteLevelDecoder);
  if (*type == "Metaspace") {
    std::string replacement = "\xE2\x96\x81";
    TS_RETURN_IF_ERROR(read(config, "replacement", where, &replacement));
    auto scheme = parse_prepend_scheme(config, where);
    if (!scheme.ok()) return scheme.status();
    if (replacement.empty()) return InvalidArgument(where + ".replacement: must not be empty");
    return std::unique_ptr<Decoder>(new MetaspaceDecoder(replacement, *scheme));
  }
  if (*type == "Replace") {
    auto pattern = Pattern::make(config.value("pattern", json()), where + ".pattern");
    if (!pattern.ok()) return pattern.status();
    std::string content;
    TS_RETURN_IF_ERROR(read(config, "content", where, &content));
    return std::unique_ptr<Decoder>(new ReplaceDecoder(std::move(*pattern), content));
  }
  if (*type == "ByteFallback") return std::unique_ptr<Decoder>(new ByteFallbackDecoder);
  if (*type == "Fuse") return std::unique_ptr<Decoder>(new FuseDecoder);
  if (*type == "Strip") {
    std::string content = " ";
    size_t start = 0, stop = 0;
    TS_RETURN_IF_ERROR(read(config, "content", where, &content));
    TS_RETURN_IF_ERROR(read(config, "start", where, &start));
    TS_RETURN_IF_ERROR(read(config, "stop", where, &stop));
    size_t pos = 0;
    if (content.empty() || first_invalid_utf8(content) != content.size() ||
        (next_char(content, &pos), pos != content.size())) {
      return InvalidArgument(where + ".content: must be one character");
    }
    pos = 0;
    return std::unique_ptr<Decoder>(new StripDecoder(next_char(content, &pos), start, stop));
  }
  if (*type == "Sequence") {
    auto list = list_field(config, "decoders", where);
    if (!list.ok()) return list.status();
    std::vector<std::unique_ptr<Decoder>> steps;
    for (size_t i = 0; i < (*list)->size(); ++i) {
      auto step = make_decoder((**list)[i], where + ".decoders[" + std::to_string(i) + "]");
      if (!step.ok()) return step.status();
      if (*step) steps.push_back(std::move(*step));
    }
    return std::unique_ptr<Decoder>(new SequenceDecoder(std::move(steps)));
  }
  return unsupported(where, *type,
                     "ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence");
}

bool is_byte_level_decoder(const json& config) {
  return config.is_object() && config.value("type", "") == "ByteLevel";
}

}  // namespace treeserve::detail
