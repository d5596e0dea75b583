// The CUDA backend: Llama layers on one GPU in fp16 or bf16 — cuBLAS GEMMs (fused QKV, O,
// fused gate/up, down, LM head), the row kernels of cuda_ops.cu, and the tree-attention
// kernel (kernels/tree_attention.h) running the step's plan over the paged pool. Logits of
// the requested rows come back to the host as token ids (greedy or sampled on the device) or
// float32 rows when asked for.
// Plain C++ header: no CUDA types.
#pragma once

#include <cstdint>
#include <memory>

#include "common/status.h"
#include "engine/backend.h"
#include "kernels/tree_attention.h"

namespace treeserve {

struct LlamaWeights;

struct CudaBackendOptions {
  int64_t num_pages = 1024;
  int32_t page_size = 16;
  bool bfloat16 = false;  // false: fp16
  int32_t device = 0;
  // FP8 KV cache (--kv-cache-dtype fp8): the pool holds K and V in e4m3 with one float32 scale
  // per (token, kv head) row (kernels/kv_layout.h), about half the bytes a token (so about twice
  // the tokens in the same memory) and half the K/V bytes attention reads.
  bool kv_cache_fp8 = false;
  // Force the prefix-unaware baseline schedule for attention (per-query flash-decoding over
  // each query's whole path): for benchmark comparisons only.
  bool baseline_attention = false;
  // Tensor parallelism over devices device .. device + tensor_parallel - 1 (NCCL; Megatron
  // sharding, engine/tensor_parallel.h). num_pages is per rank: each holds its KV heads'
  // share of every page.
  int32_t tensor_parallel = 1;
  // Benchmarks only: ranks skip their all-reduces (the results are wrong), so the step time
  // without communication can be compared with the real one.
  bool skip_collectives = false;
  // Tensor parallel: the O and down all-reduces of steps of at most p2p_max_rows rows run as
  // one kernel per call that reads the peers' partial sums over NVLink (peer access) and
  // fuses the residual add and RMSNorm (cuda_ops.h P2PAllReduce), when every pair of devices
  // has peer access; NCCL otherwise, for larger steps, and for the embedding. false: NCCL only.
  bool p2p_all_reduce = true;
  int32_t p2p_max_rows = 512;
  // Replay each step shape's layer chain (embedding to LM head) as a CUDA graph: captured the
  // second time a shape (rows, logit rows, attention grid bucket) comes in a row, replayed
  // while it lasts (tensor parallel too: each rank's stream, NCCL collectives included); off
  // under TREESERVE_PROFILE. Replays are bit-identical to eager steps (the CUDA e2e suites
  // pass either way).
  bool cuda_graphs = true;
  // GEMMs through cublasLt with the algorithm of each shape chosen by timing cublasLt's
  // candidates the first time the shape runs (engine/detail/cuda_gemm.h; the choice is shared
  // by every backend of the process). false: cublasGemmEx with cuBLAS's default choice.
  bool gemm_autotune = true;
  // One GPU, steps of at most 256 rows (decode, verify): the O and down GEMMs as split-K
  // (LtGemm::run_split_k: K cut into parts, one strided-batched GEMM writing float32 parts that
  // the residual-add + RMSNorm kernel sums in a fixed order). 0 (auto): per row bucket and
  // GEMM, 2 parts where the tuner's median for them is at least 3% below the unsplit GEMM's
  // (smaller tuner gains do not carry over to the step), decided the first time the bucket
  // runs and kept (1 without gemm_autotune); 1: never; 2..8: always that
  // many parts where they divide K into 16-byte slices. Tensor parallel: ignored.
  int32_t gemm_split_k = 0;
  // Tree attention's chunk growth (AttentionPlanConfig::max_chunk_tokens): the longest chunk
  // the plan may grow its KV chunks to, in tokens; 0: no growth. At most the workspace's
  // longest item (2048, the default).
  int32_t attention_max_chunk_tokens = 2048;
  // Tree attention's head-pairing margin (AttentionPlanConfig::pair_margin): plans pair where
  // the simulated span is at least 1 / margin shorter. In [2, 1024].
  int32_t attention_pair_margin = 32;
  // Tree attention runs plans of only decode-shaped items (plain sequences, small trees, the
  // prefix-unaware baseline) in its decode kernel (TreeAttentionLimits::decode_kernel); false:
  // stage 1 runs every plan (for comparisons).
  bool attention_decode_kernel = true;
  // Tree attention's tail kernel (TreeAttentionLimits::tail_kernel): a plan's paired items run
  // beside stage 1's wide ones where tree_attention_tail_pays (kAuto), never, or always.
  TreeAttentionLimits::Tail attention_tail_kernel = TreeAttentionLimits::Tail::kAuto;
  // Tree attention's wide kernel (TreeAttentionLimits::wide_kernel): a plan's pairs of wide
  // query tiles and its paired items in one kernel where tree_attention_wide_pays and its pairs
  // cover every wide item, or for a plan of pairs alone where tree_attention_wide_alone_pays
  // (kAuto), never, or wherever the plan has such pairs.
  TreeAttentionLimits::Wide attention_wide_kernel = TreeAttentionLimits::Wide::kAuto;
};

// Number of usable CUDA devices (0 when there is no driver or device).
int32_t cuda_device_count();

// Uploads the checkpoint (any of F32/F16/BF16, converted on the device; each rank only its
// slices, straight from the mapped tensors) and allocates the pool. UNAVAILABLE without a
// device or with fewer than tensor_parallel devices; INVALID_ARGUMENT (naming the field)
// when the model does not split over tensor_parallel ranks; RESOURCE_EXHAUSTED when memory
// is short.
StatusOr<std::unique_ptr<Backend>> create_cuda_backend(const ModelConfig& config,
                                                       const LlamaWeights& weights,
                                                       const CudaBackendOptions& options);

// Same model shape with random weights drawn on the device (for benchmarks of a shape,
// e.g. Llama-3-8B, without its checkpoint): the same global weights for every
// tensor_parallel (each element is a hash of the seed and its index in the whole matrix).
StatusOr<std::unique_ptr<Backend>> create_cuda_backend_random(const ModelConfig& config,
                                                              const CudaBackendOptions& options,
                                                              uint64_t seed);

}  // namespace treeserve
