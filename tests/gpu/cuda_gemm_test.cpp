// LtGemm (engine/detail/cuda_gemm.h), the autotuned cublasLt GEMM, against cublasGemmEx (the
// backend's previous call) and a float64 CPU reference on sampled outputs: Llama-3-8B's
// decode shapes (fused QKV, O, fused gate/up, down, LM head) at 1, 7, 50 and 257 rows and a
// tiny shape, fp16 and bf16 in, model-dtype and float32 out. Also: a shape's calls are bit
// identical, a second instance takes the cached algorithm, rows of one bucket share a tuning,
// nothing is tuned inside a graph capture, and autotune off is exactly cublasGemmEx.
// Split-K (run_split_k): each float part equals run() on its K slice and a float64 reference,
// the parts sum to run()'s product, splits are tuned and cached apart, autotune off is
// cublasGemmStridedBatchedEx, bad arguments are refused (without a device too), and the norm
// kernel sums the parts in order before rounding once.
#include "engine/detail/cuda_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine/cuda_backend.h"
#include "engine/cuda_ops.h"
#include "engine/detail/cuda_buffers.h"
#include "tests/gpu/gemm_test_util.h"

namespace treeserve {
namespace {

using detail::DeviceBuffer;
using detail::LtGemm;
using detail::TunedGemm;

using testing::Gpu;
constexpr size_t kWorkspaceBytes = testing::kGemmWorkspaceBytes;

float half_bits_to_float(uint16_t h) {
  const int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v = 0;
  if (exp == 0) {
    v = std::ldexp(float(man), -24);
  } else if (exp == 31) {
    v = man ? NAN : INFINITY;
  } else {
    v = std::ldexp(float(man | 0x400), exp - 25);
  }
  return (h & 0x8000) ? -v : v;
}

float bf16_bits_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// Host copy of `count` elements of `type` from the device as floats.
std::vector<float> download(const void* src, size_t count, cudaDataType_t type) {
  std::vector<float> out(count);
  if (type == CUDA_R_32F) {
    EXPECT_EQ(cudaMemcpy(out.data(), src, count * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  std::vector<uint16_t> bits(count);
  EXPECT_EQ(cudaMemcpy(bits.data(), src, count * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  for (size_t i = 0; i < count; ++i) {
    out[i] = type == CUDA_R_16F ? half_bits_to_float(bits[i]) : bf16_bits_to_float(bits[i]);
  }
  return out;
}

std::vector<uint8_t> bytes_of(const void* src, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(cudaMemcpy(out.data(), src, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// y [m][n] = x [m][k] . w [n][k]^T with cublasGemmEx, as the backend called it.
void cublas_reference(Gpu& gpu, const void* x, const void* w, void* y, int64_t m, int64_t n,
                      int64_t k, cudaDataType_t in, cudaDataType_t out) {
  const float alpha = 1.0f, beta = 0.0f;
  ASSERT_EQ(cublasGemmEx(gpu.cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &alpha, w,
                         in, int(k), x, in, int(k), &beta, y, out, int(n), CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
}

struct Shape {
  const char* name;
  int64_t n, k;
  bool lm_head;  // float32 out only, one matrix (as the backend)
};

// Llama-3-8B's GEMMs (n = output features, k = input features) and a tiny one.
const Shape kShapes[] = {{"qkv", 6144, 4096, false},      {"o", 4096, 4096, false},
                         {"gate_up", 28672, 4096, false}, {"down", 4096, 14336, false},
                         {"lm_head", 128256, 4096, true}, {"tiny", 96, 64, false}};

// Worst difference two correct fp32-accumulated GEMMs may show after rounding to `out`
// (|y| stays below ~2 with these inputs: one ulp there, twice); a transposed operand is off by
// the outputs' size (~0.3).
float tolerance(cudaDataType_t out) {
  if (out == CUDA_R_32F) return 2e-3f;
  return out == CUDA_R_16F ? 4e-3f : 3e-2f;
}

// A random weight matrix of the shape (uniform +-1/sqrt(k)) in each of ws, their pointers in
// set (the tuner cycles through them).
void random_weights(const Gpu& gpu, cuda::Dtype dt, const Shape& s, uint64_t* seed,
                    std::vector<DeviceBuffer>* ws, std::vector<const void*>* set) {
  set->clear();
  for (DeviceBuffer& w : *ws) {
    ASSERT_TRUE(w.reserve(size_t(s.n * s.k) * 2, "w").ok());
    cuda::fill_random(dt, w.ptr, s.n * s.k, (*seed)++, float(1.0 / std::sqrt(double(s.k))), 0.0f,
                      gpu.stream);
    set->push_back(w.ptr);
  }
}

// Every shape and row count in `in`, each output type the backend uses for it: the tuned
// result against cublasGemmEx everywhere and a float64 reference on sampled outputs, and a
// second call bit for bit.
void run_shapes(cudaDataType_t in) {
  Gpu gpu;
  LtGemm gemm;
  ASSERT_TRUE(gpu.init(&gemm).ok());
  const cuda::Dtype dt = in == CUDA_R_16BF ? cuda::Dtype::kBFloat16 : cuda::Dtype::kFloat16;
  uint64_t seed = 1;
  for (const Shape& s : kShapes) {
    // Two matrices of the shape (one for the LM head) for the tuner to cycle through.
    std::vector<DeviceBuffer> ws(s.lm_head ? 1 : 2);
    std::vector<const void*> set;
    ASSERT_NO_FATAL_FAILURE(random_weights(gpu, dt, s, &seed, &ws, &set));
    for (int64_t m : {1, 7, 50, 257}) {
      DeviceBuffer x, y, y2, ref;
      ASSERT_TRUE(x.reserve(size_t(m * s.k) * 2, "x").ok());
      cuda::fill_random(dt, x.ptr, m * s.k, seed++, 1.0f, 0.0f, gpu.stream);
      std::vector<cudaDataType_t> outs = {CUDA_R_32F};
      if (!s.lm_head) outs.push_back(in);
      for (cudaDataType_t out : outs) {
        SCOPED_TRACE(std::string(s.name) + " m=" + std::to_string(m) +
                     (out == CUDA_R_32F ? " f32 out" : " model-dtype out"));
        const size_t y_bytes = size_t(m * s.n) * (out == CUDA_R_32F ? 4 : 2);
        ASSERT_TRUE(y.reserve(y_bytes, "y").ok());
        ASSERT_TRUE(y2.reserve(y_bytes, "y2").ok());
        ASSERT_TRUE(ref.reserve(y_bytes, "ref").ok());
        const void* w = set.back();
        Status st = gemm.run(x.ptr, w, y.ptr, m, s.n, s.k, in, out, gpu.stream, set);
        ASSERT_TRUE(st.ok()) << st.message();
        st = gemm.run(x.ptr, w, y2.ptr, m, s.n, s.k, in, out, gpu.stream, set);
        ASSERT_TRUE(st.ok()) << st.message();
        cublas_reference(gpu, x.ptr, w, ref.ptr, m, s.n, s.k, in, out);
        ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);

        EXPECT_TRUE(bytes_of(y.ptr, y_bytes) == bytes_of(y2.ptr, y_bytes)) << "not bit-identical";
        const std::vector<float> got = download(y.ptr, size_t(m * s.n), out);
        const std::vector<float> want = download(ref.ptr, size_t(m * s.n), out);
        float worst = 0;
        for (size_t i = 0; i < got.size(); ++i)
          worst = std::max(worst, std::fabs(got[i] - want[i]));
        EXPECT_LE(worst, tolerance(out)) << "max |tuned - cublasGemmEx|";

        // float64 dot products of the stored inputs on 64 sampled outputs.
        const std::vector<float> xs = download(x.ptr, size_t(m * s.k), in);
        float worst_cpu = 0;
        uint64_t r = 12345;
        for (int sample = 0; sample < 64; ++sample) {
          r = r * 6364136223846793005ull + 1442695040888963407ull;
          const int64_t row = int64_t((r >> 33) % uint64_t(m));
          const int64_t col = int64_t((r >> 13) % uint64_t(s.n));
          const std::vector<float> wrow =
              download(static_cast<const char*>(w) + col * s.k * 2, size_t(s.k), in);
          double dot = 0;
          for (int64_t i = 0; i < s.k; ++i)
            dot += double(xs[size_t(row * s.k + i)]) * wrow[size_t(i)];
          worst_cpu = std::max(worst_cpu, float(std::fabs(dot - got[size_t(row * s.n + col)])));
        }
        EXPECT_LE(worst_cpu, tolerance(out)) << "max |tuned - float64 reference|";
      }
    }
  }
  for (const TunedGemm& t : LtGemm::tuned_shapes()) {
    EXPECT_FALSE(t.fallback) << "m=" << t.m_tuned << " n=" << t.n << " k=" << t.k;
    if (!t.fallback) {
      EXPECT_GE(t.candidates, 1);
      EXPECT_GT(t.us, 0.0f);
    }
  }
}

TEST(LtGemm, MatchesCublasAndReferenceFp16) {
  REQUIRE_GPU();
  run_shapes(CUDA_R_16F);
}

TEST(LtGemm, MatchesCublasAndReferenceBf16) {
  REQUIRE_GPU();
  run_shapes(CUDA_R_16BF);
}

// One O-projection-shaped problem with its inputs (fp16).
struct Problem {
  int64_t m = 50, n = 4096, k = 4096;
  DeviceBuffer x, w, y;
  explicit Problem(Gpu& gpu, int64_t rows = 50) : m(rows) {
    EXPECT_TRUE(x.reserve(size_t(m * k) * 2, "x").ok());
    EXPECT_TRUE(w.reserve(size_t(n * k) * 2, "w").ok());
    EXPECT_TRUE(y.reserve(size_t(m * n) * 2, "y").ok());
    cuda::fill_random(cuda::Dtype::kFloat16, x.ptr, m * k, 7, 1.0f, 0.0f, gpu.stream);
    cuda::fill_random(cuda::Dtype::kFloat16, w.ptr, n * k, 8, 1.0f / 64, 0.0f, gpu.stream);
  }
  Status run(LtGemm& g, Gpu& gpu, void* out = nullptr) {
    return g.run(x.ptr, w.ptr, out ? out : y.ptr, m, n, k, CUDA_R_16F, CUDA_R_16F, gpu.stream);
  }
  std::vector<uint8_t> result() { return bytes_of(y.ptr, size_t(m * n) * 2); }
};

TEST(LtGemm, SecondInstanceTakesTheCachedAlgorithm) {
  REQUIRE_GPU();
  LtGemm::clear_cache();
  Gpu gpu;
  Problem p(gpu);
  LtGemm a, b;
  ASSERT_TRUE(gpu.init(&a).ok());
  ASSERT_TRUE(gpu.init(&b).ok());
  ASSERT_TRUE(p.run(a, gpu).ok());
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
  const std::vector<uint8_t> first = p.result();
  const std::vector<TunedGemm> tuned = LtGemm::tuned_shapes();
  ASSERT_EQ(tuned.size(), 1u);
  EXPECT_EQ(tuned[0].m_tuned, 64) << "a bucket is tuned at its top row count";
  EXPECT_EQ(tuned[0].m_bucket, 64);
  ASSERT_TRUE(p.run(b, gpu).ok());
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
  EXPECT_EQ(LtGemm::tuned_shapes().size(), 1u) << "the second instance tuned again";
  EXPECT_TRUE(first == p.result()) << "two instances, one shape: not bit-identical";
}

// Buckets stay narrow next to the tiles (no device needed): a bucket's rows run the tiles
// tuned at its top, so 129 rows must not share 256's (128-row tiles: two passes over every
// weight matrix).
TEST(LtGemm, RowBuckets) {
  for (int64_t m = 1; m <= 16; ++m) EXPECT_EQ(detail::gemm_rows_bucket(m), m);
  EXPECT_EQ(detail::gemm_rows_bucket(17), 32);
  EXPECT_EQ(detail::gemm_rows_bucket(50), 64);
  EXPECT_EQ(detail::gemm_rows_bucket(129), 144);
  EXPECT_EQ(detail::gemm_rows_bucket(256), 256);
  EXPECT_EQ(detail::gemm_rows_bucket(257), 272);
  EXPECT_EQ(detail::gemm_rows_bucket(513), 576);
  EXPECT_EQ(detail::gemm_rows_bucket(1024), 1024);
  EXPECT_EQ(detail::gemm_rows_bucket(1025), 2048);
  for (int64_t m = 1; m <= 4096; ++m) {
    const int64_t b = detail::gemm_rows_bucket(m);
    EXPECT_GE(b, m);
    EXPECT_LE(b - m, m <= 512 ? 15 : m <= 1024 ? 63 : m);
    EXPECT_EQ(detail::gemm_rows_bucket(b), b) << "a bucket's top is its own bucket";
  }
}

TEST(LtGemm, RowsOfOneBucketShareATuning) {
  REQUIRE_GPU();
  LtGemm::clear_cache();
  Gpu gpu;
  LtGemm g;
  ASSERT_TRUE(gpu.init(&g).ok());
  Problem p50(gpu, 50), p49(gpu, 49);
  ASSERT_TRUE(p50.run(g, gpu).ok());
  ASSERT_TRUE(p49.run(g, gpu).ok());
  DeviceBuffer ref;
  ASSERT_TRUE(ref.reserve(size_t(49 * 4096) * 2, "ref").ok());
  cublas_reference(gpu, p49.x.ptr, p49.w.ptr, ref.ptr, 49, 4096, 4096, CUDA_R_16F, CUDA_R_16F);
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
  EXPECT_EQ(LtGemm::tuned_shapes().size(), 1u);
  const std::vector<float> got = download(p49.y.ptr, 49 * 4096, CUDA_R_16F);
  const std::vector<float> want = download(ref.ptr, 49 * 4096, CUDA_R_16F);
  float worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
  EXPECT_LE(worst, tolerance(CUDA_R_16F));
}

// Inside a capture: the heuristic's first candidate, nothing timed or cached; the graph
// computes the product; the next eager call tunes.
TEST(LtGemm, NothingIsTunedDuringAGraphCapture) {
  REQUIRE_GPU();
  LtGemm::clear_cache();
  Gpu gpu;
  LtGemm g;
  ASSERT_TRUE(gpu.init(&g).ok());
  Problem p(gpu);
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(gpu.stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status captured = p.run(g, gpu);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(gpu.stream, &graph), cudaSuccess);
  ASSERT_TRUE(captured.ok()) << captured.message();
  EXPECT_TRUE(LtGemm::tuned_shapes().empty());
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, gpu.stream), cudaSuccess);
  DeviceBuffer ref;
  ASSERT_TRUE(ref.reserve(size_t(p.m * p.n) * 2, "ref").ok());
  cublas_reference(gpu, p.x.ptr, p.w.ptr, ref.ptr, p.m, p.n, p.k, CUDA_R_16F, CUDA_R_16F);
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
  const std::vector<float> got = download(p.y.ptr, size_t(p.m * p.n), CUDA_R_16F);
  const std::vector<float> want = download(ref.ptr, size_t(p.m * p.n), CUDA_R_16F);
  float worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
  EXPECT_LE(worst, tolerance(CUDA_R_16F));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  ASSERT_TRUE(p.run(g, gpu).ok());
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
  EXPECT_EQ(LtGemm::tuned_shapes().size(), 1u);
}

TEST(LtGemm, AutotuneOffIsCublasGemmEx) {
  REQUIRE_GPU();
  Gpu gpu;
  LtGemm g;
  ASSERT_TRUE(gpu.init(&g, false).ok());
  Problem p(gpu);
  DeviceBuffer ref;
  ASSERT_TRUE(ref.reserve(size_t(p.m * p.n) * 2, "ref").ok());
  ASSERT_TRUE(p.run(g, gpu).ok());
  cublas_reference(gpu, p.x.ptr, p.w.ptr, ref.ptr, p.m, p.n, p.k, CUDA_R_16F, CUDA_R_16F);
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
  EXPECT_TRUE(p.result() == bytes_of(ref.ptr, size_t(p.m * p.n) * 2)) << "not cublasGemmEx's bits";
}

float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    worst = std::max(worst, std::fabs(a[i] - b[i]));
  }
  return worst;
}

// dst [rows][len] = columns [begin, begin + len) of src [rows][k] (2-byte elements).
void copy_columns(const void* src, int64_t rows, int64_t k, int64_t begin, int64_t len, void* dst,
                  cudaStream_t stream) {
  ASSERT_EQ(cudaMemcpy2DAsync(dst, size_t(len) * 2, static_cast<const char*>(src) + begin * 2,
                              size_t(k) * 2, size_t(len) * 2, size_t(rows),
                              cudaMemcpyDeviceToDevice, stream),
            cudaSuccess);
}

// run_split_k with 2 and 4 parts on Llama-3-8B's O and down shapes and a tiny one, odd row
// counts: every part against run() on the copied-out slices (its own contiguous problem) and a
// float64 reference on sampled outputs, a second call bit for bit, and the parts' sum against
// run()'s float32 product over the whole K.
void run_split_shapes(cudaDataType_t in) {
  Gpu gpu;
  LtGemm gemm;
  ASSERT_TRUE(gpu.init(&gemm).ok());
  const cuda::Dtype dt = in == CUDA_R_16BF ? cuda::Dtype::kBFloat16 : cuda::Dtype::kFloat16;
  const float tol = tolerance(CUDA_R_32F);
  uint64_t seed = 100;
  for (const Shape& s : {kShapes[1], kShapes[3], kShapes[5]}) {
    std::vector<DeviceBuffer> ws(2);
    std::vector<const void*> set;
    ASSERT_NO_FATAL_FAILURE(random_weights(gpu, dt, s, &seed, &ws, &set));
    const void* w = set.back();
    for (int64_t m : {1, 7, 50, 129}) {
      DeviceBuffer x, full;
      ASSERT_TRUE(x.reserve(size_t(m * s.k) * 2, "x").ok());
      ASSERT_TRUE(full.reserve(size_t(m * s.n) * 4, "full").ok());
      cuda::fill_random(dt, x.ptr, m * s.k, seed++, 1.0f, 0.0f, gpu.stream);
      Status st = gemm.run(x.ptr, w, full.ptr, m, s.n, s.k, in, CUDA_R_32F, gpu.stream, set);
      ASSERT_TRUE(st.ok()) << st.message();
      for (int32_t splits : {2, 4}) {
        SCOPED_TRACE(std::string(s.name) + " m=" + std::to_string(m) +
                     " splits=" + std::to_string(splits));
        const int64_t slice = s.k / splits;
        const size_t y_count = size_t(splits * m * s.n);
        DeviceBuffer y, y2, xs, wsl, ref;
        ASSERT_TRUE(y.reserve(y_count * 4, "y").ok());
        ASSERT_TRUE(y2.reserve(y_count * 4, "y2").ok());
        ASSERT_TRUE(xs.reserve(size_t(m * slice) * 2, "x slice").ok());
        ASSERT_TRUE(wsl.reserve(size_t(s.n * slice) * 2, "w slice").ok());
        ASSERT_TRUE(ref.reserve(size_t(m * s.n) * 4, "ref").ok());
        st = gemm.run_split_k(x.ptr, w, y.as<float>(), m, s.n, s.k, splits, in, gpu.stream, set);
        ASSERT_TRUE(st.ok()) << st.message();
        st = gemm.run_split_k(x.ptr, w, y2.as<float>(), m, s.n, s.k, splits, in, gpu.stream, set);
        ASSERT_TRUE(st.ok()) << st.message();
        ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
        EXPECT_TRUE(bytes_of(y.ptr, y_count * 4) == bytes_of(y2.ptr, y_count * 4))
            << "not bit-identical";
        const std::vector<float> parts = download(y.ptr, y_count, CUDA_R_32F);
        const std::vector<float> xh = download(x.ptr, size_t(m * s.k), in);

        // The parts summed in order against the whole product.
        std::vector<float> sum(size_t(m * s.n), 0.0f);
        for (int32_t p = 0; p < splits; ++p) {
          for (size_t i = 0; i < sum.size(); ++i) sum[i] += parts[size_t(p) * sum.size() + i];
        }
        EXPECT_LE(max_diff(sum, download(full.ptr, sum.size(), CUDA_R_32F)), tol)
            << "max |sum of parts - run() float32|";

        for (int32_t p = 0; p < splits; ++p) {
          copy_columns(x.ptr, m, s.k, p * slice, slice, xs.ptr, gpu.stream);
          copy_columns(w, s.n, s.k, p * slice, slice, wsl.ptr, gpu.stream);
          st = gemm.run(xs.ptr, wsl.ptr, ref.ptr, m, s.n, slice, in, CUDA_R_32F, gpu.stream);
          ASSERT_TRUE(st.ok()) << st.message();
          ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
          const std::vector<float> got(parts.begin() + ptrdiff_t(p) * m * s.n,
                                       parts.begin() + ptrdiff_t(p + 1) * m * s.n);
          EXPECT_LE(max_diff(got, download(ref.ptr, size_t(m * s.n), CUDA_R_32F)), tol)
              << "part " << p << ": max |part - run() on the slice|";
          // float64 dot products of the stored inputs over the slice, 16 sampled outputs.
          float worst = 0;
          uint64_t r = 777 + uint64_t(p);
          for (int sample = 0; sample < 16; ++sample) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            const int64_t row = int64_t((r >> 33) % uint64_t(m));
            const int64_t col = int64_t((r >> 13) % uint64_t(s.n));
            const std::vector<float> wrow = download(
                static_cast<const char*>(w) + (col * s.k + p * slice) * 2, size_t(slice), in);
            double dot = 0;
            for (int64_t i = 0; i < slice; ++i) {
              dot += double(xh[size_t(row * s.k + p * slice + i)]) * wrow[size_t(i)];
            }
            worst = std::max(worst, float(std::fabs(dot - got[size_t(row * s.n + col)])));
          }
          EXPECT_LE(worst, tol) << "part " << p << ": max |part - float64 reference|";
        }
      }
    }
  }
  for (const TunedGemm& t : LtGemm::tuned_shapes()) {
    EXPECT_FALSE(t.fallback) << "m=" << t.m_tuned << " n=" << t.n << " k=" << t.k
                             << " splits=" << t.splits;
  }
}

TEST(LtGemmSplitK, PartsMatchTheSlicedProblemFp16) {
  REQUIRE_GPU();
  run_split_shapes(CUDA_R_16F);
}

TEST(LtGemmSplitK, PartsMatchTheSlicedProblemBf16) {
  REQUIRE_GPU();
  run_split_shapes(CUDA_R_16BF);
}

// One part is run() with a float32 output, bit for bit and under the same cache entry.
TEST(LtGemmSplitK, OnePartIsRun) {
  REQUIRE_GPU();
  LtGemm::clear_cache();
  Gpu gpu;
  LtGemm g;
  ASSERT_TRUE(gpu.init(&g).ok());
  Problem p(gpu);
  DeviceBuffer a, b;
  ASSERT_TRUE(a.reserve(size_t(p.m * p.n) * 4, "a").ok());
  ASSERT_TRUE(b.reserve(size_t(p.m * p.n) * 4, "b").ok());
  ASSERT_TRUE(
      g.run(p.x.ptr, p.w.ptr, a.ptr, p.m, p.n, p.k, CUDA_R_16F, CUDA_R_32F, gpu.stream).ok());
  ASSERT_TRUE(
      g.run_split_k(p.x.ptr, p.w.ptr, b.as<float>(), p.m, p.n, p.k, 1, CUDA_R_16F, gpu.stream)
          .ok());
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
  EXPECT_TRUE(bytes_of(a.ptr, size_t(p.m * p.n) * 4) == bytes_of(b.ptr, size_t(p.m * p.n) * 4));
  const std::vector<TunedGemm> tuned = LtGemm::tuned_shapes();
  ASSERT_EQ(tuned.size(), 1u);
  EXPECT_EQ(tuned[0].splits, 1);
}

// tuned_time tunes a bucket once per split count (kept apart in the cache), returns its
// median, and inside a capture times nothing: -1 until an eager call has tuned the bucket.
TEST(LtGemmSplitK, TunedTimePerSplitCount) {
  REQUIRE_GPU();
  LtGemm::clear_cache();
  Gpu gpu;
  LtGemm g;
  ASSERT_TRUE(gpu.init(&g).ok());
  Problem p(gpu);
  DeviceBuffer parts;
  ASSERT_TRUE(parts.reserve(size_t(4 * p.m * p.n) * 4, "parts").ok());
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);

  float us = 0;
  ASSERT_EQ(cudaStreamBeginCapture(gpu.stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const Status in_capture = g.tuned_time(p.x.ptr, p.w.ptr, parts.ptr, p.m, p.n, p.k, 2, CUDA_R_16F,
                                         CUDA_R_32F, gpu.stream, {}, &us);
  const Status captured =
      g.run_split_k(p.x.ptr, p.w.ptr, parts.as<float>(), p.m, p.n, p.k, 2, CUDA_R_16F, gpu.stream);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(gpu.stream, &graph), cudaSuccess);
  ASSERT_TRUE(in_capture.ok()) << in_capture.message();
  ASSERT_TRUE(captured.ok()) << captured.message();
  EXPECT_EQ(us, -1.0f);
  EXPECT_TRUE(LtGemm::tuned_shapes().empty());
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, gpu.stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
  const std::vector<float> from_graph = download(parts.ptr, size_t(2 * p.m * p.n), CUDA_R_32F);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);

  float one = 0, two = 0, four = 0;
  ASSERT_TRUE(g.tuned_time(p.x.ptr, p.w.ptr, p.y.ptr, p.m, p.n, p.k, 1, CUDA_R_16F, CUDA_R_16F,
                           gpu.stream, {}, &one)
                  .ok());
  ASSERT_TRUE(g.tuned_time(p.x.ptr, p.w.ptr, parts.ptr, p.m, p.n, p.k, 2, CUDA_R_16F, CUDA_R_32F,
                           gpu.stream, {}, &two)
                  .ok());
  ASSERT_TRUE(g.tuned_time(p.x.ptr, p.w.ptr, parts.ptr, p.m, p.n, p.k, 4, CUDA_R_16F, CUDA_R_32F,
                           gpu.stream, {}, &four)
                  .ok());
  EXPECT_GT(one, 0.0f);
  EXPECT_GT(two, 0.0f);
  EXPECT_GT(four, 0.0f);
  std::vector<TunedGemm> tuned = LtGemm::tuned_shapes();
  ASSERT_EQ(tuned.size(), 3u);
  for (size_t i = 0; i < tuned.size(); ++i) {
    EXPECT_EQ(tuned[i].splits, int32_t(1) << i) << "sorted by split count within a shape";
    EXPECT_EQ(tuned[i].m_bucket, 64);
    EXPECT_EQ(tuned[i].out, i == 0 ? CUDA_R_16F : CUDA_R_32F);
  }
  // Cached: the same medians, nothing tuned again.
  float again = 0;
  ASSERT_TRUE(g.tuned_time(p.x.ptr, p.w.ptr, parts.ptr, p.m, p.n, p.k, 2, CUDA_R_16F, CUDA_R_32F,
                           gpu.stream, {}, &again)
                  .ok());
  EXPECT_EQ(again, two);
  ASSERT_TRUE(
      g.run_split_k(p.x.ptr, p.w.ptr, parts.as<float>(), p.m, p.n, p.k, 2, CUDA_R_16F, gpu.stream)
          .ok());
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
  EXPECT_EQ(LtGemm::tuned_shapes().size(), 3u);
  EXPECT_LE(max_diff(from_graph, download(parts.ptr, size_t(2 * p.m * p.n), CUDA_R_32F)),
            tolerance(CUDA_R_32F))
      << "the captured (heuristic) parts against the tuned ones";
}

// Autotune off: cublasGemmStridedBatchedEx over the slices, bit for bit; no time known.
TEST(LtGemmSplitK, AutotuneOffIsStridedBatchedGemmEx) {
  REQUIRE_GPU();
  Gpu gpu;
  LtGemm g;
  ASSERT_TRUE(gpu.init(&g, false).ok());
  Problem p(gpu, 7);
  const int64_t splits = 4, slice = p.k / splits, part = p.m * p.n;
  DeviceBuffer got, ref;
  ASSERT_TRUE(got.reserve(size_t(splits * part) * 4, "got").ok());
  ASSERT_TRUE(ref.reserve(size_t(splits * part) * 4, "ref").ok());
  ASSERT_TRUE(g.run_split_k(p.x.ptr, p.w.ptr, got.as<float>(), p.m, p.n, p.k, int32_t(splits),
                            CUDA_R_16F, gpu.stream)
                  .ok());
  const float alpha = 1.0f, beta = 0.0f;
  ASSERT_EQ(
      cublasGemmStridedBatchedEx(gpu.cublas, CUBLAS_OP_T, CUBLAS_OP_N, int(p.n), int(p.m),
                                 int(slice), &alpha, p.w.ptr, CUDA_R_16F, int(p.k), slice, p.x.ptr,
                                 CUDA_R_16F, int(p.k), slice, &beta, ref.ptr, CUDA_R_32F, int(p.n),
                                 part, int(splits), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
  EXPECT_TRUE(bytes_of(got.ptr, size_t(splits * part) * 4) ==
              bytes_of(ref.ptr, size_t(splits * part) * 4));
  float us = 0;
  ASSERT_TRUE(g.tuned_time(p.x.ptr, p.w.ptr, got.ptr, p.m, p.n, p.k, 2, CUDA_R_16F, CUDA_R_32F,
                           gpu.stream, {}, &us)
                  .ok());
  EXPECT_EQ(us, -1.0f);
}

// Argument checks come before any device work: this runs without a device too.
TEST(LtGemmSplitK, RejectsBadArguments) {
  LtGemm g;
  ASSERT_TRUE(g.init(0, nullptr, nullptr, 0, false).ok());
  float* y = nullptr;
  auto split = [&](int64_t k, int32_t splits, cudaDataType_t in = CUDA_R_16F) {
    return g.run_split_k(nullptr, nullptr, y, 50, 4096, k, splits, in, nullptr).code();
  };
  EXPECT_EQ(split(4096, 0), StatusCode::kInvalidArgument);
  EXPECT_EQ(split(4096, -2), StatusCode::kInvalidArgument);
  EXPECT_EQ(split(4096, 9), StatusCode::kInvalidArgument);
  EXPECT_EQ(split(4096, 3), StatusCode::kInvalidArgument) << "k % splits != 0";
  EXPECT_EQ(split(24, 2), StatusCode::kInvalidArgument) << "12-element (24-byte) slices";
  EXPECT_EQ(split(4104, 2), StatusCode::kInvalidArgument) << "2052-element slices";
  EXPECT_EQ(split(4096, 2, CUDA_R_32F), StatusCode::kInvalidArgument) << "float32 input";
  float us = 0;
  EXPECT_EQ(
      g.tuned_time(nullptr, nullptr, y, 50, 4096, 4096, 2, CUDA_R_16F, CUDA_R_16F, nullptr, {}, &us)
          .code(),
      StatusCode::kInvalidArgument)
      << "split parts are float32";
  EXPECT_EQ(us, -1.0f);
  EXPECT_EQ(
      g.tuned_time(nullptr, nullptr, y, 50, 4096, 4096, 9, CUDA_R_16F, CUDA_R_32F, nullptr, {}, &us)
          .code(),
      StatusCode::kInvalidArgument);
}

// The norm kernel's split-K sum: parts slabs summed in float32 in slab order, rounded to the
// model dtype once — bit for bit the one-slab call on the host's in-order sum, and within one
// rounding of the exact sum; for one-chunk and two-chunk rows (hidden <= / > 8192).
TEST(LtGemmSplitK, NormKernelSumsThePartsInOrder) {
  REQUIRE_GPU();
  Gpu gpu;
  for (cuda::Dtype dt : {cuda::Dtype::kFloat16, cuda::Dtype::kBFloat16}) {
    for (int64_t hidden : {256, 4096, 12288}) {
      SCOPED_TRACE("hidden " + std::to_string(hidden) +
                   (dt == cuda::Dtype::kFloat16 ? " fp16" : " bf16"));
      const int64_t rows = 7, n = rows * hidden;
      const int32_t parts = 4;
      std::vector<float> slabs(static_cast<size_t>(parts * n));
      std::vector<float> residual(static_cast<size_t>(n)), summed(static_cast<size_t>(n), 0.0f);
      uint64_t r = 99;
      auto uniform = [&r] {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        return float((r >> 40) & 0xffffff) / float(1 << 24) * 2.0f - 1.0f;
      };
      for (float& v : slabs) v = uniform();
      for (float& v : residual) v = 4.0f * uniform();
      for (int32_t p = 0; p < parts; ++p) {
        for (int64_t i = 0; i < n; ++i) summed[size_t(i)] += slabs[size_t(p * n + i)];
      }
      DeviceBuffer d_slabs, d_sum, res_a, res_b, weight, out_a, out_b;
      ASSERT_TRUE(d_slabs.reserve(slabs.size() * 4, "slabs").ok());
      ASSERT_TRUE(d_sum.reserve(summed.size() * 4, "sum").ok());
      ASSERT_TRUE(res_a.reserve(size_t(n) * 4, "residual").ok());
      ASSERT_TRUE(res_b.reserve(size_t(n) * 4, "residual").ok());
      ASSERT_TRUE(weight.reserve(size_t(hidden) * 2, "weight").ok());
      ASSERT_TRUE(out_a.reserve(size_t(n) * 2, "out").ok());
      ASSERT_TRUE(out_b.reserve(size_t(n) * 2, "out").ok());
      ASSERT_EQ(cudaMemcpy(d_slabs.ptr, slabs.data(), slabs.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d_sum.ptr, summed.data(), summed.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      for (DeviceBuffer* b : {&res_a, &res_b}) {
        ASSERT_EQ(cudaMemcpy(b->ptr, residual.data(), residual.size() * 4, cudaMemcpyHostToDevice),
                  cudaSuccess);
      }
      cuda::fill_random(dt, weight.ptr, hidden, 3, 0.5f, 1.0f, gpu.stream);
      cuda::add_rms_norm_f32_delta(dt, res_a.as<float>(), d_slabs.as<float>(), parts, n, weight.ptr,
                                   1e-5f, rows, hidden, out_a.ptr, gpu.stream);
      cuda::add_rms_norm_f32_delta(dt, res_b.as<float>(), d_sum.as<float>(), 1, 0, weight.ptr,
                                   1e-5f, rows, hidden, out_b.ptr, gpu.stream);
      ASSERT_EQ(cudaStreamSynchronize(gpu.stream), cudaSuccess);
      EXPECT_TRUE(bytes_of(res_a.ptr, size_t(n) * 4) == bytes_of(res_b.ptr, size_t(n) * 4));
      EXPECT_TRUE(bytes_of(out_a.ptr, size_t(n) * 2) == bytes_of(out_b.ptr, size_t(n) * 2));
      // One rounding to the dtype: relative 2^-8 (bf16; fp16 2^-11), and the float adds.
      const std::vector<float> after = download(res_a.ptr, size_t(n), CUDA_R_32F);
      float worst = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float added = after[size_t(i)] - residual[size_t(i)];
        const float slack = std::fabs(summed[size_t(i)]) * 0x1p-8f +
                            std::fabs(residual[size_t(i)]) * 0x1p-22f + 1e-7f;
        worst = std::max(worst, std::fabs(added - summed[size_t(i)]) / slack);
      }
      EXPECT_LE(worst, 1.0f) << "worst error / allowed";
    }
  }
}

}  // namespace
}  // namespace treeserve
