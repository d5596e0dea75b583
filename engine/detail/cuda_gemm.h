// The CUDA backend's GEMMs through cublasLt with the algorithm chosen per shape by measurement
// (cuBLAS's default heuristic picks under-filled tiles for the skinny decode GEMMs, e.g. 64
// CTAs on 132 SMs for Llama-3-8B's O projection at 50 rows).
//
//   y [m][n] = x [m][k] . w [n][k]^T   (row-major; fp16 or bf16 in, float32 accumulate,
//                                       y in the input dtype or float32; or e4m3 in with
//                                       per-row scales, run_fp8)
//
// Split-K by batching (run_split_k): the K axis cut into S slices run as one strided-batched
// matmul, batch s writing the float32 part y_s = x[:, slice s] . w[:, slice s]^T, so S times
// as many CTAs stream the weights; the caller sums the parts (the backend's residual-add +
// RMSNorm kernel does, in a fixed order: bit-reproducible, unlike cublasLt's atomic split-K).
//
// The first time a shape is seen (outside a CUDA graph capture) the heuristic's candidates are
// timed on the caller's stream, cycling through the caller's same-shape weight matrices (all
// layers' O weights, say) so every timed call reads weights that are not in L2, and the
// fastest is kept in a process-wide cache keyed by device and shape: every LtGemm of a process
// on that device (two backends compared bit for bit) uses the same algorithm for the shape,
// and a given algorithm gives bit-identical results; each tensor-parallel rank tunes on its
// own device. The cache's mutex is never held while timing (a rank that waits on its stream
// may wait for another rank's all-reduce). Host-only code (plain C++ with the CUDA
// runtime and cublasLt headers), for the backend's .cpp files and the GPU tests.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace treeserve::detail {

// One tuned shape as the process-wide cache holds it (for benchmark reports and tests).
struct TunedGemm {
  int32_t device = 0;
  int64_t m_bucket = 0;  // the cache key's rows (gemm_rows_bucket)
  // The rows it was timed with: the bucket's top (m_bucket), so that the chosen tile covers
  // every m of the bucket; the first call's m when no scratch rows could be allocated.
  int64_t m_tuned = 0;
  int64_t n = 0, k = 0;
  // K slices run as one strided batch (run_split_k; out float32); 1: run(). Each count is
  // tuned and cached on its own.
  int32_t splits = 1;
  cudaDataType_t in = CUDA_R_16F, out = CUDA_R_16F;
  // The chosen cublasLt configuration (CUBLASLT_ALGO_CONFIG_*; tile is a cublasLtMatmulTile_t;
  // split_k is cublasLt's own split inside one matmul, not `splits`).
  int32_t algo_id = -1, tile = 0, stages = 0, split_k = 1, reduction = 0;
  // FP8 only: > 0 when the engine's own kernel (cuda_fp8.h fp8_gemm_rows) won with this many
  // K ranges per column block (the cublasLt fields above then describe nothing).
  int32_t fp8_rows_splits = 0;
  float us = 0;            // median time of one call, microseconds
  float heuristic_us = 0;  // the heuristic's first candidate's median (what it would run)
  int32_t candidates = 0;  // timed successfully
  bool fallback = false;   // every candidate failed: cublasGemmEx runs instead
  cublasLtMatmulAlgo_t algo{};
};

// The cache key's row count for m rows: exact up to 16, then rounded up to 16 up to 512, to
// 64 up to 1024, to a power of two beyond. A server sees every row count from 1 to
// max_step_rows; tuning each would cost tens of milliseconds a shape each time, while the
// best tile changes slowly with m. Every m of a bucket runs the algorithm tuned at the
// bucket's top, so a bucket must be narrow next to the tiles: with buckets of 128 rows from
// 129 on, 129 rows would run the tiles chosen for 256 (128 rows wide: every weight matrix read
// twice), and with buckets of 64 rows past 256, 257 rows would run 320's tiles.
int64_t gemm_rows_bucket(int64_t m);

