// The CPU backend: the float32 reference the CUDA engine is compared with, and the engine a
// user without a GPU gets. One forward per step:
//   slot moves, page copies -> embed -> per layer [RMSNorm, fused QKV GEMM, RoPE, K/V into
//   the pool at the rows' slots, tree attention by the step's plan over the pool, O GEMM,
//   residual, RMSNorm, fused gate/up GEMM, SwiGLU, down GEMM, residual] -> final RMSNorm and
//   LM head on the logit rows only.
// The attention plan is built once per step and executed for every layer (the same plan
// the CUDA kernel will run). All scratch lives in the backend and is reused across steps.
// FP8 models (engine/cpu_weights.h) run the same loop on dequantized e4m3 weights, with each
// GEMM's input quantized to e4m3 and dequantized first (the LM head's excepted). An FP8 KV
// cache (kv_cache_fp8) is emulated the same way: each (token, kv head) row of K and V is
// quantized and dequantized before it is written, so the float32 pool holds e4m3 values times
// the row's scale, what the CUDA backend's e4m3 pool dequantizes to.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <span>
#include <string>

#include "engine/backend.h"
#include "engine/cpu_backend_pool.h"
#include "engine/cpu_ops.h"
#include "engine/cpu_weights.h"
#include "engine/thread_pool.h"
#include "kernels/attention_cpu.h"
#include "kernels/tree_attention.h"

namespace treeserve {
namespace {

// Attention work (multiply-adds) below which the executor runs on the calling thread: it
// starts its own threads per call, which costs more than a small step's attention.
constexpr double kParallelAttentionFlops = 4e6;

class CpuBackend final : public Backend {
 public:
  CpuBackend(const ModelConfig& config, CpuModelWeights weights, const CpuBackendOptions& options)
      : config_(config), weights_(std::move(weights)), pool_(options.num_threads) {
    layout_.num_layers = int32_t(config.num_hidden_layers);
    layout_.num_kv_heads = int32_t(config.num_key_value_heads);
    layout_.head_dim = int32_t(config.head_dim);
    layout_.page_size = options.page_size;
    layout_.num_pages = options.num_pages;
    layout_.dtype_bytes = 4;
    plan_config_ = options.plan;
    baseline_attention_ = options.baseline_attention;
    kv_cache_fp8_ = options.kv_cache_fp8;
    plan_config_.gqa_group_size = int32_t(config.num_attention_heads / config.num_key_value_heads);
    plan_config_.head_dim = int32_t(config.head_dim);
    plan_config_.num_pages = options.num_pages;
    inv_freq_ = rope_inv_freq(config);
    scale_ = float(1.0 / std::sqrt(double(config.head_dim)));
  }

  // Allocates the pool (zeros). False when memory is short.
  bool allocate_pool() {
    try {
      k_pool_.resize(layout_.num_layers);
      v_pool_.resize(layout_.num_layers);
      for (int32_t l = 0; l < layout_.num_layers; ++l) {
        k_pool_[l].assign(size_t(layout_.layer_elems()), 0.0f);
        v_pool_[l].assign(size_t(layout_.layer_elems()), 0.0f);
      }
    } catch (const std::bad_alloc&) {
      return false;
    }
    return true;
  }

  // One layer's K (or V) buffer, [num_pages][num_kv_heads][page_size][head_dim].
  std::span<const float> kv_buffer(int32_t layer, bool v) const {
    if (layer < 0 || layer >= int32_t(k_pool_.size())) return {};
    return v ? v_pool_[size_t(layer)] : k_pool_[size_t(layer)];
  }

  std::string_view name() const override { return "cpu"; }
  const ModelConfig& model_config() const override { return config_; }
  const KvLayout& kv_layout() const override { return layout_; }

  Status forward(const StepBatch& batch, Logits* out) override {
    try {
      return forward_unchecked(batch, out);
    } catch (const std::bad_alloc&) {
      return ResourceExhausted("CPU backend: out of host memory for a step of " +
                               std::to_string(batch.num_rows()) + " rows");
    }
  }

