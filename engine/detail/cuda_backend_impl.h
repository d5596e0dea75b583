// The CUDA backend's rank class (engine/cuda_backend.cpp describes the step): one GPU's
// weights, KV pool, buffers and step machinery. Its methods are defined in
// cuda_backend.cpp (set-up, weights), cuda_backend_step.cpp (the forward step, CUDA graphs,
// metadata upload, all-reduce) and cuda_backend_sampling.cpp (sampling on the device).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/cuda_backend.h"
#include "engine/cuda_fp8.h"
#include "engine/cuda_ops.h"
#include "engine/cuda_sampling.h"
#include "engine/detail/cuda_buffers.h"
#include "engine/detail/cuda_gemm.h"
#include "engine/detail/cuda_rank.h"
#include "engine/detail/cuda_weight_upload.h"
#include "engine/detail/step_profiler.h"
#include "engine/tensor_parallel.h"
#include "kernels/tree_attention.h"
#include "models/llama_weights.h"

namespace treeserve::detail {

inline Status cuda_status(cudaError_t e, const char* what) {
  return detail::cuda_error_status(e, "CUDA backend", what);
}
#define TS_CUDA(expr, what) TS_RETURN_IF_ERROR(cuda_status((expr), what))

inline Status cublas_status(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Internal(std::string("cuBLAS: ") + what + " failed (status " + std::to_string(int(s)) +
                  ")");
}

// An FP8 linear layer: e4m3 weights [n][k], one float scale per output row, and for static
// activation scales the input's scale (a device float; null: each input row is scaled by its
// own largest value, per step).
struct Fp8Linear {
  uint8_t* w = nullptr;
  float* scale = nullptr;
  float* input_scale = nullptr;
};

struct LayerWeights {
  void* input_norm = nullptr;  // T [hidden]
  void* qkv = nullptr;         // T [q + 2 kv][hidden]
  void* o = nullptr;           // T [hidden][q]
  void* post_norm = nullptr;   // T [hidden]
  void* gate_up = nullptr;     // T [2 im][hidden]
  void* down = nullptr;        // T [hidden][im]
  // FP8 models (config.quant): the four linear layers in e4m3 instead (the 16-bit pointers
  // above are then null, the norms stay).
  Fp8Linear qkv8, o8, gate_up8, down8;
};

inline void* byte_offset(void* p, int64_t elems, int64_t elem_bytes) {
  return static_cast<char*>(p) + elems * elem_bytes;
}

class CudaBackend final : public Backend, public detail::CudaRank {
 public:
  // world = 1: the whole model on options.device. Otherwise rank `rank` of a
  // TensorParallelBackend, on device options.device + rank, all-reducing over `comm`.
  CudaBackend(const ModelConfig& config, const CudaBackendOptions& options, int32_t rank = 0,
              int32_t world = 1, ncclComm_t comm = nullptr)
      : config_(config),
        options_(options),
        shard_(tensor_parallel_shard(config, rank, world)),
        world_(world),
        device_(options.device + rank),
        comm_(comm) {
    dtype_ = options.bfloat16 ? cuda::Dtype::kBFloat16 : cuda::Dtype::kFloat16;
    fp8_ = config.quant.scheme == QuantScheme::kFp8;
    h_ = config.hidden_size;
    d_ = config.head_dim;
    nh_ = int32_t(shard_.num_q_heads);
    nkv_ = int32_t(shard_.num_kv_heads);
    q_size_ = shard_.q_size(d_);
    kv_size_ = shard_.kv_size(d_);
    im_ = shard_.im_size;
    vocab_ = shard_.vocab_size;
    layout_.num_layers = int32_t(config.num_hidden_layers);
    layout_.num_kv_heads = nkv_;
    layout_.head_dim = int32_t(config.head_dim);
    layout_.page_size = options.page_size;
    layout_.num_pages = options.num_pages;
    layout_.set_element(2, options.kv_cache_fp8);
    scale_ = float(1.0 / std::sqrt(double(config.head_dim)));
  }

