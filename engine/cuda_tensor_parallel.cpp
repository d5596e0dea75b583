// The tensor-parallel CUDA backend: N ranks (detail::CudaRank, one per GPU) of one model,
// split Megatron-style (engine/tensor_parallel.h), each driven by its own persistent thread.
// A step is validated and its attention plan built once here; every rank uploads the same
// plan and runs its share of the layers, all-reducing the row-parallel GEMMs' partial sums
// over NCCL; the ranks' logits shards are gathered in pinned host memory (full rows) or
// merged there (greedy steps: argmax and log-softmax from each shard's max and sum).
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/cuda_ops.h"
#include "engine/detail/cuda_buffers.h"
#include "engine/detail/cuda_rank.h"
#include "engine/detail/rank_workers.h"
#include "engine/tensor_parallel.h"
#include "kernels/detail/peer_access.h"

namespace treeserve::detail {
namespace {

// N CudaBackend shards, one per GPU (devices options.device .. + N - 1), each driven by its
// own persistent thread. The communicators come from ncclCommInitAll: one process owns every
// GPU, so no unique id has to be handed around (ncclGetUniqueId + ncclCommInitRank are for
// one process per GPU), and one thread per communicator issues its collectives.
class TensorParallelBackend final : public Backend {
 public:
  TensorParallelBackend(const ModelConfig& config, const CudaBackendOptions& options)
      : config_(config), options_(options), world_(options.tensor_parallel), workers_(world_) {
    // The pool as the scheduler sees it: every rank has these pages, each with its heads.
    layout_.num_layers = int32_t(config.num_hidden_layers);
    layout_.num_kv_heads = int32_t(config.num_key_value_heads);
    layout_.head_dim = int32_t(config.head_dim);
    layout_.page_size = options.page_size;
    layout_.num_pages = options.num_pages;
    layout_.set_element(2, options.kv_cache_fp8);
  }

  ~TensorParallelBackend() override {
    shards_.clear();  // each waits for its stream and frees its memory on its device
    if (!aborted_) {
      for (ncclComm_t c : comms_) ncclCommDestroy(c);
    }
    host_.release();
  }

  Status init() {
    // NVLink multicast (NVLS) stays off unless the operator set it: on shared hosts it can
    // take the GPUs out of service.
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    std::vector<int> devices(static_cast<size_t>(world_));
    for (int32_t r = 0; r < world_; ++r) devices[size_t(r)] = options_.device + r;
    comms_.assign(size_t(world_), nullptr);
    const ncclResult_t nr = ncclCommInitAll(comms_.data(), world_, devices.data());
    if (nr != ncclSuccess) {
      comms_.clear();
      return Unavailable("tensor_parallel = " + std::to_string(world_) +
                         ": NCCL could not connect devices " + std::to_string(options_.device) +
                         ".." + std::to_string(options_.device + world_ - 1) + ": " +
                         ncclGetErrorString(nr));
    }
    for (int32_t r = 0; r < world_; ++r) {
      shards_.push_back(make_cuda_rank(config_, options_, r, world_, comms_[size_t(r)]));
    }
    TS_RETURN_IF_ERROR(workers_.run([&](int32_t r) { return shards_[size_t(r)]->init(); }));
    if (options_.p2p_all_reduce) enable_p2p(devices);
    return Status::Ok();
  }

  // The peer-to-peer all-reduce needs every device to map every other's memory; without
  // that (or if enabling it fails) the ranks keep NCCL for every all-reduce.
  void enable_p2p(const std::vector<int>& devices) {
    if (world_ > cuda::kMaxP2PRanks) return;
    int previous_device = 0;
    cudaGetDevice(&previous_device);
    bool ok = true;
    for (int a : devices) {
      for (int b : devices) {
        if (a == b) continue;
        int can = 0;
        if (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || !can) ok = false;
        if (!ok) break;
        if (detail::enable_peer_access(a, b) != cudaSuccess) {
          cudaGetLastError();
          ok = false;
        }
      }
      if (!ok) break;
    }
    cudaSetDevice(previous_device);
    std::vector<CudaRank::P2PEndpoint> ends;
    for (const auto& shard : shards_) {
      ends.push_back(shard->p2p_endpoint());
      if (ends.back().flags == nullptr) ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "treeserve: tensor parallel: no peer access between all devices; all-reduces "
                   "go through NCCL\n");
      return;
    }
    for (const auto& shard : shards_) shard->set_p2p_peers(ends);
  }

  // Every rank loads its slices in parallel, from the same mapped checkpoint.
  Status load(const LlamaWeights& weights) {
    return workers_.run([&](int32_t r) { return shards_[size_t(r)]->load(weights); });
  }
  Status randomize(uint64_t seed) {
    return workers_.run([&](int32_t r) { return shards_[size_t(r)]->randomize(seed); });
  }

