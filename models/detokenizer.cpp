// Incremental detokenizer: hold back incomplete UTF-8 from byte pieces and byte-level
// tokens, and emit decode(window + new) minus decode(window).
#include "models/detokenizer.h"

#include <algorithm>
#include <cctype>

#include "models/detail/unicode.h"

namespace treeserve {
namespace {

// Whether id's text may be part of a character split over several tokens: its bytes (a
// byte piece, a byte-level token) are not whole characters on their own.
bool partial_bytes(const Tokenizer& tokenizer, int32_t id) {
  const std::string_view bytes = tokenizer.token_bytes(id);
  return !bytes.empty() && detail::first_invalid_utf8(bytes) != bytes.size();
}

// "<0xE6>": a sentencepiece or ByteFallback byte piece.
bool is_byte_piece(const std::string& piece) {
  auto hex = [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; };
  return piece.size() == 6 && piece.compare(0, 3, "<0x") == 0 && hex(piece[3]) && hex(piece[4]) &&
         piece[5] == '>';
}

// A piece with no leading U+2581 that is not a byte, control or unknown piece, and
// decodes to itself alone and twice over: decoding it first ends sentencepiece's
// "start of text" state without adding a space. -1 when there is none.
int32_t find_anchor(const Tokenizer& tokenizer) {
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    const std::string piece = tokenizer.id_to_piece(id);
    if (piece.empty() || piece[0] == '<' || piece.rfind("\xE2\x96\x81", 0) == 0) continue;
    StatusOr<std::string> once = tokenizer.decode({id});
    StatusOr<std::string> twice = tokenizer.decode({id, id});
    if (once.ok() && twice.ok() && *once == piece && *twice == piece + piece) return id;
  }
  return -1;
}

// Text b adds to text a. sentencepiece decoding is concatenative, so a is a prefix
// of b; should a model ever break that, emit b past the common prefix.
std::string suffix_after(const std::string& a, const std::string& b) {
  const auto mismatch = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return b.substr(static_cast<size_t>(mismatch.second - b.begin()));
}

}  // namespace

int incomplete_utf8_tail(const Tokenizer& tokenizer, const std::vector<int32_t>& ids) {
  // Hold back the ids holding an incomplete last character; a byte-level token may also end
  // the character before it (bytes "A4 ED": the end of U+FF24, the start of U+D78C), so the
  // ids left may end incomplete in turn: repeat until they end on a whole character.
  // An id without token_bytes decodes to whole characters.
  size_t held = 0;
  while (held < ids.size()) {
    char tail[3];
    size_t owner[3];  // how many ids back from the end of ids[0, size - held) hold the byte
    size_t have = 0;
    for (size_t k = 1; k <= ids.size() - held && have < 3; ++k) {
      const std::string_view bytes = tokenizer.token_bytes(ids[ids.size() - held - k]);
      if (bytes.empty()) break;
      for (size_t i = bytes.size(); i > 0 && have < 3; --i, ++have) {
        tail[2 - have] = bytes[i - 1];
        owner[2 - have] = k;
      }
    }
    const size_t incomplete =
        detail::incomplete_utf8_suffix(std::string_view(tail + 3 - have, have));
    if (incomplete == 0) break;
    held += owner[3 - incomplete];
  }
  return static_cast<int>(held);
}

StatusOr<std::string> decode_new_text(const Tokenizer& tokenizer,
                                      const std::vector<int32_t>& previous, int32_t new_id) {
  if (new_id < 0 || new_id >= tokenizer.vocab_size()) {  // held back ids skip decode's check
    return InvalidArgument("token id " + std::to_string(new_id) +
                           " is outside the vocabulary [0, " +
                           std::to_string(tokenizer.vocab_size()) + ")");
  }
  std::vector<int32_t> all = previous;
  all.push_back(new_id);
  std::vector<int32_t> emitted_prev(previous.begin(),
                                    previous.end() - incomplete_utf8_tail(tokenizer, previous));
  std::vector<int32_t> emitted_all(all.begin(), all.end() - incomplete_utf8_tail(tokenizer, all));
  StatusOr<std::string> before = tokenizer.decode(emitted_prev);
  if (!before.ok()) return before.status();
  StatusOr<std::string> after = tokenizer.decode(emitted_all);
  if (!after.ok()) return after.status();
  return suffix_after(*before, *after);
}

