// The sentencepiece backend of Tokenizer, over libtreeserve_spm.so. This file must not
// include sentencepiece headers or link sentencepiece: it finds the shim, dlopen()s it with
// RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND and calls its C ABI (models/detail/spm_shim.h).
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>

#include "models/detail/spm_shim.h"
#include "models/detail/tokenizer_backend.h"

#ifndef TREESERVE_SPM_SHIM_BUILD_PATH
#define TREESERVE_SPM_SHIM_BUILD_PATH ""
#endif

#if defined(__SANITIZE_ADDRESS__)
#define TREESERVE_TOKENIZER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TREESERVE_TOKENIZER_ASAN 1
#endif
#endif

namespace treeserve {
namespace detail {

// The shim's entry points, resolved once per process. The shim is never dlclose()d:
// unloading a library that carries its own protobuf runtime is not worth the risk.
struct SpmApi {
  decltype(&treeserve_spm_load) load;
  decltype(&treeserve_spm_free) free;
  decltype(&treeserve_spm_encode) encode;
  decltype(&treeserve_spm_decode) decode;
  decltype(&treeserve_spm_piece) piece;
  decltype(&treeserve_spm_vocab_size) vocab_size;
  decltype(&treeserve_spm_bos_id) bos_id;
  decltype(&treeserve_spm_eos_id) eos_id;
  decltype(&treeserve_spm_free_buffer) free_buffer;
};

}  // namespace detail

namespace {

constexpr const char* kShimName = "libtreeserve_spm.so";

// ASan refuses RTLD_DEEPBIND (it would bypass its malloc interceptors) and aborts the
// process. Sanitizer builds therefore load the shim without it; they cannot isolate
// sentencepiece's protobuf from gRPC's, so a sanitized binary that also links gRPC
// must not load a tokenizer under ASan (models_tests links no gRPC, so its tokenizer
// tests do run sanitized).
#ifdef TREESERVE_TOKENIZER_ASAN
constexpr int kDlopenFlags = RTLD_NOW | RTLD_LOCAL;
#else
constexpr int kDlopenFlags = RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND;
#endif

bool is_file(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::vector<std::string> shim_candidates() {
  std::vector<std::string> out;
  if (const char* env = std::getenv("TREESERVE_SPM_SHIM"); env != nullptr && *env != '\0') {
    const std::string path = env;
    out.push_back(is_dir(path) ? path + "/" + kShimName : path);
  }
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    const std::string dir = parent_dir(std::string(exe, static_cast<size_t>(n)));
    out.push_back(dir + "/" + kShimName);
    out.push_back(dir + "/../lib/" + kShimName);
  }
  if (*TREESERVE_SPM_SHIM_BUILD_PATH != '\0') out.push_back(TREESERVE_SPM_SHIM_BUILD_PATH);
  return out;
}

StatusOr<const detail::SpmApi*> open_shim() {
  static std::mutex mu;
  static const detail::SpmApi* api = nullptr;  // set once, never freed
  std::lock_guard<std::mutex> lock(mu);
  if (api != nullptr) return api;

  std::string looked;
  for (const std::string& path : shim_candidates()) {
    looked += "\n  " + path;
    if (!is_file(path)) continue;
    void* lib = dlopen(path.c_str(), kDlopenFlags);
    if (lib == nullptr) {
      return Internal(std::string("cannot dlopen tokenizer shim ") + path + ": " + dlerror());
    }
    auto* resolved = new detail::SpmApi;
    bool missing = false;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      missing = missing || fn == nullptr;
    };
    decltype(&treeserve_spm_abi_version) abi_version = nullptr;
    sym(abi_version, "treeserve_spm_abi_version");
    sym(resolved->load, "treeserve_spm_load");
    sym(resolved->free, "treeserve_spm_free");
    sym(resolved->encode, "treeserve_spm_encode");
    sym(resolved->decode, "treeserve_spm_decode");
    sym(resolved->piece, "treeserve_spm_piece");
    sym(resolved->vocab_size, "treeserve_spm_vocab_size");
    sym(resolved->bos_id, "treeserve_spm_bos_id");
    sym(resolved->eos_id, "treeserve_spm_eos_id");
    sym(resolved->free_buffer, "treeserve_spm_free_buffer");
    if (missing || abi_version() != TREESERVE_SPM_ABI_VERSION) {
      delete resolved;
      return Internal("tokenizer shim " + path + " is missing symbols or has another ABI version");
    }
    api = resolved;
    return api;
  }
  return NotFound(std::string("tokenizer shim ") + kShimName +
                  " not found (set TREESERVE_SPM_SHIM to its path); looked in:" + looked);
}

}  // namespace

