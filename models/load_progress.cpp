// Progress bar for paging in large checkpoints (models/detail/load_progress.h).
#include "models/detail/load_progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace treeserve::detail {

namespace {

constexpr size_t kPage = 4096;
constexpr int kBarWidth = 40;

void draw(size_t done, size_t total) {
  const int filled = static_cast<int>(static_cast<double>(done) / total * kBarWidth);
  char bar[kBarWidth + 1];
  for (int i = 0; i < kBarWidth; ++i) bar[i] = i < filled ? '#' : ' ';
  bar[kBarWidth] = '\0';
  std::fprintf(stderr, "\rloading weights [%s] %3d%% %.1f/%.1f GiB", bar,
               static_cast<int>(100.0 * done / total), done / double(1 << 30),
               total / double(1 << 30));
  std::fflush(stderr);
}

}  // namespace

void touch_pages_with_progress(const std::vector<MappedRange>& ranges, size_t min_bytes) {
  size_t total = 0;
  for (const MappedRange& r : ranges) total += r.size;
  if (total == 0 || total < min_bytes || !isatty(STDERR_FILENO)) return;

  size_t done = 0;
  size_t next_draw = 0;
  volatile unsigned char sink = 0;  // keeps the reads from being optimized away
  for (const MappedRange& r : ranges) {
    for (size_t off = 0; off < r.size; off += kPage) {
      sink = sink ^ r.base[off];
      done += std::min(kPage, r.size - off);
      if (done >= next_draw) {
        draw(done, total);
        next_draw = done + total / 200;
      }
    }
  }
  draw(total, total);
  std::fputc('\n', stderr);
}

}  // namespace treeserve::detail
