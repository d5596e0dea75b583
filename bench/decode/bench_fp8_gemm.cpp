// FP8 GEMMs at decode row counts on the GPU: the engine's own kernel (cuda_fp8.h
// fp8_gemm_rows, at each split count) against cublasLt's vector-scaled FP8 matmul as the tuner
// chooses it (LtGemm::run_fp8), and fp16 cublasLt as tuned, on Llama-3-8B's four linear
// shapes. Each call reads the next of enough copies of the weights that none is in L2.
//
//   bench_fp8_gemm [--rows 16,32,50,64,100,128,129,257] [--reps 20]
//
// Prints per shape and row count the median microseconds of one call and the weight bytes
// read per second (e4m3: one byte an element; fp16: two), and the device's copy bandwidth.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "bench/tree_attention/bench_util.h"
#include "engine/cuda_fp8.h"
#include "engine/detail/cuda_gemm.h"

namespace {

using treeserve::detail::LtGemm;

constexpr size_t kL2Flush = size_t(400) << 20;  // copies of a matrix span at least this

// Median microseconds of `reps` calls of f(i) (i: the call's index), each between two events,
// enqueued back to back (bench::Timer waits on each call, which would add the host's launch
// latency to these 10-100 us kernels).
template <typename F>
float median_us(cudaStream_t s, int reps, F&& f) {
  std::vector<cudaEvent_t> ev(size_t(reps) + 1);
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  f(0);
  CHECK_CUDA(cudaEventRecord(ev[0], s));
  for (int r = 0; r < reps; ++r) {
    f(r + 1);
    CHECK_CUDA(cudaEventRecord(ev[size_t(r) + 1], s));
  }
  CHECK_CUDA(cudaEventSynchronize(ev.back()));
  std::vector<float> ms(static_cast<size_t>(reps));
  for (int r = 0; r < reps; ++r)
    CHECK_CUDA(cudaEventElapsedTime(&ms[size_t(r)], ev[size_t(r)], ev[size_t(r) + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::nth_element(ms.begin(), ms.begin() + reps / 2, ms.end());
  return ms[size_t(reps) / 2] * 1e3f;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> rows = {16, 32, 50, 64, 100, 128, 129, 257};
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--rows" && i + 1 < argc) {
      rows.clear();
      std::stringstream ss(argv[++i]);
      std::string tok;
      while (std::getline(ss, tok, ',')) rows.push_back(std::stoll(tok));
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: bench_fp8_gemm [--rows 16,32,50,64,100,128,129,257] [--reps 20]\n");
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("bench_fp8_gemm: no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreate(&s));
  cublasHandle_t cublas;
  if (cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS) return 1;
  cublasSetStream(cublas, s);
  const size_t ws_bytes = size_t(64) << 20;
  void* ws = nullptr;
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  cublasSetWorkspace(cublas, ws, ws_bytes);
  LtGemm lt;
  if (!lt.init(0, cublas, ws, ws_bytes, true).ok()) return 1;
  const double bw = treeserve::bench::copy_bandwidth();
  std::printf("device: %s, copy bandwidth %.2f TB/s\n", prop.name, bw / 1e12);
  std::printf("%6s %6s %5s | %8s %6s | %8s %6s | own kernel us (TB/s) at K ranges 1 2 4 8\n", "n",
              "k", "m", "fp16 us", "TB/s", "lt8 us", "TB/s");
  const int64_t shapes[4][2] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
  for (const auto& sh : shapes) {
    const int64_t n = sh[0], k = sh[1];
    const size_t w8 = size_t(n * k);
    const int copies = int(std::max<size_t>(2, kL2Flush / w8 + 1));
    uint8_t* w = nullptr;
    CHECK_CUDA(cudaMalloc(&w, w8 * size_t(copies) * 2));  // fp16 copies reuse the same bytes
    CHECK_CUDA(cudaMemset(w, 0x11, w8 * size_t(copies) * 2));
    float* ws_scale = nullptr;
    CHECK_CUDA(cudaMalloc(&ws_scale, size_t(n) * 4));
    std::vector<float> ones(size_t(std::max<int64_t>(n, 256)), 1.0f);
    CHECK_CUDA(cudaMemcpy(ws_scale, ones.data(), size_t(n) * 4, cudaMemcpyHostToDevice));
    for (int64_t m : rows) {
      uint8_t* x = nullptr;
      float* xs = nullptr;
      void* y = nullptr;
      CHECK_CUDA(cudaMalloc(&x, size_t(m * k) * 2));
      CHECK_CUDA(cudaMemset(x, 0x22, size_t(m * k) * 2));
      CHECK_CUDA(cudaMalloc(&xs, size_t(m) * 4));
      CHECK_CUDA(cudaMemcpy(xs, ones.data(), size_t(m) * 4, cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMalloc(&y, size_t(m * n) * 4));
      std::vector<const void*> w16s, w8s;
      for (int c = 0; c < copies; ++c) {
        w16s.push_back(w + size_t(c) * w8 * 2);
        w8s.push_back(w + size_t(c) * w8);
      }
      // Half the copies' bytes as fp16 matrices (each twice as large).
      const int c16 = std::max(2, copies / 2);
      const float f16 = median_us(s, reps, [&](int i) {
        (void)lt.run(x, w16s[size_t(i % c16)], y, m, n, k, CUDA_R_16F, CUDA_R_16F, s, w16s);
      });
      const float l8 = median_us(s, reps, [&](int i) {
        (void)lt.run_fp8(x, xs, w8s[size_t(i % copies)], ws_scale, y, m, n, k, CUDA_R_16F, s, w8s);
      });
      std::printf("%6lld %6lld %5lld | %8.1f %6.2f | %8.1f %6.2f |", (long long)n, (long long)k,
                  (long long)m, f16, 2.0 * double(w8) / (f16 * 1e-6) / 1e12, l8,
                  double(w8) / (l8 * 1e-6) / 1e12);
      for (int sp : {1, 2, 4, 8}) {
        if (sp > k / 128) continue;
        const float own = median_us(s, reps, [&](int i) {
          CHECK_CUDA(treeserve::cuda::fp8_gemm_rows(
              x, xs, static_cast<const uint8_t*>(w8s[size_t(i % copies)]), ws_scale, y,
              treeserve::cuda::Fp8Out::kFloat16, m, n, k, sp, s));
        });
        std::printf(" %6.1f (%4.2f)", own, double(w8) / (own * 1e-6) / 1e12);
      }
      std::printf("\n");
      cudaFree(x);
      cudaFree(xs);
      cudaFree(y);
    }
    cudaFree(w);
    cudaFree(ws_scale);
  }
  std::printf(
      "(lt8: cublasLt FP8 as LtGemm::run_fp8 tunes it, which may itself pick the own kernel)\n");
  return 0;
}
