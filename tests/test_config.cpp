// test_config.cpp: config parsing, validation errors (each names file, line and key),
// overrides, and the dump -> reload round trip. Also loads every shipped configs/*.cfg.
#include <catch2/catch.hpp>

#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

#include "trainer/config.h"

using loom::Config;

namespace {

std::string tmp_dir() {
  static std::string dir;
  if (dir.empty()) {
    char buf[] = "/tmp/loom_test_config_XXXXXX";
    REQUIRE(mkdtemp(buf) != nullptr);
    dir = buf;
  }
  return dir;
}

std::string write_file(const std::string& name, const std::string& text) {
  std::string p = tmp_dir() + "/" + name;
  std::ofstream(p) << text;
  return p;
}

// Load `text` as a file and return the error message (fails the test if none is thrown).
std::string error_of(const std::string& text, const std::vector<std::string>& overrides = {}) {
  std::string p = write_file("bad.cfg", text);
  try {
    Config::load(p, overrides);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  FAIL("no error for:\n" << text);
  return "";
}

bool has(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

}  // namespace

TEST_CASE("config: defaults, parse, comments, quotes", "[config]") {
  Config d;
  CHECK(d.get_str("model.kind") == "vlm");
  CHECK(d.get_bool("data.use_sequence_packing") == true);
  CHECK(d.get_str("data.tokenizer").empty());

  std::string p = write_file("ok.cfg",
                             "# a comment\n"
                             "\n"
                             "[model]\n"
                             "vit_dim = 48   # trailing comment\n"
                             "  rope_theta=10000.5\n"
                             "contrastive = yes\n"
                             "lm_init = \"weights/with # hash.safetensors\"  # comment after a quote\n"
                             "[ train ]\n"
                             "lr = 3e-4\n"
                             "steps = 77\n"
                             "out_dir = runs/x\n"
                             "freeze = \"\"\n");
  Config c = Config::load(p);
  CHECK(c.get_int("model.vit_dim") == 48);
  CHECK(c.get_float("model.rope_theta") == Approx(10000.5));
  CHECK(c.get_bool("model.contrastive") == true);
  CHECK(c.get_str("model.lm_init") == "weights/with # hash.safetensors");
  CHECK(c.get_float("train.lr") == Approx(3e-4));
  CHECK(c.get_int("train.steps") == 77);
  CHECK(c.get_str("train.out_dir") == "runs/x");
  CHECK(c.get_str("train.freeze").empty());
  CHECK(c.get_int("model.patch_size") == Config().get_int("model.patch_size"));  // untouched default
  CHECK(c.source() == p);
}

TEST_CASE("config: every error names file, line and key and lists valid keys", "[config]") {
  std::string file = tmp_dir() + "/bad.cfg";

  std::string e = error_of("[train]\nlr = 1e-3\nlrr = 2\n");
  INFO(e);
  CHECK(has(e, file + ":3"));
  CHECK(has(e, "'lrr'"));
  CHECK(has(e, "valid keys of [train]"));
  CHECK(has(e, "weight_decay"));

  e = error_of("[train]\n[trian]\nlr = 1\n");
  INFO(e);
  CHECK(has(e, file + ":2"));
  CHECK(has(e, "[trian]"));
  CHECK(has(e, "valid sections: [model], [data], [train], [eval]"));

  e = error_of("[model]\nvit_dim = 4x8\n");
  INFO(e);
  CHECK(has(e, file + ":2"));
  CHECK(has(e, "bad int"));
  CHECK(has(e, "vit_dim"));

  e = error_of("[model]\n\nvit_dim = 2.5\n");  // a float is not an int
  CHECK(has(e, file + ":3"));
  CHECK(has(e, "bad int"));

  e = error_of("[train]\nlr = fast\n");
  INFO(e);
  CHECK(has(e, file + ":2"));
  CHECK(has(e, "bad float"));
  CHECK(has(e, "lr"));

  e = error_of("[train]\nlr = nan\n");  // not finite
  CHECK(has(e, "bad float"));

  e = error_of("[data]\nstrict = maybe\n");
  INFO(e);
  CHECK(has(e, file + ":2"));
  CHECK(has(e, "bad bool"));
  CHECK(has(e, "strict"));

  e = error_of("[data]\nstrict\n");
  INFO(e);
  CHECK(has(e, file + ":2"));
  CHECK(has(e, "missing '='"));
  CHECK(has(e, "strict"));
  CHECK(has(e, "valid keys of [data]"));

  e = error_of("# header\n[data\nstrict = true\n");
  INFO(e);
  CHECK(has(e, file + ":2"));
  CHECK(has(e, "unterminated section header"));

  e = error_of("[train]\nsteps = 1\n\nsteps = 2\n");
  INFO(e);
  CHECK(has(e, file + ":4"));
  CHECK(has(e, "duplicate key 'steps'"));
  CHECK(has(e, "line 2"));

  e = error_of("steps = 1\n");
  INFO(e);
  CHECK(has(e, file + ":1"));
  CHECK(has(e, "before any [section]"));

  e = error_of("[train]\nschedule = cosin\n");  // choices
  INFO(e);
  CHECK(has(e, file + ":2"));
  CHECK(has(e, "cosine|linear|constant"));

  e = error_of("[train]\nout_dir = \"runs/x\n");
  CHECK(has(e, file + ":2"));
  CHECK(has(e, "unterminated quoted value"));

  // Missing file, by path and by bare name.
  try {
    Config::load(tmp_dir() + "/nope.cfg");
    FAIL("no error for a missing file");
  } catch (const std::runtime_error& x) {
    CHECK(has(x.what(), tmp_dir() + "/nope.cfg"));
    CHECK(has(x.what(), "not found"));
  }
  try {
    Config::load("surely_not_a_config_name.cfg");
    FAIL("no error for a missing bare name");
  } catch (const std::runtime_error& x) {
    CHECK(has(x.what(), "configs/surely_not_a_config_name.cfg"));
  }
}

TEST_CASE("config: overrides", "[config]") {
  std::string p = write_file("ov.cfg", "[train]\nlr = 1e-3\nsteps = 10\n");
  Config c = Config::load(p, {"--train.lr=5e-4", "--data.use_sequence_packing=false", "eval.samples=7",
                              "--model.lm_init=some/path.safetensors"});
  CHECK(c.get_float("train.lr") == Approx(5e-4));
  CHECK(c.get_int("train.steps") == 10);
  CHECK_FALSE(c.get_bool("data.use_sequence_packing"));
  CHECK(c.get_int("eval.samples") == 7);
  CHECK(c.get_str("model.lm_init") == "some/path.safetensors");

  auto err = [&](const std::string& o) -> std::string {
    try {
      Config::load(p, {o});
    } catch (const std::runtime_error& e) {
      return e.what();
    }
    FAIL("no error for override " << o);
    return "";
  };
  std::string e = err("--train.lrr=1");
  INFO(e);
  CHECK(has(e, "--train.lrr=1"));
  CHECK(has(e, "'lrr'"));
  CHECK(has(e, "valid keys of [train]"));
  e = err("--trian.lr=1");
  CHECK(has(e, "valid sections"));
  e = err("--train.steps=ten");
  CHECK(has(e, "bad int"));
  CHECK(has(e, "steps"));
  e = err("--train.steps");
  CHECK(has(e, "missing '='"));
  e = err("--steps=3");
  CHECK(has(e, "no section"));
}

TEST_CASE("config: getters check key and type", "[config]") {
  Config c;
  CHECK_THROWS_WITH(c.get_int("train.nope"), Catch::Contains("valid keys of [train]"));
  CHECK_THROWS_WITH(c.get_int("train.lr"), Catch::Contains("float"));
  CHECK_THROWS_WITH(c.get_str("nosection.x"), Catch::Contains("valid sections"));
  CHECK_THROWS_WITH(c.get_float("train.steps"), Catch::Contains("int"));
}

TEST_CASE("config: dump / reload round trip", "[config]") {
  std::string p = write_file("rt.cfg",
                             "[model]\nkind = mim\nlm_init = \"a b/c#d\"\n[train]\nlr = 2.5e-4\n"
                             "freeze = vision.,lm.embed\n[eval]\nprobe = linear\n");
  Config a = Config::load(p, {"--train.steps=123", "--data.strict=on"});
  std::string d = a.dump();
  // Every schema key appears in the dump.
  for (const loom::ConfigKey& k : loom::config_schema()) {
    INFO(k.section << "." << k.key);
    CHECK(has(d, std::string("\n") + k.key + " = "));
  }
  std::string p2 = tmp_dir() + "/saved.cfg";
  a.save(p2);
  Config b = Config::load(p2);
  CHECK(b.dump().substr(b.dump().find('\n')) == d.substr(d.find('\n')));  // all but the header line
  CHECK(b.get_str("model.kind") == "mim");
  CHECK(b.get_str("model.lm_init") == "a b/c#d");
  CHECK(b.get_int("train.steps") == 123);
  CHECK(b.get_bool("data.strict"));
  CHECK(b.get_str("train.freeze") == "vision.,lm.embed");
  CHECK(b.get_str("data.tokenizer").empty());
  for (const loom::ConfigKey& k : loom::config_schema()) {
    std::string key = std::string(k.section) + "." + k.key;
    switch (k.type) {
      case loom::ConfigType::Int: CHECK(a.get_int64(key) == b.get_int64(key)); break;
      case loom::ConfigType::Float: CHECK(a.get_float(key) == b.get_float(key)); break;
      case loom::ConfigType::Bool: CHECK(a.get_bool(key) == b.get_bool(key)); break;
      case loom::ConfigType::String: CHECK(a.get_str(key) == b.get_str(key)); break;
    }
  }
}

TEST_CASE("config: every shipped configs/*.cfg loads, by bare name", "[config]") {
  DIR* d = opendir("configs");
  if (!d) {
    WARN("configs/ not found from the working directory; run from the repo root");
    return;
  }
  int n = 0;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.size() < 5 || name.substr(name.size() - 4) != ".cfg") continue;
    INFO(name);
    CHECK_NOTHROW(Config::load(name));
    n++;
  }
  closedir(d);
  CHECK(n >= 6);
}