  ~CudaBackend() override {
    // On this rank's device; the caller's current device is left as it was (a single-GPU
    // backend's forward runs on the caller's).
    int caller_device = 0;
    cudaGetDevice(&caller_device);
    cudaSetDevice(device_);
    if (stream_) cudaStreamSynchronize(stream_);
    drop_graphs();
    for (void* p : allocations_) cudaFree(p);
    host_logits_.release();
    host_meta_.release();
    if (cublas_) cublasDestroy(cublas_);
    if (stream_) cudaStreamDestroy(stream_);
    release_buffers();
    cudaSetDevice(caller_device);
  }

  // Device, stream, cuBLAS, weight buffers (uninitialised), pool (zeros), workspace.
  Status init() override;

  P2PEndpoint p2p_endpoint() const override {
    P2PEndpoint e;
    e.partials[0] = p2p_partial_[0];
    e.partials[1] = p2p_partial_[1];
    e.flags = p2p_flags_;
    return e;
  }

  void set_p2p_peers(const std::vector<P2PEndpoint>& ranks) override {
    for (int parity = 0; parity < 2; ++parity) {
      cuda::P2PAllReduce& ar = p2p_[parity];
      ar.rank = shard_.rank;
      ar.world = world_;
      ar.counters = p2p_counters_;
      for (size_t r = 0; r < ranks.size(); ++r) {
        ar.deltas[r] = ranks[r].partials[parity];
        ar.flags[r] = ranks[r].flags;
      }
    }
    p2p_on_ = true;
  }

  // Fills this rank's slices of the weights straight from the checkpoint's mapped tensors
  // (converted on the device when the checkpoint dtype differs): no float32 host copy.
  Status load(const LlamaWeights& weights) override;

  // Random weights: uniform(+-1/sqrt(fan_in)) matrices, norms of ones — one seed per matrix
  // (the fused Q/K/V and gate/up count as one), each element drawn from its index in the
  // whole matrix, so every rank count holds the same global weights (and random_cpu_weights
  // the same values in float32).
  Status randomize(uint64_t seed) override;

  std::string_view name() const override { return "cuda"; }
  const ModelConfig& model_config() const override { return config_; }
  const KvLayout& kv_layout() const override { return layout_; }

  // The step's attention plan (built once; a TensorParallelBackend shares it across ranks).
  Status build_plan(const AttentionView& view, AttentionPlan* plan) const override {
    if (options_.baseline_attention) return build_baseline_plan(view, plan_config_, plan);
    return build_attention_plan(view, plan_config_, plan);
  }

  Status forward(const StepBatch& batch, Logits* out) override;

  // StepBatch::sampling on the device (cuda_sampling.cu): the rows' params up, a token, its
  // logprob and the alternatives per row down (~170 bytes, not the vocabulary).
  Status sample_on_device(const StepBatch& batch, Logits* out);

  // Device and pinned buffers of a draw over n rows (before a tensor-parallel step starts).
  Status reserve_sampling(int64_t n);

  // Uploads the rows' sampling params and enqueues the draw over `rows` (float [n][vocab],
  // the whole vocabulary) into sample_out_.
  Status enqueue_sampling(const StepBatch& batch, const float* rows);

  // A tensor-parallel sampling step: the ranks' logits shards meet on rank 0 (NCCL
  // point-to-point), which draws on the device like one GPU does; only the draws go to the
  // host (out.sampled). Every rank joins: the others send their shard.
  Status gather_and_sample(const StepBatch& batch, const ShardOutput& out);

