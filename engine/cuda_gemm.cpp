// LtGemm (engine/detail/cuda_gemm.h): cublasLt GEMMs whose algorithm is chosen per shape by
// timing the heuristic's candidates, with a process-wide cache of the choices.
#include "engine/detail/cuda_gemm.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "engine/cuda_fp8.h"
#include "engine/detail/cuda_buffers.h"

namespace treeserve::detail {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  return cuda_error_status(e, "GEMM tuner", what);
}

Status cublas_status(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Internal(std::string("cuBLAS: ") + what + " failed (status " + std::to_string(int(s)) +
                  ")");
}

#define TS_LT(expr, what) TS_RETURN_IF_ERROR(cublas_status((expr), what))

// Heuristic candidates timed per shape, and calls per candidate: one warm-up (lazy module
// loading, first-touch of the workspace), then kReps timed one by one (median).
constexpr int kCandidates = 16;
constexpr int kReps = 7;

// The largest power of two (up to 256, cublasLt's default requirement) dividing the address
// (or byte offset).
int32_t alignment(uintptr_t a) {
  int32_t align = 256;
  while (align > 1 && a % uintptr_t(align) != 0) align /= 2;
  return align;
}
int32_t alignment(const void* p) { return alignment(reinterpret_cast<uintptr_t>(p)); }

int64_t dtype_bytes(int32_t type) {
  return type == CUDA_R_32F ? 4 : type == CUDA_R_8F_E4M3 ? 1 : 2;
}

// Split-K parts are added in float32: INPLACE and OUTPUT_TYPE add them in the output type,
// which for fp16/bf16 outputs rounds every part instead of the float32 sum once (what
// cublasGemmEx with CUBLAS_COMPUTE_32F gives). INPLACE also orders its additions through
// counters in the workspace; it is left out for float32 outputs too, so that only schemes
// with a fixed reduction order (none, or a separate reduction kernel) are ever run.
uint32_t reduction_mask(cudaDataType_t out) {
  uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  if (out == CUDA_R_32F) mask |= CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
  return mask;
}

// The process-wide cache: (device, m bucket, n, k, in, out, alignment, splits) -> choice.
using TuneKey = std::tuple<int32_t, int64_t, int64_t, int64_t, int32_t, int32_t, int32_t, int32_t>;
std::mutex g_mutex;
std::map<TuneKey, TunedGemm>& cache() {
  static auto* c = new std::map<TuneKey, TunedGemm>();  // never destroyed: no exit-order issue
  return *c;
}

bool lookup(const TuneKey& key, TunedGemm* out) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = cache().find(key);
  if (it == cache().end()) return false;
  *out = it->second;
  return true;
}

// Inserts `tuned` unless another thread got there first; *out = the cached entry.
void insert(const TuneKey& key, const TunedGemm& tuned, TunedGemm* out) {
  bool inserted = false;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto [it, fresh] = cache().emplace(key, tuned);
    inserted = fresh;
    *out = it->second;
  }
  if (inserted && tuned.fallback) {
    std::fprintf(stderr,
                 "treeserve: no cublasLt algorithm ran for GEMM m=%lld n=%lld k=%lld (%d K "
                 "slices) on device %d; using cublasGemmEx for it\n",
                 (long long)tuned.m_tuned, (long long)tuned.n, (long long)tuned.k, tuned.splits,
                 tuned.device);
  }
}

template <typename T>
T algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T v{};
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof v, &written);
  return v;
}

// The chosen configuration's numbers, for reports.
void describe(const cublasLtMatmulAlgo_t& algo, TunedGemm* t) {
  t->algo = algo;
  t->algo_id = algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID);
  t->tile = int32_t(algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID));
  t->stages = int32_t(algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID));
  t->split_k = algo_config<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  t->reduction = int32_t(algo_config<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME));
}

// The timing events of one tuning (kReps + 1), destroyed with it.
struct Events {
  std::vector<cudaEvent_t> e = std::vector<cudaEvent_t>(kReps + 1, nullptr);
  Status create() {
    for (cudaEvent_t& ev : e) TS_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&ev), "tuning event"));
    return Status::Ok();
  }
  ~Events() {
    for (cudaEvent_t ev : e) {
      if (ev) cudaEventDestroy(ev);
    }
  }
};

