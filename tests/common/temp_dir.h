// A temporary directory owned by this test process. ctest runs each test case in its own
// process and several at once, so fixed names directly under ::testing::TempDir() would be
// shared (and removed) by concurrent cases; everything a test writes goes under this one.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <system_error>

namespace treeserve::testing_support {

class ProcessTempDir {
 public:
  ProcessTempDir()
      : path_(std::filesystem::path(::testing::TempDir()) /
              ("treeserve-test-" + std::to_string(::getpid()))) {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    std::filesystem::create_directories(path_, ec);
  }
  ~ProcessTempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// The directory's path with a trailing '/', the form ::testing::TempDir() returns.
inline std::string test_temp_dir() {
  static ProcessTempDir dir;
  return dir.path().string() + "/";
}

}  // namespace treeserve::testing_support