class LtGemm {
 public:
  LtGemm() = default;
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  ~LtGemm();

  // On `device` (current when called): a cublasLt handle; `workspace` (workspace_bytes,
  // shared with the cuBLAS handle `fallback`, which must use the same stream as run()'s
  // calls) and `fallback` stay the caller's. autotune false: every run() is cublasGemmEx
  // with CUBLAS_GEMM_DEFAULT (cuBLAS's default choice).
  Status init(int32_t device, cublasHandle_t fallback, void* workspace, size_t workspace_bytes,
              bool autotune);

  // y = x . w^T on `stream` (see the file comment; in: CUDA_R_16F or CUDA_R_16BF, out: in or
  // CUDA_R_32F). same_shape: every weight matrix of this shape that the caller streams (w's
  // siblings, w among them or not), cycled through while tuning; empty: w alone. Tunes on the
  // first call of a shape unless the stream is capturing a graph (then the cached choice, or
  // the heuristic's first candidate, not cached).
  Status run(const void* x, const void* w, void* y, int64_t m, int64_t n, int64_t k,
             cudaDataType_t in, cudaDataType_t out, cudaStream_t stream,
             std::span<const void* const> same_shape = {});

  // Split-K as one strided-batched matmul (see the file comment): y float [splits][m][n], part
  // s (at y + s m n) = x[:, cols] . w[:, cols]^T for cols [s k/S, (s + 1) k/S). Tuned and
  // cached per split count like run(); autotune off: cublasGemmStridedBatchedEx. splits == 1
  // is run(..., out = CUDA_R_32F). InvalidArgument unless 1 <= splits <= kMaxSplits and, for
  // splits > 1, k % splits == 0, a slice is a multiple of 16 bytes (k / splits % 8 == 0) and
  // `in` is fp16 or bf16.
  static constexpr int32_t kMaxSplits = 8;
  // Whether k cuts into `splits` slices of whole 16-byte runs of `in` (fp16 or bf16): what
  // run_split_k needs of k, beside the split count's range and the output type.
  static bool splits_evenly(int64_t k, int32_t splits, cudaDataType_t in);
  Status run_split_k(const void* x, const void* w, float* y, int64_t m, int64_t n, int64_t k,
                     int32_t splits, cudaDataType_t in, cudaStream_t stream,
                     std::span<const void* const> same_shape = {});

  // FP8: y = x . w^T with x and w in e4m3 (CUDA_R_8F_E4M3) and element (i, j) scaled by
  // x_scale[i] * w_scale[j] (cublasLt's outer-vector scaling: one float per row of x, one per
  // row of w), accumulated in float32; out CUDA_R_16F, CUDA_R_16BF or CUDA_R_32F. k must be a
  // multiple of 16 and every operand 16-byte aligned (cublasLt's FP8 rules). Tuned and cached
  // like run() (the scales do not change a shape's timing), the engine's own kernel for
  // decode-sized m (cuda_fp8.h fp8_gemm_rows, at a few split counts) timed beside cublasLt's
  // candidates. With autotune off: the own kernel where it fits the shape and m is at most
  // cuda::kFp8GemmRowsDefaultMaxM, at its default split count, else the heuristic's first
  // candidate (cuBLAS has no FP8 GEMM with vector scales to fall back on).
  Status run_fp8(const void* x, const float* x_scale, const void* w, const float* w_scale, void* y,
                 int64_t m, int64_t n, int64_t k, cudaDataType_t out, cudaStream_t stream,
                 std::span<const void* const> same_shape = {});

  // The median time in microseconds (*us) of one call as the tuning cache holds it for this
  // call's bucket: run() (splits == 1, `out` as there) or run_split_k (splits > 1, out must be
  // CUDA_R_32F). Arguments and tuning rules are those calls' (the bucket is tuned now if it is
  // not yet, writing y, unless the stream is capturing a graph); nothing else is launched.
  // *us = -1 when no time is known: autotune off, a capture before the bucket was tuned, or no
  // cublasLt candidate ran (cublasGemmEx).
  Status tuned_time(const void* x, const void* w, void* y, int64_t m, int64_t n, int64_t k,
                    int32_t splits, cudaDataType_t in, cudaDataType_t out, cudaStream_t stream,
                    std::span<const void* const> same_shape, float* us);

