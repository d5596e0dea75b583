// Incremental detokenization for streaming: turns a growing token sequence into
// text deltas whose concatenation equals Tokenizer::decode of the whole sequence.
// A character split over several byte-fallback tokens (<0xE6><0x97><0xA5>) is held
// back until it is complete, so no delta ever ends inside a UTF-8 sequence.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "models/tokenizer.h"

namespace treeserve {

// Number of trailing ids to hold back so that the ids before them end on a whole character:
// those whose bytes (Tokenizer::token_bytes) end in a UTF-8 sequence that is incomplete but
// could still become valid, and, where such an id also holds the end of the character before
// it, the ids that character started in (and so on).
int incomplete_utf8_tail(const Tokenizer& tokenizer, const std::vector<int32_t>& ids);

// Stateless form: the text that appending new_id to previous adds, where each
// sequence's text is decode() of it minus any incomplete UTF-8 tail (see above).
// O(len) per call; IncrementalDetokenizer is the O(1)-per-token form for streams.
StatusOr<std::string> decode_new_text(const Tokenizer& tokenizer,
                                      const std::vector<int32_t>& previous, int32_t new_id);

// What streaming needs to know about a vocabulary, computed once per tokenizer (two decodes
// per id, at construction): the anchor piece (see IncrementalDetokenizer), and the ids whose
// text is the same in any context — decode(anchor, id) adds a fixed non-empty text and
// decode(anchor, id, anchor) adds just the anchor's after it — which a stream can then emit
// without calling the decoder. Ids whose bytes are not whole characters never qualify.
// Immutable: share it between threads.
class DetokenizerVocab {
 public:
  explicit DetokenizerVocab(const Tokenizer& tokenizer);

  int32_t anchor() const { return anchor_; }
  const std::string& anchor_text() const { return anchor_text_; }
  // id's fixed text, or nullptr when its text depends on its neighbours (or id is outside
  // the vocabulary).
  const std::string* plain_text(int32_t id) const {
    return id >= 0 && id < int32_t(text_.size()) && !text_[size_t(id)].empty() ? &text_[size_t(id)]
                                                                               : nullptr;
  }
  int32_t num_plain() const;

 private:
  int32_t anchor_ = -1;
  std::string anchor_text_;
  std::vector<std::string> text_;  // a plain id's text (never empty); "" for the others
};

// One per streamed sequence. Decodes only a sliding window of the last tokens
// (the TGI prefix/read-offset scheme). sentencepiece strips the dummy-prefix space of
// the first non-control piece of what it decodes; a window that starts mid-sequence
// is therefore decoded behind an anchor piece (a plain piece such as "he") whose text
// is cut off again, so the window's first piece keeps its space exactly as in the
// full decode. Until some text has been emitted the window starts at token 0 instead,
// unanchored, so leading control ids (BOS) and the real first piece behave as there.
//
// With a DetokenizerVocab (of the same tokenizer), construction does not search for the
// anchor, and once text has been emitted a plain id with nothing held back is emitted from
// the table (the same delta, without two decodes).
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer,
                                  const DetokenizerVocab* vocab = nullptr);

  // Appends id and returns the newly completed text ("" while a character is
  // incomplete). INVALID_ARGUMENT for an id outside the vocabulary (not appended).
  StatusOr<std::string> push(int32_t id);
  // Text still held back at the end of a stream (incomplete bytes decode to U+FFFD).
  StatusOr<std::string> flush();

  const std::vector<int32_t>& ids() const { return ids_; }

 private:
  StatusOr<std::string> emit_until(size_t end);
  StatusOr<std::string> decode_window(size_t begin, size_t end) const;

  const Tokenizer& tokenizer_;
  const DetokenizerVocab* vocab_ = nullptr;
  int32_t anchor_ = -1;  // a plain piece that decodes to itself; -1 if the vocab has none
  std::string anchor_text_;
  bool emitted_text_ = false;  // any non-empty delta yet: the decoder is past its start
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0;  // start of the decode window
  size_t read_offset_ = 0;    // ids_[0, read_offset_) have been emitted as text
};

}  // namespace treeserve
