// test_sources.cpp: rules of the CUDA sources that no compiler checks, read from the files.
//
// kernels/cuda launches its kernels with programmatic dependent launch (launch_kernel in
// common.cuh): a kernel may be scheduled before the kernel ahead of it in the stream has
// finished, so each one must wait for it (pdl_entry) before it touches global memory. A kernel
// that forgot would race its predecessor only on the GPU, and only sometimes. So: every
// __global__ function's first statement is pdl_entry(), and no file launches with <<<>>>
// (launches that would silently skip the dependent-launch attribute).
#include <catch2/catch.hpp>

#include "tests/source_text.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <string>
#include <vector>

namespace {

using loom::test::read_all;

// The text with // and /* */ comments blanked (string literals in kernel files hold no "//").
std::string strip_comments(const std::string& s) {
  std::string out = s;
  for (size_t i = 0; i + 1 < out.size(); i++) {
    if (out[i] == '/' && out[i + 1] == '/') {
      while (i < out.size() && out[i] != '\n') out[i++] = ' ';
    } else if (out[i] == '/' && out[i + 1] == '*') {
      size_t e = out.find("*/", i + 2);
      e = e == std::string::npos ? out.size() : e + 2;
      for (; i < e; i++)
        if (out[i] != '\n') out[i] = ' ';
    }
  }
  return out;
}

struct Kernel {
  std::string file, name;
  bool entry_first;
};

// Each __global__ definition in `text`: its name and whether its body opens with pdl_entry();
// (declarations, which end in ';' before any '{', are skipped).
std::vector<Kernel> kernels_in(const std::string& file, const std::string& text) {
  std::vector<Kernel> out;
  for (size_t at = text.find("__global__"); at != std::string::npos; at = text.find("__global__", at + 1)) {
    const size_t brace = text.find('{', at), semi = text.find(';', at);
    if (brace == std::string::npos || semi < brace) continue;
    // the name: the identifier before the first '(' that does not open __launch_bounds__(...)
    size_t a = at, b = at;
    for (size_t paren = text.find('(', at); paren < brace; paren = text.find('(', text.find(')', paren))) {
      b = paren;
      while (b > at && std::isspace(static_cast<unsigned char>(text[b - 1]))) b--;
      a = b;
      while (a > at && (std::isalnum(static_cast<unsigned char>(text[a - 1])) || text[a - 1] == '_')) a--;
      if (text.compare(a, b - a, "__launch_bounds__") != 0) break;
    }
    size_t body = brace + 1;
    while (body < text.size() && std::isspace(static_cast<unsigned char>(text[body]))) body++;
    out.push_back({file, text.substr(a, b - a), text.compare(body, 12, "pdl_entry();") == 0});
  }
  return out;
}

std::vector<std::string> cuda_sources() {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator("kernels/cuda")) {
    const std::string p = e.path().string();
    if (e.path().extension() == ".cu" || e.path().extension() == ".cuh") files.push_back(p);
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

TEST_CASE("kernels/cuda: every kernel waits for its predecessor first (pdl_entry)", "[sources]") {
  int n = 0;
  for (const std::string& f : cuda_sources()) {
    for (const Kernel& k : kernels_in(f, strip_comments(read_all(f)))) {
      INFO(k.file << ": kernel " << k.name << " must open with pdl_entry();");
      CHECK(k.entry_first);
      n++;
    }
  }
  CHECK(n >= 80);  // the kernels of kernels/cuda; a broken scan would find none
}

TEST_CASE("kernels/cuda: kernels are launched by launch_kernel, not <<<>>>", "[sources]") {
  int launches = 0;
  for (const std::string& f : cuda_sources()) {
    const std::string text = strip_comments(read_all(f));
    INFO(f);
    CHECK(text.find("<<<") == std::string::npos);
    for (size_t at = text.find("launch_kernel("); at != std::string::npos; at = text.find("launch_kernel(", at + 1))
      launches++;
  }
  CHECK(launches >= 90);
}

TEST_CASE("the source rules' scanner finds a kernel without pdl_entry", "[sources]") {
  const std::string good = "template <class T>\n__global__ void k1(T* x) {\n  pdl_entry();\n  x[0] = 0;\n}\n";
  const std::string bad = "__global__ void __launch_bounds__(256) k2(float* x) {\n  x[0] = 0;\n  pdl_entry();\n}\n";
  const std::string decl = "__global__ void k3(float* x);\n";
  auto g = kernels_in("good", good), b = kernels_in("bad", strip_comments("// __global__ void c() {}\n" + bad)),
       d = kernels_in("decl", decl);
  REQUIRE(g.size() == 1);
  CHECK(g[0].name == "k1");
  CHECK(g[0].entry_first);
  REQUIRE(b.size() == 1);
  CHECK(b[0].name == "k2");
  CHECK_FALSE(b[0].entry_first);
  CHECK(d.empty());
}
