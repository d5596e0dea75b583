// Start-up and shutdown of the treeserve process. The listeners open before the model loads:
// until it is loaded the health service says NOT_SERVING and TreeServe calls get UNAVAILABLE.
#include "server/app.h"

#include <google/protobuf/stubs/logging.h>
#include <grpc/support/log.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <thread>

#include "common/metrics.h"
#include "common/route_key.h"
#include "engine/backend.h"
#ifdef TREESERVE_HAVE_CUDA
#include "engine/cuda_backend.h"
#endif
#include "kernels/kv_layout.h"
#include "models/chat_template.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/quantization.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"
#include "scheduler/scheduler.h"
#include "server/auth.h"
#include "server/config.h"
#include "server/http_api.h"
#include "server/metrics_http.h"
#include "server/routing.h"
#include "server/tls.h"
#include "server/treeserve_service.h"

#ifndef TREESERVE_TINY_MODEL_DIR
#define TREESERVE_TINY_MODEL_DIR ""
#endif

namespace treeserve {
namespace {

struct CommandLine {
  std::string config_file;
  std::optional<std::string> model, listen, backend, log_level, metrics_listen, http_listen;
  std::optional<std::string> tls_cert, tls_key, tls_client_ca;
  std::optional<std::string> keys_file;
  std::optional<std::string> chat_template;
  std::optional<std::string> quantization, kv_cache_dtype;
  std::optional<std::string> replica_id;
  std::optional<int64_t> kv_cache_bytes, random_weights;
  std::optional<int32_t> page_size, tensor_parallel, gemm_split_k;
  std::optional<bool> cuda_graphs, gemm_autotune, p2p_all_reduce;
  bool print_config = false;
};

// Where the default tiny model lives: next to the binary's build tree, as built by CMake.
std::string default_model_dir() { return TREESERVE_TINY_MODEL_DIR; }

// Blocks SIGTERM/SIGINT in every thread; a dedicated thread waits for them with sigwait
// and shuts the server down (no work in an async signal handler).
sigset_t shutdown_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

// auto: CUDA when this build has it and a device is present, else the CPU.
Status resolve_backend(const std::string& requested, std::string* backend) {
#ifdef TREESERVE_HAVE_CUDA
  const int32_t devices = cuda_device_count();
#else
  const int32_t devices = 0;
#endif
  if (requested == "cuda") {
#ifndef TREESERVE_HAVE_CUDA
    return Unavailable(
        "backend 'cuda': this build has no CUDA support (configure with "
        "-DTREESERVE_CUDA=ON); use --backend cpu");
#endif
    if (devices == 0) {
      return Unavailable("backend 'cuda': no CUDA device is visible; use --backend cpu");
    }
    *backend = "cuda";
  } else if (requested == "auto") {
    *backend = devices > 0 ? "cuda" : "cpu";
  } else {
    *backend = "cpu";
  }
  return Status::Ok();
}

// Random weights make every output meaningless: say so where an operator cannot miss it.
void warn_random_weights(const std::string& model_dir, uint64_t seed) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(model_dir, ec)) {
    if (entry.path().extension() == ".safetensors") {
      spdlog::warn("model.random_weights_seed is set: ignoring the checkpoint's weights in {}",
                   model_dir);
      break;
    }
  }
  spdlog::warn(
      "*** RANDOM WEIGHTS (seed {}): serving the shape of {} with random weights; its tokens "
      "are meaningless (for load tests only) ***",
      seed, model_dir);
}

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Model load progress as log lines ("load: <stage>: <percent>% (<done> of <total> GiB, <time>)"):
// one when a stage starts, one per 10% of a stage whose progress is known, one when it ends. Stage
// lines are logged whatever stderr is; the percent lines of the checkpoint read only when stderr is
// not a terminal (on a terminal the checkpoint reader draws its progress bar there instead).
class LoadProgress {
 public:
  void begin(const std::string& name, int64_t total_bytes) {
    name_ = name;
    total_ = total_bytes;
    next_percent_ = 10;
    start_ = std::chrono::steady_clock::now();
    spdlog::info("load: {}: 0% (0.0 of {:.1f} GiB)", name_, double(total_) / kGiB);
  }
  void update(int64_t done_bytes) {
    if (total_ <= 0) return;
    const int percent = int(100 * done_bytes / total_);
    if (percent < next_percent_ || percent >= 100) return;
    next_percent_ = (percent / 10 + 1) * 10;
    spdlog::info("load: {}: {}% ({:.1f} of {:.1f} GiB, {:.1f} s)", name_, percent,
                 double(done_bytes) / kGiB, double(total_) / kGiB, seconds());
  }
  void end() {
    spdlog::info("load: {}: 100% ({:.1f} of {:.1f} GiB, {:.1f} s)", name_, double(total_) / kGiB,
                 double(total_) / kGiB, seconds());
  }

