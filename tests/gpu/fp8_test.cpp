// FP8 on the GPU: the quantization kernels (engine/cuda_fp8.h) equal models/fp8.h's CPU rule
// bit for bit (float32 and fp16 rows, zero rows, saturation); LtGemm::run_fp8 against a
// float64 reference over the dequantized operands at Llama-3-8B's decode shapes, autotuned
// and not, fp16 and float32 out; and the CUDA backend with FP8 linear layers (quantized at
// load from the tiny checkpoint, eager and from CUDA graphs, and from each generated FP8
// checkpoint layout) against the CPU backend's FP8 emulation.
#include "models/fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/cuda_backend.h"
#include "engine/cuda_fp8.h"
#include "engine/cuda_ops.h"
#include "engine/detail/cuda_buffers.h"
#include "engine/detail/cuda_gemm.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "tests/gpu/gemm_test_util.h"
#include "tests/gpu/gpu_test_util.h"

namespace treeserve {
namespace {

using detail::DeviceBuffer;
using detail::LtGemm;

using testing::Gpu;
constexpr size_t kWorkspaceBytes = testing::kGemmWorkspaceBytes;

template <typename T>
void upload(DeviceBuffer* d, const std::vector<T>& h) {
  ASSERT_TRUE(d->reserve(h.size() * sizeof(T) + 16, "test").ok());
  ASSERT_EQ(cudaMemcpy(d->ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
}

template <typename T>
std::vector<T> download(const DeviceBuffer& d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d.ptr, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// Rows with a spread of magnitudes: normal values, a zero row, a row of one huge value among
// tiny ones (most of it rounds to e4m3 subnormals or zero), values past 448 times the scale
// cannot occur (the scale is the row's max) but exact ties between e4m3 values do.
std::vector<float> test_rows(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float mag = std::ldexp(1.0f, int(r % 17) - 8);
    for (int64_t c = 0; c < cols; ++c) x[size_t(r * cols + c)] = normal(rng) * mag;
  }
  if (rows > 1) std::fill(x.begin() + cols, x.begin() + 2 * cols, 0.0f);
  if (rows > 2) {
    for (int64_t c = 0; c < cols; ++c) x[size_t(2 * cols + c)] = 1e-6f * float(c % 7 - 3);
    x[size_t(2 * cols)] = 3.0e4f;
  }
  if (rows > 3) {
    // Exact midpoints between neighbouring e4m3 values once scaled by 448 / max.
    for (int64_t c = 0; c < cols; ++c) x[size_t(3 * cols + c)] = float(c % 32) + 0.5f;
    x[size_t(3 * cols)] = 448.0f;
  }
  return x;
}

uint16_t to_half_bits(float f) {
  // Round to nearest even through the hardware-independent path the CPU code uses elsewhere:
  // a float16 from float32 by rounding the mantissa (normal range only, as the test values).
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const int32_t exp = int32_t((b >> 23) & 0xff) - 127 + 15;
  uint32_t man = b & 0x7fffffu;
  if (exp <= 0) return uint16_t(sign);  // flush (the test rows stay above)
  uint32_t h = (uint32_t(exp) << 10) | (man >> 13);
  const uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

TEST(Fp8Quantize, FloatRowsEqualTheCpuRuleBitForBit) {
  REQUIRE_GPU();
  Gpu g;
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{64, 4096}, {5, 14336}, {1, 16}}) {
    const std::vector<float> x = test_rows(rows, cols, uint32_t(rows * 131 + cols));
    std::vector<uint8_t> q_cpu(x.size());
    std::vector<float> s_cpu(static_cast<size_t>(rows));
    quantize_fp8_rows(x.data(), rows, cols, q_cpu.data(), s_cpu.data());
    DeviceBuffer dx, dq, ds;
    upload(&dx, x);
    ASSERT_TRUE(dq.reserve(x.size(), "q").ok());
    ASSERT_TRUE(ds.reserve(size_t(rows) * 4, "s").ok());
    cuda::quantize_rows_fp8_f32(dx.as<float>(), rows, cols, dq.as<uint8_t>(), ds.as<float>(),
                                g.stream);
    ASSERT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
    const auto q_gpu = download<uint8_t>(dq, x.size());
    const auto s_gpu = download<float>(ds, size_t(rows));
    EXPECT_EQ(std::memcmp(s_cpu.data(), s_gpu.data(), s_cpu.size() * 4), 0) << rows << "x" << cols;
    int64_t differ = 0;
    for (size_t i = 0; i < x.size(); ++i) differ += q_cpu[i] != q_gpu[i];
    EXPECT_EQ(differ, 0) << rows << "x" << cols;
  }
}

TEST(Fp8Quantize, HalfRowsEqualTheCpuRuleOnTheirValues) {
  REQUIRE_GPU();
  Gpu g;
  const int64_t rows = 32, cols = 4096;
  std::vector<float> x = test_rows(rows, cols, 7);
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    h[i] = to_half_bits(std::clamp(x[i], -60000.0f, 60000.0f));
    x[i] = f16_to_f32(h[i]);  // the values the kernel sees
  }
  std::vector<uint8_t> q_cpu(x.size());
  std::vector<float> s_cpu(static_cast<size_t>(rows));
  quantize_fp8_rows(x.data(), rows, cols, q_cpu.data(), s_cpu.data());
  DeviceBuffer dx, dq, ds;
  upload(&dx, h);
  ASSERT_TRUE(dq.reserve(x.size(), "q").ok());
  ASSERT_TRUE(ds.reserve(size_t(rows) * 4, "s").ok());
  cuda::quantize_rows_fp8(cuda::Dtype::kFloat16, dx.ptr, rows, cols, dq.as<uint8_t>(),
                          ds.as<float>(), g.stream);
  ASSERT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
  EXPECT_EQ(download<uint8_t>(dq, x.size()), q_cpu);
  const auto s_gpu = download<float>(ds, size_t(rows));
  EXPECT_EQ(std::memcmp(s_cpu.data(), s_gpu.data(), s_cpu.size() * 4), 0);
  // Static scale: x / s, rounded, and every row's scale reads s.
  const float s = 0.25f;
  DeviceBuffer dscalar;
  upload(&dscalar, std::vector<float>{s});
  cuda::quantize_rows_fp8_static(cuda::Dtype::kFloat16, dx.ptr, rows, cols, dscalar.as<float>(),
                                 dq.as<uint8_t>(), ds.as<float>(), g.stream);
  ASSERT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
  const auto q_static = download<uint8_t>(dq, x.size());
  for (size_t i = 0; i < x.size(); i += 97) {
    ASSERT_EQ(q_static[i], float_to_e4m3(x[i] / s)) << i;
  }
  for (float v : download<float>(ds, size_t(rows))) EXPECT_EQ(v, s);
}

// The RMSNorm kernel's e4m3 copy of its output (the FP8 GEMM input it saves a pass for) equals
// quantize_rows_fp8 on that output, bit for bit: both dtypes, one and two chunks a thread, the
// plain and the float-delta forms.
TEST(Fp8Quantize, TheNormKernelsCopyEqualsQuantizeRows) {
  REQUIRE_GPU();
  Gpu g;
  const int64_t rows = 6;
  for (cuda::Dtype dt : {cuda::Dtype::kFloat16, cuda::Dtype::kBFloat16}) {
    for (int64_t hidden : {int64_t(4096), int64_t(12288)}) {
      for (bool f32_delta : {false, true}) {
        SCOPED_TRACE("hidden=" + std::to_string(hidden) +
                     (dt == cuda::Dtype::kFloat16 ? " fp16" : " bf16") +
                     (f32_delta ? " float delta" : ""));
        const std::vector<float> res = test_rows(rows, hidden, uint32_t(hidden + 3));
        std::vector<float> delta = test_rows(rows, hidden, uint32_t(hidden + 5));
        std::vector<uint16_t> weight(static_cast<size_t>(hidden));
        for (int64_t c = 0; c < hidden; ++c) {
          const float v = 0.5f + float(c % 13) * 0.1f;
          uint32_t b;
          std::memcpy(&b, &v, 4);
          weight[size_t(c)] = dt == cuda::Dtype::kFloat16 ? to_half_bits(v) : uint16_t(b >> 16);
        }
        DeviceBuffer dres, ddelta, dw, dout, dq, ds, dq2, ds2;
        upload(&dres, res);
        upload(&ddelta, delta);
        upload(&dw, weight);
        ASSERT_TRUE(dout.reserve(size_t(rows * hidden) * 2, "out").ok());
        ASSERT_TRUE(dq.reserve(size_t(rows * hidden), "q").ok());
        ASSERT_TRUE(ds.reserve(size_t(rows) * 4, "s").ok());
        ASSERT_TRUE(dq2.reserve(size_t(rows * hidden), "q2").ok());
        ASSERT_TRUE(ds2.reserve(size_t(rows) * 4, "s2").ok());
        const cuda::Fp8Rows fp8{dq.as<uint8_t>(), ds.as<float>()};
        if (f32_delta) {
          cuda::add_rms_norm_f32_delta(dt, dres.as<float>(), ddelta.as<float>(), 1, 0, dw.ptr,
                                       1e-5f, rows, hidden, dout.ptr, g.stream, fp8);
        } else {
          cuda::add_rms_norm(dt, dres.as<float>(), nullptr, dw.ptr, 1e-5f, rows, hidden, dout.ptr,
                             g.stream, fp8);
        }
        cuda::quantize_rows_fp8(dt, dout.ptr, rows, hidden, dq2.as<uint8_t>(), ds2.as<float>(),
                                g.stream);
        ASSERT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
        EXPECT_EQ(download<uint8_t>(dq, size_t(rows * hidden)),
                  download<uint8_t>(dq2, size_t(rows * hidden)));
        const auto s1 = download<float>(ds, size_t(rows)), s2 = download<float>(ds2, size_t(rows));
        EXPECT_EQ(0, std::memcmp(s1.data(), s2.data(), size_t(rows) * 4));
      }
    }
  }
}

// swiglu's e4m3 copy (the FP8 down projection's input) equals quantize_rows_fp8 on its output,
// and the output is the plain kernel's, bit for bit: one to eight chunks a thread and the
// widths past the row kernel's reach (a separate quantization).
TEST(Fp8Quantize, TheSwigluKernelsCopyEqualsQuantizeRows) {
  REQUIRE_GPU();
  Gpu g;
  const int64_t rows = 5;
  for (cuda::Dtype dt : {cuda::Dtype::kFloat16, cuda::Dtype::kBFloat16}) {
    for (int64_t im :
         {int64_t(1024), int64_t(14336), int64_t(28672), int64_t(53248), int64_t(65600)}) {
      SCOPED_TRACE("im=" + std::to_string(im) + (dt == cuda::Dtype::kFloat16 ? " fp16" : " bf16"));
      const std::vector<float> gu = test_rows(rows, 2 * im, uint32_t(im));
      std::vector<uint16_t> bits(gu.size());
      for (size_t i = 0; i < gu.size(); ++i) {
        // Gate and up values kept in range: silu(g) * u of the test rows' scaled normals.
        const float v = std::max(-60.0f, std::min(60.0f, gu[i]));
        uint32_t b;
        std::memcpy(&b, &v, 4);
        bits[i] = dt == cuda::Dtype::kFloat16 ? to_half_bits(v) : uint16_t(b >> 16);
      }
      DeviceBuffer dgu, dout, dout2, dq, ds, dq2, ds2;
      upload(&dgu, bits);
      ASSERT_TRUE(dout.reserve(size_t(rows * im) * 2, "out").ok());
      ASSERT_TRUE(dout2.reserve(size_t(rows * im) * 2, "out2").ok());
      ASSERT_TRUE(dq.reserve(size_t(rows * im), "q").ok());
      ASSERT_TRUE(ds.reserve(size_t(rows) * 4, "s").ok());
      ASSERT_TRUE(dq2.reserve(size_t(rows * im), "q2").ok());
      ASSERT_TRUE(ds2.reserve(size_t(rows) * 4, "s2").ok());
      cuda::swiglu(dt, dgu.ptr, rows, im, dout.ptr, g.stream, {dq.as<uint8_t>(), ds.as<float>()});
      cuda::swiglu(dt, dgu.ptr, rows, im, dout2.ptr, g.stream);
      cuda::quantize_rows_fp8(dt, dout2.ptr, rows, im, dq2.as<uint8_t>(), ds2.as<float>(),
                              g.stream);
      ASSERT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
      EXPECT_EQ(download<uint16_t>(dout, size_t(rows * im)),
                download<uint16_t>(dout2, size_t(rows * im)));
      EXPECT_EQ(download<uint8_t>(dq, size_t(rows * im)),
                download<uint8_t>(dq2, size_t(rows * im)));
      const auto s1 = download<float>(ds, size_t(rows)), s2 = download<float>(ds2, size_t(rows));
      EXPECT_EQ(0, std::memcmp(s1.data(), s2.data(), size_t(rows) * 4));
    }
  }
}

// y = run(x, x scales, w, w scales, y) on random rows quantized per row, against float64 sums
// of the dequantized operands on sampled outputs. Returns y's bits (for repeat checks).
template <typename Run>
std::vector<uint8_t> check_fp8_product(int64_t m, int64_t n, int64_t k, cudaDataType_t out,
                                       const Gpu& g, Run&& run) {
  const std::vector<float> x = test_rows(m, k, uint32_t(m + k));
  std::mt19937 rng(uint32_t(n * 7 + k));
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> w(size_t(n * k));
  for (float& v : w) v = normal(rng);
  std::vector<uint8_t> xq(x.size()), wq(w.size());
  std::vector<float> xs(static_cast<size_t>(m)), ws(static_cast<size_t>(n));
  quantize_fp8_rows(x.data(), m, k, xq.data(), xs.data());
  quantize_fp8_rows(w.data(), n, k, wq.data(), ws.data());
  DeviceBuffer dxq, dxs, dwq, dws, dy;
  upload(&dxq, xq);
  upload(&dxs, xs);
  upload(&dwq, wq);
  upload(&dws, ws);
  const size_t out_bytes = out == CUDA_R_32F ? 4 : 2;
  EXPECT_TRUE(dy.reserve(size_t(m * n) * out_bytes, "y").ok());
  EXPECT_EQ(cudaMemset(dy.ptr, 0xff, size_t(m * n) * out_bytes), cudaSuccess);
  const Status s = run(dxq.ptr, dxs.as<float>(), dwq.ptr, dws.as<float>(), dy.ptr);
  EXPECT_TRUE(s.ok()) << s.message();
  if (!s.ok()) return {};
  EXPECT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
  const std::vector<uint8_t> bits = download<uint8_t>(dy, size_t(m * n) * out_bytes);
  std::vector<float> y(size_t(m * n));
  for (size_t i = 0; i < y.size(); ++i) {
    if (out == CUDA_R_32F) {
      std::memcpy(&y[i], &bits[i * 4], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &bits[i * 2], 2);
      if (out == CUDA_R_16F) {
        y[i] = f16_to_f32(h);
      } else {
        const uint32_t f = uint32_t(h) << 16;
        std::memcpy(&y[i], &f, 4);
      }
    }
  }
  double worst = 0, err2 = 0, ref2 = 0;
  // A sample of the rows and columns, the last of each among them.
  auto sample = [](int64_t count, int64_t every) {
    std::vector<int64_t> v;
    for (int64_t i = 0; i < count; i += std::max<int64_t>(1, every)) v.push_back(i);
    if (v.back() != count - 1) v.push_back(count - 1);
    return v;
  };
  for (int64_t i : sample(m, m <= 20 ? 1 : m / 9)) {
    for (int64_t j : sample(n, n / 61)) {
      double ref = 0, mag = 0;
      for (int64_t c = 0; c < k; ++c) {
        const double a = double(e4m3_to_float(xq[size_t(i * k + c)])) * xs[size_t(i)];
        const double b = double(e4m3_to_float(wq[size_t(j * k + c)])) * ws[size_t(j)];
        ref += a * b;
        mag += std::fabs(a * b);
      }
      // Hopper's FP8 tensor cores add the products in narrower partial sums than float32
      // before promoting them (measured: up to 2.3e-5 of the sum of magnitudes), plus the
      // output's rounding (fp16 2^-11, bf16 2^-8 of the value).
      const double rounding = out == CUDA_R_32F ? 0.0 : out == CUDA_R_16F ? 1e-3 : 8e-3;
      const double tol = 1e-4 * mag + std::fabs(ref) * rounding + 1e-30;
      const double err = std::fabs(double(y[size_t(i * n + j)]) - ref);
      worst = std::max(worst, err / (mag + 1e-30));
      err2 += err * err;
      ref2 += ref * ref;
      EXPECT_LE(err, tol) << "y[" << i << "][" << j << "] = " << y[size_t(i * n + j)]
                          << ", reference " << ref;
      if (err > tol) return bits;
    }
  }
  // The RMS error against the RMS output, comparable with the output type's own rounding
  // (fp16: about 1.4e-4). With float32 outputs it is the accumulation's error alone.
  std::printf("  worst error / sum of |terms|: %.2e; RMS error / RMS value: %.2e\n", worst,
              std::sqrt(err2 / (ref2 + 1e-300)));
  return bits;
}

// run_fp8 against float64 sums of the dequantized operands, on sampled outputs.
void check_fp8_gemm(int64_t m, int64_t n, int64_t k, cudaDataType_t out, bool autotune) {
  SCOPED_TRACE("m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
               (out == CUDA_R_32F ? " f32" : " f16") + (autotune ? " tuned" : " heuristic"));
  Gpu g;
  LtGemm gemm;
  ASSERT_TRUE(gemm.init(0, g.cublas, g.workspace.ptr, kWorkspaceBytes, autotune).ok());
  check_fp8_product(m, n, k, out, g,
                    [&](const void* xq, const float* xs, const void* wq, const float* ws, void* y) {
                      return gemm.run_fp8(xq, xs, wq, ws, y, m, n, k, out, g.stream);
                    });
}

// The engine's decode-row FP8 kernel on its own: every row-block instantiation (1 to 272 rows),
// split counts from 1 to 8, each output type; the same call twice gives the same bits.
TEST(Fp8GemmRows, EveryRowCountAndSplitMatchesAFloat64Reference) {
  REQUIRE_GPU();
  Gpu g;
  struct Case {
    int64_t m, n, k;
    int splits;
    cudaDataType_t out;
  };
  const Case cases[] = {
      {1, 128, 128, 1, CUDA_R_32F},     {8, 256, 1024, 3, CUDA_R_16F},
      {9, 4096, 4096, 8, CUDA_R_32F},   {24, 6144, 4096, 5, CUDA_R_16F},
      {33, 1024, 14336, 8, CUDA_R_32F}, {50, 4096, 4096, 8, CUDA_R_16BF},
      {64, 28672, 4096, 1, CUDA_R_16F}, {65, 512, 4096, 2, CUDA_R_32F},
      {100, 6144, 4096, 5, CUDA_R_16F}, {128, 4096, 14336, 7, CUDA_R_32F},
      {97, 384, 384, 3, CUDA_R_16BF},   {129, 4096, 4096, 4, CUDA_R_32F},
      {150, 1024, 4096, 2, CUDA_R_16F}, {200, 512, 14336, 8, CUDA_R_16BF},
      {257, 6144, 4096, 2, CUDA_R_32F}, {272, 28672, 4096, 1, CUDA_R_16F},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) +
                 " k=" + std::to_string(c.k) + " splits=" + std::to_string(c.splits));
    const auto out = c.out == CUDA_R_32F    ? cuda::Fp8Out::kFloat32
                     : c.out == CUDA_R_16BF ? cuda::Fp8Out::kBFloat16
                                            : cuda::Fp8Out::kFloat16;
    std::vector<uint8_t> first;
    auto run = [&](const void* xq, const float* xs, const void* wq, const float* ws, void* y) {
      if (!cuda::fp8_gemm_rows_fits(c.m, c.n, c.k, xq, wq, y)) {
        return InvalidArgument("the shape does not fit");
      }
      const cudaError_t e =
          cuda::fp8_gemm_rows(static_cast<const uint8_t*>(xq), xs, static_cast<const uint8_t*>(wq),
                              ws, y, out, c.m, c.n, c.k, c.splits, g.stream);
      if (e != cudaSuccess) return Internal(cudaGetErrorString(e));
      return Status::Ok();
    };
    first = check_fp8_product(c.m, c.n, c.k, c.out, g, run);
    EXPECT_EQ(check_fp8_product(c.m, c.n, c.k, c.out, g, run), first) << "not reproducible";
  }
}

