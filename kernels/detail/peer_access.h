// Peer access between the GPUs of one process, for the peer-to-peer collectives (tensor-parallel
// all-reduce, sequence-parallel combine). cudaDeviceEnablePeerAccess fails with "already
// enabled" on a second call for the same pair (and compute-sanitizer reports each such call),
// so the pairs enabled so far are remembered process-wide. Host code; needs cuda_runtime.h.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <set>
#include <utility>

namespace treeserve::detail {

// Lets `device` map `peer`'s memory. The caller's current device is kept.
inline cudaError_t enable_peer_access(int device, int peer) {
  static std::mutex mu;
  static std::set<std::pair<int, int>> enabled;
  std::lock_guard<std::mutex> lock(mu);
  if (enabled.count({device, peer}) != 0) return cudaSuccess;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {  // enabled by someone else in this process
    cudaGetLastError();
    e = cudaSuccess;
  }
  cudaSetDevice(previous);
  if (e == cudaSuccess) enabled.insert({device, peer});
  return e;
}

}  // namespace treeserve::detail