 private:
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  std::string name_;
  int64_t total_ = 0;
  int next_percent_ = 10;
  std::chrono::steady_clock::time_point start_;
};

// Bytes of memory the kernel could give without swapping (MemAvailable), or -1.
int64_t memory_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

// Reads one byte of every page of the checkpoint's tensors (each mapped range once), logging
// progress, so that the conversion or upload that follows does not stall on the disk. Skipped
// when the checkpoint is larger than the available memory: the pages would be evicted again
// before they are used.
void page_in_checkpoint(const LlamaWeights& w, LoadProgress* progress) {
  std::vector<const TensorView*> views = {&w.embed_tokens, &w.norm, &w.lm_head};
  for (const LlamaLayerWeights& l : w.layers) {
    for (const TensorView* t :
         {&l.input_layernorm, &l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj,
          &l.post_attention_layernorm, &l.gate_proj, &l.up_proj, &l.down_proj}) {
      views.push_back(t);
    }
  }
  std::set<const void*> seen;
  int64_t total = 0;
  std::vector<const TensorView*> unique;
  for (const TensorView* t : views) {
    if (t->data != nullptr && seen.insert(t->data).second) {
      unique.push_back(t);
      total += int64_t(t->nbytes);
    }
  }
  const int64_t available = memory_available_bytes();
  if (available >= 0 && total > available) {
    spdlog::info(
        "load: the checkpoint ({:.1f} GiB) is larger than the available memory ({:.1f} GiB): "
        "its pages are read as the weights are converted",
        double(total) / kGiB, double(available) / kGiB);
    return;
  }
  progress->begin("reading the checkpoint", total);
  constexpr size_t kPage = 4096;
  volatile unsigned char sink = 0;  // keeps the reads from being optimized away
  int64_t done = 0;
  for (const TensorView* t : unique) {
    const auto* base = static_cast<const unsigned char*>(t->data);
    for (size_t off = 0; off < t->nbytes; off += kPage) {
      sink = sink ^ base[off];
      const int64_t step = int64_t(std::min(kPage, t->nbytes - off));
      done += step;
      if ((done & ((int64_t(1) << 26) - 1)) < step) progress->update(done);  // every 64 MiB
    }
  }
  progress->end();
}

// Parameters of the model's shape (embedding, layers, final norm, LM head unless tied).
int64_t parameter_count(const ModelConfig& c) {
  const int64_t h = c.hidden_size, q = c.q_size(), kv = c.kv_size();
  const int64_t layer = h * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size + 2 * h;
  return c.vocab_size * h * (c.tie_word_embeddings ? 1 : 2) + c.num_hidden_layers * layer + h;
}

// The longest piece of the tokenizer's vocabulary, in bytes: no token stands for more text
// than this (a piece's bytes bound the text it decodes to), so a text of more than
// max_prompt_tokens times it is over the token limit whatever it tokenizes to (save a text
// that normalization shrinks, such as runs of whitespace the tokenizer collapses).
int64_t longest_piece_bytes(const Tokenizer& tokenizer) {
  size_t longest = 1;
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    longest = std::max(longest, tokenizer.id_to_piece(id).size());
  }
  return int64_t(longest);
}

// Protobuf's log lines through spdlog. A request string that is not valid UTF-8 makes the
// parser log an error; the client gets INVALID_ARGUMENT naming the field, so the server logs it
// at debug (a client could otherwise fill the log).
void route_protobuf_logs() {
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel level, const char* file, int line, const std::string& message) {
        if (message.find("invalid UTF-8 data when parsing") != std::string::npos) {
          spdlog::debug("protobuf: {}", message);
        } else if (level >= google::protobuf::LOGLEVEL_ERROR) {
          spdlog::error("protobuf {}:{}: {}", file, line, message);
        } else if (level == google::protobuf::LOGLEVEL_WARNING) {
          spdlog::warn("protobuf {}:{}: {}", file, line, message);
        } else {
          spdlog::debug("protobuf {}:{}: {}", file, line, message);
        }
      });
}

// One line per tenant of the keys file: its quotas and cache partition (never its keys).
void log_tenants(const KeysFile& keys) {
  auto limit = [](double v) { return v > 0 ? fmt::format("{}", v) : std::string("-"); };
  for (const TenantConfig& t : keys.tenants) {
    const TenantQuotas& q = t.quotas;
    const int32_t n_keys = int32_t(std::count_if(
        keys.keys.begin(), keys.keys.end(), [&](const KeyEntry& k) { return k.tenant == t.name; }));
    spdlog::info(
        "tenant {}: {} key(s); live trees {}, live branches {}, kv {}, streams {}, requests per "
        "second {} (burst {}); cache {}",
        t.name, n_keys, limit(q.max_live_trees), limit(q.max_live_branches),
        q.kv_pages > 0   ? fmt::format("{} pages", q.kv_pages)
        : q.kv_share > 0 ? fmt::format("{} of the pool", q.kv_share)
                         : "-",
        limit(q.max_concurrent_streams), limit(q.requests_per_second),
        limit(q.burst > 0 ? q.burst : std::ceil(q.requests_per_second)),
        t.cache_salt.empty() ? "its own" : "salt '" + t.cache_salt + "'");
  }
}