// One candidate's median time in microseconds (*us) on `stream`, after the work queued there:
// a warm-up call, then kReps calls each between two events. call() launches one and says
// whether it launched; *us = -1 when one did not (its error is cleared, not left for the
// caller's next check). A non-OK status is a fault on the device (the context is lost), not
// a bad candidate.
template <typename Call>
Status time_candidate(cudaStream_t stream, const Events& events, float* us, Call&& call) {
  *us = -1;
  bool launched = call();
  TS_RETURN_IF_ERROR(cuda_status(cudaEventRecord(events.e[0], stream), "tuning event"));
  for (int r = 0; r < kReps && launched; ++r) {
    launched = call();
    TS_RETURN_IF_ERROR(
        cuda_status(cudaEventRecord(events.e[size_t(r) + 1], stream), "tuning event"));
  }
  if (!launched) {
    cudaGetLastError();
    return cuda_status(cudaStreamSynchronize(stream), "tuning");
  }
  TS_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(events.e[kReps]), "tuning"));
  std::vector<float> ms(kReps);
  for (int r = 0; r < kReps; ++r) {
    TS_RETURN_IF_ERROR(cuda_status(
        cudaEventElapsedTime(&ms[size_t(r)], events.e[size_t(r)], events.e[size_t(r) + 1]),
        "tuning event time"));
  }
  std::nth_element(ms.begin(), ms.begin() + kReps / 2, ms.end());
  *us = ms[kReps / 2] * 1e3f;
  return Status::Ok();
}

cuda::Fp8Out fp8_out(cudaDataType_t out) {
  return out == CUDA_R_32F    ? cuda::Fp8Out::kFloat32
         : out == CUDA_R_16BF ? cuda::Fp8Out::kBFloat16
                              : cuda::Fp8Out::kFloat16;
}

}  // namespace

int64_t gemm_rows_bucket(int64_t m) {
  if (m <= 16) return m;
  if (m <= 512) return (m + 15) / 16 * 16;
  if (m <= 1024) return (m + 63) / 64 * 64;
  int64_t b = 2048;
  while (b < m) b *= 2;
  return b;
}

size_t LtGemm::PlanKeyHash::operator()(const PlanKey& p) const {
  size_t h = std::hash<int64_t>()(p.m);
  for (int64_t v : {p.n, p.k, int64_t(p.in), int64_t(p.out), int64_t(p.align), int64_t(p.splits)}) {
    h = h * 1000003u ^ std::hash<int64_t>()(v);
  }
  return h;
}

LtGemm::~LtGemm() {
  for (auto& [key, plan] : plans_) destroy(&plan);
  if (lt_) cublasLtDestroy(lt_);
}

void LtGemm::destroy(Plan* plan) {
  if (plan->desc) cublasLtMatmulDescDestroy(plan->desc);
  for (cublasLtMatrixLayout_t l : {plan->a, plan->b, plan->c}) {
    if (l) cublasLtMatrixLayoutDestroy(l);
  }
  *plan = Plan{};
}

Status LtGemm::init(int32_t device, cublasHandle_t fallback, void* workspace,
                    size_t workspace_bytes, bool autotune) {
  device_ = device;
  fallback_ = fallback;
  workspace_ = workspace;
  workspace_bytes_ = workspace_bytes;
  autotune_ = autotune;
  if (autotune_) TS_LT(cublasLtCreate(&lt_), "cublasLtCreate");
  return Status::Ok();
}

Status LtGemm::run(const void* x, const void* w, void* y, int64_t m, int64_t n, int64_t k,
                   cudaDataType_t in, cudaDataType_t out, cudaStream_t stream,
                   std::span<const void* const> same_shape) {
  return launch(plan_key(x, w, y, m, n, k, 1, in, out), x, w, y, stream, same_shape);
}

