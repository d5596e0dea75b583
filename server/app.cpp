// Start-up and shutdown of the treeserve process.
#include "server/app.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <filesystem>
#include <optional>
#include <thread>

#include "common/metrics.h"
#include "engine/backend.h"
#ifdef TREESERVE_HAVE_CUDA
#include "engine/cuda_backend.h"
#endif
#include "kernels/kv_layout.h"
#include "models/llama_weights.h"
#include "models/model_config.h"
#include "models/safetensors.h"
#include "models/tokenizer.h"
#include "scheduler/scheduler.h"
#include "server/config.h"
#include "server/metrics_http.h"
#include "server/treeserve_service.h"

#ifndef TREESERVE_TINY_MODEL_DIR
#define TREESERVE_TINY_MODEL_DIR ""
#endif

namespace treeserve {
namespace {

struct CommandLine {
  std::string config_file;
  std::optional<std::string> model, listen, backend, log_level, metrics_listen;
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

}  // namespace

int run_treeserve(int argc, char** argv) {
  // Block the shutdown signals first, before any library starts a thread: every thread
  // inherits the mask, so only the sigwait thread below ever sees SIGTERM/SIGINT.
  sigset_t signals = shutdown_signals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
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
  app.add_option("--kv-cache-bytes", cl.kv_cache_bytes, "KV pool budget in bytes");
  app.add_option("--random-weights", cl.random_weights,
                 "serve random weights drawn from SEED instead of the checkpoint's (the model "
                 "dir needs only config.json and tokenizer.model)")
      ->check(CLI::NonNegativeNumber);
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
  if (cl.kv_cache_bytes) config.kv_cache.memory_bytes = *cl.kv_cache_bytes;
  if (cl.page_size) config.kv_cache.page_size = *cl.page_size;
  if (cl.tensor_parallel) config.engine.tensor_parallel = *cl.tensor_parallel;
  if (cl.cuda_graphs) config.engine.cuda_graphs = *cl.cuda_graphs;
  if (cl.gemm_autotune) config.engine.gemm_autotune = *cl.gemm_autotune;
  if (cl.p2p_all_reduce) config.engine.p2p_all_reduce = *cl.p2p_all_reduce;
  if (cl.gemm_split_k) config.engine.gemm_split_k = *cl.gemm_split_k;
  if (cl.random_weights) config.model.random_weights_seed = *cl.random_weights;
  if (config.model.dir.empty()) config.model.dir = default_model_dir();
  if (Status s = validate_config(config); !s.ok()) return fail(s);
  spdlog::set_level(spdlog::level::from_str(config.log_level));
  if (cl.print_config) {
    std::printf("%s\n", config_to_json(config).c_str());
    return 0;
  }
  spdlog::info("effective config: {}", config_to_json(config));

  if (config.model.dir.empty() || !std::filesystem::is_directory(config.model.dir)) {
    return fail(NotFound("model directory '" + config.model.dir +
                         "' does not exist (pass --model DIR, or build the default tiny model "
                         "with `cmake --build build --target tiny_model`)"));
  }
  auto model_config = load_model_config(config.model.dir);
  if (!model_config.ok()) return fail(model_config.status());
  auto tokenizer = Tokenizer::load(config.model.dir + "/tokenizer.model");
  if (!tokenizer.ok()) return fail(tokenizer.status());

  std::string backend;
  if (Status s = resolve_backend(config.engine.backend, &backend); !s.ok()) return fail(s);
  if (config.engine.tensor_parallel != 1 && backend != "cuda") {
    return fail(InvalidArgument(
        "engine.tensor_parallel = " + std::to_string(config.engine.tensor_parallel) +
        " needs the cuda backend (engine.backend resolved to '" + backend +
        "'); use 1 with the cpu backend"));
  }

  // KV capacity: the CPU backend keeps KV in float32.
  KvLayout layout;
  layout.num_layers = static_cast<int32_t>(model_config->num_hidden_layers);
  layout.num_kv_heads = static_cast<int32_t>(model_config->num_key_value_heads);
  layout.head_dim = static_cast<int32_t>(model_config->head_dim);
  layout.page_size = config.kv_cache.page_size;
  layout.dtype_bytes = backend == "cpu" ? 4 : 2;
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
  info.max_sequence_tokens = model_config->max_position_embeddings;

  // The model runtime and the scheduler that drives it.
  MetricsRegistry metrics_registry;
  ServerMetrics metrics(&metrics_registry);
  std::unique_ptr<Backend> engine;
  {
    StatusOr<std::unique_ptr<Backend>> created = Unavailable("no backend");
    CpuBackendOptions cpu;
    cpu.num_pages = pages;
    cpu.page_size = config.kv_cache.page_size;
    cpu.num_threads = config.engine.cpu_threads;
    cpu.baseline_attention = config.engine.attention == "baseline";
#ifdef TREESERVE_HAVE_CUDA
    CudaBackendOptions cuda;
    cuda.num_pages = pages;
    cuda.page_size = config.kv_cache.page_size;
    cuda.bfloat16 = model_config->torch_dtype == "bfloat16";
    // num_pages is per rank; each rank holds its KV heads' share of every page.
    cuda.tensor_parallel = config.engine.tensor_parallel;
    cuda.baseline_attention = config.engine.attention == "baseline";
    cuda.cuda_graphs = config.engine.cuda_graphs;
    cuda.gemm_autotune = config.engine.gemm_autotune;
    cuda.p2p_all_reduce = config.engine.p2p_all_reduce;
    cuda.gemm_split_k = config.engine.gemm_split_k;
#endif
    if (random_weights) {
      const uint64_t seed = uint64_t(config.model.random_weights_seed);
      warn_random_weights(config.model.dir, seed);
      if (backend == "cuda") {
#ifdef TREESERVE_HAVE_CUDA
        created = create_cuda_backend_random(*model_config, cuda, seed);
#endif
      } else {
        created = create_cpu_backend_random(*model_config, cpu, seed);
      }
    } else {
      auto reader = SafetensorsReader::open_dir(config.model.dir);
      if (reader.status().code() == StatusCode::kNotFound) {
        return fail(Status(reader.status().code(),
                           reader.status().message() +
                               " (to serve this model's shape without weights, pass "
                               "--random-weights SEED)"));
      }
      if (!reader.ok()) return fail(reader.status());
      auto weights = load_llama_weights(*model_config, *reader);
      if (!weights.ok()) return fail(weights.status());
      if (backend == "cuda") {
#ifdef TREESERVE_HAVE_CUDA
        created = create_cuda_backend(*model_config, *weights, cuda);
#endif
      } else {
        created = create_cpu_backend(*model_config, *weights, cpu);
      }
    }
    if (!created.ok()) return fail(created.status());
    engine = std::move(*created);
  }
  SchedulerOptions sched;
  sched.max_live_trees = config.limits.max_live_trees;
  sched.max_step_tokens = config.scheduler.max_step_tokens;
  sched.max_step_rows = config.scheduler.max_step_rows;
  sched.default_max_tokens = config.scheduler.default_max_tokens;
  sched.prefix_sharing = config.kv_cache.prefix_sharing;
  sched.max_sequence_tokens = model_config->max_position_embeddings;
  auto scheduler = Scheduler::create(engine.get(), tokenizer->get(), sched, &metrics);
  if (!scheduler.ok()) return fail(scheduler.status());

  TreeServeService service(config, tokenizer->get(), info, scheduler->get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int selected_port = -1;
  builder.AddListeningPort(config.server.listen, grpc::InsecureServerCredentials(), &selected_port);
  // The service itself refuses requests over max_request_bytes with INVALID_ARGUMENT; the
  // transport takes a margin more so that such requests reach it.
  builder.SetMaxReceiveMessageSize(
      int(std::min<int64_t>(int64_t(config.server.max_request_bytes) * 2 + (1 << 20), INT32_MAX)));
  builder.RegisterService(&service);

  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || selected_port <= 0) {
    return fail(Unavailable("cannot listen on " + config.server.listen +
                            " (address in use, or not an address of this machine)"));
  }
  spdlog::info(
      "treeserve {} ready: model={} ({} layers, hidden {}, {} heads / {} kv heads, vocab {}) "
      "backend={} listen={} (port {}) kv_capacity={} pages x {} tokens = {} tokens ({} MiB)",
      TREESERVE_VERSION, config.model.dir + (random_weights ? " (RANDOM WEIGHTS)" : ""),
      model_config->num_hidden_layers, model_config->hidden_size, model_config->num_attention_heads,
      model_config->num_key_value_heads, model_config->vocab_size, backend, config.server.listen,
      selected_port, pages, layout.page_size, pages * layout.page_size,
      config.kv_cache.memory_bytes >> 20);

  MetricsHttpServer metrics_http(&metrics_registry);
  if (!config.server.metrics_listen.empty()) {
    if (Status s = metrics_http.start(config.server.metrics_listen); !s.ok()) {
      server->Shutdown();
      return fail(s);
    }
    spdlog::info("metrics on http://{}/metrics", config.server.metrics_listen);
  }

  std::thread waiter([&] {
    int sig = 0;
    sigwait(&signals, &sig);
    spdlog::info("received {}, shutting down (grace {} ms)", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                 config.server.shutdown_grace_ms);
    // Drain: refuse new calls, let in-flight ones finish within the grace period, then end
    // what is left (streams close UNAVAILABLE, their branches FINISH_CANCELLED). gRPC's own
    // Shutdown(deadline) would also wait for idle client connections, so it is called only
    // once no call is left.
    service.begin_drain();
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
    (*scheduler)->shutdown();
    const auto cancel_end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (service.active_calls() > 0 && std::chrono::steady_clock::now() < cancel_end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  });
  server->Wait();
  waiter.join();
  (*scheduler)->shutdown();
  metrics_http.stop();
  spdlog::info("treeserve stopped");
  return 0;
}

}  // namespace treeserve
