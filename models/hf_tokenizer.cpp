// The tokenizer.json reader: a Hugging Face BPE tokenizer, run as the Rust crate runs it.
// Encoding: added tokens are cut out first (those with normalized=false from the raw text,
// leftmost-longest, honouring single_word / lstrip / rstrip), the text between them is
// normalized, cut again at the normalized added tokens, pre-tokenized into words, and every
// word goes through the BPE model. Decoding maps ids to their pieces and runs the decoder
// chain; a plain ByteLevel decoder is a per-id byte table instead.
#include <array>
#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "models/detail/bpe.h"
#include "models/detail/hf_components.h"
#include "models/detail/tokenizer_backend.h"
#include "models/detail/unicode.h"

namespace treeserve::detail {
namespace {

using nlohmann::json;

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// Leftmost-longest matching of added tokens over a byte trie.
class AddedTokenMatcher {
 public:
  struct Match {
    size_t begin, end;  // the span the token takes (with any stripped whitespace)
    int32_t token;      // index into the added token list
  };

  void add(const std::string& pattern, int32_t token) {
    int32_t node = 0;
    for (unsigned char c : pattern) {
      int32_t child = -1;
      for (const auto& [byte, next] : nodes_[size_t(node)].children) {
        if (byte == c) child = next;
      }
      if (child < 0) {
        child = int32_t(nodes_.size());
        nodes_[size_t(node)].children.emplace_back(c, child);
        nodes_.push_back(Node{});
      }
      node = child;
    }
    if (nodes_[size_t(node)].token < 0) nodes_[size_t(node)].token = token;
    first_byte_[static_cast<unsigned char>(pattern[0])] = true;
    empty_ = false;
  }
  bool empty() const { return empty_; }

  void find(std::string_view text, const std::vector<AddedToken>& tokens,
            std::vector<Match>* out) const {
    out->clear();
    size_t consumed = 0;  // end of the previous match: lstrip never reaches back past it
    size_t pos = 0;
    while (pos < text.size()) {
      if (!first_byte_[static_cast<unsigned char>(text[pos])]) {
        ++pos;
        continue;
      }
      int32_t node = 0, token = -1;
      size_t end = pos;
      for (size_t i = pos; i < text.size(); ++i) {
        int32_t child = -1;
        for (const auto& [byte, next] : nodes_[size_t(node)].children) {
          if (byte == static_cast<unsigned char>(text[i])) child = next;
        }
        if (child < 0) break;
        node = child;
        if (nodes_[size_t(node)].token >= 0) {
          token = nodes_[size_t(node)].token;
          end = i + 1;
        }
      }
      if (token < 0) {
        ++pos;
        continue;
      }
      const AddedToken& t = tokens[size_t(token)];
      size_t begin = pos;
      pos = end;
      if (t.single_word && !is_single_word(text, begin, end)) continue;
      while (t.lstrip && begin > consumed) {
        size_t length = 0;
        if (!is_white_space(last_char(text.substr(consumed, begin - consumed), &length))) break;
        begin -= length;
      }
      while (t.rstrip && end < text.size()) {
        size_t next = end;
        if (!is_white_space(next_char(text, &next))) break;
        end = next;
      }
      out->push_back(Match{begin, end, token});
      consumed = pos = end;
    }
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;
    int32_t token = -1;
  };
  // A single_word token must not touch a word character on either side.
  static bool is_single_word(std::string_view text, size_t begin, size_t end) {
    size_t length = 0;
    if (begin > 0 && is_word_char(last_char(text.substr(0, begin), &length))) return false;
    size_t next = end;
    return end == text.size() || !is_word_char(next_char(text, &next));
  }
  static bool is_word_char(uint32_t cp) { return cp == '_' || is_alphanumeric(cp); }

  std::vector<Node> nodes_{Node{}};
  std::array<bool, 256> first_byte_{};
  bool empty_ = true;
};

std::string describe(const json& stage, const char* list_field) {
  if (stage.is_null()) return "none";
  std::string type = stage.value("type", "?");
  if (type != "Sequence" || !stage.contains(list_field)) return type;
  std::string inner;
  for (const json& s : stage.at(list_field)) {
    inner += (inner.empty() ? "" : ", ") + describe(s, list_field);
  }
  return "Sequence[" + inner + "]";
}

class HfTokenizer : public TokenizerBackend {
 public:
  static StatusOr<std::unique_ptr<TokenizerBackend>> load(const std::string& file);