Status LtGemm::run_fp8(const void* x, const float* x_scale, const void* w, const float* w_scale,
                       void* y, int64_t m, int64_t n, int64_t k, cudaDataType_t out,
                       cudaStream_t stream, std::span<const void* const> same_shape) {
  if (k % 16 != 0) {
    return InvalidArgument("FP8 GEMM: k = " + std::to_string(k) + " is not a multiple of 16");
  }
  if (out != CUDA_R_16F && out != CUDA_R_16BF && out != CUDA_R_32F) {
    return InvalidArgument("FP8 GEMM: the output must be fp16, bf16 or float32");
  }
  // Without autotune the handle is made here: FP8 GEMMs run through cublasLt only.
  if (lt_ == nullptr) TS_LT(cublasLtCreate(&lt_), "cublasLtCreate");
  w_scale_ = w_scale;
  x_scale_ = x_scale;
  return launch(plan_key(x, w, y, m, n, k, 1, CUDA_R_8F_E4M3, out), x, w, y, stream, same_shape);
}

Status LtGemm::set_scales(const Plan& plan, const float* w_scale, const float* x_scale) const {
  // Column-major A is w, B is x (make_descriptors).
  TS_LT(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scale,
                                       sizeof w_scale),
        "A scale pointer");
  TS_LT(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale,
                                       sizeof x_scale),
        "B scale pointer");
  return Status::Ok();
}

Status LtGemm::run_split_k(const void* x, const void* w, float* y, int64_t m, int64_t n, int64_t k,
                           int32_t splits, cudaDataType_t in, cudaStream_t stream,
                           std::span<const void* const> same_shape) {
  TS_RETURN_IF_ERROR(check_split(k, splits, in, CUDA_R_32F));
  if (splits == 1) return run(x, w, y, m, n, k, in, CUDA_R_32F, stream, same_shape);
  return launch(plan_key(x, w, y, m, n, k, splits, in, CUDA_R_32F), x, w, y, stream, same_shape);
}

Status LtGemm::tuned_time(const void* x, const void* w, void* y, int64_t m, int64_t n, int64_t k,
                          int32_t splits, cudaDataType_t in, cudaDataType_t out,
                          cudaStream_t stream, std::span<const void* const> same_shape, float* us) {
  *us = -1;
  TS_RETURN_IF_ERROR(check_split(k, splits, in, out));
  if (m == 0 || !autotune_) return Status::Ok();
  const PlanKey key = plan_key(x, w, y, m, n, k, splits, in, out);
  const Plan* plan = nullptr;
  TS_RETURN_IF_ERROR(prepare(key, x, w, y, stream, same_shape, &plan));
  TunedGemm tuned;
  const TuneKey tune_key{device_, gemm_rows_bucket(m), n, k, key.in, key.out, key.align, splits};
  if (lookup(tune_key, &tuned) && !tuned.fallback) *us = tuned.us;
  return Status::Ok();
}

// splits > 1 needs a float32 output and 16-byte slices of fp16/bf16 rows (cublasLt's and
// cuBLAS's batch pointers at s k/S elements); splits == 1 is run(), whatever k.
Status LtGemm::check_split(int64_t k, int32_t splits, cudaDataType_t in, cudaDataType_t out) {
  if (splits < 1 || splits > kMaxSplits) {
    return InvalidArgument("GEMM split-K: splits must be in [1, " + std::to_string(kMaxSplits) +
                           "], got " + std::to_string(splits));
  }
  if (splits == 1) return Status::Ok();
  if (out != CUDA_R_32F) {
    return InvalidArgument("GEMM split-K: the parts are float32 (out must be CUDA_R_32F)");
  }
  if (in != CUDA_R_16F && in != CUDA_R_16BF) {
    return InvalidArgument("GEMM split-K: input must be fp16 or bf16");
  }
  if (!splits_evenly(k, splits, in)) {
    return InvalidArgument("GEMM split-K: k = " + std::to_string(k) + " does not split into " +
                           std::to_string(splits) + " slices of whole 16-byte runs");
  }
  return Status::Ok();
}

bool LtGemm::splits_evenly(int64_t k, int32_t splits, cudaDataType_t in) {
  return splits >= 1 && k % splits == 0 && (k / splits * dtype_bytes(in)) % 16 == 0;
}

// The plan's key: the shape, types and split count, and the alignment cublasLt may assume of
// every operand — with splits > 1 also of the batch entries (slice and part offsets).
LtGemm::PlanKey LtGemm::plan_key(const void* x, const void* w, const void* y, int64_t m, int64_t n,
                                 int64_t k, int32_t splits, cudaDataType_t in,
                                 cudaDataType_t out) const {
  int32_t align = std::min({alignment(x), alignment(w), alignment(y)});
  if (splits > 1) {
    align = std::min({align, alignment(uintptr_t(k / splits * dtype_bytes(in))),
                      alignment(uintptr_t(m * n * dtype_bytes(out)))});
  }
  return PlanKey{m, n, k, int32_t(in), int32_t(out), align, splits};
}

