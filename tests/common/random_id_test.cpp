// random_id: the prefix, the length and alphabet (URL-safe base64), and that ids drawn in
// bulk, from several threads, never repeat and use every bit (each character position takes
// many values).
#include "common/random_id.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

namespace treeserve {
namespace {

TEST(RandomId, PrefixLengthAndAlphabet) {
  const std::string id = random_id("t_");
  ASSERT_EQ(id.size(), 2u + 22u);
  EXPECT_EQ(id.substr(0, 2), "t_");
  for (char c : id.substr(2)) {
    EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') << id;
  }
  EXPECT_EQ(random_id("").size(), 22u);
}

TEST(RandomId, NeverRepeatsAcrossThreads) {
  constexpr int kThreads = 4, kEach = 20000;
  std::vector<std::vector<std::string>> ids(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) ids[t].push_back(random_id("b_"));
    });
  }
  for (auto& th : threads) th.join();
  std::set<std::string> all;
  for (auto& v : ids) all.insert(v.begin(), v.end());
  EXPECT_EQ(all.size(), size_t(kThreads * kEach));
  // Every position but the last varies over (nearly) the whole alphabet; the last carries
  // 2 bits (128 = 21 * 6 + 2), so 4 values.
  for (size_t pos = 2; pos < 24; ++pos) {
    std::set<char> seen;
    for (const std::string& id : ids[0]) seen.insert(id[pos]);
    EXPECT_EQ(seen.size(), pos == 23 ? 4u : 64u) << "position " << pos;
  }
}

// random_hex: two lowercase hex digits a byte, each position taking all 16 values.
TEST(RandomId, Hex) {
  EXPECT_EQ(random_hex(0), "");
  std::vector<std::set<char>> seen(32);
  for (int i = 0; i < 2000; ++i) {
    const std::string h = random_hex(16);
    ASSERT_EQ(h.size(), 32u);
    for (size_t pos = 0; pos < h.size(); ++pos) {
      ASSERT_NE(std::string("0123456789abcdef").find(h[pos]), std::string::npos) << h;
      seen[pos].insert(h[pos]);
    }
  }
  for (const auto& s : seen) EXPECT_EQ(s.size(), 16u);
}

TEST(RandomId, BytesLargerThanTheBlock) {
  std::vector<unsigned char> a(10000), b(10000);
  random_bytes(a.data(), a.size());
  random_bytes(b.data(), b.size());
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace treeserve
