// The tree viewer's static files (server/viewer/), compiled into the binary at build time
// (cmake/embed_files.cmake) so that serving them needs no files beside the executable.
#pragma once

#include <span>
#include <string_view>

namespace treeserve {

struct EmbeddedFile {
  std::string_view name;  // relative to server/viewer/, e.g. "viewer.js"
  std::string_view data;
};

// Every file of server/viewer/ as it was at build time.
std::span<const EmbeddedFile> viewer_files();

}  // namespace treeserve
