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
#include "engine/detail/cuda_backend_impl.h"

namespace treeserve::detail {

Status CudaBackend::init() {
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
  TS_RETURN_IF_ERROR(gemm_.init(device_, cublas_, cublas_workspace_, size_t(kCublasWorkspaceBytes),
                                options_.gemm_autotune));
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
    TS_RETURN_IF_ERROR(alloc(&l.post_norm, h * 2));
    if (fp8_) {
      TS_RETURN_IF_ERROR(alloc_fp8(&l.qkv8, q + 2 * kv, h));
      TS_RETURN_IF_ERROR(alloc_fp8(&l.o8, h, q));
      TS_RETURN_IF_ERROR(alloc_fp8(&l.gate_up8, 2 * im, h));
      TS_RETURN_IF_ERROR(alloc_fp8(&l.down8, h, im));
      continue;
    }
    TS_RETURN_IF_ERROR(alloc(&l.qkv, (q + 2 * kv) * h * 2));
    TS_RETURN_IF_ERROR(alloc(&l.o, h * q * 2));
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
    qkv_set_.push_back(fp8_ ? l.qkv8.w : l.qkv);
    o_set_.push_back(fp8_ ? l.o8.w : l.o);
    gate_up_set_.push_back(fp8_ ? l.gate_up8.w : l.gate_up);
    down_set_.push_back(fp8_ ? l.down8.w : l.down);
  }
  lm_head_set_ = {lm_head_};
  const int64_t pool_bytes = layout_.layer_bytes() * layout_.num_layers;
  TS_RETURN_IF_ERROR(alloc(&k_all_, pool_bytes));
  TS_RETURN_IF_ERROR(alloc(&v_all_, pool_bytes));
  TS_CUDA(cudaMemsetAsync(k_all_, 0, size_t(pool_bytes), stream_), "pool memset");
  TS_CUDA(cudaMemsetAsync(v_all_, 0, size_t(pool_bytes), stream_), "pool memset");
  if (options_.kv_cache_fp8) {
    const int64_t scale_bytes = layout_.layer_scale_bytes() * layout_.num_layers;
    for (float** scales : {&k_scale_all_, &v_scale_all_}) {
      void* p = nullptr;
      TS_RETURN_IF_ERROR(alloc(&p, scale_bytes));
      TS_CUDA(cudaMemsetAsync(p, 0, size_t(scale_bytes), stream_), "pool memset");
      *scales = static_cast<float*>(p);
    }
  }
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
  limits.decode_kernel = options_.attention_decode_kernel;
  limits.tail_kernel = options_.attention_tail_kernel;
  limits.wide_kernel = options_.attention_wide_kernel;
  if (options_.kv_cache_fp8) {
    // The tail and wide kernels copy 16-bit tiles only (TreeAttentionKvScales).
    limits.tail_kernel = TreeAttentionLimits::Tail::kOff;
    limits.wide_kernel = TreeAttentionLimits::Wide::kOff;
  }
  TS_RETURN_IF_ERROR(workspace_.init(limits));
  plan_config_ = tree_attention_plan_config(nh_, nkv_, int32_t(d_), sms);
  plan_config_.max_chunk_tokens = options_.attention_max_chunk_tokens;
  static_assert(CudaBackendOptions{}.attention_pair_margin == AttentionPlanConfig{}.pair_margin,
                "the engine's default margin is the builder's");
  plan_config_.pair_margin = options_.attention_pair_margin;
  limits.apply_to(&plan_config_);  // caps it at limits.max_item_tokens too
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

Status CudaBackend::load(const LlamaWeights& weights) {
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
  // FP8 from a 16-bit checkpoint: each matrix is uploaded in the model dtype into a stage
  // instead of its own buffer, then quantized per row into its e4m3 layer.
  Fp8Stage stage;
  if (fp8_ && !config_.quant.prequantized) TS_RETURN_IF_ERROR(stage.init(this));
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LlamaLayerWeights& src = weights.layers[i];
    LayerWeights& dst = layers_[i];
    TS_RETURN_IF_ERROR(vec(src.input_layernorm, dst.input_norm));
    TS_RETURN_IF_ERROR(vec(src.post_attention_layernorm, dst.post_norm));
    if (fp8_ && config_.quant.prequantized) {
      TS_RETURN_IF_ERROR(load_fp8_layer(src, &dst));
      continue;
    }
    void* qkv = stage.target(dst.qkv);
    TS_RETURN_IF_ERROR(rows(src.q_proj, {q, h}, q0, q_size_, qkv));
    TS_RETURN_IF_ERROR(rows(src.k_proj, {kv, h}, kv0, kv_size_, byte_offset(qkv, q_size_ * h, 2)));
    TS_RETURN_IF_ERROR(
        rows(src.v_proj, {kv, h}, kv0, kv_size_, byte_offset(qkv, (q_size_ + kv_size_) * h, 2)));
    stage.quantize(&dst.qkv8, q_size_ + 2 * kv_size_, h);
    TS_RETURN_IF_ERROR(cols(src.o_proj, {h, q}, q0, q_size_, stage.target(dst.o)));
    stage.quantize(&dst.o8, h, q_size_);
    void* gate_up = stage.target(dst.gate_up);
    TS_RETURN_IF_ERROR(rows(src.gate_proj, {im, h}, im0, im_, gate_up));
    TS_RETURN_IF_ERROR(rows(src.up_proj, {im, h}, im0, im_, byte_offset(gate_up, im_ * h, 2)));
    stage.quantize(&dst.gate_up8, 2 * im_, h);
    TS_RETURN_IF_ERROR(cols(src.down_proj, {h, im}, im0, im_, stage.target(dst.down)));
    stage.quantize(&dst.down8, h, im_);
  }
  TS_RETURN_IF_ERROR(vec(weights.norm, norm_));
  if (!config_.tie_word_embeddings) {
    TS_RETURN_IF_ERROR(rows(weights.lm_head, {v, h}, v0, vocab_, lm_head_));
  }
  TS_RETURN_IF_ERROR(up.finish());
  TS_CUDA(cudaGetLastError(), "FP8 quantization");
  return Status::Ok();
}

