// treeserve's effective configuration: one struct per component with its defaults here, read
// from a JSON preset (configs/) and overridden by the CLI.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"

namespace treeserve {

struct ServerOptions {
  std::string listen = "127.0.0.1:50051";
  std::string metrics_listen;  // "host:port" for Prometheus text; empty = off
  // "host:port" for the HTTP API (OpenAI endpoints, the tree API as JSON, the viewer:
  // server/http_api.h); empty = off.
  std::string http_listen;
  int32_t http_threads = 64;  // HTTP connections served at once (an SSE stream holds one)
  // When set (or $TREESERVE_API_KEY; server/auth.h), every TreeServe and reflection call and
  // every /metrics scrape needs "authorization: Bearer <token>".
  std::string auth_token;
  // A JSON file of API keys, each naming a tenant, and the tenants' quotas and cache salts
  // (server/keys_file.h; docs/operations.md, "Tenants and quotas"); empty = none.
  std::string keys_file;
  // TLS on the gRPC, metrics and HTTP API listeners (PEM files; empty = plaintext). With a
  // client CA, clients must present a certificate it signed (mutual TLS).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Serialized size of one request message; 0 = derived from the limits at start (the text
  // bound times the text fields one request can hold, plus room for ids: docs/api.md).
  int32_t max_request_bytes = 0;
  int32_t shutdown_grace_ms = 5000;  // in-flight calls get this long after SIGTERM
  // A tree's idle lease: deleted once no call has named it for this long. CreateTree's
  // lease_ms picks another, up to the maximum.
  int64_t tree_lease_default_s = 600;
  int64_t tree_lease_max_s = 86400;
  // This replica's name among replicas behind a proxy: every tree id it makes names it, and a
  // call naming a tree of another replica is refused naming that one (common/route_key.h;
  // docs/api.md, "Routing across replicas"). 1 to 32 of [a-z0-9-].
  std::string replica_id = "local";
};

struct ModelOptions {
  std::string dir;  // Hugging Face checkpoint dir; empty = the built tiny model
  // >= 0: serve random weights drawn from this seed instead of the checkpoint's (the dir
  // needs only config.json and its tokenizer files; safetensors there are ignored), for load
  // tests of a model shape without its weights. -1 = off.
  int64_t random_weights_seed = -1;
  // A Jinja chat template file for `messages` prompts, in place of the checkpoint's own
  // (tokenizer_config.json's chat_template, chat_template.jinja); empty = the checkpoint's.
  std::string chat_template;
  // The linear layers' quantization (models/model_config.h, apply_quantization_option):
  // "auto" = the checkpoint's own (16-bit, or its FP8 quantization_config); "fp8" = FP8, a
  // 16-bit checkpoint's weights quantized at load; "none" = 16-bit (refused on FP8 checkpoints).
  std::string quantization = "auto";
};

struct EngineOptions {
  std::string backend = "auto";  // "cpu" | "cuda" | "auto"
  int32_t cpu_threads = 0;       // 0 = hardware concurrency
  int32_t tensor_parallel = 1;
  // "tree": the flattened tree-attention plan (each shared KV run read once per step);
  // "baseline": per-query attention over each query's whole root-to-leaf path, what a
  // prefix-unaware server does (to compare the two side by side; see
  // configs/server/no-prefix-sharing.json).
  std::string attention = "tree";
  // CUDA backend: replay each decode shape's layer chain as a CUDA graph (per rank too).
  bool cuda_graphs = true;
  // CUDA backend: choose each GEMM shape's cublasLt algorithm by timing its candidates the
  // first time the shape runs (false: cuBLAS's default choice).
  bool gemm_autotune = true;
  // Tensor parallel: the O/down all-reduces of small steps run peer to peer over NVLink, fused
  // with the norm (when every pair of GPUs has peer access); false: NCCL for all of them.
  bool p2p_all_reduce = true;
  // CUDA backend, one GPU: split-K parts of the O and down GEMMs of steps of up to 256 rows
  // (0..8; 0 = auto: 2 parts where the GEMM tuner times them faster, per row bucket; 1 = never;
  // 2..8 = always that many where they divide K).
  int32_t gemm_split_k = 0;
};

struct KvCacheOptions {
  int32_t page_size = 16;            // tokens per page, 1..256
  int64_t memory_bytes = 256 << 20;  // KV pool budget
  bool prefix_sharing = true;        // global radix-cache reuse across trees
  // K and V's element type (models/quantization.h, parse_kv_cache_dtype): "auto" = the
  // model's (fp16/bf16 on CUDA, float32 on the CPU); "fp8" (alias "fp8_e4m3") = e4m3 with a
  // float32 scale per (token, kv head) row, about twice the tokens in the same memory on CUDA
  // (the CPU backend emulates its numerics in its float32 pool).
  std::string dtype = "auto";
};

struct LimitOptions {
  int32_t max_prompt_tokens = 8192;
  int32_t max_n = 256;        // branches per fork / one-shot n
  int32_t max_tokens = 4096;  // per branch per Generate call
  int32_t max_verify_tokens = 256;
  int32_t max_stop_strings = 16;
  int32_t max_live_trees = 4096;
  // TreeSearch in client-scoring mode: how long the server waits for a level's scores before
  // ending the search DEADLINE_EXCEEDED (and pruning what it made).
  int32_t tree_search_score_timeout_ms = 60000;
};

struct SchedulerConfig {
  int32_t max_step_tokens = 512;    // prefill tokens per step
  int32_t max_step_rows = 4096;     // rows (all kinds) per step; the rest waits a step
  int32_t default_max_tokens = 16;  // Generate's max_tokens when the request says 0
};

struct TreeserveConfig {
  ServerOptions server;
  ModelOptions model;
  EngineOptions engine;
  KvCacheOptions kv_cache;
  LimitOptions limits;
  SchedulerConfig scheduler;
  std::string log_level = "info";
};

// Parses a JSON preset on top of `config` (keys not present keep their value). Unknown keys
// and ill-typed values are errors naming the key, so a typo never silently does nothing.
Status merge_config_json(const std::string& json_text, const std::string& source_name,
                         TreeserveConfig* config);
Status load_config_file(const std::string& path, TreeserveConfig* config);

// Checks ranges and formats (listen address, page size, backend name, log level).
Status validate_config(const TreeserveConfig& config);

// "host:port" with a non-empty host and a port in [0, 65535]; IPv6 as "[::1]:port".
Status validate_listen_address(const std::string& address, const std::string& field);

// The effective config as JSON, for the start-up log and GetServerInfo debugging.
std::string config_to_json(const TreeserveConfig& config);

}  // namespace treeserve
