// Decode-step benchmark of the CUDA engine on one GPU: a model shape (default Llama-3-8B,
// random fp16 weights: the shape is what matters for timing) runs the decoding workloads
// (few-shot, sampled, speculative, tree of thought) for a fixed number of steps. Per workload it
// prints the mean step time, tokens/s, the roofline step time ((weight bytes + unique KV bytes) /
// measured copy bandwidth), and the same steps with attention forced to the prefix-unaware
// baseline, in the same run. With --tensor-parallel N (N GPUs, NCCL) it also runs every workload
// with the ranks' all-reduces skipped (CudaBackendOptions::skip_collectives: wrong results, same
// kernels) and reports the all-reduce share of the step as 1 - (step without communication / step);
// the roofline then divides the streamed bytes over the N GPUs. Its O and down all-reduces are
// peer-to-peer kernels fused with the norm (CudaBackendOptions::p2p_all_reduce) where the
// GPUs reach each other's memory; --nccl-all-reduce sends them all through NCCL instead.
// GEMMs are autotuned (CudaBackendOptions::gemm_autotune): after the table it prints each
// tuned shape (algorithm, tile, split-K, time, weight bytes / time), and the few-shot steps
// run once more with tuning off (cublasGemmEx) for comparison; --no-gemm-tune: off throughout.
// --gemm-split-k N sets CudaBackendOptions::gemm_split_k (default 0: auto, 1: off, 2..8:
// forced): one GPU's O and down GEMMs as split-K; the tuned-GEMM table's "K/S" column is the
// split count a shape was tuned for (1: unsplit).
// --max-chunk N sets CudaBackendOptions::attention_max_chunk_tokens (tree attention's chunk
// growth; 0: off; default 2048, the engine's).
// --pair-margin N sets CudaBackendOptions::attention_pair_margin (tree attention pairs heads
// where the simulated span is at least 1/N shorter; default 32, the engine's).
// --no-decode-kernel sets CudaBackendOptions::attention_decode_kernel false (tree attention's
// stage 1 runs every plan, also the all-decode-shaped ones; for comparison).
// --fewshot-prompt N sets the few-shot trees' shared prompt (default 4000 tokens; 16000 with
// --fewshot-branches 64 is the kernel bench's P=16000 + 64x200, whose paired items run in
// tree attention's tail kernel).
// --no-tail sets CudaBackendOptions::attention_tail_kernel to kOff (tree attention never runs
// a plan's paired items in its tail kernel; for comparison), --no-wide attention_wide_kernel (never
// its wide kernel).
//
//   bench_decode [--config configs/models/llama-3-8b.json] [--steps 16] [--json FILE]
//                [--workloads fewshot,sampled,spec,tot] [--kv-gib 6] [--tensor-parallel N]
//                [--fewshot-branches 20,30,50] [--fewshot-prompt 4000] [--profile-last-step]
//                [--graphs|--no-graphs]
//                [--no-gemm-tune] [--nccl-all-reduce] [--skip-collectives] [--no-baseline]
//                [--shard-of N]
//                [--gemm-split-k N] [--max-chunk N] [--pair-margin N] [--no-decode-kernel]
//                [--no-tail] [--no-wide] [--quantization fp8|none] [--kv-cache-dtype fp8|auto]
// --quantization fp8 quantizes the linear layers to e4m3 at load; --kv-cache-dtype fp8 keeps
// the KV pool in e4m3 with a float32 scale a (token, kv head) row (the roofline counts its bytes).
// --profile-last-step wraps each workload's last step in cudaProfilerStart/Stop, for
// `ncu --profile-from-start off` (per-kernel times of one step).
// --skip-collectives runs only the tensor-parallel steps without all-reduces (no baseline or
// untuned pass): each rank's kernels alone, which ncu's kernel replay can serve (the
// peer-to-peer all-reduce kernels wait on the other GPUs, so replaying one of them hangs).
// --no-baseline skips the baseline-attention pass (its columns print as -).
// --shard-of N runs one rank's share of the model at tensor-parallel degree N on one GPU (its
// heads, MLP slice and vocabulary slice; no communication): the per-rank kernels of a TP=N
// step, to profile and tune them where only one GPU is at hand.
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_tile_names.h"  // generated (bench/decode/CMakeLists.txt)
#include "engine/backend.h"
#include "engine/cuda_backend.h"
#include "engine/detail/cuda_gemm.h"
#include "engine/tensor_parallel.h"
#include "kernels/kv_layout.h"
#include "kvcache/kv_cache.h"
#include "models/model_config.h"

