// test_config.cpp: config parsing, validation errors (each names file, line and key),
// overrides, and the dump -> reload round trip. Also loads every shipped configs/*.cfg.
#include <catch2/catch.hpp>

#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

#include "tests/scratch_dir.h"
#include "trainer/config.h"

using loom::Config;

namespace {

std::string tmp_dir() { return loom_test::scratch_root(); }

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

  std::string w = write_file("with # hash.safetensors", "");  // init paths must exist
  std::string p = write_file("ok.cfg",
                             "# a comment\n"
                             "\n"
                             "[model]\n"
                             "vit_dim = 48   # trailing comment\n"
                             "  rope_theta=10000.5\n"
                             "contrastive = yes\n"
                             "lm_init = \"" + w + "\"  # comment after a quote\n"
                             "[ train ]\n"
                             "lr = 3e-4\n"
                             "steps = 77\n"
                             "out_dir = runs/x\n"
                             "freeze = \"\"\n");
  Config c = Config::load(p);
  CHECK(c.get_int("model.vit_dim") == 48);
  CHECK(c.get_float("model.rope_theta") == Approx(10000.5));
  CHECK(c.get_bool("model.contrastive") == true);
  CHECK(c.get_str("model.lm_init") == w);
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
  std::string w = write_file("path.safetensors", "");
  Config c = Config::load(p, {"--train.lr=5e-4", "--data.use_sequence_packing=false", "eval.samples=7",
                              "--model.lm_init=" + w});
  CHECK(c.get_float("train.lr") == Approx(5e-4));
  CHECK(c.get_int("train.steps") == 10);
  CHECK_FALSE(c.get_bool("data.use_sequence_packing"));
  CHECK(c.get_int("eval.samples") == 7);
  CHECK(c.get_str("model.lm_init") == w);

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
  std::string w = write_file("a b#c", "");
  std::string p = write_file("rt.cfg",
                             "[model]\nkind = mim\nvision_init = \"" + w + "\"\n[data]\ndataset = synthetic\n"
                             "[train]\ntrainer = vit_mim\nlr = 2.5e-4\nfreeze = vision.,lm.embed\n[eval]\nprobe = linear\n");
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
  CHECK(b.get_str("model.vision_init") == w);
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

// The message of validate_config for the default config with `overrides`, "" when it passes.
static std::string rule_error(const std::vector<std::string>& overrides, const std::string& file = "vlm_sft.cfg") {
  try {
    Config::load(file, overrides);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "";
}

TEST_CASE("config: constraints are checked when the config is resolved, naming key, value and rule", "[config]") {
  struct Case {
    std::vector<std::string> overrides;
    std::string file, expect;  // expect: the "key = value: rule" text (a prefix of it)
  };
  std::vector<Case> cases = {
      {{"--train.batch_size=0"}, "vlm_sft.cfg", "train.batch_size = 0: must be >= 1"},
      {{"--model.image_size=30"}, "vlm_sft.cfg", "model.image_size = 30: must be a multiple of model.patch_size = 4"},
      {{"--model.image_size=28"}, "vlm_sft.cfg", "model.shuffle = 2: must divide the patch grid side"},
      {{"--model.patch_size=64"}, "vlm_sft.cfg", "model.patch_size = 64: must be <= model.image_size = 32"},
      {{"--model.vit_heads=3"}, "vlm_sft.cfg", "model.vit_dim = 64: must be a multiple of model.vit_heads = 3"},
      {{"--model.lm_kv_heads=3"}, "vlm_sft.cfg", "model.lm_heads = 4: must be a multiple of model.lm_kv_heads = 3"},
      {{"--model.lm_dim=36", "--model.lm_heads=4", "--model.lm_kv_heads=1"}, "vlm_sft.cfg", "model.lm_dim = 36: lm_dim / lm_heads = 9 must be even"},
      {{"--model.channels=2"}, "vlm_sft.cfg", "model.channels = 2: must be 1 (grey) or 3 (RGB)"},
      // found by the config fuzz target: a huge channel count went on into the batch's pixel
      // product (signed overflow) after its own error was recorded
      {{"--model.channels=205722057220572205"}, "vlm_sft.cfg", "model.channels = 205722057220572205: must be 1 (grey) or 3"},
      {{"--model.channels=1"}, "vlm_sft.cfg", "model.channels = 1: the shapes dataset is RGB"},
      {{"--data.pack_max_length=16"}, "vlm_sft.cfg", "data.pack_max_length = 16: must exceed the 16 image tokens"},
      {{"--train.min_lr=1"}, "vlm_sft.cfg", "train.min_lr = 1: must be <= train.lr"},
      {{"--train.beta2=1"}, "vlm_sft.cfg", "train.beta2 = 1: must be in [0, 1)"},
      {{"--train.trainer=vit_mim"}, "vlm_sft.cfg", "train.trainer = vit_mim: needs model.kind = mim"},
      {{"--data.dataset=jsonl"}, "vlm_sft.cfg", "data.path = \"\": data.dataset = jsonl needs a path"},
      {{"--data.tokenizer=/no/such/tokenizer.json"}, "vlm_sft.cfg", "data.tokenizer = /no/such/tokenizer.json: no such file"},
      {{"--model.lm_init=/no/such/run"}, "vlm_sft.cfg", "model.lm_init = /no/such/run: no such file or folder"},
      {{"--model.init=/no/such/run"}, "vlm_sft.cfg", "model.init = /no/such/run: no such file or folder"},
      {{"--model.init=configs", "--model.vision_init=configs"}, "vlm_sft.cfg", "model.vision_init = configs: model.init = configs already gives every part"},
      {{"--model.init=configs"}, "vit_mim.cfg", "model.init = configs: continues a VLM"},
      {{"--data.task=caption"}, "vit_mim.cfg", "data.task = caption: captions are generated by the shapes dataset"},
      {{"--data.synth_min_len=10", "--data.synth_max_len=5"}, "vlm_sft.cfg", "data.synth_max_len = 5: must be >= data.synth_min_len = 10"},
      {{"--train.batch_size=1048576", "--data.pack_max_length=4096"}, "vlm_sft.cfg", "tokens per step must fit int32"},
      {{"--model.mask_ratio=0.999"}, "vit_mim.cfg", "model.mask_ratio = 0.999: keeps round(49 patches x (1 - mask_ratio)) = 0"},
      {{"--model.pred_heads=5"}, "vit_mim.cfg", "model.pred_dim = 48: must be a multiple of model.pred_heads = 5"},
      {{"--model.image_size=32"}, "vit_mim.cfg", "model.image_size = 32: fashion_mnist images are 1x28x28"},
      {{"--data.dataset=shapes"}, "vit_mim.cfg", "data.dataset = shapes: is a VLM dataset"},
  };
  for (const Case& c : cases) {
    std::string msg = rule_error(c.overrides, c.file);
    INFO(c.file << " " << c.overrides[0] << "\n  got: " << msg);
    CHECK(has(msg, "config error"));
    CHECK(has(msg, c.expect));
    CHECK(has(msg, c.file));  // the file the config came from
  }
  // several broken rules: all of them, one line each
  std::string msg = rule_error({"--train.batch_size=0", "--train.steps=0", "--eval.knn_k=0"});
  CHECK(has(msg, "3 config errors"));
  CHECK(has(msg, "\n  train.steps = 0: must be >= 1"));
  CHECK(has(msg, "\n  eval.knn_k = 0: must be >= 1"));
}

// Every numeric key has a range: a far-out value on one side or the other is refused naming
// that key (the seeds are the only free integers).
TEST_CASE("config: every numeric key has a checked range", "[config]") {
  for (const loom::ConfigKey& k : loom::config_schema()) {
    if (k.type != loom::ConfigType::Int && k.type != loom::ConfigType::Float) continue;
    std::string key = std::string(k.section) + "." + k.key;
    if (std::string(k.key) == "seed") continue;
    INFO(key);
    std::string lo = rule_error({"--" + key + "=-1000000000000"}), hi = rule_error({"--" + key + "=1000000000000"});
    CHECK((has(lo, key + " = ") || has(hi, key + " = ")));
  }
  CHECK(rule_error({}).empty());  // the defaults of vlm_sft.cfg pass
}

// A value is one line of text: bytes below 0x20 (a NUL, a newline) are refused, and a number
// must be all of its value (strtod stops at an embedded NUL; "1\0# x" was taken as 1 and then
// dumped as a line that read back otherwise; found by the config fuzz target, the input is in
// tests/fuzz/config/).
TEST_CASE("config: control characters in a value are refused", "[config]") {
  using Catch::Matchers::Contains;
  for (std::string bad : {std::string("--train.lr=1\0# x", 16), std::string("--train.steps=5\0", 16),
                          std::string("--train.out_dir=a\nb"), std::string("--data.path=x\ry")}) {
    INFO(bad);
    REQUIRE_THROWS_WITH(loom::Config::load("vlm_sft.cfg", {bad}), Contains("contains a control character"));
  }
  CHECK(loom::Config::load("vlm_sft.cfg", {"--train.out_dir=a\tb"}).get_str("train.out_dir") == "a\tb");
}

// [section.cuda] / [section.cpu]: values for one device, over the file's and under the
// command line's; applied once the run's device is known (train_command).
TEST_CASE("config: device sections", "[config]") {
  std::string p = write_file("dev.cfg",
                             "[train]\nsteps = 100\nbatch_size = 8\nlr = 1e-3\n"
                             "[train.cuda]   # on a GPU\nsteps = 5000\nbatch_size = 64\n"
                             "[train.cpu]\nlr = 2e-3\n"
                             "[model.cuda]\nvit_depth = 5\n");
  Config raw = Config::load(p);  // before the device is known: the plain sections only
  CHECK(raw.get_int("train.steps") == 100);
  CHECK(raw.get_int("model.vit_depth") == Config().get_int("model.vit_depth"));

  Config g = Config::load(p, {"--train.batch_size=32"});
  std::vector<std::string> applied = g.apply_device_sections("cuda");
  CHECK(g.get_int("train.steps") == 5000);
  CHECK(g.get_int("train.batch_size") == 32);  // the command line wins over [train.cuda]
  CHECK(g.get_float("train.lr") == 1e-3);      // [train.cpu] is not for this run
  CHECK(g.get_int("model.vit_depth") == 5);
  REQUIRE(applied.size() == 2);
  CHECK(applied[0] == "[train.cuda] steps = 5000");
  CHECK(has(g.dump(), "# device section: [model.cuda] vit_depth = 5"));
  // the dump is the resolved config: it reloads to the same values with no device sections
  Config back = Config::load(write_file("dev_back.cfg", g.dump()));
  CHECK(back.apply_device_sections("cpu").empty());
  CHECK(back.get_int("train.steps") == 5000);
  CHECK(back.get_float("train.lr") == 1e-3);

  Config c = Config::load(p);
  c.apply_device_sections("cpu");
  CHECK(c.get_int("train.steps") == 100);
  CHECK(c.get_float("train.lr") == 2e-3);

  // a device value is checked by the same rules as any other, naming key and value
  Config bad = Config::load(write_file("dev_bad.cfg", "[train]\nsteps = 10\n[train.cuda]\nsteps = 0\n"));
  REQUIRE_THROWS_WITH(bad.apply_device_sections("cuda"), Catch::Matchers::Contains("train.steps = 0: must be >= 1"));

  // errors name file, line and section
  std::string e = error_of("[train]\nsteps = 1\n[train.tpu]\nsteps = 2\n");
  CHECK(has(e, "bad.cfg:3"));
  CHECK(has(e, "unknown device 'tpu' in section [train.tpu]"));
  e = error_of("[trian.cuda]\nsteps = 2\n");
  CHECK(has(e, "unknown section [trian.cuda]"));
  e = error_of("[train.cuda]\nstepz = 2\n");
  CHECK(has(e, "bad.cfg:2"));
  CHECK(has(e, "unknown key 'stepz' in [train.cuda]; valid keys of [train]"));
  e = error_of("[train.cuda]\nsteps = 2\nsteps = 3\n");
  CHECK(has(e, "duplicate key 'steps' in [train.cuda] (first set at line 2)"));
  e = error_of("[train.cuda]\ndevice = cpu\n");
  CHECK(has(e, "cannot depend on the device"));
  e = error_of("[train.cuda]\nsteps = many\n");
  CHECK(has(e, "bad.cfg:2"));
}