  // One rank's share of a tensor-parallel step, on its own thread (reserve_scratch done):
  // the layers with their all-reduces, then its logits shard into `out` (host memory),
  // waited for.
  Status forward_shard(const StepBatch& batch, const AttentionPlan& plan,
                       const ShardOutput& out) override {
    TS_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    prof_.begin(stream_, batch.num_rows());
    TS_RETURN_IF_ERROR(enqueue_step(batch, plan));
    const int64_t n = int64_t(batch.logit_rows.size());
    if (n > 0 && !batch.sampling.empty()) {
      TS_RETURN_IF_ERROR(gather_and_sample(batch, out));
    } else if (n > 0 && batch.full_logits) {
      // This rank's columns [vocab_begin, + vocab_) of the host's [n][vocab] rows.
      TS_CUDA(cudaMemcpy2DAsync(out.logits + shard_.vocab_begin, size_t(config_.vocab_size) * 4,
                                logits_.ptr, size_t(vocab_) * 4, size_t(vocab_) * 4, size_t(n),
                                cudaMemcpyDeviceToHost, stream_),
              "logits download");
    } else if (n > 0) {
      const int64_t limit = batch.drawable_vocab(config_.vocab_size);
      const int64_t mine = std::clamp<int64_t>(limit - shard_.vocab_begin, 0, vocab_);
      float* maxes = argmax_.as<float>();
      float* sums = maxes + n;
      int32_t* ids = reinterpret_cast<int32_t*>(sums + n);
      cuda::argmax_partial(logits_.as<float>(), n, vocab_, mine, shard_.vocab_begin, maxes, sums,
                           ids, stream_);
      TS_CUDA(cudaMemcpyAsync(out.maxes, maxes, size_t(n) * 4, cudaMemcpyDeviceToHost, stream_),
              "argmax download");
      TS_CUDA(cudaMemcpyAsync(out.sums, sums, size_t(n) * 4, cudaMemcpyDeviceToHost, stream_),
              "argmax download");
      TS_CUDA(cudaMemcpyAsync(out.ids, ids, size_t(n) * 4, cudaMemcpyDeviceToHost, stream_),
              "argmax download");
    }
    prof_.mark("logits", stream_);
    TS_CUDA(cudaStreamSynchronize(stream_), "step");
    TS_CUDA(cudaGetLastError(), "kernel launch");
    prof_.end();
    return Status::Ok();
  }

  // Grows the step's device scratch and pinned metadata buffer (on this rank's device; for a
  // tensor-parallel step, before any rank enqueues its collectives, since cudaFree waits for
  // the device).
  Status reserve_scratch(const StepBatch& batch) override;

 private:
  // Enqueues the step's device work up to the LM head (logits_ float [n][vocab_]): metadata
  // and plan upload, slot moves, page copies, then the layers (from a CUDA graph when on).
  Status enqueue_step(const StepBatch& batch, const AttentionPlan& plan);

  // What a captured layer chain depends on besides the uploaded data: the step's shape, the
  // attention grid, and every buffer the chain reads or writes (they move when they grow;
  // those allocated once by init() — weights, pool, split-K parts — are left out). The split-K
  // choice of each residual GEMM follows from the rows alone and never changes once made
  // (split_k_parts), so it needs no place in the key.
  struct GraphKey {
    int64_t rows = 0, n_logits = 0;
    TreeAttentionGrid grid;  // the attention's (tree_attention_graph_grid)
    std::array<const void*, 14> buffers{};
    bool operator==(const GraphKey&) const = default;
  };
  struct StepGraph {
    GraphKey key;
    cudaGraphExec_t exec = nullptr;
  };
  static constexpr size_t kMaxGraphs = 8;
  static constexpr int64_t kCublasWorkspaceBytes = 32 << 20;
  // Split-K applies to steps up to this many rows (decode and verify steps; a prefill chunk's
  // GEMM has rows enough to fill the GPU unsplit). The top of a gemm_rows_bucket.
  static constexpr int64_t kSplitMaxRows = 256;
  // Auto splits only where the tuner's median for 2 parts is at least 3% below the unsplit
  // GEMM's: a gain of about 1% in the tuner is within the step's noise and can move the step
  // either way, while larger gains carry over to it.
  static constexpr float kSplitMargin = 0.97f;

  // The layer chain from a graph: replayed when this shape has one; captured when the shape
  // repeats the previous step's (a decode batch; a one-off prefill chunk runs eagerly, with
  // the same grid, so both paths compute the same thing).
  Status run_step_graph(const StepBatch& batch);

  // Captures enqueue_layers into *exec; any failure (of the capture or of an enqueue inside
  // it) ends the capture and is returned.
  Status capture_layers(const StepBatch& batch, TreeAttentionGrid grid, cudaGraphExec_t* exec);

  void drop_graphs();

  // Embedding, every layer, final norm and LM head on the logit rows (grid: the attention
  // launch's, see TreeAttentionGrid).
  Status enqueue_layers(const StepBatch& batch, TreeAttentionGrid grid);