// The plan for the key (made now, and its bucket tuned, when there is none; a plan made
// during a capture is made again on the first call outside one).
Status LtGemm::prepare(const PlanKey& key, const void* x, const void* w, void* y,
                       cudaStream_t stream, std::span<const void* const> same_shape,
                       const Plan** out) {
  auto it = plans_.find(key);
  if (it != plans_.end() && it->second.provisional) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    TS_RETURN_IF_ERROR(cuda_status(cudaStreamIsCapturing(stream, &capturing), "capture status"));
    if (capturing == cudaStreamCaptureStatusNone) {
      destroy(&it->second);
      plans_.erase(it);
      it = plans_.end();
    }
  }
  if (it == plans_.end()) {
    Plan plan;
    const Status made = make_plan(key, x, w, y, stream, same_shape, &plan);
    if (!made.ok()) {
      destroy(&plan);
      return made;
    }
    it = plans_.emplace(key, plan).first;
  }
  *out = &it->second;
  return Status::Ok();
}

Status LtGemm::launch(const PlanKey& key, const void* x, const void* w, void* y,
                      cudaStream_t stream, std::span<const void* const> same_shape) {
  if (key.m == 0) return Status::Ok();
  if (!autotune_ && !is_fp8(key.in)) return run_fallback(key, x, w, y);
  const Plan* plan = nullptr;
  TS_RETURN_IF_ERROR(prepare(key, x, w, y, stream, same_shape, &plan));
  if (plan->use_fallback) return run_fallback(key, x, w, y);
  if (plan->fp8_rows_splits > 0) {
    return cuda_status(cuda::fp8_gemm_rows(static_cast<const uint8_t*>(x), x_scale_,
                                           static_cast<const uint8_t*>(w), w_scale_, y,
                                           fp8_out(cudaDataType_t(key.out)), key.m, key.n, key.k,
                                           plan->fp8_rows_splits, stream),
                       "FP8 GEMM (fp8_gemm_rows)");
  }
  if (is_fp8(key.in)) TS_RETURN_IF_ERROR(set_scales(*plan, w_scale_, x_scale_));
  const float alpha = 1.0f, beta = 0.0f;
  return cublas_status(
      cublasLtMatmul(lt_, plan->desc, &alpha, w, plan->a, x, plan->b, &beta, y, plan->c, y, plan->c,
                     &plan->algo, workspace_, workspace_bytes_, stream),
      "cublasLtMatmul");
}

