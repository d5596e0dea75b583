// Progress bar for paging in large checkpoints (models/detail/load_progress.h).
#include "models/detail/load_progress.h"

#include <unistd.h>

#include <algorithm>

namespace treeserve::detail {

namespace {

constexpr size_t kPage = 4096;
constexpr int kBarWidth = 40;
constexpr int kRedraws = 200;  // at most this many updates, however large the checkpoint

void draw(std::FILE* out, size_t done, size_t total) {
  const double fraction = static_cast<double>(done) / static_cast<double>(total);
  const int filled = static_cast<int>(fraction * kBarWidth);
  char bar[kBarWidth + 1];
  for (int i = 0; i < kBarWidth; ++i) bar[i] = i < filled ? '#' : ' ';
  bar[kBarWidth] = '\0';
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  std::fprintf(out, "\rloading weights [%s] %3d%% %.1f/%.1f GiB", bar,
               static_cast<int>(100.0 * fraction), static_cast<double>(done) / kGiB,
               static_cast<double>(total) / kGiB);
  std::fflush(out);
}

}  // namespace

void touch_pages_with_progress(const std::vector<MappedRange>& ranges, size_t min_bytes,
                               std::FILE* out) {
  size_t total = 0;
  for (const MappedRange& r : ranges) total += r.size;
  if (out == nullptr || total == 0 || total < min_bytes || !isatty(fileno(out))) return;

  size_t done = 0;
  size_t next_draw = 0;
  volatile unsigned char sink = 0;  // keeps the reads from being optimized away
  for (const MappedRange& r : ranges) {
    for (size_t off = 0; off < r.size; off += kPage) {
      sink = sink ^ r.base[off];
      done += std::min(kPage, r.size - off);
      if (done >= next_draw && done < total) {
        draw(out, done, total);
        next_draw = done + total / kRedraws;
      }
    }
  }
  draw(out, total, total);
  std::fputc('\n', out);
  std::fflush(out);
}

}  // namespace treeserve::detail