// The kernel's shape rules and argument checks: host code only, so this runs without a GPU
// (the pointers are only checked for alignment; every call here is refused before a launch).
TEST(Fp8GemmRows, RefusesShapesItDoesNotServe) {
  alignas(16) static uint8_t bytes[64];
  alignas(16) static float floats[16];
  const uint8_t* p = bytes;
  EXPECT_TRUE(cuda::fp8_gemm_rows_fits(272, 4096, 4096, p, p, p));
  EXPECT_FALSE(cuda::fp8_gemm_rows_fits(273, 4096, 4096, p, p, p));  // too many rows
  EXPECT_FALSE(cuda::fp8_gemm_rows_fits(0, 4096, 4096, p, p, p));
  EXPECT_FALSE(cuda::fp8_gemm_rows_fits(8, 4000, 4096, p, p, p));    // n not a multiple of 128
  EXPECT_FALSE(cuda::fp8_gemm_rows_fits(8, 4096, 4000, p, p, p));    // k not a multiple of 128
  EXPECT_FALSE(cuda::fp8_gemm_rows_fits(8, 128, 128, p + 8, p, p));  // x not 16-byte aligned
  EXPECT_FALSE(cuda::fp8_gemm_rows_fits(8, 128, 128, p, p + 4, p));  // w not 16-byte aligned
  EXPECT_FALSE(cuda::fp8_gemm_rows_fits(8, 128, 128, p, p, p + 2));  // y not 16-byte aligned
  const float* f = floats;
  void* y = bytes;
  EXPECT_EQ(cuda::fp8_gemm_rows(p, f, p, f, y, cuda::Fp8Out::kFloat16, 8, 128, 256, 3, nullptr),
            cudaErrorInvalidValue);  // more splits than 128-byte chunks of k
  EXPECT_EQ(cuda::fp8_gemm_rows(p, f, p, f, y, cuda::Fp8Out::kFloat16, 8, 128, 1024, 9, nullptr),
            cudaErrorInvalidValue);  // more than a portable cluster
  EXPECT_EQ(cuda::fp8_gemm_rows(p, f, p, f, y, cuda::Fp8Out::kFloat16, 8, 128, 1024, 0, nullptr),
            cudaErrorInvalidValue);  // no split
  EXPECT_EQ(cuda::fp8_gemm_rows(p, f, p, f, y, cuda::Fp8Out::kFloat16, 300, 128, 1024, 1, nullptr),
            cudaErrorInvalidValue);  // too many rows
  EXPECT_EQ(cuda::fp8_gemm_rows(p, f, p, f, y, cuda::Fp8Out::kFloat16, 0, 128, 1024, 1, nullptr),
            cudaSuccess);  // no rows: nothing to do
  EXPECT_EQ(cuda::fp8_gemm_rows_splits(4096, 4096), 8);
  EXPECT_EQ(cuda::fp8_gemm_rows_splits(28672, 4096), 1);
  EXPECT_EQ(cuda::fp8_gemm_rows_splits(6144, 4096), 5);
  EXPECT_EQ(cuda::fp8_gemm_rows_splits(128, 128), 1);
  EXPECT_EQ(cuda::fp8_gemm_rows_splits(2048, 256), 2);  // at most k / 128 K ranges
}