// On fallback_'s stream (set by the owner: the same as the calls').
Status LtGemm::run_fallback(const PlanKey& key, const void* x, const void* w, void* y) {
  if (is_fp8(key.in)) {
    return Internal("FP8 GEMM m=" + std::to_string(key.m) + " n=" + std::to_string(key.n) +
                    " k=" + std::to_string(key.k) +
                    ": cublasLt has no algorithm for it on this device (FP8 needs sm_89+)");
  }
  // Column-major y^T [n][m] = w^T . x^T: w is k x n (ld k) transposed, x is k x m (ld k);
  // with splits, batch s takes rows [s k/S, (s+1) k/S) of both and writes y + s m n.
  const auto in = cudaDataType_t(key.in), out = cudaDataType_t(key.out);
  const int n = int(key.n), m = int(key.m), ld = int(key.k);
  const float alpha = 1.0f, beta = 0.0f;
  if (key.splits == 1) {
    return cublas_status(
        cublasGemmEx(fallback_, CUBLAS_OP_T, CUBLAS_OP_N, n, m, ld, &alpha, w, in, ld, x, in, ld,
                     &beta, y, out, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "gemm");
  }
  const long long slice = key.k / key.splits, part = key.m * key.n;
  return cublas_status(
      cublasGemmStridedBatchedEx(fallback_, CUBLAS_OP_T, CUBLAS_OP_N, n, m, int(slice), &alpha, w,
                                 in, ld, slice, x, in, ld, slice, &beta, y, out, n, part,
                                 key.splits, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "strided batched gemm");
}

// Descriptors for the shape, then the algorithm: the cache's choice for the shape's bucket
// (tuned now when there is none and the stream is not capturing), checked for this m.
Status LtGemm::make_plan(const PlanKey& key, const void* x, const void* w, void* y,
                         cudaStream_t stream, std::span<const void* const> same_shape, Plan* plan) {
  TS_RETURN_IF_ERROR(make_descriptors(key, plan));
  // cublasLt's heuristic refuses a vector-scaled FP8 matmul whose scale pointers are unset.
  if (is_fp8(key.in)) TS_RETURN_IF_ERROR(set_scales(*plan, w_scale_, x_scale_));
  if (!autotune_) {  // FP8 (run_fallback serves the rest)
    if (key.m <= cuda::kFp8GemmRowsDefaultMaxM &&
        cuda::fp8_gemm_rows_fits(key.m, key.n, key.k, x, w, y)) {
      plan->fp8_rows_splits = cuda::fp8_gemm_rows_splits(key.n, key.k);
      return Status::Ok();
    }
    return use_first_candidate(key, plan);
  }
  const int64_t bucket = gemm_rows_bucket(key.m);
  const TuneKey tune_key{device_, bucket, key.n, key.k, key.in, key.out, key.align, key.splits};
  TunedGemm chosen;
  if (!lookup(tune_key, &chosen)) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    TS_RETURN_IF_ERROR(cuda_status(cudaStreamIsCapturing(stream, &capturing), "capture status"));
    if (capturing != cudaStreamCaptureStatusNone) {
      // No timing inside a capture: the heuristic's first candidate for this call only.
      plan->provisional = true;
      return use_first_candidate(key, plan);
    }
    // The tuning set: the caller's same-shape weights at least as aligned as this call's.
    std::vector<const void*> weights;
    for (const void* p : same_shape) {
      if (alignment(p) >= key.align) weights.push_back(p);
    }
    if (weights.empty()) weights.push_back(w);
    TunedGemm tuned;
    TS_RETURN_IF_ERROR(tune_bucket(*plan, key, bucket, x, y, stream, weights, &tuned));
    insert(tune_key, tuned, &chosen);
  }
  if (chosen.fallback) {
    plan->use_fallback = true;
    return Status::Ok();
  }
  if (chosen.fp8_rows_splits > 0) {
    if (cuda::fp8_gemm_rows_fits(key.m, key.n, key.k, x, w, y)) {
      plan->fp8_rows_splits = chosen.fp8_rows_splits;
      return Status::Ok();
    }
    return use_first_candidate(key, plan);
  }
  plan->algo = chosen.algo;
  if (chosen.m_tuned == key.m) return Status::Ok();
  // Another m of the bucket: the same algorithm if it supports this m (it is a tile and
  // split-K configuration, so it should), else the heuristic's first candidate for it —
  // either way the same for every LtGemm of the process.
  cublasLtMatmulHeuristicResult_t check{};
  if (cublasLtMatmulAlgoCheck(lt_, plan->desc, plan->a, plan->b, plan->c, plan->c, &plan->algo,
                              &check) == CUBLAS_STATUS_SUCCESS &&
      check.workspaceSize <= workspace_bytes_) {
    return Status::Ok();
  }
  return use_first_candidate(key, plan);
}

// Tunes the bucket at its top row count, on scratch x and y rows of that size (the caller's
// hold only key.m rows): a bucket's choice runs every m of it, and a choice timed at a
// smaller m can be a tile that covers that m but not the bucket's top (bucket 32 timed at
// m = 20 can pick 24-row tiles, and m = 30 then reads every weight matrix twice). Without
// memory for the scratch rows, the call's own m.
Status LtGemm::tune_bucket(const Plan& plan, const PlanKey& key, int64_t bucket, const void* x,
                           void* y, cudaStream_t stream, std::span<const void* const> weights,
                           TunedGemm* chosen) {
  if (bucket == key.m) return tune(plan, key, x, y, stream, weights, chosen);
  PlanKey top = key;
  top.m = bucket;
  const size_t x_bytes = size_t(bucket * key.k * dtype_bytes(key.in));
  const size_t y_bytes = size_t(key.splits * bucket * key.n * dtype_bytes(key.out));
  // FP8: the scratch rows' scales follow them (one float a row).
  const size_t scale_bytes = is_fp8(key.in) ? size_t(bucket) * 4 : 0;
  void *xs = nullptr, *ys = nullptr;
  if (cudaMalloc(&xs, x_bytes + scale_bytes) != cudaSuccess ||
      cudaMalloc(&ys, y_bytes) != cudaSuccess) {
    cudaGetLastError();  // out of memory is not left for the caller's next check
    if (xs) cudaFree(xs);
    return tune(plan, key, x, y, stream, weights, chosen);
  }
  const float* call_x_scale = x_scale_;
  if (is_fp8(key.in)) x_scale_ = reinterpret_cast<const float*>(static_cast<char*>(xs) + x_bytes);
  Plan top_plan;
  Status status = make_descriptors(top, &top_plan);
  if (status.ok() && is_fp8(key.in)) status = set_scales(top_plan, w_scale_, x_scale_);
  // Zero rows (timing does not depend on the values; uninitialised ones could hold NaNs).
  if (status.ok()) {
    status = cuda_status(cudaMemsetAsync(xs, 0, x_bytes + scale_bytes, stream), "scratch rows");
  }
  if (status.ok()) status = tune(top_plan, top, xs, ys, stream, weights, chosen);
  if (status.ok()) status = cuda_status(cudaStreamSynchronize(stream), "tuning");
  x_scale_ = call_x_scale;
  destroy(&top_plan);
  cudaFree(xs);
  cudaFree(ys);
  return status;
}

// The shape's matmul descriptor and matrix layouts.
Status LtGemm::make_descriptors(const PlanKey& key, Plan* plan) const {
  const int64_t slice = key.k / key.splits;
  const auto in = cudaDataType_t(key.in), out = cudaDataType_t(key.out);
  TS_LT(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc create");
  const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
  TS_LT(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof trans),
      "transa");
  TS_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans,
                                       sizeof no_trans),
        "transb");
  // Column-major: A = w (k x n, ld k) transposed, B = x (k x m, ld k), C = D = y (n x m).
  // Split: batch s of A and B is their rows [s k/S, (s+1) k/S) (k/S rows, ld k, batch stride
  // k/S elements), of C the part at s m n (ld n).
  TS_LT(cublasLtMatrixLayoutCreate(&plan->a, in, uint64_t(slice), uint64_t(key.n), key.k),
        "layout a");
  TS_LT(cublasLtMatrixLayoutCreate(&plan->b, in, uint64_t(slice), uint64_t(key.m), key.k),
        "layout b");
  TS_LT(cublasLtMatrixLayoutCreate(&plan->c, out, uint64_t(key.n), uint64_t(key.m), key.n),
        "layout c");
  if (is_fp8(key.in)) {
    // One float per row of D (A = w's rows) and per column (B = x's rows).
    const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    TS_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode,
                                         sizeof mode),
          "A scale mode");
    TS_LT(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode,
                                         sizeof mode),
          "B scale mode");
  }
  if (key.splits == 1) return Status::Ok();
  const int32_t batch = key.splits;  // CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT: int32_t
  // CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET: int64_t, in elements.
  const int64_t strides[3] = {slice, slice, key.m * key.n};
  const cublasLtMatrixLayout_t layouts[3] = {plan->a, plan->b, plan->c};
  for (int i = 0; i < 3; ++i) {
    TS_LT(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                           sizeof batch),
          "layout batch count");
    TS_LT(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                           &strides[i], sizeof strides[i]),
          "layout batch stride");
  }
  return Status::Ok();
}

