// bench_tokenizer: encode and decode throughput of a tokenizer.json on one core (Google
// Benchmark), per corpus. Encode runs with the per-word cache (as the server does) and
// without it (the baseline in the same binary: every word through the BPE merges); decode is
// the plain decode and the streaming detokenizer, one token at a time.
//
//   bench_tokenizer --tokenizer PATH/tokenizer.json --corpus NAME=FILE [--corpus ...]
//                   [Google Benchmark flags]
//
// A corpus file is encoded as one text per line (JSON lines of strings when the name ends in
// .jsonl, else plain lines). bench/tokenizer/run.sh builds Llama 3's tokenizer.json (from
// tests/tokenizer_ref) and runs this over prose, code and the multilingual test strings.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/detail/tokenizer_backend.h"
#include "models/detokenizer.h"
#include "models/tokenizer.h"

namespace treeserve {
namespace {

struct Corpus {
  std::string name;
  std::vector<std::string> texts;
  size_t bytes = 0;
};

std::unique_ptr<detail::TokenizerBackend> g_backend;  // encode with the cache switchable
std::unique_ptr<Tokenizer> g_tokenizer;               // decode and streaming
std::vector<Corpus> g_corpora;

bool ends_with(const std::string& s, const char* suffix) {
  const size_t n = std::char_traits<char>::length(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

bool read_corpus(const std::string& spec, Corpus* corpus) {
  const size_t eq = spec.find('=');
  if (eq == std::string::npos) return false;
  corpus->name = spec.substr(0, eq);
  const std::string file = spec.substr(eq + 1);
  std::ifstream in(file, std::ios::binary);
  if (!in) return false;
  std::string line;
  while (std::getline(in, line)) {
    std::string text = line;
    if (ends_with(file, ".jsonl")) {
      text = nlohmann::json::parse(line).get<std::string>();
    } else {
      text += "\n";
    }
    corpus->bytes += text.size();
    corpus->texts.push_back(std::move(text));
  }
  return !corpus->texts.empty();
}

void encode_loop(benchmark::State& state, const Corpus& corpus, bool cache) {
  g_backend->set_word_cache(cache);
  size_t tokens = 0;
  for (auto _ : state) {
    tokens = 0;
    for (const std::string& text : corpus.texts) {
      auto ids = g_backend->encode(text);
      if (!ids.ok()) {
        state.SkipWithError(ids.status().message().c_str());
        return;
      }
      tokens += ids->size();
      benchmark::DoNotOptimize(ids->data());
    }
  }
  g_backend->set_word_cache(true);
  state.counters["tokens/s"] =
      benchmark::Counter(double(tokens), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["MB/s"] =
      benchmark::Counter(double(corpus.bytes) / 1e6, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes/token"] = double(corpus.bytes) / double(std::max<size_t>(tokens, 1));
}

std::vector<std::vector<int32_t>> encode_all(const Corpus& corpus, size_t* tokens) {
  std::vector<std::vector<int32_t>> all;
  *tokens = 0;
  for (const std::string& text : corpus.texts) {
    all.push_back(g_tokenizer->encode(text).value());
    *tokens += all.back().size();
  }
  return all;
}

void decode_loop(benchmark::State& state, const Corpus& corpus) {
  size_t tokens = 0;
  const auto all = encode_all(corpus, &tokens);
  for (auto _ : state) {
    for (const auto& ids : all) benchmark::DoNotOptimize(g_tokenizer->decode(ids).value().data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(double(tokens), benchmark::Counter::kIsIterationInvariantRate);
}

void stream_loop(benchmark::State& state, const Corpus& corpus) {
  size_t tokens = 0;
  const auto all = encode_all(corpus, &tokens);
  const DetokenizerVocab vocab(*g_tokenizer);
  for (auto _ : state) {
    for (const auto& ids : all) {
      IncrementalDetokenizer detok(*g_tokenizer, &vocab);
      for (int32_t id : ids) benchmark::DoNotOptimize(detok.push(id).value().data());
    }
  }
  state.counters["tokens/s"] =
      benchmark::Counter(double(tokens), benchmark::Counter::kIsIterationInvariantRate);
}

int run(int argc, char** argv) {
  std::string tokenizer_file;
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--tokenizer" || arg == "--corpus") && i + 1 < argc) {
      const std::string value = argv[++i];
      if (arg == "--tokenizer") {
        tokenizer_file = value;
      } else {
        Corpus corpus;
        if (!read_corpus(value, &corpus)) {
          std::fprintf(stderr, "--corpus %s: expected NAME=FILE of non-empty text\n",
                       value.c_str());
          return 2;
        }
        g_corpora.push_back(std::move(corpus));
      }
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (tokenizer_file.empty() || g_corpora.empty()) {
    std::fprintf(stderr,
                 "usage: bench_tokenizer --tokenizer tokenizer.json --corpus NAME=FILE ...\n");
    return 2;
  }
  auto backend = detail::load_tokenizer_json(tokenizer_file);
  auto tokenizer = Tokenizer::load(tokenizer_file);
  if (!backend.ok() || !tokenizer.ok()) {
    std::fprintf(stderr, "%s\n",
                 (backend.ok() ? tokenizer.status() : backend.status()).ToString().c_str());
    return 1;
  }
  g_backend = std::move(*backend);
  g_tokenizer = std::move(*tokenizer);
  for (const Corpus& c : g_corpora) {
    benchmark::RegisterBenchmark(("encode/" + c.name + "/cache").c_str(), encode_loop, c, true)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("encode/" + c.name + "/no_cache").c_str(), encode_loop, c, false)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("decode/" + c.name).c_str(), decode_loop, c)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("stream/" + c.name).c_str(), stream_loop, c)
        ->Unit(benchmark::kMillisecond);
  }
  int bench_argc = int(rest.size());
  benchmark::Initialize(&bench_argc, rest.data());
  benchmark::AddCustomContext("tokenizer", g_tokenizer->description());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace
}  // namespace treeserve

int main(int argc, char** argv) { return treeserve::run(argc, argv); }
