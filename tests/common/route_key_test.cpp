// Routing keys and tree ids (common/route_key.h): the fixed vectors of route_key_vectors.json
// (the Python package's test, route_key_test.py, checks the same file), the header and replica
// id checks, and tree ids made and read back.
#include "common/route_key.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "common/sha256.h"

namespace treeserve {
namespace {

using nlohmann::json;

std::string repeated(const std::string& s, int64_t times) {
  std::string out;
  for (int64_t i = 0; i < times; ++i) out += s;
  return out;
}

std::string key_of_vector(const json& v) {
  const int64_t repeat = v.value("repeat", int64_t(1));
  const std::string kind = v.at("kind");
  if (kind == "text") {
    return route_key_text(repeated(v.at("text"), repeat),
                          v.value("prefix_bytes", kRoutePrefixBytes));
  }
  if (kind == "ids") {
    std::vector<int32_t> ids;
    if (v.contains("range")) {
      for (int32_t i = 0; i < v.at("range").get<int32_t>(); ++i) ids.push_back(i);
    } else {
      ids = v.at("ids").get<std::vector<int32_t>>();
    }
    return route_key_ids(ids, v.value("prefix_ids", kRoutePrefixIds));
  }
  std::vector<std::string> roles, contents;
  for (const json& m : v.at("messages")) {
    roles.push_back(m.at("role"));
    contents.push_back(repeated(m.at("content"), repeat));
  }
  std::vector<RouteMessage> messages;
  for (size_t i = 0; i < roles.size(); ++i) messages.emplace_back(roles[i], contents[i]);
  return route_key_messages(messages, v.value("prefix_bytes", kRoutePrefixBytes));
}

TEST(RouteKey, FixedVectors) {
  std::ifstream in(TREESERVE_ROUTE_KEY_VECTORS);
  ASSERT_TRUE(in) << TREESERVE_ROUTE_KEY_VECTORS;
  const json file = json::parse(in);
  ASSERT_GE(file.at("vectors").size(), 10u);
  for (const json& v : file.at("vectors")) {
    EXPECT_EQ(key_of_vector(v), v.at("key").get<std::string>()) << v.dump();
  }
}

TEST(RouteKey, SixteenHexDigitsOfTheCanonicalForm) {
  EXPECT_EQ(route_key_text("Once upon a time"), sha256_hex("text:Once upon a time").substr(0, 16));
  const std::vector<int32_t> ids = {3, 2, 1};
  EXPECT_EQ(route_key_ids(ids), sha256_hex("ids:3,2,1").substr(0, 16));
  // Prompts that share their first N bytes (M ids) share a key; others do not.
  const std::string head(kRoutePrefixBytes, 'p');
  EXPECT_EQ(route_key_text(head + "one ending"), route_key_text(head + "another"));
  EXPECT_NE(route_key_text("one prompt"), route_key_text("another prompt"));
  std::vector<int32_t> a(kRoutePrefixIds, 7), b = a;
  a.push_back(1);
  b.push_back(2);
  EXPECT_EQ(route_key_ids(a), route_key_ids(b));
  // The kinds do not collide: text "1" and the id 1 differ.
  const std::vector<int32_t> one = {1};
  EXPECT_NE(route_key_text("1"), route_key_ids(one));
}

TEST(RouteKey, HeaderValues) {
  for (const char* good : {"a", "3f2a9c0d1e2b4a5c", "user-42.session_7", "A.B-c_D"}) {
    EXPECT_TRUE(check_route_key(good).ok()) << good;
  }
  EXPECT_TRUE(check_route_key(std::string(64, 'k')).ok());
  for (const std::string& bad :
       {std::string(), std::string(65, 'k'), std::string("has space"), std::string("a/b"),
        std::string("caf\xc3\xa9"), std::string("a:b")}) {
    const Status s = check_route_key(bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(s.message().rfind("x-treeserve-route: must be 1 to 64 characters", 0), 0u)
        << s.message();
  }
}

TEST(RouteKey, ReplicaIds) {
  for (const char* good : {"local", "r1", "0", "replica-7", "a-b-c"}) {
    EXPECT_TRUE(check_replica_id(good, "server.replica_id").ok()) << good;
  }
  EXPECT_TRUE(check_replica_id(std::string(32, 'r'), "f").ok());
  for (const std::string& bad : {std::string(), std::string(33, 'r'), std::string("-r1"),
                                 std::string("R1"), std::string("r_1"), std::string("r.1")}) {
    const Status s = check_replica_id(bad, "server.replica_id");
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(s.message(),
              "server.replica_id: must be 1 to 32 characters of [a-z0-9-] starting "
              "with a letter or a digit, got '" +
                  bad + "'");
  }
}

TEST(TreeId, MadeAndReadBack) {
  const std::string incarnation = new_incarnation();
  ASSERT_EQ(incarnation.size(), 8u);
  EXPECT_EQ(incarnation.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(new_incarnation(), new_incarnation());  // 2^-32 to fail
  const std::string id = make_tree_id("3f2a9c0d1e2b4a5c", "r1", incarnation);
  ASSERT_EQ(id.size(), 2 + 16 + 1 + 2 + 1 + 8 + 1 + 32);
  EXPECT_EQ(id.substr(0, 22), "t_3f2a9c0d1e2b4a5c.r1.");
  auto parts = parse_tree_id(id);
  ASSERT_TRUE(parts);
  EXPECT_EQ(parts->route, "3f2a9c0d1e2b4a5c");
  EXPECT_EQ(parts->replica, "r1");
  EXPECT_EQ(parts->incarnation, incarnation);
  EXPECT_EQ(route_of_tree(id), "3f2a9c0d1e2b4a5c");
  EXPECT_EQ(route_of_tree("t_unknown"), "");
  // A route may hold dots: the id is read from the right.
  auto dotted = parse_tree_id(make_tree_id("user.42.a", "local", "0123abcd"));
  ASSERT_TRUE(dotted);
  EXPECT_EQ(dotted->route, "user.42.a");
  EXPECT_EQ(dotted->replica, "local");
  EXPECT_EQ(dotted->incarnation, "0123abcd");
  std::set<std::string> ids;
  for (int i = 0; i < 1000; ++i) ids.insert(make_tree_id("k", "local", incarnation));
  EXPECT_EQ(ids.size(), 1000u);
}

TEST(TreeId, OtherStringsDoNotParse) {
  const std::string hex32(32, 'a');
  for (const std::string& bad : {
           std::string(), std::string("t_unknown"),
           "t_" + std::string(22, 'Q'),                // an id of the base64 form
           "t_k.r1.0123abcd." + std::string(31, 'a'),  // random part too short
           "t_k.r1.0123abcd." + std::string(32, 'A'),  // upper-case hex
           "t_k.r1.0123abc." + hex32,                  // incarnation too short
           "t_k.R1.0123abcd." + hex32,                 // replica not [a-z0-9-]
           "t_.r1.0123abcd." + hex32,                  // empty route
           "t_k/x.r1.0123abcd." + hex32,               // route not [A-Za-z0-9._-]
           "x_k.r1.0123abcd." + hex32,                 // not a tree id
           "t_r1.0123abcd." + hex32,                   // a part missing
       }) {
    EXPECT_FALSE(parse_tree_id(bad)) << bad;
  }
  EXPECT_TRUE(parse_tree_id("t_k.r1.0123abcd." + hex32));
}

TEST(Sha256, KnownDigests) {
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_digest("abc").size(), 32u);
}

}  // namespace
}  // namespace treeserve