Status CudaBackend::alloc_fp8(Fp8Linear* l, int64_t n, int64_t k) {
  void* p = nullptr;
  TS_RETURN_IF_ERROR(alloc(&p, n * k));
  l->w = static_cast<uint8_t*>(p);
  TS_RETURN_IF_ERROR(alloc(&p, n * 4));
  l->scale = static_cast<float*>(p);
  if (config_.quant.prequantized &&
      config_.quant.activation_scale == Fp8ActivationScale::kStaticPerTensor) {
    TS_RETURN_IF_ERROR(alloc(&p, 4));
    l->input_scale = static_cast<float*>(p);
  }
  return Status::Ok();
}

int64_t CudaBackend::fp8_stage_elems() const {
  return std::max({(q_size_ + 2 * kv_size_) * h_, h_ * q_size_, 2 * im_ * h_, h_ * im_});
}

Status CudaBackend::load_fp8_layer(const LlamaLayerWeights& src, LayerWeights* dst) {
  const int64_t h = h_, d = d_, q = config_.q_size(), kv = config_.kv_size();
  const int64_t im = config_.intermediate_size;
  const int64_t q0 = shard_.q_head_begin * d, kv0 = shard_.kv_head_begin * d;
  const int64_t im0 = shard_.im_begin;
  // This rank's block of each checkpoint matrix [rows][cols]: rows [row0, + n) of QKV and
  // gate/up (split by output rows), columns [col0, + width) of O and down (split by input).
  struct Part {
    const TensorView* weight;
    const Fp8Scales* scales;
    int64_t rows, row0, n;
  };
  struct Matrix {
    Fp8Linear* dst;
    std::vector<Part> parts;
    int64_t cols, col0, width;
  };
  const Matrix matrices[] = {
      {&dst->qkv8,
       {{&src.q_proj, &src.q_scale, q, q0, q_size_},
        {&src.k_proj, &src.k_scale, kv, kv0, kv_size_},
        {&src.v_proj, &src.v_scale, kv, kv0, kv_size_}},
       h,
       0,
       h},
      {&dst->o8, {{&src.o_proj, &src.o_scale, h, 0, h}}, q, q0, q_size_},
      {&dst->gate_up8,
       {{&src.gate_proj, &src.gate_scale, im, im0, im_},
        {&src.up_proj, &src.up_scale, im, im0, im_}},
       h,
       0,
       h},
      {&dst->down8, {{&src.down_proj, &src.down_scale, h, 0, h}}, im, im0, im_},
  };
  for (const Matrix& m : matrices) {
    int64_t n = 0;
    for (const Part& p : m.parts) n += p.n;
    // The checkpoint's e4m3 bytes as they are, the scales per row, and for static activation
    // scales the largest of the parts' input scales (one quantization of the shared input
    // serves the fused matrix; a larger scale only costs the smaller ones some precision).
    // A rank's columns of O and down keep their rows' scales: a row's scale covers all of it.
    std::vector<float> row_scales;
    float input_scale = 0.0f;
    int64_t row = 0;
    for (const Part& p : m.parts) {
      const TensorView& w = *p.weight;
      if (w.dtype != DType::kF8E4M3 || w.numel() != p.rows * m.cols) {
        return InvalidArgument(w.file + ": tensor '" + w.name + "' is " + dtype_name(w.dtype) +
                               " " + w.shape_string() +
                               "; an FP8 checkpoint's weight must be "
                               "F8_E4M3 [" +
                               std::to_string(p.rows) + ", " + std::to_string(m.cols) + "]");
      }
      const uint8_t* from = static_cast<const uint8_t*>(w.data) + p.row0 * m.cols + m.col0;
      TS_CUDA(cudaMemcpy2D(m.dst->w + row * m.width, size_t(m.width), from, size_t(m.cols),
                           size_t(m.width), size_t(p.n), cudaMemcpyHostToDevice),
              "FP8 weight upload");
      StatusOr<std::vector<float>> scales = fp8_row_scales(*p.scales, p.rows);
      if (!scales.ok()) return scales.status();
      row_scales.insert(row_scales.end(), scales->begin() + p.row0, scales->begin() + p.row0 + p.n);
      if (m.dst->input_scale) {
        StatusOr<float> s = fp8_input_scale(*p.scales);
        if (!s.ok()) return s.status();
        input_scale = std::max(input_scale, *s);
      }
      row += p.n;
    }
    TS_CUDA(cudaMemcpy(m.dst->scale, row_scales.data(), size_t(n) * 4, cudaMemcpyHostToDevice),
            "FP8 scale upload");
    if (m.dst->input_scale) {
      TS_CUDA(cudaMemcpy(m.dst->input_scale, &input_scale, 4, cudaMemcpyHostToDevice),
              "FP8 input scale upload");
    }
  }
  return Status::Ok();
}