// The heuristic's first candidate for the plan's shape, or cublasGemmEx when it has none.
Status LtGemm::use_first_candidate(const PlanKey& key, Plan* plan) const {
  std::vector<cublasLtMatmulHeuristicResult_t> found;
  TS_RETURN_IF_ERROR(heuristic(*plan, key, 1, &found));
  plan->use_fallback = found.empty();
  if (!found.empty()) plan->algo = found[0].algo;
  return Status::Ok();
}

// Up to `requested` usable candidates, best first by cublasLt's own estimate.
Status LtGemm::heuristic(const Plan& plan, const PlanKey& key, int requested,
                         std::vector<cublasLtMatmulHeuristicResult_t>* out) const {
  cublasLtMatmulPreference_t pref = nullptr;
  TS_LT(cublasLtMatmulPreferenceCreate(&pref), "preference create");
  const uint64_t ws = workspace_bytes_;
  const uint32_t mask = reduction_mask(cudaDataType_t(key.out));
  const uint32_t align = uint32_t(key.align);
  cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                             &mask, sizeof mask);
  }
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    if (s == CUBLAS_STATUS_SUCCESS) {
      s = cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof align);
    }
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(requested));
  int returned = 0;
  if (s == CUBLAS_STATUS_SUCCESS) {
    s = cublasLtMatmulAlgoGetHeuristic(lt_, plan.desc, plan.a, plan.b, plan.c, plan.c, pref,
                                       requested, results.data(), &returned);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  out->clear();
  // NOT_SUPPORTED: no algorithm for this shape at all (the caller falls back to cuBLAS).
  if (s == CUBLAS_STATUS_NOT_SUPPORTED) return Status::Ok();
  TS_LT(s, "cublasLtMatmulAlgoGetHeuristic");
  for (int i = 0; i < returned; ++i) {
    if (results[size_t(i)].state == CUBLAS_STATUS_SUCCESS &&
        results[size_t(i)].workspaceSize <= workspace_bytes_) {
      out->push_back(results[size_t(i)]);
    }
  }
  return Status::Ok();
}

