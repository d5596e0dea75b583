// treeserve_logits: runs one prompt (token ids) through a backend the way the scheduler does
// (KvCache slots and attention views -> StepBatch -> Backend::forward) and writes, as JSON,
// the logits of the prompt's last position (the first generated token's distribution) and a
// greedy continuation. For comparisons with Hugging Face transformers
// (tests/hf_compare/hf_compare.py) and the golden-data check of tests/tools/.
//
//   treeserve_logits --model DIR --ids 1,2,3 | --ids-file FILE [--backend cpu|cuda]
//                    [--dtype auto|fp16|bf16] [--quantization auto|none|fp8] [--greedy N]
//                    [--kv-cache-dtype auto|fp8] [--vocab-limit N] [--chunk N]
//                    [--branches FILE] [--random-weights SEED] [--threads N] --out FILE
//
// --quantization is the server's (model.quantization): auto serves an FP8 checkpoint as FP8
// and a 16-bit one as it is; fp8 quantizes a 16-bit checkpoint's linear layers at load.
// --kv-cache-dtype is the server's too (kv_cache.dtype): fp8 (alias fp8_e4m3) keeps K and V
// in e4m3 with a float32 scale per token and kv head (emulated by the CPU backend).
//
// --chunk N prefills the prompt in steps of N tokens, as the scheduler does with
// max_step_tokens (0: the whole prompt in one step). --branches FILE (a JSON list of token-id
// lists) forks the prefilled prompt once per list, appends each list to its branch and runs
// all of them in one step, as a decoding tree does: "branch_logits" holds each branch's
// logits after its last token, for a comparison with each sequence run alone.
//
// Greedy steps take the full logits and pick the token as the scheduler's sampler does at
// temperature 0 (argmax, ties to the lowest id, over the first vocab-limit ids); on the CUDA
// backend each step is also run a second time asking for the device argmax only
// (full_logits = false, the scheduler's greedy fast path), reported as device_argmax.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/sampling.h"
#ifdef TREESERVE_HAVE_CUDA
#include "engine/cuda_backend.h"
#endif
#include "kvcache/kv_cache.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/quantization.h"
#include "models/safetensors.h"

namespace treeserve {
namespace {

struct Args {
  std::string model;
  std::string ids;
  std::string ids_file;
  std::string backend = "cpu";
  std::string dtype = "auto";
  std::string quantization = "auto";
  std::string kv_cache_dtype = "auto";
  int32_t greedy = 16;
  int64_t vocab_limit = 0;
  int64_t random_weights = -1;
  int32_t threads = 0;
  int32_t page_size = 16;
  int32_t chunk = 0;
  bool gemm_autotune = true;
  int32_t tensor_parallel = 1;
  std::string branches_file;
  std::string out;
};

// "1, 2,3" or "[1, 2, 3]" or whitespace-separated: every integer in the text, in order.
StatusOr<std::vector<int32_t>> parse_ids(const std::string& text, const std::string& source) {
  std::string cleaned = text;
  for (char& c : cleaned) {
    if (c == ',' || c == '[' || c == ']' || c == '\n' || c == '\t' || c == '\r') c = ' ';
  }
  std::istringstream in(cleaned);
  std::vector<int32_t> ids;
  std::string word;
  while (in >> word) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != word.size() || v < INT32_MIN || v > INT32_MAX) {
      return InvalidArgument(source + ": '" + word + "' is not a token id");
    }
    ids.push_back(int32_t(v));
  }
  if (ids.empty()) return InvalidArgument(source + ": no token ids");
  return ids;
}

StatusOr<std::vector<int32_t>> read_ids(const Args& a) {
  if (a.ids.empty() == a.ids_file.empty()) {
    return InvalidArgument("give the prompt as exactly one of --ids or --ids-file");
  }
  if (!a.ids.empty()) return parse_ids(a.ids, "--ids");
  std::ifstream in(a.ids_file);
  if (!in) return NotFound("--ids-file " + a.ids_file + " cannot be opened");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_ids(ss.str(), a.ids_file);
}

