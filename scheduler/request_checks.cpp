// The request checks declared in scheduler.h that both the scheduler's methods and the server
// run: one definition of each message.
#include <cmath>

#include "scheduler/scheduler.h"

namespace treeserve {

Status check_tokens_given(const std::string& field, const std::vector<int32_t>& tokens) {
  if (tokens.empty()) return InvalidArgument(field + ": must not be empty");
  return Status::Ok();
}

Status check_branch_ids_given(const std::string& tree_id,
                              const std::vector<std::string>& branch_ids) {
  if (branch_ids.empty()) {
    return InvalidArgument("branch_ids: name at least one branch of tree " + tree_id);
  }
  return Status::Ok();
}

Status check_length_penalty(float length_penalty) {
  if (!std::isfinite(length_penalty)) {
    return InvalidArgument("beam_search.length_penalty: must be finite");
  }
  return Status::Ok();
}

}  // namespace treeserve
