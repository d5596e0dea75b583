// GPU harness for tree-attention tests and benchmarks (see gpu_attention_harness.h).
#include "kernels/testing/gpu_attention_harness.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/attention_cpu.h"
#include "kernels/detail/tree_attention_launch.h"

namespace treeserve::testing {
namespace {

Status cuda_check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

// splitmix64: fast, seedable; tensors here run to tens of millions of elements.
uint64_t next_u64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Fills host (rounded floats) and bits (dtype) with values in [-scale, scale].
void random_tensor(size_t n, uint64_t seed, float scale, TreeAttentionDtype dtype,
                   std::vector<float>* host, std::vector<uint16_t>* bits) {
  host->resize(n);
  bits->resize(n);
  uint64_t state = seed;
  for (size_t i = 0; i < n; ++i) {
    const float x = scale * (float(next_u64(&state) >> 40) * (2.f / 16777216.f) - 1.f);
    if (dtype == TreeAttentionDtype::kFloat16) {
      const __half h = __float2half_rn(x);
      (*host)[i] = __half2float(h);
      (*bits)[i] = __half_as_ushort(h);
    } else {
      const __nv_bfloat16 b = __float2bfloat16_rn(x);
      (*host)[i] = __bfloat162float(b);
      (*bits)[i] = __bfloat16_as_ushort(b);
    }
  }
}

Status to_device(const std::vector<uint16_t>& bits, void** dst) {
  TS_RETURN_IF_ERROR(cuda_check(cudaMalloc(dst, bits.size() * 2), "cudaMalloc"));
  return cuda_check(cudaMemcpy(*dst, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice),
                    "cudaMemcpy H2D");
}

}  // namespace

bool cuda_device_available() { return cuda_device_count() > 0; }

int32_t cuda_device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

TreeAttentionLimits workspace_limits_for(const std::vector<AttentionPlan>& plans,
                                         int32_t num_q_heads, int32_t head_dim) {
  TreeAttentionLimits l;
  l.max_num_q_heads = num_q_heads;
  l.max_head_dim = head_dim;
  for (const AttentionPlan& p : plans) {
    int64_t tokens = 0;
    for (int32_t n : p.item_num_tokens) tokens += n;
    l.max_work_items = std::max(l.max_work_items, p.num_items());
    l.max_partials = std::max(l.max_partials, p.num_partials());
    l.max_segments = std::max(l.max_segments, p.num_segments());
    l.max_mask_words = std::max(l.max_mask_words, int32_t(p.mask_words.size()));
    l.max_queries = std::max(l.max_queries, p.num_queries());
    l.max_view_pages = std::max(l.max_view_pages, int32_t(p.page_table.size()));
    l.max_item_tokens = std::max(l.max_item_tokens, p.max_item_tokens);
    l.max_table_tokens = std::max<int32_t>(l.max_table_tokens, int32_t(tokens));
  }
  // Room for the fixed-stride table layout.
  l.max_table_tokens = std::max<int32_t>(
      l.max_table_tokens,
      int32_t(int64_t(l.max_work_items) * tree_attention_table_stride(l.max_item_tokens)));
  return l;
}

Status download_as_float(const void* data, size_t n, TreeAttentionDtype dtype,
                         std::vector<float>* out) {
  std::vector<uint16_t> bits(n);
  TS_RETURN_IF_ERROR(
      cuda_check(cudaMemcpy(bits.data(), data, n * 2, cudaMemcpyDefault), "cudaMemcpy D2H"));
  out->resize(n);
  for (size_t i = 0; i < n; ++i) {
    (*out)[i] = dtype == TreeAttentionDtype::kFloat16
                    ? __half2float(__ushort_as_half(bits[i]))
                    : __bfloat162float(__ushort_as_bfloat16(bits[i]));
  }
  return Status::Ok();
}

GpuAttentionProblem::~GpuAttentionProblem() {
  for (void* p : {d_q_, d_k_, d_v_, d_out_}) {
    if (p != nullptr) cudaFree(p);
  }
}

Status GpuAttentionProblem::init(const TreeCase& tree, int32_t num_q_heads, int32_t num_kv_heads,
                                 int32_t head_dim, TreeAttentionDtype dtype, uint64_t seed,
                                 float q_scale) {
  tree_ = &tree;
  dtype_ = dtype;
  num_q_heads_ = num_q_heads;
  layout_ = KvLayout{};
  layout_.num_layers = 1;
  layout_.num_kv_heads = num_kv_heads;
  layout_.head_dim = head_dim;
  layout_.page_size = tree.view.page_size;
  layout_.num_pages = tree.num_pages;
  layout_.dtype_bytes = 2;
  num_rows_ = tree.num_rows + 2;
  sm_scale_ = 1.f / std::sqrt(float(head_dim));
  std::vector<uint16_t> bits;
  const size_t row_elems = size_t(num_q_heads) * head_dim;
  random_tensor(size_t(num_rows_) * row_elems, seed, q_scale, dtype, &q_, &bits);
  TS_RETURN_IF_ERROR(to_device(bits, &d_q_));
  random_tensor(size_t(layout_.layer_elems()), seed + 1, 1.f, dtype, &k_, &bits);
  TS_RETURN_IF_ERROR(to_device(bits, &d_k_));
  random_tensor(size_t(layout_.layer_elems()), seed + 2, 1.f, dtype, &v_, &bits);
  TS_RETURN_IF_ERROR(to_device(bits, &d_v_));
  TS_RETURN_IF_ERROR(
      cuda_check(cudaMalloc(&d_out_, size_t(num_rows_) * row_elems * 2), "cudaMalloc(out)"));
  return reset_out();
}

Status GpuAttentionProblem::reset_out() const {
  const size_t n = size_t(num_rows_) * num_q_heads_ * layout_.head_dim;
  const uint16_t sentinel = dtype_ == TreeAttentionDtype::kFloat16
                                ? __half_as_ushort(__float2half_rn(kSentinel))
                                : __bfloat16_as_ushort(__float2bfloat16_rn(kSentinel));
  std::vector<uint16_t> bits(n, sentinel);
  return cuda_check(cudaMemcpy(d_out_, bits.data(), n * 2, cudaMemcpyHostToDevice),
                    "cudaMemcpy(out sentinel)");
}

Status GpuAttentionProblem::launch(const AttentionPlan& plan, TreeAttentionWorkspace* ws,
                                   cudaStream_t stream) const {
  TS_RETURN_IF_ERROR(ws->upload(plan, stream));
  return launch_uploaded(*ws, stream);
}

Status GpuAttentionProblem::launch_uploaded(const TreeAttentionWorkspace& ws, cudaStream_t stream,
                                            TreeAttentionGrid grid) const {
  return launch_tree_attention(d_q_, d_k_, d_v_, d_out_, dtype_, num_q_heads_, layout_.num_kv_heads,
                               layout_.head_dim, layout_.page_size, sm_scale_, ws, stream, grid);
}

Status GpuAttentionProblem::download_out(std::vector<float>* out) const {
  TS_RETURN_IF_ERROR(cuda_check(cudaDeviceSynchronize(), "kernel execution"));
  return download_as_float(d_out_, out_elems(), dtype_, out);
}

Status GpuAttentionProblem::reference_plan(const AttentionPlan& plan,
                                           std::vector<float>* out) const {
  out->assign(size_t(num_rows_) * num_q_heads_ * layout_.head_dim, kSentinel);
  AttentionCpuWorkspace ws;
  return execute_attention_plan_cpu(plan, tree_->view, layout_, q_.data(), num_rows_, k_.data(),
                                    v_.data(), num_q_heads_, sm_scale_, out->data(), &ws);
}

Status GpuAttentionProblem::reference_plan_state(const AttentionPlan& plan, std::vector<float>* o,
                                                 std::vector<float>* lse) const {
  const size_t pairs = tree_->view.queries.size() * size_t(num_q_heads_);
  o->resize(pairs * layout_.head_dim);
  lse->resize(pairs);
  AttentionCpuWorkspace ws;
  return execute_attention_plan_cpu_state(plan, tree_->view, layout_, q_.data(), num_rows_,
                                          k_.data(), v_.data(), num_q_heads_, sm_scale_, o->data(),
                                          lse->data(), &ws);
}

Status GpuAttentionProblem::reference_naive(const std::vector<int32_t>& queries,
                                            std::vector<float>* out) const {
  out->assign(size_t(num_rows_) * num_q_heads_ * layout_.head_dim, kSentinel);
  AttentionView sub;  // same runs, only the sampled queries (naive reads nothing else)
  sub.page_size = tree_->view.page_size;
  sub.nodes = tree_->view.nodes;
  sub.pages = tree_->view.pages;
  for (int32_t q : queries) sub.queries.push_back(tree_->view.queries[q]);
  return naive_tree_attention_cpu(sub, layout_, q_.data(), num_rows_, k_.data(), v_.data(),
                                  num_q_heads_, sm_scale_, out->data());
}

float GpuAttentionProblem::max_abs_diff(const std::vector<float>& a, const std::vector<float>& b,
                                        const std::vector<int32_t>& queries) const {
  const size_t row_elems = size_t(num_q_heads_) * layout_.head_dim;
  float worst = 0.f;
  auto row_diff = [&](int32_t row) {
    for (size_t i = size_t(row) * row_elems; i < size_t(row + 1) * row_elems; ++i) {
      const float d = std::fabs(a[i] - b[i]);
      worst = std::isnan(d) ? INFINITY : std::max(worst, d);
    }
  };
  if (queries.empty()) {
    for (const AttentionQuery& q : tree_->view.queries) row_diff(q.row);
  } else {
    for (int32_t q : queries) row_diff(tree_->view.queries[q].row);
  }
  return worst;
}

bool GpuAttentionProblem::untouched_rows_kept(const std::vector<float>& out) const {
  const size_t row_elems = size_t(num_q_heads_) * layout_.head_dim;
  for (size_t i = size_t(tree_->num_rows) * row_elems; i < out.size(); ++i) {
    if (out[i] != kSentinel) return false;
  }
  return true;
}

}  // namespace treeserve::testing
