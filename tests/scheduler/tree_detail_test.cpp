// GetTree's detail (TreePage::detail: each branch's state, last finish reason, text and page
// counts) and the prompt usage a one-shot Generate reports on each branch's first token, on
// the scheduler directly (CPU backend, tiny model).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "scheduler/scheduler.h"
#include "tests/scheduler/scheduler_test_util.h"

namespace treeserve {
namespace {

using testing::drain;
using testing::Drained;
using testing::expect_idle;
using testing::serve;
using testing::Served;

constexpr int32_t kPage = 16;  // testing::serve's page size

std::vector<int32_t> text_prompt(const Tokenizer& tok) {
  std::vector<int32_t> ids = {tok.bos_id()};
  auto enc = tok.encode(
      "Once upon a time there was a little girl who lived in a village near the forest. "
      "Whenever she went out, the little girl wore a red riding cloak.");
  EXPECT_TRUE(enc.ok());
  ids.insert(ids.end(), enc->begin(), enc->end());
  return ids;
}

BranchSummary find(const TreeSummary& t, const std::string& id) {
  for (const BranchSummary& b : t.branches) {
    if (b.branch_id == id) return b;
  }
  ADD_FAILURE() << "no branch " << id;
  return {};
}

TEST(TreeDetail, StateFinishTextAndPages) {
  Served sv = serve(128);
  Scheduler& s = *sv.scheduler;
  const std::vector<int32_t> prompt = text_prompt(*sv.tokenizer);
  ASSERT_GT(prompt.size(), size_t(2 * kPage));
  auto tree = s.create_tree(prompt);
  ASSERT_TRUE(tree.ok()) << tree.status().message();
  TreePage detail;
  detail.detail = true;

  // Without detail: none of it.
  auto plain = s.get_tree(tree->tree_id);
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->branches[0].text.empty());
  EXPECT_EQ(plain->branches[0].kv_pages, 0);

  auto root_only = s.get_tree(tree->tree_id, detail);
  ASSERT_TRUE(root_only.ok());
  const BranchSummary root = root_only->branches[0];
  EXPECT_EQ(root.fork_offset, 0);
  EXPECT_EQ(root.state, BranchState::kIdle);
  EXPECT_EQ(root.finish_reason, FinishReason::kNone);
  EXPECT_EQ(root.text, *sv.tokenizer->decode(prompt));
  // The prompt's KV (all but its last token, still pending) in whole and partial pages; the
  // prefill put it in the radix cache, so every whole page of it is shared.
  const int32_t kv_len = int32_t(prompt.size()) - 1;
  EXPECT_EQ(root.kv_pages, (kv_len + kPage - 1) / kPage);
  EXPECT_GE(root.shared_pages, kv_len / kPage);
  EXPECT_LE(root.shared_pages, root.kv_pages);

  auto kids = s.branch(tree->tree_id, tree->root_branch_id, 3, 0);
  ASSERT_TRUE(kids.ok());
  GenerateSpec g;
  g.tree_id = tree->tree_id;
  g.branch_ids = *kids;
  g.sampling.temperature = 0;
  g.max_tokens = 20;
  auto stream = s.generate(g);
  ASSERT_TRUE(stream.ok());
  Drained d = drain(**stream);
  ASSERT_TRUE(d.status.ok());

