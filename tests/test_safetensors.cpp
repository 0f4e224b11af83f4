// test_safetensors.cpp: the safetensors reader and writer (tensor/safetensors.h).
//
// Round trips for every dtype the writer emits, plus metadata; an F16 file written byte by
// byte here (the writer never emits F16) read back widened to f32; and malformed files, each
// written by hand into a temporary directory, each rejected with a message that names the
// file and, where one is at fault, the tensor.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <random>
#include <filesystem>
#include <stdexcept>
#include <fstream>
#include <string>
#include <vector>

#include "tensor/safetensors.h"
#include "tests/scratch_dir.h"

using namespace loom;
using Catch::Contains;
using std::string;
using std::vector;

namespace {

const string& temp_dir() { return loom_test::scratch_root(); }

string temp_path(const string& name) { return temp_dir() + "/" + name; }

// Writes the raw safetensors layout: 8-byte little-endian header length (hlen, or the
// header's own size when hlen < 0), the header text, then the data bytes.
string write_raw(const string& name, const string& header, const vector<uint8_t>& data, int64_t hlen = -1) {
  string path = temp_path(name);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  uint64_t n = hlen < 0 ? header.size() : uint64_t(hlen);
  unsigned char len[8];
  for (int i = 0; i < 8; i++) len[i] = (unsigned char)(n >> (8 * i));
  f.write(reinterpret_cast<const char*>(len), 8);
  f.write(header.data(), std::streamsize(header.size()));
  f.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
  return path;
}

vector<uint8_t> bytes(size_t n, uint8_t seed = 1) {
  vector<uint8_t> v(n);
  for (size_t i = 0; i < n; i++) v[i] = uint8_t(seed + 37 * i);
  return v;
}

// A valid two-tensor header: a F32 [2, 3] at [0, 24), b I32 [4] at [24, 40).
const char* kGoodHeader =
    R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},)"
    R"( "b": {"dtype": "I32", "shape": [4], "data_offsets": [24, 40]}})";

}  // namespace

TEST_CASE("safetensors: round trip of every dtype with metadata", "[safetensors]") {
  Rng rng(31);
  std::map<string, Tensor> ts;
  ts["f32"] = Tensor::randn({3, 5}, rng, 1.0, DType::F32);
  ts["f64"] = Tensor::randn({7}, rng, 1.0, DType::F64);
  ts["bf16"] = Tensor::randn({2, 3, 4}, rng, 1.0, DType::BF16);
  vector<int32_t> i32 = {-3, 0, 2147483647, -2147483647 - 1, 5};
  ts["i32"] = Tensor::from_vector(i32, {5});
  vector<int64_t> i64 = {int64_t(1) << 50, -1, 0};
  ts["i64"] = Tensor::from_vector(i64, {3, 1});
  vector<uint8_t> u8 = {0, 255, 7, 128, 9};
  ts["u8"] = Tensor::from_vector(u8, {5});
  ts["scalar"] = Tensor::from_vector(vector<double>{-0.25}, {});
  ts["empty"] = Tensor::empty({0, 4}, DType::F32);
  // a strided view is written as its contiguous values
  Tensor base = Tensor::randn({4, 6}, rng, 1.0, DType::F32);
  ts["strided"] = base.transpose(0, 1).narrow(0, 1, 3);
  std::map<string, string> meta = {{"format", "pt"}, {"config", R"({"dim": 48, "name": "x y"})"}};

  string path = temp_path("all.safetensors");
  save_safetensors(path, ts, meta);
  SafeTensors st = load_safetensors(path);
  CHECK(st.path == path);
  CHECK(st.metadata == meta);
  REQUIRE(st.tensors.size() == ts.size());
  for (auto& [name, t] : ts) {
    INFO(name);
    const Tensor& got = st.at(name);
    CHECK(got.dtype() == t.dtype());
    CHECK(got.shape() == t.shape());
    CHECK(got.is_contiguous());
    Tensor want = t.contiguous();
    REQUIRE(got.nbytes() == want.nbytes());
    if (want.nbytes()) CHECK(std::memcmp(got.raw(), want.raw(), want.nbytes()) == 0);  // bit exact
  }
  CHECK(st.at("i32").to_vector<int32_t>() == i32);
  CHECK(st.at("i64").to_vector<int64_t>() == i64);
  REQUIRE_THROWS_WITH(st.at("missing"), Contains(path) && Contains("missing"));

  SECTION("data is 8-byte aligned and no .tmp file is left behind") {
    std::ifstream f(path, std::ios::binary);
    uint64_t hlen = 0;
    f.read(reinterpret_cast<char*>(&hlen), 8);
    CHECK((8 + hlen) % 8 == 0);
    CHECK_FALSE(std::ifstream(path + ".tmp").good());
  }
  SECTION("no metadata writes no __metadata__") {
    string p2 = temp_path("nometa.safetensors");
    save_safetensors(p2, {{"x", ts["f32"]}});
    SafeTensors s2 = load_safetensors(p2);
    CHECK(s2.metadata.empty());
    CHECK(s2.at("x").to_vector<float>() == ts["f32"].to_vector<float>());
  }
}