namespace treeserve {
namespace {

struct Args {
  std::string config = "configs/models/llama-3-8b.json";
  int steps = 16;
  std::string json;
  std::string workloads = "fewshot,sampled,spec,tot";
  double kv_gib = 6.0;
  int tensor_parallel = 1;
  std::vector<int> fewshot_branches = {20, 30, 50};
  int fewshot_prompt = 4000;       // --fewshot-prompt: the few-shot trees' shared prompt, tokens
  bool profile_last_step = false;  // cudaProfilerStart/Stop around each workload's last step
  bool cuda_graphs = true;
  bool gemm_tune = true;
  bool nccl_only = false;  // tensor parallel: every all-reduce through NCCL (no peer-to-peer)
  bool skip_collectives = false;  // tensor parallel: only the steps without all-reduces
  bool baseline = true;           // the baseline-attention pass
  int shard_of = 1;               // > 1: one rank's share of the model at that TP degree
  int gemm_split_k = 0;           // CudaBackendOptions::gemm_split_k
  int max_chunk = CudaBackendOptions{}.attention_max_chunk_tokens;    // --max-chunk
  int pair_margin = CudaBackendOptions{}.attention_pair_margin;       // --pair-margin
  bool decode_kernel = CudaBackendOptions{}.attention_decode_kernel;  // --no-decode-kernel
  bool tail = CudaBackendOptions{}.attention_tail_kernel != TreeAttentionLimits::Tail::kOff;
  bool wide = CudaBackendOptions{}.attention_wide_kernel != TreeAttentionLimits::Wide::kOff;
  bool fp8 = false;  // --quantization fp8: e4m3 linear layers (quantized from the random weights)
  bool fp8_kv = false;  // --kv-cache-dtype fp8: the KV pool in e4m3 with a scale a row
};

double copy_bandwidth_bytes_per_s() {
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  cudaMalloc(&a, bytes);
  cudaMalloc(&b, bytes);
  cudaMemset(a, 1, bytes);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
  float best = 1e30f;
  for (int i = 0; i < 10; ++i) {
    cudaEventRecord(e0);
    cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    best = std::min(best, ms);
  }
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / (double(best) * 1e-3);  // read + write
}

// Weights one decode step streams: every layer matrix and the LM head (embedding rows are
// gathered, negligible).
double weight_bytes(const ModelConfig& c) {
  const double h = double(c.hidden_size), q = double(c.q_size()), kv = double(c.kv_size());
  const double im = double(c.intermediate_size);
  const double matrices = (q + 2 * kv) * h + h * q + 3 * im * h;
  // FP8: one byte an element plus a float scale per output row; the norms and the LM head stay
  // 16-bit.
  const bool fp8 = c.quant.scheme == QuantScheme::kFp8;
  const double layer = fp8 ? matrices + 4.0 * ((q + 2 * kv) + h + 2 * im + h) + 2.0 * 2 * h
                           : 2.0 * (matrices + 2 * h);
  return layer * double(c.num_hidden_layers) + 2.0 * double(c.vocab_size) * h;
}

// One measured workload: a KvCache state with `branches` live, each decoding `rows_per_branch`
// rows per step (1 for decode; 1 + drafts for speculative verify).
struct Workload {
  std::string name;
  std::vector<BranchId> branches;
  int32_t drafts = 0;  // speculative: token-tree size per step
  std::vector<int32_t> draft_parents;
  int64_t unique_kv_tokens = 0;
};

class Runner {
 public:
  Runner(const ModelConfig& config, Backend* backend, KvCache* kv)
      : config_(config), backend_(backend), kv_(kv) {}

  // How decode steps draw their tokens: greedy (argmax on the device), or temperature 0.8 /
  // top-p 0.95 sampling drawn by the backend (StepBatch::sampling) or on the host from the
  // full logits rows (the host-side path, for comparison).
  enum class Draw { kGreedy, kBackend, kHost };
  void set_draw(Draw d) { draw_ = d; }

  // Prefills `tokens` on a new branch in chunks of up to 1024 tokens; returns the branch.
  BranchId prefill(const std::vector<int32_t>& tokens) {
    BranchId id = 0;
    size_t done = 0;
    while (done < tokens.size()) {
      const size_t n = std::min<size_t>(1024, tokens.size() - done);
      std::vector<int32_t> chunk(tokens.begin() + done, tokens.begin() + done + n);
      std::vector<KvSlot> slots;
      if (done == 0) {
        auto nb = kv_->create_branch(chunk);
        check(nb.status());
        id = nb->id;
        slots = nb->slots;
      } else {
        check(kv_->append(id, chunk, &slots));
      }
      batch_.clear();
      add(id, chunk, slots, int32_t(done), false);
      step({{id, int32_t(n)}});
      done += n;
    }
    return id;
  }