  StatusOr<std::vector<int32_t>> encode(std::string_view text) const override;
  StatusOr<std::string> decode(const std::vector<int32_t>& ids, bool skip_special) const override;
  std::string id_to_piece(int32_t id) const override {
    return id >= 0 && id < vocab_size() ? pieces_[size_t(id)] : "";
  }
  int32_t piece_to_id(std::string_view piece) const override {
    auto it = piece_ids_.find(piece);
    return it == piece_ids_.end() ? -1 : it->second;
  }
  std::string_view token_bytes(int32_t id) const override {
    return id >= 0 && id < int32_t(bytes_.size()) ? std::string_view(bytes_[size_t(id)])
                                                  : std::string_view();
  }
  int32_t vocab_size() const override { return int32_t(pieces_.size()); }
  int32_t bos_id() const override { return bos_id_; }
  int32_t eos_id() const override { return -1; }
  std::string description() const override { return description_; }
  void set_word_cache(bool enabled) override { model_->set_cache_enabled(enabled); }

 private:
  Status parse(const json& root, const std::string& file);
  Status parse_model(const json& model, const std::string& where, bool byte_level);
  Status parse_post_processor(const json& config, const std::string& where);
  Status encode_section(std::string_view text, bool at_start, std::vector<int32_t>* ids) const;
  Status encode_words(std::string text, bool at_start, std::vector<int32_t>* ids) const;

