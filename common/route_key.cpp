// Routing keys and tree ids (common/route_key.h).
#include "common/route_key.h"

#include <algorithm>

#include "common/random_id.h"
#include "common/sha256.h"

namespace treeserve {
namespace {

constexpr size_t kKeyHexDigits = 16;
constexpr size_t kTreeRandomBytes = 16;  // 128 bits, as branch ids

std::string key_of(std::string_view canonical) {
  return sha256_hex(canonical).substr(0, kKeyHexDigits);
}

bool is_lower_hex(std::string_view s, size_t digits) {
  if (s.size() != digits) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool is_route_char(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

bool is_route_key(std::string_view s) {
  if (s.empty() || s.size() > kMaxRouteKeyChars) return false;
  for (char c : s) {
    if (!is_route_char(c)) return false;
  }
  return true;
}

bool is_replica_id(std::string_view s) {
  if (s.empty() || s.size() > kMaxReplicaIdChars || s[0] == '-') return false;
  for (char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return true;
}

}  // namespace

std::string route_key_text(std::string_view text, size_t prefix_bytes) {
  return key_of("text:" + std::string(text.substr(0, prefix_bytes)));
}

std::string route_key_ids(std::span<const int32_t> ids, size_t prefix_ids) {
  std::string canonical = "ids:";
  for (size_t i = 0; i < ids.size() && i < prefix_ids; ++i) {
    if (i > 0) canonical += ',';
    canonical += std::to_string(ids[i]);
  }
  return key_of(canonical);
}

std::string route_key_messages(std::span<const RouteMessage> messages, size_t prefix_bytes) {
  std::string joined;
  for (const auto& [role, content] : messages) {
    if (joined.size() >= prefix_bytes) break;
    joined.append(role).append("\n").append(content).append("\n");
  }
  joined.resize(std::min(joined.size(), prefix_bytes));
  return key_of("messages:" + joined);
}

Status check_route_key(std::string_view value) {
  if (is_route_key(value)) return Status::Ok();
  return InvalidArgument(std::string(kRouteHeader) + ": must be 1 to " +
                         std::to_string(kMaxRouteKeyChars) +
                         " characters of [A-Za-z0-9._-] (the route of a tree id, or the routing "
                         "key of a prompt), got " +
                         std::to_string(value.size()) + " bytes");
}

Status check_replica_id(std::string_view value, const std::string& field) {
  if (is_replica_id(value)) return Status::Ok();
  return InvalidArgument(field + ": must be 1 to " + std::to_string(kMaxReplicaIdChars) +
                         " characters of [a-z0-9-] starting with a letter or a digit, got '" +
                         std::string(value) + "'");
}

std::string new_incarnation() { return random_hex(kIncarnationHexDigits / 2); }

std::string make_tree_id(std::string_view route, std::string_view replica,
                         std::string_view incarnation) {
  std::string id = "t_";
  id.append(route).append(".").append(replica).append(".").append(incarnation).append(".");
  return id + random_hex(kTreeRandomBytes);
}

std::optional<TreeIdParts> parse_tree_id(std::string_view id) {
  if (id.substr(0, 2) != "t_") return std::nullopt;
  std::string_view rest = id.substr(2);
  std::string_view parts[3];  // random, incarnation, replica: the last three, right to left
  for (std::string_view& part : parts) {
    const size_t dot = rest.rfind('.');
    if (dot == std::string_view::npos) return std::nullopt;
    part = rest.substr(dot + 1);
    rest = rest.substr(0, dot);
  }
  if (!is_lower_hex(parts[0], 2 * kTreeRandomBytes) ||
      !is_lower_hex(parts[1], kIncarnationHexDigits) || !is_replica_id(parts[2]) ||
      !is_route_key(rest)) {
    return std::nullopt;
  }
  return TreeIdParts{std::string(rest), std::string(parts[2]), std::string(parts[1])};
}

std::string route_of_tree(std::string_view tree_id) {
  std::optional<TreeIdParts> parts = parse_tree_id(tree_id);
  return parts ? parts->route : std::string();
}

}  // namespace treeserve
