// TreeAttentionWorkspace (tree_attention.h): fixed device buffers for one tree-attention
// launch, the upload of a plan into them (packed into a pinned staging buffer in the layout of
// detail/tree_attention_layout.h, then one cudaMemcpyAsync), and tree_attention_graph_grid,
// the grid to capture the last upload's launch with.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/detail/tree_attention_launch.h"
#include "kernels/detail/tree_attention_layout.h"
#include "kernels/tree_attention.h"

namespace treeserve {
namespace {

using namespace detail;  // NOLINT: header field names

constexpr int64_t kAlignWords = 32;  // 128 bytes

int64_t align_up(int64_t n) { return (n + kAlignWords - 1) / kAlignWords * kAlignWords; }

Status cuda_error(const char* what, cudaError_t e) {
  return Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

// Words the device buffer needs for plans within limits (each array padded to alignment).
int64_t capacity_words(const TreeAttentionLimits& l) {
  return kHeaderWords + int64_t(kItemRecordWords) * l.max_work_items +
         3 * align_up(l.max_segments) + align_up(l.max_queries + 1) + align_up(l.max_queries) +
         align_up(l.max_view_pages) + align_up(l.max_mask_words) + align_up(l.max_partials);
}

// Packed table entries hold the physical page in 23 bits (slot: 8 bits, page_size <= 256).
constexpr int32_t kTablePageLimit = 1 << 23;

// Trace records: one per (item, kv head) block; kv heads <= q heads.
size_t block_trace_capacity(const TreeAttentionLimits& limits) {
  return size_t(limits.max_work_items) * size_t(limits.max_num_q_heads);
}

}  // namespace

void TreeAttentionLimits::apply_to(AttentionPlanConfig* config) const {
  config->max_work_items = max_work_items;
  config->max_partials = max_partials;
  config->max_segments = max_segments;
  config->max_mask_words = max_mask_words;
  config->max_chunk_tokens = std::min(config->max_chunk_tokens, max_item_tokens);
}

TreeAttentionWorkspace::~TreeAttentionWorkspace() { release(); }

void TreeAttentionWorkspace::release() {
  // Errors are ignored: release also runs from the destructor, possibly after a device reset.
  if (staging_done_ != nullptr) {
    cudaEventSynchronize(static_cast<cudaEvent_t>(staging_done_));
    cudaEventDestroy(static_cast<cudaEvent_t>(staging_done_));
  }
  if (host_staging_ != nullptr) cudaFreeHost(host_staging_);
  if (device_plan_ != nullptr) cudaFree(device_plan_);
  if (partial_o_ != nullptr) cudaFree(partial_o_);
  if (partial_lse_ != nullptr) cudaFree(partial_lse_);
  if (token_table_ != nullptr) cudaFree(token_table_);
  if (block_trace_ != nullptr) cudaFree(block_trace_);
  if (wide_counters_ != nullptr) cudaFree(wide_counters_);
  wide_counters_ = nullptr;
  staging_done_ = host_staging_ = device_plan_ = partial_o_ = partial_lse_ = token_table_ = nullptr;
  block_trace_ = nullptr;
  table_filled_ = table_fixed_ = decode_kernel_ = false;
  table_stride_ = table_items_ = 0;
  paired_items_begin_ = -1;
  wide_built_ = false;
  plan_words_ = 0;
  num_items_ = num_queries_ = num_partials_ = 0;
}

Status TreeAttentionWorkspace::init(const TreeAttentionLimits& limits) {
  release();
  if (limits.max_work_items < 1 || limits.max_partials < 1 || limits.max_segments < 1 ||
      limits.max_queries < 1 || limits.max_view_pages < 1 || limits.max_mask_words < 0 ||
      limits.max_item_tokens < 1 || limits.max_num_q_heads < 1 || limits.max_table_tokens < 0 ||
      (limits.max_head_dim != 64 && limits.max_head_dim != 128)) {
    return InvalidArgument(
        "TreeAttentionLimits: every max_* must be >= 1 (max_table_tokens, max_mask_words >= 0) "
        "and max_head_dim 64|128");
  }
  limits_ = limits;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return cuda_error("cudaGetDevice", e);
  e = cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return cuda_error("cudaDeviceGetAttribute(SMs)", e);
  e = cudaDeviceGetAttribute(&smem_per_sm_, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  if (e != cudaSuccess) return cuda_error("cudaDeviceGetAttribute(shared memory per SM)", e);
  e = cudaDeviceGetAttribute(&smem_reserved_, cudaDevAttrReservedSharedMemoryPerBlock, device);
  if (e != cudaSuccess) return cuda_error("cudaDeviceGetAttribute(reserved shared memory)", e);
  wide_built_ = detail::wide_kernel_built();
  table_stride_ = tree_attention_table_stride(limits.max_item_tokens);
  plan_words_ = capacity_words(limits);
  e = cudaMalloc(&device_plan_, size_t(plan_words_) * 4);
  if (e != cudaSuccess) return cuda_error("cudaMalloc(plan)", e);
  e = cudaMallocHost(&host_staging_, size_t(plan_words_) * 4);
  if (e != cudaSuccess) return cuda_error("cudaMallocHost(staging)", e);
  const size_t lse_elems = size_t(limits.max_partials) * limits.max_num_q_heads;
  e = cudaMalloc(&partial_o_, lse_elems * limits.max_head_dim * sizeof(float));
  if (e != cudaSuccess) return cuda_error("cudaMalloc(partial_o)", e);
  e = cudaMalloc(&partial_lse_, lse_elems * sizeof(float));
  if (e != cudaSuccess) return cuda_error("cudaMalloc(partial_lse)", e);
  e = cudaMalloc(&wide_counters_, 2 * sizeof(int32_t));
  if (e != cudaSuccess) return cuda_error("cudaMalloc(wide kernel counters)", e);
  e = cudaMemset(wide_counters_, 0, 2 * sizeof(int32_t));
  if (e != cudaSuccess) return cuda_error("cudaMemset(wide kernel counters)", e);
  if (limits.max_table_tokens > 0) {
    e = cudaMalloc(&token_table_, size_t(limits.max_table_tokens) * 4);
    if (e != cudaSuccess) return cuda_error("cudaMalloc(token table)", e);
    // Stage 1 reads an item's first entries before it knows the table's mode: defined words.
    e = cudaMemset(token_table_, 0, size_t(limits.max_table_tokens) * 4);
    if (e != cudaSuccess) return cuda_error("cudaMemset(token table)", e);
    table_items_ = limits.max_table_tokens / table_stride_;
  }
  cudaEvent_t event;
  e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (e != cudaSuccess) return cuda_error("cudaEventCreate", e);
  staging_done_ = event;
  // An empty plan, so a launch before the first upload does nothing (the whole buffer: stage
  // 1 reads a record before it checks the item count).
  e = cudaMemset(device_plan_, 0, size_t(plan_words_) * 4);
  if (e != cudaSuccess) return cuda_error("cudaMemset(plan)", e);
  return Status::Ok();
}

Status TreeAttentionWorkspace::enable_block_trace() {
  if (!initialized()) return FailedPrecondition("enable_block_trace before init");
  if (block_trace_ != nullptr) return Status::Ok();
  const size_t bytes = block_trace_capacity(limits_) * sizeof(TreeAttentionBlockTrace);
  cudaError_t e = cudaMalloc(&block_trace_, bytes);
  if (e != cudaSuccess) return cuda_error("cudaMalloc(block trace)", e);
  e = cudaMemset(block_trace_, 0, bytes);
  if (e != cudaSuccess) {
    cudaFree(block_trace_);  // not left half set up: a later call allocates and clears again
    block_trace_ = nullptr;
    return cuda_error("cudaMemset(block trace)", e);
  }
  return Status::Ok();
}

Status TreeAttentionWorkspace::download_block_trace(std::vector<TreeAttentionBlockTrace>* out) {
  out->clear();
  if (block_trace_ == nullptr) return FailedPrecondition("block trace not enabled");
  std::vector<TreeAttentionBlockTrace> all(block_trace_capacity(limits_));
  const size_t bytes = all.size() * sizeof(TreeAttentionBlockTrace);
  cudaError_t e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaMemcpy(all.data(), block_trace_, bytes, cudaMemcpyDeviceToHost);
  if (e == cudaSuccess) e = cudaMemset(block_trace_, 0, bytes);
  if (e != cudaSuccess) return cuda_error("block trace download", e);
  for (const TreeAttentionBlockTrace& r : all) {
    if (r.end_ns != 0) out->push_back(r);
  }
  return Status::Ok();
}

int32_t TreeAttentionWorkspace::wide_pairs() const {
  return table_filled_ ? header_[kWidePairs] : 0;
}

Status TreeAttentionWorkspace::upload(const AttentionPlan& plan, cudaStream_t stream) {
  if (!initialized()) return FailedPrecondition("TreeAttentionWorkspace::upload before init");
  auto over = [](const char* what, int64_t have, int64_t bound) {
    return ResourceExhausted(std::string("attention plan needs ") + std::to_string(have) + " " +
                             what + ", workspace holds " + std::to_string(bound));
  };
  const TreeAttentionLimits& l = limits_;
  if (plan.num_items() > l.max_work_items)
    return over("work items", plan.num_items(), l.max_work_items);
  if (plan.num_partials() > l.max_partials)
    return over("partials", plan.num_partials(), l.max_partials);
  if (plan.num_segments() > l.max_segments)
    return over("segments", plan.num_segments(), l.max_segments);
  if (plan.num_queries() > l.max_queries) return over("queries", plan.num_queries(), l.max_queries);
  if (int64_t(plan.page_table.size()) > l.max_view_pages) {
    return over("view pages", int64_t(plan.page_table.size()), l.max_view_pages);
  }
  if (int64_t(plan.mask_words.size()) > l.max_mask_words) {
    return over("mask words", int64_t(plan.mask_words.size()), l.max_mask_words);
  }
  if (plan.max_item_tokens > l.max_item_tokens) {
    return over("tokens in one item", plan.max_item_tokens, l.max_item_tokens);
  }
  if (plan.queries_per_tile * plan.gqa_group_size > kTreeAttentionTileRows) {
    return InvalidArgument("plan.queries_per_tile * gqa_group_size = " +
                           std::to_string(plan.queries_per_tile * plan.gqa_group_size) +
                           " exceeds the kernel's query tile of " +
                           std::to_string(kTreeAttentionTileRows) + " rows");
  }
  // The previous upload's copy must have left the staging buffer before it is rewritten.
  cudaError_t e = cudaEventSynchronize(static_cast<cudaEvent_t>(staging_done_));
  if (e != cudaSuccess) return cuda_error("cudaEventSynchronize(staging)", e);

  int32_t* words = static_cast<int32_t*>(host_staging_);
  std::memset(words, 0, kHeaderWords * 4);
  const size_t ni = size_t(plan.num_items());
  words[kNumItems] = plan.num_items();
  words[kNumQueries] = plan.num_queries();
  words[kNumPartials] = plan.num_partials();
  words[kGqaGroupSize] = plan.gqa_group_size;
  words[kPageSize] = plan.page_size;
  words[kHeadsFirst] = plan.heads_first ? 1 : 0;
  // The items' records, then the other arrays.
  int64_t table_tokens = 0;  // the packed table layout's cursor
  for (size_t i = 0; i < ni; ++i) {
    int32_t* rec = words + kHeaderWords + int64_t(i) * kItemRecordWords;
    const int32_t q0 = plan.item_query_begin[i], q1 = plan.item_query_end[i];
    if (q1 - q0 > kItemRecordWords - kRecQueryRows) {
      return InvalidArgument("work item " + std::to_string(i) + " has " + std::to_string(q1 - q0) +
                             " queries; the kernel's items hold at most " +
                             std::to_string(kItemRecordWords - kRecQueryRows));
    }
    rec[kRecQueryBegin] = q0;
    rec[kRecQueryEnd] = q1;
    rec[kRecNumTokens] = plan.item_num_tokens[i];
    rec[kRecMaskOffset] = plan.item_mask_offset[i];
    rec[kRecTableBegin] = int32_t(std::min<int64_t>(table_tokens, INT32_MAX));
    rec[kRecSegBegin] = plan.item_segment_begin[i];
    rec[kRecSegEnd] = plan.item_segment_end[i];
    rec[kRecVisibleTokens] = item_visible_tokens(plan, int32_t(i));
    for (int32_t j = q0; j < q1; ++j) {
      rec[kRecQueryRows + (j - q0)] = plan.query_rows[size_t(plan.item_queries[size_t(j)])];
    }
    table_tokens += plan.item_num_tokens[i];
  }
  int64_t cursor = kHeaderWords + int64_t(ni) * kItemRecordWords;
  auto put = [&](PlanHeader field, const void* data, size_t count) {
    words[field] = int32_t(cursor);
    if (count > 0) std::memcpy(words + cursor, data, count * 4);
    cursor += align_up(int64_t(count));
  };
  const size_t ns = size_t(plan.num_segments());
  put(kSegPageBegin, plan.seg_page_begin.data(), ns);
  put(kSegFirstSlot, plan.seg_first_slot.data(), ns);
  put(kSegNumTokens, plan.seg_num_tokens.data(), ns);
  put(kQueryMergeBegin, plan.query_merge_begin.data(), plan.query_merge_begin.size());
  put(kQueryRows, plan.query_rows.data(), plan.query_rows.size());
  put(kPageTable, plan.page_table.data(), plan.page_table.size());
  put(kMaskWords, plan.mask_words.data(), plan.mask_words.size());
  words[kPartialSlot] = int32_t(cursor);
  for (int32_t m = 0; m < plan.num_partials(); ++m) words[cursor + plan.merge_partials[m]] = m;
  cursor += align_up(plan.num_partials());
  // The token table's layout: fixed stride when every item's slot fits, else packed when the
  // tokens fit, else none.
  bool pages_fit = token_table_ != nullptr;
  for (size_t i = 0; pages_fit && i < plan.page_table.size(); ++i) {
    pages_fit = plan.page_table[i] < kTablePageLimit;
  }
  TokenTableMode mode = kTableNone;
  if (pages_fit && int64_t(ni) <= table_items_) {
    mode = kTableFixedStride;
  } else if (pages_fit && table_tokens <= limits_.max_table_tokens) {
    mode = kTablePacked;
  }
  words[kTokenTable] = mode;
  // The decode kernel runs the plan when all its items are decode-shaped (it reads its tokens
  // from the table).
  const bool decode_kernel =
      limits_.decode_kernel && mode != kTableNone && tree_attention_all_decode_shaped(plan);
  // Head pairing: the kernel trusts the paired items to be one slab (decode-shaped), and a
  // plan that pairs at its head count names where they begin inside [0, items].
  if (plan.pair_heads == kTreeAttentionPairHeads) TS_RETURN_IF_ERROR(validate_paired_items(plan));
  const int32_t paired_begin = tree_attention_paired_begin(plan);
  words[kPairedBegin] = paired_begin;
  words[kWidePairs] = mode != kTableNone ? tree_attention_wide_pairs(plan) : 0;
  std::memcpy(header_, words, sizeof(header_));

  e = cudaMemcpyAsync(device_plan_, host_staging_, size_t(cursor) * 4, cudaMemcpyHostToDevice,
                      stream);
  if (e != cudaSuccess) return cuda_error("cudaMemcpyAsync(plan)", e);
  table_filled_ = table_fixed_ = decode_kernel_ = false;
  if (mode != kTableNone && ni > 0) {
    TS_RETURN_IF_ERROR(detail::enqueue_token_table_fill(device_plan_, header_, token_table_,
                                                        table_stride_, plan.num_items(), stream));
  }
  table_filled_ = mode != kTableNone;
  table_fixed_ = mode == kTableFixedStride;
  decode_kernel_ = decode_kernel;
  paired_items_begin_ = paired_begin;
  e = cudaEventRecord(static_cast<cudaEvent_t>(staging_done_), stream);
  if (e != cudaSuccess) return cuda_error("cudaEventRecord(staging)", e);
  num_items_ = plan.num_items();
  num_queries_ = plan.num_queries();
  num_partials_ = plan.num_partials();
  gqa_group_size_ = plan.gqa_group_size;
  page_size_ = plan.page_size;
  max_item_tokens_ = plan.max_item_tokens;
  return Status::Ok();
}

TreeAttentionGrid tree_attention_graph_grid(const TreeAttentionWorkspace& workspace,
                                            int32_t num_kv_heads, int32_t head_dim) {
  TreeAttentionGrid grid;
  grid.items = tree_attention_grid_bucket(workspace.num_items());
  grid.queries = tree_attention_grid_bucket(workspace.num_queries());
  grid.decode_kernel = workspace.runs_decode_kernel();
  grid.paired = workspace.paired_items_begin() >= 0;
  grid.wide = tree_attention_runs_wide(workspace, num_kv_heads, head_dim);
  if (grid.wide) {
    const int32_t rest = tree_attention_wide_rest(workspace);
    grid.wide_rest = rest > 0 ? tree_attention_wide_bucket(rest) : 0;
    return grid;
  }
  grid.tail = tree_attention_runs_tail(workspace, num_kv_heads);
  const int32_t begin = workspace.paired_items_begin();
  if (grid.tail) {
    // runs_tail: the plan pairs from an item past the first and has a token table.
    grid.wide_items = tree_attention_wide_bucket(begin);
  } else if (grid.paired && !grid.decode_kernel && num_kv_heads % kTreeAttentionPairHeads == 0) {
    grid.wide_items = begin > 0 ? tree_attention_wide_bucket(begin) : 0;
    grid.paired_items = tree_attention_wide_bucket(workspace.num_items() - begin);
  }
  return grid;
}

}  // namespace treeserve
