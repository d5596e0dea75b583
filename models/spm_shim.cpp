// libtreeserve_spm.so: wraps sentencepiece::SentencePieceProcessor behind the C ABI
// of spm_shim.h. Built as a MODULE library linking libsentencepiece; nothing else in
// treeserve includes sentencepiece headers. No exception or C++ type crosses the ABI.
#include "models/detail/spm_shim.h"

#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#define TREESERVE_SPM_EXPORT extern "C" __attribute__((visibility("default")))

struct TreeserveSpm {
  sentencepiece::SentencePieceProcessor processor;
};

namespace {

void write_error(char* err, size_t err_len, const std::string& message) {
  if (err == nullptr || err_len == 0) return;
  const size_t n = std::min(message.size(), err_len - 1);
  std::memcpy(err, message.data(), n);
  err[n] = '\0';
}

// Copies bytes into a fresh malloc'ed buffer (one extra NUL so text stays a C string).
template <typename T>
T* copy_out(const T* data, size_t count) {
  T* out = static_cast<T*>(std::malloc(sizeof(T) * count + 1));
  if (out != nullptr && count > 0) std::memcpy(out, data, sizeof(T) * count);
  return out;
}

}  // namespace

TREESERVE_SPM_EXPORT int treeserve_spm_abi_version(void) { return TREESERVE_SPM_ABI_VERSION; }

TREESERVE_SPM_EXPORT TreeserveSpm* treeserve_spm_load(const char* model_file, char* err,
                                                      size_t err_len) {
  try {
    auto* spm = new TreeserveSpm;
    const auto status = spm->processor.Load(model_file);
    if (!status.ok()) {
      write_error(err, err_len, status.ToString());
      delete spm;
      return nullptr;
    }
    return spm;
  } catch (const std::exception& e) {
    write_error(err, err_len, e.what());
    return nullptr;
  }
}

TREESERVE_SPM_EXPORT void treeserve_spm_free(TreeserveSpm* spm) { delete spm; }

TREESERVE_SPM_EXPORT int treeserve_spm_encode(const TreeserveSpm* spm, const char* text,
                                              size_t text_len, int32_t** out_ids, size_t* out_count,
                                              char* err, size_t err_len) {
  try {
    std::vector<int> ids;
    const auto status = spm->processor.Encode(std::string_view(text, text_len), &ids);
    if (!status.ok()) {
      write_error(err, err_len, status.ToString());
      return 1;
    }
    std::vector<int32_t> ids32(ids.begin(), ids.end());
    *out_ids = copy_out(ids32.data(), ids32.size());
    *out_count = ids32.size();
    if (*out_ids == nullptr) {
      write_error(err, err_len, "out of memory");
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    write_error(err, err_len, e.what());
    return 1;
  }
}

TREESERVE_SPM_EXPORT int treeserve_spm_decode(const TreeserveSpm* spm, const int32_t* ids,
                                              size_t count, char** out_text, size_t* out_len,
                                              char* err, size_t err_len) {
  try {
    std::vector<int> ids_int(ids, ids + count);
    std::string text;
    const auto status = spm->processor.Decode(ids_int, &text);
    if (!status.ok()) {
      write_error(err, err_len, status.ToString());
      return 1;
    }
    *out_text = copy_out(text.data(), text.size());
    *out_len = text.size();
    if (*out_text == nullptr) {
      write_error(err, err_len, "out of memory");
      return 1;
    }
    (*out_text)[text.size()] = '\0';
    return 0;
  } catch (const std::exception& e) {
    write_error(err, err_len, e.what());
    return 1;
  }
}

TREESERVE_SPM_EXPORT int treeserve_spm_piece(const TreeserveSpm* spm, int32_t id, char** out_text,
                                             size_t* out_len) {
  try {
    std::string piece;
    if (id >= 0 && id < spm->processor.GetPieceSize()) piece = spm->processor.IdToPiece(id);
    *out_text = copy_out(piece.data(), piece.size());
    *out_len = piece.size();
    if (*out_text == nullptr) return 1;
    (*out_text)[piece.size()] = '\0';
    return 0;
  } catch (const std::exception&) {
    return 1;
  }
}

TREESERVE_SPM_EXPORT int32_t treeserve_spm_vocab_size(const TreeserveSpm* spm) {
  return spm->processor.GetPieceSize();
}

TREESERVE_SPM_EXPORT int32_t treeserve_spm_bos_id(const TreeserveSpm* spm) {
  return spm->processor.bos_id();
}

TREESERVE_SPM_EXPORT int32_t treeserve_spm_eos_id(const TreeserveSpm* spm) {
  return spm->processor.eos_id();
}

TREESERVE_SPM_EXPORT void treeserve_spm_free_buffer(void* buffer) { std::free(buffer); }
