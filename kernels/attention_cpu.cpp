// CPU executors of tree attention (see attention_cpu.h): the plan executor, which mirrors
// what a GPU block does per work item, and the naive per-query reference.
#include "kernels/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <thread>

namespace treeserve {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

Status check_shapes(const AttentionView& view, const KvLayout& layout, int32_t num_rows,
                    int32_t num_q_heads) {
  if (layout.page_size != view.page_size) {
    return InvalidArgument("layout.page_size = " + std::to_string(layout.page_size) +
                           " differs from view.page_size = " + std::to_string(view.page_size));
  }
  if (layout.num_kv_heads < 1 || num_q_heads % layout.num_kv_heads != 0) {
    return InvalidArgument(
        "num_q_heads = " + std::to_string(num_q_heads) +
        " is not a multiple of num_kv_heads = " + std::to_string(layout.num_kv_heads));
  }
  for (size_t i = 0; i < view.queries.size(); ++i) {
    if (view.queries[i].row < 0 || view.queries[i].row >= num_rows) {
      return InvalidArgument("queries[" + std::to_string(i) + "].row = " +
                             std::to_string(view.queries[i].row) + " is outside [0, num_rows)");
    }
  }
  for (size_t p = 0; p < view.pages.size(); ++p) {
    if (view.pages[p] < 0 || view.pages[p] >= layout.num_pages) {
      return InvalidArgument("pages[" + std::to_string(p) + "] = " + std::to_string(view.pages[p]) +
                             " is outside the pool");
    }
  }
  return Status::Ok();
}

float dot(const float* a, const float* b, int32_t n) {
  float s = 0.f;
  for (int32_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

struct ItemContext {
  const AttentionPlan& plan;
  const KvLayout& layout;
  const float* q;
  const float* k;
  const float* v;
  int32_t num_q_heads;
  float scale;
  AttentionCpuWorkspace* ws;
};

// One work item, as one GPU block per (item, kv head) would do it: the tile's rows are
// (item query, q head of the kv head's group); scores over the item's tokens, masked,
// softmax, then the partial O and LSE for each row.
void run_item(const ItemContext& c, int32_t item, std::vector<float>* scores,
              std::vector<int64_t>* token_offsets) {
  const AttentionPlan& plan = c.plan;
  const int32_t d = c.layout.head_dim;
  const int32_t gqa = c.num_q_heads / c.layout.num_kv_heads;
  const int32_t num_tokens = plan.item_num_tokens[item];
  const int32_t words = AttentionPlan::mask_words_per_row(num_tokens);
  const int32_t mask_offset = plan.item_mask_offset[item];
  // Page-table walk once per item: element offset of each token for kv head 0.
  token_offsets->resize(num_tokens);
  int32_t t = 0;
  for (int32_t g = plan.item_segment_begin[item]; g < plan.item_segment_end[item]; ++g) {
    for (int32_t j = 0; j < plan.seg_num_tokens[g]; ++j, ++t) {
      const int32_t slot = plan.seg_first_slot[g] + j;
      const int32_t page = plan.page_table[plan.seg_page_begin[g] + slot / plan.page_size];
      (*token_offsets)[t] = c.layout.offset(page, 0, slot % plan.page_size);
    }
  }
  const int64_t head_stride = int64_t(c.layout.page_size) * d;
  scores->resize(num_tokens);
  for (int32_t p = plan.item_query_begin[item]; p < plan.item_query_end[item]; ++p) {
    const int32_t query = plan.item_queries[p];
    const uint32_t* mask = mask_offset < 0 ? nullptr
                                           : plan.mask_words.data() + mask_offset +
                                                 int64_t(p - plan.item_query_begin[item]) * words;
    for (int32_t h = 0; h < c.num_q_heads; ++h) {
      const int32_t kv_head = h / gqa;
      const float* qv = c.q + (int64_t(plan.query_rows[query]) * c.num_q_heads + h) * d;
      float max_score = kNegInf;
      for (int32_t j = 0; j < num_tokens; ++j) {
        const bool visible = mask == nullptr || ((mask[j >> 5] >> (j & 31)) & 1u);
        const float s =
            visible ? c.scale * dot(qv, c.k + (*token_offsets)[j] + kv_head * head_stride, d)
                    : kNegInf;
        (*scores)[j] = s;
        max_score = std::max(max_score, s);
      }
      float* o = c.ws->partial_o.data() + (int64_t(p) * c.num_q_heads + h) * d;
      std::fill(o, o + d, 0.f);
      float* lse = c.ws->partial_lse.data() + int64_t(p) * c.num_q_heads + h;
      if (max_score == kNegInf) {  // nothing visible: a neutral partial for the merge
        *lse = kNegInf;
        continue;
      }
      float sum = 0.f;
      for (int32_t j = 0; j < num_tokens; ++j) {
        if ((*scores)[j] == kNegInf) continue;
        const float w = std::exp((*scores)[j] - max_score);
        sum += w;
        const float* vv = c.v + (*token_offsets)[j] + kv_head * head_stride;
        for (int32_t i = 0; i < d; ++i) o[i] += w * vv[i];
      }
      for (int32_t i = 0; i < d; ++i) o[i] /= sum;
      *lse = max_score + std::log(sum);
    }
  }
}

// Checks the inputs and runs phase 1 (every work item's partials into workspace).
Status run_plan_items(const AttentionPlan& plan, const AttentionView& view, const KvLayout& layout,
                      const float* q, int32_t num_rows, const float* k_layer, const float* v_layer,
                      int32_t num_q_heads, float scale, AttentionCpuWorkspace* workspace,
                      int32_t num_threads) {
  TS_RETURN_IF_ERROR(check_shapes(view, layout, num_rows, num_q_heads));
  if (plan.num_queries() != int32_t(view.queries.size()) ||
      plan.page_table.size() != view.pages.size()) {
    return InvalidArgument("plan was not built for this view (query or page counts differ)");
  }
  if (plan.gqa_group_size != num_q_heads / layout.num_kv_heads) {
    return InvalidArgument("plan.gqa_group_size = " + std::to_string(plan.gqa_group_size) +
                           " differs from num_q_heads / num_kv_heads");
  }
  const int32_t d = layout.head_dim;
  workspace->partial_o.resize(size_t(plan.num_partials()) * num_q_heads * d);
  workspace->partial_lse.resize(size_t(plan.num_partials()) * num_q_heads);
  const ItemContext ctx{plan, layout, q, k_layer, v_layer, num_q_heads, scale, workspace};

  // Work items are independent (like thread blocks): strided over the threads.
  const int32_t items = plan.num_items();
  int32_t threads =
      num_threads > 0 ? num_threads : int32_t(std::max(1u, std::thread::hardware_concurrency()));
  threads = std::max(1, std::min(threads, items));
  auto worker = [&](int32_t first) {
    std::vector<float> scores;
    std::vector<int64_t> offsets;
    for (int32_t i = first; i < items; i += threads) run_item(ctx, i, &scores, &offsets);
  };
  if (threads == 1) {
    worker(0);
  } else {
    std::vector<std::thread> pool;
    for (int32_t t = 1; t < threads; ++t) pool.emplace_back(worker, t);
    worker(0);
    for (auto& th : pool) th.join();
  }
  return Status::Ok();
}

// Phase 2 for one (query, q head): its partials folded in reduction-map order (deterministic)
// into o (head_dim floats) and *lse, starting from the empty state (O = 0, LSE = -inf).
void merge_query(const AttentionPlan& plan, const AttentionCpuWorkspace& ws, int32_t query,
                 int32_t head, int32_t num_q_heads, int32_t head_dim, float* o, float* lse) {
  std::fill(o, o + head_dim, 0.f);
  *lse = kNegInf;
  for (int32_t m = plan.query_merge_begin[query]; m < plan.query_merge_begin[query + 1]; ++m) {
    const int64_t at = int64_t(plan.merge_partials[m]) * num_q_heads + head;
    merge_attention_state(o, lse, ws.partial_o.data() + at * head_dim, ws.partial_lse[at],
                          head_dim);
  }
}

}  // namespace

void merge_attention_state(float* o_a, float* lse_a, const float* o_b, float lse_b,
                           int32_t head_dim) {
  const float m = std::max(*lse_a, lse_b);
  if (m == kNegInf) return;
  const float wa = std::exp(*lse_a - m);
  const float wb = std::exp(lse_b - m);
  const float inv = 1.f / (wa + wb);
  for (int32_t i = 0; i < head_dim; ++i) o_a[i] = (o_a[i] * wa + o_b[i] * wb) * inv;
  *lse_a = m + std::log(wa + wb);
}

Status execute_attention_plan_cpu(const AttentionPlan& plan, const AttentionView& view,
                                  const KvLayout& layout, const float* q, int32_t num_rows,
                                  const float* k_layer, const float* v_layer, int32_t num_q_heads,
                                  float scale, float* out, AttentionCpuWorkspace* workspace,
                                  int32_t num_threads) {
  TS_RETURN_IF_ERROR(run_plan_items(plan, view, layout, q, num_rows, k_layer, v_layer, num_q_heads,
                                    scale, workspace, num_threads));
  const int32_t d = layout.head_dim;
  for (int32_t query = 0; query < plan.num_queries(); ++query) {
    for (int32_t h = 0; h < num_q_heads; ++h) {
      float lse;
      merge_query(plan, *workspace, query, h, num_q_heads, d,
                  out + (int64_t(plan.query_rows[query]) * num_q_heads + h) * d, &lse);
    }
  }
  return Status::Ok();
}

Status execute_attention_plan_cpu_state(const AttentionPlan& plan, const AttentionView& view,
                                        const KvLayout& layout, const float* q, int32_t num_rows,
                                        const float* k_layer, const float* v_layer,
                                        int32_t num_q_heads, float scale, float* state_o,
                                        float* state_lse, AttentionCpuWorkspace* workspace,
                                        int32_t num_threads) {
  TS_RETURN_IF_ERROR(run_plan_items(plan, view, layout, q, num_rows, k_layer, v_layer, num_q_heads,
                                    scale, workspace, num_threads));
  const int32_t d = layout.head_dim;
  for (int32_t query = 0; query < plan.num_queries(); ++query) {
    for (int32_t h = 0; h < num_q_heads; ++h) {
      const int64_t at = int64_t(query) * num_q_heads + h;
      merge_query(plan, *workspace, query, h, num_q_heads, d, state_o + at * d, state_lse + at);
    }
  }
  return Status::Ok();
}

Status naive_tree_attention_cpu(const AttentionView& view, const KvLayout& layout, const float* q,
                                int32_t num_rows, const float* k_layer, const float* v_layer,
                                int32_t num_q_heads, float scale, float* out) {
  TS_RETURN_IF_ERROR(check_shapes(view, layout, num_rows, num_q_heads));
  const int32_t d = layout.head_dim;
  const int32_t gqa = num_q_heads / layout.num_kv_heads;
  std::vector<int64_t> tokens;  // offsets (kv head 0) of the query's visible tokens
  std::vector<double> scores, acc(d);
  for (const AttentionQuery& query : view.queries) {
    tokens.clear();
    int32_t visible = query.leaf_tokens;
    for (int32_t n = query.leaf; n >= 0; n = view.nodes[n].parent) {
      const KvNodeRun& run = view.nodes[n];
      for (int32_t t = visible - 1; t >= 0; --t) {
        const int32_t slot = run.first_slot + t;
        const int32_t page = view.pages[run.page_begin + slot / view.page_size];
        tokens.push_back(layout.offset(page, 0, slot % view.page_size));
      }
      if (run.parent >= 0) visible = view.nodes[run.parent].num_tokens;
    }
    scores.resize(tokens.size());
    for (int32_t h = 0; h < num_q_heads; ++h) {
      const int64_t kv = int64_t(h / gqa) * layout.page_size * d;
      const float* qv = q + (int64_t(query.row) * num_q_heads + h) * d;
      double max_score = -std::numeric_limits<double>::infinity();
      for (size_t j = 0; j < tokens.size(); ++j) {
        double s = 0;
        for (int32_t i = 0; i < d; ++i) s += double(qv[i]) * k_layer[tokens[j] + kv + i];
        scores[j] = s * scale;
        max_score = std::max(max_score, scores[j]);
      }
      double sum = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (size_t j = 0; j < tokens.size(); ++j) {
        const double w = std::exp(scores[j] - max_score);
        sum += w;
        for (int32_t i = 0; i < d; ++i) acc[i] += w * v_layer[tokens[j] + kv + i];
      }
      float* o = out + (int64_t(query.row) * num_q_heads + h) * d;
      for (int32_t i = 0; i < d; ++i) o[i] = float(acc[i] / sum);
    }
  }
  return Status::Ok();
}

}  // namespace treeserve
