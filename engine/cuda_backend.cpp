// The CUDA backend. One forward per step, all on one stream:
//   upload step metadata + plan -> slot moves, page copies -> embed -> per layer
//   [RMSNorm, QKV GEMM, RoPE + K/V append into pages, tree attention, O GEMM, residual add +
//   RMSNorm, gate/up GEMM, SwiGLU, down GEMM, residual add] -> final RMSNorm and LM head on
//   the logit rows only -> logits to the host.
// With options.cuda_graphs the part from the embedding to the LM head is replayed
// from a CUDA graph per step shape (rows, logit rows, attention grid bucket, buffers): the
// metadata and plan uploads, slot moves and page copies stay ordinary stream work before it.
// The residual stream is float32; activations and weights are in the model dtype; GEMMs
// accumulate in float32 (CUBLAS_COMPUTE_32F): cublasLt with each shape's algorithm chosen by
// timing (detail/cuda_gemm.h, options.gemm_autotune; each tuned on all layers' matrices of
// its kind), or cublasGemmEx. On one GPU, the O and down GEMMs of steps of up to 256 rows may
// run split-K (options.gemm_split_k): float32 parts of K slices from one strided-batched GEMM,
// summed by the residual-add + RMSNorm kernel that follows them anyway.
//
// Tensor parallelism (options.tensor_parallel = N > 1): CudaBackend is one rank's shard
// (engine/tensor_parallel.h: its query/KV heads, intermediate and vocabulary slices, its
// heads' share of every KV page, its own stream, cuBLAS handle and workspace), driven by
// cuda_tensor_parallel.cpp (one thread per GPU, the plan built once). The O and down GEMMs
// write float32 partial sums that an NCCL all-reduce adds (float32, so the sum is rounded to
// the model dtype once, as the unsharded GEMM rounds it); the vocabulary-sharded embedding is
// all-reduced the same way (exact: one rank holds each row). Each rank's logits shard goes
// to the host (its columns of [rows][vocab], or for greedy steps its (max, sum exp, argmax),
// merged there), or for sampling steps to rank 0, which draws on the device
// (gather_and_sample). With N = 1 none of this runs: no extra copy, sync or kernel.
#include "engine/cuda_backend.h"

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

namespace treeserve {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  return detail::cuda_error_status(e, "CUDA backend", what);
}
#define TS_CUDA(expr, what) TS_RETURN_IF_ERROR(cuda_status((expr), what))

Status cublas_status(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Internal(std::string("cuBLAS: ") + what + " failed (status " + std::to_string(int(s)) +
                  ")");
}

using detail::DeviceBuffer;
using detail::PinnedBuffer;

struct LayerWeights {
  void* input_norm = nullptr;  // T [hidden]
  void* qkv = nullptr;         // T [q + 2 kv][hidden]
  void* o = nullptr;           // T [hidden][q]
  void* post_norm = nullptr;   // T [hidden]
  void* gate_up = nullptr;     // T [2 im][hidden]
  void* down = nullptr;        // T [hidden][im]
};

void* byte_offset(void* p, int64_t elems, int64_t elem_bytes) {
  return static_cast<char*>(p) + elems * elem_bytes;
}

