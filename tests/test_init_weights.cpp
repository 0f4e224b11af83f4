// test_init_weights.cpp: model.lm_init / model.vision_init end to end on the CPU with tiny
// models. Every form the keys' help names is used to start a run whose LM and vision tower
// are then frozen (train.freeze), so the run's checkpoint must hold exactly the source's
// weights: an HF folder, a checkpoint folder, a run folder (its newest checkpoint) and a
// .safetensors file, from a VLM run, a MIM run (encoder.*) and the HF fixtures; and
// model.init, the whole VLM of a stage-1 (caption) run with its tokenizer.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "nn/hf.h"
#include "tensor/safetensors.h"
#include "tests/scratch_dir.h"
#include "trainer/init_weights.h"
#include "trainer/run.h"
#include "trainer/trainer.h"

using namespace loom;
using Catch::Matchers::Contains;

namespace {

int run_train(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return train_command(int(argv.size()), argv.data());
}

std::string tmpdir(const char* name) {
  return loom_test::scratch_path(std::string("init_") + name);
}

// a VLM run of `steps` steps on a few shapes samples; seed varies the weights
std::vector<std::string> tiny_vlm(const std::string& out, int steps, int seed) {
  return {"vlm_sft.cfg", "--train.out_dir=" + out, "--data.train_samples=120", "--data.val_samples=4",
          "--train.batch_size=2", "--train.steps=" + std::to_string(steps), "--train.warmup_steps=0",
          "--train.eval_every=0", "--eval.samples=2", "--train.device=cpu", "--train.seed=" + std::to_string(seed),
          "--train.keep_last=3", "--train.save_every=1"};
}

std::map<std::string, Tensor> final_weights(const std::string& run) {
  RunContext ctx;
  ctx.out_dir = run;
  std::string ck = find_checkpoint(ctx, "latest");
  REQUIRE(!ck.empty());
  return load_checkpoint_model(ck);
}

// Every `prefix`-stripped tensor of `got` equals `want`'s, bit for bit, and all are present.
void require_same(const std::map<std::string, Tensor>& got, const std::string& prefix,
                  const std::map<std::string, Tensor>& want, size_t at_least = 5) {
  size_t n = 0;
  for (auto& [k, v] : got) {
    if (k.rfind(prefix, 0) != 0) continue;
    std::string name = k.substr(prefix.size());
    INFO(prefix << name);
    auto it = want.find(name);
    REQUIRE(it != want.end());
    REQUIRE(v.shape() == it->second.shape());
    REQUIRE(v.to_vector<float>() == it->second.to(DType::F32).to_vector<float>());
    n++;
  }
  REQUIRE(n == want.size());
  REQUIRE(n >= at_least);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::map<std::string, Tensor> strip(const std::map<std::string, Tensor>& sd, const std::string& prefix) {
  std::map<std::string, Tensor> out;
  for (auto& [k, v] : sd)
    if (k.rfind(prefix, 0) == 0) out[k.substr(prefix.size())] = v;
  return out;
}

}  // namespace

TEST_CASE("lm_init / vision_init: a run folder, a checkpoint folder and a .safetensors file", "[trainer][init]") {
  std::string src = tmpdir("src");
  REQUIRE(run_train(tiny_vlm(src, 2, 11)) == 0);
  auto want = final_weights(src);  // the newest checkpoint: step 2
  auto first = load_checkpoint_model(src + "/step_00000001");
  std::vector<std::pair<std::string, std::map<std::string, Tensor>>> forms = {
      {src, want},                                            // run folder: newest checkpoint
      {src + "/step_00000001", first},                        // checkpoint folder
      {src + "/step_00000002/model.safetensors", want},       // a .safetensors file
  };
  // the two checkpoints differ, so taking the wrong one fails
  REQUIRE(want.at("lm.norm.weight").to_vector<float>() != first.at("lm.norm.weight").to_vector<float>());
  int i = 0;
  for (auto& [path, w] : forms) {
    INFO("init from " << path);
    std::string out = tmpdir(("dst" + std::to_string(i++)).c_str());
    auto args = tiny_vlm(out, 1, 99);  // another seed: random init would differ
    args.push_back("--model.lm_init=" + path);
    args.push_back("--model.vision_init=" + path);
    args.push_back("--train.freeze=lm.,vision.");
    REQUIRE(run_train(args) == 0);
    auto got = final_weights(out);
    require_same(got, "lm.", strip(w, "lm."));
    require_same(got, "vision.", strip(w, "vision."));
  }
}

TEST_CASE("vision_init from a MIM run (encoder.*), lm_init / vision_init from HF folders", "[trainer][init]") {
  std::string mim = tmpdir("mim");
  REQUIRE(run_train({"vit_mim.cfg", "--train.out_dir=" + mim, "--data.dataset=synthetic", "--model.image_size=32",
                     "--model.channels=3", "--model.vit_depth=2", "--train.steps=1", "--train.batch_size=4",
                     "--train.warmup_steps=0", "--train.device=cpu"}) == 0);
  std::string out = tmpdir("from_mim");
  auto args = tiny_vlm(out, 1, 5);
  args.push_back("--model.vision_init=" + mim);
  args.push_back("--train.freeze=vision.");
  REQUIRE(run_train(args) == 0);
  require_same(final_weights(out), "vision.", strip(final_weights(mim), "encoder."));

  // HF folders (tests/fixtures): the VLM sized like the fixtures
  std::string hf = tmpdir("from_hf");
  args = tiny_vlm(hf, 1, 5);
  for (const char* a : {"--model.lm_init=tests/fixtures/llama_tiny_s0", "--model.lm_dim=64", "--model.lm_hidden=160",
                        "--model.lm_vocab=512", "--model.vision_init=tests/fixtures/siglip_tiny_s0",
                        "--model.patch_size=8", "--model.vit_mlp_ratio=2", "--train.freeze=lm.,vision."})
    args.push_back(a);
  REQUIRE(run_train(args) == 0);
  auto got = final_weights(hf);
  HFFolder llama = read_hf_folder("tests/fixtures/llama_tiny_s0"), siglip = read_hf_folder("tests/fixtures/siglip_tiny_s0");
  require_same(got, "lm.", llama_to_loom(llama.weights, llama_config("tests/fixtures/llama_tiny_s0"), "llama"));
  ViTConfig vc = siglip_config("tests/fixtures/siglip_tiny_s0");
  require_same(got, "vision.", siglip_to_loom(siglip.weights, vc, "siglip"));
}

TEST_CASE("lm_init with a tokenizer that got the chat tokens added: the embedding grows", "[trainer][init]") {
  // llama_tiny_s0 has 512 ids; the Llama 2 fixture tokenizer has 1056 and gets the 4 ChatML
  // tokens, so the LM has 1060: rows 0..511 come from the HF folder, the rest stay fresh
  std::string out = tmpdir("grow");
  auto args = tiny_vlm(out, 1, 5);
  for (const char* a : {"--model.lm_init=tests/fixtures/llama_tiny_s0", "--model.lm_dim=64", "--model.lm_hidden=160",
                        "--data.tokenizer=tests/fixtures/tokenizer_spm_llama2/tokenizer.json", "--train.freeze=lm."})
    args.push_back(a);
  REQUIRE(run_train(args) == 0);
  auto got = final_weights(out);
  const Tensor& e = got.at("lm.embed_tokens.weight");
  REQUIRE(e.shape() == Shape{1060, 64});
  HFFolder llama = read_hf_folder("tests/fixtures/llama_tiny_s0");
  std::vector<float> src = llama.weights.at("model.embed_tokens.weight").to_vector<float>(), all = e.to_vector<float>();
  REQUIRE(src.size() == 512 * 64);
  CHECK(std::equal(src.begin(), src.end(), all.begin()));
  CHECK(std::any_of(all.begin() + 512 * 64, all.end(), [](float x) { return x != 0; }));  // initialized, not zeros
  std::map<std::string, Tensor> rest = strip(got, "lm.");
  rest.erase("embed_tokens.weight");
  auto hf = llama_to_loom(llama.weights, llama_config("tests/fixtures/llama_tiny_s0"), "llama");
  hf.erase("embed_tokens.weight");
  require_same(rest, "", hf);
  std::system(("rm -rf " + out).c_str());
}

TEST_CASE("lm_init / vision_init: what is not a source is an error naming the key and the path", "[trainer][init]") {
  std::string empty = tmpdir("empty");
  REQUIRE(std::system(("mkdir -p " + empty).c_str()) == 0);
  LMConfig lc;
  REQUIRE_THROWS_WITH(lm_init_weights(empty, lc), Contains("model.lm_init = " + empty) && Contains("run folder"));
  REQUIRE_THROWS_WITH(vision_init_weights(empty + "/nope", ViTConfig{}), Contains("model.vision_init") && Contains("no such"));
  // a safetensors file of another kind: shapes that do not fit the model are named
  std::string out = tmpdir("wrong");
  auto args = tiny_vlm(out, 1, 5);
  args.push_back("--model.lm_init=tests/fixtures/llama_tiny_s0");  // 64 wide, the model is 96
  REQUIRE_THROWS_WITH(run_train(args), Contains("llama_tiny_s0") && Contains("embed_tokens.weight"));
}

TEST_CASE("model.init: stage 2 continues every part of a caption run, with its tokenizer", "[trainer][init]") {
  std::string src = tmpdir("caption");
  auto first = tiny_vlm(src, 2, 11);
  first.push_back("--data.task=caption");
  first.push_back("--eval.max_new_tokens=4");
  REQUIRE(run_train(first) == 0);
  auto want = final_weights(src);
  // two runs, each freezing what it compares (another seed: a random init would differ)
  for (std::string frozen : {"vision.,lm.", "projector."}) {
    INFO("frozen " << frozen);
    std::string out = tmpdir("stage2");
    auto args = tiny_vlm(out, 1, 99);
    args.push_back("--model.init=" + src);
    args.push_back("--train.freeze=" + frozen);
    REQUIRE(run_train(args) == 0);
    auto got = final_weights(out);
    if (frozen == "projector.") {
      require_same(got, "projector.", strip(want, "projector."), 1);  // one linear map
    } else {
      require_same(got, "vision.", strip(want, "vision."));
      require_same(got, "lm.", strip(want, "lm."));
    }
    // the tokenizer came with the weights and is kept in the new run folder
    REQUIRE(read_text(out + "/tokenizer.json") == read_text(src + "/tokenizer.json"));
    std::system(("rm -rf " + out).c_str());
  }
  // a checkpoint's model.safetensors names the same source
  std::string out = tmpdir("stage2_file");
  auto args = tiny_vlm(out, 1, 99);
  args.push_back("--model.init=" + src + "/step_00000002/model.safetensors");
  args.push_back("--train.freeze=vision.,lm.");
  REQUIRE(run_train(args) == 0);
  require_same(final_weights(out), "lm.", strip(want, "lm."));

  // what cannot be continued is named
  REQUIRE_THROWS_WITH(vlm_init_weights("tests/fixtures/llama_tiny_s0"),
                      Contains("model.init = tests/fixtures/llama_tiny_s0") && Contains("model.lm_init"));
  std::string mim = tmpdir("init_mim");
  REQUIRE(run_train({"vit_mim.cfg", "--train.out_dir=" + mim, "--data.dataset=synthetic", "--model.image_size=32",
                     "--model.channels=3", "--model.vit_depth=2", "--train.steps=1", "--train.batch_size=4",
                     "--train.warmup_steps=0", "--train.device=cpu"}) == 0);
  REQUIRE_THROWS_WITH(vlm_init_weights(mim), Contains("model.init = " + mim) && Contains("no vision.*"));
  args = tiny_vlm(tmpdir("both"), 1, 5);
  args.push_back("--model.init=" + src);
  args.push_back("--model.lm_init=" + src);
  REQUIRE_THROWS_WITH(run_train(args), Contains("model.lm_init") && Contains("already gives every part"));
  for (auto& d : {src, out, mim}) std::system(("rm -rf " + d).c_str());
}