  // residual (float [rows][h]) += x [rows][k] . w [h][k]^T, then out = rmsnorm(residual) *
  // norm (when norm is not null). Tensor parallel: the GEMM is row-parallel (k is this
  // rank's slice), so its float32 partial sums are all-reduced first. same_shape: w's kind in
  // every layer (for tuning).
  // FP8 models pass the layer as w8 (w is then null), and as next_q where the normed output
  // goes (fp8_rows_for: the next FP8 GEMM's input, quantized by the norm kernel);
  // x_quantized: x's e4m3 copy is in xq_ / xs_ already (fp8_rows_for(w8) when x was written).
  Status residual_gemm(const void* x, const void* w, const Fp8Linear& w8,
                       std::span<const void* const> same_shape, int64_t rows, int64_t k,
                       const void* norm, void* out, const char* name, cuda::Fp8Rows next_q = {},
                       bool x_quantized = false) {
    const float eps = float(config_.rms_norm_eps);
    int32_t parts = 1;
    if (world_ == 1 && !fp8_) {
      TS_RETURN_IF_ERROR(split_k_parts(x, w, same_shape, rows, k, &parts));
    }
    const bool p2p =
        world_ > 1 && p2p_on_ && rows <= options_.p2p_max_rows && !options_.skip_collectives;
    if (fp8_) {
      // FP8: float32 out, all-reduced under tensor parallelism (each rank's partial sums from
      // its slice of k), added and normed by the float-delta kernel, which also writes the
      // next FP8 GEMM's e4m3 input.
      const cuda::Fp8Rows q = out ? next_q : cuda::Fp8Rows{};
      if (p2p) {
        const int parity = p2p_call_++ & 1;  // as the 16-bit branch below
        TS_RETURN_IF_ERROR(
            fp8_gemm(x, w8, p2p_partial_[parity], rows, h_, k, true, same_shape, x_quantized));
        prof_.mark(name, stream_);
        cuda::p2p_all_reduce_add_rms_norm(dtype_, residual_.as<float>(), p2p_[parity], norm, eps,
                                          rows, h_, out, stream_, q);
        prof_.mark("all-reduce+norm", stream_);
        return Status::Ok();
      }
      float* partial = partial_.as<float>();
      TS_RETURN_IF_ERROR(fp8_gemm(x, w8, partial, rows, h_, k, true, same_shape, x_quantized));
      prof_.mark(name, stream_);
      TS_RETURN_IF_ERROR(all_reduce(partial, rows * h_));
      cuda::add_rms_norm_f32_delta(dtype_, residual_.as<float>(), partial, 1, 0, norm, eps, rows,
                                   h_, out, stream_, q);
    } else if (parts > 1) {
      // Split-K: float parts [parts][rows][h], summed in order and rounded once by the norm.
      TS_RETURN_IF_ERROR(gemm_.run_split_k(x, w, split_parts_, rows, h_, k, parts, model_type(),
                                           stream_, same_shape));
      prof_.mark(name, stream_);
      cuda::add_rms_norm_f32_delta(dtype_, residual_.as<float>(), split_parts_, parts, rows * h_,
                                   norm, eps, rows, h_, out, stream_);
    } else if (world_ == 1) {
      TS_RETURN_IF_ERROR(gemm(x, w, tmp_.ptr, rows, h_, k, false, same_shape));
      prof_.mark(name, stream_);
      cuda::add_rms_norm(dtype_, residual_.as<float>(), tmp_.ptr, norm, eps, rows, h_, out,
                         stream_);
    } else if (p2p) {
      // Every rank takes this branch for the same steps (same rows) and alternates its two
      // buffers the same way (p2p_call_ restarts every step; a step has an even number of
      // calls, so eager and replayed steps agree).
      const int parity = p2p_call_++ & 1;
      TS_RETURN_IF_ERROR(gemm(x, w, p2p_partial_[parity], rows, h_, k, true, same_shape));
      prof_.mark(name, stream_);
      cuda::p2p_all_reduce_add_rms_norm(dtype_, residual_.as<float>(), p2p_[parity], norm, eps,
                                        rows, h_, out, stream_);
      prof_.mark("all-reduce+norm", stream_);
      return Status::Ok();
    } else {
      float* partial = partial_.as<float>();
      TS_RETURN_IF_ERROR(gemm(x, w, partial, rows, h_, k, true, same_shape));
      prof_.mark(name, stream_);
      TS_RETURN_IF_ERROR(all_reduce(partial, rows * h_));
      cuda::add_rms_norm_f32_delta(dtype_, residual_.as<float>(), partial, 1, 0, norm, eps, rows,
                                   h_, out, stream_);
    }
    prof_.mark("norm", stream_);
    return Status::Ok();
  }

