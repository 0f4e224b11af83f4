// test_trainer.cpp: the training loop's promises, on the CPU with the default VLM config cut
// down to a few steps: a run interrupted and resumed from its checkpoint continues with
// bit-identical losses; non-finite steps are skipped and too many in a row stop the run with
// the last checkpoint intact; bad configs fail before any work with the key in the message.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "nn/vit.h"
#include "nn/vlm.h"
#include "trainer/run.h"
#include "trainer/trainer.h"
#include "data/chat.h"
#include "trainer/vlm_task.h"

using namespace loom;
using Catch::Matchers::Contains;

static int run_train(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return train_command(int(argv.size()), argv.data());
}

// a small, fast version of the default run
static std::vector<std::string> tiny(const std::string& out) {
  return {"vlm_sft.cfg", "--train.out_dir=" + out, "--data.train_samples=300", "--data.val_samples=16",
          "--train.batch_size=2", "--train.steps=6", "--train.warmup_steps=2", "--train.eval_every=0",
          "--eval.samples=8", "--train.log_every=1", "--data.workers=2"};
}

static std::vector<std::pair<int64_t, std::string>> losses(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> v;
  std::ifstream f(dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.value("kind", "") == "train") v.push_back({j["step"].get<int64_t>(), j["loss"].dump()});
  }
  return v;
}

static std::string tmpdir(const char* name) {
  std::string d = std::string("/tmp/loom_test_trainer_") + name + "_" + std::to_string(::getpid());
  std::system(("rm -rf " + d).c_str());
  return d;
}

// eval.samples = 0: no evaluation at all (it printed a validation loss of 0 and 0% of the
// answers, as if the model had learned nothing)
TEST_CASE("eval.samples = 0 trains without an evaluation", "[trainer]") {
  std::string a = tmpdir("noeval");
  auto args = tiny(a);
  args.push_back("--eval.samples=0");
  REQUIRE(run_train(args) == 0);
  std::ifstream f(a + "/metrics.jsonl");
  int train_lines = 0, eval_lines = 0;
  for (std::string line; std::getline(f, line);) {
    const std::string kind = nlohmann::json::parse(line).value("kind", "");
    train_lines += kind == "train";
    eval_lines += kind == "eval";
  }
  CHECK(train_lines == 6);
  CHECK(eval_lines == 0);
  std::system(("rm -rf " + a).c_str());
}

TEST_CASE("a resumed run continues with bit-identical losses (CPU)", "[trainer]") {
  std::string a = tmpdir("a"), b = tmpdir("b");
  auto args_a = tiny(a);
  args_a.push_back("--train.save_every=0");
  REQUIRE(run_train(args_a) == 0);
  auto args_b = tiny(b);
  args_b.push_back("--train.stop_at=3");  // "interrupted" after step 3, checkpoint written
  REQUIRE(run_train(args_b) == 0);
  REQUIRE(losses(b).size() == 3);
  auto args_c = tiny(b);
  args_c.push_back("--train.resume=latest");
  REQUIRE(run_train(args_c) == 0);
  auto la = losses(a), lb = losses(b);
  REQUIRE(la.size() == 6);
  REQUIRE(lb.size() == 6);
  for (size_t i = 0; i < 6; i++) {
    INFO("step " << la[i].first);
    CHECK(la[i].first == lb[i].first);
    CHECK(la[i].second == lb[i].second);  // the JSON text of a double round-trips exactly
  }
  // the loss actually moved (a constant would make the comparison meaningless)
  CHECK(la.front().second != la.back().second);
  // every step line has the elapsed time; all but the first of a process have an ETA, 0 at the end
  std::ifstream f(a + "/metrics.jsonl");
  std::string line;
  int with_eta = 0;
  double last_eta = -1;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.value("kind", "") != "train") continue;
    CHECK(j["elapsed_s"].get<double>() >= 0);
    if (j.contains("eta_s")) with_eta++, last_eta = j["eta_s"].get<double>();
  }
  CHECK(with_eta == 5);
  CHECK(last_eta == 0);
}