  auto after = s.get_tree(tree->tree_id, detail);
  ASSERT_TRUE(after.ok());
  for (const std::string& id : *kids) {
    const BranchSummary b = find(*after, id);
    EXPECT_EQ(b.parent_branch_id, tree->root_branch_id);
    EXPECT_EQ(b.fork_offset, int32_t(prompt.size()));
    EXPECT_EQ(b.state, BranchState::kIdle);
    EXPECT_EQ(b.finish_reason, FinishReason::kLength);
    // Its text is what its tokens add after the root's: the whole decode is the two joined.
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), d.tokens[id].begin(), d.tokens[id].end());
    EXPECT_EQ(root.text + b.text, *sv.tokenizer->decode(all)) << id;
    EXPECT_EQ(b.length, int32_t(all.size()));
    EXPECT_EQ(b.kv_pages, (b.length - 1 + kPage - 1) / kPage);
    // It reads the prompt's whole pages from the cache; its own pages are its alone.
    EXPECT_GE(b.shared_pages, kv_len / kPage);
    EXPECT_LT(b.shared_pages, b.kv_pages);
  }

  // While a Generate runs its branch says so; a cancelled one says why it stopped.
  g.branch_ids = {(*kids)[0]};
  g.max_tokens = 4000;
  stream = s.generate(g);
  ASSERT_TRUE(stream.ok());
  bool seen_generating = false;
  for (int i = 0; i < 200 && !seen_generating; ++i) {
    auto now = s.get_tree(tree->tree_id, detail);
    ASSERT_TRUE(now.ok());
    seen_generating = find(*now, (*kids)[0]).state == BranchState::kGenerating;
    if (!seen_generating) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(seen_generating);
  (*stream)->cancel();
  d = drain(**stream);
  auto cancelled = s.get_tree(tree->tree_id, detail);
  ASSERT_TRUE(cancelled.ok());
  EXPECT_EQ(find(*cancelled, (*kids)[0]).state, BranchState::kIdle);
  EXPECT_EQ(find(*cancelled, (*kids)[0]).finish_reason, FinishReason::kCancelled);
  EXPECT_EQ(find(*cancelled, (*kids)[1]).finish_reason, FinishReason::kLength);

  // Paged: the detail covers the listed branches only.
  TreePage page = detail;
  page.page_size = 2;
  auto first = s.get_tree(tree->tree_id, page);
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->branches.size(), 2u);
  page.page_token = first->next_page_token;
  auto second = s.get_tree(tree->tree_id, page);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(second->branches.size(), 2u);
  EXPECT_EQ(second->branches[1].text, find(*cancelled, (*kids)[2]).text);

  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

// The first token of each branch of a one-shot Generate carries the prompt's size and the
// tokens the radix cache supplied; later tokens carry nothing.
TEST(TreeDetail, OneShotReportsPromptUsage) {
  Served sv = serve(128);
  Scheduler& s = *sv.scheduler;
  const std::vector<int32_t> prompt = text_prompt(*sv.tokenizer);
  for (int32_t n : {1, 3}) {
    for (int round = 0; round < 2; ++round) {
      GenerateSpec g;
      g.prompt = prompt;
      g.n = n;
      g.sampling.temperature = 0;
      g.max_tokens = 3;
      auto stream = s.generate(g);
      ASSERT_TRUE(stream.ok());
      std::map<std::string, int> events;
      TokenEvent ev;
      Status end;
      while ((*stream)->next(&ev, &end, std::chrono::milliseconds(5000)) ==
             GenerateStream::Wait::kEvent) {
        const int k = events[ev.branch_id]++;
        if (k == 0) {
          EXPECT_EQ(ev.prompt_tokens, int32_t(prompt.size())) << "n=" << n;
          // The first call sees an empty cache; every later call reuses the prompt's KV: all
          // but its last token (n = 1), or all but its last two (n > 1: the prefill before
          // the fork computes all but the last, and reuses all but its own last).
          if (n == 1 && round == 0) {
            EXPECT_EQ(ev.cached_tokens, 0);
          } else {
            EXPECT_EQ(ev.cached_tokens, int32_t(prompt.size()) - (n == 1 ? 1 : 2)) << "n=" << n;
          }
        } else {
          EXPECT_EQ(ev.prompt_tokens, 0);
          EXPECT_EQ(ev.cached_tokens, 0);
        }
      }
      EXPECT_TRUE(end.ok());
      EXPECT_EQ(int(events.size()), n);
    }
  }
  // Calls on a tree report no prompt usage.
  auto tree = s.create_tree(prompt);
  ASSERT_TRUE(tree.ok());
  GenerateSpec g;
  g.tree_id = tree->tree_id;
  g.branch_ids = {tree->root_branch_id};
  g.max_tokens = 2;
  auto stream = s.generate(g);
  ASSERT_TRUE(stream.ok());
  TokenEvent ev;
  Status end;
  while ((*stream)->next(&ev, &end, std::chrono::milliseconds(5000)) ==
         GenerateStream::Wait::kEvent) {
    EXPECT_EQ(ev.prompt_tokens, 0);
  }
  ASSERT_TRUE(s.delete_tree(tree->tree_id).ok());
  expect_idle(s);
}

}  // namespace
}  // namespace treeserve
