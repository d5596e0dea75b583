// The keys file: JSON -> tenants and keys, with every field checked (server/keys_file.h).
#include "server/keys_file.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

namespace treeserve {
namespace {

using nlohmann::json;

// A quota field: an integer >= 1 ("int"), a number in (0, 1] ("share") or > 0 ("rate").
enum class QuotaKind { kInt, kShare, kRate };

struct QuotaField {
  const char* name;
  QuotaKind kind;
};

constexpr QuotaField kQuotaFields[] = {
    {"max_live_trees", QuotaKind::kInt},
    {"max_live_branches", QuotaKind::kInt},
    {"kv_pages", QuotaKind::kInt},
    {"kv_share", QuotaKind::kShare},
    {"max_concurrent_streams", QuotaKind::kInt},
    {"requests_per_second", QuotaKind::kRate},
    {"burst", QuotaKind::kInt},
};

// The fields a "quotas" object sets: a number, or null for "no limit".
using QuotaValues = std::map<std::string, json>;

Status check_fields(const json& obj, const std::string& where, const std::string& source,
                    std::initializer_list<const char*> known) {
  if (!obj.is_object()) return InvalidArgument(source + ": " + where + ": must be an object");
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    if (std::find_if(known.begin(), known.end(), [&](const char* k) { return it.key() == k; }) ==
        known.end()) {
      std::string list;
      for (const char* k : known) list += (list.empty() ? "" : ", ") + std::string(k);
      return InvalidArgument(source + ": " + (where.empty() ? "" : where + ".") + it.key() +
                             ": unknown field (known: " + list + ")");
    }
  }
  return Status::Ok();
}

StatusOr<QuotaValues> parse_quotas(const json& obj, const std::string& where,
                                   const std::string& source) {
  if (!obj.is_object()) return InvalidArgument(source + ": " + where + ": must be an object");
  QuotaValues out;
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const std::string at = source + ": " + where + "." + it.key();
    const QuotaField* field = nullptr;
    for (const QuotaField& f : kQuotaFields) {
      if (it.key() == f.name) field = &f;
    }
    if (field == nullptr) {
      std::string list;
      for (const QuotaField& f : kQuotaFields)
        list += (list.empty() ? "" : ", ") + std::string(f.name);
      return InvalidArgument(at + ": unknown quota (known: " + list + ")");
    }
    const json& v = it.value();
    if (v.is_null()) {
      out[it.key()] = v;
      continue;
    }
    switch (field->kind) {
      case QuotaKind::kInt:
        if (!v.is_number_integer() || v.get<int64_t>() < 1 ||
            v.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
          return InvalidArgument(at + ": must be an integer in [1, 2147483647] or null (no " +
                                 "limit), got " + v.dump());
        }
        break;
      case QuotaKind::kShare:
        if (!v.is_number() || !(v.get<double>() > 0 && v.get<double>() <= 1)) {
          return InvalidArgument(at + ": must be a number in (0, 1] (a share of the KV pool) " +
                                 "or null, got " + v.dump());
        }
        break;
      case QuotaKind::kRate:
        if (!v.is_number() || !(v.get<double>() > 0 && std::isfinite(v.get<double>()))) {
          return InvalidArgument(at + ": must be a number > 0 or null, got " + v.dump());
        }
        break;
    }
    out[it.key()] = v;
  }
  if (out.count("kv_pages") && out.count("kv_share") && !out["kv_pages"].is_null() &&
      !out["kv_share"].is_null()) {
    return InvalidArgument(source + ": " + where +
                           ": set kv_pages (pages) or kv_share (a share of the pool), not both");
  }
  return out;
}

// default_quotas with a tenant's own on top, field by field; kv_pages and kv_share are one
// quota (setting either replaces both).
TenantQuotas effective_quotas(const QuotaValues& defaults, const QuotaValues& own) {
  QuotaValues merged = defaults;
  if (own.count("kv_pages") || own.count("kv_share")) {
    merged.erase("kv_pages");
    merged.erase("kv_share");
  }
  for (const auto& [k, v] : own) merged[k] = v;
  TenantQuotas q;
  auto get_int = [&](const char* k) -> int32_t {
    auto it = merged.find(k);
    return it == merged.end() || it->second.is_null() ? 0 : it->second.get<int32_t>();
  };
  auto get_num = [&](const char* k) -> double {
    auto it = merged.find(k);
    return it == merged.end() || it->second.is_null() ? 0.0 : it->second.get<double>();
  };
  q.max_live_trees = get_int("max_live_trees");
  q.max_live_branches = get_int("max_live_branches");
  q.kv_pages = get_int("kv_pages");
  q.kv_share = get_num("kv_share");
  q.max_concurrent_streams = get_int("max_concurrent_streams");
  q.requests_per_second = get_num("requests_per_second");
  q.burst = get_int("burst");
  return q;
}