// Times every candidate on `stream` (after the work already queued there): a warm-up call,
// then kReps calls each between two events, each call on the next matrix of `weights` (so
// the weights it reads were not read by the calls just before it: not in L2 when the set is
// larger than L2, as all layers' matrices of one kind are). A candidate that fails to launch
// is dropped; the fastest median wins.
Status LtGemm::tune(const Plan& plan, const PlanKey& key, const void* x, void* y,
                    cudaStream_t stream, std::span<const void* const> weights, TunedGemm* chosen) {
  *chosen = TunedGemm{};
  chosen->device = device_;
  chosen->m_bucket = gemm_rows_bucket(key.m);
  chosen->m_tuned = key.m;
  chosen->n = key.n;
  chosen->k = key.k;
  chosen->splits = key.splits;
  chosen->in = cudaDataType_t(key.in);
  chosen->out = cudaDataType_t(key.out);
  chosen->fallback = true;
  std::vector<cublasLtMatmulHeuristicResult_t> found;
  TS_RETURN_IF_ERROR(heuristic(plan, key, kCandidates, &found));
  if (is_fp8(key.in)) {
    TS_RETURN_IF_ERROR(set_scales(plan, w_scale_, x_scale_));
    if (!found.empty()) add_fp8_variants(plan, &found);
  } else if (found.empty()) {
    return Status::Ok();
  }

  Events events;
  TS_RETURN_IF_ERROR(events.create());
  const float alpha = 1.0f, beta = 0.0f;
  size_t cursor = 0;
  float best = 0;
  for (size_t c = 0; c < found.size(); ++c) {
    const cublasLtMatmulAlgo_t& algo = found[c].algo;
    float us = -1;
    TS_RETURN_IF_ERROR(time_candidate(stream, events, &us, [&] {
      const void* w = weights[cursor++ % weights.size()];
      return cublasLtMatmul(lt_, plan.desc, &alpha, w, plan.a, x, plan.b, &beta, y, plan.c, y,
                            plan.c, &algo, workspace_, workspace_bytes_,
                            stream) == CUBLAS_STATUS_SUCCESS;
    }));
    if (us < 0) continue;
    if (c == 0) chosen->heuristic_us = us;
    ++chosen->candidates;
    if (chosen->fallback || us < best) {
      best = us;
      chosen->fallback = false;
      chosen->us = us;
      describe(algo, chosen);
    }
  }
  if (is_fp8(key.in)) return tune_fp8_rows(key, x, y, stream, weights, chosen);
  return Status::Ok();
}

