// SafetensorsReader: read-only mmap of a Hugging Face checkpoint (one or many
// *.safetensors shards) with by-name tensor lookup; TensorView points straight into
// the mapping. Supported dtypes: F32, F16, BF16 and F8_E4M3 (FP8 checkpoints' linear
// weights, models/fp8.h); to_float converts any of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace treeserve {

enum class DType { kF32, kF16, kBF16, kF8E4M3 };

const char* dtype_name(DType dtype);  // "F32", "F16", "BF16", "F8_E4M3"
size_t dtype_size(DType dtype);       // 4, 2, 2, 1

// A tensor inside a mapped shard. Valid while any copy of its SafetensorsReader lives.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // row-major, little-endian
  size_t nbytes = 0;
  std::string file;  // the shard it lives in (for messages)

  int64_t numel() const;
  std::string shape_string() const;  // "[512, 256]"
};

struct SafetensorsOptions {
  // On a terminal, checkpoints above this size are paged in up front behind a
  // progress bar on stderr; otherwise pages are faulted in lazily and silently.
  size_t progress_min_bytes = size_t{1} << 30;
  bool progress = true;
};

// A cheap, copyable handle: copies share the mappings, which are unmapped when the
// last copy goes away (LlamaWeights keeps one).
class SafetensorsReader {
 public:
  // Opens model_dir/model.safetensors.index.json (its weight_map) when present, else
  // model_dir/model.safetensors, else every *.safetensors in model_dir (sorted).
  static StatusOr<SafetensorsReader> open_dir(const std::string& model_dir,
                                              const SafetensorsOptions& options = {});
  // Opens the given shard files; a tensor name may appear in only one of them.
  static StatusOr<SafetensorsReader> open_files(const std::vector<std::string>& files,
                                                const SafetensorsOptions& options = {});

  // NOT_FOUND naming the tensor (and the files searched) when absent;
  // INVALID_ARGUMENT naming tensor, dtype and file when its dtype is not F32, F16, BF16 or
  // F8_E4M3 (which tensors may have which dtype is load_llama_weights' business).
  StatusOr<TensorView> tensor(const std::string& name) const;
  bool contains(const std::string& name) const;
  std::vector<std::string> tensor_names() const;  // sorted
  const std::vector<std::string>& files() const;
  size_t total_bytes() const;  // sum of the shard file sizes

  struct Impl;

 private:
  explicit SafetensorsReader(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Converts view.numel() elements to float32 into dst. F16 handles subnormals,
// infinities and NaN exactly; BF16 is a shift; F8_E4M3 gives each code's e4m3 value
// (e4m3_to_float, unscaled: the weight_scale is applied by the caller). All are exact.
void to_float(const TensorView& view, float* dst);

float f16_to_f32(uint16_t bits);
float bf16_to_f32(uint16_t bits);

}  // namespace treeserve
