// test_trainer.cpp: the training loop's promises, on the CPU with the default VLM config cut
// down to a few steps: a run interrupted and resumed from its checkpoint continues with
// bit-identical losses; non-finite steps are skipped and too many in a row stop the run with
// the last checkpoint intact; bad configs fail before any work with the key in the message;
// the keep_* switches train to the same losses. The data and bookkeeping options are in
// test_trainer_data.cpp, the shared helpers in trainer_test_util.h.
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
#include "tests/trainer_test_util.h"

using namespace loom;
using Catch::Matchers::Contains;

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
  // 2. a fresh run whose metrics.jsonl outgrows the limit (config.cfg's size, which grows with the
  // schema's help texts, + 2 KB: config.cfg and tokenizer.json fit, 160 steps of metrics do not)
  // stops at the failed line with the file and the reason
  long config_bytes = 0;
  {
    std::ifstream cf(a + "/config.cfg", std::ios::ate | std::ios::binary);
    config_bytes = long(cf.tellg());
  }
  REQUIRE(config_bytes > 1000);
  std::string c = tmpdir("fc");
  auto fresh = tiny(c);
  fresh.push_back("--train.steps=160");
  REQUIRE(run_train_limited(fresh, config_bytes + 2048, log) == 1);
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
