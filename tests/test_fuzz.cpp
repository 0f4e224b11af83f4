// test_fuzz.cpp: replays every input kept under tests/fuzz/<target>/ (inputs that once
// crashed a parser or broke a property, found by `make fuzz`) through the same fuzz target,
// in the normal test run (and under ASan + UBSan in `make SANITIZE=1 test`). Each target is
// also run on fresh random inputs, so the replay harness itself is exercised.
#include <catch2/catch.hpp>

#include <dirent.h>

#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "data/images.h"
#include "fuzz/targets.h"

namespace {

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> v;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') v.push_back(dir + "/" + e->d_name);
    closedir(d);
  }
  return v;
}

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("fuzz regressions: every kept input runs through its target", "[fuzz]") {
  int replayed = 0;
  for (const auto& t : loom::fuzz::all_targets()) {
    for (const std::string& f : files_in(std::string("tests/fuzz/") + t.name)) {
      INFO(f);
      std::string bytes = slurp(f);
      CHECK(t.fn(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()) == 0);
      replayed++;
    }
  }
  WARN(replayed << " regression inputs replayed");
}

TEST_CASE("fuzz targets: random inputs are refused without a crash", "[fuzz]") {
  std::mt19937_64 rng(std::random_device{}());
  for (const auto& t : loom::fuzz::all_targets()) {
    INFO(t.name);
    for (int i = 0; i < 20; i++) {
      std::string bytes(size_t(rng() % 512), '\0');
      for (auto& c : bytes) c = char(rng());
      CHECK(t.fn(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()) == 0);
    }
  }
}

// The inputs that found defects, each with the verdict the fix gives (the replay above runs
// them; these name what must happen).
TEST_CASE("fuzz regressions: the verdicts of the fixed defects", "[fuzz]") {
  std::string jpeg = slurp("tests/fuzz/image/jpeg_dht_257_codes");
  REQUIRE(jpeg.size() > 100);
  std::vector<float> out;
  std::string err;
  CHECK(loom::decode_image_chw(reinterpret_cast<const unsigned char*>(jpeg.data()), jpeg.size(), 8, 3, out, &err) ==
        loom::ImageStatus::DecodeError);
  CHECK(err.find("Huffman table with") != std::string::npos);
}