 private:
  Status forward_unchecked(const StepBatch& batch, Logits* out) {
    TS_RETURN_IF_ERROR(validate_step_batch(batch, layout_, config_.vocab_size, &check_));
    TS_RETURN_IF_ERROR(baseline_attention_
                           ? build_baseline_plan(batch.view, plan_config_, &plan_)
                           : build_attention_plan(batch.view, plan_config_, &plan_));
    // Scratch first: if it cannot grow (RESOURCE_EXHAUSTED) the pool is still untouched.
    const int64_t rows = batch.num_rows();
    resize_scratch(rows);
    move_slots(batch);
    copy_pages(batch);
    embed_rows(weights_.embed.data(), batch.token_ids.data(), rows, config_.hidden_size, x_.data());
    rope_cos_sin(batch.positions.data(), rows, inv_freq_.data(), config_.head_dim / 2, cos_.data(),
                 sin_.data());
    const int32_t attention_threads = attention_thread_count();
    for (int32_t l = 0; l < layout_.num_layers; ++l) {
      TS_RETURN_IF_ERROR(run_layer(l, batch, attention_threads));
    }
    lm_head(batch, out);
    out->argmax.clear();
    out->argmax_logprob.clear();
    out->sampled.clear();
    if (!batch.sampling.empty()) {
      // The backend draws (StepBatch::sampling): the host sampler on each row, then no logits.
      sample_rows_on_host(batch, out->data.data(), config_.vocab_size, config_.vocab_size,
                          &sampling_scratch_, &out->sampled);
      out->data.clear();
    }
    return Status::Ok();
  }

  void move_slots(const StepBatch& batch) {
    const int32_t ps = layout_.page_size;
    const size_t d = size_t(layout_.head_dim);
    for (const StepSlotMove& m : batch.slot_moves) {
      if (m.src_slot == m.dst_slot) continue;
      for (int32_t l = 0; l < layout_.num_layers; ++l) {
        for (int32_t h = 0; h < layout_.num_kv_heads; ++h) {
          const int64_t src = layout_.offset(m.src_slot / ps, h, int32_t(m.src_slot % ps));
          const int64_t dst = layout_.offset(m.dst_slot / ps, h, int32_t(m.dst_slot % ps));
          std::memcpy(&k_pool_[l][dst], &k_pool_[l][src], d * sizeof(float));
          std::memcpy(&v_pool_[l][dst], &v_pool_[l][src], d * sizeof(float));
        }
      }
    }
  }

  void copy_pages(const StepBatch& batch) {
    for (const StepPageCopy& c : batch.page_copies) {
      // Within a page each head's slots [0, num_slots) are contiguous (HND layout).
      const size_t n = size_t(c.num_slots) * layout_.head_dim;
      for (int32_t l = 0; l < layout_.num_layers; ++l) {
        for (int32_t h = 0; h < layout_.num_kv_heads; ++h) {
          const int64_t src = layout_.offset(c.src_page, h, 0);
          const int64_t dst = layout_.offset(c.dst_page, h, 0);
          std::memcpy(&k_pool_[l][dst], &k_pool_[l][src], n * sizeof(float));
          std::memcpy(&v_pool_[l][dst], &v_pool_[l][src], n * sizeof(float));
        }
      }
    }
  }

  void resize_scratch(int64_t rows) {
    const int64_t h = config_.hidden_size, q = config_.q_size(), kv = config_.kv_size();
    const int64_t im = config_.intermediate_size;
    x_.resize(size_t(rows * h));
    xn_.resize(size_t(rows * h));
    qkv_.resize(size_t(rows * (q + 2 * kv)));
    q_.resize(size_t(rows * q));
    attn_.resize(size_t(rows * q));
    gu_.resize(size_t(rows * 2 * im));
    act_.resize(size_t(rows * im));
    if (weights_.fp8) fp8_in_.resize(size_t(rows * std::max({h, q, im})));
    cos_.resize(size_t(rows * config_.head_dim / 2));
    sin_.resize(cos_.size());
  }

  int32_t attention_thread_count() const {
    double flops = 0.0;
    for (int32_t i = 0; i < plan_.num_items(); ++i) {
      flops += double(plan_.item_num_tokens[i]) *
               double(plan_.item_query_end[i] - plan_.item_query_begin[i]);
    }
    flops *= 2.0 * double(config_.num_attention_heads * config_.head_dim);
    return flops < kParallelAttentionFlops ? 1 : pool_.num_threads();
  }