Status check_tenant_name(const std::string& name, const std::string& at) {
  if (name.empty() || name.size() > kMaxTenantName) {
    return InvalidArgument(at + ": must be 1 to " + std::to_string(kMaxTenantName) +
                           " characters, got '" + name + "'");
  }
  for (unsigned char c : name) {
    if (!std::isalnum(c) && c != '.' && c != '_' && c != '-') {
      return InvalidArgument(at + ": '" + name +
                             "' may hold only letters, digits, '.', '_' and '-'");
    }
  }
  return Status::Ok();
}

Status get_string(const json& obj, const char* key, const std::string& at, std::string* out,
                  bool required) {
  auto it = obj.find(key);
  if (it == obj.end()) {
    return required ? InvalidArgument(at + "." + key + ": missing") : Status::Ok();
  }
  if (!it->is_string()) return InvalidArgument(at + "." + key + ": must be a string");
  *out = it->get<std::string>();
  return Status::Ok();
}

// "<64 hex digits>" -> 32 raw bytes.
bool parse_hex_digest(const std::string& hex, std::string* out) {
  if (hex.size() != 64) return false;
  out->clear();
  for (size_t i = 0; i < hex.size(); i += 2) {
    int byte = 0;
    for (size_t j = i; j < i + 2; ++j) {
      const char c = static_cast<char>(std::tolower(static_cast<unsigned char>(hex[j])));
      int nibble = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (nibble < 0) return false;
      byte = byte * 16 + nibble;
    }
    out->push_back(static_cast<char>(byte));
  }
  return true;
}

}  // namespace

Status check_api_key(const std::string& key, const std::string& source) {
  if (key.empty()) return InvalidArgument(source + " is set but empty");
  for (unsigned char c : key) {
    if (c <= 0x20 || c == 0x7f) {
      return InvalidArgument(source +
                             " must not contain whitespace or control characters (it is sent "
                             "as 'authorization: Bearer <key>')");
    }
  }
  return Status::Ok();
}

