// GPU harness shared by the GPU tests and the tree-attention benchmark: random Q/K/V for a
// TreeCase (rounded to the kernel dtype, so the float32 CPU references see exactly the
// kernel's inputs), their device copies, and running a plan on the GPU next to the CPU plan
// executor or the naive reference. Host code only (links cudart).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/attention_plan.h"
#include "kernels/kv_layout.h"
#include "kernels/testing/random_tree.h"
#include "kernels/tree_attention.h"

namespace treeserve::testing {

// True when cudaGetDeviceCount succeeds with at least one device.
bool cuda_device_available();
// CUDA devices present (0 when cudaGetDeviceCount fails).
int32_t cuda_device_count();

// Workspace limits that fit every plan of `plans` (items, partials, segments, masks, queries,
// view pages, longest item, token-table entries) at num_q_heads x head_dim.
TreeAttentionLimits workspace_limits_for(const std::vector<AttentionPlan>& plans,
                                         int32_t num_q_heads, int32_t head_dim);

// n dtype elements of device memory (on any device; the caller has synchronised its writers)
// as floats.
Status download_as_float(const void* data, size_t n, TreeAttentionDtype dtype,
                         std::vector<float>* out);

// Enqueues a kernel that reads bytes of buffer (device memory, larger than L2) so the next
// kernel starts with a cold L2 and no dirty lines; sink: 4 bytes of device memory.
void flush_l2_by_reading(const void* buffer, size_t bytes, void* sink, cudaStream_t stream);

// Host and device tensors of one attention problem over a TreeCase.
class GpuAttentionProblem {
 public:
  GpuAttentionProblem() = default;
  ~GpuAttentionProblem();
  GpuAttentionProblem(const GpuAttentionProblem&) = delete;
  GpuAttentionProblem& operator=(const GpuAttentionProblem&) = delete;

  // Random values in [-1, 1] (q scaled by q_scale), rounded to dtype, copied to the device.
  // out is filled with a sentinel so rows no query names can be checked.
  Status init(const TreeCase& tree, int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
              TreeAttentionDtype dtype, uint64_t seed, float q_scale = 1.f);

  // Uploads the plan into ws and launches the kernels on stream (no synchronisation).
  Status launch(const AttentionPlan& plan, TreeAttentionWorkspace* ws, cudaStream_t stream) const;
  // Kernels only (plan already uploaded).
  Status launch_uploaded(const TreeAttentionWorkspace& ws, cudaStream_t stream,
                         TreeAttentionGrid grid = {}) const;

  // Device output as float: [num_rows][num_q_heads][head_dim].
  Status download_out(std::vector<float>* out) const;
  Status reset_out() const;  // back to the sentinel

  // CPU plan executor (float32) over the same (rounded) inputs; rows no query names keep the
  // sentinel.
  Status reference_plan(const AttentionPlan& plan, std::vector<float>* out) const;
  // The CPU plan executor's merged states (execute_attention_plan_cpu_state): o
  // [num_queries][num_q_heads][head_dim], lse [num_queries][num_q_heads] (natural log).
  Status reference_plan_state(const AttentionPlan& plan, std::vector<float>* o,
                              std::vector<float>* lse) const;
  // Naive per-query reference (double) for the given view queries only.
  Status reference_naive(const std::vector<int32_t>& queries, std::vector<float>* out) const;

  // Max |a - b| over the rows of the given view queries (all queries if empty).
  float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b,
                     const std::vector<int32_t>& queries = {}) const;
  // True when every row no query names still holds the sentinel in out.
  bool untouched_rows_kept(const std::vector<float>& out) const;

  // Device tensors (on the device that was current at init) and the output's element count.
  const void* device_q() const { return d_q_; }
  const void* device_k() const { return d_k_; }
  const void* device_v() const { return d_v_; }
  void* device_out() const { return d_out_; }
  size_t out_elems() const { return size_t(num_rows_) * num_q_heads_ * layout_.head_dim; }
  TreeAttentionDtype dtype() const { return dtype_; }

  const TreeCase& tree() const { return *tree_; }
  const KvLayout& layout() const { return layout_; }
  int32_t num_q_heads() const { return num_q_heads_; }
  int32_t num_rows() const { return num_rows_; }
  float sm_scale() const { return sm_scale_; }

  static constexpr float kSentinel = 7.f;

 private:
  const TreeCase* tree_ = nullptr;
  KvLayout layout_;
  TreeAttentionDtype dtype_ = TreeAttentionDtype::kFloat16;
  int32_t num_q_heads_ = 0;
  int32_t num_rows_ = 0;  // tree rows + 2 rows no query names
  float sm_scale_ = 1.f;
  std::vector<float> q_, k_, v_;  // rounded to dtype
  void* d_q_ = nullptr;
  void* d_k_ = nullptr;
  void* d_v_ = nullptr;
  void* d_out_ = nullptr;
};

}  // namespace treeserve::testing
