// SequenceParallelAttention (sequence_parallel_attention.h): per-rank resources, the local half
// of a step (launch_tree_attention_state on every rank) and the combine: one peer-to-peer
// kernel per rank where all devices have peer access, else two NCCL all-reduces around the
// kernels of detail/sequence_parallel_combine.h.
//
// One thread drives every rank: each collective is issued for all communicators inside one
// ncclGroupStart/End (NCCL's single-thread, multi-device pattern), which is also where the only
// host waits of a step are. Buffers per rank, for n = queries x q heads (query, q head) pairs:
//   state   float [n][head_dim] O, then float [n] w: one sum all-reduce carries both (w after
//           O rather than interleaved as [n][head_dim + 1], so the merge writes O as float4)
//   lse     float [n]  the rank's LSE (base 2)
//   lse_max float [n]  the all-reduced max
#include "kernels/sequence_parallel_attention.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "kernels/detail/peer_access.h"
#include "kernels/detail/sequence_parallel_combine.h"
#include "kernels/detail/tree_attention_layout.h"

namespace treeserve {

struct SequenceParallelAttention::Rank {
  int32_t device = 0;
  cudaStream_t stream = nullptr;
  ncclComm_t comm = nullptr;
  TreeAttentionWorkspace workspace;
  float* state = nullptr;
  float* lse = nullptr;
  float* lse_max = nullptr;
  // Peer-to-peer combine: two (O, LSE) state sets, alternating per step, and the barrier's
  // flags [kSpP2PBlocks][kSpMaxRanks] then counters [kSpP2PBlocks] (one allocation).
  float* p2p_o[2] = {nullptr, nullptr};
  float* p2p_lse[2] = {nullptr, nullptr};
  uint32_t* p2p_flags = nullptr;
};

namespace {

Status cuda_error(const std::string& what, cudaError_t e) {
  return Internal(what + ": " + cudaGetErrorString(e));
}

#define TS_CUDA_RETURN(what, expr)                        \
  do {                                                    \
    const cudaError_t _e = (expr);                        \
    if (_e != cudaSuccess) return cuda_error((what), _e); \
  } while (0)

// Restores the calling thread's current device when it goes out of scope.
class DeviceGuard {
 public:
  DeviceGuard() { cudaGetDevice(&device_); }
  ~DeviceGuard() { cudaSetDevice(device_); }