// KV quotas that add up to more than the pool: a tenant under its quota may then find the pool
// short (its work waits while others' runs), so each quota is a cap, not a reservation.
void warn_kv_oversubscribed(const KeysFile& keys, int64_t pool_pages) {
  int64_t total = 0;
  for (const TenantConfig& t : keys.tenants) {
    total += t.quotas.kv_pages > 0 ? t.quotas.kv_pages
                                   : int64_t(std::floor(t.quotas.kv_share * double(pool_pages)));
  }
  if (total > pool_pages) {
    spdlog::warn(
        "the tenants' KV quotas add up to {} pages, more than the pool's {}: a tenant under its "
        "quota may wait for pages other tenants hold",
        total, pool_pages);
  }
}

// gRPC core's log lines through spdlog. A failed TLS handshake (a client without the right
// CA, without a certificate where one is required, or speaking plaintext) is a refused
// authentication: counted and logged, rate-limited, by the authenticator.
Authenticator* g_handshake_auth = nullptr;

void route_grpc_logs(Authenticator* auth) {
  g_handshake_auth = auth;
  gpr_set_log_function([](gpr_log_func_args* args) {
    const std::string_view message = args->message;
    if (message.find("Handshake failed") != std::string_view::npos && g_handshake_auth) {
      g_handshake_auth->record_failure("a client", "the TLS handshake", message);
    } else if (args->severity == GPR_LOG_SEVERITY_ERROR) {
      spdlog::error("grpc {}:{}: {}", args->file, args->line, message);
    } else {
      spdlog::debug("grpc {}:{}: {}", args->file, args->line, message);
    }
  });
}

}  // namespace

