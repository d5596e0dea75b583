// Tenants at the server's edge: the keys file (format, effective quotas, every error naming its
// entry and field), keys of the file -> tenants in the Authenticator, and the per-tenant
// counters of the TenantGate (streams in flight, the requests-per-second bucket, the refusal
// count).
#include <gtest/gtest.h>

#include <thread>

#include "server/auth.h"
#include "server/keys_file.h"
#include "server/quotas.h"

namespace treeserve {
namespace {

const std::string kFile = R"({
  "comment": "two teams",
  "default_quotas": {"max_live_trees": 64, "kv_share": 0.25, "requests_per_second": 20,
                     "max_concurrent_streams": 4},
  "tenants": [
    {"name": "team-a", "quotas": {"kv_pages": 2000, "burst": 50}, "cache_salt": "docs"},
    {"name": "team-b", "quotas": {"max_live_trees": null, "max_live_branches": 100}},
    {"name": "team-c", "cache_salt": "docs", "comment": "reads team-a's cached documents"}
  ],
  "keys": [
    {"tenant": "team-a", "sha256": "5E884898DA28047151D0E56F8DC6292773603D0D6AABBDD62A11EF721D1542D8"},
    {"tenant": "team-b", "key": "b-secret"},
    {"tenant": "team-c", "key": "c-secret", "comment": "rotated monthly"},
    {"tenant": "default", "key": "d-secret"}
  ]
})";

const TenantConfig* find(const KeysFile& f, const std::string& name) {
  for (const TenantConfig& t : f.tenants) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

TEST(KeysFile, Sha256Hex) {
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("password"),
            "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8");
}

