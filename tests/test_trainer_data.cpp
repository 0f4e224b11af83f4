// test_trainer_data.cpp: the trainer's data and bookkeeping options on the CPU: parameter
// groups, the ViT position table, the run log and loss.svg, data.repeat_batch, the synthetic
// VLM samples and data.synth_rows files, data.workers, a checkpoint's trainer.json. The
// training loop's promises (resume, failures, skipped steps) are in test_trainer.cpp.
#include <catch2/catch.hpp>

#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "data/chat.h"
#include "nn/vit.h"
#include "nn/vlm.h"
#include "tests/trainer_test_util.h"
#include "trainer/run.h"
#include "trainer/vlm_task.h"

using namespace loom;
using Catch::Matchers::Contains;

TEST_CASE("parameter groups: embeddings, projector, matrices, norms with their own lr and decay", "[trainer]") {
  VLMConfig c;
  c.vit = ViTConfig{8, 4, 3, 16, 1, 2, 4, 1e-6};
  c.lm.vocab = 40;
  c.lm.dim = 16;
  c.lm.depth = 1;
  c.lm.heads = 2;
  c.lm.kv_heads = 1;
  c.lm.hidden = 32;
  Rng rng(3);
  VLM m(c, Init{DType::F32, Device::CPU, &rng});
  m.vision.norm.weight.requires_grad_(false);  // frozen: in no group
  auto find = [](const std::vector<ParamGroup>& gs, const std::string& name) -> const ParamGroup* {
    for (auto& g : gs)
      for (auto& [n, t] : g.params)
        if (n == name) return &g;
    return nullptr;
  };
  // no factor set: two groups (decay for every matrix, none for 1-D), as before groups existed
  auto d = param_groups_from(m, Config::load("vlm_sft.cfg", {"--train.lr_scale_embeddings=1", "--train.lr_scale_projector=1"}));
  REQUIRE(d.size() == 2);
  CHECK(find(d, "projector.weight")->name == "decay");
  CHECK(find(d, "lm.norm.weight")->name == "no_decay");
  CHECK(find(d, "vision.norm.weight") == nullptr);
  // any factor set: four groups
  auto g = param_groups_from(m, Config::load("vlm_sft.cfg", {"--train.lr_scale_projector=10",
                                                              "--train.embeddings_weight_decay=0", "--train.weight_decay=0.1"}));
  REQUIRE(g.size() == 4);
  CHECK(find(g, "projector.weight")->name == "projector");
  CHECK(find(g, "projector.weight")->lr_scale == 10.0);
  CHECK(find(g, "lm.embed_tokens.weight")->name == "embeddings");
  CHECK(find(g, "lm.embed_tokens.weight")->weight_decay == 0.0);
  CHECK(find(g, "vision.pos_embed")->name == "embeddings");
  CHECK(find(g, "lm.layers.0.q_proj.weight")->name == "matrices");
  CHECK(find(g, "lm.layers.0.q_proj.weight")->weight_decay == 0.1);
  CHECK(find(g, "vision.blocks.0.qkv.bias")->name == "norms");
  CHECK(find(g, "vision.blocks.0.qkv.bias")->weight_decay == 0.0);
  size_t n = 0;
  for (auto& gr : g) n += gr.params.size();
  CHECK(int64_t(n) == int64_t(m.named_parameters().size()) - 1);  // all but the frozen one
}