  std::vector<AddedToken> added_;
  AddedTokenMatcher raw_matcher_, normalized_matcher_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<Decoder> decoder_;
  bool byte_level_decoder_ = false;
  std::vector<std::string> pieces_;  // id -> piece as tokenizer.json writes it ("" for holes)
  std::vector<bool> special_;        // id -> an added token with special=true
  StringMap<int32_t> piece_ids_;
  std::vector<std::string> bytes_;  // id -> token_bytes()
  int32_t bos_id_ = -1;
  std::string description_;
};

StatusOr<std::unique_ptr<TokenizerBackend>> HfTokenizer::load(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return NotFound("tokenizer " + file + ": no such file");
  std::stringstream text;
  text << in.rdbuf();
  json root;
  try {
    root = json::parse(text.str());
  } catch (const json::exception& e) {
    return InvalidArgument(file + ": invalid JSON: " + e.what());
  }
  if (!root.is_object()) return InvalidArgument(file + ": top level must be a JSON object");
  std::unique_ptr<HfTokenizer> tokenizer(new HfTokenizer);
  TS_RETURN_IF_ERROR(tokenizer->parse(root, file));
  return std::unique_ptr<TokenizerBackend>(std::move(tokenizer));
}

Status HfTokenizer::parse(const json& root, const std::string& file) {
  const json null;
  auto stage = [&](const char* name) -> const json& {
    auto it = root.find(name);
    return it == root.end() ? null : *it;
  };
  auto normalizer = make_normalizer(stage("normalizer"), file + ": normalizer");
  if (!normalizer.ok()) return normalizer.status();
  normalizer_ = std::move(*normalizer);
  bool byte_level = false;
  auto pre = make_pre_tokenizer(stage("pre_tokenizer"), file + ": pre_tokenizer", &byte_level);
  if (!pre.ok()) return pre.status();
  pre_tokenizer_ = std::move(*pre);
  auto decoder = make_decoder(stage("decoder"), file + ": decoder");
  if (!decoder.ok()) return decoder.status();
  decoder_ = std::move(*decoder);
  byte_level_decoder_ = is_byte_level_decoder(stage("decoder"));
  if (!root.contains("model") || !root.at("model").is_object()) {
    return InvalidArgument(file + ": missing the 'model' object");
  }
  TS_RETURN_IF_ERROR(parse_model(root.at("model"), file + ": model", byte_level));

  // Added tokens: in the id table, and cut out of the text before the model sees it.
  const json& added = stage("added_tokens");
  if (!added.is_null() && !added.is_array()) {
    return InvalidArgument(file + ": added_tokens: expected a list");
  }
  for (size_t i = 0; added.is_array() && i < added.size(); ++i) {
    const std::string where = file + ": added_tokens[" + std::to_string(i) + "]";
    const json& a = added[i];
    AddedToken t;
    try {
      t.id = a.at("id").get<int32_t>();
      t.content = a.at("content").get<std::string>();
      t.single_word = a.value("single_word", false);
      t.lstrip = a.value("lstrip", false);
      t.rstrip = a.value("rstrip", false);
      t.special = a.value("special", false);
      t.normalized = a.value("normalized", !t.special);
    } catch (const json::exception& e) {
      return InvalidArgument(where + ": " + e.what());
    }
    if (t.id < 0 || t.content.empty() || first_invalid_utf8(t.content) != t.content.size()) {
      return InvalidArgument(where + ": needs an id >= 0 and non-empty UTF-8 content");
    }
    if (size_t(t.id) >= pieces_.size()) pieces_.resize(size_t(t.id) + 1);
    pieces_[size_t(t.id)] = t.content;
    piece_ids_[t.content] = t.id;
    added_.push_back(t);
  }
  special_.assign(pieces_.size(), false);
  for (size_t i = 0; i < added_.size(); ++i) {
    const AddedToken& t = added_[i];
    special_[size_t(t.id)] = t.special;
    if (t.normalized && normalizer_) {
      std::string pattern = t.content;
      TS_RETURN_IF_ERROR(normalizer_->apply(&pattern));
      if (!pattern.empty()) normalized_matcher_.add(pattern, int32_t(i));
    } else {
      raw_matcher_.add(t.content, int32_t(i));
    }
  }
  TS_RETURN_IF_ERROR(parse_post_processor(stage("post_processor"), file + ": post_processor"));

  // token_bytes: what each id adds to the decoded bytes, where that can be part of a character.
  bytes_.assign(pieces_.size(), std::string());
  for (size_t id = 0; id < pieces_.size(); ++id) {
    if (byte_level_decoder_) {  // the ByteLevel decoder's rule, per token
      std::string raw;
      bool mapped = true;
      for (size_t pos = 0; pos < pieces_[id].size() && mapped;) {
        const int b = char_to_byte(next_char(pieces_[id], &pos));
        mapped = b >= 0;
        raw.push_back(char(b));
      }
      bytes_[id] = mapped ? raw : pieces_[id];
    } else if (pieces_[id].size() == 6 && pieces_[id].compare(0, 3, "<0x") == 0 &&
               pieces_[id][5] == '>' && std::isxdigit(static_cast<unsigned char>(pieces_[id][3])) &&
               std::isxdigit(static_cast<unsigned char>(pieces_[id][4]))) {
      // Only two hex digits make a byte piece ("<0xZZ>" is a plain piece, and no exception).
      const int value = std::stoi(pieces_[id].substr(3, 2), nullptr, 16);
      bytes_[id] = std::string(1, char(value));
    }
  }
  description_ = file + " (tokenizer.json: BPE" + std::string(byte_level ? ", byte-level" : "") +
                 "; " + std::to_string(pieces_.size()) + " ids, " + std::to_string(added_.size()) +
                 " added tokens; normalizer " + describe(stage("normalizer"), "normalizers") +
                 ", pre-tokenizer " + describe(stage("pre_tokenizer"), "pretokenizers") +
                 ", decoder " + describe(stage("decoder"), "decoders") + ")";
  return Status::Ok();
}

Status HfTokenizer::parse_model(const json& model, const std::string& where, bool byte_level) {
  const std::string type = model.value("type", model.contains("merges") ? "BPE" : "");
  if (type != "BPE") {
    return InvalidArgument(where + ": type '" + type + "' is not supported (supported: BPE)");
  }
  for (const char* field : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(field) && !model.at(field).is_null() && model.at(field) != "") {
      return InvalidArgument(where + "." + field + " is not supported");
    }
  }
  if (model.contains("dropout") && !model.at("dropout").is_null() &&
      model.at("dropout").get<double>() != 0.0) {
    return InvalidArgument(where + ".dropout is not supported (it randomizes encoding)");
  }
  if (!model.contains("vocab") || !model.at("vocab").is_object()) {
    return InvalidArgument(where + ".vocab: expected an object of piece -> id");
  }
  if (!model.contains("merges") || !model.at("merges").is_array()) {
    return InvalidArgument(where + ".merges: expected a list");
  }
  // Byte-level pieces are spelled in GPT-2's alphabet; the model works on the bytes.
  auto to_model_space = [&](const std::string& piece, std::string* out) {
    if (!byte_level) {
      *out = piece;
      return true;
    }
    out->clear();
    for (size_t pos = 0; pos < piece.size();) {
      const int b = char_to_byte(next_char(piece, &pos));
      if (b < 0) return false;
      out->push_back(char(b));
    }
    return true;
  };
  StringMap<int32_t> vocab;
  std::string converted;
  for (const auto& [piece, id_json] : model.at("vocab").items()) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 ||
        id_json.get<int64_t>() > INT32_MAX) {
      return InvalidArgument(where + ".vocab['" + piece + "']: expected an id >= 0");
    }
    const int32_t id = id_json.get<int32_t>();
    if (size_t(id) >= pieces_.size()) pieces_.resize(size_t(id) + 1);
    pieces_[size_t(id)] = piece;
    piece_ids_[piece] = id;
    if (to_model_space(piece, &converted)) vocab[converted] = id;  // else: never produced
  }
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(model.at("merges").size());
  const json& merge_list = model.at("merges");
  for (size_t i = 0; i < merge_list.size(); ++i) {
    const json& m = merge_list[i];
    std::string left, right;
    if (m.is_string()) {  // "left right"
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        return InvalidArgument(where + ".merges[" + std::to_string(i) + "]: '" + s +
                               "' is not two pieces separated by one space");
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      return InvalidArgument(where + ".merges[" + std::to_string(i) + "]: unexpected " + m.dump());
    }
    std::string l, r;
    if (!to_model_space(left, &l) || !to_model_space(right, &r)) {
      return InvalidArgument(where + ".merges[" + std::to_string(i) +
                             "]: a piece outside the byte-level alphabet");
    }
    merges.emplace_back(std::move(l), std::move(r));
  }
  BpeOptions options;
  options.byte_level = byte_level;
  options.ignore_merges = model.value("ignore_merges", false);
  options.byte_fallback = model.value("byte_fallback", false);
  options.fuse_unk = model.value("fuse_unk", false);
  if (model.contains("unk_token") && model.at("unk_token").is_string()) {
    const std::string unk = model.at("unk_token").get<std::string>();
    auto it = piece_ids_.find(unk);
    if (it == piece_ids_.end()) {
      return InvalidArgument(where + ".unk_token '" + unk + "' is not in the vocabulary");
    }
    options.unk_id = it->second;
  }
  auto built = BpeModel::build(std::move(vocab), merges, options);
  if (!built.ok()) return InvalidArgument(where + ": " + built.status().message());
  model_ = std::move(*built);
  return Status::Ok();
}

