// WeightUploader: copies blocks of checkpoint tensors (the mapped safetensors bytes, F32 / F16
// / BF16) to device memory in the model dtype, with no float32 copy of the model on the host:
// rows are packed into a pinned buffer (double-buffered, so packing overlaps the DMA), copied
// to the device and, when the checkpoint dtype differs from the model's, converted there.
// A tensor-parallel rank uploads only its slice (a block of rows or of columns).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "engine/cuda_ops.h"
#include "models/safetensors.h"

namespace treeserve::detail {

class WeightUploader {
 public:
  // On the current device; enqueues on `stream`.
  WeightUploader(cuda::Dtype dtype, cudaStream_t stream) : dtype_(dtype), stream_(stream) {}
  ~WeightUploader();
  WeightUploader(const WeightUploader&) = delete;
  WeightUploader& operator=(const WeightUploader&) = delete;

  // dst (T [rows][cols], dense) = t[row0 + i][col0 + j]. t must have exactly `shape` (2-D
  // [R][C], or 1-D [C] with row0 = 0 and rows = 1): INVALID_ARGUMENT naming the tensor
  // otherwise.
  Status upload_block(const TensorView& t, const std::vector<int64_t>& shape, int64_t row0,
                      int64_t rows, int64_t col0, int64_t cols, void* dst);

  // Waits for every upload (the host buffers are reused; the views may go away after this).
  Status finish();

 private:
  static constexpr int kBuffers = 2;
  static constexpr size_t kBufferBytes = size_t(32) << 20;

  Status ensure_buffers(size_t bytes);

  cuda::Dtype dtype_;
  cudaStream_t stream_;
  size_t buffer_bytes_ = 0;
  void* host_[kBuffers] = {};
  void* device_[kBuffers] = {};  // checkpoint-dtype staging for the on-device conversion
  void* done_[kBuffers] = {};    // cudaEvent_t: the buffer's last copy finished
  bool pending_[kBuffers] = {};
  int next_ = 0;
};

}  // namespace treeserve::detail
