// CPU executors of tree attention over the paged KV pool, float32:
//  - execute_attention_plan_cpu runs an AttentionPlan literally (per work item a partial
//    (O, LSE) under the item's mask, then the per-query log-sum-exp merge of the reduction
//    map), so it is the reference the CUDA kernel is compared with;
//  - execute_attention_plan_cpu_state runs it the same way but returns each query's merged
//    attention state (O, LSE) instead of output rows, for merging with states computed
//    elsewhere (a sequence-parallel shard's, kernels/sequence_parallel.h);
//  - naive_tree_attention_cpu gathers each query's visible tokens and does plain softmax
//    attention in double: the reference the plan executor is compared with.
// GQA: q head h reads kv head h / (num_q_heads / num_kv_heads).
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "kernels/attention_plan.h"
#include "kernels/attention_view.h"
#include "kernels/kv_layout.h"

namespace treeserve {

// Partial results of one execution, reused between calls.
struct AttentionCpuWorkspace {
  std::vector<float> partial_o;    // [num_partials][num_q_heads][head_dim]
  std::vector<float> partial_lse;  // [num_partials][num_q_heads], natural log
};

// q:   [num_rows][num_q_heads][head_dim]      rows of the batch; only the queries' rows are read
// k_layer, v_layer: one layer's K / V buffer  [num_pages][num_kv_heads][page_size][head_dim]
// out: [num_rows][num_q_heads][head_dim]      only the queries' rows are written
// num_threads: 0 = hardware concurrency (bounded by the item count), 1 = this thread only.
// A query without partials in the plan (possible in a sequence-parallel shard) gets zeros.
Status execute_attention_plan_cpu(const AttentionPlan& plan, const AttentionView& view,
                                  const KvLayout& layout, const float* q, int32_t num_rows,
                                  const float* k_layer, const float* v_layer, int32_t num_q_heads,
                                  float scale, float* out, AttentionCpuWorkspace* workspace,
                                  int32_t num_threads = 0);

// Same inputs; writes each view query's merged state instead of output rows:
// state_o:   [num_queries][num_q_heads][head_dim]  normalised O
// state_lse: [num_queries][num_q_heads]            natural log
// A query without partials in the plan gets O = 0, LSE = -inf (neutral in
// merge_attention_state).
Status execute_attention_plan_cpu_state(const AttentionPlan& plan, const AttentionView& view,
                                        const KvLayout& layout, const float* q, int32_t num_rows,
                                        const float* k_layer, const float* v_layer,
                                        int32_t num_q_heads, float scale, float* state_o,
                                        float* state_lse, AttentionCpuWorkspace* workspace,
                                        int32_t num_threads = 0);

// Same shapes as above; out rows of view queries are overwritten.
Status naive_tree_attention_cpu(const AttentionView& view, const KvLayout& layout, const float* q,
                                int32_t num_rows, const float* k_layer, const float* v_layer,
                                int32_t num_q_heads, float scale, float* out);

// FlashInfer merge_state: folds partial (o_b, lse_b) into (o_a, lse_a), head_dim elements.
void merge_attention_state(float* o_a, float* lse_a, const float* o_b, float lse_b,
                           int32_t head_dim);

}  // namespace treeserve
