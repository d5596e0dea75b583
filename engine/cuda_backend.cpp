// The CUDA backend. One forward per step, all on one stream:
//   upload step metadata + plan -> slot moves, page copies -> embed -> per layer
//   [RMSNorm, QKV GEMM, RoPE + K/V append into pages, tree attention, O GEMM, residual add +
//   RMSNorm, gate/up GEMM, SwiGLU, down GEMM, residual add] -> final RMSNorm and LM head on
//   the logit rows only -> logits to the host.
// The residual stream is float32; activations and weights are in the model dtype; GEMMs
// accumulate in float32 (cublasGemmEx, CUBLAS_COMPUTE_32F).
#include "engine/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cpu_weights.h"
#include "engine/cuda_ops.h"
#include "engine/detail/step_profiler.h"
#include "kernels/tree_attention.h"
#include "models/llama_weights.h"

namespace treeserve {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  if (e == cudaErrorMemoryAllocation) {
    return ResourceExhausted(std::string("CUDA backend: out of device memory (") + what + ")");
  }
  return Internal(std::string("CUDA backend: ") + what + ": " + cudaGetErrorString(e));
}
#define TS_CUDA(expr, what) TS_RETURN_IF_ERROR(cuda_status((expr), what))

Status cublas_status(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return Internal(std::string("cuBLAS: ") + what + " failed (status " + std::to_string(int(s)) +
                  ")");
}

