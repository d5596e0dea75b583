// Host-side CUDA helpers of the CUDA backend's .cpp files (not for .cu files or headers that
// plain C++ code includes): CUDA errors as Status, and grow-only device and pinned buffers.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <string>

#include "common/status.h"

namespace treeserve::detail {

// Ok for cudaSuccess; RESOURCE_EXHAUSTED for an allocation failure; INTERNAL with CUDA's
// message otherwise. `who` names the component ("CUDA backend"), `what` the call.
inline Status cuda_error_status(cudaError_t e, const char* who, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  if (e == cudaErrorMemoryAllocation) {
    return ResourceExhausted(std::string(who) + ": out of memory (" + what + ")");
  }
  return Internal(std::string(who) + ": " + what + ": " + cudaGetErrorString(e));
}

// A device buffer that only grows (step scratch): reallocated, 1.5x, when a step needs more.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }
  void release() {
    cudaFree(ptr);
    ptr = nullptr;
    bytes = 0;
  }
  Status reserve(size_t want, const char* what) {
    if (want <= bytes) return Status::Ok();
    const size_t grown = std::max(want, bytes * 3 / 2);
    release();
    const cudaError_t e = cudaMalloc(&ptr, grown);
    if (e != cudaSuccess) {
      cudaGetLastError();  // not left pending for the next step's launch check
      ptr = nullptr;
      return cuda_error_status(e, "CUDA backend", what);
    }
    bytes = grown;
    return Status::Ok();
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

// Pinned host memory that only grows (twice the request, so later steps rarely regrow).
// portable: usable by the streams of every device (cudaHostAllocPortable).
struct PinnedBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  bool portable = false;
  PinnedBuffer() = default;
  explicit PinnedBuffer(bool portable_memory) : portable(portable_memory) {}
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { release(); }
  void release() {
    cudaFreeHost(ptr);
    ptr = nullptr;
    bytes = 0;
  }
  Status reserve(size_t want, const char* what) {
    if (want <= bytes) return Status::Ok();
    release();
    const cudaError_t e =
        cudaHostAlloc(&ptr, want * 2, portable ? cudaHostAllocPortable : cudaHostAllocDefault);
    if (e != cudaSuccess) {
      cudaGetLastError();
      ptr = nullptr;
      return ResourceExhausted("CUDA backend: cannot allocate " + std::to_string(want * 2) +
                               " bytes of pinned memory (" + what + ")");
    }
    bytes = want * 2;
    return Status::Ok();
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

}  // namespace treeserve::detail
