// Paths the tests read, fixed at configure time, and a visible skip when shared data is absent.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

namespace kvbound::test {

inline std::string test_data(const std::string& rel) { return std::string(KVBOUND_TEST_DATA) + "/" + rel; }
inline std::string shared_data(const std::string& rel) { return std::string(KVBOUND_SHARED_DATA) + "/" + rel; }
inline std::string default_model() { return KVBOUND_DEFAULT_MODEL; }
inline std::string kvbound_bin() { return KVBOUND_BIN; }

}  // namespace kvbound::test

// Skips the current test, saying why, when a file it needs is not there.
#define KVBOUND_REQUIRE_FILE(path)                                                   \
  do {                                                                               \
    if (!std::filesystem::exists(path)) GTEST_SKIP() << "missing " << (path);        \
  } while (0)
