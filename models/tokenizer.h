// Tokenizer: text <-> token ids for a checkpoint, from either of the files checkpoints ship:
//  - tokenizer.json (Hugging Face format): byte-level BPE (Llama 3.x, Qwen2.5) or
//    sentencepiece-style BPE with byte fallback (Mistral, Llama 2 exports), read and run in
//    treeserve (models/hf_tokenizer.cpp);
//  - tokenizer.model (sentencepiece: Llama 2, Mistral, TinyLlama), run by sentencepiece
//    inside libtreeserve_spm.so, loaded at run time with dlopen(RTLD_DEEPBIND) so its bundled
//    protobuf runtime is isolated from gRPC's. The shim is searched in: $TREESERVE_SPM_SHIM
//    (a file or a directory), the directory of the running executable and its ../lib, then
//    the build tree it was compiled in.
// Immutable after loading; every method may be called from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace treeserve {

namespace detail {
class TokenizerBackend;
}

class Tokenizer {
 public:
  // file: a tokenizer.json (a name ending in ".json") or a sentencepiece model. NOT_FOUND
  // when the file (or the sentencepiece shim) is missing; INVALID_ARGUMENT naming the file
  // and the part when it cannot be read, e.g. a tokenizer.json component treeserve does not
  // implement, or a tiktoken file (Llama 3's tokenizer.model).
  static StatusOr<std::unique_ptr<Tokenizer>> load(const std::string& file);
  // A checkpoint directory: a sentencepiece tokenizer.model when there is one, else
  // tokenizer.json (Llama 3's tiktoken tokenizer.model is passed over); then
  // tokenizer_config.json, when present, sets BOS (add_bos_token, bos_token) and EOS
  // (eos_token). Logs which file it read.
  static StatusOr<std::unique_ptr<Tokenizer>> load_model_dir(const std::string& dir);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // No BOS/EOS added. tokenizer.json: added tokens written in the text (<|eot_id|>) are
  // matched as those tokens; INVALID_ARGUMENT for text that is not valid UTF-8.
  StatusOr<std::vector<int32_t>> encode(std::string_view text) const;
  // Special tokens (sentencepiece control pieces, tokenizer.json added tokens marked
  // special) are left out. INVALID_ARGUMENT on ids outside [0, vocab).
  StatusOr<std::string> decode(const std::vector<int32_t>& ids) const;
  // The same with special tokens written out (tokenizer.json; sentencepiece writes none).
  StatusOr<std::string> decode_with_special(const std::vector<int32_t>& ids) const;

  std::string id_to_piece(int32_t id) const;          // "" for ids outside [0, vocab)
  int32_t piece_to_id(std::string_view piece) const;  // -1 when no token has that piece
  // The raw bytes id adds to the decoded text when those may be part of a UTF-8 character
  // split over several tokens: a sentencepiece or ByteFallback byte piece (<0xE6>), any
  // token of a byte-level BPE. Empty for tokens that always decode to whole characters.
  std::string_view token_bytes(int32_t id) const;
  int32_t vocab_size() const;
  int32_t bos_id() const;  // the id text prompts start with; -1 when none is added
  int32_t eos_id() const;  // -1 when the tokenizer names none
  // The file read and what it holds, as logged at load.
  const std::string& description() const { return description_; }

 private:
  explicit Tokenizer(std::unique_ptr<detail::TokenizerBackend> backend);
  StatusOr<std::string> checked_decode(const std::vector<int32_t>& ids, bool skip_special) const;

  std::unique_ptr<detail::TokenizerBackend> backend_;
  int32_t vocab_size_ = 0;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  std::string description_;
};

}  // namespace treeserve
