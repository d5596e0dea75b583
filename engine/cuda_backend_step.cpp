// The CUDA backend's forward step (detail/cuda_backend_impl.h; the scheme is described in
// cuda_backend.cpp): metadata and plan upload, slot moves and page copies, the layers eagerly
// or from a CUDA graph per step shape, the all-reduce of tensor-parallel ranks.
#include "engine/detail/cuda_backend_impl.h"

namespace treeserve::detail {

Status CudaBackend::forward(const StepBatch& batch, Logits* out) {
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

Status CudaBackend::reserve_scratch(const StepBatch& batch) {
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
  if (fp8_) {
    TS_RETURN_IF_ERROR(xq_.reserve(size_t(rows * std::max({h, q, im})), "fp8 input"));
    TS_RETURN_IF_ERROR(xs_.reserve(size_t(std::max<int64_t>(rows, 1)) * 4, "fp8 input scales"));
    TS_RETURN_IF_ERROR(partial_.reserve(size_t(std::max<int64_t>(rows, 1) * h) * 4, "partial"));
  }
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

Status CudaBackend::enqueue_step(const StepBatch& batch, const AttentionPlan& plan) {
  TS_RETURN_IF_ERROR(upload_metadata(batch));
  TS_RETURN_IF_ERROR(workspace_.upload(plan, stream_));
  prof_.mark("upload", stream_);
  const int32_t d = int32_t(d_);
  const int64_t layer_elems = layout_.layer_elems();
  cuda::move_slots(dtype_, k_all_, v_all_, layout_.num_layers, layer_elems, layout_.page_elems(),
                   nkv_, layout_.page_size, d, d_move_src_, d_move_dst_,
                   int32_t(batch.slot_moves.size()), stream_, k_scale_all_, v_scale_all_);
  cuda::copy_pages(dtype_, k_all_, v_all_, layout_.num_layers, layer_elems, layout_.page_elems(),
                   nkv_, layout_.page_size, d, d_copy_src_, d_copy_dst_, d_copy_n_,
                   int32_t(batch.page_copies.size()), stream_, k_scale_all_, v_scale_all_);
  if (!graphs_) return enqueue_layers(batch, TreeAttentionGrid{});
  return run_step_graph(batch);
}

Status CudaBackend::run_step_graph(const StepBatch& batch) {
  GraphKey key;
  key.rows = batch.num_rows();
  key.n_logits = int64_t(batch.logit_rows.size());
  // As an eager launch of this upload would run (so a step runs the same kernels either way).
  key.grid = tree_attention_graph_grid(workspace_, int32_t(nkv_), int32_t(d_));
  key.buffers = {residual_.ptr, x_.ptr,       tmp_.ptr, qkv_.ptr,   q_.ptr,
                 attn_.ptr,     gu_.ptr,      act_.ptr, final_.ptr, logits_.ptr,
                 meta_.ptr,     partial_.ptr, xq_.ptr,  xs_.ptr};
  // step_graphs_ is kept least recently used first.
  auto found = std::find_if(step_graphs_.begin(), step_graphs_.end(),
                            [&](const StepGraph& g) { return g.key == key; });
  if (found != step_graphs_.end()) {
    std::rotate(found, found + 1, step_graphs_.end());
  } else {
    if (key != last_eager_key_) {
      last_eager_key_ = key;
      return enqueue_layers(batch, key.grid);
    }
    cudaGraphExec_t exec = nullptr;
    const Status captured = capture_layers(batch, key.grid, &exec);
    if (!captured.ok()) {
      // Not expected. The step runs again, eagerly (a real error of the step shows there
      // too), and later steps do not try again.
      std::fprintf(stderr, "treeserve: CUDA graph capture failed (%s); running without graphs\n",
                   captured.ToString().c_str());
      graphs_ = false;
      return enqueue_layers(batch, key.grid);
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

Status CudaBackend::capture_layers(const StepBatch& batch, TreeAttentionGrid grid,
                                   cudaGraphExec_t* exec) {
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

void CudaBackend::drop_graphs() {
  for (StepGraph& g : step_graphs_) cudaGraphExecDestroy(g.exec);
  step_graphs_.clear();
}

Status CudaBackend::enqueue_layers(const StepBatch& batch, TreeAttentionGrid grid) {
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
                     x_.ptr, stream_, fp8_rows_for(layers_[0].qkv8));
  prof_.mark("embed+moves", stream_);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LayerWeights& w = layers_[l];
    void* k_pool = static_cast<char*>(k_all_) + int64_t(l) * layout_.layer_bytes();
    void* v_pool = static_cast<char*>(v_all_) + int64_t(l) * layout_.layer_bytes();
    // kv_cache_fp8: the layer's row scales (one a (page, head, slot): layer_elems / d).
    float* k_scale = nullptr;
    float* v_scale = nullptr;
    if (k_scale_all_ != nullptr) {
      k_scale = k_scale_all_ + int64_t(l) * (layer_elems / d);
      v_scale = v_scale_all_ + int64_t(l) * (layer_elems / d);
    }
    // x_'s e4m3 copy, where FP8 wants one, came with it from the norm that wrote it.
    TS_RETURN_IF_ERROR(linear(x_.ptr, w.qkv, w.qkv8, qkv_.ptr, rows, q + 2 * kv, h, qkv_set_,
                              fp8_rows_for(w.qkv8).q != nullptr));
    prof_.mark("gemm qkv", stream_);
    cuda::rope_and_store_kv(dtype_, qkv_.ptr, d_positions_, inv_freq(), d_slots_, rows, nh, nkv, d,
                            layout_.page_size, q_.ptr, k_pool, v_pool, stream_, k_scale, v_scale);
    prof_.mark("rope+kv", stream_);
    TS_RETURN_IF_ERROR(launch_tree_attention(
        q_.ptr, k_pool, v_pool, attn_.ptr,
        options_.bfloat16 ? TreeAttentionDtype::kBFloat16 : TreeAttentionDtype::kFloat16, nh, nkv,
        d, layout_.page_size, scale_, workspace_, stream_, grid,
        TreeAttentionKvScales{k_scale, v_scale}));
    prof_.mark("attention", stream_);
    TS_RETURN_IF_ERROR(residual_gemm(attn_.ptr, w.o, w.o8, o_set_, rows, q, w.post_norm, x_.ptr,
                                     "gemm o", fp8_rows_for(w.gate_up8)));
    TS_RETURN_IF_ERROR(linear(x_.ptr, w.gate_up, w.gate_up8, gu_.ptr, rows, 2 * im, h, gate_up_set_,
                              fp8_rows_for(w.gate_up8).q != nullptr));
    prof_.mark("gemm gate_up", stream_);
    const cuda::Fp8Rows act_q = fp8_rows_for(w.down8);
    cuda::swiglu(dtype_, gu_.ptr, rows, im, act_.ptr, stream_, act_q);
    prof_.mark("swiglu", stream_);
    // Residual add, fused with the next layer's input norm.
    const bool last = l + 1 == layers_.size();
    TS_RETURN_IF_ERROR(residual_gemm(
        act_.ptr, w.down, w.down8, down_set_, rows, im, last ? nullptr : layers_[l + 1].input_norm,
        last ? nullptr : x_.ptr, "gemm down",
        last ? cuda::Fp8Rows{} : fp8_rows_for(layers_[l + 1].qkv8), act_q.q != nullptr));
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

Status CudaBackend::all_reduce(float* data, int64_t n) {
  if (world_ == 1 || options_.skip_collectives || n == 0) return Status::Ok();
  TS_RETURN_IF_ERROR(nccl_status(
      ncclAllReduce(data, data, size_t(n), ncclFloat32, ncclSum, comm_, stream_), "all-reduce"));
  prof_.mark("all-reduce", stream_);
  return Status::Ok();
}

Status CudaBackend::upload_metadata(const StepBatch& b) {
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

}  // namespace treeserve::detail
