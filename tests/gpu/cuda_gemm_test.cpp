// LtGemm (engine/detail/cuda_gemm.h), the autotuned cublasLt GEMM, against cublasGemmEx (the
// backend's previous call) and a float64 CPU reference on sampled outputs: Llama-3-8B's
// decode shapes (fused QKV, O, fused gate/up, down, LM head) at 1, 7, 50 and 257 rows and a
// tiny shape, fp16 and bf16 in, model-dtype and float32 out. Also: a shape's calls are bit
// identical, a second instance takes the cached algorithm, rows of one bucket share a tuning,
// nothing is tuned inside a graph capture, and autotune off is exactly cublasGemmEx.
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

namespace treeserve {
namespace {

using detail::DeviceBuffer;
using detail::LtGemm;
using detail::TunedGemm;

#define REQUIRE_GPU()                                                                 \
  do {                                                                                \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU test skipped"; \
  } while (0)

constexpr size_t kWorkspaceBytes = 32 << 20;

// A stream, a cuBLAS handle on it and the workspace both libraries share (as the backend).
struct Gpu {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  DeviceBuffer workspace;
  Gpu() {
    EXPECT_EQ(cudaSetDevice(0), cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cublasCreate(&cublas), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cublasSetStream(cublas, stream), CUBLAS_STATUS_SUCCESS);
    EXPECT_TRUE(workspace.reserve(kWorkspaceBytes, "workspace").ok());
    EXPECT_EQ(cublasSetWorkspace(cublas, workspace.ptr, kWorkspaceBytes), CUBLAS_STATUS_SUCCESS);
  }
  ~Gpu() {
    cudaStreamSynchronize(stream);
    cublasDestroy(cublas);
    cudaStreamDestroy(stream);
  }
  Status init(LtGemm* g, bool autotune = true) {
    return g->init(0, cublas, workspace.ptr, kWorkspaceBytes, autotune);
  }
};

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
    const int sets = s.lm_head ? 1 : 2;
    std::vector<DeviceBuffer> ws(static_cast<size_t>(sets));
    std::vector<const void*> set;
    for (DeviceBuffer& w : ws) {
      ASSERT_TRUE(w.reserve(size_t(s.n * s.k) * 2, "w").ok());
      cuda::fill_random(dt, w.ptr, s.n * s.k, seed++, float(1.0 / std::sqrt(double(s.k))), 0.0f,
                        gpu.stream);
      set.push_back(w.ptr);
    }
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

}  // namespace
}  // namespace treeserve
