// Speculative token trees: drafts stored after a branch's tail, one slot each, and the accept
// step that keeps one path. See the header comment of kv_cache.h for the layout.
#include <string>

#include "kvcache/kv_cache.h"

namespace treeserve {

Status KvCache::append_token_tree(BranchId id, std::span<const int32_t> tokens,
                                  std::span<const int32_t> parents, std::vector<KvSlot>* slots) {
  StatusOr<Branch*> found = find(id);
  if (!found.ok()) return found.status();
  Branch& b = **found;
  if (tokens.empty()) return InvalidArgument("tokens must not be empty");
  if (parents.size() != tokens.size()) {
    return InvalidArgument("parents must have one entry per token (" +
                           std::to_string(tokens.size()) + "), got " +
                           std::to_string(parents.size()));
  }
  for (size_t i = 0; i < parents.size(); ++i) {
    if (parents[i] < -1 || parents[i] >= static_cast<int32_t>(i)) {
      return InvalidArgument("parents[" + std::to_string(i) + "] must be in [-1, " +
                             std::to_string(i) + "), got " + std::to_string(parents[i]));
    }
  }
  if (!b.draft_tokens.empty()) {
    return FailedPrecondition("branch " + std::to_string(id) + " already has a token tree");
  }
  const int32_t length = b.length();
  const int32_t end = length + static_cast<int32_t>(tokens.size());
  const int32_t need = tail_pages_for(b, end) - static_cast<int32_t>(b.tail_pages.size());
  if (need > 0) {
    TS_RETURN_IF_ERROR(reserve(need, "append_token_tree", b.ns_slot));
    for (int32_t i = 0; i < need; ++i) b.tail_pages.push_back(take_page(b.ns_slot));
  }
  b.draft_tokens.assign(tokens.begin(), tokens.end());
  b.draft_parents.assign(parents.begin(), parents.end());
  for (int32_t p = length; p < end; ++p) slots->push_back(slot_of(b, p));
  return Status::Ok();
}

Status KvCache::accept(BranchId id, std::span<const int32_t> path, std::vector<SlotMove>* moves) {
  StatusOr<Branch*> found = find(id);
  if (!found.ok()) return found.status();
  Branch& b = **found;
  if (b.draft_tokens.empty()) {
    return FailedPrecondition("branch " + std::to_string(id) + " has no token tree");
  }
  const int32_t drafts = static_cast<int32_t>(b.draft_tokens.size());
  int32_t expected_parent = -1;
  for (size_t j = 0; j < path.size(); ++j) {
    if (path[j] < 0 || path[j] >= drafts || b.draft_parents[path[j]] != expected_parent) {
      return InvalidArgument("path[" + std::to_string(j) +
                             "] must be a child of the previous entry (a root draft first)");
    }
    expected_parent = path[j];
  }
  // Accepted draft j moves from storage position length + path[j] to length + j. path[j] >= j
  // and path is increasing, so moving in order never overwrites a source not yet moved.
  const int32_t length = b.length();
  for (size_t j = 0; j < path.size(); ++j) {
    const int32_t dst = length + static_cast<int32_t>(j);
    const int32_t src = length + path[j];
    if (src != dst) moves->push_back({slot_of(b, src), slot_of(b, dst)});
    b.tail_tokens.push_back(b.draft_tokens[path[j]]);
  }
  b.draft_tokens.clear();
  b.draft_parents.clear();
  shrink_tail(b, b.length());
  return Status::Ok();
}

}  // namespace treeserve