  // A linear layer's input x [rows][cols]: x itself, or under FP8 its e4m3 quantization
  // dequantized into fp8_in_ (per row, or with the layer's static input scale).
  const float* linear_input(const float* x, int64_t rows, int64_t cols, float input_scale) {
    if (!weights_.fp8) return x;
    if (weights_.fp8_static) {
      fp8_fake_quantize_static(x, rows * cols, input_scale, fp8_in_.data());
    } else {
      fp8_fake_quantize_rows(x, rows, cols, fp8_in_.data());
    }
    return fp8_in_.data();
  }

  // x_ [rows][hidden] is the residual stream; everything else is scratch.
  Status run_layer(int32_t l, const StepBatch& batch, int32_t attention_threads) {
    const CpuLayerWeights& w = weights_.layers[l];
    const int64_t rows = batch.num_rows();
    const int64_t h = config_.hidden_size, d = config_.head_dim;
    const int64_t nh = config_.num_attention_heads, nkv = config_.num_key_value_heads;
    const int64_t q = config_.q_size(), kv = config_.kv_size(), im = config_.intermediate_size;
    const int64_t qkv_stride = q + 2 * kv;
    const float eps = float(config_.rms_norm_eps);

    // Attention block. qkv_ [rows][q | k | v].
    rms_norm(x_.data(), w.input_norm.data(), rows, h, eps, xn_.data());
    gemm_xwt(&pool_, linear_input(xn_.data(), rows, h, w.qkv_input_scale), h, w.qkv.data(),
             qkv_.data(), qkv_stride, rows, qkv_stride, h);
    apply_rope(qkv_.data(), rows, qkv_stride, nh, d, cos_.data(), sin_.data());
    apply_rope(qkv_.data() + q, rows, qkv_stride, nkv, d, cos_.data(), sin_.data());
    float* k_layer = k_pool_[l].data();
    float* v_layer = v_pool_[l].data();
    const int32_t ps = layout_.page_size;
    for (int64_t r = 0; r < rows; ++r) {
      float* row = qkv_.data() + r * qkv_stride;
      if (kv_cache_fp8_) {
        // K [nkv][d] and V [nkv][d] of this row, in place: one scale per head's vector, as
        // the e4m3 pool stores them. Attention reads K and V only from the pool.
        fp8_kv_fake_quantize_rows(row + q, nkv, d, row + q);
        fp8_kv_fake_quantize_rows(row + q + kv, nkv, d, row + q + kv);
      }
      std::memcpy(q_.data() + r * q, row, size_t(q) * sizeof(float));  // [rows][nh][d]
      const int64_t page = batch.kv_slots[r] / ps;
      const int32_t slot = int32_t(batch.kv_slots[r] % ps);
      for (int64_t j = 0; j < nkv; ++j) {
        const int64_t off = layout_.offset(page, int32_t(j), slot);
        std::memcpy(k_layer + off, row + q + j * d, size_t(d) * sizeof(float));
        std::memcpy(v_layer + off, row + q + kv + j * d, size_t(d) * sizeof(float));
      }
    }
    TS_RETURN_IF_ERROR(execute_attention_plan_cpu(
        plan_, batch.view, layout_, q_.data(), int32_t(rows), k_layer, v_layer, int32_t(nh), scale_,
        attn_.data(), &attention_ws_, attention_threads));
    gemm_xwt(&pool_, linear_input(attn_.data(), rows, q, w.o_input_scale), q, w.o.data(),
             xn_.data(), h, rows, h, q);
    add_inplace(x_.data(), xn_.data(), rows * h);

    // MLP block. gu_ [rows][gate | up].
    rms_norm(x_.data(), w.post_norm.data(), rows, h, eps, xn_.data());
    gemm_xwt(&pool_, linear_input(xn_.data(), rows, h, w.gate_up_input_scale), h, w.gate_up.data(),
             gu_.data(), 2 * im, rows, 2 * im, h);
    swiglu(gu_.data(), rows, im, act_.data());
    gemm_xwt(&pool_, linear_input(act_.data(), rows, im, w.down_input_scale), im, w.down.data(),
             xn_.data(), h, rows, h, im);
    add_inplace(x_.data(), xn_.data(), rows * h);
    return Status::Ok();
  }

