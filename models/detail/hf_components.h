// The pipeline stages of a tokenizer.json that treeserve implements, each built from its
// JSON object: normalizers (NFC, NFD, NFKC, NFKD, Replace, Prepend, Strip, Sequence),
// pre-tokenizers (Split, ByteLevel, Metaspace, Digits, Sequence) and decoders (ByteLevel,
// Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence), with Hugging Face tokenizers'
// semantics. Any other type is refused with an error naming it and the stage.
#pragma once

#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "common/status.h"

namespace treeserve::detail {

// Text on its way through normalization and pre-tokenization. at_start: the piece begins at
// offset 0 of the text being encoded (Metaspace's prepend_scheme "first" asks).
struct Piece {
  std::string text;
  bool at_start = false;
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual Status apply(std::string* text) const = 0;  // text is valid UTF-8
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Splits (and may rewrite) every piece in place; empty pieces are dropped.
  virtual Status apply(std::vector<Piece>* pieces) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  // One step of Hugging Face's decode_chain: token strings in, token strings out.
  virtual void apply(std::vector<std::string>* tokens) const = 0;
};

// `where` names the JSON path in errors ("tokenizer.json: normalizer").
// A null JSON value gives a null stage.
StatusOr<std::unique_ptr<Normalizer>> make_normalizer(const nlohmann::json& config,
                                                      const std::string& where);
// *byte_level is set when the stage ends in a ByteLevel pre-tokenizer: the words it produces
// are raw bytes and the model's pieces must be read in the byte-level alphabet. ByteLevel
// anywhere but last is refused.
StatusOr<std::unique_ptr<PreTokenizer>> make_pre_tokenizer(const nlohmann::json& config,
                                                           const std::string& where,
                                                           bool* byte_level);
StatusOr<std::unique_ptr<Decoder>> make_decoder(const nlohmann::json& config,
                                                const std::string& where);

// Whether a decoder is exactly ByteLevel (a token's text is the bytes its characters stand
// for): decode can then concatenate per-token bytes instead of running the chain.
bool is_byte_level_decoder(const nlohmann::json& config);

// The GPT-2 pre-tokenization pattern ByteLevel uses when use_regex is true.
extern const char* const kGpt2SplitPattern;

}  // namespace treeserve::detail
