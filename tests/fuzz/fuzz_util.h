// Helpers the fuzz targets share: invariant checks that abort (libFuzzer then saves the input
// as a crash reproducer), a scratch directory per process, and UTF-8 validation.
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace treeserve::fuzz {

// A broken invariant: says which, then aborts like a sanitizer report would.
[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "==fuzz== invariant broken: %s\n", what.c_str());
  std::abort();
}

inline void check(bool ok, const char* invariant) {
  if (!ok) fail(invariant);
}

// A fresh directory under $TMPDIR (or /tmp), removed by no one: fuzz runs are short-lived and
// each process writes only a few small files there, emptied before each input.
inline std::string make_temp_dir(const char* name) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/" + name + ".XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) fail("cannot create a scratch directory");
  return templ;
}

// Removes the plain files in dir (the harnesses write no subdirectories).
inline void empty_dir(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") unlink((dir + "/" + name).c_str());
  }
  closedir(d);
}

// Well-formed UTF-8 (shortest forms, no surrogates, at most U+10FFFF).
inline bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n >= s.size()) return false;  // the sequence runs past the end
    for (size_t k = 1; k <= n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000)) return false;
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

}  // namespace treeserve::fuzz