int run_treeserve(int argc, char** argv) {
  // Block the shutdown signals first, before any library starts a thread: every thread
  // inherits the mask, so only the sigwait thread below ever sees SIGTERM/SIGINT.
  sigset_t signals = shutdown_signals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A peer that closes its connection while the server writes (an HTTPS metrics scrape cut
  // short, where OpenSSL writes with write(2)) must not end the process.
  signal(SIGPIPE, SIG_IGN);
  CLI::App app{"treeserve: tree-structured LLM decoding server"};
  CommandLine cl;
  app.add_option("--config", cl.config_file, "JSON config preset (see configs/server/)");
  app.add_option("--model", cl.model,
                 "Hugging Face Llama checkpoint directory "
                 "(default: the built tiny test model)");
  app.add_option("--listen", cl.listen, "gRPC listen address host:port (default 127.0.0.1:50051)");
  app.add_option("--backend", cl.backend, "cpu | cuda | auto (default auto)");
  app.add_option("--log-level", cl.log_level, "trace|debug|info|warn|error|critical|off");
  app.add_option("--metrics-listen", cl.metrics_listen, "Prometheus metrics host:port (off)");
  app.add_option("--http-listen", cl.http_listen,
                 "HTTP API host:port, or a port alone for 127.0.0.1:PORT: OpenAI /v1/completions "
                 "and /v1/chat/completions, the tree API as JSON, the tree viewer at /viewer "
                 "(server.http_listen; off)");
  app.add_option("--tls-cert", cl.tls_cert,
                 "PEM certificate chain: TLS on the gRPC and metrics listeners "
                 "(server.tls_cert_file; needs --tls-key)");
  app.add_option("--tls-key", cl.tls_key, "PEM private key of --tls-cert (server.tls_key_file)");
  app.add_option("--tls-client-ca", cl.tls_client_ca,
                 "PEM CA certificates: clients must present a certificate one of them signed "
                 "(mutual TLS; server.tls_client_ca_file)");
  app.add_option("--keys-file", cl.keys_file,
                 "JSON file of API keys (or their SHA-256), each naming a tenant, and the "
                 "tenants' quotas and cache salts (server.keys_file; docs/operations.md)");
  app.add_option("--replica-id", cl.replica_id,
                 "this replica's name behind a proxy, in every tree id it makes: 1 to 32 of "
                 "[a-z0-9-] (server.replica_id; default local; docs/api.md, \"Routing across "
                 "replicas\")");
  app.add_option("--kv-cache-bytes", cl.kv_cache_bytes, "KV pool budget in bytes");
  app.add_option("--random-weights", cl.random_weights,
                 "serve random weights drawn from SEED instead of the checkpoint's (the model "
                 "dir needs only config.json and its tokenizer files)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--chat-template", cl.chat_template,
                 "Jinja chat template file for messages prompts, in place of the checkpoint's "
                 "(model.chat_template)");
  app.add_option("--quantization", cl.quantization,
                 "auto | none | fp8: FP8 (e4m3) linear layers; fp8 quantizes a 16-bit "
                 "checkpoint at load, auto serves the checkpoint as it is (model.quantization; "
                 "default auto; docs/operations.md, \"Quantization (FP8)\")");
  app.add_option("--kv-cache-dtype", cl.kv_cache_dtype,
                 "auto | fp8 (alias fp8_e4m3): K and V in e4m3 with a float32 scale per token "
                 "and kv head, about twice the tokens per byte on the cuda backend (the cpu "
                 "backend emulates the numerics); auto is the model's dtype (kv_cache.dtype; "
                 "default auto)");
  app.add_option("--page-size", cl.page_size, "KV page size in tokens (1..256)");
  app.add_option("--tensor-parallel", cl.tensor_parallel,
                 "GPUs to split the model over (NCCL; cuda backend; default 1)");
  // Boolean switches with a negated form: CLI11 gives a std::optional<bool> flag a value even
  // when it is absent, so each flag writes a plain bool and counts tell whether it was given.
  bool cuda_graphs_flag = false, gemm_autotune_flag = false, p2p_flag = false;
  CLI::Option* cuda_graphs_opt =
      app.add_flag("--cuda-graphs,!--no-cuda-graphs", cuda_graphs_flag,
                   "replay decode steps from CUDA graphs (engine.cuda_graphs; cuda backend; "
                   "default on)");
  CLI::Option* gemm_autotune_opt =
      app.add_flag("--gemm-autotune,!--no-gemm-autotune", gemm_autotune_flag,
                   "time each GEMM shape's cublasLt candidates on first use "
                   "(engine.gemm_autotune; cuda backend; default on)");
  CLI::Option* p2p_opt =
      app.add_flag("--p2p-all-reduce,!--no-p2p-all-reduce", p2p_flag,
                   "tensor parallel: small steps' all-reduces peer to peer over NVLink, fused "
                   "with the norm (engine.p2p_all_reduce; default on; off: NCCL only)");
  app.add_option("--gemm-split-k", cl.gemm_split_k,
                 "O and down GEMMs of steps of <= 256 rows as N-part split-K (engine.gemm_split_k; "
                 "cuda backend, one GPU; 0 = auto (default), 1 = off, 2..8 = always)");
  app.add_flag("--print-config", cl.print_config, "print the effective config and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (cuda_graphs_opt->count() > 0) cl.cuda_graphs = cuda_graphs_flag;
  if (gemm_autotune_opt->count() > 0) cl.gemm_autotune = gemm_autotune_flag;
  if (p2p_opt->count() > 0) cl.p2p_all_reduce = p2p_flag;

  TreeserveConfig config;
  auto fail = [](const Status& s) {
    spdlog::error("{}", s.message());
    return 1;
  };
  if (!cl.config_file.empty()) {
    if (Status s = load_config_file(cl.config_file, &config); !s.ok()) return fail(s);
  }
  if (cl.model) config.model.dir = *cl.model;
  if (cl.listen) config.server.listen = *cl.listen;
  if (cl.backend) config.engine.backend = *cl.backend;
  if (cl.log_level) config.log_level = *cl.log_level;
  if (cl.metrics_listen) config.server.metrics_listen = *cl.metrics_listen;
  if (cl.http_listen) {
    // A port alone listens on loopback only, like the gRPC default.
    const bool port_only = !cl.http_listen->empty() &&
                           cl.http_listen->find_first_not_of("0123456789") == std::string::npos;
    config.server.http_listen = port_only ? "127.0.0.1:" + *cl.http_listen : *cl.http_listen;
  }
  if (cl.tls_cert) config.server.tls_cert_file = *cl.tls_cert;
  if (cl.tls_key) config.server.tls_key_file = *cl.tls_key;
  if (cl.tls_client_ca) config.server.tls_client_ca_file = *cl.tls_client_ca;
  if (cl.keys_file) config.server.keys_file = *cl.keys_file;
  if (cl.replica_id) config.server.replica_id = *cl.replica_id;
  if (cl.kv_cache_bytes) config.kv_cache.memory_bytes = *cl.kv_cache_bytes;
  if (cl.page_size) config.kv_cache.page_size = *cl.page_size;
  if (cl.kv_cache_dtype) config.kv_cache.dtype = *cl.kv_cache_dtype;
  if (cl.tensor_parallel) config.engine.tensor_parallel = *cl.tensor_parallel;
  if (cl.cuda_graphs) config.engine.cuda_graphs = *cl.cuda_graphs;
  if (cl.gemm_autotune) config.engine.gemm_autotune = *cl.gemm_autotune;
  if (cl.p2p_all_reduce) config.engine.p2p_all_reduce = *cl.p2p_all_reduce;
  if (cl.gemm_split_k) config.engine.gemm_split_k = *cl.gemm_split_k;
  if (cl.random_weights) config.model.random_weights_seed = *cl.random_weights;
  if (cl.chat_template) config.model.chat_template = *cl.chat_template;
  if (cl.quantization) config.model.quantization = *cl.quantization;
  if (config.model.dir.empty()) config.model.dir = default_model_dir();
  if (Status s = validate_config(config); !s.ok()) return fail(s);
  spdlog::set_level(spdlog::level::from_str(config.log_level));
  if (cl.print_config) {
    std::printf("%s\n", config_to_json(config).c_str());
    return 0;
  }
  spdlog::info("effective config: {}", config_to_json(config));
  route_protobuf_logs();

  // Keys, TLS and the model's metadata are checked before anything listens: a bad key, file or
  // model directory stops the server here with a message naming it.
  MetricsRegistry metrics_registry;
  ServerMetrics metrics(&metrics_registry);
  std::optional<KeysFile> keys_file;
  if (!config.server.keys_file.empty()) {
    StatusOr<KeysFile> loaded = load_keys_file(config.server.keys_file);
    if (!loaded.ok()) return fail(loaded.status());
    keys_file = std::move(*loaded);
    log_tenants(*keys_file);
  }
  auto auth = Authenticator::create(config.server, std::getenv(kApiKeyEnv), &metrics_registry,
                                    keys_file ? &*keys_file : nullptr);
  if (!auth.ok()) return fail(auth.status());
  // Per-tenant streams and requests per second (the scheduler applies the other quotas).
  TenantGate tenant_gate(keys_file ? keys_file->tenants : std::vector<TenantConfig>{},
                         &metrics_registry);
  auto tls = load_tls_material(config.server);
  if (!tls.ok()) return fail(tls.status());
  route_grpc_logs(auth->get());
  struct HandshakeAuthEnds {  // the authenticator ends with this function
    ~HandshakeAuthEnds() { g_handshake_auth = nullptr; }
  } handshake_auth_ends;

  if (config.model.dir.empty() || !std::filesystem::is_directory(config.model.dir)) {
    return fail(NotFound("model directory '" + config.model.dir +
                         "' does not exist (pass --model DIR, or build the default tiny model "
                         "with `cmake --build build --target tiny_model`)"));
  }
  auto model_config = load_model_config(config.model.dir);
  if (!model_config.ok()) return fail(model_config.status());
  if (Status s = apply_quantization_option(
          config.model.quantization, cl.quantization ? "--quantization" : "model.quantization",
          &*model_config);
      !s.ok()) {
    return fail(s);
  }
  auto tokenizer = Tokenizer::load_model_dir(config.model.dir);
  if (!tokenizer.ok()) return fail(tokenizer.status());
  auto chat_template =
      ChatTemplate::load(config.model.dir, config.model.chat_template, **tokenizer);
  if (!chat_template.ok()) return fail(chat_template.status());

  std::string backend;
  if (Status s = resolve_backend(config.engine.backend, &backend); !s.ok()) return fail(s);
  if (config.engine.tensor_parallel != 1 && backend != "cuda") {
    return fail(InvalidArgument(
        "engine.tensor_parallel = " + std::to_string(config.engine.tensor_parallel) +
        " needs the cuda backend (engine.backend resolved to '" + backend +
        "'); use 1 with the cpu backend"));
  }

  // KV capacity: the CPU backend keeps KV in float32 (an FP8 KV cache there is an emulation of
  // its numerics in the same float32 pool); the CUDA backend in fp16/bf16, or in e4m3 with one
  // float32 scale per (token, kv head) row.
  StatusOr<KvCacheDtype> kv_dtype =
      parse_kv_cache_dtype(config.kv_cache.dtype, "kv_cache.dtype (--kv-cache-dtype)");
  if (!kv_dtype.ok()) return fail(kv_dtype.status());
  const bool kv_fp8 = *kv_dtype == KvCacheDtype::kFp8E4m3;
  const bool bfloat16 = model_config->torch_dtype == "bfloat16";
  KvLayout layout;
  layout.num_layers = static_cast<int32_t>(model_config->num_hidden_layers);
  layout.num_kv_heads = static_cast<int32_t>(model_config->num_key_value_heads);
  layout.head_dim = static_cast<int32_t>(model_config->head_dim);
  layout.page_size = config.kv_cache.page_size;
  layout.set_element(backend == "cpu" ? 4 : 2, backend == "cuda" && kv_fp8);
  const int64_t pages = KvLayout::pages_for_budget(config.kv_cache.memory_bytes,
                                                   layout.bytes_per_token(), layout.page_size);
  if (pages < 1) {
    return fail(InvalidArgument("kv_cache.memory_bytes (" +
                                std::to_string(config.kv_cache.memory_bytes) +
                                ") is too small for one page of this model"));
  }

  ServingInfo info;
  info.model_name = std::filesystem::path(config.model.dir).filename().string();
  if (info.model_name.empty()) info.model_name = config.model.dir;
  const bool random_weights = config.model.random_weights_seed >= 0;
  if (random_weights) info.model_name += " (random weights)";
  info.backend = backend;
  info.tensor_parallel = config.engine.tensor_parallel;
  info.page_size = config.kv_cache.page_size;
  info.kv_pages_total = pages;
  info.kv_cache_dtype = kv_fp8             ? kv_cache_dtype_name(KvCacheDtype::kFp8E4m3)
                        : backend == "cpu" ? "float32"
                        : bfloat16         ? "bfloat16"
                                           : "float16";
  if (keys_file) warn_kv_oversubscribed(*keys_file, pages);
  info.max_sequence_tokens = model_config->max_sequence_tokens();
  if (info.max_sequence_tokens < model_config->max_position_embeddings) {
    info.context_limit_reason =
        "the model's sliding_window: treeserve attends over whole sequences, which equals "
        "sliding-window attention only up to the window";
  }
  info.chat_template = chat_template->get();
  // This run: tree ids name it, so an id from before a restart is told apart from a misroute.
  info.incarnation = new_incarnation();

  // Size bounds (docs/api.md, Limits): a text field may hold max_prompt_tokens of the longest
  // token; a request, one such text and its stop strings plus 16 bytes a prompt token (ids,
  // parents, branch ids) and 64 KiB; the transport takes 1 MiB more, so that a request a little
  // over the bound gets the service's INVALID_ARGUMENT and a larger one is refused by gRPC
  // (RESOURCE_EXHAUSTED) before anything parses it.
  const int64_t piece_bytes = longest_piece_bytes(**tokenizer);
  info.max_text_bytes = int64_t(config.limits.max_prompt_tokens) * piece_bytes;
  const bool derived_request_bytes = config.server.max_request_bytes == 0;
  if (derived_request_bytes) {
    const int64_t derived = info.max_text_bytes * (1 + config.limits.max_stop_strings) +
                            16 * int64_t(config.limits.max_prompt_tokens) + (64 << 10);
    config.server.max_request_bytes = int32_t(std::min<int64_t>(derived, INT32_MAX - (2 << 20)));
  }
  const int max_receive_bytes =
      int(std::min<int64_t>(int64_t(config.server.max_request_bytes) + (1 << 20), INT32_MAX));
  spdlog::info(
      "request bounds: a text field {} bytes (limits.max_prompt_tokens {} x {} bytes, the "
      "longest token), a request {} bytes (server.max_request_bytes{}), the transport {} bytes",
      info.max_text_bytes, config.limits.max_prompt_tokens, piece_bytes,
      config.server.max_request_bytes, derived_request_bytes ? ", derived" : "", max_receive_bytes);

  // The listener opens now; the service answers UNAVAILABLE until set_ready.
  TreeServeService service(config, tokenizer->get(), info, nullptr, auth->get(), &tenant_gate);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int selected_port = -1;
  builder.AddListeningPort(config.server.listen, make_server_credentials(tls->get()),
                           &selected_port);
  // Another process already on the port is a start-up error, not a silent co-listener.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(max_receive_bytes);
  builder.RegisterService(&service);
  // Reflection (and any other service but health) needs a key when keys are configured;
  // TreeServe authenticates each call itself (it needs the principal).
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(make_auth_interceptor_factory(
      auth->get(), {"/grpc.health.v1.Health/", "/treeserve.v1.TreeServe/"}));
  interceptors.push_back(make_replica_interceptor_factory(config.server.replica_id));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));

  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || selected_port <= 0) {
    return fail(Unavailable("cannot listen on " + config.server.listen +
                            " (address in use, or not an address of this machine)"));
  }
  server->GetHealthCheckService()->SetServingStatus(false);
  const std::string tls_mode = *tls == nullptr    ? "plaintext"
                               : (*tls)->mutual() ? "TLS, client certificates required"
                                                  : "TLS";
  spdlog::info(
      "treeserve {} listening on {} (port {}, {}, auth {}) as replica {} (incarnation {}); "
      "loading the model",
      TREESERVE_VERSION, config.server.listen, selected_port, tls_mode,
      (*auth)->enabled() ? "by key from " + (*auth)->source() : "off", config.server.replica_id,
      info.incarnation);
  if (*tls != nullptr) {
    spdlog::info("TLS certificate {} ({})", (*tls)->cert_file, (*tls)->subject);
  }
  for (const std::string& address :
       {config.server.listen, config.server.metrics_listen, config.server.http_listen}) {
    if (address.empty() || is_loopback_listen_address(address)) continue;
    if (!(*auth)->enabled()) {
      spdlog::warn(
          "*** NO AUTHENTICATION: {} is not a loopback address and no API key is configured: "
          "anyone who reaches it can {}. Set ${}, server.auth_token or keys in "
          "server.keys_file ***",
          address,
          address != config.server.metrics_listen
              ? "create, read, fork, prune and delete every tree and use the whole KV pool"
              : "read the metrics",
          kApiKeyEnv);
    } else if (*tls == nullptr) {
      spdlog::warn(
          "{} is not a loopback address and TLS is off: the API key, prompts and tokens cross "
          "the network in plaintext (set --tls-cert and --tls-key, or put a TLS proxy in "
          "front)",
          address);
    }
  }

  MetricsHttpServer metrics_http(&metrics_registry, auth->get(), tls->get());
  if (!config.server.metrics_listen.empty()) {
    if (Status s = metrics_http.start(config.server.metrics_listen); !s.ok()) {
      server->Shutdown();
      return fail(s);
    }
    spdlog::info("metrics on {}://{}/metrics{}", *tls != nullptr ? "https" : "http",
                 config.server.metrics_listen, (*auth)->enabled() ? " (key required)" : "");
  }

  // The HTTP API: a gateway that runs each call through the service over an in-process
  // channel (server/http_api.h). A JSON body may take a few times its message's bytes.
  grpc::ChannelArguments inproc_args;
  inproc_args.SetMaxReceiveMessageSize(-1);
  HttpApiOptions http_options;
  http_options.model_name = info.model_name;
  http_options.threads = config.server.http_threads;
  http_options.max_body_bytes = 4 * int64_t(max_receive_bytes);
  http_options.replica_id = config.server.replica_id;
  HttpApiServer http_api(server->InProcessChannel(inproc_args), auth->get(), tls->get(),
                         tokenizer->get(), http_options);
  if (!config.server.http_listen.empty()) {
    if (Status s = http_api.start(config.server.http_listen); !s.ok()) {
      metrics_http.stop();
      server->Shutdown();
      return fail(s);
    }
    spdlog::info(
        "HTTP API on {}://{} (port {}): OpenAI /v1/completions and "
        "/v1/chat/completions, the tree API /v1/trees, the viewer /viewer{}",
        *tls != nullptr ? "https" : "http", config.server.http_listen, http_api.port(),
        (*auth)->enabled() ? " (key required)" : "");
  }

  // Signals from now on. While the model loads there is nothing to drain: a signal ends the
  // process at once. Once it serves, a signal drains (see the comments below). A failed load
  // wakes this thread with SIGTERM after setting load_failed.
  std::atomic<Scheduler*> serving{nullptr};
  std::atomic<bool> load_failed{false};
  std::thread waiter([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    if (load_failed.load()) return;
    const char* name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
    Scheduler* scheduler = serving.load();
    if (scheduler == nullptr) {
      spdlog::info("received {} while loading the model: exiting", name);
      std::fflush(stdout);
      std::_Exit(0);
    }
    spdlog::info("received {}, shutting down (grace {} ms)", name, config.server.shutdown_grace_ms);
    // Drain: refuse new calls, let in-flight ones finish within the grace period, then end
    // what is left (streams close UNAVAILABLE, their branches FINISH_CANCELLED). gRPC's own
    // Shutdown(deadline) would also wait for idle client connections, so it is called only
    // once no call is left.
    service.begin_drain();
    http_api.begin_drain();
    server->GetHealthCheckService()->SetServingStatus(false);
    const auto grace_end = std::chrono::steady_clock::now() +
                           std::chrono::milliseconds(config.server.shutdown_grace_ms);
    while (service.active_calls() > 0 && std::chrono::steady_clock::now() < grace_end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (service.active_calls() > 0) {
      spdlog::warn("{} calls still running after the grace period: cancelling them",
                   service.active_calls());
    }
    scheduler->shutdown();
    const auto cancel_end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (service.active_calls() > 0 && std::chrono::steady_clock::now() < cancel_end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  });
  // A failed load: stop the listeners and the signal thread, exit 1 with the reason.
  auto fail_loading = [&](const Status& s) {
    spdlog::error("{}", s.message());
    load_failed = true;
    pthread_kill(waiter.native_handle(), SIGTERM);
    waiter.join();
    http_api.stop();
    metrics_http.stop();
    server->Shutdown(std::chrono::system_clock::now());
    return 1;
  };

  // The model runtime and the scheduler that drives it.
  const auto load_start = std::chrono::steady_clock::now();
  if (const char* delay = std::getenv("TREESERVE_LOAD_DELAY_MS")) {
    // For tests of readiness: the load takes at least this long.
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoll(delay)));
  }
  const bool lines = !isatty(fileno(stderr));
  std::unique_ptr<Backend> engine;
  {
    StatusOr<std::unique_ptr<Backend>> created = Unavailable("no backend");
    CpuBackendOptions cpu;
    cpu.num_pages = pages;
    cpu.page_size = config.kv_cache.page_size;
    cpu.num_threads = config.engine.cpu_threads;
    cpu.baseline_attention = config.engine.attention == "baseline";
    cpu.kv_cache_fp8 = kv_fp8;
#ifdef TREESERVE_HAVE_CUDA
    CudaBackendOptions cuda;
    cuda.num_pages = pages;
    cuda.page_size = config.kv_cache.page_size;
    cuda.bfloat16 = bfloat16;
    cuda.kv_cache_fp8 = kv_fp8;
    // num_pages is per rank; each rank holds its KV heads' share of every page.
    cuda.tensor_parallel = config.engine.tensor_parallel;
    cuda.baseline_attention = config.engine.attention == "baseline";
    cuda.cuda_graphs = config.engine.cuda_graphs;
    cuda.gemm_autotune = config.engine.gemm_autotune;
    cuda.p2p_all_reduce = config.engine.p2p_all_reduce;
    cuda.gemm_split_k = config.engine.gemm_split_k;
#endif
    const int64_t weight_bytes = parameter_count(*model_config) * (backend == "cpu" ? 4 : 2);
    const std::string weights_stage =
        backend == "cpu" ? "float32 weights for the cpu backend"
                         : "weights on " + std::to_string(config.engine.tensor_parallel) + " GPU" +
                               (config.engine.tensor_parallel > 1 ? "s" : "");
    if (random_weights) {
      const uint64_t seed = uint64_t(config.model.random_weights_seed);
      warn_random_weights(config.model.dir, seed);
      LoadProgress progress;
      progress.begin("drawing random " + weights_stage, weight_bytes);
      if (backend == "cuda") {
#ifdef TREESERVE_HAVE_CUDA
        created = create_cuda_backend_random(*model_config, cuda, seed);
#endif
      } else {
        created = create_cpu_backend_random(*model_config, cpu, seed);
      }
      if (created.ok()) progress.end();
    } else {
      auto reader = SafetensorsReader::open_dir(config.model.dir);
      if (reader.status().code() == StatusCode::kNotFound) {
        return fail_loading(Status(reader.status().code(),
                                   reader.status().message() +
                                       " (to serve this model's shape without weights, pass "
                                       "--random-weights SEED)"));
      }
      if (!reader.ok()) return fail_loading(reader.status());
      auto weights = load_llama_weights(*model_config, *reader);
      if (!weights.ok()) return fail_loading(weights.status());
      LoadProgress progress;
      if (lines) page_in_checkpoint(*weights, &progress);
      progress.begin(weights_stage, weight_bytes);
      if (backend == "cuda") {
#ifdef TREESERVE_HAVE_CUDA
        created = create_cuda_backend(*model_config, *weights, cuda);
#endif
      } else {
        created = create_cpu_backend(*model_config, *weights, cpu);
      }
      if (created.ok()) progress.end();
    }
    if (!created.ok()) return fail_loading(created.status());
    engine = std::move(*created);
  }
  SchedulerOptions sched;
  sched.max_live_trees = config.limits.max_live_trees;
  sched.max_step_tokens = config.scheduler.max_step_tokens;
  sched.max_step_rows = config.scheduler.max_step_rows;
  sched.default_max_tokens = config.scheduler.default_max_tokens;
  sched.prefix_sharing = config.kv_cache.prefix_sharing;
  sched.max_sequence_tokens = model_config->max_sequence_tokens();
  if (keys_file) sched.tenants = scheduler_tenants(*keys_file);
  sched.replica_id = config.server.replica_id;
  sched.incarnation = info.incarnation;
  auto scheduler = Scheduler::create(engine.get(), tokenizer->get(), sched, &metrics);
  if (!scheduler.ok()) return fail_loading(scheduler.status());

  service.set_ready(scheduler->get());
  http_api.set_ready((*scheduler)->detokenizer_vocab());
  serving = scheduler->get();
  server->GetHealthCheckService()->SetServingStatus(true);
  spdlog::info(
      "treeserve {} ready: model={} ({} layers, hidden {}, {} heads / {} kv heads, vocab {}) "
      "backend={} listen={} (port {}) kv_capacity={} pages x {} tokens = {} tokens ({} MiB) "
      "kv_dtype={}{} loaded in {:.1f} s",
      TREESERVE_VERSION, config.model.dir + (random_weights ? " (RANDOM WEIGHTS)" : ""),
      model_config->num_hidden_layers, model_config->hidden_size, model_config->num_attention_heads,
      model_config->num_key_value_heads, model_config->vocab_size, backend, config.server.listen,
      selected_port, pages, layout.page_size, pages * layout.page_size,
      config.kv_cache.memory_bytes >> 20, info.kv_cache_dtype,
      kv_fp8 && backend == "cpu" ? " (emulated in the float32 pool)" : "",
      std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count());

  server->Wait();
  waiter.join();
  (*scheduler)->shutdown();
  http_api.stop();
  metrics_http.stop();
  spdlog::info("treeserve stopped");
  return 0;
}

}  // namespace treeserve
