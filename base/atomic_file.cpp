#include "base/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "base/errors.h"

namespace kvbound {
namespace {

std::string errno_text() { return std::strerror(errno); }

// Removes the temporary file unless the rename that publishes it succeeded.
struct TempFileGuard {
  std::string path;
  bool published = false;
  ~TempFileGuard() {
    if (!published) ::unlink(path.c_str());
  }
};

void write_all(int fd, const std::string& bytes, const std::string& path) {
  std::size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      const std::string why = errno_text();
      ::close(fd);
      fail(path, "", "write failed: " + why);
    }
    written += static_cast<std::size_t>(n);
  }
}

}  // namespace

void write_file_atomic(const std::string& path, const std::string& bytes) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  if (target.filename().empty()) fail(path, "", "not a file name");
  const fs::path directory = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::error_code ec;
  fs::create_directories(directory, ec);
  if (ec) fail(path, "", "cannot create directory " + directory.string() + ": " + ec.message());

  std::string name_template = (directory / ("." + target.filename().string() + ".tmp.XXXXXX")).string();
  const int fd = ::mkstemp(name_template.data());
  if (fd < 0) fail(path, "", "cannot create a temporary file in " + directory.string() + ": " + errno_text());
  TempFileGuard guard{name_template};
  // mkstemp creates the file 0600; results are meant to be shared like any other output.
  ::fchmod(fd, 0644);
  write_all(fd, bytes, path);
  if (::fsync(fd) != 0) {
    const std::string why = errno_text();
    ::close(fd);
    fail(path, "", "fsync failed: " + why);
  }
  if (::close(fd) != 0) fail(path, "", "close failed: " + errno_text());
  if (::rename(guard.path.c_str(), path.c_str()) != 0) fail(path, "", "rename from temporary file failed: " + errno_text());
  guard.published = true;

  // The rename is already visible; syncing the directory only makes it survive a power loss, and some
  // filesystems refuse fsync on a directory, so a failure here is not an error.
  const int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

}  // namespace kvbound
