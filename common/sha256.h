// SHA-256, through OpenSSL's EVP interface: the server holds API keys as their digest
// (server/keys_file.h), and a routing key is a prefix of one (common/route_key.h).
#pragma once

#include <string>
#include <string_view>

namespace treeserve {

// The SHA-256 of `data` (32 raw bytes).
std::string sha256_digest(std::string_view data);
// Lower-case hex of the SHA-256 of `data` (64 characters): what `sha256sum` prints.
std::string sha256_hex(std::string_view data);

}  // namespace treeserve
