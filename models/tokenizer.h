// Tokenizer: a sentencepiece tokenizer.model (Llama-2 / Mistral style) behind a
// small Status-returning API. All sentencepiece code lives in libtreeserve_spm.so,
// loaded at run time with dlopen(RTLD_DEEPBIND) so its bundled protobuf runtime is
// isolated from gRPC's. The shim is searched in: $TREESERVE_SPM_SHIM
// (a file or a directory), the directory of the running executable and its ../lib,
// then the build tree it was compiled in.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace treeserve {

namespace detail {
struct SpmApi;
}

class Tokenizer {
 public:
  // model_file: a sentencepiece tokenizer.model. NOT_FOUND when the file or the shim
  // is missing, INVALID_ARGUMENT when sentencepiece cannot parse the file.
  static StatusOr<std::unique_ptr<Tokenizer>> load(const std::string& model_file);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  StatusOr<std::vector<int32_t>> encode(std::string_view text) const;  // no BOS/EOS added
  StatusOr<std::string> decode(
      const std::vector<int32_t>& ids) const;  // INVALID_ARGUMENT on ids outside [0, vocab)
  std::string id_to_piece(int32_t id) const;   // "" for ids outside [0, vocab)
  int32_t vocab_size() const;
  int32_t bos_id() const;  // -1 when the model has none
  int32_t eos_id() const;  // -1 when the model has none

 private:
  Tokenizer(const detail::SpmApi* api, void* handle, std::string model_file);

  const detail::SpmApi* api_;
  void* handle_;  // TreeserveSpm*, owned
  std::string model_file_;
  int32_t vocab_size_;
  int32_t bos_id_;
  int32_t eos_id_;
};

}  // namespace treeserve
