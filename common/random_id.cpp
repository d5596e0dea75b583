// random_id: bytes from getrandom(2) (the kernel's CSPRNG; /dev/urandom where the call is
// missing), drawn in blocks of 4 KiB so that an id costs a copy, not a system call.
#include "common/random_id.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace treeserve {
namespace {

constexpr size_t kBlock = 4096;

// Fills buf[0, n) straight from the kernel.
void fill_from_kernel(uint8_t* buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = getrandom(buf + got, n - got, 0);
    if (r > 0) {
      got += size_t(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    break;
  }
  if (got == n) return;
  const int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  while (fd >= 0 && got < n) {
    ssize_t r = read(fd, buf + got, n - got);
    if (r > 0) {
      got += size_t(r);
    } else if (!(r < 0 && errno == EINTR)) {
      break;
    }
  }
  if (fd >= 0) close(fd);
  if (got == n) return;
  std::fprintf(stderr, "treeserve: no randomness from getrandom or /dev/urandom (%s)\n",
               std::strerror(errno));
  std::abort();
}

struct Pool {
  std::mutex mu;
  uint8_t block[kBlock];
  size_t used = kBlock;  // empty until first use
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

void random_bytes(void* out, size_t n) {
  auto* dst = static_cast<uint8_t*>(out);
  if (n >= kBlock) {
    fill_from_kernel(dst, n);
    return;
  }
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mu);
  if (kBlock - p.used < n) {
    fill_from_kernel(p.block, kBlock);
    p.used = 0;
  }
  std::memcpy(dst, p.block + p.used, n);
  // Bytes handed out are wiped: a later core dump does not show ids already given.
  std::memset(p.block + p.used, 0, n);
  p.used += n;
}

std::string random_id(std::string_view prefix) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  constexpr size_t kBytes = kRandomIdBits / 8;  // 16
  uint8_t raw[kBytes + 2] = {};                 // two zero bytes pad the last group of 3
  random_bytes(raw, kBytes);
  std::string out(prefix);
  out.reserve(prefix.size() + (kRandomIdBits + 5) / 6);
  for (size_t i = 0; i < kBytes; i += 3) {
    const uint32_t v = (uint32_t(raw[i]) << 16) | (uint32_t(raw[i + 1]) << 8) | raw[i + 2];
    const size_t chars = i + 3 <= kBytes ? 4 : (kBytes - i) * 8 / 6 + 1;  // 16 % 3 = 1: 2 chars
    for (size_t c = 0; c < chars; ++c) out.push_back(kAlphabet[(v >> (18 - 6 * c)) & 63]);
  }
  return out;
}

std::string random_hex(size_t bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string raw(bytes, '\0');
  random_bytes(raw.data(), bytes);
  std::string out;
  out.reserve(2 * bytes);
  for (unsigned char c : raw) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

}  // namespace treeserve