  // Final norm and LM head on the logit rows only. out [num_logit_rows][vocab].
  void lm_head(const StepBatch& batch, Logits* out) {
    const int64_t h = config_.hidden_size;
    const int64_t n = int64_t(batch.logit_rows.size());
    final_.resize(size_t(n * h));
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(final_.data() + i * h, x_.data() + int64_t(batch.logit_rows[i]) * h,
                  size_t(h) * sizeof(float));
    }
    rms_norm(final_.data(), weights_.norm.data(), n, h, float(config_.rms_norm_eps), final_.data());
    out->num_rows = int32_t(n);
    out->vocab = config_.vocab_size;
    out->data.resize(size_t(n * config_.vocab_size));
    gemm_xwt(&pool_, final_.data(), h, weights_.lm_head_data(), out->data.data(),
             config_.vocab_size, n, config_.vocab_size, h);
  }

  ModelConfig config_;
  CpuModelWeights weights_;
  ThreadPool pool_;
  KvLayout layout_;
  AttentionPlanConfig plan_config_;
  bool baseline_attention_ = false;
  bool kv_cache_fp8_ = false;    // K/V rows through e4m3 before they enter the pool
  std::vector<float> inv_freq_;  // [head_dim / 2]
  float scale_ = 1.0f;
  std::vector<std::vector<float>> k_pool_, v_pool_;  // [layers][KvLayout::layer_elems()]

  // Per-step state, reused.
  StepBatchCheckScratch check_;
  AttentionPlan plan_;
  AttentionCpuWorkspace attention_ws_;
  std::vector<float> x_, xn_;     // [rows][hidden]
  std::vector<float> qkv_;        // [rows][q_size + 2 * kv_size]
  std::vector<float> q_, attn_;   // [rows][heads][head_dim]
  std::vector<float> gu_;         // [rows][2 * intermediate]
  std::vector<float> act_;        // [rows][intermediate]
  std::vector<float> cos_, sin_;  // [rows][head_dim / 2]
  std::vector<float> final_;      // [logit rows][hidden]
  std::vector<float> fp8_in_;     // FP8: a linear layer's dequantized input [rows][<= max dim]
  SamplingScratch sampling_scratch_;
};

Status check_options(const ModelConfig& config, const CpuBackendOptions& options) {
  if (options.page_size < 1 || options.page_size > 256) {
    return InvalidArgument("page_size = " + std::to_string(options.page_size) +
                           " must be in [1, 256]");
  }
  if (options.num_pages < 1 || options.num_pages > INT32_MAX) {
    return InvalidArgument("num_pages = " + std::to_string(options.num_pages) +
                           " must be in [1, 2^31)");
  }
  if (options.num_threads < 0) {
    return InvalidArgument("num_threads = " + std::to_string(options.num_threads) +
                           " must be >= 0");
  }
  if (config.num_key_value_heads < 1 || config.num_attention_heads % config.num_key_value_heads ||
      config.head_dim % 2 || config.head_dim < 2) {
    return InvalidArgument(
        "model: num_attention_heads must be a multiple of "
        "num_key_value_heads and head_dim even");
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<Backend>> make_backend(const ModelConfig& config,
                                                StatusOr<CpuModelWeights> weights,
                                                const CpuBackendOptions& options) {
  if (!weights.ok()) return weights.status();
  auto backend = std::make_unique<CpuBackend>(config, std::move(weights).value(), options);
  if (!backend->allocate_pool()) {
    return ResourceExhausted(
        "cannot allocate the CPU KV pool: " + std::to_string(options.num_pages) + " pages of " +
        std::to_string(backend->kv_layout().bytes_per_token() * options.page_size) + " bytes");
  }
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace

std::span<const float> cpu_backend_kv_buffer(const Backend& backend, int32_t layer, bool v) {
  const auto* cpu = dynamic_cast<const CpuBackend*>(&backend);
  return cpu != nullptr ? cpu->kv_buffer(layer, v) : std::span<const float>();
}

StatusOr<std::unique_ptr<Backend>> create_cpu_backend(const ModelConfig& config,
                                                      const LlamaWeights& weights,
                                                      const CpuBackendOptions& options) {
  TS_RETURN_IF_ERROR(check_options(config, options));
  return make_backend(config, convert_weights_to_f32(config, weights), options);
}

StatusOr<std::unique_ptr<Backend>> create_cpu_backend_random(const ModelConfig& config,
                                                             const CpuBackendOptions& options,
                                                             uint64_t seed) {
  TS_RETURN_IF_ERROR(check_options(config, options));
  return make_backend(config, random_cpu_weights(config, seed), options);
}

}  // namespace treeserve