TEST(KeysFile, ParsesTenantsQuotasAndKeys) {
  StatusOr<KeysFile> f = parse_keys_file(kFile, "keys.json");
  ASSERT_TRUE(f.ok()) << f.status().message();
  ASSERT_EQ(f->tenants.size(), 4u);  // the three, and "default"
  const TenantConfig* a = find(*f, "team-a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->cache_salt, "docs");
  EXPECT_EQ(a->quotas.max_live_trees, 64);  // from default_quotas
  EXPECT_EQ(a->quotas.kv_pages, 2000);      // its own replaces the default kv_share
  EXPECT_EQ(a->quotas.kv_share, 0);
  EXPECT_EQ(a->quotas.burst, 50);
  EXPECT_EQ(a->quotas.requests_per_second, 20);
  const TenantConfig* b = find(*f, "team-b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->quotas.max_live_trees, 0);  // null lifts the default
  EXPECT_EQ(b->quotas.max_live_branches, 100);
  EXPECT_EQ(b->quotas.kv_share, 0.25);
  EXPECT_EQ(b->cache_salt, "");
  const TenantConfig* def = find(*f, "default");
  ASSERT_NE(def, nullptr);
  EXPECT_EQ(def->quotas.max_concurrent_streams, 4);
  ASSERT_EQ(f->keys.size(), 4u);
  EXPECT_EQ(f->keys[0].sha256, sha256_digest("password"));  // hex in any case
  EXPECT_EQ(f->keys[0].tenant, "team-a");
  EXPECT_EQ(f->keys[1].sha256, sha256_digest("b-secret"));
  EXPECT_EQ(f->keys[3].tenant, "default");

  std::vector<TenantLimits> limits = scheduler_tenants(*f);
  ASSERT_EQ(limits.size(), 4u);
  EXPECT_EQ(limits[0].tenant, "default");
  EXPECT_EQ(limits[1].tenant, "team-a");
  EXPECT_EQ(limits[1].kv_pages, 2000);
  EXPECT_EQ(limits[1].cache_salt, "docs");

  // An empty file is valid: no keys, and tenant "default" without quotas.
  StatusOr<KeysFile> empty = parse_keys_file("{}", "k.json");
  ASSERT_TRUE(empty.ok());
  ASSERT_EQ(empty->tenants.size(), 1u);
  EXPECT_EQ(empty->tenants[0].quotas.max_live_trees, 0);
  EXPECT_TRUE(empty->keys.empty());
}

// Every mistake is refused with the file, the entry and the field.
TEST(KeysFile, ErrorsNameTheEntryAndField) {
  struct Case {
    std::string json;
    std::string message;
  };
  const std::string sha(64, 'a');
  const std::vector<Case> cases = {
      {"[", "k.json: invalid JSON"},
      {"[]", "k.json: the top level must be a JSON object"},
      {R"({"key": []})", "k.json: key: unknown field"},
      {R"({"tenants": {}})", "k.json: tenants: must be an array"},
      {R"({"tenants": [{"quotas": {}}]})", "k.json: tenants[0].name: missing"},
      {R"({"tenants": [{"name": "a b"}]})",
       "k.json: tenants[0].name: 'a b' may hold only letters, digits, '.', '_' and '-'"},
      {R"({"tenants": [{"name": "a"}, {"name": "a"}]})",
       "k.json: tenants[1].name: 'a' is also tenants[0]"},
      {R"({"tenants": [{"name": "a", "quota": {}}]})", "k.json: tenants[0].quota: unknown field"},
      {R"({"tenants": [{"name": "a", "quotas": {"max_live_trees": 0}}]})",
       "k.json: tenants[0].quotas.max_live_trees: must be an integer in [1, 2147483647] or null"},
      {R"({"tenants": [{"name": "a", "quotas": {"max_trees": 5}}]})",
       "k.json: tenants[0].quotas.max_trees: unknown quota"},
      {R"({"tenants": [{"name": "a", "quotas": {"kv_share": 1.5}}]})",
       "k.json: tenants[0].quotas.kv_share: must be a number in (0, 1]"},
      {R"({"tenants": [{"name": "a", "quotas": {"kv_share": 0.5, "kv_pages": 10}}]})",
       "k.json: tenants[0].quotas: set kv_pages (pages) or kv_share (a share of the pool), not "
       "both"},
      {R"({"tenants": [{"name": "a", "quotas": {"requests_per_second": -1}}]})",
       "k.json: tenants[0].quotas.requests_per_second: must be a number > 0 or null"},
      {R"({"tenants": [{"name": "a", "quotas": {"burst": 5}}]})",
       "k.json: tenants[0].quotas.burst: needs requests_per_second"},
      {R"({"default_quotas": {"max_live_trees": 2.5}})",
       "k.json: default_quotas.max_live_trees: must be an integer"},
      {R"({"tenants": [{"name": "a", "cache_salt": ""}]})",
       "k.json: tenants[0].cache_salt: must be 1 to 256 characters"},
      {R"({"tenants": [{"name": "a", "cache_salt": "s", "quotas": {"kv_pages": 5}},
                       {"name": "b", "cache_salt": "s"}]})",
       "k.json: tenants 'a' and 'b' share cache_salt 's' (so one KV page limit)"},
      {R"({"keys": [{"tenant": "nobody", "key": "k"}]})",
       "k.json: keys[0].tenant: 'nobody' is not a tenant of this file"},
      {R"({"keys": [{"key": "k"}]})", "k.json: keys[0].tenant: missing"},
      {R"({"keys": [{"tenant": "default"}]})", "k.json: keys[0]: give exactly one of \"sha256\""},
      {R"({"keys": [{"tenant": "default", "key": "k", "sha256": ")" + sha + R"("}]})",
       "k.json: keys[0]: give exactly one of"},
      {R"({"keys": [{"tenant": "default", "sha256": "abc"}]})",
       "k.json: keys[0].sha256: must be 64 hex digits"},
      {R"({"keys": [{"tenant": "default", "sha256": ")" + std::string(64, 'g') + R"("}]})",
       "k.json: keys[0].sha256: must be 64 hex digits"},
      {R"({"keys": [{"tenant": "default", "key": "a b"}]})",
       "k.json: keys[0].key must not contain whitespace"},
      {R"({"keys": [{"tenant": "default", "key": 5}]})", "k.json: keys[0].key: must be a string"},
      {R"({"keys": [{"tenant": "default", "key": "password"},
                    {"tenant": "default", "sha256": "5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"}]})",
       "k.json: keys[1]: the same key as keys[0]"},
  };
  for (const Case& c : cases) {
    StatusOr<KeysFile> f = parse_keys_file(c.json, "k.json");
    ASSERT_FALSE(f.ok()) << c.json;
    EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(f.status().message().rfind(c.message, 0), 0u)
        << "got: " << f.status().message() << "\nwant: " << c.message;
  }
  EXPECT_EQ(load_keys_file("/nonexistent/keys.json").status().message(),
            "server.keys_file: cannot read '/nonexistent/keys.json'");
}