DetokenizerVocab::DetokenizerVocab(const Tokenizer& tokenizer)
    : anchor_(find_anchor(tokenizer)), text_(size_t(std::max(0, tokenizer.vocab_size()))) {
  if (anchor_ < 0) return;  // no anchor: no context-free decode to test against
  anchor_text_ = tokenizer.id_to_piece(anchor_);
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    // Byte-fallback pieces never qualify, ASCII ones included: a ByteFallback decoder turns a
    // whole run of byte pieces that is not UTF-8 into U+FFFDs, so their text is never fixed.
    if (partial_bytes(tokenizer, id) || is_byte_piece(tokenizer.id_to_piece(id))) continue;
    StatusOr<std::string> alone = tokenizer.decode({anchor_, id});
    StatusOr<std::string> between = tokenizer.decode({anchor_, id, anchor_});
    if (!alone.ok() || !between.ok() || alone->size() <= anchor_text_.size() ||
        alone->compare(0, anchor_text_.size(), anchor_text_) != 0 ||
        *between != *alone + anchor_text_) {
      continue;
    }
    text_[size_t(id)] = alone->substr(anchor_text_.size());
  }
}

int32_t DetokenizerVocab::num_plain() const {
  return int32_t(
      std::count_if(text_.begin(), text_.end(), [](const std::string& t) { return !t.empty(); }));
}

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer,
                                               const DetokenizerVocab* vocab)
    : tokenizer_(tokenizer),
      vocab_(vocab),
      anchor_(vocab ? vocab->anchor() : find_anchor(tokenizer)) {
  if (anchor_ >= 0) anchor_text_ = vocab ? vocab->anchor_text() : tokenizer_.id_to_piece(anchor_);
}

StatusOr<std::string> IncrementalDetokenizer::push(int32_t id) {
  if (id < 0 || id >= tokenizer_.vocab_size()) {
    return InvalidArgument("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                           std::to_string(tokenizer_.vocab_size()) + ")");
  }
  ids_.push_back(id);
  if (vocab_ != nullptr && emitted_text_ && read_offset_ + 1 == ids_.size()) {
    // Past the decoder's start state with nothing held back: a plain id's text is fixed.
    if (const std::string* text = vocab_->plain_text(id)) {
      prefix_offset_ = read_offset_;
      read_offset_ = ids_.size();
      return *text;
    }
  }
  // Only not-yet-emitted ids can be held back.
  const std::vector<int32_t> pending(ids_.begin() + static_cast<ptrdiff_t>(read_offset_),
                                     ids_.end());
  const size_t end = ids_.size() - static_cast<size_t>(incomplete_utf8_tail(tokenizer_, pending));
  if (end <= read_offset_) return std::string();
  return emit_until(end);
}

StatusOr<std::string> IncrementalDetokenizer::flush() {
  if (read_offset_ == ids_.size()) return std::string();
  return emit_until(ids_.size());
}

StatusOr<std::string> IncrementalDetokenizer::decode_window(size_t begin, size_t end) const {
  const auto first = ids_.begin() + static_cast<ptrdiff_t>(begin);
  const auto last = ids_.begin() + static_cast<ptrdiff_t>(end);
  if (begin == 0 || anchor_ < 0) return tokenizer_.decode(std::vector<int32_t>(first, last));
  std::vector<int32_t> window = {anchor_};
  window.insert(window.end(), first, last);
  StatusOr<std::string> text = tokenizer_.decode(window);
  if (!text.ok()) return text.status();
  return text->substr(std::min(anchor_text_.size(), text->size()));
}

StatusOr<std::string> IncrementalDetokenizer::emit_until(size_t end) {
  // Nothing emitted yet: the decoder may still be in its start state (only control ids
  // so far, or a lone "▁"), which only a decode from token 0 reproduces.
  const size_t begin = emitted_text_ ? prefix_offset_ : 0;
  StatusOr<std::string> before = decode_window(begin, read_offset_);
  if (!before.ok()) return before.status();
  StatusOr<std::string> after = decode_window(begin, end);
  if (!after.ok()) return after.status();
  prefix_offset_ = read_offset_;
  read_offset_ = end;
  std::string delta = suffix_after(*before, *after);
  emitted_text_ = emitted_text_ || !delta.empty();
  return delta;
}

}  // namespace treeserve
