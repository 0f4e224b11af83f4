// fileio.cpp: durable writes (see fileio.h).
#include "tensor/fileio.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "tensor/tensor.h"

namespace loom {

std::string parent_dir(const std::string& path) {
  size_t s = path.find_last_of('/');
  if (s == std::string::npos) return ".";
  return s == 0 ? "/" : path.substr(0, s);
}

static void fsync_fd_of(const std::string& path, int flags, const char* what) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  LOOM_CHECK(fd >= 0, "%s: cannot open to sync %s: %s", path.c_str(), what, std::strerror(errno));
  int rc = ::fsync(fd), err = errno;
  ::close(fd);
  LOOM_CHECK(rc == 0, "%s: fsync of the %s failed: %s", path.c_str(), what, std::strerror(err));
}

void fsync_dir(const std::string& dir) { fsync_fd_of(dir, O_RDONLY | O_DIRECTORY, "folder"); }

void fsync_path(const std::string& path) { fsync_fd_of(path, O_RDONLY, "file"); }

void write_file_atomic(const std::string& path, const std::vector<ByteSpan>& pieces) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LOOM_CHECK(fd >= 0, "%s: cannot open for writing: %s", tmp.c_str(), std::strerror(errno));
  auto fail = [&](const char* what) {
    int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());  // never leave a partial file behind
    LOOM_CHECK(false, "%s: %s failed: %s", tmp.c_str(), what, std::strerror(err));
  };
  for (const ByteSpan& p : pieces) {
    const char* b = static_cast<const char*>(p.first);
    size_t left = p.second;
    while (left > 0) {
      ssize_t n = ::write(fd, b, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        if (n == 0) errno = EIO;
        fail("write");
      }
      b += n;
      left -= size_t(n);
    }
  }
  if (::fsync(fd) != 0) fail("fsync");
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    LOOM_CHECK(false, "%s: close failed: %s", tmp.c_str(), std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    LOOM_CHECK(false, "cannot rename %s to %s: %s", tmp.c_str(), path.c_str(), std::strerror(err));
  }
  fsync_dir(parent_dir(path));
}

}  // namespace loom
