// trainer_test_util.h: what tests/test_trainer.cpp and test_trainer_data.cpp share: ./train's
// entry point called in-process, the default VLM config cut down to a few steps, the losses of
// a run's metrics.jsonl and a fresh scratch folder.
#pragma once
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "tests/scratch_dir.h"
#include "trainer/trainer.h"

inline int run_train(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return loom::train_command(int(argv.size()), argv.data());
}

// a small, fast version of the default run
inline std::vector<std::string> tiny(const std::string& out) {
  return {"vlm_sft.cfg", "--train.out_dir=" + out, "--data.train_samples=300", "--data.val_samples=16",
          "--train.batch_size=2", "--train.steps=6", "--train.warmup_steps=2", "--train.eval_every=0",
          "--eval.samples=8", "--train.log_every=1", "--data.workers=2"};
}

inline std::vector<std::pair<int64_t, std::string>> losses(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> v;
  std::ifstream f(dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.value("kind", "") == "train") v.push_back({j["step"].get<int64_t>(), j["loss"].dump()});
  }
  return v;
}

inline std::string tmpdir(const char* name) {
  return loom_test::scratch_path(std::string("trainer_") + name);
}

inline bool has(const std::string& s, const std::string& t) { return s.find(t) != std::string::npos; }