TEST_CASE("a frozen vision tower run one micro-batch ahead gives the same losses (CPU)", "[trainer]") {
  // train.vision_ahead computes the tower's features for micro-batch i + 1 before the LM step
  // of micro-batch i (on CUDA on a second stream): the same math in another order, so the losses
  // must be bit-identical to the tower run inside the step; with gradient accumulation, and
  // across a stop and resume (the batch launched ahead of the stop is dropped, then redone)
  for (int accum : {1, 2}) {
    INFO("grad_accum " << accum);
    std::string on = tmpdir("ahead_on"), off = tmpdir("ahead_off"), cut = tmpdir("ahead_cut");
    auto with = [&](const std::string& d, const char* ahead) {
      auto a = tiny(d);
      a.push_back("--train.freeze=vision.");
      a.push_back(std::string("--train.vision_ahead=") + ahead);
      a.push_back("--train.grad_accum=" + std::to_string(accum));
      a.push_back("--train.save_every=0");
      return a;
    };
    REQUIRE(run_train(with(on, "true")) == 0);
    REQUIRE(run_train(with(off, "false")) == 0);
    auto stop = with(cut, "true");
    stop.back() = "--train.stop_at=3";
    REQUIRE(run_train(stop) == 0);
    auto resume = with(cut, "true");
    resume.back() = "--train.resume=latest";
    REQUIRE(run_train(resume) == 0);
    auto lon = losses(on), loff = losses(off), lcut = losses(cut);
    REQUIRE(lon.size() == 6);
    REQUIRE(loff.size() == 6);
    REQUIRE(lcut.size() == 6);
    for (size_t i = 0; i < 6; i++) {
      INFO("step " << lon[i].first);
      CHECK(lon[i].first == loff[i].first);
      CHECK(lon[i].second == loff[i].second);
      CHECK(lcut[i].second == loff[i].second);
    }
    CHECK(lon.front().second != lon.back().second);
  }
}

TEST_CASE("a resume drops the metrics lines written after its checkpoint (a kill between saves)", "[trainer]") {
  std::string a = tmpdir("ma"), b = tmpdir("mb");
  auto args_a = tiny(a);
  REQUIRE(run_train(args_a) == 0);
  auto args_b = tiny(b);
  args_b.push_back("--train.stop_at=3");
  REQUIRE(run_train(args_b) == 0);
  // what a run killed after step 5 (checkpoint at 3) leaves: two step lines and a torn one
  std::string m = b + "/metrics.jsonl";
  {
    std::ofstream f(m, std::ios::app);
    f << "{\"kind\":\"train\",\"step\":4,\"loss\":123.0}\n{\"kind\":\"train\",\"step\":5,\"loss\":7.0}\n{\"kind\":\"tr";
  }
  auto args_c = tiny(b);
  args_c.push_back("--train.resume=latest");
  REQUIRE(run_train(args_c) == 0);
  auto read = [](const std::string& p) {
    std::ifstream f(p);
    std::vector<std::string> lines;
    std::string line;
    while (std::getline(f, line)) {
      auto j = nlohmann::json::parse(line);  // every line parses: the torn one is gone
      if (j.value("kind", "") == "train") lines.push_back(j["step"].dump() + " " + j["loss"].dump());
    }
    return lines;
  };
  CHECK(read(a + "/metrics.jsonl") == read(m));
  CHECK(read(m).size() == 6);
}

