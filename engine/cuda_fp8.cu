// FP8 quantization kernels (engine/cuda_fp8.h). One block per row: the row's largest |x|
// (a max, exact in any order), then every element divided by the row's scale and rounded to
// e4m3 by the hardware conversion (cvt.rn.satfinite.e4m3x2.f32 on sm_89+). The quantize
// kernels go out as programmatic dependent launches (kernels/detail/pdl_launch.cuh): each waits
// for the kernel that wrote its input, then lets the FP8 GEMM after it start loading weights.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/cuda_fp8.h"
#include "kernels/detail/pdl_launch.cuh"

namespace treeserve::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load_f(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ float load_f(const float* p, int64_t i) { return p[i]; }

__device__ __forceinline__ uint8_t to_e4m3(float v) {
  return uint8_t(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ float block_max(float v) {
  __shared__ float warp_max[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) warp_max[0] = v;
  }
  __syncthreads();
  return warp_max[0];
}

template <typename T>
__global__ void quantize_rows_kernel(const T* x, int64_t cols, uint8_t* q, float* scale) {
  detail::pdl_wait();
  detail::pdl_trigger();
  const int64_t r = blockIdx.x;
  const T* row = x + r * cols;
  float amax = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) amax = fmaxf(amax, fabsf(load_f(row, c)));
  amax = block_max(amax);
  // fmaxf drops NaN, so a row with NaNs gets the scale of its numbers; the NaNs stay NaN.
  const float s = amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f;
  if (threadIdx.x == 0) scale[r] = s;
  uint8_t* out = q + r * cols;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads)
    out[c] = to_e4m3(__fdiv_rn(load_f(row, c), s));
}

template <typename T>
__global__ void quantize_rows_static_kernel(const T* x, int64_t cols, const float* s_ptr,
                                            uint8_t* q, float* row_scale) {
  detail::pdl_wait();
  detail::pdl_trigger();
  const int64_t r = blockIdx.x;
  const float s = *s_ptr;
  if (threadIdx.x == 0) row_scale[r] = s;
  const T* row = x + r * cols;
  uint8_t* out = q + r * cols;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads)
    out[c] = to_e4m3(__fdiv_rn(load_f(row, c), s));
}

__global__ void dequantize_rows_kernel(const uint8_t* q, const float* scale, int64_t cols,
                                       float* x) {
  const int64_t r = blockIdx.x;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(q[r * cols + c]), __NV_E4M3);
    x[r * cols + c] = __half2float(__half(h)) * scale[r];
  }
}

}  // namespace

void quantize_rows_fp8(Dtype dt, const void* x, int64_t rows, int64_t cols, uint8_t* q,
                       float* scale, cudaStream_t stream) {
  if (rows == 0) return;
  if (dt == Dtype::kFloat16) {
    detail::launch_pdl(dim3(unsigned(rows)), dim3(kThreads), 0, stream,
                       quantize_rows_kernel<__half>, static_cast<const __half*>(x), cols, q, scale);
  } else {
    detail::launch_pdl(dim3(unsigned(rows)), dim3(kThreads), 0, stream,
                       quantize_rows_kernel<__nv_bfloat16>, static_cast<const __nv_bfloat16*>(x),
                       cols, q, scale);
  }
}

void quantize_rows_fp8_f32(const float* x, int64_t rows, int64_t cols, uint8_t* q, float* scale,
                           cudaStream_t stream) {
  if (rows == 0) return;
  detail::launch_pdl(dim3(unsigned(rows)), dim3(kThreads), 0, stream, quantize_rows_kernel<float>,
                     x, cols, q, scale);
}

void quantize_rows_fp8_static(Dtype dt, const void* x, int64_t rows, int64_t cols, const float* s,
                              uint8_t* q, float* row_scale, cudaStream_t stream) {
  if (rows == 0) return;
  if (dt == Dtype::kFloat16) {
    detail::launch_pdl(dim3(unsigned(rows)), dim3(kThreads), 0, stream,
                       quantize_rows_static_kernel<__half>, static_cast<const __half*>(x), cols, s,
                       q, row_scale);
  } else {
    detail::launch_pdl(dim3(unsigned(rows)), dim3(kThreads), 0, stream,
                       quantize_rows_static_kernel<__nv_bfloat16>,
                       static_cast<const __nv_bfloat16*>(x), cols, s, q, row_scale);
  }
}

void dequantize_rows_fp8(const uint8_t* q, const float* scale, int64_t rows, int64_t cols, float* x,
                         cudaStream_t stream) {
  if (rows == 0) return;
  dequantize_rows_kernel<<<unsigned(rows), kThreads, 0, stream>>>(q, scale, cols, x);
}

}  // namespace treeserve::cuda
