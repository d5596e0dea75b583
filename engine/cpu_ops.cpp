// Float32 CPU operators. The GEMM is the only hot loop: register tiles of 2 x rows by
// 4 weight rows with 8-lane vector accumulators (GCC/Clang vector extensions, which lower
// to SSE, AVX or NEON), compiled twice on x86-64 (AVX2 and baseline) and picked at load
// time. AVX2 without FMA keeps both clones numerically identical (same multiplies and adds
// per lane), so results do not depend on the machine's ISA either.
#include "engine/cpu_ops.h"

#include <cmath>
#include <cstring>

#include "engine/thread_pool.h"
#include "models/fp8.h"

namespace treeserve {
namespace {

typedef float V8 __attribute__((vector_size(32)));

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define TS_GEMM_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef TS_GEMM_CLONES
#define TS_GEMM_CLONES
#endif

inline __attribute__((always_inline)) V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Fixed pairwise order: part of the numerics contract (see gemm_xwt).
inline __attribute__((always_inline)) float hsum8(V8 a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// y[i][j] for i < MR rows of x and j < NR rows of w.
template <int MR, int NR>
inline __attribute__((always_inline)) void gemm_tile(const float* x, int64_t ldx, const float* w,
                                                     int64_t K, float* y, int64_t ldy) {
  V8 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = V8{};
  const int64_t k8 = K & ~int64_t(7);
  for (int64_t k = 0; k < k8; k += 8) {
    V8 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const V8 xv = load8(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = hsum8(acc[i][j]);
      for (int64_t k = k8; k < K; ++k) s += x[i * ldx + k] * w[j * K + k];
      y[i * ldy + j] = s;
    }
  }
}

// Columns [n0, n1) of y for all M rows.
TS_GEMM_CLONES
void gemm_columns(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t M,
                  int64_t n0, int64_t n1, int64_t K) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float* wn = w + n * K;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) gemm_tile<2, 4>(x + m * ldx, ldx, wn, K, y + m * ldy + n, ldy);
    if (m < M) gemm_tile<1, 4>(x + m * ldx, ldx, wn, K, y + m * ldy + n, ldy);
  }
  for (; n < n1; ++n) {
    const float* wn = w + n * K;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) gemm_tile<2, 1>(x + m * ldx, ldx, wn, K, y + m * ldy + n, ldy);
    if (m < M) gemm_tile<1, 1>(x + m * ldx, ldx, wn, K, y + m * ldy + n, ldy);
  }
}

}  // namespace

void embed_rows(const float* table, const int32_t* token_ids, int64_t rows, int64_t hidden,
                float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(out + r * hidden, table + int64_t(token_ids[r]) * hidden, hidden * sizeof(float));
  }
}

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t hidden, float eps,
              float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * hidden;
    float* o = out + r * hidden;
    double sum = 0.0;
    for (int64_t i = 0; i < hidden; ++i) sum += double(xr[i]) * xr[i];
    const float variance = float(sum / double(hidden));
    const float inv = 1.0f / std::sqrt(variance + eps);
    for (int64_t i = 0; i < hidden; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

void rope_cos_sin(const int32_t* positions, int64_t rows, const float* inv_freq, int64_t half,
                  float* cos_out, float* sin_out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float pos = float(positions[r]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      // Double cos/sin of the float angle, rounded once: the correctly rounded value,
      // which torch's float32 cos/sin match to within an ulp.
      cos_out[r * half + i] = float(std::cos(double(angle)));
      sin_out[r * half + i] = float(std::sin(double(angle)));
    }
  }
}

void apply_rope(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos + r * half;
    const float* s = sin + r * half;
    for (int64_t j = 0; j < heads; ++j) {
      float* v = x + r * row_stride + j * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i];
        const float b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

void gemm_xwt(ThreadPool* pool, const float* x, int64_t ldx, const float* w, float* y, int64_t ldy,
              int64_t M, int64_t N, int64_t K) {
  if (M <= 0 || N <= 0) return;
  // Split columns in multiples of 16 (whole 4-wide tiles); tiny GEMMs stay on one thread.
  const int64_t grain = (M * N * K < (int64_t(1) << 16)) ? N : 16;
  pool->parallel_for(
      N, grain, [&](int64_t n0, int64_t n1) { gemm_columns(x, ldx, w, y, ldy, M, n0, n1, K); });
}

void swiglu(const float* gu, int64_t M, int64_t I, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gu + m * 2 * I;
    const float* u = g + I;
    float* o = out + m * I;
    for (int64_t i = 0; i < I; ++i) o[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
  }
}

void add_inplace(float* x, const float* delta, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += delta[i];
}

namespace {

void fake_quantize_rows_with(float (*scale_of)(float), const float* x, int64_t rows, int64_t cols,
                             float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float amax = 0.0f;
    for (int64_t c = 0; c < cols; ++c) amax = std::fmax(amax, std::fabs(xr[c]));
    fp8_fake_quantize_static(xr, cols, scale_of(amax), out + r * cols);
  }
}

}  // namespace

void fp8_fake_quantize_rows(const float* x, int64_t rows, int64_t cols, float* out) {
  fake_quantize_rows_with(fp8_scale, x, rows, cols, out);
}

void fp8_kv_fake_quantize_rows(const float* x, int64_t rows, int64_t cols, float* out) {
  fake_quantize_rows_with(fp8_kv_scale, x, rows, cols, out);
}

void fp8_fake_quantize_static(const float* x, int64_t n, float scale, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = e4m3_to_float(float_to_e4m3(x[i] / scale)) * scale;
}

}  // namespace treeserve
