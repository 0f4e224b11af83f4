// test_reading.cpp: docs/READING.md, the guided tour of the code, cannot rot. Every
// `path` it names in backticks must exist, and every `path:name` must name a function, class
// or struct that the file defines (for `A::b`, the file must hold `A::b(` or declare `b(`).
#include <catch2/catch.hpp>

#include "tests/source_text.h"

#include <regex>
#include <string>
#include <vector>

namespace {

using loom::test::read_all;

// Does `text` define `name`: a call-like `name(` (function or method definition/declaration),
// or `struct name` / `class name`.
bool defines(const std::string& text, const std::string& name) {
  const std::string last = name.substr(name.rfind(':') == std::string::npos ? 0 : name.rfind(':') + 1);
  if (name.find("::") != std::string::npos && text.find(name + "(") != std::string::npos) return true;
  const std::regex fn("(^|[^A-Za-z0-9_])" + last + "\\s*\\(");
  const std::regex type("(struct|class)\\s+" + last + "([^A-Za-z0-9_]|$)");
  return std::regex_search(text, fn) || std::regex_search(text, type);
}

}  // namespace

TEST_CASE("docs/READING.md: every file and file:function it names exists", "[docs]") {
  const std::string doc = read_all("docs/READING.md");
  REQUIRE(!doc.empty());
  // `dir/file.ext` or `dir/file.ext:name`, inside backticks
  const std::regex ref("`([A-Za-z0-9_./-]+/[A-Za-z0-9_.-]+\\.(cpp|h|cu|cuh|inc|md|cfg))(:([A-Za-z_][A-Za-z0-9_:]*))?`");
  int files = 0, names = 0;
  for (auto it = std::sregex_iterator(doc.begin(), doc.end(), ref); it != std::sregex_iterator(); ++it) {
    const std::string path = (*it)[1], name = (*it)[4];
    const std::string text = read_all(path);
    INFO("READING.md names " << path << (name.empty() ? "" : ":" + name));
    CHECK(!text.empty());
    files++;
    if (!name.empty()) {
      CHECK(defines(text, name));
      names++;
    }
  }
  CHECK(files >= 40);  // the tour names this many stops; a broken pattern would find none
  CHECK(names >= 30);
}
