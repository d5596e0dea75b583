// The request checks both the scheduler's methods and the server run (scheduler.h): each
// message, exactly as a client sees it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "scheduler/scheduler.h"

namespace treeserve {
namespace {

TEST(RequestChecks, TokensGivenNamesTheField) {
  EXPECT_TRUE(check_tokens_given("prompt", {1}).ok());
  const Status s = check_tokens_given("append", {});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "append: must not be empty");
}

TEST(RequestChecks, BranchIdsGivenNamesTheTree) {
  EXPECT_TRUE(check_branch_ids_given("t1", {"b0"}).ok());
  const Status s = check_branch_ids_given("t1", {});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "branch_ids: name at least one branch of tree t1");
}

TEST(RequestChecks, LengthPenaltyIsFinite) {
  EXPECT_TRUE(check_length_penalty(0.f).ok());
  EXPECT_TRUE(check_length_penalty(-1.5f).ok());
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
    const Status s = check_length_penalty(bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(), "beam_search.length_penalty: must be finite");
  }
}

}  // namespace
}  // namespace treeserve
