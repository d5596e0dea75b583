// Routing across replicas (docs/api.md, "Routing across replicas"). Replicas of the server sit
// behind a proxy that hashes the header x-treeserve-route consistently, so every call carrying
// one key reaches one replica. This file owns the two things client and server must agree on:
//
//  - the routing key of a prompt: the first 16 lowercase hex digits of the SHA-256 of the
//    prompt's leading part in a canonical form ("text:" + its first N bytes, "ids:" + its first
//    M ids joined by ",", "messages:" + the first N bytes of role "\n" content "\n" over the
//    messages), so prompts that share a prefix share a replica and its prefix cache;
//  - the tree id, which carries the tree's key, the replica that holds it and that replica's
//    incarnation (a random tag drawn at each start):
//      t_<route>.<replica>.<incarnation>.<32 hex digits, 128 random bits>
//    A client reads the key back from the id (route_of_tree) for every later call; a replica
//    named in an id it did not make tells the caller where the tree lives.
//
// The server, the C++ load client and the Python package (clients/python/treeserve/routing.py)
// compute the same keys: tests/common checks both against the same fixed vectors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace treeserve {

inline constexpr char kRouteHeader[] = "x-treeserve-route";      // the routing key of a call
inline constexpr char kReplicaHeader[] = "x-treeserve-replica";  // who answered it
inline constexpr char kDefaultReplicaId[] = "local";
inline constexpr size_t kRoutePrefixBytes = 256;  // N: text and messages bytes hashed
inline constexpr size_t kRoutePrefixIds = 64;     // M: token ids hashed
inline constexpr size_t kMaxRouteKeyChars = 64;
inline constexpr size_t kMaxReplicaIdChars = 32;
inline constexpr size_t kIncarnationHexDigits = 8;

// Routing keys of a prompt's leading part.
std::string route_key_text(std::string_view text, size_t prefix_bytes = kRoutePrefixBytes);
std::string route_key_ids(std::span<const int32_t> ids, size_t prefix_ids = kRoutePrefixIds);
// Messages as (role, content), in order.
using RouteMessage = std::pair<std::string_view, std::string_view>;
std::string route_key_messages(std::span<const RouteMessage> messages,
                               size_t prefix_bytes = kRoutePrefixBytes);

// A header value that is a routing key: 1 to 64 of [A-Za-z0-9._-]; otherwise INVALID_ARGUMENT
// naming x-treeserve-route.
Status check_route_key(std::string_view value);
// A replica id: 1 to 32 of [a-z0-9-], starting with a letter or a digit; otherwise
// INVALID_ARGUMENT naming `field`.
Status check_replica_id(std::string_view value, const std::string& field);

// A new incarnation: 8 random lowercase hex digits.
std::string new_incarnation();

struct TreeIdParts {
  std::string route;
  std::string replica;
  std::string incarnation;
};
// A new tree id for `route` on `replica` in its run `incarnation`.
std::string make_tree_id(std::string_view route, std::string_view replica,
                         std::string_view incarnation);
// The parts of an id of the form above, read from the right (a route may hold dots; the other
// parts cannot); nullopt for any other string.
std::optional<TreeIdParts> parse_tree_id(std::string_view id);
// The route an id carries, what a client sends with every call on the tree; "" for an id of
// another form.
std::string route_of_tree(std::string_view tree_id);

}  // namespace treeserve
