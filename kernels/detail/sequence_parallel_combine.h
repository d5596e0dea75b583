// The two small kernels of the sequence-parallel combine (sequence_parallel_combine.cu), which
// SequenceParallelAttention (kernels/sequence_parallel_attention.h) runs around its two NCCL
// all-reduces. Per rank, with n = queries x num_q_heads (query, q head) pairs and the rank's
// merged states from launch_tree_attention_state:
//   1. all-reduce(max) of lse [n] -> lse_max [n]
//   2. enqueue_scale_states: w = 2^(lse - lse_max), o [n][head_dim] *= w, w [n] written
//   3. all-reduce(sum) of o and w together (w follows o in one buffer: one collective)
//   4. enqueue_write_combined: out[query_rows[q]][h] = o / w in the model dtype
// Plain declarations (cudaStream_t as forward declared by tree_attention.h).
#pragma once

#include <cstdint>

#include "common/status.h"
#include "kernels/tree_attention.h"

namespace treeserve::detail {

// o: float [n][head_dim] (scaled in place); lse, lse_max: float [n] (base 2); w: float [n].
// A pair whose lse_max is -inf (no rank saw a token) gets w = 0. head_dim % 4 == 0.
Status enqueue_scale_states(float* o, const float* lse, const float* lse_max, float* w, int64_t n,
                            int32_t head_dim, cudaStream_t stream);

// o_sum: float [num_queries][num_q_heads][head_dim]; w_sum: float [num_queries][num_q_heads];
// query_rows: int32 [num_queries] (device); out: dtype [num_rows][num_q_heads][head_dim], only
// the queries' rows written (zeros where w_sum is 0). head_dim % 4 == 0.
Status enqueue_write_combined(const float* o_sum, const float* w_sum, const int32_t* query_rows,
                              void* out, TreeAttentionDtype dtype, int32_t num_queries,
                              int32_t num_q_heads, int32_t head_dim, cudaStream_t stream);

// Peer-to-peer combine (all devices with peer access): one kernel per rank replaces steps 1-4.
// It goes out as a programmatic launch and waits for the kernel before it (the local merge,
// which lets it be scheduled early). Block b meets block b of every rank
// (detail/p2p_barrier.cuh: flags, counters), then each warp takes (query, q head) pairs and
// reads every rank's state over NVLink, all ranks' LSE and O of two pairs in one round trip:
//   M = max_s lse_s,  w_s = 2^(lse_s - M),  out = sum_s w_s o_s / sum_s w_s
// (o_s normalised, as launch_tree_attention_state writes it), ranks summed in rank order, so
// every rank writes the same rows. A rank must not overwrite its state before the peers have
// read it: callers alternate two state buffers per step (a rank reaches step i + 1's combine
// only after every peer has started it, so step i's reads are over before step i + 2 writes).
inline constexpr int kSpP2PBlocks = 128;
inline constexpr int kSpMaxRanks = 8;
struct SpP2PCombine {
  int32_t rank = 0;
  int32_t world = 1;
  const float* o[kSpMaxRanks] = {};    // rank s's float [n][head_dim] for this step
  const float* lse[kSpMaxRanks] = {};  // rank s's float [n] (base 2)
  uint32_t* flags[kSpMaxRanks] = {};   // rank s's uint32 [kSpP2PBlocks][kSpMaxRanks]
  uint32_t* counters = nullptr;        // this rank's uint32 [kSpP2PBlocks]
};
Status enqueue_p2p_combine(const SpP2PCombine& args, const int32_t* query_rows, void* out,
                           TreeAttentionDtype dtype, int32_t num_queries, int32_t num_q_heads,
                           int32_t head_dim, cudaStream_t stream);

}  // namespace treeserve::detail
