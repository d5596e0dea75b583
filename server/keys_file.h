// The keys file (server.keys_file, --keys-file): API keys, each naming a tenant, and every
// tenant's quotas and cache salt. Format and example: docs/operations.md, "Tenants and quotas".
//
//   {
//     "default_quotas": {"max_live_trees": 64, "kv_share": 0.25, "requests_per_second": 20},
//     "tenants": [
//       {"name": "team-a", "quotas": {"kv_pages": 2000}, "cache_salt": "shared-docs"},
//       {"name": "team-b", "quotas": {"max_live_trees": null}}
//     ],
//     "keys": [
//       {"tenant": "team-a", "sha256": "<64 hex digits: the SHA-256 of the key>"},
//       {"tenant": "team-b", "key": "<the key itself>"}
//     ]
//   }
//
// A key is given as its SHA-256 (so the file holds no secret) or as itself. A tenant's quotas
// are default_quotas with its own "quotas" on top, field by field; null lifts a default limit.
// Tenant "default" (the single key of server.auth_token / $TREESERVE_API_KEY, or every call
// when no key is set) has default_quotas unless the file lists it. Every error names the file,
// the entry and the field ("keys.json: keys[2].sha256: ...").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/sha256.h"  // sha256_digest: how the server holds keys
#include "common/status.h"
#include "scheduler/scheduler.h"

namespace treeserve {

// 0 = no limit.
struct TenantQuotas {
  int32_t max_live_trees = 0;
  int32_t max_live_branches = 0;
  int32_t kv_pages = 0;                // KV pages of its cache namespace, or
  double kv_share = 0;                 // that share of the pool, in (0, 1]
  int32_t max_concurrent_streams = 0;  // Generate and TreeSearch calls in flight
  double requests_per_second = 0;      // a token bucket refilled at this rate ...
  int32_t burst = 0;                   // ... holding this many (0 = ceil(requests_per_second))
};

struct TenantConfig {
  std::string name;
  TenantQuotas quotas;     // effective: default_quotas with the tenant's own on top
  std::string cache_salt;  // "" = a cache namespace of its own
};

struct KeyEntry {
  std::string sha256;  // the key's SHA-256, 32 raw bytes
  std::string tenant;
};

struct KeysFile {
  std::vector<TenantConfig> tenants;  // each listed tenant, and "default"; by name
  std::vector<KeyEntry> keys;
};

// The tenant of the single key (server.auth_token, $TREESERVE_API_KEY), and of every call
// when no key is configured.
inline constexpr const char* kDefaultTenant = "default";

// Tenant names: 1..64 characters of [A-Za-z0-9._-] (they appear in messages and logs).
inline constexpr size_t kMaxTenantName = 64;

StatusOr<KeysFile> parse_keys_file(const std::string& json_text, const std::string& source);
StatusOr<KeysFile> load_keys_file(const std::string& path);

// The tenants as the scheduler takes them (quotas on trees, branches and KV pages; salts).
std::vector<TenantLimits> scheduler_tenants(const KeysFile& keys);

// INVALID_ARGUMENT naming `source` for an empty key or one holding whitespace or control
// characters (a key travels as "authorization: Bearer <key>").
Status check_api_key(const std::string& key, const std::string& source);

}  // namespace treeserve