  // Appends `len` tokens to each branch (suffixes), in batches of up to 1024 rows.
  void extend(const std::vector<BranchId>& ids, int32_t len, uint32_t seed) {
    const size_t per_batch = std::max<size_t>(1, 1024 / size_t(len));
    for (size_t first = 0; first < ids.size(); first += per_batch) {
      batch_.clear();
      std::vector<ViewQuery> q;
      for (size_t i = first; i < std::min(ids.size(), first + per_batch); ++i) {
        const BranchId b = ids[i];
        std::vector<int32_t> toks(static_cast<size_t>(len));
        for (auto& t : toks) t = int32_t((seed = seed * 1664525u + 1013904223u) % 1000) + 10;
        std::vector<KvSlot> slots;
        const int32_t pos = kv_->branch_length(b).value();
        check(kv_->append(b, toks, &slots));
        add(b, toks, slots, pos, false);
        q.push_back({b, len});
      }
      step(q);
    }
  }

  // Mean milliseconds of `steps` decode steps (each branch +1 token, or a token tree), after
  // two warm-up steps: the engine runs a step shape eagerly the first time and captures its
  // CUDA graph the second (milliseconds more than a replay), so the measured steps are
  // the steady state, graph replays where graphs are on. A measured step over 1.5x the median
  // (a host stall, a shape captured mid-run) is named on stderr: the mean includes it.
  double measure(Workload& w, int steps, bool profile_last = false) {
    double total = 0;
    std::vector<double> step_ms;
    constexpr int kWarmup = 2;
    for (int s = 0; s < steps + kWarmup; ++s) {
      batch_.clear();
      std::vector<ViewQuery> q;
      for (BranchId b : w.branches) {
        const int32_t pos = kv_->branch_length(b).value();
        std::vector<KvSlot> slots;
        std::vector<int32_t> tok = {int32_t(100 + s)};
        check(kv_->append(b, tok, &slots));
        add(b, tok, slots, pos, true);
        q.push_back({b, 1});
        if (w.drafts > 0) {
          std::vector<int32_t> drafts(static_cast<size_t>(w.drafts));
          for (int32_t i = 0; i < w.drafts; ++i) drafts[i] = 200 + i;
          std::vector<KvSlot> ds;
          check(kv_->append_token_tree(b, drafts, w.draft_parents, &ds));
          std::vector<int32_t> depth(drafts.size());
          for (size_t i = 0; i < drafts.size(); ++i) {
            depth[i] = w.draft_parents[i] < 0 ? 0 : depth[w.draft_parents[i]] + 1;
            batch_.token_ids.push_back(drafts[i]);
            batch_.positions.push_back(pos + 1 + depth[i]);
            batch_.kv_slots.push_back(int64_t(ds[i].page) * kv_->page_size() + ds[i].slot);
            batch_.logit_rows.push_back(batch_.num_rows() - 1);
          }
        }
      }
      const bool profile = profile_last && s == steps + kWarmup - 1;
      if (profile) cudaProfilerStart();
      const auto t0 = std::chrono::steady_clock::now();
      step(q);
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (profile) cudaProfilerStop();
      if (s >= kWarmup) {
        total += ms;
        step_ms.push_back(ms);
      }
      if (w.drafts > 0) {
        for (BranchId b : w.branches) {
          std::vector<SlotMove> none;
          check(kv_->accept(b, {}, &none));  // reject all: the next step starts the same
        }
      }
    }
    if (!step_ms.empty()) {
      std::vector<double> sorted = step_ms;
      std::sort(sorted.begin(), sorted.end());
      const double median = sorted[sorted.size() / 2];
      for (size_t i = 0; i < step_ms.size(); ++i) {
        if (step_ms[i] > 1.5 * median) {
          std::fprintf(stderr, "bench_decode: %s: step %zu took %.3f ms (median %.3f ms)\n",
                       w.name.c_str(), i + 1, step_ms[i], median);
        }
      }
    }
    return total / steps;
  }

 private:
  void add(BranchId b, const std::vector<int32_t>& toks, const std::vector<KvSlot>& slots,
           int32_t pos, bool logits) {
    (void)b;
    for (size_t i = 0; i < toks.size(); ++i) {
      batch_.token_ids.push_back(toks[i]);
      batch_.positions.push_back(pos + int32_t(i));
      batch_.kv_slots.push_back(int64_t(slots[i].page) * kv_->page_size() + slots[i].slot);
    }
    if (logits) batch_.logit_rows.push_back(batch_.num_rows() - 1);
  }
  void step(const std::vector<ViewQuery>& q) {
    batch_.full_logits = draw_ == Draw::kHost;  // greedy decoding: argmax on the device
    SamplingParams sp;
    sp.temperature = 0.8f;
    sp.top_p = 0.95f;
    sp.seed = 1;
    batch_.sampling.clear();
    if (draw_ == Draw::kBackend) {
      for (size_t i = 0; i < batch_.logit_rows.size(); ++i) {
        batch_.sampling.push_back({sp, uint64_t(i), batch_.positions[batch_.logit_rows[i]] + 1});
      }
    }
    check(kv_->build_attention_view(q, &batch_.view));
    check(backend_->forward(batch_, &logits_));
    if (draw_ == Draw::kHost) {
      for (int32_t i = 0; i < logits_.num_rows; ++i) {
        (void)sample_token(logits_.row(i), logits_.vocab, sp, uint64_t(i),
                           batch_.positions[batch_.logit_rows[i]] + 1, &scratch_);
      }
    }
  }
  static void check(const Status& s) {
    if (!s.ok()) {
      std::fprintf(stderr, "error: %s\n", s.message().c_str());
      std::exit(1);
    }
  }

