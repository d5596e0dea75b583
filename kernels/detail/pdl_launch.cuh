// Programmatic dependent launch (PDL) for the project's .cu files (CUDA code only).
//
// A grid launched with launch_pdl may be scheduled while the previous kernel on its stream
// drains, which hides its launch latency (also inside a CUDA graph, where the dependency is
// captured as a programmatic edge). Such a kernel must call pdl_wait() before it reads what
// the previous kernel wrote or writes what it reads; until then only inputs that were ready
// before the previous kernel started (the plan, weights) may be touched. A previous kernel
// may call pdl_trigger() once its remaining work no longer matters to the next one.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

namespace treeserve::detail {

// Before sm_90 there is no programmatic launch (the attribute below is ignored there and the
// launch waits for the previous kernel as usual), so both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// pdl_trigger() where `when` is nonzero, as one predicated instruction (no branch), and without
// ordering the caller's memory accesses around it: for a kernel's prologue whose dependent
// reads nothing the caller writes.
__device__ __forceinline__ void pdl_trigger_if(int when) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.s32 p, %0, 0;\n @p griddepcontrol.launch_dependents;\n}\n" ::"r"(
          when));
#endif
}

// Whether `kernel` may go out as a programmatic launch on the current device: its code there
// comes from PTX of sm_90 or later. A build for older GPUs only (pdl_wait() a no-op), JIT-
// compiled for a Hopper, would start before the kernel it depends on has finished. Cached per
// (kernel, device).
inline bool pdl_capable(const void* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, bool> known;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, fresh] = known.try_emplace({kernel, device}, false);
  if (fresh) {
    cudaFuncAttributes a{};
    it->second = cudaFuncGetAttributes(&a, kernel) == cudaSuccess && a.ptxVersion >= 90;
  }
  return it->second;
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization (where
// pdl_capable; a plain launch elsewhere), in thread-block clusters of *cluster blocks where
// cluster is set. Returns the launch's error (cudaSuccess when enqueued).
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl_impl(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                            const dim3* cluster, void (*kernel)(KArgs...), Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned n = 0;
  if (cluster != nullptr) {
    attribute[n].id = cudaLaunchAttributeClusterDimension;
    attribute[n].val.clusterDim.x = cluster->x;
    attribute[n].val.clusterDim.y = cluster->y;
    attribute[n].val.clusterDim.z = cluster->z;
    ++n;
  }
  if (pdl_capable(reinterpret_cast<const void*>(kernel))) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  config.attrs = attribute;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, static_cast<KArgs>(args)...);
}

template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       void (*kernel)(KArgs...), Args... args) {
  return launch_pdl_impl(grid, block, smem, stream, nullptr, kernel, args...);
}

// The same in thread-block clusters of `cluster` blocks.
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl_cluster(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                               dim3 cluster, void (*kernel)(KArgs...), Args... args) {
  return launch_pdl_impl(grid, block, smem, stream, &cluster, kernel, args...);
}

}  // namespace treeserve::detail
