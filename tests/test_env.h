// Paths the tests read, fixed at configure time. Everything a test reads is in the checkout (assets/) or made
// by `make test` (the default model, the goldens): a missing file is a failure, never a skip.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace kvbound::test {

inline std::string test_data(const std::string& rel) { return std::string(KVBOUND_TEST_DATA) + "/" + rel; }
inline std::string asset(const std::string& rel) { return std::string(KVBOUND_ASSETS) + "/" + rel; }
inline std::string default_model() { return KVBOUND_DEFAULT_MODEL; }
inline std::string kvbound_bin() { return KVBOUND_BIN; }

// Runs `kvbound ARGS` (ARGS as a shell would split them); returns the exit code and fills stdout / stderr.
inline int run_kvbound(const std::string& args, std::string* out, std::string* err) {
  const std::filesystem::path err_file =
      std::filesystem::temp_directory_path() / ("kvbound_test_err_" + std::to_string(::getpid()));
  FILE* p = ::popen((kvbound_bin() + " " + args + " 2>" + err_file.string()).c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out->append(buf, n);
  const int status = ::pclose(p);
  std::ifstream in(err_file);
  err->assign(std::istreambuf_iterator<char>(in), {});
  std::filesystem::remove(err_file);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A fresh empty folder under the temp directory, removed by the destructor.
class TempDir {
 public:
  explicit TempDir(const std::string& tag)
      : path_(std::filesystem::temp_directory_path() / ("kvbound_" + tag + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string operator/(const std::string& rel) const { return (path_ / rel).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace kvbound::test

// Fails the current test, naming the file, when a file it needs is not there.
#define KVBOUND_REQUIRE_FILE(path)                                                                       \
  do {                                                                                                   \
    if (!std::filesystem::exists(path)) GTEST_FAIL() << "missing " << (path) << " (make test creates it)"; \
  } while (0)