  const ModelConfig& config_;
  Backend* backend_;
  KvCache* kv_;
  StepBatch batch_;
  Logits logits_;
  Draw draw_ = Draw::kGreedy;
  SamplingScratch scratch_;
};

std::vector<int32_t> tokens(int n, uint32_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t((seed = seed * 1664525u + 1013904223u) % 30000) + 10;
  return t;
}

// Medusa-like token tree: wide near the root, narrow deeper (t tokens).
std::vector<int32_t> medusa_parents(int32_t t) {
  std::vector<int32_t> parents;
  std::vector<int32_t> level = {-1};
  int32_t width = 8;
  while (int32_t(parents.size()) < t) {
    std::vector<int32_t> next;
    for (int32_t p : level) {
      for (int32_t k = 0; k < width && int32_t(parents.size()) < t; ++k) {
        parents.push_back(p);
        next.push_back(int32_t(parents.size()) - 1);
      }
    }
    level = next;
    width = std::max(1, width / 2);
  }
  return parents;
}

struct Result {
  std::string name;
  int64_t rows = 0;
  double ms = 0, baseline_ms = 0, roofline_ms = 0, unique_kv_gb = 0;
  double no_comm_ms = 0;  // tensor parallel: the same steps without the all-reduces
  double untuned_ms = 0;  // the same steps with cublasGemmEx (few-shot only; 0: not run)
};

// cublasLt's tile enum as "64x56" (bench_tile_names.h is generated from cublasLt.h).
std::string tile_name(int32_t tile) {
  for (const bench::TileName& t : bench::kTileNames) {
    if (t.id == tile) return t.name;
  }
  return "tile " + std::to_string(tile);
}

// One line per shape the GEMM tuner chose an algorithm for, with its weight-read rate.
void print_tuned_gemms(double copy_bw) {
  const std::vector<detail::TunedGemm> tuned = detail::LtGemm::tuned_shapes();
  if (tuned.empty()) return;
  std::printf("\ntuned GEMMs (y[m][n] = x[m][k] . w[n][k]^T; TB/s of weight bytes; copy %.2f)\n",
              copy_bw / 1e12);
  std::printf("%3s %5s %5s %7s %6s %3s %4s %5s %9s %6s %6s %4s %9s %7s %9s %6s\n", "dev", "m", "m@",
              "n", "k", "K/S", "out", "algo", "tile", "stages", "splitK", "red", "us", "TB/s",
              "heur. us", "cands");
  for (const detail::TunedGemm& t : tuned) {
    // e4m3 inputs (FP8 layers) are marked "8" before the output type.
    const bool e4m3 = t.in == CUDA_R_8F_E4M3;
    const std::string out = std::string(e4m3 ? "8" : "") + (t.out == CUDA_R_32F    ? "f32"
                                                            : t.out == CUDA_R_16BF ? "bf16"
                                                                                   : "f16");
    if (t.fallback) {
      std::printf("%3d %5lld %5lld %7lld %6lld %3d %4s  cublasGemmEx (no cublasLt candidate ran)\n",
                  t.device, (long long)t.m_bucket, (long long)t.m_tuned, (long long)t.n,
                  (long long)t.k, t.splits, out.c_str());
      continue;
    }
    const double tbps =
        double(t.n) * double(t.k) * (e4m3 ? 1.0 : 2.0) / (double(t.us) * 1e-6) / 1e12;
    if (t.fp8_rows_splits > 0) {  // the engine's own FP8 kernel: K ranges as "splitK"
      std::printf("%3d %5lld %5lld %7lld %6lld %3d %4s %5s %9s %6s %6d %4s %9.1f %7.2f %9.1f %6d\n",
                  t.device, (long long)t.m_bucket, (long long)t.m_tuned, (long long)t.n,
                  (long long)t.k, t.splits, out.c_str(), "rows", "128 cols", "-", t.fp8_rows_splits,
                  "-", t.us, tbps, t.heuristic_us, t.candidates);
      continue;
    }
    std::printf("%3d %5lld %5lld %7lld %6lld %3d %4s %5d %9s %6d %6d %4d %9.1f %7.2f %9.1f %6d\n",
                t.device, (long long)t.m_bucket, (long long)t.m_tuned, (long long)t.n,
                (long long)t.k, t.splits, out.c_str(), t.algo_id, tile_name(t.tile).c_str(),
                t.stages, t.split_k, t.reduction, t.us, tbps, t.heuristic_us, t.candidates);
  }
  std::printf(
      "(m: the bucket's rows, m@: the rows it was timed at; K/S: K slices as one strided batch, "
      "float parts (gemm_split_k); splitK: cublasLt's own; red: reduction scheme, "
      "cublasLtReductionScheme_t; heur. us: cublasLt's first candidate; out 8f16: e4m3 inputs, "
      "weights counted at one byte; algo rows: the engine's FP8 kernel for decode rows, its "
      "K ranges under splitK)\n");
}

int run(const Args& args) {
  std::ifstream f(args.config);
  if (!f) {
    std::fprintf(stderr, "cannot open %s\n", args.config.c_str());
    return 1;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  auto config = parse_model_config(ss.str(), args.config);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().message().c_str());
    return 1;
  }
  if (args.shard_of > 1) {
    // Rank 0's share, as engine/tensor_parallel.h splits the model: its query and KV heads,
    // its slice of the MLP and of the vocabulary (the LM head's rows); hidden stays.
    ModelConfig& c = *config;
    const Status split = check_tensor_parallel(c, args.shard_of);
    if (args.tensor_parallel != 1 || !split.ok()) {
      std::fprintf(
          stderr, "--shard-of %d: %s\n", args.shard_of,
          args.tensor_parallel != 1 ? "needs --tensor-parallel 1" : split.message().c_str());
      return 2;
    }
    const TensorParallelShard shard = tensor_parallel_shard(c, 0, args.shard_of);
    c.num_attention_heads = shard.num_q_heads;
    c.num_key_value_heads = shard.num_kv_heads;
    c.intermediate_size = shard.im_size;
    c.vocab_size = shard.vocab_size;
    c.bos_token_id = -1;
    std::erase_if(c.eos_token_ids, [&](int32_t id) { return id >= c.vocab_size; });
  }
  if (args.fp8) {
    config->quant.scheme = QuantScheme::kFp8;
    config->quant.source = "--quantization fp8";
  }
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "bench_decode: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const double bw = copy_bandwidth_bytes_per_s();
  const std::string split_k = args.gemm_split_k == 0 ? "auto"
                              : args.gemm_split_k == 1
                                  ? "off"
                                  : std::to_string(args.gemm_split_k) + " parts";
  std::printf(
      "device: %s, copy bandwidth %.2f TB/s, tensor parallel %d%s, CUDA graphs %s, GEMM "
      "autotune %s, GEMM split-K %s, attention chunk growth up to %d tokens (0: off), attention "
      "pairing margin 1/%d, attention decode kernel %s, attention tail kernel %s, attention "
      "wide kernel %s\n",
      prop.name, bw / 1e12, args.tensor_parallel,
      args.tensor_parallel == 1 ? ""
      : args.nccl_only          ? " (all-reduce: NCCL)"
                       : " (all-reduce: peer-to-peer fused with the norm, NCCL for the embedding)",
      args.cuda_graphs ? "on" : "off", args.gemm_tune ? "on" : "off", split_k.c_str(),
      args.max_chunk, args.pair_margin, args.decode_kernel ? "on" : "off",
      args.tail ? "where it pays" : "off", args.wide ? "where it pays" : "off");
  if (cuda_device_count() < args.tensor_parallel) {
    std::fprintf(stderr, "bench_decode: --tensor-parallel %d needs %d devices, found %d\n",
                 args.tensor_parallel, args.tensor_parallel, cuda_device_count());
    return 1;
  }
  const double wbytes = weight_bytes(*config);
  std::printf("model: %s shape%s, %lld layers, hidden %lld, %s weights streamed per step %.2f GB\n",
              args.config.c_str(),
              args.shard_of > 1
                  ? (", one rank's share at TP=" + std::to_string(args.shard_of)).c_str()
                  : "",
              (long long)config->num_hidden_layers, (long long)config->hidden_size,
              args.fp8 ? "fp8 (LM head fp16)" : "fp16", wbytes / 1e9);
  // A token's K and V over all layers, as the engine's pool lays them out: 2 bytes a value, or
  // e4m3 with a float32 scale a row with --kv-cache-dtype fp8.
  KvLayout kv_layout;
  kv_layout.num_layers = int32_t(config->num_hidden_layers);
  kv_layout.num_kv_heads = int32_t(config->num_key_value_heads);
  kv_layout.head_dim = int32_t(config->head_dim);
  kv_layout.set_element(2, args.fp8_kv);
  const int64_t kv_token_bytes = kv_layout.bytes_per_token();
  if (args.fp8_kv) std::printf("KV cache: e4m3 with a float32 scale a row\n");