StatusOr<KeysFile> parse_keys_file(const std::string& json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    return InvalidArgument(source + ": invalid JSON: " + e.what());
  }
  if (!root.is_object()) return InvalidArgument(source + ": the top level must be a JSON object");
  TS_RETURN_IF_ERROR(
      check_fields(root, "", source, {"default_quotas", "tenants", "keys", "comment"}));
  QuotaValues defaults;
  if (auto it = root.find("default_quotas"); it != root.end()) {
    StatusOr<QuotaValues> q = parse_quotas(*it, "default_quotas", source);
    if (!q.ok()) return q.status();
    defaults = std::move(*q);
  }

  KeysFile out;
  std::map<std::string, size_t> tenant_index;  // name -> index in "tenants"
  std::map<std::string, std::vector<std::string>> by_salt;
  if (auto it = root.find("tenants"); it != root.end()) {
    if (!it->is_array()) return InvalidArgument(source + ": tenants: must be an array");
    for (size_t i = 0; i < it->size(); ++i) {
      const json& t = (*it)[i];
      const std::string where = "tenants[" + std::to_string(i) + "]";
      const std::string at = source + ": " + where;
      TS_RETURN_IF_ERROR(
          check_fields(t, where, source, {"name", "quotas", "cache_salt", "comment"}));
      TenantConfig tc;
      TS_RETURN_IF_ERROR(get_string(t, "name", at, &tc.name, /*required=*/true));
      TS_RETURN_IF_ERROR(check_tenant_name(tc.name, at + ".name"));
      if (auto [prev, added] = tenant_index.emplace(tc.name, i); !added) {
        return InvalidArgument(at + ".name: '" + tc.name + "' is also tenants[" +
                               std::to_string(prev->second) + "]");
      }
      QuotaValues own;
      if (auto q = t.find("quotas"); q != t.end()) {
        StatusOr<QuotaValues> parsed = parse_quotas(*q, where + ".quotas", source);
        if (!parsed.ok()) return parsed.status();
        own = std::move(*parsed);
      }
      TS_RETURN_IF_ERROR(get_string(t, "cache_salt", at, &tc.cache_salt, false));
      if (t.contains("cache_salt") && (tc.cache_salt.empty() || tc.cache_salt.size() > 256)) {
        return InvalidArgument(at +
                               ".cache_salt: must be 1 to 256 characters (leave it out for a "
                               "cache of the tenant's own)");
      }
      tc.quotas = effective_quotas(defaults, own);
      if (tc.quotas.burst > 0 && tc.quotas.requests_per_second <= 0) {
        return InvalidArgument(at +
                               ".quotas.burst: needs requests_per_second (here or in "
                               "default_quotas)");
      }
      if (!tc.cache_salt.empty()) by_salt[tc.cache_salt].push_back(tc.name);
      out.tenants.push_back(std::move(tc));
    }
  }
  if (!tenant_index.count(kDefaultTenant)) {
    TenantConfig def;
    def.name = kDefaultTenant;
    def.quotas = effective_quotas(defaults, {});
    if (def.quotas.burst > 0 && def.quotas.requests_per_second <= 0) {
      return InvalidArgument(source + ": default_quotas.burst: needs requests_per_second");
    }
    out.tenants.push_back(std::move(def));
  }
  // Tenants sharing a salt share one namespace and its KV page limit (the sum of theirs): all
  // of them need a KV quota, or none.
  for (const auto& [salt, names] : by_salt) {
    const TenantConfig* with = nullptr;
    const TenantConfig* without = nullptr;
    for (const TenantConfig& t : out.tenants) {
      if (t.cache_salt != salt) continue;
      (t.quotas.kv_pages > 0 || t.quotas.kv_share > 0 ? with : without) = &t;
    }
    if (with != nullptr && without != nullptr) {
      return InvalidArgument(source + ": tenants '" + with->name + "' and '" + without->name +
                             "' share cache_salt '" + salt +
                             "' (so one KV page limit): give both a KV quota (kv_pages or "
                             "kv_share) or neither");
    }
  }

  if (auto it = root.find("keys"); it != root.end()) {
    if (!it->is_array()) return InvalidArgument(source + ": keys: must be an array");
    std::map<std::string, size_t> seen;  // digest -> index
    for (size_t i = 0; i < it->size(); ++i) {
      const json& k = (*it)[i];
      const std::string where = "keys[" + std::to_string(i) + "]";
      const std::string at = source + ": " + where;
      TS_RETURN_IF_ERROR(check_fields(k, where, source, {"tenant", "sha256", "key", "comment"}));
      KeyEntry entry;
      TS_RETURN_IF_ERROR(get_string(k, "tenant", at, &entry.tenant, /*required=*/true));
      if (entry.tenant != kDefaultTenant && !tenant_index.count(entry.tenant)) {
        return InvalidArgument(at + ".tenant: '" + entry.tenant +
                               "' is not a tenant of this file (list it under \"tenants\")");
      }
      const bool has_hash = k.contains("sha256"), has_key = k.contains("key");
      if (has_hash == has_key) {
        return InvalidArgument(at +
                               ": give exactly one of \"sha256\" (the key's SHA-256 in hex) "
                               "or \"key\" (the key itself)");
      }
      std::string value;
      if (has_hash) {
        TS_RETURN_IF_ERROR(get_string(k, "sha256", at, &value, true));
        if (!parse_hex_digest(value, &entry.sha256)) {
          return InvalidArgument(
              at +
              ".sha256: must be 64 hex digits (the output of `printf %s \"$KEY\" | "
              "sha256sum`), got " +
              (value.size() != 64 ? std::to_string(value.size()) + " characters"
                                  : std::string("a character that is not a hex digit")));
        }
      } else {
        TS_RETURN_IF_ERROR(get_string(k, "key", at, &value, true));
        TS_RETURN_IF_ERROR(check_api_key(value, at + ".key"));
        entry.sha256 = sha256_digest(value);
      }
      if (auto [prev, added] = seen.emplace(entry.sha256, i); !added) {
        return InvalidArgument(at + ": the same key as keys[" + std::to_string(prev->second) + "]");
      }
      out.keys.push_back(std::move(entry));
    }
  }
  std::sort(out.tenants.begin(), out.tenants.end(),
            [](const TenantConfig& a, const TenantConfig& b) { return a.name < b.name; });
  return out;
}

StatusOr<KeysFile> load_keys_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("server.keys_file: cannot read '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_keys_file(ss.str(), path);
}

std::vector<TenantLimits> scheduler_tenants(const KeysFile& keys) {
  std::vector<TenantLimits> out;
  for (const TenantConfig& t : keys.tenants) {
    TenantLimits l;
    l.tenant = t.name;
    l.cache_salt = t.cache_salt;
    l.max_live_trees = t.quotas.max_live_trees;
    l.max_live_branches = t.quotas.max_live_branches;
    l.kv_pages = t.quotas.kv_pages;
    l.kv_share = t.quotas.kv_share;
    out.push_back(std::move(l));
  }
  return out;
}

}  // namespace treeserve