TEST(Fp8Gemm, LlamaShapesMatchAFloat64Reference) {
  REQUIRE_GPU();
  for (int64_t m : {1, 7, 50, 257}) {
    for (auto [n, k] :
         {std::pair<int64_t, int64_t>{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}}) {
      check_fp8_gemm(m, n, k, m == 50 ? CUDA_R_32F : CUDA_R_16F, true);
    }
  }
  check_fp8_gemm(50, 6144, 4096, CUDA_R_16F, false);
  check_fp8_gemm(3, 96, 64, CUDA_R_32F, true);
}

TEST(Fp8Gemm, RefusesAKThatIsNotAMultipleOf16) {
  REQUIRE_GPU();
  Gpu g;
  LtGemm gemm;
  ASSERT_TRUE(gemm.init(0, g.cublas, g.workspace.ptr, kWorkspaceBytes, true).ok());
  DeviceBuffer b;
  ASSERT_TRUE(b.reserve(1 << 20, "b").ok());
  Status s = gemm.run_fp8(b.ptr, b.as<float>(), b.ptr, b.as<float>(), b.ptr, 4, 32, 40, CUDA_R_16F,
                          g.stream);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("multiple of 16"), std::string::npos) << s.message();
}

// rope_and_store_kv into an e4m3 pool (the FP8 KV cache): Q as the 16-bit form writes it, and
// each (token, kv head) row of K and of V equals quantize_fp8_kv_rows on what the 16-bit form
// stores there (K rotated and rounded to the dtype), bytes and scale bit for bit; both dtypes,
// head_dim 64 and 128, rows scattered over pages, one row of zeros (scale 1). Rows no token
// writes stay zero.
TEST(Fp8KvCache, RopeStoreEqualsQuantizeRowsOfThe16BitPool) {
  REQUIRE_GPU();
  Gpu g;
  for (const bool bf16 : {false, true}) {
    for (const int32_t d : {64, 128}) {
      SCOPED_TRACE(std::string(bf16 ? "bf16" : "fp16") + " head_dim " + std::to_string(d));
      const int32_t nh = 8, nkv = 2, page_size = 16;
      const int64_t rows = 37, pages = 8;
      const int64_t width = int64_t(nh + 2 * nkv) * d;
      const int64_t pool = pages * nkv * page_size * d;
      const cuda::Dtype dt = bf16 ? cuda::Dtype::kBFloat16 : cuda::Dtype::kFloat16;
      std::mt19937 rng(uint32_t(d + bf16));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::vector<uint16_t> qkv(size_t(rows * width));
      for (int64_t r = 0; r < rows; ++r) {
        const float mag = std::ldexp(1.0f, int(r % 9) - 4);
        for (int64_t c = 0; c < width; ++c) {
          // Row 3's V of kv head 1 is zero (its scale is 1).
          const bool zero = r == 3 && c >= int64_t(nh + nkv + 1) * d;
          const float x = zero ? 0.0f : normal(rng) * mag;
          qkv[size_t(r * width + c)] =
              bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : to_half_bits(x);
        }
      }
      std::vector<int32_t> positions(static_cast<size_t>(rows));
      std::vector<int64_t> slots(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        positions[size_t(r)] = int32_t(r * 97 + 3);
        slots[size_t(r)] = (r * 5) % (pages * page_size);  // distinct, across every page
      }
      std::vector<float> inv_freq(static_cast<size_t>(d / 2));
      for (int32_t i = 0; i < d / 2; ++i) {
        inv_freq[size_t(i)] = float(std::pow(500000.0, -2.0 * i / d));
      }
      DeviceBuffer dqkv, dpos, dslots, dfreq, q16, q8, k16, v16, k8, v8, ks, vs;
      upload(&dqkv, qkv);
      upload(&dpos, positions);
      upload(&dslots, slots);
      upload(&dfreq, inv_freq);
      for (DeviceBuffer* b : {&q16, &q8})
        ASSERT_TRUE(b->reserve(size_t(rows * nh * d) * 2, "q").ok());
      for (DeviceBuffer* b : {&k16, &v16, &k8, &v8, &ks, &vs}) {
        const size_t bytes = b == &k16 || b == &v16 ? size_t(pool) * 2
                             : b == &k8 || b == &v8 ? size_t(pool)
                                                    : size_t(pool / d) * 4;
        ASSERT_TRUE(b->reserve(bytes, "pool").ok());
        ASSERT_EQ(cudaMemset(b->ptr, 0, bytes), cudaSuccess);
      }
      cuda::rope_and_store_kv(dt, dqkv.ptr, dpos.as<int32_t>(), dfreq.as<float>(),
                              dslots.as<int64_t>(), rows, nh, nkv, d, page_size, q16.ptr, k16.ptr,
                              v16.ptr, g.stream);
      cuda::rope_and_store_kv(dt, dqkv.ptr, dpos.as<int32_t>(), dfreq.as<float>(),
                              dslots.as<int64_t>(), rows, nh, nkv, d, page_size, q8.ptr, k8.ptr,
                              v8.ptr, g.stream, ks.as<float>(), vs.as<float>());
      ASSERT_EQ(cudaStreamSynchronize(g.stream), cudaSuccess);
      EXPECT_EQ(download<uint16_t>(q16, size_t(rows * nh * d)),
                download<uint16_t>(q8, size_t(rows * nh * d)));
      for (const bool is_k : {true, false}) {
        const auto src = download<uint16_t>(is_k ? k16 : v16, size_t(pool));
        const auto q = download<uint8_t>(is_k ? k8 : v8, size_t(pool));
        const auto sc = download<float>(is_k ? ks : vs, size_t(pool / d));
        int64_t written = 0, differ = 0, scale_differ = 0, stray = 0;
        std::vector<bool> is_written(size_t(pool / d), false);
        for (int64_t r = 0; r < rows; ++r) {
          for (int32_t h = 0; h < nkv; ++h) {
            const int64_t page = slots[size_t(r)] / page_size;
            const int64_t row = (page * nkv + h) * page_size + slots[size_t(r)] % page_size;
            is_written[size_t(row)] = true;
            std::vector<float> x(static_cast<size_t>(d));
            for (int32_t c = 0; c < d; ++c) {
              const uint16_t bits = src[size_t(row * d + c)];
              x[size_t(c)] = bf16 ? bf16_to_f32(bits) : f16_to_f32(bits);
            }
            std::vector<uint8_t> want(static_cast<size_t>(d));
            float want_scale = 0.0f;
            quantize_fp8_kv_rows(x.data(), 1, d, want.data(), &want_scale);
            for (int32_t c = 0; c < d; ++c) differ += want[size_t(c)] != q[size_t(row * d + c)];
            scale_differ += std::memcmp(&want_scale, &sc[size_t(row)], 4) != 0;
            if (r == 3 && !is_k && h == 1) {
              EXPECT_EQ(sc[size_t(row)], 1.0f);
            }
            ++written;
          }
        }
        for (int64_t row = 0; row < pool / d; ++row) {
          if (is_written[size_t(row)]) continue;
          for (int32_t c = 0; c < d; ++c) stray += q[size_t(row * d + c)] != 0;
          stray += sc[size_t(row)] != 0.0f;
        }
        EXPECT_EQ(written, rows * nkv);
        EXPECT_EQ(differ, 0) << (is_k ? "K" : "V") << " bytes";
        EXPECT_EQ(scale_differ, 0) << (is_k ? "K" : "V") << " scales";
        EXPECT_EQ(stray, 0) << (is_k ? "K" : "V") << ": rows no token names were written";
      }
    }
  }
}