  std::vector<Result> results;
  std::string memory_line;
  auto gib = [](double bytes) {
    char b[32];
    std::snprintf(b, sizeof b, "%.2f GiB", bytes / double(1ull << 30));
    return std::string(b);
  };
  // Passes: 0 the measured run, 1 baseline attention, 2 (tensor parallel) no all-reduces,
  // 3 (tuning on, few-shot only) GEMMs untuned.
  const int passes = args.tensor_parallel > 1 && !args.skip_collectives ? 3 : 2;
  const bool untuned_pass = args.gemm_tune && !args.skip_collectives &&
                            args.workloads.find("fewshot") != std::string::npos;
  for (int pass = 0; pass < 4; ++pass) {
    if (pass == 1 && (args.skip_collectives || !args.baseline)) continue;
    if (pass == 2 && passes < 3) continue;
    if (pass == 3 && !untuned_pass) continue;
    const bool baseline = pass == 1;
    CudaBackendOptions opt;
    opt.page_size = 16;
    opt.num_pages = int64_t(args.kv_gib * (1ull << 30)) / (kv_token_bytes * opt.page_size);
    opt.baseline_attention = baseline;
    opt.tensor_parallel = args.tensor_parallel;
    opt.skip_collectives = pass == 2 || args.skip_collectives;
    opt.cuda_graphs = args.cuda_graphs;
    opt.p2p_all_reduce = !args.nccl_only;
    opt.gemm_autotune = args.gemm_tune && pass != 3;
    opt.gemm_split_k = args.gemm_split_k;
    opt.attention_max_chunk_tokens = args.max_chunk;
    opt.attention_pair_margin = args.pair_margin;
    opt.kv_cache_fp8 = args.fp8_kv;
    opt.attention_decode_kernel = args.decode_kernel;
    if (!args.tail) opt.attention_tail_kernel = TreeAttentionLimits::Tail::kOff;
    if (!args.wide) opt.attention_wide_kernel = TreeAttentionLimits::Wide::kOff;
    size_t free_before = 0, total_mem = 0;
    cudaMemGetInfo(&free_before, &total_mem);
    auto backend = create_cuda_backend_random(*config, opt, 42);
    if (!backend.ok()) {
      std::fprintf(stderr, "%s\n", backend.status().message().c_str());
      return 1;
    }
    size_t index = 0;
    auto record = [&](const std::string& name, int64_t rows, int64_t unique_tokens, double ms) {
      if (pass == 0) {
        Result r;
        r.name = name;
        r.rows = rows;
        r.ms = ms;
        r.unique_kv_gb = double(unique_tokens * kv_token_bytes) / 1e9;
        r.roofline_ms =
            (wbytes + double(unique_tokens * kv_token_bytes)) / (bw * args.tensor_parallel) * 1e3;
        results.push_back(r);
      } else if (pass == 1) {
        results[index++].baseline_ms = ms;
      } else if (pass == 2) {
        results[index++].no_comm_ms = ms;
      } else {
        results[index++].untuned_ms = ms;  // the few-shot workloads come first in pass 0 too
      }
    };
    auto want = [&](const char* w) {
      if (pass == 3) return std::strcmp(w, "fewshot") == 0;
      return args.workloads.find(w) != std::string::npos;
    };
    if (want("fewshot")) {
      for (int b : args.fewshot_branches) {
        KvCacheConfig kc{16, int32_t(opt.num_pages)};
        auto kv = KvCache::create(kc);
        Runner r(*config, backend->get(), kv->get());
        const int prompt = args.fewshot_prompt;
        BranchId root = r.prefill(tokens(prompt, 1));
        auto forked = (*kv)->fork(root, b);
        Workload w;
        w.name = "fewshot P=" + std::to_string(prompt) + " b=" + std::to_string(b) + " +200";
        w.branches = forked->branches;
        r.extend(w.branches, 200, 7);
        const double ms = r.measure(w, args.steps, args.profile_last_step);
        record(w.name, b, prompt + int64_t(b) * 200, ms);
      }
    }
    if (want("sampled")) {
      // Few-shot b=50 drawing with temperature / top-p: on the device vs on the host.
      for (Runner::Draw d : {Runner::Draw::kBackend, Runner::Draw::kHost}) {
        KvCacheConfig kc{16, int32_t(opt.num_pages)};
        auto kv = KvCache::create(kc);
        Runner r(*config, backend->get(), kv->get());
        BranchId root = r.prefill(tokens(4000, 1));
        auto forked = (*kv)->fork(root, 50);
        Workload w;
        w.name = std::string("fewshot b=50 T=0.8 top-p .95, ") +
                 (d == Runner::Draw::kBackend ? "device draw" : "host draw");
        w.branches = forked->branches;
        r.extend(w.branches, 200, 7);
        r.set_draw(d);
        const double ms = r.measure(w, args.steps, args.profile_last_step);
        record(w.name, 50, 4000 + 50 * 200, ms);
      }
    }
    if (want("spec")) {
      for (int t : {32, 64, 128, 256}) {
        KvCacheConfig kc{16, int32_t(opt.num_pages)};
        auto kv = KvCache::create(kc);
        Runner r(*config, backend->get(), kv->get());
        Workload w;
        w.name = "speculative t=" + std::to_string(t) + " over 4000";
        w.branches = {r.prefill(tokens(4000, 2))};
        w.drafts = t;
        w.draft_parents = medusa_parents(t);
        const double ms = r.measure(w, args.steps, args.profile_last_step);
        record(w.name, 1 + t, 4000 + t, ms);
      }
    }
    if (want("tot")) {
      // Tree-of-thought-like: prompt 1000, 10 thoughts of 100, 10 more each of 50 (100 leaves).
      KvCacheConfig kc{16, int32_t(opt.num_pages)};
      auto kv = KvCache::create(kc);
      Runner r(*config, backend->get(), kv->get());
      BranchId root = r.prefill(tokens(1000, 3));
      auto l1 = (*kv)->fork(root, 10);
      r.extend(l1->branches, 100, 9);
      Workload w;
      w.name = "tot 1000 -> 10 x 100 -> 100 x 50";
      for (BranchId b : l1->branches) {
        auto l2 = (*kv)->fork(b, 10);
        for (BranchId c : l2->branches) w.branches.push_back(c);
      }
      r.extend(w.branches, 50, 11);
      const double ms = r.measure(w, args.steps, args.profile_last_step);
      record(w.name, 100, 1000 + 10 * 100 + 100 * 50, ms);
    }
    if (pass == 0 && args.tensor_parallel == 1) {
      // Device memory the backend holds after every workload (its buffers only grow): the
      // weights, the KV pool, and the rest — attention workspace, step activations at the
      // largest step (1024-token prefill chunks here), cuBLAS.
      size_t free_after = 0;
      cudaMemGetInfo(&free_after, &total_mem);
      const double used = double(free_before) - double(free_after);
      const double weights = weight_bytes(*config) + double(config->vocab_size) *
                                                         double(config->hidden_size) * 2.0 *
                                                         (config->tie_word_embeddings ? 0 : 1);
      const double pool = double(opt.num_pages) * opt.page_size * double(kv_token_bytes);
      memory_line = "device memory held by the backend: " + gib(used) + " = weights " +
                    gib(weights) + " + KV pool " + gib(pool) + " + workspace and activations " +
                    gib(used - weights - pool);
    }
  }
  if (!memory_line.empty()) std::printf("\n%s\n", memory_line.c_str());
  std::printf("\n%-36s %6s %10s %10s %12s %12s %10s", "workload", "rows", "step ms", "tok/s",
              "roofline ms", "baseline ms", "speedup");
  if (passes == 3) std::printf(" %12s %11s", "no-comm ms", "all-reduce");
  if (untuned_pass) std::printf(" %11s %8s", "untuned ms", "tuning");
  std::printf("\n");
  for (const Result& r : results) {
    std::printf("%-36s %6lld %10.3f %10.0f %12.3f", r.name.c_str(), (long long)r.rows, r.ms,
                double(r.rows) / (r.ms * 1e-3), r.roofline_ms);
    if (r.baseline_ms > 0) {
      std::printf(" %12.3f %9.2fx", r.baseline_ms, r.baseline_ms / r.ms);
    } else {
      std::printf(" %12s %10s", "-", "-");  // --no-baseline, --skip-collectives
    }
    if (passes == 3)
      std::printf(" %12.3f %10.1f%%", r.no_comm_ms, 100.0 * (1.0 - r.no_comm_ms / r.ms));
    if (untuned_pass && r.untuned_ms > 0) {
      std::printf(" %11.3f %7.2fx", r.untuned_ms, r.untuned_ms / r.ms);
    }
    std::printf("\n");
  }
  print_tuned_gemms(bw);
  if (!args.json.empty()) {
    std::ofstream out(args.json);
    out << "{\"device\": \"" << prop.name << "\", \"copy_bandwidth_tbps\": " << bw / 1e12
        << ", \"tensor_parallel\": " << args.tensor_parallel
        << ", \"gemm_autotune\": " << (args.gemm_tune ? "true" : "false")
        << ", \"gemm_split_k\": " << args.gemm_split_k
        << ", \"attention_max_chunk_tokens\": " << args.max_chunk
        << ", \"attention_pair_margin\": " << args.pair_margin
        << ", \"attention_decode_kernel\": " << (args.decode_kernel ? "true" : "false")
        << ", \"attention_tail_kernel\": " << (args.tail ? "true" : "false")
        << ", \"attention_wide_kernel\": " << (args.wide ? "true" : "false") << ", \"results\": [";
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      out << (i ? ", " : "") << "{\"name\": \"" << r.name << "\", \"rows\": " << r.rows
          << ", \"step_ms\": " << r.ms << ", \"roofline_ms\": " << r.roofline_ms
          << ", \"baseline_ms\": " << r.baseline_ms << ", \"unique_kv_gb\": " << r.unique_kv_gb;
      if (passes == 3) {
        out << ", \"no_comm_ms\": " << r.no_comm_ms
            << ", \"allreduce_share\": " << 1.0 - r.no_comm_ms / r.ms;
      }
      if (r.untuned_ms > 0) out << ", \"untuned_gemm_step_ms\": " << r.untuned_ms;
      out << "}";
    }
    out << "]}\n";
  }
  return 0;
}

}  // namespace
}  // namespace treeserve

