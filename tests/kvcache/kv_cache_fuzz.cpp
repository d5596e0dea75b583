// Fuzz target for KvCache: the bytes drive the operation interpreter of kv_cache_model.h
// (config, then operations, then a drain); any broken property aborts with its message.
//
// Built two ways (see CMakeLists.txt and README.md): with clang as a libFuzzer binary
// (kv_cache_fuzz), and with any compiler as a plain replay driver (kv_cache_fuzz_replay)
// whose main() runs a fixed corpus of pseudo-random inputs, or the files named on its
// command line (to replay a crash libFuzzer saved).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "tests/kvcache/kv_cache_model.h"

namespace {

constexpr int64_t kMaxOps = 4000;

int run_one(const uint8_t* data, size_t size) {
  const std::string err = treeserve::testing::run_kv_cache_program({data, size}, kMaxOps);
  if (!err.empty()) {
    std::fprintf(stderr, "kv_cache_fuzz: %s\n", err.c_str());
    std::abort();
  }
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return run_one(data, size);
}

#ifndef TREESERVE_LIBFUZZER
// Replay: kv_cache_fuzz_replay [FILE...]; with no files, kCorpus inputs from a fixed seed
// (160 in optimized builds, 40 in Debug / sanitizer builds).
int main(int argc, char** argv) {
  if (argc > 1) {
    for (int i = 1; i < argc; ++i) {
      std::ifstream in(argv[i], std::ios::binary);
      if (!in) {
        std::fprintf(stderr, "cannot read %s\n", argv[i]);
        return 2;
      }
      const std::vector<uint8_t> bytes{std::istreambuf_iterator<char>(in), {}};
      run_one(bytes.data(), bytes.size());
    }
    std::printf("replayed %d inputs\n", argc - 1);
    return 0;
  }
  constexpr int kCorpus = 40 * treeserve::testing::kProgramScale;
  std::mt19937 rng(20261123);
  for (int i = 0; i < kCorpus; ++i) {
    std::vector<uint8_t> bytes(rng() % 3000);
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
    run_one(bytes.data(), bytes.size());
  }
  std::printf("replayed %d pseudo-random inputs\n", kCorpus);
  return 0;
}
#endif