// model.pos_init = sincos: the 2-D table's values at a few places (sin/cos of the row in the
// first half, of the column in the second), the ViT starting from it, the other parameters
// drawn exactly as with normal init, and the config rule for vit_dim % 4.
TEST_CASE("ViT position table: sincos init", "[trainer]") {
  const int grid = 3, dim = 8, q = dim / 4;
  std::vector<float> t = sincos_2d(grid, dim);
  REQUIRE(t.size() == size_t(grid * grid * dim));
  for (int r = 0; r < grid; r++)
    for (int c = 0; c < grid; c++)
      for (int i = 0; i < q; i++) {
        const float* row = &t[size_t(r * grid + c) * dim];
        double w = std::pow(10000.0, -double(i) / q);
        CHECK(row[i] == Approx(std::sin(r * w)).margin(1e-6));
        CHECK(row[q + i] == Approx(std::cos(r * w)).margin(1e-6));
        CHECK(row[2 * q + i] == Approx(std::sin(c * w)).margin(1e-6));
        CHECK(row[3 * q + i] == Approx(std::cos(c * w)).margin(1e-6));
      }
  uint64_t seed = uint64_t(Catch::rngSeed()) + 11;
  ViTConfig a{12, 4, 3, 8, 1, 2, 2, 1e-6}, b = a;
  b.pos_init = "sincos";
  Rng ra(seed), rb(seed);
  ViT va(a, Init{DType::F32, Device::CPU, &ra}), vb(b, Init{DType::F32, Device::CPU, &rb});
  std::vector<float> want = sincos_2d(3, 8);
  Tensor pb = vb.pos_embed.contiguous();
  for (size_t i = 0; i < want.size(); i++) REQUIRE(pb.data<float>()[i] == want[i]);
  CHECK(vb.pos_embed.requires_grad());
  auto sa = va.state_dict(), sb = vb.state_dict();
  for (auto& [name, x] : sa) {
    if (name == "pos_embed") continue;
    INFO(name);
    REQUIRE(std::memcmp(x.contiguous().raw(), sb.at(name).contiguous().raw(), x.nbytes()) == 0);
  }
  REQUIRE_THROWS_WITH(Config::load("vlm_sft.cfg", {"--model.pos_init=sincos", "--model.vit_dim=66", "--model.vit_heads=2"}),
                      Contains("model.vit_dim = 66: must be a multiple of 4 with model.pos_init = sincos"));
  REQUIRE_THROWS_WITH(Config::load("vit_mim.cfg", {"--model.pos_init=sincos", "--model.pred_dim=50", "--model.pred_heads=5"}),
                      Contains("model.pred_dim = 50: must be a multiple of 4 with model.pos_init = sincos"));
}


// Elapsed time and ETA in the log; loss.svg's panels, log-scale ticks, curves and eval points.
TEST_CASE("run log: durations and loss.svg", "[trainer]") {
  CHECK(fmt_duration(0.4) == "0s");
  CHECK(fmt_duration(42) == "42s");
  CHECK(fmt_duration(185) == "3m05s");
  CHECK(fmt_duration(3725) == "1h02m");
  Rng rng(uint64_t(Catch::rngSeed()) + 5);
  std::vector<std::pair<int64_t, double>> train, val, lr, acc;
  double l = 5.0;
  for (int s = 1; s <= 300; s++) {
    l *= 0.99 + 0.005 * rng.uniform();
    train.push_back({s, l});
    lr.push_back({s, 1e-3 * std::min(1.0, s / 50.0)});
  }
  val = {{150, train[149].second * 1.1}, {300, train[299].second * 1.1}};
  acc = {{150, 0.5}, {300, 0.875}};
  std::string svg = loss_svg("vlm_sft", train, val, lr, acc, "accuracy");
  CHECK(has(svg, "vlm_sft: loss (log scale)"));
  // log ticks: the losses span ~5 to ~0.3, so 0.5, 1, 2 and 5 are labelled
  for (const char* t : {">0.5<", ">1<", ">2<", ">5<"}) CHECK(has(svg, t));
  CHECK(has(svg, "learning rate"));
  CHECK(has(svg, "eval accuracy"));
  CHECK(has(svg, ">87.5%<"));
  CHECK(has(svg, ">validation<"));
  CHECK(has(svg, ">300<"));  // a step tick at the end
  size_t polylines = 0;
  for (size_t p = svg.find("<polyline"); p != std::string::npos; p = svg.find("<polyline", p + 1)) polylines++;
  CHECK(polylines == 4);  // train, moving average, validation, learning rate
}

