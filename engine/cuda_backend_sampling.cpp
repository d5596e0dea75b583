// The CUDA backend's sampling on the device (detail/cuda_backend_impl.h): greedy, temperature,
// top-k / top-p and logprobs on the logit rows, and for tensor-parallel steps the gather of
// the ranks' vocabulary shards on rank 0.
#include "engine/detail/cuda_backend_impl.h"

namespace treeserve::detail {

Status CudaBackend::sample_on_device(const StepBatch& batch, Logits* out) {
  const int64_t n = int64_t(batch.logit_rows.size());
  TS_RETURN_IF_ERROR(reserve_sampling(n));
  TS_RETURN_IF_ERROR(enqueue_sampling(batch, logits_.as<float>()));
  // Same stream: the params upload has read the pinned buffer before this overwrites it.
  TS_CUDA(cudaMemcpyAsync(host_logits_.ptr, sample_out_.ptr, size_t(n) * sizeof(cuda::DeviceSample),
                          cudaMemcpyDeviceToHost, stream_),
          "sampled tokens download");
  TS_CUDA(cudaStreamSynchronize(stream_), "step");
  out->data.clear();
  out->argmax.clear();
  out->argmax_logprob.clear();
  detail::append_device_samples(host_logits_.as<const cuda::DeviceSample>(), n, &out->sampled);
  return Status::Ok();
}

Status CudaBackend::reserve_sampling(int64_t n) {
  const size_t param_bytes = size_t(n) * sizeof(cuda::DeviceSamplingRow);
  const size_t out_bytes = size_t(n) * sizeof(cuda::DeviceSample);
  TS_RETURN_IF_ERROR(sample_params_.reserve(param_bytes, "sampling params"));
  TS_RETURN_IF_ERROR(sample_out_.reserve(out_bytes, "sampled tokens"));
  return host_logits_.reserve(std::max(param_bytes, out_bytes), "pinned sampling rows");
}

Status CudaBackend::enqueue_sampling(const StepBatch& batch, const float* rows) {
  const int64_t n = int64_t(batch.logit_rows.size());
  auto* params = host_logits_.as<cuda::DeviceSamplingRow>();
  for (int64_t i = 0; i < n; ++i) {
    const StepSampling& s = batch.sampling[size_t(i)];
    params[i] = detail::device_sampling_row(s.params, s.stream_key, s.position);
  }
  TS_CUDA(
      cudaMemcpyAsync(sample_params_.ptr, host_logits_.ptr,
                      size_t(n) * sizeof(cuda::DeviceSamplingRow), cudaMemcpyHostToDevice, stream_),
      "sampling params upload");
  const int64_t limit = batch.drawable_vocab(config_.vocab_size);
  TS_CUDA(static_cast<cudaError_t>(cuda::sample_rows(
              rows, n, config_.vocab_size, limit, sample_params_.as<cuda::DeviceSamplingRow>(),
              sample_out_.as<cuda::DeviceSample>(), stream_)),
          "sampling launch");
  return Status::Ok();
}

Status CudaBackend::gather_and_sample(const StepBatch& batch, const ShardOutput& out) {
  const int64_t n = int64_t(batch.logit_rows.size());
  const size_t part = size_t(n * vocab_);  // every shard has vocab_ columns
  const bool communicate = !options_.skip_collectives;
  if (shard_.rank != 0) {
    if (communicate) {
      TS_RETURN_IF_ERROR(
          nccl_status(ncclSend(logits_.ptr, part, ncclFloat32, 0, comm_, stream_), "logits send"));
    }
    return Status::Ok();
  }
  float* recv = gather_recv_.as<float>();
  if (communicate) {
    TS_RETURN_IF_ERROR(nccl_status(ncclGroupStart(), "group start"));
    for (int32_t r = 1; r < world_; ++r) {
      const ncclResult_t got =
          ncclRecv(recv + size_t(r - 1) * part, part, ncclFloat32, r, comm_, stream_);
      if (got != ncclSuccess) {
        ncclGroupEnd();
        return nccl_status(got, "logits receive");
      }
    }
    TS_RETURN_IF_ERROR(nccl_status(ncclGroupEnd(), "group end"));
  }
  // Rank r's shard is columns [vocab_begin(r), + vocab_) of every row.
  float* rows = gathered_.as<float>();
  const int64_t vocab = config_.vocab_size;
  for (int32_t r = 0; r < world_; ++r) {
    const float* src = r == 0 ? logits_.as<float>() : recv + size_t(r - 1) * part;
    const int64_t begin = tensor_parallel_shard(config_, r, world_).vocab_begin;
    TS_CUDA(cudaMemcpy2DAsync(rows + begin, size_t(vocab) * 4, src, size_t(vocab_) * 4,
                              size_t(vocab_) * 4, size_t(n), cudaMemcpyDeviceToDevice, stream_),
            "logits gather");
  }
  TS_RETURN_IF_ERROR(enqueue_sampling(batch, rows));
  TS_CUDA(cudaMemcpyAsync(out.sampled, sample_out_.ptr, size_t(n) * sizeof(cuda::DeviceSample),
                          cudaMemcpyDeviceToHost, stream_),
          "sampled tokens download");
  return Status::Ok();
}

}  // namespace treeserve::detail
