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

#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb_image_write.h>

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
  // JPEG Huffman tables of more than 256 codes (stb_image wrote past its size array, in the
  // header parse of stbi_info and in the decode); the second one puts junk before the table,
  // the third 0xFF fill bytes before the SOI marker; the fourth made stb's Huffman decoder
  // read before its symbol table. With libjpeg-turbo (LOOM_HAVE_LIBJPEG) stb decodes no JPEG.
  for (const char* f : {"tests/fuzz/image/jpeg_dht_257_codes", "tests/fuzz/image/jpeg_dht_257_codes_resync",
                        "tests/fuzz/image/jpeg_dht_257_codes_fill_bytes",
                        "tests/fuzz/image/jpeg_huffman_decode_negative_index"}) {
    INFO(f);
    std::string jpeg = slurp(f);
    REQUIRE(jpeg.size() > 100);
    std::vector<float> out;
    std::string err;
    CHECK(loom::decode_image_chw(reinterpret_cast<const unsigned char*>(jpeg.data()), jpeg.size(), 8, 3, out, &err) ==
          loom::ImageStatus::DecodeError);
    CHECK(!err.empty());
    err.clear();
    CHECK(loom::probe_image(f, nullptr, nullptr, &err) != loom::ImageStatus::Ok);
    CHECK(!err.empty());
  }
}

TEST_CASE("fuzz regressions: a PNG chunk longer than the file is refused before any allocation", "[fuzz]") {
  // 113 bytes whose IDAT claims 1.4 GB: stb reallocated its buffer to that before reading
  std::string png = slurp("tests/fuzz/image/png_idat_claims_1.4GB");
  REQUIRE(png.size() == 113);
  std::vector<float> out;
  std::string err;
  CHECK(loom::decode_image_chw(reinterpret_cast<const unsigned char*>(png.data()), png.size(), 8, 3, out, &err) ==
        loom::ImageStatus::DecodeError);
  CHECK(err.find("chunk 'IDAT' at byte 33 claims") != std::string::npos);
}

// An empty IDAT whose CRC is cut off by the end of the file (stb copied its 0 bytes to NULL
// too): refused as a truncated PNG, no undefined behaviour on the way (the sanitizer build).
TEST_CASE("fuzz regressions: an empty IDAT cut off inside its CRC", "[fuzz]") {
  std::string png = slurp("tests/fuzz/image/png_empty_idat_cut_crc");
  REQUIRE(png.size() == 44);
  std::vector<float> out;
  std::string err;
  CHECK(loom::decode_image_chw(reinterpret_cast<const unsigned char*>(png.data()), png.size(), 8, 3, out, &err) ==
        loom::ImageStatus::DecodeError);
  CHECK(!err.empty());
}

// An empty IDAT chunk holds no data: the copy without it (what the decoder hands stb) must
// decode to the same pixels as the file without it.
TEST_CASE("images: a PNG with empty IDAT chunks decodes like the one without", "[fuzz]") {
  std::mt19937_64 rng(std::random_device{}());
  int w = 5 + int(rng() % 7), h = 3 + int(rng() % 5);
  std::vector<unsigned char> px(size_t(w) * h * 3);
  for (auto& v : px) v = (unsigned char)rng();
  int len = 0;
  unsigned char* png = stbi_write_png_to_mem(px.data(), w * 3, w, h, 3, &len);
  REQUIRE(png != nullptr);
  std::string plain(reinterpret_cast<char*>(png), size_t(len));
  STBIW_FREE(png);
  // after IHDR (8 + 25 bytes): an empty IDAT (length 0, type, CRC of the type alone)
  std::string empty = std::string("\0\0\0\0IDAT\xae\x42\x60\x82", 12);
  std::string with = plain.substr(0, 33) + empty + plain.substr(33);
  std::vector<float> a, b;
  auto dec = [](const std::string& f, std::vector<float>& out) {
    return loom::decode_image_chw(reinterpret_cast<const unsigned char*>(f.data()), f.size(), 6, 3, out);
  };
  REQUIRE(dec(plain, a) == loom::ImageStatus::Ok);
  REQUIRE(dec(with, b) == loom::ImageStatus::Ok);
  CHECK(a == b);
}