 private:
  int device_ = 0;
};

}  // namespace

SequenceParallelAttention::SequenceParallelAttention() = default;
SequenceParallelAttention::~SequenceParallelAttention() { release(); }

int32_t SequenceParallelAttention::device(int32_t rank) const { return ranks_[rank]->device; }
cudaStream_t SequenceParallelAttention::stream(int32_t rank) const { return ranks_[rank]->stream; }
const TreeAttentionWorkspace& SequenceParallelAttention::workspace(int32_t rank) const {
  return ranks_[rank]->workspace;
}

void SequenceParallelAttention::release() {
  // Errors are ignored: release also runs from the destructor, possibly after a failed step.
  DeviceGuard guard;
  for (const std::unique_ptr<Rank>& r : ranks_) {
    cudaSetDevice(r->device);
    if (r->stream != nullptr) cudaStreamSynchronize(r->stream);
    r->workspace.release();
    for (void* p : {static_cast<void*>(r->state), static_cast<void*>(r->lse),
                    static_cast<void*>(r->lse_max), static_cast<void*>(r->p2p_o[0]),
                    static_cast<void*>(r->p2p_o[1]), static_cast<void*>(r->p2p_lse[0]),
                    static_cast<void*>(r->p2p_lse[1]), static_cast<void*>(r->p2p_flags)}) {
      if (p != nullptr) cudaFree(p);
    }
    if (r->stream != nullptr) cudaStreamDestroy(r->stream);
    if (r->comm != nullptr && !aborted_) ncclCommDestroy(r->comm);
  }
  ranks_.clear();
  aborted_ = false;
  p2p_ = false;
  step_ = 0;
}

void SequenceParallelAttention::abort_communicators() {
  if (aborted_) return;
  for (const std::unique_ptr<Rank>& r : ranks_) {
    if (r->comm != nullptr) ncclCommAbort(r->comm);
  }
  aborted_ = true;
}

Status SequenceParallelAttention::init(const std::vector<int32_t>& devices,
                                       const TreeAttentionLimits& limits) {
  release();
  int count = 0;
  TS_CUDA_RETURN("cudaGetDeviceCount", cudaGetDeviceCount(&count));
  if (devices.empty()) return InvalidArgument("SequenceParallelAttention: no devices");
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] < 0 || devices[i] >= count ||
        std::count(devices.begin(), devices.end(), devices[i]) > 1) {
      return InvalidArgument("SequenceParallelAttention: devices[" + std::to_string(i) + "] = " +
                             std::to_string(devices[i]) + " is not a distinct device of the " +
                             std::to_string(count) + " present");
    }
  }
  // NVLink multicast (NVLS) stays off unless the operator set it: on shared hosts it can take
  // the GPUs out of service, and these all-reduces are far too small to gain from it.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  const int world = int(devices.size());
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  const ncclResult_t nr = ncclCommInitAll(comms.data(), world, devices.data());
  if (nr != ncclSuccess) {
    return Unavailable("SequenceParallelAttention: NCCL could not connect " +
                       std::to_string(world) + " devices: " + ncclGetErrorString(nr));
  }
  limits_ = limits;
  DeviceGuard guard;
  const size_t pairs = size_t(limits.max_queries) * limits.max_num_q_heads;
  for (int r = 0; r < world; ++r) {
    ranks_.push_back(std::make_unique<Rank>());
    Rank& rank = *ranks_.back();
    rank.device = devices[size_t(r)];
    rank.comm = comms[size_t(r)];
  }
  for (const std::unique_ptr<Rank>& r : ranks_) {
    const std::string where = " (device " + std::to_string(r->device) + ")";
    TS_CUDA_RETURN("cudaSetDevice" + where, cudaSetDevice(r->device));
    TS_CUDA_RETURN("cudaStreamCreate" + where,
                   cudaStreamCreateWithFlags(&r->stream, cudaStreamNonBlocking));
    TS_RETURN_IF_ERROR(r->workspace.init(limits));
    TS_CUDA_RETURN("cudaMalloc(state)" + where,
                   cudaMalloc(&r->state, pairs * (size_t(limits.max_head_dim) + 1) * 4));
    TS_CUDA_RETURN("cudaMalloc(lse)" + where, cudaMalloc(&r->lse, pairs * 4));
    TS_CUDA_RETURN("cudaMalloc(lse_max)" + where, cudaMalloc(&r->lse_max, pairs * 4));
  }
  return init_peer_to_peer(pairs);
}

// The peer-to-peer combine when every device reaches every other's memory (else NCCL's).
Status SequenceParallelAttention::init_peer_to_peer(size_t pairs) {
  if (world() > detail::kSpMaxRanks) return Status::Ok();
  for (const std::unique_ptr<Rank>& a : ranks_) {
    for (const std::unique_ptr<Rank>& b : ranks_) {
      if (a == b) continue;
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, a->device, b->device) != cudaSuccess || !can) {
        cudaGetLastError();
        return Status::Ok();
      }
    }
  }
  for (const std::unique_ptr<Rank>& a : ranks_) {
    for (const std::unique_ptr<Rank>& b : ranks_) {
      if (a != b) {
        TS_CUDA_RETURN("cudaDeviceEnablePeerAccess",
                       detail::enable_peer_access(a->device, b->device));
      }
    }
    TS_CUDA_RETURN("cudaSetDevice", cudaSetDevice(a->device));
    for (int parity = 0; parity < 2; ++parity) {
      TS_CUDA_RETURN("cudaMalloc(p2p o)",
                     cudaMalloc(&a->p2p_o[parity], pairs * size_t(limits_.max_head_dim) * 4));
      TS_CUDA_RETURN("cudaMalloc(p2p lse)", cudaMalloc(&a->p2p_lse[parity], pairs * 4));
    }
    const size_t words = size_t(detail::kSpP2PBlocks) * (detail::kSpMaxRanks + 1);
    TS_CUDA_RETURN("cudaMalloc(p2p flags)", cudaMalloc(&a->p2p_flags, words * 4));
    TS_CUDA_RETURN("cudaMemset(p2p flags)", cudaMemset(a->p2p_flags, 0, words * 4));
    TS_CUDA_RETURN("cudaDeviceSynchronize", cudaDeviceSynchronize());
  }
  p2p_ = true;
  return Status::Ok();
}