TEST_CASE("data.repeat_batch trains the first batch at every step", "[trainer]") {
  // with a learning rate far below every weight's last bit the weights stay as they are, so the
  // loss is a function of the batch alone: equal at every step with the key, not without it
  auto steps_losses = [](const std::vector<std::string>& args, const std::string& d) {
    REQUIRE(run_train(args) == 0);
    std::vector<std::string> v;
    for (auto& l : losses(d)) v.push_back(l.second);
    REQUIRE(v.size() == 4);
    return v;
  };
  std::string a = tmpdir("repeat_a"), b = tmpdir("repeat_b");
  auto vlm = [](const std::string& out, const char* repeat) {
    auto args = tiny(out);
    for (auto& x : args)
      if (x.rfind("--train.steps=", 0) == 0) x = "--train.steps=4";
    args.push_back("--train.lr=1e-30");
    args.push_back("--train.min_lr=0");
    args.push_back(std::string("--data.repeat_batch=") + repeat);
    return args;
  };
  auto on = steps_losses(vlm(a, "true"), a), off = steps_losses(vlm(b, "false"), b);
  for (int i = 1; i < 4; i++) CHECK(on[size_t(i)] == on[0]);
  CHECK(off[1] != off[0]);
  CHECK(off[0] == on[0]);  // the first batch is the same either way

  // epochs: a dataset of a few rows ends one every step or two; one batch over and over has none
  auto epochs = [](const std::string& dir) {
    int n = 0;
    std::ifstream f(dir + "/metrics.jsonl");
    for (std::string line; std::getline(f, line);)
      if (nlohmann::json::parse(line).value("kind", "") == "epoch") n++;
    return n;
  };
  std::string g = tmpdir("repeat_e"), h = tmpdir("repeat_f");
  auto few = [](const std::string& out, const char* repeat) {
    auto args = tiny(out);  // the later override wins: 6 samples pack into a few rows
    args.insert(args.end(), {"--data.train_samples=6", std::string("--data.repeat_batch=") + repeat});
    return args;
  };
  REQUIRE(run_train(few(g, "false")) == 0);
  REQUIRE(run_train(few(h, "true")) == 0);
  CHECK(epochs(g) >= 1);
  CHECK(epochs(h) == 0);

  auto mim = [](const std::string& out, const char* repeat) {
    return std::vector<std::string>{"vit_mim.cfg", "--train.out_dir=" + out, "--data.dataset=synthetic",
                                    "--train.batch_size=8", "--train.steps=4", "--train.warmup_steps=0",
                                    "--train.lr=1e-30", "--train.min_lr=0", "--train.log_every=1",
                                    "--train.eval_every=0", std::string("--data.repeat_batch=") + repeat};
  };
  std::string c = tmpdir("repeat_c"), e = tmpdir("repeat_d");
  auto mon = steps_losses(mim(c, "true"), c), moff = steps_losses(mim(e, "false"), e);
  for (int i = 1; i < 4; i++) CHECK(mon[size_t(i)] == mon[0]);
  CHECK(moff[1] != moff[0]);
}

TEST_CASE("synthetic VLM samples: image tokens and the prompt carry no target, the rest do", "[trainer]") {
  // the SPEC section 3 batches: 49 image tokens, then text whose first synth_prompt_len tokens are
  // the prompt (no target, as in the reference's batches), then trained tokens
  for (int prompt : {0, 16, 30}) {
    const std::string dir = tmpdir("synth_prompt");
    Config cfg = Config::load("bench_vlm_sft.cfg", {"--train.device=cpu", "--train.dtype=f32", "--data.train_samples=50",
                                                    "--data.synth_prompt_len=" + std::to_string(prompt),
                                                    "--train.out_dir=" + dir});
    RunContext ctx = make_context(cfg);
    ctx.out_dir = dir;
    REQUIRE(::mkdir(dir.c_str(), 0755) == 0);
    VLMData d = build_vlm_data(ctx, 49);
    REQUIRE(d.train.size() == 50);
    for (const Sample& s : d.train) {
      REQUIRE(s.ids.size() == s.labels.size());
      REQUIRE(s.ids.size() >= size_t(49 + 24));
      for (size_t t = 0; t < s.ids.size(); t++) {
        INFO("prompt " << prompt << " token " << t << " of " << s.ids.size());
        if (t < size_t(49)) CHECK((s.ids[t] == d.image_token && s.labels[t] == kIgnoreLabel));
        else if (t < size_t(49 + prompt)) CHECK((s.ids[t] != d.image_token && s.labels[t] == kIgnoreLabel));
        else CHECK((s.ids[t] != d.image_token && s.labels[t] == s.ids[t]));
      }
    }
  }
}

