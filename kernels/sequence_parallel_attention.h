// Sequence-parallel tree attention over the GPUs of one process (Tree Attention,
// papers/tree-attention-multigpu.txt): each rank holds the KV pages of its shard of the step's
// plan (split_plan_for_sequence_parallel, kernels/sequence_parallel.h), runs stage 1 over them
// and merges its partials into one float32 state (O, LSE) per (query, q head)
// (launch_tree_attention_state); the ranks then combine their states exactly, as the paper's
// all-reduces do:
//   M = all-reduce(max) of LSE;  w = 2^(LSE - M);  (O w, w) all-reduced by sum;  out = sum / sum
// so every rank ends with the full attention output of every query.
//
// SequenceParallelAttention owns, per rank, a stream, a TreeAttentionWorkspace, the state
// buffers, and an NCCL communicator (ncclCommInitAll: one process drives every device, its
// collectives issued from the calling thread in NCCL groups). Where every device has peer
// access to every other, the combine is instead one kernel per rank that meets the peers at a
// flag barrier and reads their states over NVLink (detail/sequence_parallel_combine.h): the
// same sums, one launch instead of two all-reduces and two kernels. NVLink multicast (NVLS) is
// kept off unless the operator set NCCL_NVLS_ENABLE. Kernel level only: not wired into the
// engine.
//
// Plain C++: no CUDA or NCCL types (streams are cudaStream_t, forward declared in
// tree_attention.h).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "kernels/attention_plan.h"
#include "kernels/tree_attention.h"

namespace treeserve {

class SequenceParallelAttention {
 public:
  SequenceParallelAttention();
  ~SequenceParallelAttention();
  SequenceParallelAttention(const SequenceParallelAttention&) = delete;
  SequenceParallelAttention& operator=(const SequenceParallelAttention&) = delete;

  // One rank per entry of devices (distinct CUDA ordinals; rank r runs on devices[r]): the
  // communicators, and per rank a non-blocking stream, a workspace with limits and state buffers
  // for limits.max_queries x max_num_q_heads x (max_head_dim + 3) floats. UNAVAILABLE when NCCL
  // cannot connect the devices, INVALID_ARGUMENT for a bad device list.
  Status init(const std::vector<int32_t>& devices, const TreeAttentionLimits& limits);
  // Waits for the ranks' streams and frees everything (also run by the destructor).
  void release();
  bool initialized() const { return !ranks_.empty(); }

  int32_t world() const { return int32_t(ranks_.size()); }
  int32_t device(int32_t rank) const;
  // The stream rank r's work runs on: inputs must be ready in its order (write them there, or
  // make it wait for an event), and the output is ready in its order.
  cudaStream_t stream(int32_t rank) const;
  const TreeAttentionWorkspace& workspace(int32_t rank) const;

  // Uploads shards[r] (one split's shards: same queries) into rank r's workspace, on its stream.
  Status upload(const std::vector<AttentionPlan>& shards);

  // Rank r's device tensors.
  struct RankTensors {
    const void* q = nullptr;       // [num_rows][num_q_heads][head_dim], the same on every rank
    const void* k_pool = nullptr;  // [num_pages][num_kv_heads][page_size][head_dim]: only the
    const void* v_pool = nullptr;  //   pages plan_read_pages(shard r) names are read
    void* out = nullptr;           // [num_rows][num_q_heads][head_dim]: the queries' rows written
  };

  // One step for the uploaded shards, enqueued on the ranks' streams: launch_local, then
  // combine. tensors[r] for rank r; dtype and shapes as in launch_tree_attention. Nothing waits
  // on the host but what NCCL's group calls do.
  Status launch(const std::vector<RankTensors>& tensors, TreeAttentionDtype dtype,
                int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim, int32_t page_size,
                float sm_scale);

  // The combine in use: peer to peer (one kernel per rank reading the peers' states over
  // NVLink; chosen by init when every device has peer access to every other) or NCCL.
  // use_nccl_combine(true) forces NCCL (benchmark comparisons; call it between steps only).
  bool peer_to_peer() const { return p2p_ && !force_nccl_; }
  void use_nccl_combine(bool force) { force_nccl_ = force; }

  // The two halves of launch (so a benchmark can time them apart). launch_local: per rank, stage
  // 1 over its shard and the merge into its state buffers. combine: the all-reduces and kernels
  // that turn the ranks' states into out on every rank (tensors' out only).
  Status launch_local(const std::vector<RankTensors>& tensors, TreeAttentionDtype dtype,
                      int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                      int32_t page_size, float sm_scale);
  Status combine(const std::vector<RankTensors>& tensors, TreeAttentionDtype dtype,
                 int32_t num_q_heads, int32_t head_dim);

 private:
  struct Rank;  // stream, communicator, workspace, buffers (sequence_parallel_attention.cpp)
  Status check_tensors(const std::vector<RankTensors>& tensors, int32_t num_q_heads,
                       int32_t head_dim) const;
  void abort_communicators();
  Status init_peer_to_peer(size_t pairs);

  std::vector<std::unique_ptr<Rank>> ranks_;
  TreeAttentionLimits limits_;
  bool aborted_ = false;  // a collective failed: the communicators were aborted
  bool p2p_ = false;      // peer-to-peer combine set up
  bool force_nccl_ = false;
  uint64_t step_ = 0;  // peer-to-peer steps so far: their parity picks the state set
  int parity_ = 0;     // the state set of the current step
};

}  // namespace treeserve