  // How many split-K parts the residual GEMM x [rows][k] . w [h][k]^T runs as (1: one GEMM;
  // options_.gemm_split_k). Auto takes 2 parts when the tuner's median for them (float parts)
  // beats the unsplit GEMM's (model-dtype output, what runs otherwise) by kSplitMargin, per
  // (row bucket, k): O and down decide apart. The choice is made the first time the pair comes
  // outside a capture — tuning both if they are not yet — and kept for good: a graph is captured
  // only when a step shape comes a second time in a row, after its eager run decided, and replays
  // it from then on. A pair first met inside a capture (not expected) keeps 1 part.
  Status split_k_parts(const void* x, const void* w, std::span<const void* const> same_shape,
                       int64_t rows, int64_t k, int32_t* parts) {
    *parts = 1;
    const int32_t option = options_.gemm_split_k;
    auto splits_into = [&](int32_t p) { return detail::LtGemm::splits_evenly(k, p, model_type()); };
    if (split_parts_ == nullptr || rows == 0 || rows > kSplitMaxRows) return Status::Ok();
    if (option > 1) {
      if (splits_into(option)) *parts = option;
      return Status::Ok();
    }
    if (!splits_into(2)) return Status::Ok();
    const std::pair<int64_t, int64_t> key{detail::gemm_rows_bucket(rows), k};
    if (auto it = split_choice_.find(key); it != split_choice_.end()) {
      *parts = it->second;
      return Status::Ok();
    }
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    TS_CUDA(cudaStreamIsCapturing(stream_, &capturing), "capture status");
    if (capturing == cudaStreamCaptureStatusNone) {
      const cudaDataType_t t = model_type();
      float one = -1, two = -1;
      TS_RETURN_IF_ERROR(
          gemm_.tuned_time(x, w, tmp_.ptr, rows, h_, k, 1, t, t, stream_, same_shape, &one));
      TS_RETURN_IF_ERROR(gemm_.tuned_time(x, w, split_parts_, rows, h_, k, 2, t, CUDA_R_32F,
                                          stream_, same_shape, &two));
      if (one > 0 && two > 0 && two <= kSplitMargin * one) *parts = 2;
    }
    split_choice_.emplace(key, *parts);
    return Status::Ok();
  }

  static Status nccl_status(ncclResult_t r, const char* what) {
    if (r == ncclSuccess) return Status::Ok();
    return Internal(std::string("NCCL ") + what + " failed: " + ncclGetErrorString(r));
  }

  // In-place float32 sum over the ranks (none with world_ == 1, or when the benchmark option
  // skip_collectives measures the step without communication).
  Status all_reduce(float* data, int64_t n);

  // The step buffers and the attention workspace, freed while this rank's device is current.
  void release_buffers();

  Status alloc(void** p, int64_t bytes);

  // y [m][n] = x [m][k] . w [n][k]^T (row-major); same_shape: the matrices of w's kind
  // (all layers' O weights, say), which tuning the shape cycles through.
  Status gemm(const void* x, const void* w, void* y, int64_t m, int64_t n, int64_t k, bool f32_out,
              std::span<const void* const> same_shape) {
    const cudaDataType_t t = model_type();
    return gemm_.run(x, w, y, m, n, k, t, f32_out ? CUDA_R_32F : t, stream_, same_shape);
  }