Status HfTokenizer::parse_post_processor(const json& config, const std::string& where) {
  if (config.is_null()) return Status::Ok();
  const std::string type = config.value("type", "");
  if (type == "ByteLevel") return Status::Ok();  // offsets only
  if (type == "Sequence") {
    const json processors = config.value("processors", json::array());
    for (size_t i = 0; i < processors.size(); ++i) {
      TS_RETURN_IF_ERROR(
          parse_post_processor(processors[i], where + ".processors[" + std::to_string(i) + "]"));
    }
    return Status::Ok();
  }
  if (type != "TemplateProcessing") {
    return InvalidArgument(where + ": type '" + type +
                           "' is not supported (supported: TemplateProcessing, ByteLevel, "
                           "Sequence)");
  }
  // single: [{"SpecialToken": {"id": NAME}}, {"Sequence": {"id": "A"}}, ...]; special_tokens
  // maps NAME to its ids. treeserve adds at most one token, a BOS before the text.
  std::vector<int32_t> before, after;
  bool seen_text = false;
  try {
    for (const json& item : config.at("single")) {
      if (item.contains("Sequence")) {
        seen_text = true;
        continue;
      }
      const std::string name = item.at("SpecialToken").at("id").get<std::string>();
      for (const json& id : config.at("special_tokens").at(name).at("ids")) {
        (seen_text ? after : before).push_back(id.get<int32_t>());
      }
    }
  } catch (const json::exception& e) {
    return InvalidArgument(where + ": malformed TemplateProcessing: " + e.what());
  }
  if (!after.empty() || before.size() > 1) {
    return InvalidArgument(where + ": TemplateProcessing adds " + std::to_string(before.size()) +
                           " token(s) before and " + std::to_string(after.size()) +
                           " after the text; only a single BOS before it is supported");
  }
  if (!before.empty()) {
    if (before[0] < 0 || size_t(before[0]) >= pieces_.size()) {
      return InvalidArgument(where + ": BOS id " + std::to_string(before[0]) +
                             " is outside the vocabulary");
    }
    bos_id_ = before[0];
  }
  return Status::Ok();
}