// --branches FILE: a JSON list of non-empty token-id lists.
StatusOr<std::vector<std::vector<int32_t>>> read_branches(const std::string& path) {
  std::vector<std::vector<int32_t>> branches;
  if (path.empty()) return branches;
  std::ifstream in(path);
  if (!in) return NotFound("--branches " + path + " cannot be opened");
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (!j.is_array() || j.empty()) {
    return InvalidArgument("--branches " + path + ": expected a non-empty JSON list of id lists");
  }
  for (size_t b = 0; b < j.size(); ++b) {
    if (!j[b].is_array() || j[b].empty()) {
      return InvalidArgument("--branches " + path + ": entry " + std::to_string(b) +
                             " is not a non-empty list of token ids");
    }
    std::vector<int32_t> ids;
    for (const auto& v : j[b]) {
      if (!v.is_number_integer()) {
        return InvalidArgument("--branches " + path + ": entry " + std::to_string(b) +
                               " holds a value that is not a token id");
      }
      ids.push_back(v.get<int32_t>());
    }
    branches.push_back(std::move(ids));
  }
  return branches;
}

StatusOr<std::unique_ptr<Backend>> make_backend(const Args& a, const ModelConfig& config,
                                                int64_t num_pages, bool kv_cache_fp8) {
  std::unique_ptr<LlamaWeights> weights;
  if (a.random_weights < 0) {
    StatusOr<SafetensorsReader> reader = SafetensorsReader::open_dir(a.model);
    if (!reader.ok()) return reader.status();
    StatusOr<LlamaWeights> w = load_llama_weights(config, *reader);
    if (!w.ok()) return w.status();
    weights = std::make_unique<LlamaWeights>(std::move(w).value());
  }
  const uint64_t seed = uint64_t(a.random_weights);
  if (a.backend == "cuda") {
#ifdef TREESERVE_HAVE_CUDA
    CudaBackendOptions o;
    o.num_pages = num_pages;
    o.page_size = a.page_size;
    o.bfloat16 = a.dtype == "bf16" || (a.dtype == "auto" && config.torch_dtype == "bfloat16");
    o.gemm_autotune = a.gemm_autotune;
    o.tensor_parallel = a.tensor_parallel;
    o.kv_cache_fp8 = kv_cache_fp8;
    return weights ? create_cuda_backend(config, *weights, o)
                   : create_cuda_backend_random(config, o, seed);
#else
    return Unavailable("--backend cuda: this build has no CUDA support");
#endif
  }
  CpuBackendOptions o;
  o.num_pages = num_pages;
  o.page_size = a.page_size;
  o.num_threads = a.threads;
  o.kv_cache_fp8 = kv_cache_fp8;
  return weights ? create_cpu_backend(config, *weights, o)
                 : create_cpu_backend_random(config, o, seed);
}

// One sequence through the backend: the prompt as one prefill step, then greedy decode steps.
class Runner {
 public:
  Runner(Backend* backend, KvCache* kv, int64_t vocab_limit)
      : backend_(backend), kv_(kv), vocab_limit_(vocab_limit) {}

  // *device_argmax (when not null, CUDA) gets the backend's own argmax of the same step, run a
  // second time with full_logits = false (-1 when the backend returns none). chunk > 0 runs
  // the prompt in steps of at most `chunk` tokens, logits after the last one only.
  Status prefill(const std::vector<int32_t>& prompt, int32_t chunk, Logits* out,
                 int32_t* device_argmax) {
    const int32_t n = int32_t(prompt.size());
    const int32_t step = chunk > 0 ? std::min(chunk, n) : n;
    StatusOr<NewBranch> b = kv_->create_branch(std::span<const int32_t>(prompt.data(), step));
    if (!b.ok()) return b.status();
    branch_ = b->id;
    length_ = step;
    std::vector<int32_t> rows(prompt.begin() + b->cached_tokens, prompt.begin() + step);
    if (step == n) return run(rows, b->slots, out, device_argmax);
    TS_RETURN_IF_ERROR(run(rows, b->slots, nullptr, nullptr));
    for (int32_t begin = step; begin < n; begin += step) {
      const int32_t end = std::min(n, begin + step);
      std::vector<int32_t> piece(prompt.begin() + begin, prompt.begin() + end);
      std::vector<KvSlot> slots;
      TS_RETURN_IF_ERROR(kv_->append(branch_, piece, &slots));
      length_ = end;
      const bool last = end == n;
      TS_RETURN_IF_ERROR(run(piece, slots, last ? out : nullptr, last ? device_argmax : nullptr));
    }
    return Status::Ok();
  }