TEST_CASE("data.synth_rows: the rows of a file, their samples as the synthetic ones, and its errors", "[trainer]") {
  // random rows (lengths include the 49 image tokens), written as tools/ref_vlm_rows.py writes them
  const std::string dir = tmpdir("synth_rows");
  REQUIRE(::mkdir(dir.c_str(), 0755) == 0);
  const std::string rows_path = dir + "/rows.txt";
  std::vector<std::vector<int>> want;
  {
    std::ofstream f(rows_path);
    f << "# rows\n";
    Rng g(uint64_t(::getpid()) * 7919u + uint64_t(::time(nullptr)));
    for (int r = 0; r < 5; r++) {
      std::vector<int> row;
      int left = 512;
      do {
        const int L = 50 + int(g.randint(std::min(left, 300) - 49));
        row.push_back(L);
        left -= L;
      } while (left > 50 && g.randint(4) != 0);
      for (int L : row) f << L << " ";
      f << "\n";
      want.push_back(row);
    }
  }
  const int prompt = 16;
  Config cfg = Config::load("bench_vlm_sft.cfg", {"--train.device=cpu", "--train.dtype=f32", "--data.pack_max_length=512",
                                                  "--data.synth_rows=" + rows_path, "--train.out_dir=" + dir});
  RunContext ctx = make_context(cfg);
  ctx.out_dir = dir;
  VLMData d = build_vlm_data(ctx, 49);
  REQUIRE(d.rows.size() == want.size());
  size_t total = 0;
  for (size_t r = 0; r < want.size(); r++) {
    REQUIRE(d.rows[r].size() == want[r].size());
    for (size_t k = 0; k < want[r].size(); k++) {
      const Sample& s = d.train[size_t(d.rows[r][k])];
      INFO("row " << r << " sample " << k);
      REQUIRE(s.ids.size() == size_t(want[r][k]));
      CHECK(s.image >= 0);
      for (size_t t = 0; t < s.ids.size(); t++) {
        if (t < 49) CHECK((s.ids[t] == d.image_token && s.labels[t] == kIgnoreLabel));
        else if (t < size_t(49 + prompt)) CHECK((s.ids[t] != d.image_token && s.labels[t] == kIgnoreLabel));
        else CHECK((s.ids[t] != d.image_token && s.labels[t] == s.ids[t]));
      }
      total++;
    }
  }
  CHECK(d.train.size() == total);
  CHECK(d.stats.rows == int64_t(want.size()));
  CHECK(d.stats.samples == int64_t(total));
  // the whole file as one batch: its images and real tokens
  PackedBatch pb = build_batch(d.train, d.rows, 512, d.pad_id, d.image_token);
  int64_t real = 0;
  for (auto& row : want)
    for (int L : row) real += L;
  CHECK(pb.real_tokens == real);
  CHECK(pb.images.size() == total);
  // errors: the file and line; a rows file for another dataset
  {
    std::ofstream f(rows_path);
    f << "100 100\n300 300\n";
  }
  CHECK_THROWS_WITH(build_vlm_data(ctx, 49), Contains(rows_path + ":2:") && Contains("600 tokens"));
  CHECK_THROWS_WITH(run_train({"vlm_sft.cfg", "--data.synth_rows=" + rows_path, "--train.out_dir=" + tmpdir("rows_ds")}),
                    Contains("data.synth_rows") && Contains("data.dataset = synthetic"));
  CHECK_THROWS_WITH(run_train({"bench_vlm_sft.cfg", "--train.device=cpu", "--data.synth_rows=" + dir + "/none.txt",
                               "--train.out_dir=" + tmpdir("rows_none")}),
                    Contains("data.synth_rows") && Contains("no such file"));
}

TEST_CASE("data.workers: a number is taken as given, 0 resolves to one loader thread on the CPU", "[trainer]") {
  Config a = Config::load("vlm_sft.cfg", {"--train.device=cpu", "--data.workers=3"});
  CHECK(make_context(a).loader_threads == 3);
  Config b = Config::load("vlm_sft.cfg", {"--train.device=cpu", "--data.workers=0"});
  CHECK(make_context(b).loader_threads == 1);
  Config c = Config::load("vlm_sft.cfg", {"--train.device=cpu"});  // the default is 0 (auto)
  CHECK(make_context(c).loader_threads == 1);
  CHECK_THROWS_WITH(run_train({"vlm_sft.cfg", "--data.workers=-1", "--train.out_dir=" + tmpdir("workers")}),
                    Contains("data.workers"));
}

TEST_CASE("a checkpoint's trainer.json with a bad step count is an error naming the file", "[trainer]") {
  const std::string d = tmpdir("bad_step");
  std::system(("mkdir -p " + d).c_str());
  for (const char* bad : {"{\"step\": 1e300}", "{\"step\": -4}", "{\"step\": \"7\"}", "{}"}) {
    INFO(bad);
    std::ofstream(d + "/trainer.json") << bad;
    CHECK_THROWS_WITH(read_checkpoint_state(d), Contains(d + "/trainer.json") && Contains("\"step\""));
  }
  std::ofstream(d + "/trainer.json") << "{\"step\": 12, \"extra\": {\"best\": 0.5}}";
  TrainerState st = read_checkpoint_state(d);
  CHECK(st.step == 12);
  CHECK(st.extra.at("best") == 0.5);
  std::system(("rm -rf " + d).c_str());
}
