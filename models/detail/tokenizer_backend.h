// What Tokenizer (models/tokenizer.h) asks of an implementation: the sentencepiece shim
// (spm_tokenizer.cpp) or the tokenizer.json reader (hf_tokenizer.cpp). Implementations are
// immutable after loading and safe to call from several threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace treeserve::detail {

class TokenizerBackend {
 public:
  virtual ~TokenizerBackend() = default;

  virtual StatusOr<std::vector<int32_t>> encode(std::string_view text) const = 0;
  // ids are inside [0, vocab_size()); skip_special drops control / special tokens.
  virtual StatusOr<std::string> decode(const std::vector<int32_t>& ids,
                                       bool skip_special) const = 0;
  virtual std::string id_to_piece(int32_t id) const = 0;
  virtual int32_t piece_to_id(std::string_view piece) const = 0;  // -1 when absent
  // See Tokenizer::token_bytes.
  virtual std::string_view token_bytes(int32_t id) const = 0;
  virtual int32_t vocab_size() const = 0;
  // The BOS id text prompts start with and the EOS id, as the file itself says (-1: none).
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  // One line for the load log: the kind and its main components.
  virtual std::string description() const = 0;
  // Turns a per-word encode cache off or on (benchmarks time both); not thread-safe.
  virtual void set_word_cache(bool /*enabled*/) {}
};

// model_file: a sentencepiece model (loaded through the dlopen()ed shim).
StatusOr<std::unique_ptr<TokenizerBackend>> load_sentencepiece(const std::string& model_file);
// file: a Hugging Face tokenizer.json.
StatusOr<std::unique_ptr<TokenizerBackend>> load_tokenizer_json(const std::string& file);

}  // namespace treeserve::detail