  // Forks the prefilled sequence once per suffix, appends each suffix to its branch and runs
  // every branch's tokens in one step; out's row b holds branch b's logits after its last
  // token. The prefilled branch is left as it was.
  Status branches(const std::vector<std::vector<int32_t>>& suffixes, Logits* out) {
    StatusOr<ForkResult> fork = kv_->fork(branch_, int32_t(suffixes.size()));
    if (!fork.ok()) return fork.status();
    const int32_t page_size = kv_->page_size();
    batch_.clear();
    for (const PageCopy& c : fork->copies) {
      batch_.page_copies.push_back({c.src_page, c.dst_page, c.num_slots});
    }
    std::vector<ViewQuery> queries;
    for (size_t b = 0; b < suffixes.size(); ++b) {
      std::vector<KvSlot> slots;
      TS_RETURN_IF_ERROR(kv_->append(fork->branches[b], suffixes[b], &slots));
      const int32_t n = int32_t(suffixes[b].size());
      for (int32_t i = 0; i < n; ++i) {
        batch_.token_ids.push_back(suffixes[b][size_t(i)]);
        batch_.positions.push_back(length_ + i);
        batch_.kv_slots.push_back(int64_t(slots[size_t(i)].page) * page_size +
                                  slots[size_t(i)].slot);
      }
      batch_.logit_rows.push_back(batch_.num_rows() - 1);
      queries.push_back({fork->branches[b], n});
    }
    batch_.vocab_limit = vocab_limit_;
    TS_RETURN_IF_ERROR(kv_->build_attention_view(queries, &batch_.view));
    batch_.full_logits = true;
    return backend_->forward(batch_, out);
  }

  // Appends `token` and runs it.
  Status decode(int32_t token, Logits* out, int32_t* device_argmax) {
    std::vector<KvSlot> slots;
    TS_RETURN_IF_ERROR(kv_->append(branch_, std::vector<int32_t>{token}, &slots));
    ++length_;
    return run(std::vector<int32_t>{token}, slots, out, device_argmax);
  }

 private:
  // out == nullptr: a prefill chunk before the last, no logits wanted.
  Status run(const std::vector<int32_t>& tokens, const std::vector<KvSlot>& slots, Logits* out,
             int32_t* device_argmax) {
    const int32_t page_size = kv_->page_size();
    batch_.clear();
    const int32_t n = int32_t(tokens.size());
    for (int32_t i = 0; i < n; ++i) {
      batch_.token_ids.push_back(tokens[size_t(i)]);
      batch_.positions.push_back(length_ - n + i);
      batch_.kv_slots.push_back(int64_t(slots[size_t(i)].page) * page_size + slots[size_t(i)].slot);
    }
    if (out != nullptr) batch_.logit_rows.push_back(n - 1);
    batch_.vocab_limit = vocab_limit_;
    const ViewQuery query{branch_, n};
    TS_RETURN_IF_ERROR(
        kv_->build_attention_view(std::span<const ViewQuery>(&query, 1), &batch_.view));
    batch_.full_logits = true;
    Logits unused;
    TS_RETURN_IF_ERROR(backend_->forward(batch_, out != nullptr ? out : &unused));
    if (device_argmax != nullptr) {
      // The same rows again (the same K/V rewritten at the same slots), argmax only.
      batch_.full_logits = false;
      Logits argmax_only;
      TS_RETURN_IF_ERROR(backend_->forward(batch_, &argmax_only));
      *device_argmax = argmax_only.argmax.empty() ? -1 : argmax_only.argmax[0];
    }
    return Status::Ok();
  }

  Backend* backend_;
  KvCache* kv_;
  int64_t vocab_limit_;
  BranchId branch_ = 0;
  int32_t length_ = 0;
  StepBatch batch_;
};

// The top two of the first `vocab` logits: (id, logit) each.
std::pair<SamplingCandidate, SamplingCandidate> top2(const float* row, int64_t vocab) {
  SamplingCandidate a{row[0], 0}, b{-INFINITY, -1};
  for (int32_t i = 1; i < int32_t(vocab); ++i) {
    if (row[i] > a.logit) {
      b = a;
      a = {row[i], i};
    } else if (row[i] > b.logit) {
      b = {row[i], i};
    }
  }
  return {a, b};
}