  // FP8: y [m][n] = x [m][k] . w [n][k]^T with x (T) quantized to e4m3 first (per row, or by
  // the layer's static input scale) into xq_ / xs_, unless x_quantized: the kernel that wrote x
  // wrote xq_ / xs_ too (fp8_rows_for). same_shape: the e4m3 matrices of w's kind.
  Status fp8_gemm(const void* x, const Fp8Linear& w, void* y, int64_t m, int64_t n, int64_t k,
                  bool f32_out, std::span<const void* const> same_shape, bool x_quantized) {
    uint8_t* xq = xq_.as<uint8_t>();
    float* xs = xs_.as<float>();
    if (!x_quantized && w.input_scale) {
      cuda::quantize_rows_fp8_static(dtype_, x, m, k, w.input_scale, xq, xs, stream_);
    } else if (!x_quantized) {
      cuda::quantize_rows_fp8(dtype_, x, m, k, xq, xs, stream_);
    }
    const cudaDataType_t t = model_type();
    return gemm_.run_fp8(xq, xs, w.w, w.scale, y, m, n, k, f32_out ? CUDA_R_32F : t, stream_,
                         same_shape);
  }

  // Where a norm kernel writing the input of `next` (an FP8 layer quantized per token) also
  // writes its e4m3 copy: xq_ / xs_. Nothing for 16-bit models and static input scales.
  cuda::Fp8Rows fp8_rows_for(const Fp8Linear& next) {
    if (!fp8_ || next.input_scale != nullptr) return {};
    return {xq_.as<uint8_t>(), xs_.as<float>()};
  }

  // The QKV and gate/up GEMMs: 16-bit or FP8 as the model is. x_quantized: x's norm kernel
  // wrote its e4m3 copy (fp8_rows_for(w8)).
  Status linear(const void* x, const void* w16, const Fp8Linear& w8, void* y, int64_t m, int64_t n,
                int64_t k, std::span<const void* const> same_shape, bool x_quantized) {
    if (fp8_) return fp8_gemm(x, w8, y, m, n, k, false, same_shape, x_quantized);
    return gemm(x, w16, y, m, n, k, false, same_shape);
  }

  // FP8 weights from 16-bit ones (a checkpoint's, or random): each matrix goes into the stage,
  // T as large as a layer's largest, in place of its own 16-bit buffer (null under FP8), and
  // is then quantized per output row into its e4m3 layer. Without init() (16-bit models) the
  // matrices go to their own buffers and quantize() does nothing.
  class Fp8Stage {
   public:
    Status init(CudaBackend* b) {
      backend_ = b;
      return buffer_.reserve(size_t(b->fp8_stage_elems()) * 2, "FP8 staging");
    }
    void* target(void* w16) const { return backend_ ? buffer_.ptr : w16; }
    void quantize(Fp8Linear* w8, int64_t rows, int64_t cols) const {
      if (!backend_) return;
      cuda::quantize_rows_fp8(backend_->dtype_, buffer_.ptr, rows, cols, w8->w, w8->scale,
                              backend_->stream_);
    }

   private:
    CudaBackend* backend_ = nullptr;
    DeviceBuffer buffer_;
  };

  // The elements of the largest matrix of a layer (the FP8 stage).
  int64_t fp8_stage_elems() const;

  // Device memory for an FP8 layer of n rows of k (weights, scales, and the input scale when
  // the checkpoint has static activation scales).
  Status alloc_fp8(Fp8Linear* l, int64_t n, int64_t k);

  // Loads a layer's FP8 projections from an FP8 checkpoint: its e4m3 bytes as they are, its
  // scales per row (16-bit checkpoints go through Fp8Stage instead).
  Status load_fp8_layer(const LlamaLayerWeights& src, LayerWeights* dst);

  cudaDataType_t model_type() const { return options_.bfloat16 ? CUDA_R_16BF : CUDA_R_16F; }

  static size_t align8(size_t n) { return (n + 7) & ~size_t(7); }

  static size_t meta_bytes(const StepBatch& b) {
    const size_t rows = size_t(b.num_rows());
    return align8(rows * 4) * 2 + rows * 8 + align8(b.logit_rows.size() * 4) +
           b.slot_moves.size() * 16 + align8(b.page_copies.size() * 4) * 3 + 64;
  }

  // Packs ids, positions, slots, logit rows, moves and copies into one pinned buffer and
  // uploads it with one copy; the d_* pointers point into the device copy.
  Status upload_metadata(const StepBatch& b);