namespace detail {
namespace {

// "<0xE6>" -> 0xE6; -1 for any other piece.
int byte_piece_value(const std::string& piece) {
  if (piece.size() != 6 || piece.compare(0, 3, "<0x") != 0 || piece[5] != '>') return -1;
  int value = 0;
  for (int i = 3; i < 5; ++i) {
    const char c = piece[size_t(i)];
    int digit = -1;
    if (c >= '0' && c <= '9') digit = c - '0';
    if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

class SpmTokenizer : public TokenizerBackend {
 public:
  SpmTokenizer(const SpmApi* api, TreeserveSpm* handle, std::string model_file)
      : api_(api), handle_(handle), model_file_(std::move(model_file)) {
    vocab_size_ = api_->vocab_size(handle_);
    bos_id_ = api_->bos_id(handle_);
    eos_id_ = api_->eos_id(handle_);
    bytes_.resize(size_t(std::max(0, vocab_size_)));
    for (int32_t id = 0; id < vocab_size_; ++id) {
      const int value = byte_piece_value(id_to_piece(id));
      if (value >= 0) bytes_[size_t(id)] = std::string(1, char(value));
    }
  }
  ~SpmTokenizer() override { api_->free(handle_); }

  StatusOr<std::vector<int32_t>> encode(std::string_view text) const override {
    int32_t* ids = nullptr;
    size_t count = 0;
    char err[512] = {0};
    if (api_->encode(handle_, text.data(), text.size(), &ids, &count, err, sizeof(err)) != 0) {
      return Internal("tokenizer " + model_file_ + ": encode failed: " + err);
    }
    std::vector<int32_t> out(ids, ids + count);
    api_->free_buffer(ids);
    return out;
  }

  // sentencepiece never writes control pieces (<s>, </s>): skip_special changes nothing.
  StatusOr<std::string> decode(const std::vector<int32_t>& ids, bool) const override {
    char* text = nullptr;
    size_t len = 0;
    char err[512] = {0};
    if (api_->decode(handle_, ids.data(), ids.size(), &text, &len, err, sizeof(err)) != 0) {
      return Internal("tokenizer " + model_file_ + ": decode failed: " + err);
    }
    std::string out(text, len);
    api_->free_buffer(text);
    return out;
  }

  std::string id_to_piece(int32_t id) const override {
    char* text = nullptr;
    size_t len = 0;
    if (api_->piece(handle_, id, &text, &len) != 0) return "";
    std::string out(text, len);
    api_->free_buffer(text);
    return out;
  }

  int32_t piece_to_id(std::string_view piece) const override {
    std::call_once(piece_ids_once_, [this] {
      for (int32_t id = 0; id < vocab_size_; ++id) piece_ids_.emplace(id_to_piece(id), id);
    });
    auto it = piece_ids_.find(std::string(piece));
    return it == piece_ids_.end() ? -1 : it->second;
  }

  std::string_view token_bytes(int32_t id) const override {
    return id >= 0 && id < vocab_size_ ? std::string_view(bytes_[size_t(id)]) : std::string_view();
  }
  int32_t vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return bos_id_; }
  int32_t eos_id() const override { return eos_id_; }
  std::string description() const override {
    return model_file_ + " (sentencepiece, " + std::to_string(vocab_size_) + " ids)";
  }

 private:
  const SpmApi* api_;
  TreeserveSpm* handle_;  // owned
  std::string model_file_;
  int32_t vocab_size_ = 0;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  std::vector<std::string> bytes_;  // id -> the byte of a <0xXX> piece, "" for the others
  mutable std::once_flag piece_ids_once_;
  mutable std::unordered_map<std::string, int32_t> piece_ids_;
};

}  // namespace

StatusOr<std::unique_ptr<TokenizerBackend>> load_sentencepiece(const std::string& model_file) {
  if (!is_file(model_file)) {
    return NotFound("tokenizer model " + model_file + ": no such file");
  }
  StatusOr<const SpmApi*> api = open_shim();
  if (!api.ok()) return api.status();
  char err[512] = {0};
  TreeserveSpm* handle = (*api)->load(model_file.c_str(), err, sizeof(err));
  if (handle == nullptr) {
    return InvalidArgument("tokenizer model " + model_file +
                           " is not a valid sentencepiece model: " + err);
  }
  return std::unique_ptr<TokenizerBackend>(new SpmTokenizer(*api, handle, model_file));
}

}  // namespace detail
}  // namespace treeserve