// Runs a 41-token prompt and 24 greedy steps on both backends (the CPU's tokens drive both);
// returns the largest logit difference and how many greedy tokens agree.
struct Lockstep {
  float worst = 0;
  int agree = 0, steps = 0;
};
Lockstep run_lockstep(Backend* cpu, Backend* gpu, int64_t pages, int32_t page_size) {
  Lockstep r;
  testing::StepBuilder sb(pages, page_size);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 41; ++i) prompt.push_back(1 + (i * 53 + 7) % 500);
  auto nb = sb.kv().create_branch(prompt);
  EXPECT_TRUE(nb.ok());
  if (!nb.ok()) return r;
  sb.add_rows(nb->id, prompt, nb->slots, 0, true);
  int32_t pos = int32_t(prompt.size());
  for (int step = 0; step < 24; ++step) {
    EXPECT_TRUE(sb.build_view().ok());
    Logits a, b;
    Status sc = cpu->forward(sb.batch(), &a);
    Status sg = gpu->forward(sb.batch(), &b);
    EXPECT_TRUE(sc.ok()) << sc.message();
    EXPECT_TRUE(sg.ok()) << sg.message();
    if (!sc.ok() || !sg.ok()) return r;
    const float* x = a.row(a.num_rows - 1);
    const float* y = b.row(b.num_rows - 1);
    float err = 0;
    for (int64_t v = 0; v < a.vocab; ++v) err = std::max(err, std::fabs(x[v] - y[v]));
    r.worst = std::max(r.worst, err);
    const int32_t next = int32_t(std::max_element(x, x + a.vocab) - x);
    r.agree += next == int32_t(std::max_element(y, y + b.vocab) - y);
    ++r.steps;
    sb.clear();
    std::vector<KvSlot> slots;
    EXPECT_TRUE(sb.kv().append(nb->id, std::vector<int32_t>{next}, &slots).ok());
    sb.add_rows(nb->id, {next}, slots, pos++, true);
  }
  return r;
}