  std::string_view name() const override { return "cuda"; }
  const ModelConfig& model_config() const override { return config_; }
  const KvLayout& kv_layout() const override { return layout_; }

  Status forward(const StepBatch& batch, Logits* out) override {
    if (aborted_) {
      return Internal(
          "CUDA tensor-parallel backend: a rank failed during an earlier step and the NCCL "
          "communicators were aborted; restart the server");
    }
    TS_RETURN_IF_ERROR(validate_step_batch(batch, layout_, config_.vocab_size, &check_));
    TS_RETURN_IF_ERROR(shards_[0]->build_plan(batch.view, &plan_));
    const int64_t n = int64_t(batch.logit_rows.size());
    const int64_t vocab = config_.vocab_size;
    // Allocations before any rank starts its collectives (cudaFree waits for its device).
    int previous_device = 0;
    cudaGetDevice(&previous_device);
    for (const auto& shard : shards_) TS_RETURN_IF_ERROR(shard->reserve_scratch(batch));
    cudaSetDevice(previous_device);
    // Sampling steps draw on rank 0 (the shards gathered there); full logits come to the host
    // in columns; greedy steps bring each rank's (max, sum, argmax) per row.
    const bool sampled = n > 0 && !batch.sampling.empty();
    const size_t host_bytes = sampled             ? size_t(n) * sizeof(cuda::DeviceSample)
                              : batch.full_logits ? size_t(n * vocab) * 4
                                                  : size_t(n * world_) * 12;
    TS_RETURN_IF_ERROR(host_.reserve(host_bytes, "pinned step output"));
    float* host = host_.as<float>();
    TS_RETURN_IF_ERROR(workers_.run([&](int32_t r) {
      ShardOutput o;
      o.logits = host;
      // Greedy: rank r's [maxes | sums | ids] of n rows each.
      o.maxes = host + int64_t(r) * n * 3;
      o.sums = o.maxes + n;
      o.ids = reinterpret_cast<int32_t*>(o.sums + n);
      o.sampled = host_.as<cuda::DeviceSample>();
      Status s = shards_[size_t(r)]->forward_shard(batch, plan_, o);
      // The other ranks may be waiting in an all-reduce this rank will never join: abort
      // the communicators so that their collectives return.
      if (!s.ok()) abort_communicators();
      return s;
    }));
    out->num_rows = int32_t(n);
    out->vocab = vocab;
    out->argmax.clear();
    out->argmax_logprob.clear();
    out->sampled.clear();
    if (sampled) {
      append_device_samples(host_.as<const cuda::DeviceSample>(), n, &out->sampled);
      out->data.clear();
      return Status::Ok();
    }
    if (n == 0 || batch.full_logits) {
      out->data.assign(host, host + n * vocab);
      return Status::Ok();
    }
    out->data.clear();
    merge_.resize(size_t(world_));
    for (int32_t r = 0; r < world_; ++r) {
      const float* part = host + int64_t(r) * n * 3;  // [maxes | sums | ids]
      merge_[size_t(r)] = {part, part + n, reinterpret_cast<const int32_t*>(part + 2 * n)};
    }
    out->argmax.resize(size_t(n));
    out->argmax_logprob.resize(size_t(n));
    merge_argmax_shards(merge_, n, out->argmax.data(), out->argmax_logprob.data());
    return Status::Ok();
  }

 private:
  void abort_communicators() {
    std::call_once(abort_once_, [this] {
      aborted_ = true;
      for (ncclComm_t c : comms_) ncclCommAbort(c);
    });
  }

  ModelConfig config_;
  CudaBackendOptions options_;
  int32_t world_;
  KvLayout layout_;
  std::vector<ncclComm_t> comms_;
  std::vector<std::unique_ptr<CudaRank>> shards_;
  StepBatchCheckScratch check_;
  AttentionPlan plan_;
  std::vector<ArgmaxShard> merge_;
  std::once_flag abort_once_;
  std::atomic<bool> aborted_{false};
  detail::PinnedBuffer host_{true};  // portable: every device's stream copies into it
  detail::RankWorkers workers_;      // idle between calls; joined after the shards are gone
};

}  // namespace

StatusOr<std::unique_ptr<Backend>> create_tensor_parallel_backend(const ModelConfig& config,
                                                                  const CudaBackendOptions& options,
                                                                  const LlamaWeights* weights,
                                                                  uint64_t seed) {
  auto backend = std::make_unique<TensorParallelBackend>(config, options);
  TS_RETURN_IF_ERROR(backend->init());
  if (weights != nullptr) {
    TS_RETURN_IF_ERROR(backend->load(*weights));
  } else {
    TS_RETURN_IF_ERROR(backend->randomize(seed));
  }
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace treeserve::detail