Status CudaBackend::randomize(uint64_t seed) {
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
  auto ones = [&](void* p, int64_t n) { cuda::fill_random(dtype_, p, n, 0, 0.0f, 1.0f, stream_); };
  block(embed_, vocab_, h, seed++, h, v0, 0, 1);
  // FP8: the same 16-bit values drawn into a stage, then quantized per row.
  Fp8Stage stage;
  if (fp8_) TS_RETURN_IF_ERROR(stage.init(this));
  for (LayerWeights& l : layers_) {
    ones(l.input_norm, h);
    const uint64_t s_qkv = seed++;  // [q | k | v][h]
    void* qkv = stage.target(l.qkv);
    block(qkv, q_size_, h, s_qkv, h, q0, 0, h);
    block(byte_offset(qkv, q_size_ * h, 2), kv_size_, h, s_qkv, h, q + kv0, 0, h);
    block(byte_offset(qkv, (q_size_ + kv_size_) * h, 2), kv_size_, h, s_qkv, h, q + kv + kv0, 0, h);
    stage.quantize(&l.qkv8, q_size_ + 2 * kv_size_, h);
    block(stage.target(l.o), h, q_size_, seed++, q, 0, q0, q);  // [h][q]
    stage.quantize(&l.o8, h, q_size_);
    ones(l.post_norm, h);
    const uint64_t s_gu = seed++;  // [gate | up][h]
    void* gate_up = stage.target(l.gate_up);
    block(gate_up, im_, h, s_gu, h, im0, 0, h);
    block(byte_offset(gate_up, im_ * h, 2), im_, h, s_gu, h, im + im0, 0, h);
    stage.quantize(&l.gate_up8, 2 * im_, h);
    block(stage.target(l.down), h, im_, seed++, im, 0, im0, im);  // [h][im]
    stage.quantize(&l.down8, h, im_);
  }
  ones(norm_, h);
  if (!config_.tie_word_embeddings) block(lm_head_, vocab_, h, seed++, h, v0, 0, h);
  TS_CUDA(cudaStreamSynchronize(stream_), "random weights");
  TS_CUDA(cudaGetLastError(), "random weights");
  return Status::Ok();
}

void CudaBackend::release_buffers() {
  for (DeviceBuffer* b :
       {&argmax_, &residual_, &x_, &tmp_, &qkv_, &q_, &attn_, &gu_, &act_, &final_, &logits_,
        &meta_, &partial_, &xq_, &xs_, &sample_params_, &sample_out_, &gather_recv_, &gathered_}) {
    b->release();
  }
  workspace_.release();
}

Status CudaBackend::alloc(void** p, int64_t bytes) {
  TS_CUDA(cudaMalloc(p, size_t(std::max<int64_t>(bytes, 16))), "cudaMalloc");
  allocations_.push_back(*p);
  return Status::Ok();
}

}  // namespace treeserve::detail

namespace treeserve {
namespace {

using detail::CudaBackend;

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
  if (options.attention_max_chunk_tokens < 0 ||
      options.attention_max_chunk_tokens > TreeAttentionLimits{}.max_item_tokens) {
    return InvalidArgument("attention_max_chunk_tokens must be in [0, " +
                           std::to_string(TreeAttentionLimits{}.max_item_tokens) + "], got " +
                           std::to_string(options.attention_max_chunk_tokens));
  }
  if (options.attention_pair_margin < 2 || options.attention_pair_margin > 1024) {
    return InvalidArgument("attention_pair_margin must be in [2, 1024], got " +
                           std::to_string(options.attention_pair_margin));
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
  if (config.quant.scheme == QuantScheme::kFp8) {
    // The K of each FP8 GEMM: a rank's share of the intermediate and query sizes under tensor
    // parallelism (O and down take their input columns in slices).
    const int64_t tp = std::max<int64_t>(1, options.tensor_parallel);
    const std::string per_rank = tp > 1 ? " / tensor_parallel" : "";
    for (auto [what, n] : {std::pair<std::string, int64_t>{"hidden_size", config.hidden_size},
                           {"intermediate_size" + per_rank, config.intermediate_size / tp},
                           {"num_attention_heads * head_dim" + per_rank, config.q_size() / tp}}) {
      if (n % 16 != 0) {
        return InvalidArgument("CUDA backend: FP8 GEMMs need " + what +
                               " to be a multiple of 16, got " + std::to_string(n));
      }
    }
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
