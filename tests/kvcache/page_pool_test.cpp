// PagePool: allocation order, all-or-nothing bulk allocation, reference counts, accounting,
// and the byte-budget sizing.
#include "kvcache/page_pool.h"

#include <gtest/gtest.h>

#include <vector>

namespace treeserve {
namespace {

TEST(PagePool, FreshPoolHandsOutPagesInOrder) {
  PagePool pool(4, 16);
  EXPECT_EQ(pool.page_size(), 16);
  EXPECT_EQ(pool.num_pages(), 4);
  EXPECT_EQ(pool.num_free(), 4);
  EXPECT_EQ(pool.num_used(), 0);
  EXPECT_EQ(pool.allocate(), 0);
  EXPECT_EQ(pool.allocate(), 1);
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_EQ(pool.num_used(), 2);
  EXPECT_EQ(pool.ref_count(0), 1);
  EXPECT_EQ(pool.ref_count(3), 0);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(PagePool, AllocateReturnsMinusOneWhenEmpty) {
  PagePool pool(1, 1);
  EXPECT_EQ(pool.allocate(), 0);
  EXPECT_EQ(pool.allocate(), -1);
  EXPECT_EQ(pool.num_used(), 1);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(PagePool, RetainAndReleaseCountReferences) {
  PagePool pool(2, 4);
  const int32_t p = pool.allocate();
  pool.retain(p);
  pool.retain(p);
  EXPECT_EQ(pool.ref_count(p), 3);
  EXPECT_FALSE(pool.release(p));
  EXPECT_FALSE(pool.release(p));
  EXPECT_EQ(pool.num_used(), 1);
  EXPECT_TRUE(pool.release(p));
  EXPECT_EQ(pool.ref_count(p), 0);
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(PagePool, RecentlyFreedPageIsReusedFirst) {
  PagePool pool(3, 4);
  pool.allocate();
  const int32_t b = pool.allocate();
  EXPECT_TRUE(pool.release(b));
  EXPECT_EQ(pool.allocate(), b);
}

TEST(PagePool, BulkAllocateIsAllOrNothing) {
  PagePool pool(3, 4);
  std::vector<int32_t> pages{42};
  ASSERT_TRUE(pool.allocate(2, &pages).ok());
  EXPECT_EQ(pages, (std::vector<int32_t>{42, 0, 1}));
  Status st = pool.allocate(2, &pages);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(pages.size(), 3u);
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.allocate(-1, &pages).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(pool.allocate(0, &pages).ok());
  EXPECT_EQ(pages.size(), 3u);
  EXPECT_TRUE(pool.check_invariants().ok());
}

// Each used page has an owner (a cache namespace); used pages are counted per owner, and the
// locked count per owner is what the holders report.
TEST(PagePool, CountsPagesPerOwner) {
  PagePool pool(5, 4);
  const int32_t a = pool.allocate(2), b = pool.allocate(2), c = pool.allocate();
  EXPECT_EQ(pool.owner(a), 2);
  EXPECT_EQ(pool.owner(c), 0);
  EXPECT_EQ(pool.owner_used(2), 2);
  EXPECT_EQ(pool.owner_used(0), 1);
  EXPECT_EQ(pool.owner_used(1), 0);
  EXPECT_EQ(pool.owner_used(7), 0);  // never used
  pool.add_locked(2, 2);
  EXPECT_EQ(pool.owner_locked(2), 2);
  EXPECT_EQ(pool.owner_locked(0), 0);
  EXPECT_EQ(pool.num_locked(), 2);
  EXPECT_TRUE(pool.check_invariants().ok());
  pool.add_locked(2, 1);  // more locked pages than used ones: a broken holder
  EXPECT_FALSE(pool.check_invariants().ok());
  pool.add_locked(2, -2);
  pool.retain(a);
  EXPECT_FALSE(pool.release(a));
  EXPECT_TRUE(pool.release(b));
  EXPECT_EQ(pool.owner_used(2), 1);
  std::vector<int32_t> pages;
  ASSERT_TRUE(pool.allocate(2, &pages, 3).ok());
  EXPECT_EQ(pool.owner_used(3), 2);
  EXPECT_EQ(pool.owner(pages[1]), 3);
  EXPECT_EQ(pool.num_used(), 4);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(PagePool, PagesForBudget) {
  KvLayout model;
  model.num_layers = 2;
  model.num_kv_heads = 4;
  model.head_dim = 8;
  model.dtype_bytes = 2;
  model.page_size = 16;
  // 2 layers * 2 (K, V) * 4 heads * 8 dims * 2 bytes = 256 bytes per token, 4096 per page.
  StatusOr<int32_t> pages = PagePool::pages_for_budget(model, 4096 * 10 + 100);
  ASSERT_TRUE(pages.ok());
  EXPECT_EQ(*pages, 10);
  EXPECT_EQ(PagePool::pages_for_budget(model, 4095).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PagePool::pages_for_budget(model, 0).status().code(), StatusCode::kInvalidArgument);
  // Huge budgets clamp to the int32 page id range.
  EXPECT_EQ(*PagePool::pages_for_budget(model, int64_t{1} << 62), INT32_MAX);
}

// An e4m3 pool (--kv-cache-dtype fp8) stores each (token, kv head) row of K or V as head_dim
// bytes and a float32 scale: (head_dim + 4) bytes against 2 * head_dim for fp16/bf16, so a
// budget holds 2 * head_dim / (head_dim + 4) times the pages (1.94x at head_dim 128).
TEST(PagePool, PagesForBudgetCountsE4m3ScaleBytes) {
  KvLayout fp16{.num_layers = 32, .num_kv_heads = 8, .head_dim = 128, .page_size = 16};
  KvLayout e4m3 = fp16;
  e4m3.dtype_bytes = 1;
  e4m3.scale_bytes = 4;
  // Llama-3-8B's shape: 32 layers * 2 * 8 heads * 16 tokens * (256 | 132) bytes a row.
  EXPECT_EQ(fp16.bytes_per_token() * 16, int64_t{32} * 2 * 8 * 16 * 256);
  EXPECT_EQ(e4m3.bytes_per_token() * 16, int64_t{32} * 2 * 8 * 16 * 132);
  const int64_t budget = int64_t{40} << 30;
  StatusOr<int32_t> p16 = PagePool::pages_for_budget(fp16, budget);
  StatusOr<int32_t> p8 = PagePool::pages_for_budget(e4m3, budget);
  ASSERT_TRUE(p16.ok() && p8.ok());
  EXPECT_EQ(*p16, 20480);  // 40 GiB / (32 * 2 * 8 * 16 * 256 bytes)
  EXPECT_EQ(*p8, 39718);   // 40 GiB / (32 * 2 * 8 * 16 * 132 bytes), integer division
  EXPECT_NEAR(double(*p8) / double(*p16), 256.0 / 132.0, 1e-3);  // 1.94x
  // The server's count (KvLayout::pages_for_budget over bytes_per_token) agrees.
  EXPECT_EQ(KvLayout::pages_for_budget(budget, e4m3.bytes_per_token(), e4m3.page_size), *p8);
  // Other head_dims: (2 * hd) / (hd + 4) times the pages, as integer division gives them.
  for (int32_t hd : {64, 80, 96, 256}) {
    fp16.head_dim = e4m3.head_dim = hd;
    const int64_t page16 = int64_t{32} * 2 * 8 * 16 * 2 * hd;
    const int64_t page8 = int64_t{32} * 2 * 8 * 16 * (hd + 4);
    EXPECT_EQ(*PagePool::pages_for_budget(fp16, budget), budget / page16) << hd;
    EXPECT_EQ(*PagePool::pages_for_budget(e4m3, budget), budget / page8) << hd;
  }
  // A negative scale_bytes is refused by name.
  KvLayout bad = e4m3;
  bad.scale_bytes = -4;
  Status st = PagePool::pages_for_budget(bad, budget).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("scale_bytes"), std::string::npos) << st.message();
}

TEST(PagePool, PagesForBudgetNamesTheBadField) {
  KvLayout model{.num_layers = 2, .num_kv_heads = 4, .head_dim = 8, .page_size = 16};
  KvLayout bad = model;
  bad.page_size = 0;
  EXPECT_NE(PagePool::pages_for_budget(bad, 1 << 20).status().message().find("page_size"),
            std::string::npos);
  bad = model;
  bad.page_size = 257;
  EXPECT_EQ(PagePool::pages_for_budget(bad, 1 << 20).status().code(), StatusCode::kInvalidArgument);
  // Two negative fields must not multiply into a positive size.
  bad = model;
  bad.num_layers = -2;
  bad.num_kv_heads = -4;
  Status st = PagePool::pages_for_budget(bad, 1 << 20).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("num_layers"), std::string::npos);
  bad = model;
  bad.head_dim = 0;
  EXPECT_NE(PagePool::pages_for_budget(bad, 1 << 20).status().message().find("head_dim"),
            std::string::npos);
  bad = model;
  bad.num_layers = bad.num_kv_heads = bad.head_dim = 1 << 30;  // would overflow int64
  st = PagePool::pages_for_budget(bad, int64_t{1} << 62).status();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("too large"), std::string::npos);
  bad = model;
  bad.dtype_bytes = 0;
  EXPECT_NE(PagePool::pages_for_budget(bad, 1 << 20).status().message().find("dtype_bytes"),
            std::string::npos);
}

}  // namespace
}  // namespace treeserve