  // The process-wide cache, sorted by (device, n, k, m_bucket, splits, dtypes).
  static std::vector<TunedGemm> tuned_shapes();
  // Empties it (tests; not while another thread runs GEMMs).
  static void clear_cache();

 private:
  // What run() needs for one exact shape: descriptors and the algorithm (or cublasGemmEx).
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool use_fallback = false;
    int32_t fp8_rows_splits = 0;  // > 0: cuda::fp8_gemm_rows instead of cublasLt
    bool provisional = false;     // chosen during a capture: resolved again on the next call
  };
  struct PlanKey {
    int64_t m, n, k;
    int32_t in, out, align, splits;
    bool operator==(const PlanKey&) const = default;
  };
  struct PlanKeyHash {
    size_t operator()(const PlanKey& p) const;
  };

  static Status check_split(int64_t k, int32_t splits, cudaDataType_t in, cudaDataType_t out);
  PlanKey plan_key(const void* x, const void* w, const void* y, int64_t m, int64_t n, int64_t k,
                   int32_t splits, cudaDataType_t in, cudaDataType_t out) const;
  Status prepare(const PlanKey& key, const void* x, const void* w, void* y, cudaStream_t stream,
                 std::span<const void* const> same_shape, const Plan** plan);
  Status launch(const PlanKey& key, const void* x, const void* w, void* y, cudaStream_t stream,
                std::span<const void* const> same_shape);
  Status make_plan(const PlanKey& key, const void* x, const void* w, void* y, cudaStream_t stream,
                   std::span<const void* const> same_shape, Plan* plan);
  Status make_descriptors(const PlanKey& key, Plan* plan) const;
  Status tune_bucket(const Plan& plan, const PlanKey& key, int64_t bucket, const void* x, void* y,
                     cudaStream_t stream, std::span<const void* const> weights, TunedGemm* chosen);
  Status heuristic(const Plan& plan, const PlanKey& key, int requested,
                   std::vector<cublasLtMatmulHeuristicResult_t>* out) const;
  Status use_first_candidate(const PlanKey& key, Plan* plan) const;
  Status tune(const Plan& plan, const PlanKey& key, const void* x, void* y, cudaStream_t stream,
              std::span<const void* const> weights, TunedGemm* chosen);
  Status run_fallback(const PlanKey& key, const void* x, const void* w, void* y);
  // FP8 plans: the scale vectors of the next matmul (cublasLt reads the pointers when a
  // matmul is enqueued, so a plan shared by every layer takes each call's own).
  Status set_scales(const Plan& plan, const float* w_scale, const float* x_scale) const;
  static bool is_fp8(int32_t type) { return type == CUDA_R_8F_E4M3; }
  // FP8: the heuristic's split-K and other-tile variants, appended to *found (cuda_gemm.cpp).
  static constexpr int kFp8Candidates = 40;
  void add_fp8_variants(const Plan& plan,
                        std::vector<cublasLtMatmulHeuristicResult_t>* found) const;
  // FP8: times cuda::fp8_gemm_rows at a few split counts on tune()'s terms and takes it into
  // *chosen when it beats chosen->us (or nothing ran yet).
  Status tune_fp8_rows(const PlanKey& key, const void* x, void* y, cudaStream_t stream,
                       std::span<const void* const> weights, TunedGemm* chosen);
  static void destroy(Plan* plan);

  int32_t device_ = 0;
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t fallback_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  bool autotune_ = true;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans_;
  // run_fp8's scales, for launch() and tuning.
  const float* w_scale_ = nullptr;
  const float* x_scale_ = nullptr;
};

}  // namespace treeserve::detail