TEST_CASE("safetensors: F16 is read and widened to f32", "[safetensors]") {
  // hand-picked halves and their exact values
  struct H {
    uint16_t bits;
    float value;
  };
  vector<H> hs = {
      {0x3C00, 1.0f},       {0xC000, -2.0f},           {0x3800, 0.5f},
      {0x7BFF, 65504.0f},   {0x0001, std::ldexp(1.0f, -24)},  // smallest subnormal
      {0x0200, std::ldexp(1.0f, -15)},                         // a subnormal with a higher bit
      {0x03FF, 1023 * std::ldexp(1.0f, -24)},                  // largest subnormal
      {0x0400, std::ldexp(1.0f, -14)},                         // smallest normal
      {0x3555, 0.333251953125f}, {0x8000, -0.0f},  {0x7C00, INFINITY}, {0xFC00, -INFINITY},
  };
  vector<uint8_t> data;
  for (auto& h : hs) {
    data.push_back(uint8_t(h.bits & 0xff));
    data.push_back(uint8_t(h.bits >> 8));
  }
  data.push_back(0x00);  // + one NaN (0x7E00)
  data.push_back(0x7E);
  size_t n = hs.size() + 1;
  string header = R"({"h": {"dtype": "F16", "shape": [)" + std::to_string(n) + R"(], "data_offsets": [0, )" +
                  std::to_string(2 * n) + "]}}";
  string path = write_raw("f16.safetensors", header, data);
  SafeTensors st = load_safetensors(path);
  const Tensor& t = st.at("h");
  CHECK(t.dtype() == DType::F32);
  REQUIRE(t.numel() == int64_t(n));
  auto v = t.to_vector<float>();
  for (size_t i = 0; i < hs.size(); i++) {
    INFO("half 0x" << std::hex << hs[i].bits);
    CHECK(v[i] == hs[i].value);
    CHECK(std::signbit(v[i]) == std::signbit(hs[i].value));
    CHECK(float_to_half(hs[i].value) == hs[i].bits);  // and back
  }
  CHECK(std::isnan(v.back()));
}