Status HfTokenizer::encode_words(std::string text, bool at_start, std::vector<int32_t>* ids) const {
  if (!pre_tokenizer_) {
    model_->encode_word(text, ids);
    return Status::Ok();
  }
  thread_local std::vector<Piece> pieces;
  pieces.clear();
  pieces.push_back(Piece{std::move(text), at_start});
  TS_RETURN_IF_ERROR(pre_tokenizer_->apply(&pieces));
  for (const Piece& p : pieces) model_->encode_word(p.text, ids);
  return Status::Ok();
}

Status HfTokenizer::encode_section(std::string_view text, bool at_start,
                                   std::vector<int32_t>* ids) const {
  std::string normalized(text);
  if (normalizer_) TS_RETURN_IF_ERROR(normalizer_->apply(&normalized));
  if (normalized_matcher_.empty()) return encode_words(std::move(normalized), at_start, ids);
  std::vector<AddedTokenMatcher::Match> matches;
  normalized_matcher_.find(normalized, added_, &matches);
  size_t prev = 0;
  for (const auto& m : matches) {
    if (m.begin > prev) {
      TS_RETURN_IF_ERROR(
          encode_words(normalized.substr(prev, m.begin - prev), at_start && prev == 0, ids));
    }
    ids->push_back(added_[size_t(m.token)].id);
    prev = m.end;
  }
  if (prev < normalized.size()) {
    TS_RETURN_IF_ERROR(encode_words(normalized.substr(prev), at_start && prev == 0, ids));
  }
  return Status::Ok();
}

StatusOr<std::vector<int32_t>> HfTokenizer::encode(std::string_view text) const {
  if (const size_t bad = first_invalid_utf8(text); bad != text.size()) {
    return InvalidArgument("text is not valid UTF-8 (byte " + std::to_string(bad) + ")");
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  std::vector<AddedTokenMatcher::Match> matches;
  raw_matcher_.find(text, added_, &matches);
  size_t prev = 0;
  for (const auto& m : matches) {
    if (m.begin > prev) {
      TS_RETURN_IF_ERROR(encode_section(text.substr(prev, m.begin - prev), prev == 0, &ids));
    }
    ids.push_back(added_[size_t(m.token)].id);
    prev = m.end;
  }
  if (prev < text.size()) TS_RETURN_IF_ERROR(encode_section(text.substr(prev), prev == 0, &ids));
  return ids;
}

StatusOr<std::string> HfTokenizer::decode(const std::vector<int32_t>& ids,
                                          bool skip_special) const {
  auto skipped = [&](int32_t id) {
    return pieces_[size_t(id)].empty() || (skip_special && special_[size_t(id)]);
  };
  if (byte_level_decoder_) {
    std::string bytes;
    for (int32_t id : ids) {
      if (!skipped(id)) bytes += bytes_[size_t(id)];
    }
    return utf8_lossy(bytes);
  }
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (!skipped(id)) tokens.push_back(pieces_[size_t(id)]);
  }
  std::string out;
  if (decoder_) {
    decoder_->apply(&tokens);
    for (const std::string& t : tokens) out += t;
  } else {
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
  }
  return utf8_lossy(out);
}

}  // namespace

StatusOr<std::unique_ptr<TokenizerBackend>> load_tokenizer_json(const std::string& file) {
  return HfTokenizer::load(file);
}

}  // namespace treeserve::detail