Status LtGemm::tune_fp8_rows(const PlanKey& key, const void* x, void* y, cudaStream_t stream,
                             std::span<const void* const> weights, TunedGemm* chosen) {
  if (!cuda::fp8_gemm_rows_fits(key.m, key.n, key.k, x, weights[0], y)) return Status::Ok();
  const cuda::Fp8Out out = fp8_out(cudaDataType_t(key.out));
  const int s0 = cuda::fp8_gemm_rows_splits(key.n, key.k);
  const int most = cuda::fp8_gemm_rows_max_splits(key.k);
  std::vector<int> splits = {s0};
  for (int s : {s0 / 2, s0 * 2}) {
    if (s >= 1 && s <= most && s != s0) splits.push_back(s);
  }
  Events events;
  TS_RETURN_IF_ERROR(events.create());
  size_t cursor = 0;
  for (int s : splits) {
    float us = -1;
    TS_RETURN_IF_ERROR(time_candidate(stream, events, &us, [&] {
      const void* w = weights[cursor++ % weights.size()];
      return cuda::fp8_gemm_rows(static_cast<const uint8_t*>(x), x_scale_,
                                 static_cast<const uint8_t*>(w), w_scale_, y, out, key.m, key.n,
                                 key.k, s, stream) == cudaSuccess;
    }));
    if (us < 0) continue;
    ++chosen->candidates;
    if (chosen->fallback || us < chosen->us) {
      chosen->fallback = false;
      chosen->us = us;
      chosen->fp8_rows_splits = s;
      chosen->algo_id = -1;
      chosen->tile = 0;
      chosen->stages = 0;
      chosen->split_k = 1;
      chosen->reduction = 0;
    }
  }
  return Status::Ok();
}

// For vector-scaled FP8 at decode shapes cublasLt's heuristic offers a single configuration
// (128x128 tiles, no split: 32 CTAs for a 4096-wide output on 132 SMs). Its split-K variants
// (reduced in float32 by a separate kernel, a fixed order) and the algorithm's other tiles
// fill the GPU; each passes cublasLtMatmulAlgoCheck before it is timed.
void LtGemm::add_fp8_variants(const Plan& plan,
                              std::vector<cublasLtMatmulHeuristicResult_t>* found) const {
  const cublasLtMatmulAlgo_t base = (*found)[0].algo;
  const uint32_t base_tile = algo_config<uint32_t>(base, CUBLASLT_ALGO_CONFIG_TILE_ID);
  std::vector<uint32_t> tiles(64);
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&base, CUBLASLT_ALGO_CAP_TILE_IDS, tiles.data(),
                                        tiles.size() * sizeof(uint32_t),
                                        &written) != CUBLAS_STATUS_SUCCESS) {
    written = 0;
  }
  tiles.resize(std::min(tiles.size(), written / sizeof(uint32_t)));
  auto add = [&](uint32_t tile, int32_t split) {
    if (found->size() >= size_t(kFp8Candidates)) return;
    cublasLtMatmulAlgo_t a = base;
    const uint32_t red =
        split > 1 ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE : CUBLASLT_REDUCTION_SCHEME_NONE;
    if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile,
                                             sizeof tile) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split,
                                             sizeof split) != CUBLAS_STATUS_SUCCESS ||
        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red,
                                             sizeof red) != CUBLAS_STATUS_SUCCESS) {
      return;
    }
    cublasLtMatmulHeuristicResult_t r{};
    if (cublasLtMatmulAlgoCheck(lt_, plan.desc, plan.a, plan.b, plan.c, plan.c, &a, &r) ==
            CUBLAS_STATUS_SUCCESS &&
        r.workspaceSize <= workspace_bytes_) {
      r.algo = a;
      r.state = CUBLAS_STATUS_SUCCESS;
      found->push_back(r);
    }
  };
  for (int32_t split : {2, 3, 4, 6, 8}) add(base_tile, split);
  for (uint32_t tile : tiles) {
    if (tile == base_tile || tile == CUBLASLT_MATMUL_TILE_UNDEFINED) continue;
    for (int32_t split : {1, 2, 4}) add(tile, split);
  }
}

std::vector<TunedGemm> LtGemm::tuned_shapes() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::vector<TunedGemm> out;
  for (const auto& [key, tuned] : cache()) out.push_back(tuned);
  std::sort(out.begin(), out.end(), [](const TunedGemm& a, const TunedGemm& b) {
    return std::tie(a.device, a.n, a.k, a.m_bucket, a.splits, a.in, a.out) <
           std::tie(b.device, b.n, b.k, b.m_bucket, b.splits, b.in, b.out);
  });
  return out;
}

void LtGemm::clear_cache() {
  std::lock_guard<std::mutex> lock(g_mutex);
  cache().clear();
}

}  // namespace treeserve::detail
