// Shared by the GEMM and FP8 GPU tests: a stream, a cuBLAS handle on it and the workspace that
// cuBLAS and LtGemm share (as the backend sets them up), and the skip without a device.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "engine/cuda_backend.h"
#include "engine/detail/cuda_buffers.h"
#include "engine/detail/cuda_gemm.h"

namespace treeserve::testing {

#define REQUIRE_GPU()                                                                 \
  do {                                                                                \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU test skipped"; \
  } while (0)

constexpr size_t kGemmWorkspaceBytes = 32 << 20;

struct Gpu {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  detail::DeviceBuffer workspace;
  Gpu() {
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cublasCreate(&cublas), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasSetStream(cublas, stream), CUBLAS_STATUS_SUCCESS);
    EXPECT_TRUE(workspace.reserve(kGemmWorkspaceBytes, "workspace").ok());
    EXPECT_EQ(cublasSetWorkspace(cublas, workspace.ptr, kGemmWorkspaceBytes),
              CUBLAS_STATUS_SUCCESS);
  }
  ~Gpu() {
    cudaStreamSynchronize(stream);
    cublasDestroy(cublas);
    cudaStreamDestroy(stream);
  }
  Status init(detail::LtGemm* g, bool autotune = true) {
    return g->init(0, cublas, workspace.ptr, kGemmWorkspaceBytes, autotune);
  }
};

}  // namespace treeserve::testing