Status run(const Args& a) {
  if (a.backend != "cpu" && a.backend != "cuda") {
    return InvalidArgument("--backend must be cpu or cuda, got '" + a.backend + "'");
  }
  if (a.dtype != "auto" && a.dtype != "fp16" && a.dtype != "bf16") {
    return InvalidArgument("--dtype must be auto, fp16 or bf16, got '" + a.dtype + "'");
  }
  if (a.greedy < 0) return InvalidArgument("--greedy must be >= 0");
  if (a.chunk < 0) return InvalidArgument("--chunk must be >= 0");
  if (a.out.empty()) return InvalidArgument("--out FILE is required");
  StatusOr<ModelConfig> config = load_model_config(a.model);
  if (!config.ok()) return config.status();
  TS_RETURN_IF_ERROR(apply_quantization_option(a.quantization, "--quantization", &*config));
  StatusOr<KvCacheDtype> kv_dtype = parse_kv_cache_dtype(a.kv_cache_dtype, "--kv-cache-dtype");
  if (!kv_dtype.ok()) return kv_dtype.status();
  const bool kv_fp8 = *kv_dtype == KvCacheDtype::kFp8E4m3;
  StatusOr<std::vector<int32_t>> prompt = read_ids(a);
  if (!prompt.ok()) return prompt.status();
  const int64_t vocab = config->vocab_size;
  if (a.vocab_limit < 0 || a.vocab_limit > vocab) {
    return InvalidArgument("--vocab-limit " + std::to_string(a.vocab_limit) + " is outside [0, " +
                           std::to_string(vocab) + "] (0 = the model's vocab_size)");
  }
  const int64_t limit = a.vocab_limit > 0 ? a.vocab_limit : vocab;
  for (size_t i = 0; i < prompt->size(); ++i) {
    if ((*prompt)[i] < 0 || (*prompt)[i] >= vocab) {
      return InvalidArgument("prompt id [" + std::to_string(i) +
                             "] = " + std::to_string((*prompt)[i]) +
                             " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  StatusOr<std::vector<std::vector<int32_t>>> branches = read_branches(a.branches_file);
  if (!branches.ok()) return branches.status();
  int64_t longest_branch = 0, branch_pages = 0;
  for (const auto& b : *branches) {
    for (int32_t id : b) {
      if (id < 0 || id >= vocab) {
        return InvalidArgument("--branches: token id " + std::to_string(id) +
                               " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
      }
    }
    longest_branch = std::max<int64_t>(longest_branch, int64_t(b.size()));
    branch_pages += (int64_t(b.size()) + a.page_size - 1) / a.page_size + 1;
  }
  const int64_t tokens = int64_t(prompt->size()) + std::max<int64_t>(a.greedy, longest_branch);
  if (config->max_position_embeddings > 0 && tokens > config->max_position_embeddings) {
    return InvalidArgument("prompt + --greedy = " + std::to_string(tokens) +
                           " tokens is past the model's max_position_embeddings (" +
                           std::to_string(config->max_position_embeddings) + ")");
  }
  const int64_t num_pages = (tokens + a.page_size - 1) / a.page_size + 2 + branch_pages;

  const auto t0 = std::chrono::steady_clock::now();
  StatusOr<std::unique_ptr<Backend>> backend = make_backend(a, *config, num_pages, kv_fp8);
  if (!backend.ok()) return backend.status();
  const auto t1 = std::chrono::steady_clock::now();
  KvCacheConfig kc;
  kc.page_size = a.page_size;
  kc.num_pages = int32_t(num_pages);
  StatusOr<std::unique_ptr<KvCache>> kv = KvCache::create(kc);
  if (!kv.ok()) return kv.status();

  Runner runner(backend->get(), kv->get(), a.vocab_limit);
  Logits logits;
  const bool check_device = a.backend == "cuda";
  int32_t dev = -1;
  TS_RETURN_IF_ERROR(runner.prefill(*prompt, a.chunk, &logits, check_device ? &dev : nullptr));
  nlohmann::json out;
  out["model_dir"] = a.model;
  out["backend"] = a.backend;
  const std::string dtype =
      a.backend == "cpu"                                                                ? "float32"
      : (a.dtype == "bf16" || (a.dtype == "auto" && config->torch_dtype == "bfloat16")) ? "bfloat16"
                                                                                        : "float16";
  out["dtype"] = dtype;
  out["quantization"] = quant_scheme_name(config->quant.scheme);
  out["kv_cache_dtype"] = kv_fp8 ? kv_cache_dtype_name(KvCacheDtype::kFp8E4m3) : dtype;
  out["random_weights_seed"] = a.random_weights;
  out["vocab_size"] = vocab;
  out["vocab_limit"] = limit;
  out["prompt_ids"] = *prompt;
  out["chunk"] = a.chunk;
  out["first_logits"] = std::vector<float>(logits.row(0), logits.row(0) + vocab);
  if (!branches->empty()) {
    // Before the greedy steps, so the branches fork the prompt itself.
    Logits branch_logits;
    TS_RETURN_IF_ERROR(runner.branches(*branches, &branch_logits));
    nlohmann::json rows = nlohmann::json::array();
    for (size_t b = 0; b < branches->size(); ++b) {
      const float* row = branch_logits.row(int32_t(b));
      rows.push_back(std::vector<float>(row, row + vocab));
    }
    out["branches"] = *branches;
    out["branch_logits"] = std::move(rows);
  }

  // Greedy: the scheduler's temperature-0 sampler on the full row.
  SamplingParams greedy_params;
  greedy_params.temperature = 0.0f;
  SamplingScratch scratch;
  std::vector<int32_t> tokens_out, device_argmax;
  std::vector<float> logprobs, margins;
  for (int32_t k = 0; k < a.greedy; ++k) {
    const SampledToken t = sample_token(logits.row(0), limit, greedy_params, 0, k, &scratch);
    const auto [best, second] = top2(logits.row(0), limit);
    tokens_out.push_back(t.token);
    logprobs.push_back(t.logprob);
    margins.push_back(best.logit - second.logit);
    if (check_device) device_argmax.push_back(dev);
    if (k + 1 == a.greedy) break;
    TS_RETURN_IF_ERROR(runner.decode(t.token, &logits, check_device ? &dev : nullptr));
  }
  out["greedy"] = {{"tokens", tokens_out}, {"logprobs", logprobs}, {"top2_margin", margins}};
  // The backend's device argmax at each step (the scheduler's greedy fast path).
  if (check_device) out["greedy"]["device_argmax"] = device_argmax;
  const auto t2 = std::chrono::steady_clock::now();
  out["seconds"] = {{"load", std::chrono::duration<double>(t1 - t0).count()},
                    {"run", std::chrono::duration<double>(t2 - t1).count()}};

  std::ofstream f(a.out);
  if (!f) return NotFound("--out " + a.out + " cannot be written");
  f << out.dump() << "\n";
  if (!f) return Internal("writing " + a.out + " failed");
  std::fprintf(stderr, "treeserve_logits: %s backend, %zu prompt ids, %d greedy tokens -> %s\n",
               a.backend.c_str(), prompt->size(), a.greedy, a.out.c_str());
  return Status::Ok();
}

}  // namespace
}  // namespace treeserve

int main(int argc, char** argv) {
  treeserve::Args a;
  CLI::App app{"treeserve_logits: first-token logits and a greedy continuation of one prompt"};
  app.add_option("--model", a.model, "model directory (config.json, *.safetensors)")->required();
  app.add_option("--ids", a.ids, "prompt token ids, e.g. 1,415,2936");
  app.add_option("--ids-file", a.ids_file, "file with the prompt token ids (JSON list or text)");
  app.add_option("--backend", a.backend, "cpu | cuda (default cpu)");
  app.add_option("--dtype", a.dtype, "CUDA weights: auto (config torch_dtype) | fp16 | bf16");
  app.add_option("--quantization", a.quantization,
                 "auto (the checkpoint's own) | none | fp8 (FP8 linear layers; a 16-bit "
                 "checkpoint is quantized at load)");
  app.add_option("--kv-cache-dtype", a.kv_cache_dtype,
                 "auto (the weights' dtype) | fp8 (alias fp8_e4m3: e4m3 K/V with a float32 "
                 "scale per token and kv head; the CPU backend emulates it)");
  app.add_option("--greedy", a.greedy, "greedy continuation length (default 16)");
  app.add_option("--vocab-limit", a.vocab_limit, "sample only ids below this (0 = vocab_size)");
  app.add_option("--random-weights", a.random_weights, "random weights from SEED, not the dir's")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", a.threads, "CPU backend threads (0 = all cores)");
  app.add_option("--page-size", a.page_size, "KV page size in tokens (default 16)");
  app.add_option("--chunk", a.chunk, "prefill in steps of N tokens (0 = one step)");
  app.add_option("--tensor-parallel", a.tensor_parallel,
                 "CUDA: split the model over N GPUs (NCCL), as the server's --tensor-parallel")
      ->check(CLI::Range(1, 8));
  app.add_flag("!--no-gemm-autotune", a.gemm_autotune,
               "CUDA: cuBLAS's default GEMM choice instead of timing candidates, so that two runs "
               "choose the same algorithms (bit-identical logits for identical weights)");
  app.add_option("--branches", a.branches_file,
                 "JSON list of id lists: fork the prompt once per list, run them in one step");
  app.add_option("--out", a.out, "JSON output file")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  const treeserve::Status s = treeserve::run(a);
  if (!s.ok()) {
    std::fprintf(stderr, "treeserve_logits: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