int main(int argc, char** argv) {
  treeserve::Args args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--config")
      args.config = next();
    else if (a == "--steps")
      args.steps = std::stoi(next());
    else if (a == "--json")
      args.json = next();
    else if (a == "--workloads")
      args.workloads = next();
    else if (a == "--kv-gib")
      args.kv_gib = std::stod(next());
    else if (a == "--tensor-parallel")
      args.tensor_parallel = std::stoi(next());
    else if (a == "--fewshot-branches") {
      args.fewshot_branches.clear();
      std::stringstream list(next());
      for (std::string item; std::getline(list, item, ',');) {
        args.fewshot_branches.push_back(std::stoi(item));
      }
    } else if (a == "--fewshot-prompt") {
      args.fewshot_prompt = std::stoi(next());
      if (args.fewshot_prompt < 1) {
        std::fprintf(stderr, "--fewshot-prompt must be >= 1\n");
        return 2;
      }
    } else if (a == "--profile-last-step")
      args.profile_last_step = true;
    else if (a == "--graphs")
      args.cuda_graphs = true;
    else if (a == "--no-graphs")
      args.cuda_graphs = false;
    else if (a == "--no-gemm-tune")
      args.gemm_tune = false;
    else if (a == "--nccl-all-reduce")
      args.nccl_only = true;
    else if (a == "--skip-collectives")
      args.skip_collectives = true;
    else if (a == "--no-baseline")
      args.baseline = false;
    else if (a == "--shard-of") {
      args.shard_of = std::stoi(next());
      if (args.shard_of < 1) {
        std::fprintf(stderr, "--shard-of must be >= 1\n");
        return 2;
      }
    } else if (a == "--gemm-split-k")
      args.gemm_split_k = std::stoi(next());
    else if (a == "--max-chunk")
      args.max_chunk = std::stoi(next());
    else if (a == "--pair-margin")
      args.pair_margin = std::stoi(next());
    else if (a == "--no-decode-kernel")
      args.decode_kernel = false;
    else if (a == "--no-tail")
      args.tail = false;
    else if (a == "--no-wide")
      args.wide = false;
    else if (a == "--quantization") {
      const std::string q = next();
      if (q != "fp8" && q != "none") {
        std::fprintf(stderr, "--quantization must be fp8 or none, got '%s'\n", q.c_str());
        return 2;
      }
      args.fp8 = q == "fp8";
    } else if (a == "--kv-cache-dtype") {
      const std::string k = next();
      if (k != "fp8" && k != "auto") {
        std::fprintf(stderr, "--kv-cache-dtype must be fp8 or auto, got '%s'\n", k.c_str());
        return 2;
      }
      args.fp8_kv = k == "fp8";
    } else {
      std::fprintf(stderr,
                   "usage: bench_decode [--config F] [--steps N] [--json F] "
                   "[--workloads fewshot,sampled,spec,tot] [--kv-gib G] [--tensor-parallel N] "
                   "[--fewshot-branches 20,30,50] [--fewshot-prompt 4000] [--profile-last-step] "
                   "[--graphs|--no-graphs] "
                   "[--no-gemm-tune] [--nccl-all-reduce] [--skip-collectives] [--no-baseline] "
                   "[--shard-of N] [--gemm-split-k N] [--max-chunk N] "
                   "[--pair-margin N] [--no-decode-kernel] [--no-tail] [--no-wide] "
                   "[--quantization fp8|none] [--kv-cache-dtype fp8|auto]\n");
      return 2;
    }
  }
  return treeserve::run(args);
}