Status SequenceParallelAttention::upload(const std::vector<AttentionPlan>& shards) {
  if (!initialized()) return FailedPrecondition("SequenceParallelAttention::upload before init");
  if (int32_t(shards.size()) != world()) {
    return InvalidArgument("SequenceParallelAttention::upload: " + std::to_string(shards.size()) +
                           " shards for " + std::to_string(world()) + " ranks");
  }
  for (size_t r = 1; r < shards.size(); ++r) {
    if (shards[r].query_rows != shards[0].query_rows) {
      return InvalidArgument("SequenceParallelAttention::upload: shards[" + std::to_string(r) +
                             "] has other queries than shards[0] (not one split)");
    }
  }
  DeviceGuard guard;
  for (int32_t r = 0; r < world(); ++r) {
    TS_CUDA_RETURN("cudaSetDevice", cudaSetDevice(ranks_[r]->device));
    TS_RETURN_IF_ERROR(ranks_[r]->workspace.upload(shards[r], ranks_[r]->stream));
  }
  return Status::Ok();
}

Status SequenceParallelAttention::check_tensors(const std::vector<RankTensors>& tensors,
                                                int32_t num_q_heads, int32_t head_dim) const {
  if (!initialized()) return FailedPrecondition("SequenceParallelAttention: not initialized");
  if (aborted_) {
    return FailedPrecondition(
        "SequenceParallelAttention: an earlier combine failed and the NCCL communicators were "
        "aborted; init again");
  }
  if (int32_t(tensors.size()) != world()) {
    return InvalidArgument("SequenceParallelAttention: " + std::to_string(tensors.size()) +
                           " rank tensors for " + std::to_string(world()) + " ranks");
  }
  if (num_q_heads < 1 || num_q_heads > limits_.max_num_q_heads || head_dim % 4 != 0 ||
      head_dim > limits_.max_head_dim) {
    return InvalidArgument(
        "SequenceParallelAttention: num_q_heads = " + std::to_string(num_q_heads) +
        " / head_dim = " + std::to_string(head_dim) + " do not fit the state buffers");
  }
  for (size_t r = 0; r < tensors.size(); ++r) {
    if (tensors[r].out == nullptr) {
      return InvalidArgument("SequenceParallelAttention: tensors[" + std::to_string(r) +
                             "].out is null");
    }
  }
  return Status::Ok();
}

Status SequenceParallelAttention::launch(const std::vector<RankTensors>& tensors,
                                         TreeAttentionDtype dtype, int32_t num_q_heads,
                                         int32_t num_kv_heads, int32_t head_dim, int32_t page_size,
                                         float sm_scale) {
  TS_RETURN_IF_ERROR(
      launch_local(tensors, dtype, num_q_heads, num_kv_heads, head_dim, page_size, sm_scale));
  return combine(tensors, dtype, num_q_heads, head_dim);
}

Status SequenceParallelAttention::launch_local(const std::vector<RankTensors>& tensors,
                                               TreeAttentionDtype dtype, int32_t num_q_heads,
                                               int32_t num_kv_heads, int32_t head_dim,
                                               int32_t page_size, float sm_scale) {
  TS_RETURN_IF_ERROR(check_tensors(tensors, num_q_heads, head_dim));
  DeviceGuard guard;
  const bool p2p = peer_to_peer();
  if (p2p) parity_ = int(step_++ & 1);  // the state set this step writes (see combine)
  for (int32_t r = 0; r < world(); ++r) {
    Rank& rank = *ranks_[r];
    const RankTensors& t = tensors[r];
    TS_CUDA_RETURN("cudaSetDevice", cudaSetDevice(rank.device));
    TS_RETURN_IF_ERROR(launch_tree_attention_state(
        t.q, t.k_pool, t.v_pool, p2p ? rank.p2p_o[parity_] : rank.state,
        p2p ? rank.p2p_lse[parity_] : rank.lse, dtype, num_q_heads, num_kv_heads, head_dim,
        page_size, sm_scale, rank.workspace, rank.stream));
  }
  return Status::Ok();
}

