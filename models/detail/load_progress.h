// Paging in a freshly mapped checkpoint behind a terminal progress bar.
#pragma once

#include <cstddef>
#include <cstdio>
#include <vector>

namespace treeserve::detail {

struct MappedRange {
  const unsigned char* base;
  size_t size;
};

// When `out` is a terminal (isatty) and the ranges total at least min_bytes, reads one
// byte per page of every range (so later weight conversion does not stall on disk) while
// drawing a progress bar on `out`. Otherwise does nothing and prints nothing: small or
// non-interactive loads (logs, pipes, CI) fault pages in lazily.
void touch_pages_with_progress(const std::vector<MappedRange>& ranges, size_t min_bytes,
                               std::FILE* out = stderr);

}  // namespace treeserve::detail