using detail::ShardOutput;

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
    layout_.dtype_bytes = 2;
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
  Status init() override {
    TS_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    TS_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    TS_RETURN_IF_ERROR(cublas_status(cublasCreate(&cublas_), "cublasCreate"));
    TS_RETURN_IF_ERROR(cublas_status(cublasSetStream(cublas_, stream_), "cublasSetStream"));
    // A workspace of our own (after cublasSetStream, which resets it): cuBLAS then allocates
    // nothing while a graph is captured.
    TS_RETURN_IF_ERROR(alloc(&cublas_workspace_, kCublasWorkspaceBytes));
    TS_RETURN_IF_ERROR(
        cublas_status(cublasSetWorkspace(cublas_, cublas_workspace_, size_t(kCublasWorkspaceBytes)),
                      "cublasSetWorkspace"));
    TS_RETURN_IF_ERROR(gemm_.init(device_, cublas_, cublas_workspace_,
                                  size_t(kCublasWorkspaceBytes), options_.gemm_autotune));
    // Tensor parallel too: NCCL collectives are captured like kernels (each rank's thread
    // captures its own stream, thread-local mode), and every rank makes the same capture and
    // replay decisions since they follow from the step's shape alone.
    graphs_ = options_.cuda_graphs && !prof_.on();
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_);
    // This rank's slices (the whole model when world_ == 1).
    const int64_t h = h_, q = q_size_, kv = kv_size_, im = im_, v = vocab_;
    TS_RETURN_IF_ERROR(alloc(&embed_, v * h * 2));
    layers_.resize(size_t(config_.num_hidden_layers));
    for (LayerWeights& l : layers_) {
      TS_RETURN_IF_ERROR(alloc(&l.input_norm, h * 2));
      TS_RETURN_IF_ERROR(alloc(&l.qkv, (q + 2 * kv) * h * 2));
      TS_RETURN_IF_ERROR(alloc(&l.o, h * q * 2));
      TS_RETURN_IF_ERROR(alloc(&l.post_norm, h * 2));
      TS_RETURN_IF_ERROR(alloc(&l.gate_up, 2 * im * h * 2));
      TS_RETURN_IF_ERROR(alloc(&l.down, h * im * 2));
    }
    TS_RETURN_IF_ERROR(alloc(&norm_, h * 2));
    if (config_.tie_word_embeddings) {
      lm_head_ = embed_;
    } else {
      TS_RETURN_IF_ERROR(alloc(&lm_head_, v * h * 2));
    }
    // Each GEMM's same-shape weights, cycled through when its shape is tuned.
    for (const LayerWeights& l : layers_) {
      qkv_set_.push_back(l.qkv);
      o_set_.push_back(l.o);
      gate_up_set_.push_back(l.gate_up);
      down_set_.push_back(l.down);
    }
    lm_head_set_ = {lm_head_};
    const int64_t pool_bytes = layout_.layer_elems() * layout_.num_layers * 2;
    TS_RETURN_IF_ERROR(alloc(&k_all_, pool_bytes));
    TS_RETURN_IF_ERROR(alloc(&v_all_, pool_bytes));
    TS_CUDA(cudaMemsetAsync(k_all_, 0, size_t(pool_bytes), stream_), "pool memset");
    TS_CUDA(cudaMemsetAsync(v_all_, 0, size_t(pool_bytes), stream_), "pool memset");
    std::vector<float> inv_freq = rope_inv_freq(config_);
    TS_RETURN_IF_ERROR(alloc(&inv_freq_, int64_t(inv_freq.size()) * 4));
    TS_CUDA(cudaMemcpy(inv_freq_, inv_freq.data(), inv_freq.size() * 4, cudaMemcpyHostToDevice),
            "inv_freq upload");

    TreeAttentionLimits limits;
    limits.max_num_q_heads = nh_;
    limits.max_head_dim = int32_t(config_.head_dim);
    limits.max_queries = 1 << 16;
    limits.max_work_items = 1 << 15;
    limits.max_partials = 1 << 17;
    limits.max_segments = 1 << 17;
    limits.max_mask_words = 1 << 20;
    limits.max_view_pages = int32_t(std::min<int64_t>(layout_.num_pages * 4, 1 << 24));
    TS_RETURN_IF_ERROR(workspace_.init(limits));
    plan_config_ = tree_attention_plan_config(nh_, nkv_, int32_t(d_), sms);
    limits.apply_to(&plan_config_);
    plan_config_.num_pages = layout_.num_pages;
    if (world_ > 1 && options_.p2p_all_reduce) {
      // Two partial-sum buffers (alternate calls) and the barrier's flags and call numbers,
      // zeroed before any peer can write them (the first step comes after init returns).
      const int64_t bytes = int64_t(options_.p2p_max_rows) * h_ * 4;
      for (float*& buf : p2p_partial_) {
        void* p = nullptr;
        TS_RETURN_IF_ERROR(alloc(&p, bytes));
        buf = static_cast<float*>(p);
      }
      void* flags = nullptr;
      const int64_t flag_words = int64_t(cuda::kP2PBlocks) * (cuda::kMaxP2PRanks + 1);
      TS_RETURN_IF_ERROR(alloc(&flags, flag_words * 4));
      TS_CUDA(cudaMemsetAsync(flags, 0, size_t(flag_words) * 4, stream_), "p2p flags");
      TS_CUDA(cudaStreamSynchronize(stream_), "p2p flags");
      p2p_flags_ = static_cast<uint32_t*>(flags);
      p2p_counters_ = p2p_flags_ + cuda::kP2PBlocks * cuda::kMaxP2PRanks;
    }
    const int32_t split = options_.gemm_split_k;
    if (world_ == 1 && (split > 1 || (split == 0 && options_.gemm_autotune))) {
      // The split-K parts, float [parts][rows <= kSplitMaxRows][hidden] (8 MiB for Llama-3-8B
      // with 2 parts), allocated once: graphs never see it move.
      void* p = nullptr;
      TS_RETURN_IF_ERROR(alloc(&p, int64_t(std::max(split, 2)) * kSplitMaxRows * h_ * 4));
      split_parts_ = static_cast<float*>(p);
    }
    return Status::Ok();
  }

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
  Status load(const LlamaWeights& weights) override {
    if (int64_t(weights.layers.size()) != config_.num_hidden_layers) {
      return InvalidArgument(
          "weights have " + std::to_string(weights.layers.size()) +
          " layers, config.num_hidden_layers = " + std::to_string(config_.num_hidden_layers));
    }
    TS_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    const int64_t h = h_, d = d_, q = config_.q_size(), kv = config_.kv_size();
    const int64_t im = config_.intermediate_size, v = config_.vocab_size;
    const int64_t q0 = shard_.q_head_begin * d, kv0 = shard_.kv_head_begin * d;
    const int64_t im0 = shard_.im_begin, v0 = shard_.vocab_begin;
    detail::WeightUploader up(dtype_, stream_);
    // Row slices (embedding, LM head, Q/K/V, gate/up) and column slices (O, down).
    auto rows = [&](const TensorView& t, std::vector<int64_t> shape, int64_t row0, int64_t n,
                    void* dst) { return up.upload_block(t, shape, row0, n, 0, shape[1], dst); };
    auto cols = [&](const TensorView& t, std::vector<int64_t> shape, int64_t col0, int64_t n,
                    void* dst) { return up.upload_block(t, shape, 0, shape[0], col0, n, dst); };
    auto vec = [&](const TensorView& t, void* dst) {
      return up.upload_block(t, {h}, 0, 1, 0, h, dst);
    };
    TS_RETURN_IF_ERROR(rows(weights.embed_tokens, {v, h}, v0, vocab_, embed_));
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LlamaLayerWeights& src = weights.layers[i];
      LayerWeights& dst = layers_[i];
      TS_RETURN_IF_ERROR(vec(src.input_layernorm, dst.input_norm));
      TS_RETURN_IF_ERROR(rows(src.q_proj, {q, h}, q0, q_size_, dst.qkv));
      TS_RETURN_IF_ERROR(
          rows(src.k_proj, {kv, h}, kv0, kv_size_, byte_offset(dst.qkv, q_size_ * h, 2)));
      TS_RETURN_IF_ERROR(rows(src.v_proj, {kv, h}, kv0, kv_size_,
                              byte_offset(dst.qkv, (q_size_ + kv_size_) * h, 2)));
      TS_RETURN_IF_ERROR(cols(src.o_proj, {h, q}, q0, q_size_, dst.o));
      TS_RETURN_IF_ERROR(vec(src.post_attention_layernorm, dst.post_norm));
      TS_RETURN_IF_ERROR(rows(src.gate_proj, {im, h}, im0, im_, dst.gate_up));
      TS_RETURN_IF_ERROR(
          rows(src.up_proj, {im, h}, im0, im_, byte_offset(dst.gate_up, im_ * h, 2)));
      TS_RETURN_IF_ERROR(cols(src.down_proj, {h, im}, im0, im_, dst.down));
    }
    TS_RETURN_IF_ERROR(vec(weights.norm, norm_));
    if (!config_.tie_word_embeddings) {
      TS_RETURN_IF_ERROR(rows(weights.lm_head, {v, h}, v0, vocab_, lm_head_));
    }
    return up.finish();
  }

  // Random weights: uniform(+-1/sqrt(fan_in)) matrices, norms of ones — one seed per matrix
  // (the fused Q/K/V and gate/up count as one), each element drawn from its index in the
  // whole matrix, so every rank count holds the same global weights (and random_cpu_weights
  // the same values in float32).
  Status randomize(uint64_t seed) override {
    TS_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    const int64_t h = h_, d = d_, q = config_.q_size(), kv = config_.kv_size();
    const int64_t im = config_.intermediate_size;
    const int64_t q0 = shard_.q_head_begin * d, kv0 = shard_.kv_head_begin * d;
    const int64_t im0 = shard_.im_begin, v0 = shard_.vocab_begin;
    // dst = the block [row0, +rows) x [col0, +cols) of a matrix with src_cols columns.
    auto block = [&](void* dst, int64_t rows, int64_t cols, uint64_t s, int64_t src_cols,
                     int64_t row0, int64_t col0, int64_t fan_in) {
      cuda::fill_random_block(dtype_, dst, rows, cols, s, src_cols, row0, col0,
                              float(1.0 / std::sqrt(double(fan_in))), 0.0f, stream_);
    };
    auto ones = [&](void* p, int64_t n) {
      cuda::fill_random(dtype_, p, n, 0, 0.0f, 1.0f, stream_);
    };
    block(embed_, vocab_, h, seed++, h, v0, 0, 1);
    for (LayerWeights& l : layers_) {
      ones(l.input_norm, h);
      const uint64_t s_qkv = seed++;  // [q | k | v][h]
      block(l.qkv, q_size_, h, s_qkv, h, q0, 0, h);
      block(byte_offset(l.qkv, q_size_ * h, 2), kv_size_, h, s_qkv, h, q + kv0, 0, h);
      block(byte_offset(l.qkv, (q_size_ + kv_size_) * h, 2), kv_size_, h, s_qkv, h, q + kv + kv0, 0,
            h);
      block(l.o, h, q_size_, seed++, q, 0, q0, q);  // [h][q]
      ones(l.post_norm, h);
      const uint64_t s_gu = seed++;  // [gate | up][h]
      block(l.gate_up, im_, h, s_gu, h, im0, 0, h);
      block(byte_offset(l.gate_up, im_ * h, 2), im_, h, s_gu, h, im + im0, 0, h);
      block(l.down, h, im_, seed++, im, 0, im0, im);  // [h][im]
    }
    ones(norm_, h);
    if (!config_.tie_word_embeddings) block(lm_head_, vocab_, h, seed++, h, v0, 0, h);
    TS_CUDA(cudaStreamSynchronize(stream_), "random weights");
    TS_CUDA(cudaGetLastError(), "random weights");
    return Status::Ok();
  }

  std::string_view name() const override { return "cuda"; }
  const ModelConfig& model_config() const override { return config_; }
  const KvLayout& kv_layout() const override { return layout_; }

  // The step's attention plan (built once; a TensorParallelBackend shares it across ranks).
  Status build_plan(const AttentionView& view, AttentionPlan* plan) const override {
    if (options_.baseline_attention) return build_baseline_plan(view, plan_config_, plan);
    return build_attention_plan(view, plan_config_, plan);
  }

  Status forward(const StepBatch& batch, Logits* out) override {
    prof_.begin(stream_, batch.num_rows());
    TS_RETURN_IF_ERROR(validate_step_batch(batch, layout_, config_.vocab_size, &check_));
    TS_RETURN_IF_ERROR(build_plan(batch.view, &plan_));
    const int64_t n_logits = int64_t(batch.logit_rows.size());
    TS_RETURN_IF_ERROR(reserve_scratch(batch));
    prof_.host("plan");
    TS_RETURN_IF_ERROR(enqueue_step(batch, plan_));
    // Logits float [n][vocab] on the device.
    out->num_rows = int32_t(n_logits);
    out->vocab = config_.vocab_size;
    out->sampled.clear();
    if (n_logits > 0) {
      prof_.host("enqueue");
      if (!batch.sampling.empty()) {
        TS_RETURN_IF_ERROR(sample_on_device(batch, out));
      } else if (batch.full_logits) {
        const size_t bytes = size_t(n_logits * config_.vocab_size) * 4;
        TS_RETURN_IF_ERROR(host_logits_.reserve(bytes, "pinned logits"));
        TS_CUDA(
            cudaMemcpyAsync(host_logits_.ptr, logits_.ptr, bytes, cudaMemcpyDeviceToHost, stream_),
            "logits download");
        TS_CUDA(cudaStreamSynchronize(stream_), "step");
        out->data.resize(size_t(n_logits * config_.vocab_size));
        std::memcpy(out->data.data(), host_logits_.ptr, bytes);
        out->argmax.clear();
        out->argmax_logprob.clear();
      } else {
        // Greedy rows only: the argmax and its logprob per row (8 bytes, not the vocab).
        const int64_t limit = batch.drawable_vocab(config_.vocab_size);
        const size_t result_bytes = (size_t(n_logits) * 8 + 15) / 16 * 16;
        TS_RETURN_IF_ERROR(
            argmax_.reserve(result_bytes + cuda::argmax_scratch_bytes(n_logits, limit), "argmax"));
        int32_t* ids = argmax_.as<int32_t>();
        float* lps = reinterpret_cast<float*>(ids + n_logits);
        cuda::argmax_logprob(logits_.as<float>(), n_logits, config_.vocab_size, limit, ids, lps,
                             static_cast<char*>(argmax_.ptr) + result_bytes, stream_);
        TS_RETURN_IF_ERROR(host_logits_.reserve(size_t(n_logits) * 8, "pinned argmax"));
        TS_CUDA(cudaMemcpyAsync(host_logits_.ptr, argmax_.ptr, size_t(n_logits) * 8,
                                cudaMemcpyDeviceToHost, stream_),
                "argmax download");
        TS_CUDA(cudaStreamSynchronize(stream_), "step");
        out->data.clear();
        const int32_t* hid = host_logits_.as<const int32_t>();
        out->argmax.assign(hid, hid + n_logits);
        const float* hlp = reinterpret_cast<const float*>(hid + n_logits);
        out->argmax_logprob.assign(hlp, hlp + n_logits);
      }
    } else {
      TS_CUDA(cudaStreamSynchronize(stream_), "step");
      out->data.clear();
      out->argmax.clear();
      out->argmax_logprob.clear();
    }
    TS_CUDA(cudaGetLastError(), "kernel launch");
    prof_.mark("logits", stream_);
    prof_.host("wait");
    prof_.end();
    return Status::Ok();
  }

  // StepBatch::sampling on the device (cuda_sampling.cu): the rows' params up, a token, its
  // logprob and the alternatives per row down (~170 bytes, not the vocabulary).
  Status sample_on_device(const StepBatch& batch, Logits* out) {
    const int64_t n = int64_t(batch.logit_rows.size());
    TS_RETURN_IF_ERROR(reserve_sampling(n));
    TS_RETURN_IF_ERROR(enqueue_sampling(batch, logits_.as<float>()));
    // Same stream: the params upload has read the pinned buffer before this overwrites it.
    TS_CUDA(
        cudaMemcpyAsync(host_logits_.ptr, sample_out_.ptr, size_t(n) * sizeof(cuda::DeviceSample),
                        cudaMemcpyDeviceToHost, stream_),
        "sampled tokens download");
    TS_CUDA(cudaStreamSynchronize(stream_), "step");
    out->data.clear();
    out->argmax.clear();
    out->argmax_logprob.clear();
    detail::append_device_samples(host_logits_.as<const cuda::DeviceSample>(), n, &out->sampled);
    return Status::Ok();
  }

  // Device and pinned buffers of a draw over n rows (before a tensor-parallel step starts).
  Status reserve_sampling(int64_t n) {
    const size_t param_bytes = size_t(n) * sizeof(cuda::DeviceSamplingRow);
    const size_t out_bytes = size_t(n) * sizeof(cuda::DeviceSample);
    TS_RETURN_IF_ERROR(sample_params_.reserve(param_bytes, "sampling params"));
    TS_RETURN_IF_ERROR(sample_out_.reserve(out_bytes, "sampled tokens"));
    return host_logits_.reserve(std::max(param_bytes, out_bytes), "pinned sampling rows");
  }

  // Uploads the rows' sampling params and enqueues the draw over `rows` (float [n][vocab],
  // the whole vocabulary) into sample_out_.
  Status enqueue_sampling(const StepBatch& batch, const float* rows) {
    const int64_t n = int64_t(batch.logit_rows.size());
    auto* params = host_logits_.as<cuda::DeviceSamplingRow>();
    for (int64_t i = 0; i < n; ++i) {
      const StepSampling& s = batch.sampling[size_t(i)];
      params[i] = detail::device_sampling_row(s.params, s.stream_key, s.position);
    }
    TS_CUDA(cudaMemcpyAsync(sample_params_.ptr, host_logits_.ptr,
                            size_t(n) * sizeof(cuda::DeviceSamplingRow), cudaMemcpyHostToDevice,
                            stream_),
            "sampling params upload");
    const int64_t limit = batch.drawable_vocab(config_.vocab_size);
    cuda::sample_rows(rows, n, config_.vocab_size, limit,
                      sample_params_.as<cuda::DeviceSamplingRow>(),
                      sample_out_.as<cuda::DeviceSample>(), stream_);
    return Status::Ok();
  }

  // A tensor-parallel sampling step: the ranks' logits shards meet on rank 0 (NCCL
  // point-to-point), which draws on the device like one GPU does; only the draws go to the
  // host (out.sampled). Every rank joins: the others send their shard.
  Status gather_and_sample(const StepBatch& batch, const ShardOutput& out) {
    const int64_t n = int64_t(batch.logit_rows.size());
    const size_t part = size_t(n * vocab_);  // every shard has vocab_ columns
    const bool communicate = !options_.skip_collectives;
    if (shard_.rank != 0) {
      if (communicate) {
        TS_RETURN_IF_ERROR(nccl_status(ncclSend(logits_.ptr, part, ncclFloat32, 0, comm_, stream_),
                                       "logits send"));
      }
      return Status::Ok();
    }
    float* recv = gather_recv_.as<float>();
    if (communicate) {
      TS_RETURN_IF_ERROR(nccl_status(ncclGroupStart(), "group start"));
      for (int32_t r = 1; r < world_; ++r) {
        const ncclResult_t got =
            ncclRecv(recv + size_t(r - 1) * part, part, ncclFloat32, r, comm_, stream_);
        if (got != ncclSuccess) {
          ncclGroupEnd();
          return nccl_status(got, "logits receive");
        }
      }
      TS_RETURN_IF_ERROR(nccl_status(ncclGroupEnd(), "group end"));
    }
    // Rank r's shard is columns [vocab_begin(r), + vocab_) of every row.
    float* rows = gathered_.as<float>();
    const int64_t vocab = config_.vocab_size;
    for (int32_t r = 0; r < world_; ++r) {
      const float* src = r == 0 ? logits_.as<float>() : recv + size_t(r - 1) * part;
      const int64_t begin = tensor_parallel_shard(config_, r, world_).vocab_begin;
      TS_CUDA(cudaMemcpy2DAsync(rows + begin, size_t(vocab) * 4, src, size_t(vocab_) * 4,
                                size_t(vocab_) * 4, size_t(n), cudaMemcpyDeviceToDevice, stream_),
              "logits gather");
    }
    TS_RETURN_IF_ERROR(enqueue_sampling(batch, rows));
    TS_CUDA(cudaMemcpyAsync(out.sampled, sample_out_.ptr, size_t(n) * sizeof(cuda::DeviceSample),
                            cudaMemcpyDeviceToHost, stream_),
            "sampled tokens download");
    return Status::Ok();
  }

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
  Status reserve_scratch(const StepBatch& batch) override {
    if (world_ > 1) TS_CUDA(cudaSetDevice(device_), "cudaSetDevice");
    const int64_t rows = batch.num_rows();
    const int64_t n_logits = int64_t(batch.logit_rows.size());
    const int64_t h = h_, q = q_size_, kv = kv_size_, im = im_;
    TS_RETURN_IF_ERROR(residual_.reserve(size_t(rows * h) * 4, "residual"));
    TS_RETURN_IF_ERROR(x_.reserve(size_t(std::max(rows, n_logits) * h) * 2, "x"));
    TS_RETURN_IF_ERROR(tmp_.reserve(size_t(rows * h) * 2, "tmp"));
    TS_RETURN_IF_ERROR(qkv_.reserve(size_t(rows * (q + 2 * kv)) * 2, "qkv"));
    TS_RETURN_IF_ERROR(q_.reserve(size_t(rows * q) * 2, "q"));
    TS_RETURN_IF_ERROR(attn_.reserve(size_t(rows * q) * 2, "attn"));
    TS_RETURN_IF_ERROR(gu_.reserve(size_t(rows * 2 * im) * 2, "gate_up"));
    TS_RETURN_IF_ERROR(act_.reserve(size_t(rows * im) * 2, "act"));
    TS_RETURN_IF_ERROR(final_.reserve(size_t(std::max<int64_t>(n_logits, 1) * h) * 4, "final"));
    TS_RETURN_IF_ERROR(
        logits_.reserve(size_t(std::max<int64_t>(n_logits, 1) * vocab_) * 4, "logits"));
    if (world_ > 1) {
      TS_RETURN_IF_ERROR(partial_.reserve(size_t(std::max<int64_t>(rows, 1) * h) * 4, "partial"));
      TS_RETURN_IF_ERROR(argmax_.reserve(size_t(std::max<int64_t>(n_logits, 1)) * 12, "argmax"));
      if (shard_.rank == 0 && n_logits > 0 && !batch.sampling.empty()) {
        // Rank 0 gathers the sampled rows (gather_and_sample).
        const size_t part = size_t(n_logits * vocab_) * 4;
        TS_RETURN_IF_ERROR(
            gathered_.reserve(size_t(n_logits * config_.vocab_size) * 4, "gathered logits"));
        TS_RETURN_IF_ERROR(gather_recv_.reserve(part * size_t(world_ - 1), "received logits"));
        TS_RETURN_IF_ERROR(reserve_sampling(n_logits));
      }
    }
    const size_t meta = meta_bytes(batch);
    TS_RETURN_IF_ERROR(meta_.reserve(meta, "step metadata"));
    return host_meta_.reserve(meta, "step metadata");
  }

 private:
  // Enqueues the step's device work up to the LM head (logits_ float [n][vocab_]): metadata
  // and plan upload, slot moves, page copies, then the layers (from a CUDA graph when on).
  Status enqueue_step(const StepBatch& batch, const AttentionPlan& plan) {
    TS_RETURN_IF_ERROR(upload_metadata(batch));
    TS_RETURN_IF_ERROR(workspace_.upload(plan, stream_));
    prof_.mark("upload", stream_);
    const int32_t d = int32_t(d_);
    const int64_t layer_elems = layout_.layer_elems();
    cuda::move_slots(dtype_, k_all_, v_all_, layout_.num_layers, layer_elems, layout_.page_elems(),
                     nkv_, layout_.page_size, d, d_move_src_, d_move_dst_,
                     int32_t(batch.slot_moves.size()), stream_);
    cuda::copy_pages(dtype_, k_all_, v_all_, layout_.num_layers, layer_elems, layout_.page_elems(),
                     nkv_, layout_.page_size, d, d_copy_src_, d_copy_dst_, d_copy_n_,
                     int32_t(batch.page_copies.size()), stream_);
    if (!graphs_) return enqueue_layers(batch, TreeAttentionGrid{});
    return run_step_graph(batch);
  }

  // What a captured layer chain depends on besides the uploaded data: the step's shape, the
  // attention grid, and every buffer the chain reads or writes (they move when they grow;
  // those allocated once by init() — weights, pool, split-K parts — are left out). The split-K
  // choice of each residual GEMM follows from the rows alone and never changes once made
  // (split_k_parts), so it needs no place in the key.
  struct GraphKey {
    int64_t rows = 0, n_logits = 0;
    int32_t items = 0, queries = 0;
    std::array<const void*, 12> buffers{};
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
  // GEMM's: decode steps with and without split-K, interleaved on an H100 (2026-11-25), moved
  // by up to 0.1 ms either way where the tuner saw ~1% (few-shot b=50: O 17.3 vs 17.4 us, step
  // 7.93 vs 7.85 ms), and gained where it saw more (speculative t=32, down 46.2 vs 48.4 us:
  // 7.11 vs 7.36 ms).
  static constexpr float kSplitMargin = 0.97f;

  // The layer chain from a graph: replayed when this shape has one; captured when the shape
  // repeats the previous step's (a decode batch; a one-off prefill chunk runs eagerly, with
  // the same grid, so both paths compute the same thing).
  Status run_step_graph(const StepBatch& batch) {
    GraphKey key;
    key.rows = batch.num_rows();
    key.n_logits = int64_t(batch.logit_rows.size());
    key.items = tree_attention_grid_bucket(workspace_.num_items());
    key.queries = tree_attention_grid_bucket(workspace_.num_queries());
    key.buffers = {residual_.ptr, x_.ptr,   tmp_.ptr,   qkv_.ptr,    q_.ptr,    attn_.ptr,
                   gu_.ptr,       act_.ptr, final_.ptr, logits_.ptr, meta_.ptr, partial_.ptr};
    const TreeAttentionGrid grid{key.items, key.queries};
    // step_graphs_ is kept least recently used first.
    auto found = std::find_if(step_graphs_.begin(), step_graphs_.end(),
                              [&](const StepGraph& g) { return g.key == key; });
    if (found != step_graphs_.end()) {
      std::rotate(found, found + 1, step_graphs_.end());
    } else {
      if (key != last_eager_key_) {
        last_eager_key_ = key;
        return enqueue_layers(batch, grid);
      }
      cudaGraphExec_t exec = nullptr;
      const Status captured = capture_layers(batch, grid, &exec);
      if (!captured.ok()) {
        // Not expected. The step runs again, eagerly (a real error of the step shows there
        // too), and later steps do not try again.
        std::fprintf(stderr, "treeserve: CUDA graph capture failed (%s); running without graphs\n",
                     captured.ToString().c_str());
        graphs_ = false;
        return enqueue_layers(batch, grid);
      }
      if (step_graphs_.size() >= kMaxGraphs) {
        cudaGraphExecDestroy(step_graphs_.front().exec);
        step_graphs_.erase(step_graphs_.begin());
      }
      step_graphs_.push_back(StepGraph{key, exec});
    }
    TS_CUDA(cudaGraphLaunch(step_graphs_.back().exec, stream_), "CUDA graph launch");
    return Status::Ok();
  }

  // Captures enqueue_layers into *exec; any failure (of the capture or of an enqueue inside
  // it) ends the capture and is returned.
  Status capture_layers(const StepBatch& batch, TreeAttentionGrid grid, cudaGraphExec_t* exec) {
    TS_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin capture");
    const Status enqueued = enqueue_layers(batch, grid);
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
    if (!enqueued.ok() || ended != cudaSuccess) {
      if (graph != nullptr) cudaGraphDestroy(graph);
      cudaGetLastError();
      return enqueued.ok() ? cuda_status(ended, "end capture") : enqueued;
    }
    const cudaError_t made = cudaGraphInstantiate(exec, graph, 0);
    cudaGraphDestroy(graph);
    if (made != cudaSuccess) cudaGetLastError();
    return cuda_status(made, "graph instantiate");
  }

  void drop_graphs() {
    for (StepGraph& g : step_graphs_) cudaGraphExecDestroy(g.exec);
    step_graphs_.clear();
  }

  // Embedding, every layer, final norm and LM head on the logit rows (grid: the attention
  // launch's, see TreeAttentionGrid).
  Status enqueue_layers(const StepBatch& batch, TreeAttentionGrid grid) {
    const int64_t rows = batch.num_rows();
    const int64_t n_logits = int64_t(batch.logit_rows.size());
    // This rank's sizes (the whole model's when world_ == 1).
    const int64_t h = h_, q = q_size_, kv = kv_size_, im = im_;
    const int32_t nh = nh_, nkv = nkv_, d = int32_t(d_);
    const float eps = float(config_.rms_norm_eps);
    const int64_t layer_elems = layout_.layer_elems();
    p2p_call_ = 0;
    if (world_ == 1) {
      cuda::embed(dtype_, d_ids_, rows, embed_, h, residual_.as<float>(), stream_);
    } else {
      // Each rank embeds the ids of its vocabulary shard (zeros elsewhere); the sum is exact.
      cuda::embed_vocab_range(dtype_, d_ids_, rows, embed_, h, shard_.vocab_begin, vocab_,
                              residual_.as<float>(), stream_);
      TS_RETURN_IF_ERROR(all_reduce(residual_.as<float>(), rows * h));
    }
    cuda::add_rms_norm(dtype_, residual_.as<float>(), nullptr, layers_[0].input_norm, eps, rows, h,
                       x_.ptr, stream_);
    prof_.mark("embed+moves", stream_);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      void* k_pool = static_cast<char*>(k_all_) + int64_t(l) * layer_elems * 2;
      void* v_pool = static_cast<char*>(v_all_) + int64_t(l) * layer_elems * 2;
      TS_RETURN_IF_ERROR(gemm(x_.ptr, w.qkv, qkv_.ptr, rows, q + 2 * kv, h, false, qkv_set_));
      prof_.mark("gemm qkv", stream_);
      cuda::rope_and_store_kv(dtype_, qkv_.ptr, d_positions_, inv_freq(), d_slots_, rows, nh, nkv,
                              d, layout_.page_size, q_.ptr, k_pool, v_pool, stream_);
      prof_.mark("rope+kv", stream_);
      TS_RETURN_IF_ERROR(launch_tree_attention(
          q_.ptr, k_pool, v_pool, attn_.ptr,
          options_.bfloat16 ? TreeAttentionDtype::kBFloat16 : TreeAttentionDtype::kFloat16, nh, nkv,
          d, layout_.page_size, scale_, workspace_, stream_, grid));
      prof_.mark("attention", stream_);
      TS_RETURN_IF_ERROR(
          residual_gemm(attn_.ptr, w.o, o_set_, rows, q, w.post_norm, x_.ptr, "gemm o"));
      TS_RETURN_IF_ERROR(gemm(x_.ptr, w.gate_up, gu_.ptr, rows, 2 * im, h, false, gate_up_set_));
      prof_.mark("gemm gate_up", stream_);
      cuda::swiglu(dtype_, gu_.ptr, rows, im, act_.ptr, stream_);
      prof_.mark("swiglu", stream_);
      // Residual add, fused with the next layer's input norm.
      const bool last = l + 1 == layers_.size();
      TS_RETURN_IF_ERROR(residual_gemm(act_.ptr, w.down, down_set_, rows, im,
                                       last ? nullptr : layers_[l + 1].input_norm,
                                       last ? nullptr : x_.ptr, "gemm down"));
    }
    // Final norm + LM head on the logit rows only: logits float [n][vocab shard].
    if (n_logits > 0) {
      cuda::gather_rows(residual_.as<float>(), d_logit_rows_, n_logits, h, final_.as<float>(),
                        stream_);
      cuda::add_rms_norm(dtype_, final_.as<float>(), nullptr, norm_, eps, n_logits, h, x_.ptr,
                         stream_);
      TS_RETURN_IF_ERROR(
          gemm(x_.ptr, lm_head_, logits_.ptr, n_logits, vocab_, h, true, lm_head_set_));
      prof_.mark("lm head", stream_);
    }
    return Status::Ok();
  }

  // residual (float [rows][h]) += x [rows][k] . w [h][k]^T, then out = rmsnorm(residual) *
  // norm (when norm is not null). Tensor parallel: the GEMM is row-parallel (k is this
  // rank's slice), so its float32 partial sums are all-reduced first. same_shape: w's kind in
  // every layer (for tuning).
  Status residual_gemm(const void* x, const void* w, std::span<const void* const> same_shape,
                       int64_t rows, int64_t k, const void* norm, void* out, const char* name) {
    const float eps = float(config_.rms_norm_eps);
    int32_t parts = 1;
    if (world_ == 1) TS_RETURN_IF_ERROR(split_k_parts(x, w, same_shape, rows, k, &parts));
    if (parts > 1) {
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
    } else if (p2p_on_ && rows <= options_.p2p_max_rows && !options_.skip_collectives) {
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
  Status all_reduce(float* data, int64_t n) {
    if (world_ == 1 || options_.skip_collectives || n == 0) return Status::Ok();
    TS_RETURN_IF_ERROR(nccl_status(
        ncclAllReduce(data, data, size_t(n), ncclFloat32, ncclSum, comm_, stream_), "all-reduce"));
    prof_.mark("all-reduce", stream_);
    return Status::Ok();
  }

  // The step buffers and the attention workspace, freed while this rank's device is current.
  void release_buffers() {
    for (DeviceBuffer* b :
         {&argmax_, &residual_, &x_, &tmp_, &qkv_, &q_, &attn_, &gu_, &act_, &final_, &logits_,
          &meta_, &partial_, &sample_params_, &sample_out_, &gather_recv_, &gathered_}) {
      b->release();
    }
    workspace_.release();
  }

  Status alloc(void** p, int64_t bytes) {
    TS_CUDA(cudaMalloc(p, size_t(std::max<int64_t>(bytes, 16))), "cudaMalloc");
    allocations_.push_back(*p);
    return Status::Ok();
  }

  // y [m][n] = x [m][k] . w [n][k]^T (row-major); same_shape: the matrices of w's kind
  // (all layers' O weights, say), which tuning the shape cycles through.
  Status gemm(const void* x, const void* w, void* y, int64_t m, int64_t n, int64_t k, bool f32_out,
              std::span<const void* const> same_shape) {
    const cudaDataType_t t = model_type();
    return gemm_.run(x, w, y, m, n, k, t, f32_out ? CUDA_R_32F : t, stream_, same_shape);
  }

  cudaDataType_t model_type() const { return options_.bfloat16 ? CUDA_R_16BF : CUDA_R_16F; }

  static size_t align8(size_t n) { return (n + 7) & ~size_t(7); }

  static size_t meta_bytes(const StepBatch& b) {
    const size_t rows = size_t(b.num_rows());
    return align8(rows * 4) * 2 + rows * 8 + align8(b.logit_rows.size() * 4) +
           b.slot_moves.size() * 16 + align8(b.page_copies.size() * 4) * 3 + 64;
  }

  // Packs ids, positions, slots, logit rows, moves and copies into one pinned buffer and
  // uploads it with one copy; the d_* pointers point into the device copy.
  Status upload_metadata(const StepBatch& b) {
    char* host = host_meta_.as<char>();
    char* dev = meta_.as<char>();
    size_t off = 0;
    auto put = [&](const void* src, size_t bytes) {
      std::memcpy(host + off, src, bytes);
      char* at = dev + off;
      off += align8(bytes);
      return at;
    };
    const size_t rows = size_t(b.num_rows());
    d_slots_ = reinterpret_cast<int64_t*>(put(b.kv_slots.data(), rows * 8));
    d_ids_ = reinterpret_cast<int32_t*>(put(b.token_ids.data(), rows * 4));
    d_positions_ = reinterpret_cast<int32_t*>(put(b.positions.data(), rows * 4));
    d_logit_rows_ = reinterpret_cast<int32_t*>(put(b.logit_rows.data(), b.logit_rows.size() * 4));
    move_src_.clear();
    move_dst_.clear();
    for (const StepSlotMove& m : b.slot_moves) {
      move_src_.push_back(m.src_slot);
      move_dst_.push_back(m.dst_slot);
    }
    d_move_src_ = reinterpret_cast<int64_t*>(put(move_src_.data(), move_src_.size() * 8));
    d_move_dst_ = reinterpret_cast<int64_t*>(put(move_dst_.data(), move_dst_.size() * 8));
    copy_src_.clear();
    copy_dst_.clear();
    copy_n_.clear();
    for (const StepPageCopy& c : b.page_copies) {
      copy_src_.push_back(c.src_page);
      copy_dst_.push_back(c.dst_page);
      copy_n_.push_back(c.num_slots);
    }
    d_copy_src_ = reinterpret_cast<int32_t*>(put(copy_src_.data(), copy_src_.size() * 4));
    d_copy_dst_ = reinterpret_cast<int32_t*>(put(copy_dst_.data(), copy_dst_.size() * 4));
    d_copy_n_ = reinterpret_cast<int32_t*>(put(copy_n_.data(), copy_n_.size() * 4));
    TS_CUDA(cudaMemcpyAsync(dev, host, off, cudaMemcpyHostToDevice, stream_), "metadata upload");
    return Status::Ok();
  }

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
  KvLayout layout_;
  float scale_ = 1.0f;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  std::vector<void*> allocations_;

  void* embed_ = nullptr;
  std::vector<LayerWeights> layers_;
  void* norm_ = nullptr;
  void* lm_head_ = nullptr;
  void* k_all_ = nullptr;  // T [layers][pages][nkv][page_size][d]
  void* v_all_ = nullptr;
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
  DeviceBuffer partial_;  // float [rows][hidden]: row-parallel GEMM partial sums (world_ > 1)
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

Status check_options(const ModelConfig& config, const CudaBackendOptions& options) {
  if (options.tensor_parallel < 1 || options.tensor_parallel > 8) {
    return InvalidArgument("tensor_parallel must be in [1, 8], got " +
                           std::to_string(options.tensor_parallel));
  }
  TS_RETURN_IF_ERROR(check_tensor_parallel(config, options.tensor_parallel));
  if (cuda_device_count() <= options.device) {
    return Unavailable("no CUDA device " + std::to_string(options.device) + " (this machine has " +
                       std::to_string(cuda_device_count()) + ")");
  }
  if (options.tensor_parallel > 1 &&
      cuda_device_count() < options.device + options.tensor_parallel) {
    return Unavailable("tensor_parallel = " + std::to_string(options.tensor_parallel) +
                       " needs CUDA devices " + std::to_string(options.device) + ".." +
                       std::to_string(options.device + options.tensor_parallel - 1) +
                       "; this machine has " + std::to_string(cuda_device_count()));
  }
  if (options.gemm_split_k < 0 || options.gemm_split_k > detail::LtGemm::kMaxSplits) {
    return InvalidArgument("gemm_split_k must be in [0, " +
                           std::to_string(detail::LtGemm::kMaxSplits) + "] (0 = auto), got " +
                           std::to_string(options.gemm_split_k));
  }
  if (options.page_size < 1 || options.page_size > 256) {
    return InvalidArgument("page_size must be in [1, 256]");
  }
  if (options.num_pages < 1 || options.num_pages > INT32_MAX) {
    return InvalidArgument("num_pages must be in [1, 2^31)");
  }
  if (config.hidden_size > 16384 || config.hidden_size % 8 != 0) {
    return InvalidArgument("CUDA backend: hidden_size " + std::to_string(config.hidden_size) +
                           " must be a multiple of 8 and at most 16384 (the norm kernel holds "
                           "a row in registers, 8 values a thread)");
  }
  if ((config.intermediate_size / options.tensor_parallel) % 8 != 0) {
    return InvalidArgument("CUDA backend: intermediate_size / tensor_parallel = " +
                           std::to_string(config.intermediate_size / options.tensor_parallel) +
                           " must be a multiple of 8 (16-byte SwiGLU loads)");
  }
  if (config.head_dim != 64 && config.head_dim != 128) {
    return InvalidArgument("CUDA backend: head_dim " + std::to_string(config.head_dim) +
                           " is not supported (64 or 128)");
  }
  if (config.num_key_value_heads < 1 ||
      config.num_attention_heads % config.num_key_value_heads != 0 ||
      config.num_attention_heads / config.num_key_value_heads > 16) {
    return InvalidArgument("CUDA backend: GQA group size must be 1..16");
  }
  return Status::Ok();
}

}  // namespace

namespace detail {

std::unique_ptr<CudaRank> make_cuda_rank(const ModelConfig& config,
                                         const CudaBackendOptions& options, int32_t rank,
                                         int32_t world, ncclComm_t comm) {
  return std::make_unique<CudaBackend>(config, options, rank, world, comm);
}

}  // namespace detail

int32_t cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

StatusOr<std::unique_ptr<Backend>> create_cuda_backend(const ModelConfig& config,
                                                       const LlamaWeights& weights,
                                                       const CudaBackendOptions& options) {
  TS_RETURN_IF_ERROR(check_options(config, options));
  if (options.tensor_parallel > 1) {
    return detail::create_tensor_parallel_backend(config, options, &weights, 0);
  }
  auto backend = std::make_unique<CudaBackend>(config, options);
  TS_RETURN_IF_ERROR(backend->init());
  TS_RETURN_IF_ERROR(backend->load(weights));
  return std::unique_ptr<Backend>(std::move(backend));
}

StatusOr<std::unique_ptr<Backend>> create_cuda_backend_random(const ModelConfig& config,
                                                              const CudaBackendOptions& options,
                                                              uint64_t seed) {
  TS_RETURN_IF_ERROR(check_options(config, options));
  if (options.tensor_parallel > 1) {
    return detail::create_tensor_parallel_backend(config, options, nullptr, seed);
  }
  auto backend = std::make_unique<CudaBackend>(config, options);
  TS_RETURN_IF_ERROR(backend->init());
  TS_RETURN_IF_ERROR(backend->randomize(seed));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace treeserve
