// source_text.h: a file of the repository as one string, for the tests that read the sources
// and docs themselves (test_reading, test_sources; run from the repository root). A missing
// file reads as "", which those tests check for.
#pragma once
#include <fstream>
#include <sstream>
#include <string>

namespace loom::test {

inline std::string read_all(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace loom::test
