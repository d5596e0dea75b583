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

namespace treeserve::detail {

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization.
// Returns the launch's error (cudaSuccess when enqueued).
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       void (*kernel)(KArgs...), Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<KArgs>(args)...);
}

}  // namespace treeserve::detail
