// Helpers for the models/ tests: a self-deleting temp dir, file writing, and a
// minimal safetensors writer so tests build their own checkpoints (good and broken).
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/status.h"
#include "models/model_config.h"

namespace treeserve::testing {

class TempDir {
 public:
  TempDir() {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "treeserve_models_XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A small synthetic Llama model: vocab 16, hidden 8, intermediate 12, 2 layers, 2 heads of 4,
// 1 KV head.
inline ModelConfig small_llama_config(bool tied = false) {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 16;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 4;
  c.tie_word_embeddings = tied;
  return c;
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

struct TestTensor {
  std::string name;
  std::string dtype;  // "F32", "F16", "BF16", "I64", ...
  std::vector<int64_t> shape;
  std::string bytes;  // raw little-endian data
};

template <typename T>
std::string raw_bytes(const std::vector<T>& values) {
  std::string out(values.size() * sizeof(T), '\0');
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

// Serializes tensors in order; `header_override`, when non-empty, replaces the JSON
// header (to write malformed files).
inline std::string safetensors_bytes(const std::vector<TestTensor>& tensors,
                                     const std::string& header_override = "") {
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
  std::string data;
  for (const TestTensor& t : tensors) {
    header += ",\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i > 0) header += ',';  // not `(i ? "," : "") + ...`: GCC 12 -Wrestrict false positive
      header += std::to_string(t.shape[i]);
    }
    header += "],\"data_offsets\":[" + std::to_string(data.size()) + "," +
              std::to_string(data.size() + t.bytes.size()) + "]}";
    data += t.bytes;
  }
  header += "}";
  if (!header_override.empty()) header = header_override;
  while (header.size() % 8 != 0) header += ' ';
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// gtest predicate-ish helper: status has `code` and its message holds every fragment.
inline ::testing::AssertionResult status_is(const Status& s, StatusCode code,
                                            const std::vector<std::string>& fragments) {
  if (s.code() != code) {
    return ::testing::AssertionFailure()
           << "expected " << StatusCodeName(code) << ", got " << s.ToString();
  }
  for (const std::string& f : fragments) {
    if (s.message().find(f) == std::string::npos) {
      return ::testing::AssertionFailure() << "message lacks '" << f << "': " << s.ToString();
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace treeserve::testing
