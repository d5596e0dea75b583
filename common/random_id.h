// Identifiers nobody can guess: random bits from the operating system's CSPRNG (getrandom),
// written in URL-safe base64 after a short prefix (branch ids) or in hex (the random part of a
// tree id, common/route_key.h), so a stale or guessed id never opens another client's tree,
// and ids are never reused across restarts (nothing is counted from zero).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace treeserve {

// Random bits in an id: 128, written as 22 characters of [A-Za-z0-9_-] (no padding).
inline constexpr int kRandomIdBits = 128;

// `prefix` followed by kRandomIdBits fresh random bits. Thread-safe.
std::string random_id(std::string_view prefix);

// `bytes` fresh random bytes written as 2 x bytes lowercase hex digits (the random parts of a
// tree id and a replica's incarnation: common/route_key.h). Thread-safe.
std::string random_hex(size_t bytes);

// Fills out[0, n) with bytes from the OS CSPRNG. Thread-safe. Aborts the process if the
// kernel has no randomness to give (getrandom and /dev/urandom both fail): an id that could
// be guessed is worse than no server.
void random_bytes(void* out, size_t n);

}  // namespace treeserve
