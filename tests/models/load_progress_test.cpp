// The load progress bar draws on a terminal (a pseudo-terminal here) and stays silent
// on files and pipes, and below its size threshold.
#include "models/detail/load_progress.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <pty.h>
#include <termios.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace treeserve {
namespace {

using detail::MappedRange;
using detail::touch_pages_with_progress;

class LoadProgressTest : public ::testing::Test {
 protected:
  // 3 ranges, 40 pages and a bit in all.
  LoadProgressTest() : a_(4096 * 25, 1), b_(4096 * 15 + 100, 2), c_(10, 3) {
    ranges_ = {{a_.data(), a_.size()}, {b_.data(), b_.size()}, {c_.data(), c_.size()}};
  }
  size_t total() const { return a_.size() + b_.size() + c_.size(); }

  std::vector<unsigned char> a_, b_, c_;
  std::vector<MappedRange> ranges_;
};

TEST_F(LoadProgressTest, DrawsOnATerminal) {
  int master = -1, slave = -1;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  termios raw{};
  ASSERT_EQ(tcgetattr(slave, &raw), 0);
  cfmakeraw(&raw);  // no "\n" -> "\r\n" translation
  ASSERT_EQ(tcsetattr(slave, TCSANOW, &raw), 0);
  std::FILE* out = fdopen(slave, "w");
  ASSERT_NE(out, nullptr);
  ASSERT_TRUE(isatty(fileno(out)));

  // Drain the master side concurrently: a pty's buffer is finite.
  std::string seen;
  std::thread reader([&] {
    char buf[4096];
    while (seen.find('\n') == std::string::npos) {
      const ssize_t n = read(master, buf, sizeof(buf));
      if (n <= 0) break;
      seen.append(buf, static_cast<size_t>(n));
    }
  });
  touch_pages_with_progress(ranges_, /*min_bytes=*/total(), out);
  reader.join();
  std::fclose(out);
  close(master);

  EXPECT_NE(seen.find("loading weights ["), std::string::npos) << seen;
  EXPECT_NE(seen.find("100%"), std::string::npos) << seen;
  EXPECT_NE(seen.find("[########################################] 100%"), std::string::npos);
  EXPECT_EQ(seen.back(), '\n');
  EXPECT_EQ(seen.find("100%"), seen.rfind("100%")) << "100% drawn once: " << seen;
}

TEST_F(LoadProgressTest, SilentWhenNotATerminal) {
  std::FILE* file = std::tmpfile();
  ASSERT_NE(file, nullptr);
  touch_pages_with_progress(ranges_, /*min_bytes=*/0, file);
  EXPECT_EQ(std::ftell(file), 0);
  std::fclose(file);

  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  std::FILE* pipe_out = fdopen(fds[1], "w");
  touch_pages_with_progress(ranges_, /*min_bytes=*/0, pipe_out);
  std::fclose(pipe_out);  // closes the write end: the read below sees EOF, not a hang
  char c;
  EXPECT_EQ(read(fds[0], &c, 1), 0);
  close(fds[0]);
}

TEST_F(LoadProgressTest, SilentBelowTheThresholdEvenOnATerminal) {
  int master = -1, slave = -1;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  std::FILE* out = fdopen(slave, "w");
  ASSERT_NE(out, nullptr);
  touch_pages_with_progress(ranges_, /*min_bytes=*/total() + 1, out);
  touch_pages_with_progress({}, /*min_bytes=*/0, out);
  std::fflush(out);
  ASSERT_EQ(fcntl(master, F_SETFL, O_NONBLOCK), 0);
  char buf[16];
  EXPECT_LT(read(master, buf, sizeof(buf)), 1);  // nothing to read (EAGAIN)
  std::fclose(out);
  close(master);
}

}  // namespace
}  // namespace treeserve
