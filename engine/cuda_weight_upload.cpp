// WeightUploader (engine/detail/cuda_weight_upload.h).
#include "engine/detail/cuda_weight_upload.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "engine/detail/cuda_buffers.h"

namespace treeserve::detail {
namespace {

Status cuda_ok(cudaError_t e, const char* what) {
  return cuda_error_status(e, "weight upload", what);
}

bool same_dtype(DType src, cuda::Dtype dst) {
  return (src == DType::kF16 && dst == cuda::Dtype::kFloat16) ||
         (src == DType::kBF16 && dst == cuda::Dtype::kBFloat16);
}

cuda::SrcDtype src_dtype(DType d) {
  switch (d) {
    case DType::kF16:
      return cuda::SrcDtype::kFloat16;
    case DType::kBF16:
      return cuda::SrcDtype::kBFloat16;
    case DType::kF32:
    case DType::kF8E4M3:  // never converted here: FP8 weights are copied as they are
      break;
  }
  return cuda::SrcDtype::kFloat32;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace

WeightUploader::~WeightUploader() {
  for (int b = 0; b < kBuffers; ++b) {
    if (done_[b]) cudaEventSynchronize(static_cast<cudaEvent_t>(done_[b]));
  }
  for (int b = 0; b < kBuffers; ++b) {
    cudaFreeHost(host_[b]);
    cudaFree(device_[b]);
    if (done_[b]) cudaEventDestroy(static_cast<cudaEvent_t>(done_[b]));
  }
}

Status WeightUploader::ensure_buffers(size_t bytes) {
  if (bytes <= buffer_bytes_) return Status::Ok();
  TS_RETURN_IF_ERROR(finish());
  for (int b = 0; b < kBuffers; ++b) {
    cudaFreeHost(host_[b]);
    cudaFree(device_[b]);
    host_[b] = device_[b] = nullptr;
  }
  buffer_bytes_ = 0;
  for (int b = 0; b < kBuffers; ++b) {
    TS_RETURN_IF_ERROR(cuda_ok(cudaMallocHost(&host_[b], bytes), "pinned staging"));
    TS_RETURN_IF_ERROR(cuda_ok(cudaMalloc(&device_[b], bytes), "device staging"));
    if (!done_[b]) {
      cudaEvent_t e;
      TS_RETURN_IF_ERROR(cuda_ok(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event"));
      done_[b] = e;
    }
  }
  buffer_bytes_ = bytes;
  return Status::Ok();
}

Status WeightUploader::upload_block(const TensorView& t, const std::vector<int64_t>& shape,
                                    int64_t row0, int64_t rows, int64_t col0, int64_t cols,
                                    void* dst) {
  if (t.shape != shape || t.data == nullptr) {
    return InvalidArgument("tensor '" + t.name + "' has shape " + t.shape_string() + ", expected " +
                           shape_string(shape));
  }
  const int64_t src_cols = shape.back();
  const int64_t src_rows = shape.size() == 2 ? shape[0] : 1;
  if (row0 < 0 || rows < 0 || row0 + rows > src_rows || col0 < 0 || cols < 0 ||
      col0 + cols > src_cols) {
    return Internal("weight upload: block outside tensor '" + t.name + "'");
  }
  if (rows == 0 || cols == 0) return Status::Ok();
  const size_t es = dtype_size(t.dtype);
  const size_t row_bytes = size_t(cols) * es;
  TS_RETURN_IF_ERROR(ensure_buffers(std::max(kBufferBytes, row_bytes)));
  const bool direct = same_dtype(t.dtype, dtype_);
  const int64_t chunk_rows = int64_t(buffer_bytes_ / row_bytes);
  const char* src = static_cast<const char*>(t.data);
  char* out = static_cast<char*>(dst);
  for (int64_t r = 0; r < rows; r += chunk_rows) {
    const int64_t n = std::min(chunk_rows, rows - r);
    const int b = next_;
    next_ = (next_ + 1) % kBuffers;
    cudaEvent_t done = static_cast<cudaEvent_t>(done_[b]);
    if (pending_[b]) TS_RETURN_IF_ERROR(cuda_ok(cudaEventSynchronize(done), "staging wait"));
    // Pack the block's rows (one memcpy when they are whole rows).
    char* host = static_cast<char*>(host_[b]);
    const char* first = src + (size_t(row0 + r) * size_t(src_cols) + size_t(col0)) * es;
    if (cols == src_cols) {
      std::memcpy(host, first, size_t(n) * row_bytes);
    } else {
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(host + size_t(i) * row_bytes, first + size_t(i) * size_t(src_cols) * es,
                    row_bytes);
      }
    }
    const size_t bytes = size_t(n) * row_bytes;
    char* target = out + size_t(r) * size_t(cols) * 2;  // the model dtype is 2 bytes
    if (direct) {
      TS_RETURN_IF_ERROR(
          cuda_ok(cudaMemcpyAsync(target, host, bytes, cudaMemcpyHostToDevice, stream_), "copy"));
    } else {
      TS_RETURN_IF_ERROR(cuda_ok(
          cudaMemcpyAsync(device_[b], host, bytes, cudaMemcpyHostToDevice, stream_), "copy"));
      cuda::convert_weights(dtype_, src_dtype(t.dtype), device_[b], n * cols, target, stream_);
    }
    TS_RETURN_IF_ERROR(cuda_ok(cudaEventRecord(done, stream_), "event record"));
    pending_[b] = true;
  }
  return Status::Ok();
}

Status WeightUploader::finish() {
  TS_RETURN_IF_ERROR(cuda_ok(cudaStreamSynchronize(stream_), "weight upload"));
  TS_RETURN_IF_ERROR(cuda_ok(cudaGetLastError(), "conversion kernel"));
  for (bool& p : pending_) p = false;
  return Status::Ok();
}

}  // namespace treeserve::detail