constexpr int32_t kPageSize = 16;
constexpr int64_t kPages = 256;

// The tiny model quantized at load on both backends: the CPU backend emulates the FP8 layers
// (the same quantization rule, float32 products), the GPU runs them in e4m3 GEMMs.
TEST(Fp8Backend, TinyModelMatchesTheCpuEmulation) {
  REQUIRE_GPU();
  auto ckpt = testing::load_tiny_checkpoint();
  ASSERT_TRUE(ckpt);
  ModelConfig config = ckpt->config;
  config.quant.scheme = QuantScheme::kFp8;
  config.quant.source = "--quantization fp8";
  // FP8 weights alone, then with the FP8 KV cache on both backends too.
  for (bool kv_fp8 : {false, true}) {
    CpuBackendOptions co;
    co.page_size = kPageSize;
    co.num_pages = kPages;
    co.kv_cache_fp8 = kv_fp8;
    auto cpu = create_cpu_backend(config, ckpt->weights, co);
    ASSERT_TRUE(cpu.ok()) << cpu.status().message();
    for (bool graphs : {false, true}) {
      SCOPED_TRACE(std::string(graphs ? "graphs" : "eager") + (kv_fp8 ? ", FP8 KV" : ""));
      CudaBackendOptions go;
      go.num_pages = kPages;
      go.page_size = kPageSize;
      go.cuda_graphs = graphs;
      go.kv_cache_fp8 = kv_fp8;
      auto gpu = create_cuda_backend(config, ckpt->weights, go);
      ASSERT_TRUE(gpu.ok()) << gpu.status().message();
      const Lockstep r = run_lockstep(cpu->get(), gpu->get(), kPages, kPageSize);
      std::printf("  FP8 tiny model, %s%s: max |cpu - gpu| logit %.4f, greedy agrees %d of %d\n",
                  graphs ? "graphs" : "eager", kv_fp8 ? ", FP8 KV cache" : "", r.worst, r.agree,
                  r.steps);
      // The GPU quantizes the checkpoint's float32 weights after rounding them to fp16 and its
      // activations from fp16 (the CPU from float32), so inputs near an e4m3 rounding boundary
      // land on the other side: each such element moves by a whole e4m3 step (1/8 relative),
      // and the model amplifies it (HF's own fp16 and float32 runs of the same FP8 Llama-3-8B
      // differ by 2.2 in the logits). Measured on an H200: 0.76 and 17 of 24 (FP8 weights).
      // Wrong scales or layouts give errors of the logits' own size.
      EXPECT_LE(r.worst, 1.5f);
      EXPECT_GE(r.agree, r.steps / 2);
    }
  }
}