TEST(KeysFile, TheAuthenticatorMapsEachKeyToItsTenant) {
  StatusOr<KeysFile> f = parse_keys_file(kFile, "keys.json");
  ASSERT_TRUE(f.ok());
  ServerOptions options;
  options.keys_file = "keys.json";
  auto auth = Authenticator::create(options, nullptr, nullptr, &*f);
  ASSERT_TRUE(auth.ok()) << auth.status().message();
  EXPECT_TRUE((*auth)->enabled());
  EXPECT_EQ((*auth)->source(), "keys file keys.json (4 keys)");
  auto who = [&](const std::string& key) {
    const std::string header = "Bearer " + key;
    std::string_view value = header;
    return (*auth)->authenticate(&value, "peer", "/treeserve.v1.TreeServe/GetTree");
  };
  EXPECT_EQ(who("password")->tenant, "team-a");
  EXPECT_EQ(who("b-secret")->tenant, "team-b");
  EXPECT_EQ(who("c-secret")->tenant, "team-c");
  EXPECT_EQ(who("d-secret")->tenant, "default");
  EXPECT_EQ(who("nope").status().code(), StatusCode::kUnauthenticated);

  // With the single key too: it is tenant "default"; the same key in both is an error.
  auto both = Authenticator::create(options, "env-key", nullptr, &*f);
  ASSERT_TRUE(both.ok());
  EXPECT_EQ((*both)->source(), "$TREESERVE_API_KEY and keys file keys.json (4 keys)");
  auto twice = Authenticator::create(options, "b-secret", nullptr, &*f);
  EXPECT_EQ(twice.status().message(),
            "$TREESERVE_API_KEY is also keys[1] of server.keys_file: give each key one tenant");
  // A file without keys leaves authentication as the single key sets it (here: off).
  StatusOr<KeysFile> no_keys = parse_keys_file(R"({"default_quotas": {"max_live_trees": 5}})", "k");
  ASSERT_TRUE(no_keys.ok());
  auto off = Authenticator::create(options, nullptr, nullptr, &*no_keys);
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE((*off)->enabled());
}

std::vector<TenantConfig> gate_tenants() {
  TenantConfig a;
  a.name = "a";
  a.quotas.max_concurrent_streams = 2;
  a.quotas.requests_per_second = 2;
  a.quotas.burst = 3;
  TenantConfig b;
  b.name = "b";
  b.quotas.requests_per_second = 0.5;  // burst: ceil(0.5) = 1
  return {a, b};
}

TEST(TenantGate, RequestsPerSecondIsATokenBucketWithABurst) {
  MetricsRegistry registry;
  TenantGate gate(gate_tenants(), &registry);
  const auto t0 = TenantGate::Clock::now();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(gate.admit_request("a", t0).ok()) << i;  // the burst
  Status refused = gate.admit_request("a", t0);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(refused.message(),
            "tenant 'a': request rate at 2 per second with its burst of 3 used (quota "
            "requests_per_second); retry in 500 ms");
  EXPECT_TRUE(is_tenant_quota_refusal(refused));
  // A refused request took nothing: half a second later one more fits, and no more.
  const auto t1 = t0 + std::chrono::milliseconds(500);
  EXPECT_TRUE(gate.admit_request("a", t1).ok());
  EXPECT_FALSE(gate.admit_request("a", t1).ok());
  // The bucket holds at most the burst, however long the tenant was idle.
  const auto t2 = t1 + std::chrono::hours(1);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(gate.admit_request("a", t2).ok()) << i;
  EXPECT_FALSE(gate.admit_request("a", t2).ok());
  // Each tenant has its own bucket; one not listed has no limit.
  EXPECT_TRUE(gate.admit_request("b", t2).ok());
  EXPECT_FALSE(gate.admit_request("b", t2).ok());
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(gate.admit_request("other", t2).ok());
  EXPECT_EQ(gate.refusals(), 4);
  EXPECT_NE(registry.render().find("treeserve:quota_refusals_total 4"), std::string::npos)
      << registry.render();
}

TEST(TenantGate, StreamsAreCountedWhileTheirSlotsLive) {
  TenantGate gate(gate_tenants(), nullptr);
  {
    auto s1 = gate.open_stream("a");
    auto s2 = gate.open_stream("a");
    ASSERT_TRUE(s1.ok() && s2.ok());
    EXPECT_EQ(gate.streams_in_flight("a"), 2);
    auto s3 = gate.open_stream("a");
    EXPECT_EQ(s3.status().message(),
              "tenant 'a': concurrent streams 2 of 2 (quota max_concurrent_streams); wait for one "
              "to end");
    EXPECT_TRUE(gate.open_stream("b").ok());  // no stream quota
    TenantGate::StreamSlot moved = std::move(*s1);
    EXPECT_EQ(gate.streams_in_flight("a"), 2);
  }
  EXPECT_EQ(gate.streams_in_flight("a"), 0);
  // Many threads at once never pass the quota.
  std::atomic<int> peak{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      for (int k = 0; k < 2000; ++k) {
        auto slot = gate.open_stream("a");
        if (slot.ok()) {
          int now = gate.streams_in_flight("a");
          int prev = peak.load();
          while (now > prev && !peak.compare_exchange_weak(prev, now)) {
          }
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_LE(peak.load(), 2);
  EXPECT_EQ(gate.streams_in_flight("a"), 0);
}

TEST(TenantGate, CountsTheSchedulersQuotaRefusals) {
  TenantGate gate({}, nullptr);
  gate.count(ResourceExhausted("tenant 'a': live trees 8 of 8 (quota max_live_trees)"));
  gate.count(ResourceExhausted("KV pool exhausted"));
  gate.count(NotFound("tenant 'a'"));
  EXPECT_EQ(gate.refusals(), 1);
}

}  // namespace
}  // namespace treeserve
