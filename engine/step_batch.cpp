// Validation of a StepBatch against the pool layout: the engine writes K/V at the batch's
// slots, so a bad slot would corrupt another branch's cache.
#include "engine/step_batch.h"

#include <algorithm>
#include <string>

namespace treeserve {
namespace {

std::string at(const char* field, size_t i) {
  return std::string(field) + "[" + std::to_string(i) + "]";
}

Status check_rows(const StepBatch& batch, const KvLayout& layout, int64_t vocab_size) {
  const size_t rows = batch.token_ids.size();
  if (batch.positions.size() != rows || batch.kv_slots.size() != rows) {
    return InvalidArgument("token_ids, positions and kv_slots must have one entry per row (" +
                           std::to_string(rows) + ", " + std::to_string(batch.positions.size()) +
                           ", " + std::to_string(batch.kv_slots.size()) + ")");
  }
  if (batch.vocab_limit < 0 || batch.vocab_limit > vocab_size) {
    return InvalidArgument("vocab_limit = " + std::to_string(batch.vocab_limit) +
                           " is outside [0, " + std::to_string(vocab_size) + "] (0 = all)");
  }
  if (!batch.sampling.empty() && batch.sampling.size() != batch.logit_rows.size()) {
    return InvalidArgument("sampling must be empty or have one entry per logit row (" +
                           std::to_string(batch.sampling.size()) + " for " +
                           std::to_string(batch.logit_rows.size()) + ")");
  }
  for (size_t i = 0; i < batch.sampling.size(); ++i) {
    const Status ok = validate_sampling_params(batch.sampling[i].params);
    if (!ok.ok()) return InvalidArgument(at("sampling", i) + ": " + ok.message());
  }
  const int64_t pool_slots = layout.num_pages * layout.page_size;
  for (size_t r = 0; r < rows; ++r) {
    if (batch.token_ids[r] < 0 || batch.token_ids[r] >= vocab_size) {
      return InvalidArgument(at("token_ids", r) + " = " + std::to_string(batch.token_ids[r]) +
                             " is outside [0, " + std::to_string(vocab_size) + ")");
    }
    if (batch.positions[r] < 0) {
      return InvalidArgument(at("positions", r) + " = " + std::to_string(batch.positions[r]) +
                             " must be >= 0");
    }
    if (batch.kv_slots[r] < 0 || batch.kv_slots[r] >= pool_slots) {
      return InvalidArgument(at("kv_slots", r) + " = " + std::to_string(batch.kv_slots[r]) +
                             " is outside the pool [0, " + std::to_string(pool_slots) + ")");
    }
  }
  for (size_t i = 0; i < batch.logit_rows.size(); ++i) {
    if (batch.logit_rows[i] < 0 || size_t(batch.logit_rows[i]) >= rows) {
      return InvalidArgument(at("logit_rows", i) + " = " + std::to_string(batch.logit_rows[i]) +
                             " is not a row of the batch");
    }
  }
  for (size_t i = 0; i < batch.page_copies.size(); ++i) {
    const StepPageCopy& c = batch.page_copies[i];
    if (c.src_page < 0 || c.src_page >= layout.num_pages || c.dst_page < 0 ||
        c.dst_page >= layout.num_pages || c.src_page == c.dst_page) {
      return InvalidArgument(at("page_copies", i) + " = {" + std::to_string(c.src_page) + ", " +
                             std::to_string(c.dst_page) +
                             "}: pages must be distinct and inside the pool");
    }
    if (c.num_slots < 1 || c.num_slots > layout.page_size) {
      return InvalidArgument(at("page_copies", i) + ".num_slots = " + std::to_string(c.num_slots) +
                             " is outside [1, page_size]");
    }
  }
  for (size_t i = 0; i < batch.slot_moves.size(); ++i) {
    const StepSlotMove& m = batch.slot_moves[i];
    if (m.src_slot < 0 || m.src_slot >= pool_slots || m.dst_slot < 0 || m.dst_slot >= pool_slots) {
      return InvalidArgument(at("slot_moves", i) + " = {" + std::to_string(m.src_slot) + ", " +
                             std::to_string(m.dst_slot) + "}: slots must be inside the pool");
    }
  }
  return Status::Ok();
}

}  // namespace

void sample_rows_on_host(const StepBatch& batch, const float* rows, int64_t row_stride,
                         int64_t vocab_size, SamplingScratch* scratch,
                         std::vector<SampledToken>* out) {
  const int64_t vocab = batch.drawable_vocab(vocab_size);
  out->clear();
  for (size_t i = 0; i < batch.sampling.size(); ++i) {
    const StepSampling& s = batch.sampling[i];
    out->push_back(sample_token(rows + int64_t(i) * row_stride, vocab, s.params, s.stream_key,
                                s.position, scratch));
  }
}

Status validate_step_batch(const StepBatch& batch, const KvLayout& layout, int64_t vocab_size,
                           StepBatchCheckScratch* scratch) {
  TS_RETURN_IF_ERROR(check_rows(batch, layout, vocab_size));
  const int32_t rows = batch.num_rows();
  const AttentionView& view = batch.view;
  if (view.page_size != layout.page_size) {
    return InvalidArgument("view.page_size = " + std::to_string(view.page_size) +
                           " differs from the pool's page_size " +
                           std::to_string(layout.page_size));
  }

  // Distinct slots: two rows writing one slot would make the result depend on write order.
  scratch->slots.assign(batch.kv_slots.begin(), batch.kv_slots.end());
  std::sort(scratch->slots.begin(), scratch->slots.end());
  auto dup = std::adjacent_find(scratch->slots.begin(), scratch->slots.end());
  if (dup != scratch->slots.end()) {
    return InvalidArgument("kv_slots: slot " + std::to_string(*dup) + " is used by two rows");
  }

  if (view.queries.size() != size_t(rows)) {
    return InvalidArgument("view.queries has " + std::to_string(view.queries.size()) +
                           " queries for " + std::to_string(rows) + " rows (need one per row)");
  }
  scratch->row_query.assign(rows, -1);
  const int32_t num_nodes = int32_t(view.nodes.size());
  for (size_t q = 0; q < view.queries.size(); ++q) {
    const AttentionQuery& query = view.queries[q];
    if (query.row < 0 || query.row >= rows || scratch->row_query[query.row] >= 0) {
      return InvalidArgument(at("view.queries", q) + ".row = " + std::to_string(query.row) +
                             ": rows must each have exactly one query");
    }
    scratch->row_query[query.row] = int32_t(q);
    if (query.leaf < 0 || query.leaf >= num_nodes || query.leaf_tokens < 1 ||
        query.leaf_tokens > view.nodes[query.leaf].num_tokens) {
      return InvalidArgument(at("view.queries", q) + ": leaf or leaf_tokens out of range");
    }
    // The query's own token is the last one it sees: it must be the row's token.
    const KvNodeRun& leaf = view.nodes[query.leaf];
    const int32_t own = leaf.first_slot + query.leaf_tokens - 1;
    const int64_t page_index = int64_t(leaf.page_begin) + own / view.page_size;
    if (page_index < 0 || page_index >= int64_t(view.pages.size())) {
      return InvalidArgument(at("view.queries", q) + ": its leaf's pages are out of range");
    }
    const int64_t slot = int64_t(view.pages[page_index]) * view.page_size + own % view.page_size;
    if (slot != batch.kv_slots[query.row]) {
      return InvalidArgument(at("kv_slots", query.row) + " = " +
                             std::to_string(batch.kv_slots[query.row]) +
                             " but the view puts that row's token at slot " + std::to_string(slot));
    }
    const int32_t position = leaf.depth_tokens + query.leaf_tokens - 1;
    if (position != batch.positions[query.row]) {
      return InvalidArgument(
          at("positions", query.row) + " = " + std::to_string(batch.positions[query.row]) +
          " but the view puts that row's token at position " + std::to_string(position));
    }
  }
  return Status::Ok();
}

}  // namespace treeserve
