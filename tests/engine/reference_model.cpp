// The naive reference forward (see reference_model.h). Shapes: x [T][hidden], q [T][heads][d],
// k and v [T][kv_heads][d]; every activation is double.
#include "tests/engine/reference_model.h"

#include <cmath>

namespace treeserve::testing {
namespace {

std::vector<float> to_f32(const TensorView& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  to_float(t, out.data());
  return out;
}

// y[t][o] = sum_i x[t][i] * w[o][i]   (w in HF [out][in] layout)
std::vector<double> linear(const std::vector<double>& x, int64_t rows, int64_t in,
                           const std::vector<float>& w, int64_t out) {
  std::vector<double> y(static_cast<size_t>(rows * out));
  for (int64_t t = 0; t < rows; ++t) {
    const double* xt = x.data() + t * in;
    for (int64_t o = 0; o < out; ++o) {
      const float* wo = w.data() + o * in;
      double s = 0.0;
      for (int64_t i = 0; i < in; ++i) s += xt[i] * double(wo[i]);
      y[size_t(t * out + o)] = s;
    }
  }
  return y;
}

std::vector<double> rms_norm(const std::vector<double>& x, int64_t rows, int64_t hidden,
                             const std::vector<float>& w, double eps) {
  std::vector<double> y(x.size());
  for (int64_t t = 0; t < rows; ++t) {
    double ss = 0.0;
    for (int64_t i = 0; i < hidden; ++i) ss += x[t * hidden + i] * x[t * hidden + i];
    const double inv = 1.0 / std::sqrt(ss / double(hidden) + eps);
    for (int64_t i = 0; i < hidden; ++i) y[t * hidden + i] = double(w[i]) * x[t * hidden + i] * inv;
  }
  return y;
}

// Rotate-half RoPE of `heads` heads per row; row t is at position t.
void rope(std::vector<double>* x, int64_t rows, int64_t heads, int64_t d,
          const std::vector<float>& inv_freq) {
  const int64_t half = d / 2;
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = float(t) * inv_freq[i];  // HF forms the angle in float32
      const double c = std::cos(double(angle)), s = std::sin(double(angle));
      for (int64_t h = 0; h < heads; ++h) {
        double* v = x->data() + (t * heads + h) * d;
        const double a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
      }
    }
  }
}

}  // namespace

ReferenceModel::ReferenceModel(const ModelConfig& config, const LlamaWeights& w) : config_(config) {
  embed_ = to_f32(w.embed_tokens);
  norm_ = to_f32(w.norm);
  lm_head_ = to_f32(w.lm_head);
  for (const LlamaLayerWeights& lw : w.layers) {
    layers_.push_back({to_f32(lw.input_layernorm), to_f32(lw.q_proj), to_f32(lw.k_proj),
                       to_f32(lw.v_proj), to_f32(lw.o_proj), to_f32(lw.post_attention_layernorm),
                       to_f32(lw.gate_proj), to_f32(lw.up_proj), to_f32(lw.down_proj)});
  }
  inv_freq_ = rope_inv_freq(config);
}

std::vector<float> ReferenceModel::forward(std::span<const int32_t> tokens) const {
  const int64_t T = int64_t(tokens.size());
  const int64_t H = config_.hidden_size, d = config_.head_dim;
  const int64_t nh = config_.num_attention_heads, nkv = config_.num_key_value_heads;
  const int64_t im = config_.intermediate_size, vocab = config_.vocab_size;
  const double eps = config_.rms_norm_eps;
  const double scale = 1.0 / std::sqrt(double(d));

  std::vector<double> x(static_cast<size_t>(T * H));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < H; ++i) x[t * H + i] = embed_[tokens[t] * H + i];
  }
  for (const Layer& L : layers_) {
    std::vector<double> xn = rms_norm(x, T, H, L.input_norm, eps);
    std::vector<double> q = linear(xn, T, H, L.q, nh * d);
    std::vector<double> k = linear(xn, T, H, L.k, nkv * d);
    std::vector<double> v = linear(xn, T, H, L.v, nkv * d);
    rope(&q, T, nh, d, inv_freq_);
    rope(&k, T, nkv, d, inv_freq_);
    // Causal attention, query t over keys [0, t]; q head h reads kv head h / (nh / nkv).
    std::vector<double> attn(static_cast<size_t>(T * nh * d), 0.0);
    std::vector<double> p(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < nh; ++h) {
        const int64_t g = h / (nh / nkv);
        const double* qv = q.data() + (t * nh + h) * d;
        double mx = -INFINITY;
        for (int64_t s = 0; s <= t; ++s) {
          const double* kv = k.data() + (s * nkv + g) * d;
          double dot = 0.0;
          for (int64_t i = 0; i < d; ++i) dot += qv[i] * kv[i];
          p[s] = dot * scale;
          mx = std::max(mx, p[s]);
        }
        double sum = 0.0;
        for (int64_t s = 0; s <= t; ++s) sum += (p[s] = std::exp(p[s] - mx));
        double* out = attn.data() + (t * nh + h) * d;
        for (int64_t s = 0; s <= t; ++s) {
          const double* vv = v.data() + (s * nkv + g) * d;
          for (int64_t i = 0; i < d; ++i) out[i] += p[s] / sum * vv[i];
        }
      }
    }
    std::vector<double> o = linear(attn, T, nh * d, L.o, H);
    for (size_t i = 0; i < x.size(); ++i) x[i] += o[i];

    xn = rms_norm(x, T, H, L.post_norm, eps);
    std::vector<double> gate = linear(xn, T, H, L.gate, im);
    std::vector<double> up = linear(xn, T, H, L.up, im);
    for (size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
    std::vector<double> down = linear(gate, T, im, L.down, H);
    for (size_t i = 0; i < x.size(); ++i) x[i] += down[i];
  }
  std::vector<double> logits = linear(rms_norm(x, T, H, norm_, eps), T, H, lm_head_, vocab);
  return std::vector<float>(logits.begin(), logits.end());
}

}  // namespace treeserve::testing
