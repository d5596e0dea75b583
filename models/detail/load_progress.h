// Paging in a freshly mapped checkpoint behind a terminal progress bar.
#pragma once

#include <cstddef>
#include <vector>

namespace treeserve::detail {

struct MappedRange {
  const unsigned char* base;
  size_t size;
};

// When stderr is a terminal and the ranges total at least min_bytes, reads one byte
// per page of every range (so later weight conversion does not stall on disk) while
// drawing a progress bar on stderr. Otherwise does nothing: small or non-interactive
// loads fault pages in lazily and print nothing.
void touch_pages_with_progress(const std::vector<MappedRange>& ranges, size_t min_bytes);

}  // namespace treeserve::detail