  ModelConfig config_;
  CudaBackendOptions options_;
  TensorParallelShard shard_;
  int32_t world_ = 1;
  int32_t device_ = 0;
  ncclComm_t comm_ = nullptr;  // world_ > 1; owned by the TensorParallelBackend
  // This rank's sizes: hidden, head_dim, q / kv heads, q / kv widths, intermediate, vocab.
  int64_t h_ = 0, d_ = 0;
  int32_t nh_ = 0, nkv_ = 0;
  int64_t q_size_ = 0, kv_size_ = 0, im_ = 0, vocab_ = 0;
  cuda::Dtype dtype_ = cuda::Dtype::kFloat16;
  bool fp8_ = false;  // config.quant.scheme == kFp8: e4m3 linear layers
  KvLayout layout_;
  float scale_ = 1.0f;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  std::vector<void*> allocations_;

  void* embed_ = nullptr;
  std::vector<LayerWeights> layers_;
  void* norm_ = nullptr;
  void* lm_head_ = nullptr;
  void* k_all_ = nullptr;  // T (e4m3 with kv_cache_fp8) [layers][pages][nkv][page_size][d]
  void* v_all_ = nullptr;
  // kv_cache_fp8: the rows' scales, float [layers][pages][nkv][page_size]; else null.
  float* k_scale_all_ = nullptr;
  float* v_scale_all_ = nullptr;
  void* inv_freq_ = nullptr;  // float [d / 2]
  const float* inv_freq() const { return static_cast<const float*>(inv_freq_); }

  detail::StepProfiler prof_;
  void* cublas_workspace_ = nullptr;
  detail::LtGemm gemm_;  // shares cublas_ (its fallback) and cublas_workspace_
  std::vector<const void*> qkv_set_, o_set_, gate_up_set_, down_set_, lm_head_set_;
  // Split-K (world_ == 1, options_.gemm_split_k != 1): the parts, float [parts][rows][h_] for
  // rows <= kSplitMaxRows (null when split-K is off), and auto's choice per (row bucket, k).
  float* split_parts_ = nullptr;
  std::map<std::pair<int64_t, int64_t>, int32_t> split_choice_;
  bool graphs_ = false;
  std::vector<StepGraph> step_graphs_;
  GraphKey last_eager_key_;
  TreeAttentionWorkspace workspace_;
  AttentionPlanConfig plan_config_;
  AttentionPlan plan_;
  StepBatchCheckScratch check_;

  DeviceBuffer argmax_, residual_, x_, tmp_, qkv_, q_, attn_, gu_, act_, final_, logits_, meta_;
  DeviceBuffer sample_params_, sample_out_;
  // float [rows][hidden]: row-parallel GEMM partial sums (world_ > 1), FP8 O and down outputs.
  DeviceBuffer partial_;
  // FP8: a GEMM input in e4m3, uint8 [rows][max(hidden, q, im)], and its row scales.
  DeviceBuffer xq_, xs_;
  // Peer-to-peer all-reduce (options_.p2p_all_reduce): float [p2p_max_rows][hidden] x 2,
  // uint32 flags [kP2PBlocks][kMaxP2PRanks] then call numbers [kP2PBlocks] (one allocation),
  // the kernel's arguments per buffer parity, and the step's call count.
  float* p2p_partial_[2] = {nullptr, nullptr};
  uint32_t* p2p_flags_ = nullptr;
  uint32_t* p2p_counters_ = nullptr;
  cuda::P2PAllReduce p2p_[2];
  bool p2p_on_ = false;
  int p2p_call_ = 0;
  // Rank 0 of a tensor-parallel sampling step: the other ranks' shards as received, and the
  // whole rows (float [n][vocab]).
  DeviceBuffer gather_recv_, gathered_;
  PinnedBuffer host_meta_, host_logits_;
  std::vector<int64_t> move_src_, move_dst_;
  std::vector<int32_t> copy_src_, copy_dst_, copy_n_;
  int64_t* d_slots_ = nullptr;
  int32_t *d_ids_ = nullptr, *d_positions_ = nullptr, *d_logit_rows_ = nullptr;
  int64_t *d_move_src_ = nullptr, *d_move_dst_ = nullptr;
  int32_t *d_copy_src_ = nullptr, *d_copy_dst_ = nullptr, *d_copy_n_ = nullptr;
};

}  // namespace treeserve::detail