// ./train of the same build folder as this test, run with a file-size limit (RLIMIT_FSIZE:
// a write past `max_file_bytes` fails with EFBIG, as a full disk fails with ENOSPC); stderr
// to `log`. Returns the exit code.
static int run_train_limited(const std::vector<std::string>& args, long max_file_bytes, const std::string& log) {
  char exe[4096];
  ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
  REQUIRE(n > 0);
  exe[n] = '\0';
  std::string train = std::string(exe).substr(0, std::string(exe).find_last_of('/')) + "/train";
  std::vector<std::string> full = {train};
  full.insert(full.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : full) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {  // the child only sets the limit and execs (no library state after fork)
    // stderr (the error) to `log`, stdout away: a log file would hit the limit too
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644), null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 1);
    ::dup2(fd, 2);
    struct rlimit rl = {rlim_t(max_file_bytes), rlim_t(max_file_bytes)};
    ::setrlimit(RLIMIT_FSIZE, &rl);
    ::signal(SIGXFSZ, SIG_IGN);  // the write returns EFBIG instead of killing the process
    ::execv(train.c_str(), argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST_CASE("a failed checkpoint or metrics write stops the run; the previous checkpoint resumes", "[trainer]") {
  std::string a = tmpdir("fa"), b = tmpdir("fb");
  REQUIRE(run_train(tiny(a)) == 0);  // uninterrupted, for the comparison
  auto args = tiny(b);
  args.push_back("--train.stop_at=3");
  REQUIRE(run_train(args) == 0);
  long model = 0, optim = 0;
  {
    std::ifstream m(b + "/step_00000003/model.safetensors", std::ios::ate | std::ios::binary);
    std::ifstream o(b + "/step_00000003/optimizer.safetensors", std::ios::ate | std::ios::binary);
    model = long(m.tellg());
    optim = long(o.tellg());
  }
  REQUIRE(model > 100000);
  REQUIRE(optim > model);
  // 1. the checkpoint of step 4: model.safetensors fits, optimizer.safetensors does not
  auto resume = tiny(b);
  resume.push_back("--train.resume=latest");
  resume.push_back("--train.save_every=1");
  std::string log = b + "_limited.log";
  REQUIRE(run_train_limited(resume, (model + optim) / 2, log) == 1);
  std::ifstream lf(log);
  std::string text((std::istreambuf_iterator<char>(lf)), std::istreambuf_iterator<char>());
  INFO(text);
  CHECK_THAT(text, Contains("optimizer.safetensors.tmp: write failed: File too large"));
  RunContext ctx;
  ctx.out_dir = b;
  REQUIRE(find_checkpoint(ctx, "latest") == b + "/step_00000003");  // still the latest
  CHECK_FALSE(std::ifstream(b + "/step_00000004.tmp/optimizer.safetensors.tmp").good());  // no partial file
  // 2. a fresh run whose metrics.jsonl outgrows the limit (12 KB: config.cfg and
  // tokenizer.json fit) stops at the failed line with the file and the reason
  std::string c = tmpdir("fc");
  auto fresh = tiny(c);
  fresh.push_back("--train.steps=80");
  REQUIRE(run_train_limited(fresh, 12288, log) == 1);
  std::ifstream lf2(log);
  std::string text2((std::istreambuf_iterator<char>(lf2)), std::istreambuf_iterator<char>());
  CHECK_THAT(text2, Contains("metrics.jsonl: write failed: File too large"));
  // 3. with room again, the resume from step 3 ends like the uninterrupted run
  REQUIRE(run_train(resume) == 0);
  auto la = losses(a), lb = losses(b);
  REQUIRE(lb.size() == 6);
  CHECK(la == lb);
}

TEST_CASE("non-finite steps are skipped; too many in a row stop the run, checkpoint intact", "[trainer]") {
  std::string d = tmpdir("nan");
  auto args = tiny(d);
  args.push_back("--train.lr=1e30");  // step 1 is finite, its update blows the weights up
  args.push_back("--train.warmup_steps=0");
  args.push_back("--train.save_every=1");
  args.push_back("--train.max_nan_skips=3");
  REQUIRE_THROWS_WITH(run_train(args), Contains("non-finite steps in a row"));
  // steps 2 and 3 were skipped (and checkpointed unchanged), step 4 stopped the run: the
  // checkpoint of step 3 is complete and loadable, nothing half-written is left
  RunContext ctx;
  ctx.out_dir = d;
  std::string ck = find_checkpoint(ctx, "latest");
  REQUIRE(ck == d + "/step_00000003");
  CHECK(std::ifstream(d + "/step_00000004.tmp/trainer.json").good() == false);
  CHECK(load_checkpoint_model(ck).size() > 10);
  // the skipped steps were logged as such
  std::ifstream f(d + "/metrics.jsonl");
  std::string line;
  int skipped = 0;
  while (std::getline(f, line)) skipped += line.find("\"skipped\":true") != std::string::npos;
  CHECK(skipped == 2);  // the third skip in a row throws before it is logged
}

TEST_CASE("a SentencePiece-kind tokenizer without ChatML gets the chat tokens added; the LM grows", "[trainer]") {
  // the Llama 2 fixture has <unk> <s> </s> and 1053 pieces; <|endoftext|>, <|im_start|>,
  // <|im_end|> and <image> become special tokens 1056..1059, as HF's add_special_tokens does
  std::string d = tmpdir("spm");
  auto args = tiny(d);
  args.push_back("--data.tokenizer=tests/fixtures/tokenizer_spm_llama2/tokenizer.json");
  args.push_back("--train.steps=2");
  REQUIRE(run_train(args) == 0);
  REQUIRE(losses(d).size() == 2);
  RunContext ctx;
  ctx.out_dir = d;
  std::string ck = find_checkpoint(ctx, "latest");
  REQUIRE(!ck.empty());
  auto w = load_checkpoint_model(ck);
  bool found = false;
  for (auto& [name, t] : w)
    if (name.find("embed_tokens") != std::string::npos) {
      found = true;
      CHECK(t.size(0) == 1060);
    }
  CHECK(found);
  std::system(("rm -rf " + d).c_str());
}

TEST_CASE("config errors name the file, the line or the key, before any work", "[trainer]") {
  std::string d = tmpdir("cfg");
  REQUIRE_THROWS_WITH(run_train({"vlm_sft.cfg", "--train.stepz=3", "--train.out_dir=" + d}), Contains("stepz"));
  REQUIRE_THROWS_WITH(run_train({"vlm_sft.cfg", "--train.steps=abc", "--train.out_dir=" + d}), Contains("train.steps"));
  REQUIRE_THROWS_WITH(run_train({"no_such_config.cfg"}), Contains("no_such_config"));
  REQUIRE_THROWS_WITH(run_train({"vlm_sft.cfg", "positional"}), Contains("--section.key=value"));
}

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

static bool has(const std::string& s, const std::string& t) { return s.find(t) != std::string::npos; }

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

TEST_CASE("train.keep_swiglu: the VLM trains to the same losses with the LM's SwiGLU product kept (CPU)",
          "[trainer]") {
  // the kept product is the forward's silu(gate) up, the recomputed one the same function of the
  // same gate and up: on the CPU the losses agree bit for bit (on CUDA the forward's comes from the
  // gate | up product's epilogue and the backward's from the down projection's, two kernels)
  std::vector<std::vector<std::pair<int64_t, std::string>>> runs;
  for (const char* keep : {"false", "true"}) {
    std::string d = tmpdir((std::string("keep_swiglu_") + keep).c_str());
    auto args = tiny(d);
    args.push_back("--train.device=cpu");
    args.push_back(std::string("--train.keep_swiglu=") + keep);
    REQUIRE(run_train(args) == 0);
    runs.push_back(losses(d));
    REQUIRE(runs.back().size() == 6);
    std::system(("rm -rf " + d).c_str());
  }
  CHECK(runs[1] == runs[0]);
}

TEST_CASE("train.keep_gelu: false, encoder and true train the MIM to the same losses (CPU)", "[trainer]") {
  // keeping fc1's GELU output for the backward instead of recomputing it from the pre-activation
  // changes when the activation is made, not its value: the losses agree bit for bit
  auto mim = [](const std::string& out, const char* keep) {
    // on the CPU also where a GPU is present (the config's device is auto): on CUDA the kept GELU
    // output comes from the product's epilogue and the recomputed one from gelu_forward, two
    // roundings of one value, so there the losses agree to bf16 noise only
    return std::vector<std::string>{"vit_mim.cfg", "--train.device=cpu", "--train.out_dir=" + out,
                                    "--data.dataset=synthetic",
                                    "--train.batch_size=8", "--train.steps=3", "--train.warmup_steps=0",
                                    "--train.log_every=1", "--train.eval_every=0",
                                    std::string("--train.keep_gelu=") + keep};
  };
  std::vector<std::vector<std::pair<int64_t, std::string>>> runs;
  for (const char* keep : {"false", "encoder", "true"}) {
    std::string d = tmpdir((std::string("keep_gelu_") + keep).c_str());
    REQUIRE(run_train(mim(d, keep)) == 0);
    runs.push_back(losses(d));
    REQUIRE(runs.back().size() == 3);
  }
  CHECK(runs[1] == runs[0]);
  CHECK(runs[2] == runs[0]);
  std::string d = tmpdir("keep_gelu_bad");
  REQUIRE_THROWS_WITH(run_train(mim(d, "sometimes")), Contains("train.keep_gelu"));
}