TEST_CASE("safetensors: malformed files are rejected naming the file and the tensor", "[safetensors]") {
  SECTION("the valid baseline loads") {
    string p = write_raw("good.safetensors", kGoodHeader, bytes(40));
    SafeTensors st = load_safetensors(p);
    CHECK(st.at("a").shape() == Shape{2, 3});
    CHECK(st.at("b").shape() == Shape{4});
  }
  SECTION("a zero-size tensor may sit at the offset where the next tensor starts") {
    // 'z' sorts after 'a' by name but comes first by offsets: (0, 0) then (0, 24)
    string p = write_raw("zero.safetensors",
                         R"({"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]},)"
                         R"( "z": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}})",
                         bytes(24));
    SafeTensors st = load_safetensors(p);
    CHECK(st.at("z").shape() == Shape{0, 3});
    CHECK(st.at("a").numel() == 6);
  }
  SECTION("missing file") {
    string p = temp_path("nope.safetensors");
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("cannot open"));
  }
  SECTION("truncated: shorter than the 8-byte header length") {
    string p = temp_path("short.safetensors");
    { std::ofstream(p, std::ios::binary) << "abcde"; }
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("too short"));
  }
  SECTION("truncated header: the file ends inside the JSON") {
    string h = kGoodHeader;
    string p = write_raw("trunc_header.safetensors", h.substr(0, 30), {}, int64_t(h.size()));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("header length"));
  }
  SECTION("header length beyond the file") {
    string p = write_raw("hlen.safetensors", kGoodHeader, bytes(40), int64_t(1) << 40);
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("exceeds the file"));
  }
  SECTION("bad JSON") {
    string p = write_raw("badjson.safetensors", R"({"a": {"dtype": "F32", "shape": [2, 3],, }})", bytes(24));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("not valid JSON"));
    string q = write_raw("array.safetensors", "[1, 2]", {});
    REQUIRE_THROWS_WITH(load_safetensors(q), Contains(q) && Contains("not a JSON object"));
  }
  SECTION("unknown dtype") {
    string p = write_raw("dtype.safetensors",
                         R"({"weird": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]}})", bytes(4));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("'weird'") && Contains("F8_E4M3"));
  }
  SECTION("missing fields, bad shape entries") {
    string p = write_raw("fields.safetensors", R"({"w": {"dtype": "F32", "shape": [1]}})", bytes(4));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("'w'") && Contains("data_offsets"));
    string q = write_raw("negdim.safetensors", R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})",
                         bytes(4));
    REQUIRE_THROWS_WITH(load_safetensors(q), Contains(q) && Contains("'w'"));
  }
  SECTION("offsets out of range") {
    string p = write_raw("range.safetensors",
                         R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},)"
                         R"( "b": {"dtype": "I32", "shape": [4], "data_offsets": [24, 48]}})",
                         bytes(40));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("'b'") && Contains("outside"));
    string q = write_raw("reversed.safetensors", R"({"a": {"dtype": "U8", "shape": [0], "data_offsets": [8, 4]}})",
                         bytes(8));
    REQUIRE_THROWS_WITH(load_safetensors(q), Contains(q) && Contains("'a'"));
  }
  SECTION("size not matching the shape") {
    string p = write_raw("size.safetensors",
                         R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]},)"
                         R"( "b": {"dtype": "I32", "shape": [5], "data_offsets": [20, 40]}})",
                         bytes(40));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && (Contains("'a'") || Contains("'b'")) && Contains("needs"));
  }
  SECTION("overlapping tensors") {
    string p = write_raw("overlap.safetensors",
                         R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},)"
                         R"( "b": {"dtype": "I32", "shape": [4], "data_offsets": [16, 32]}})",
                         bytes(32));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("'b'") && Contains("overlaps"));
  }
  SECTION("a gap between tensors") {
    string p = write_raw("gap.safetensors",
                         R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},)"
                         R"( "b": {"dtype": "I32", "shape": [4], "data_offsets": [28, 44]}})",
                         bytes(44));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("'b'") && Contains("unused bytes"));
  }
  SECTION("trailing bytes after the last tensor") {
    string p = write_raw("trailing.safetensors", kGoodHeader, bytes(41));
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("'b'") && Contains("trailing"));
  }
  SECTION("metadata must map strings to strings") {
    string p = write_raw("meta.safetensors", R"({"__metadata__": {"n": 3}})", {});
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("'n'"));
  }
  SECTION("a shape whose size product overflows 64 bits (it wrapped to 0 bytes before)") {
    string p = write_raw("overflow.safetensors",
                         R"({"w": {"dtype": "F32", "shape": [4294967296, 1073741824], "data_offsets": [0, 0]}})", {});
    REQUIRE_THROWS_WITH(load_safetensors(p), Contains(p) && Contains("'w'") && Contains("overflows"));
    // the product of the nonzero sizes must fit too: their strides would overflow
    string q = write_raw("overflow0.safetensors",
                         R"({"w": {"dtype": "U8", "shape": [0, 4294967296, 4294967296], "data_offsets": [0, 0]}})", {});
    REQUIRE_THROWS_WITH(load_safetensors(q), Contains(q) && Contains("'w'") && Contains("overflows"));
    // a dimension past INT64_MAX (it would read back as a negative size)
    string r = write_raw("overflow_dim.safetensors",
                         R"({"w": {"dtype": "U8", "shape": [18446744073709551615], "data_offsets": [0, 0]}})", {});
    REQUIRE_THROWS_WITH(load_safetensors(r), Contains(r) && Contains("'w'") && Contains("overflows"));
  }
}

TEST_CASE("safetensors: the in-memory parser and the file reader agree", "[safetensors]") {
  Rng rng(uint64_t(std::random_device{}()));
  Tensor a = Tensor::from_vector(std::vector<float>{float(rng.normal()), float(rng.normal()), float(rng.normal())}, {3});
  string p = temp_path("mem.safetensors");
  save_safetensors(p, {{"a", a}});
  std::ifstream f(p, std::ios::binary);
  string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  SafeTensors st = parse_safetensors(bytes, "memory");
  REQUIRE(st.at("a").to_vector<float>() == a.to_vector<float>());
  // no .tmp file is left beside the written one
  CHECK_FALSE(std::filesystem::exists(p + ".tmp"));
  REQUIRE_THROWS_WITH(parse_safetensors(bytes.substr(0, 9), "memory"), Contains("memory"));
}

TEST_CASE("shapes: element counts and byte sizes that overflow are rejected", "[safetensors]") {
  REQUIRE_THROWS_WITH(Tensor::empty({int64_t(1) << 32, int64_t(1) << 31}, DType::F32), Contains("overflows"));
  REQUIRE_THROWS_WITH(Tensor::empty({int64_t(1) << 61}, DType::F64), Contains("overflows"));
  REQUIRE_THROWS_WITH(Tensor::empty({2, -3}, DType::F32), Contains("negative"));
}