Status SequenceParallelAttention::combine(const std::vector<RankTensors>& tensors,
                                          TreeAttentionDtype dtype, int32_t num_q_heads,
                                          int32_t head_dim) {
  TS_RETURN_IF_ERROR(check_tensors(tensors, num_q_heads, head_dim));
  const int32_t num_queries = ranks_[0]->workspace.num_queries();
  for (const std::unique_ptr<Rank>& r : ranks_) {
    if (r->workspace.num_queries() != num_queries) {
      return FailedPrecondition(
          "SequenceParallelAttention: the ranks' uploaded plans differ in "
          "queries (upload one split's shards)");
    }
  }
  const size_t n = size_t(num_queries) * num_q_heads;
  if (n == 0) return Status::Ok();
  auto nccl_failed = [&](const char* what, ncclResult_t e) {
    std::string message =
        std::string("SequenceParallelAttention: ") + what + ": " + ncclGetErrorString(e);
    for (const std::unique_ptr<Rank>& r : ranks_) {
      const char* last = ncclGetLastError(r->comm);
      if (last != nullptr && *last != '\0') {
        message += " (device " + std::to_string(r->device) + ": " + last + ")";
        break;
      }
    }
    // Some ranks' collectives may be enqueued without their peers': abort so none waits forever.
    abort_communicators();
    return Internal(message);
  };
  auto kernel_failed = [&](Status s) {
    abort_communicators();  // the peers' next collective would wait for this rank
    return s;
  };
  DeviceGuard guard;
  if (peer_to_peer()) {
    // One kernel per rank reads every rank's state of this step over NVLink.
    detail::SpP2PCombine args;
    args.world = world();
    for (int32_t s = 0; s < world(); ++s) {
      args.o[s] = ranks_[s]->p2p_o[parity_];
      args.lse[s] = ranks_[s]->p2p_lse[parity_];
      args.flags[s] = ranks_[s]->p2p_flags;
    }
    for (int32_t i = 0; i < world(); ++i) {
      Rank& r = *ranks_[i];
      TS_CUDA_RETURN("cudaSetDevice", cudaSetDevice(r.device));
      args.rank = i;
      args.counters = r.p2p_flags + detail::kSpP2PBlocks * detail::kSpMaxRanks;
      const int32_t* query_rows = static_cast<const int32_t*>(r.workspace.device_plan()) +
                                  r.workspace.plan_header()[detail::kQueryRows];
      TS_RETURN_IF_ERROR(detail::enqueue_p2p_combine(args, query_rows, tensors[i].out, dtype,
                                                     num_queries, num_q_heads, head_dim, r.stream));
    }
    return Status::Ok();
  }

  // M = max over ranks of each pair's LSE.
  ncclResult_t e = ncclGroupStart();
  for (const std::unique_ptr<Rank>& r : ranks_) {
    if (e == ncclSuccess) {
      e = ncclAllReduce(r->lse, r->lse_max, n, ncclFloat32, ncclMax, r->comm, r->stream);
    }
  }
  const ncclResult_t end = ncclGroupEnd();
  if (e != ncclSuccess) return nccl_failed("ncclAllReduce(max LSE)", e);
  if (end != ncclSuccess) return nccl_failed("ncclGroupEnd(max LSE)", end);

  // O *= w, w = 2^(LSE - M), then (O w, w) summed over ranks in one collective.
  for (const std::unique_ptr<Rank>& r : ranks_) {
    TS_CUDA_RETURN("cudaSetDevice", cudaSetDevice(r->device));
    const Status s = detail::enqueue_scale_states(
        r->state, r->lse, r->lse_max, r->state + n * head_dim, int64_t(n), head_dim, r->stream);
    if (!s.ok()) return kernel_failed(s);
  }
  e = ncclGroupStart();
  for (const std::unique_ptr<Rank>& r : ranks_) {
    if (e == ncclSuccess) {
      e = ncclAllReduce(r->state, r->state, n * (size_t(head_dim) + 1), ncclFloat32, ncclSum,
                        r->comm, r->stream);
    }
  }
  const ncclResult_t end2 = ncclGroupEnd();
  if (e != ncclSuccess) return nccl_failed("ncclAllReduce(sum O w, w)", e);
  if (end2 != ncclSuccess) return nccl_failed("ncclGroupEnd(sum O w, w)", end2);

  // out[query_rows[q]] = O_sum / w_sum; query_rows from the uploaded plan on each device.
  for (int32_t i = 0; i < world(); ++i) {
    Rank& r = *ranks_[i];
    TS_CUDA_RETURN("cudaSetDevice", cudaSetDevice(r.device));
    const int32_t* query_rows = static_cast<const int32_t*>(r.workspace.device_plan()) +
                                r.workspace.plan_header()[detail::kQueryRows];
    TS_RETURN_IF_ERROR(detail::enqueue_write_combined(r.state, r.state + n * head_dim, query_rows,
                                                      tensors[i].out, dtype, num_queries,
                                                      num_q_heads, head_dim, r.stream));
  }
  return Status::Ok();
}

}  // namespace treeserve