// A device buffer that only grows (step scratch): reallocated when a step needs more.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  ~DeviceBuffer() { cudaFree(ptr); }
  Status reserve(size_t want, const char* what) {
    if (want <= bytes) return Status::Ok();
    cudaFree(ptr);
    ptr = nullptr;
    bytes = 0;
    const size_t grown = std::max(want, bytes * 3 / 2);
    TS_CUDA(cudaMalloc(&ptr, grown), what);
    bytes = grown;
    return Status::Ok();
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

struct LayerWeights {
  void* input_norm = nullptr;  // T [hidden]
  void* qkv = nullptr;         // T [q + 2 kv][hidden]
  void* o = nullptr;           // T [hidden][q]
  void* post_norm = nullptr;   // T [hidden]
  void* gate_up = nullptr;     // T [2 im][hidden]
  void* down = nullptr;        // T [hidden][im]
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(const ModelConfig& config, const CudaBackendOptions& options)
      : config_(config), options_(options) {
    dtype_ = options.bfloat16 ? cuda::Dtype::kBFloat16 : cuda::Dtype::kFloat16;
    layout_.num_layers = int32_t(config.num_hidden_layers);
    layout_.num_kv_heads = int32_t(config.num_key_value_heads);
    layout_.head_dim = int32_t(config.head_dim);
    layout_.page_size = options.page_size;
    layout_.num_pages = options.num_pages;
    layout_.dtype_bytes = 2;
    scale_ = float(1.0 / std::sqrt(double(config.head_dim)));
  }

  ~CudaBackend() override {
    if (stream_) cudaStreamSynchronize(stream_);
    for (void* p : allocations_) cudaFree(p);
    cudaFreeHost(host_logits_);
    cudaFreeHost(host_meta_);
    if (cublas_) cublasDestroy(cublas_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  // Device, stream, cuBLAS, weight buffers (uninitialised), pool (zeros), workspace.
  Status init() {
    TS_CUDA(cudaSetDevice(options_.device), "cudaSetDevice");
    TS_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    TS_RETURN_IF_ERROR(cublas_status(cublasCreate(&cublas_), "cublasCreate"));
    TS_RETURN_IF_ERROR(cublas_status(cublasSetStream(cublas_, stream_), "cublasSetStream"));
    int sms = 132;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, options_.device);
    const int64_t h = config_.hidden_size, q = config_.q_size(), kv = config_.kv_size();
    const int64_t im = config_.intermediate_size, v = config_.vocab_size;
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
    limits.max_num_q_heads = int32_t(config_.num_attention_heads);
    limits.max_head_dim = int32_t(config_.head_dim);
    limits.max_queries = 1 << 16;
    limits.max_work_items = 1 << 15;
    limits.max_partials = 1 << 17;
    limits.max_segments = 1 << 17;
    limits.max_mask_words = 1 << 20;
    limits.max_view_pages = int32_t(std::min<int64_t>(layout_.num_pages * 4, 1 << 24));
    TS_RETURN_IF_ERROR(workspace_.init(limits));
    plan_config_ = tree_attention_plan_config(int32_t(config_.num_attention_heads),
                                              int32_t(config_.num_key_value_heads),
                                              int32_t(config_.head_dim), sms);
    limits.apply_to(&plan_config_);
    plan_config_.num_pages = layout_.num_pages;
    return Status::Ok();
  }

  // Fills the weights from the checkpoint, converted to float32 on the host (fused layouts
  // of cpu_weights.h) and then to the dtype on the device.
  Status load(const LlamaWeights& weights) {
    StatusOr<CpuModelWeights> w = convert_weights_to_f32(config_, weights);
    if (!w.ok()) return w.status();
    TS_RETURN_IF_ERROR(upload(w->embed, embed_));
    for (size_t i = 0; i < layers_.size(); ++i) {
      const CpuLayerWeights& src = w->layers[i];
      LayerWeights& dst = layers_[i];
      TS_RETURN_IF_ERROR(upload(src.input_norm, dst.input_norm));
      TS_RETURN_IF_ERROR(upload(src.qkv, dst.qkv));
      TS_RETURN_IF_ERROR(upload(src.o, dst.o));
      TS_RETURN_IF_ERROR(upload(src.post_norm, dst.post_norm));
      TS_RETURN_IF_ERROR(upload(src.gate_up, dst.gate_up));
      TS_RETURN_IF_ERROR(upload(src.down, dst.down));
    }
    TS_RETURN_IF_ERROR(upload(w->norm, norm_));
    if (!config_.tie_word_embeddings) TS_RETURN_IF_ERROR(upload(w->lm_head, lm_head_));
    TS_CUDA(cudaStreamSynchronize(stream_), "weight upload");
    return Status::Ok();
  }

  // Random weights: uniform(+-1/sqrt(fan_in)) matrices, norms of ones.
  Status randomize(uint64_t seed) {
    const int64_t h = config_.hidden_size, q = config_.q_size(), kv = config_.kv_size();
    const int64_t im = config_.intermediate_size, v = config_.vocab_size;
    auto mat = [&](void* p, int64_t n, int64_t fan_in) {
      cuda::fill_random(dtype_, p, n, seed++, float(1.0 / std::sqrt(double(fan_in))), 0.0f,
                        stream_);
    };
    auto ones = [&](void* p, int64_t n) {
      cuda::fill_random(dtype_, p, n, 0, 0.0f, 1.0f, stream_);
    };
    mat(embed_, v * h, 1);
    for (LayerWeights& l : layers_) {
      ones(l.input_norm, h);
      mat(l.qkv, (q + 2 * kv) * h, h);
      mat(l.o, h * q, q);
      ones(l.post_norm, h);
      mat(l.gate_up, 2 * im * h, h);
      mat(l.down, h * im, im);
    }
    ones(norm_, h);
    if (!config_.tie_word_embeddings) mat(lm_head_, v * h, h);
    TS_CUDA(cudaStreamSynchronize(stream_), "random weights");
    return Status::Ok();
  }

  std::string_view name() const override { return "cuda"; }
  const ModelConfig& model_config() const override { return config_; }
  const KvLayout& kv_layout() const override { return layout_; }

  Status forward(const StepBatch& batch, Logits* out) override {
    prof_.begin(stream_, batch.num_rows());
    TS_RETURN_IF_ERROR(validate_step_batch(batch, layout_, config_.vocab_size, &check_));
    if (options_.baseline_attention) {
      TS_RETURN_IF_ERROR(build_baseline_plan(batch.view, plan_config_, &plan_));
    } else {
      TS_RETURN_IF_ERROR(build_attention_plan(batch.view, plan_config_, &plan_));
    }
    const int64_t rows = batch.num_rows();
    const int64_t n_logits = int64_t(batch.logit_rows.size());
    TS_RETURN_IF_ERROR(reserve_scratch(rows, n_logits, batch));
    prof_.host("plan");
    TS_RETURN_IF_ERROR(upload_metadata(batch));
    TS_RETURN_IF_ERROR(workspace_.upload(plan_, stream_));
    prof_.mark("upload", stream_);

    const int64_t h = config_.hidden_size, q = config_.q_size(), kv = config_.kv_size();
    const int64_t im = config_.intermediate_size;
    const int32_t nh = int32_t(config_.num_attention_heads);
    const int32_t nkv = int32_t(config_.num_key_value_heads), d = int32_t(config_.head_dim);
    const float eps = float(config_.rms_norm_eps);
    const int64_t layer_elems = layout_.layer_elems();
    cuda::move_slots(dtype_, k_all_, v_all_, layout_.num_layers, layer_elems, layout_.page_elems(),
                     nkv, layout_.page_size, d, d_move_src_, d_move_dst_,
                     int32_t(batch.slot_moves.size()), stream_);
    cuda::copy_pages(dtype_, k_all_, v_all_, layout_.num_layers, layer_elems, layout_.page_elems(),
                     nkv, layout_.page_size, d, d_copy_src_, d_copy_dst_, d_copy_n_,
                     int32_t(batch.page_copies.size()), stream_);
    cuda::embed(dtype_, d_ids_, rows, embed_, h, residual_.as<float>(), stream_);
    cuda::add_rms_norm(dtype_, residual_.as<float>(), nullptr, layers_[0].input_norm, eps, rows, h,
                       x_.ptr, stream_);
    prof_.mark("embed+moves", stream_);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      void* k_pool = static_cast<char*>(k_all_) + int64_t(l) * layer_elems * 2;
      void* v_pool = static_cast<char*>(v_all_) + int64_t(l) * layer_elems * 2;
      TS_RETURN_IF_ERROR(gemm(x_.ptr, w.qkv, qkv_.ptr, rows, q + 2 * kv, h, false));
      prof_.mark("gemm qkv", stream_);
      cuda::rope_and_store_kv(dtype_, qkv_.ptr, d_positions_, inv_freq(), d_slots_, rows, nh, nkv,
                              d, layout_.page_size, q_.ptr, k_pool, v_pool, stream_);
      prof_.mark("rope+kv", stream_);
      TS_RETURN_IF_ERROR(launch_tree_attention(
          q_.ptr, k_pool, v_pool, attn_.ptr,
          options_.bfloat16 ? TreeAttentionDtype::kBFloat16 : TreeAttentionDtype::kFloat16, nh, nkv,
          d, layout_.page_size, scale_, workspace_, stream_));
      prof_.mark("attention", stream_);
      TS_RETURN_IF_ERROR(gemm(attn_.ptr, w.o, tmp_.ptr, rows, h, q, false));
      prof_.mark("gemm o", stream_);
      cuda::add_rms_norm(dtype_, residual_.as<float>(), tmp_.ptr, w.post_norm, eps, rows, h, x_.ptr,
                         stream_);
      prof_.mark("norm", stream_);
      TS_RETURN_IF_ERROR(gemm(x_.ptr, w.gate_up, gu_.ptr, rows, 2 * im, h, false));
      prof_.mark("gemm gate_up", stream_);
      cuda::swiglu(dtype_, gu_.ptr, rows, im, act_.ptr, stream_);
      prof_.mark("swiglu", stream_);
      TS_RETURN_IF_ERROR(gemm(act_.ptr, w.down, tmp_.ptr, rows, h, im, false));
      prof_.mark("gemm down", stream_);
      // Residual add, fused with the next layer's input norm.
      const bool last = l + 1 == layers_.size();
      cuda::add_rms_norm(dtype_, residual_.as<float>(), tmp_.ptr,
                         last ? nullptr : layers_[l + 1].input_norm, eps, rows, h,
                         last ? nullptr : x_.ptr, stream_);
      prof_.mark("norm", stream_);
    }
    // Final norm + LM head on the logit rows only: logits float [n][vocab].
    out->num_rows = int32_t(n_logits);
    out->vocab = config_.vocab_size;
    if (n_logits > 0) {
      cuda::gather_rows(residual_.as<float>(), d_logit_rows_, n_logits, h, final_.as<float>(),
                        stream_);
      cuda::add_rms_norm(dtype_, final_.as<float>(), nullptr, norm_, eps, n_logits, h, x_.ptr,
                         stream_);
      TS_RETURN_IF_ERROR(
          gemm(x_.ptr, lm_head_, logits_.ptr, n_logits, config_.vocab_size, h, true));
      prof_.mark("lm head", stream_);
      prof_.host("enqueue");
      if (batch.full_logits) {
        const size_t bytes = size_t(n_logits * config_.vocab_size) * 4;
        TS_RETURN_IF_ERROR(reserve_host_logits(bytes));
        TS_CUDA(cudaMemcpyAsync(host_logits_, logits_.ptr, bytes, cudaMemcpyDeviceToHost, stream_),
                "logits download");
        TS_CUDA(cudaStreamSynchronize(stream_), "step");
        out->data.resize(size_t(n_logits * config_.vocab_size));
        std::memcpy(out->data.data(), host_logits_, bytes);
        out->argmax.clear();
        out->argmax_logprob.clear();
      } else {
        // Greedy rows only: the argmax and its logprob per row (8 bytes, not the vocab).
        TS_RETURN_IF_ERROR(argmax_.reserve(size_t(n_logits) * 8, "argmax"));
        int32_t* ids = argmax_.as<int32_t>();
        float* lps = reinterpret_cast<float*>(ids + n_logits);
        cuda::argmax_logprob(logits_.as<float>(), n_logits, config_.vocab_size, ids, lps, stream_);
        TS_RETURN_IF_ERROR(reserve_host_logits(size_t(n_logits) * 8));
        TS_CUDA(cudaMemcpyAsync(host_logits_, argmax_.ptr, size_t(n_logits) * 8,
                                cudaMemcpyDeviceToHost, stream_),
                "argmax download");
        TS_CUDA(cudaStreamSynchronize(stream_), "step");
        out->data.clear();
        const int32_t* hid = static_cast<const int32_t*>(host_logits_);
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

 private:
  Status alloc(void** p, int64_t bytes) {
    TS_CUDA(cudaMalloc(p, size_t(std::max<int64_t>(bytes, 16))), "cudaMalloc");
    allocations_.push_back(*p);
    return Status::Ok();
  }

  Status upload(const std::vector<float>& src, void* dst) {
    TS_RETURN_IF_ERROR(staging_.reserve(src.size() * 4, "weight staging"));
    TS_CUDA(
        cudaMemcpyAsync(staging_.ptr, src.data(), src.size() * 4, cudaMemcpyHostToDevice, stream_),
        "weight upload");
    cuda::convert_from_f32(dtype_, staging_.as<float>(), int64_t(src.size()), dst, stream_);
    TS_CUDA(cudaStreamSynchronize(stream_), "weight upload");
    return Status::Ok();
  }

  // y [m][n] = x [m][k] . w [n][k]^T (row-major), i.e. column-major y^T = w . x^T.
  Status gemm(const void* x, const void* w, void* y, int64_t m, int64_t n, int64_t k,
              bool f32_out) {
    if (m == 0) return Status::Ok();
    const float alpha = 1.0f, beta = 0.0f;
    const cudaDataType_t t = options_.bfloat16 ? CUDA_R_16BF : CUDA_R_16F;
    return cublas_status(
        cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &alpha, w, t,
                     int(k), x, t, int(k), &beta, y, f32_out ? CUDA_R_32F : t, int(n),
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "gemm");
  }

  Status reserve_scratch(int64_t rows, int64_t n_logits, const StepBatch& batch) {
    const int64_t h = config_.hidden_size, q = config_.q_size(), kv = config_.kv_size();
    const int64_t im = config_.intermediate_size;
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
        logits_.reserve(size_t(std::max<int64_t>(n_logits, 1) * config_.vocab_size) * 4, "logits"));
    const size_t meta = meta_bytes(batch);
    TS_RETURN_IF_ERROR(meta_.reserve(meta, "step metadata"));
    if (meta > host_meta_bytes_) {
      cudaFreeHost(host_meta_);
      host_meta_ = nullptr;
      host_meta_bytes_ = 0;
      TS_CUDA(cudaMallocHost(&host_meta_, meta * 2), "pinned metadata");
      host_meta_bytes_ = meta * 2;
    }
    return Status::Ok();
  }

  Status reserve_host_logits(size_t bytes) {
    if (bytes <= host_logits_bytes_) return Status::Ok();
    cudaFreeHost(host_logits_);
    host_logits_ = nullptr;
    host_logits_bytes_ = 0;
    TS_CUDA(cudaMallocHost(&host_logits_, bytes * 2), "pinned logits");
    host_logits_bytes_ = bytes * 2;
    return Status::Ok();
  }

  static size_t align8(size_t n) { return (n + 7) & ~size_t(7); }

  static size_t meta_bytes(const StepBatch& b) {
    const size_t rows = size_t(b.num_rows());
    return align8(rows * 4) * 2 + rows * 8 + align8(b.logit_rows.size() * 4) +
           b.slot_moves.size() * 16 + align8(b.page_copies.size() * 4) * 3 + 64;
  }

  // Packs ids, positions, slots, logit rows, moves and copies into one pinned buffer and
  // uploads it with one copy; the d_* pointers point into the device copy.
  Status upload_metadata(const StepBatch& b) {
    char* host = static_cast<char*>(host_meta_);
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
  TreeAttentionWorkspace workspace_;
  AttentionPlanConfig plan_config_;
  AttentionPlan plan_;
  StepBatchCheckScratch check_;

  DeviceBuffer argmax_, staging_, residual_, x_, tmp_, qkv_, q_, attn_, gu_, act_, final_, logits_,
      meta_;
  void* host_meta_ = nullptr;
  size_t host_meta_bytes_ = 0;
  void* host_logits_ = nullptr;
  size_t host_logits_bytes_ = 0;
  std::vector<int64_t> move_src_, move_dst_;
  std::vector<int32_t> copy_src_, copy_dst_, copy_n_;
  int64_t* d_slots_ = nullptr;
  int32_t *d_ids_ = nullptr, *d_positions_ = nullptr, *d_logit_rows_ = nullptr;
  int64_t *d_move_src_ = nullptr, *d_move_dst_ = nullptr;
  int32_t *d_copy_src_ = nullptr, *d_copy_dst_ = nullptr, *d_copy_n_ = nullptr;
};

Status check_options(const ModelConfig& config, const CudaBackendOptions& options) {
  if (cuda_device_count() <= options.device) {
    return Unavailable("no CUDA device " + std::to_string(options.device) + " (this machine has " +
                       std::to_string(cuda_device_count()) + ")");
  }
  if (options.page_size < 1 || options.page_size > 256) {
    return InvalidArgument("page_size must be in [1, 256]");
  }
  if (options.num_pages < 1 || options.num_pages > INT32_MAX) {
    return InvalidArgument("num_pages must be in [1, 2^31)");
  }
  if (config.hidden_size > 16384) {
    return InvalidArgument("CUDA backend: hidden_size " + std::to_string(config.hidden_size) +
                           " is over the 16384 the norm kernel holds in registers");
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
  auto backend = std::make_unique<CudaBackend>(config, options);
  TS_RETURN_IF_ERROR(backend->init());
  TS_RETURN_IF_ERROR(backend->load(weights));
  return std::unique_ptr<Backend>(std::move(backend));
}

StatusOr<std::unique_ptr<Backend>> create_cuda_backend_random(const ModelConfig& config,
                                                              const CudaBackendOptions& options,
                                                              uint64_t seed) {
  TS_RETURN_IF_ERROR(check_options(config, options));
  auto backend = std::make_unique<CudaBackend>(config, options);
  TS_RETURN_IF_ERROR(backend->init());
  TS_RETURN_IF_ERROR(backend->randomize(seed));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace treeserve