// Every FP8 checkpoint layout the loader takes (tests/models/make_fp8_checkpoint.py: the fp8
// layout per channel with dynamic inputs and per tensor with static ones, compressed-tensors
// per channel and token with BF16 scales, and per tensor with static inputs), through the
// loader onto both backends: the same e4m3 weights, so only the activations' rounding differs.
TEST(Fp8Backend, Fp8CheckpointLayoutsMatchTheCpuBackend) {
  REQUIRE_GPU();
  for (const char* layout :
       {"fp8-channel-dynamic", "fp8-tensor-static", "ct-channel-token", "ct-tensor-tensor"}) {
    SCOPED_TRACE(layout);
    // $TREESERVE_FP8_MODELS_DIR: a copy carried to a GPU machine (as the tiny model's).
    const char* env = std::getenv("TREESERVE_FP8_MODELS_DIR");
    const std::string dir = std::string(env ? env : TREESERVE_FP8_MODELS_DIR) + "/" + layout;
    auto config = load_model_config(dir);
    ASSERT_TRUE(config.ok()) << config.status().message();
    ASSERT_EQ(config->quant.scheme, QuantScheme::kFp8);
    ASSERT_TRUE(config->quant.prequantized);
    auto reader = SafetensorsReader::open_dir(dir);
    ASSERT_TRUE(reader.ok()) << reader.status().message();
    auto weights = load_llama_weights(*config, *reader);
    ASSERT_TRUE(weights.ok()) << weights.status().message();
    CpuBackendOptions co;
    co.page_size = kPageSize;
    co.num_pages = kPages;
    auto cpu = create_cpu_backend(*config, *weights, co);
    ASSERT_TRUE(cpu.ok()) << cpu.status().message();
    CudaBackendOptions go;
    go.num_pages = kPages;
    go.page_size = kPageSize;
    auto gpu = create_cuda_backend(*config, *weights, go);
    ASSERT_TRUE(gpu.ok()) << gpu.status().message();
    const Lockstep r = run_lockstep(cpu->get(), gpu->get(), kPages, kPageSize);
    std::printf("  %s: max |cpu - gpu| logit %.4f, greedy agrees %d of %d\n", layout, r.worst,
                r.agree, r.steps);
    EXPECT_LE(r.worst, 1.5f);
    EXPECT_GE(r.agree, r.steps / 2);
  }
}

}  // namespace
}  // namespace treeserve
