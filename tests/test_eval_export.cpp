// test_eval_export.cpp: `./train eval` and `./train export` on tiny CPU runs. eval on a finished
// run reproduces the numbers of its end-of-training evaluation (VLM answer accuracy and MIM
// probe) from the checkpoint alone; export writes a LlamaForCausalLM + SigLIP folder whose
// re-import by the existing importer (nn/hf.cpp) gives bit-identical weights and logits; bad
// input fails with the path in the message. Each run draws a fresh seed (printed), so the
// weights compared differ from one test run to the next.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "data/chat.h"
#include "data/tokenizer.h"
#include "nn/hf.h"
#include "tests/scratch_dir.h"
#include "tests/tolerances.h"
#include "trainer/eval.h"
#include "trainer/export.h"
#include "trainer/init_weights.h"
#include "trainer/run.h"
#include "trainer/trainer.h"
#include "trainer/vlm_task.h"

using namespace loom;
using json = nlohmann::json;
using Catch::Matchers::Contains;

namespace {

int call(int (*cmd)(int, char**), std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return cmd(int(argv.size()), argv.data());
}

std::string tmpdir(const char* name) {
  return loom_test::scratch_path(std::string("eval_export_") + name);
}

bool exists(const std::string& p) {
  struct stat s;
  return stat(p.c_str(), &s) == 0;
}

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

json read_json(const std::string& p) {
  INFO(p);
  REQUIRE(exists(p));
  return json::parse(slurp(p));  // throws (fails the test) when not JSON
}

// the last "eval" line of a run's metrics.jsonl
json last_eval(const std::string& run) {
  json last;
  std::ifstream f(run + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    json j = json::parse(line);
    if (j.value("kind", "") == "eval") last = j;
  }
  REQUIRE(!last.is_null());
  return last;
}

uint64_t fresh_seed() {
  uint64_t s = std::random_device{}() % 1000000;
  std::printf("test_eval_export: seed %llu\n", (unsigned long long)s);
  return s;
}

// stdout into a file while in scope
struct StdoutToFile {
  int saved;
  explicit StdoutToFile(const std::string& path) {
    std::fflush(stdout);
    saved = ::dup(1);
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::close(fd);
  }
  ~StdoutToFile() {
    std::fflush(stdout);
    ::dup2(saved, 1);
    ::close(saved);
  }
};

// The text the run printed from its line "eval at step N" on: that line and the next `lines`.
std::string printed_eval(const std::string& file, int64_t step, int lines) {
  std::ifstream f(file);
  std::string line, out;
  const std::string head = "eval at step " + std::to_string(step) + ":";
  int left = -1;
  while (std::getline(f, line)) {
    if (left < 0 && line.rfind(head, 0) == 0) left = lines + 1;
    if (left > 0) {
      out += (out.empty() ? "" : "\n") + line;
      if (--left == 0) break;
    }
  }
  return out;
}

// A finished tiny VLM run on the CPU (shared by the test cases below: ~10 s to train),
// removed when the test program exits.
const std::string& vlm_run() {
  static struct Folder {
    std::string path;
    ~Folder() {
      if (!path.empty()) std::system(("rm -rf " + path).c_str());
    }
  } run;
  std::string& dir = run.path;
  if (!dir.empty()) return dir;
  dir = tmpdir("vlm");
  uint64_t seed = fresh_seed();
  mkdirs(dir);
  StdoutToFile capture(dir + "/stdout.txt");  // what the run prints, for the table's text
  REQUIRE(call(train_command, {"vlm_sft.cfg", "--train.out_dir=" + dir, "--train.device=cpu",
                               "--train.seed=" + std::to_string(seed), "--data.train_samples=300",
                               "--data.val_samples=24", "--train.batch_size=2", "--train.steps=8",
                               "--train.warmup_steps=2", "--train.eval_every=0", "--eval.samples=12",
                               "--train.log_every=4", "--data.workers=2", "--train.save_every=4",
                               "--train.keep_last=2"}) == 0);
  return dir;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  auto x = a.contiguous().to_vector<float>(), y = b.contiguous().to_vector<float>();
  return std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

std::map<std::string, Tensor> under(const std::map<std::string, Tensor>& sd, const std::string& prefix) {
  std::map<std::string, Tensor> out;
  for (auto& [k, v] : sd)
    if (k.rfind(prefix, 0) == 0) out[k.substr(prefix.size())] = v;
  return out;
}

}  // namespace

TEST_CASE("eval on a finished VLM run reproduces its end-of-training accuracy table", "[eval]") {
  const std::string& run = vlm_run();
  json ref = last_eval(run);
  std::string config_before = slurp(run + "/config.cfg");
  // the run folder (its newest checkpoint) and the checkpoint folder itself
  RunContext probe;
  probe.out_dir = run;
  std::string ck = find_checkpoint(probe, "latest");
  REQUIRE(!ck.empty());
  for (const std::string& src : {run, ck + "/"}) {
    INFO("eval " << src);
    EvalReport r = run_eval(src, {"--train.device=cpu"});
    REQUIRE(r.metrics.size() == ref.size() - 1);  // all but "kind"
    for (auto& [k, v] : r.metrics) {
      INFO(k);
      REQUIRE(ref.contains(k));
      CHECK(json(v).dump() == ref[k].dump());  // the JSON text of a double round-trips exactly
    }
    CHECK_THAT(r.text, Contains("eval at step 8: val loss") && Contains("baseline") && Contains("  all "));
    // the very text the run printed at its end (the eval line, the header, a line per type, "all")
    int lines = int(std::count(r.text.begin(), r.text.end(), '\n'));
    CHECK(lines >= 3);
    CHECK(r.text == printed_eval(run + "/stdout.txt", 8, lines));
  }
  CHECK(ref["val_loss"].get<double>() > 0);
  // the earlier checkpoint evaluates its own weights: another validation loss
  EvalReport r_early = run_eval(run + "/step_00000004", {"--train.device=cpu"});
  CHECK(r_early.metrics.at("step") == 4);
  CHECK(r_early.metrics.at("val_loss") != ref["val_loss"].get<double>());
  // an override on top of the checkpoint's config: fewer questions
  EvalReport r4 = run_eval(run, {"--train.device=cpu", "--eval.samples=4"});
  int total = 0;
  std::istringstream lines(r4.text);
  for (std::string l; std::getline(lines, l);)
    if (auto at = l.find("/"); at != std::string::npos && l.find("(") != std::string::npos)
      total += std::stoi(l.substr(at + 1));
  CHECK(total == 4);
  // a run trained in bf16 or fp16 on a GPU: on the CPU it is evaluated in f32, the same table
  for (const char* dt : {"--train.dtype=bf16", "--train.dtype=fp16"}) {
    INFO(dt);
    EvalReport r16 = run_eval(run, {"--train.device=cpu", dt});
    CHECK(r16.text == run_eval(run, {"--train.device=cpu"}).text);
  }
  // the run folder is only read
  CHECK(slurp(run + "/config.cfg") == config_before);
  CHECK(call(eval_command, {run, "--train.device=cpu", "--eval.samples=2"}) == 0);
  CHECK_THROWS_WITH(run_eval(run, {"--train.device=cpu", "--eval.samples=0"}), Contains("eval.samples = 0"));
}

TEST_CASE("export writes an HF folder that the importer reads back bit for bit", "[export]") {
  const std::string& run = vlm_run();
  std::string out = tmpdir("hf");
  ExportResult r = export_hf(run, out);
  const VLMConfig& vc = r.config;
  auto sd = load_checkpoint_model(r.checkpoint);

  // config.json, read as HF reads it and by our importer
  json cj = read_json(out + "/config.json");
  CHECK(cj["architectures"] == json::array({"LlamaForCausalLM"}));
  CHECK(cj["model_type"] == "llama");
  CHECK(cj["torch_dtype"] == "float32");
  CHECK(cj["tie_word_embeddings"] == true);
  CHECK(cj["max_position_embeddings"] == 256);  // vlm_sft.cfg: data.pack_max_length
  Tokenizer tok = Tokenizer::from_file(run + "/tokenizer.json");
  CHECK(cj["bos_token_id"] == tok.token_id("<|im_start|>"));
  CHECK(cj["eos_token_id"] == tok.token_id("<|im_end|>"));
  CHECK(cj["pad_token_id"] == tok.token_id("<|endoftext|>"));
  LMConfig lc = llama_config(out);
  CHECK(lc.vocab == vc.lm.vocab);
  CHECK(lc.dim == vc.lm.dim);
  CHECK(lc.hidden == vc.lm.hidden);
  CHECK(lc.depth == vc.lm.depth);
  CHECK(lc.heads == vc.lm.heads);
  CHECK(lc.kv_heads == vc.lm.kv_heads);
  CHECK(lc.rope_theta == vc.lm.rope_theta);
  CHECK(lc.eps == vc.lm.eps);
  CHECK(lc.vocab == int(sd.at("lm.embed_tokens.weight").size(0)));

  // weights: HF names, no lm_head (tied), and back through the importer unchanged
  HFFolder f = read_hf_folder(out);
  CHECK(f.model_type == "llama");
  CHECK(f.weights.count("model.layers.0.self_attn.q_proj.weight") == 1);
  CHECK(f.weights.count("lm_head.weight") == 0);
  auto lm_back = llama_to_loom(f.weights, lc, out);
  auto lm_ref = under(sd, "lm.");
  REQUIRE(lm_back.size() == lm_ref.size());
  for (auto& [k, v] : lm_ref) {
    INFO(k);
    REQUIRE(lm_back.count(k));
    CHECK(same_bits(lm_back.at(k), v));
  }
  // the same through model.lm_init's resolution of an HF folder
  auto lm_init = lm_init_weights(out, lc);
  CHECK(same_bits(lm_init.at("layers.1.down_proj.weight"), lm_ref.at("layers.1.down_proj.weight")));

  // logits of the LM built from the export equal the checkpoint's LM's, on fresh token ids
  {
    Rng rng(0), ids_rng(std::random_device{}());
    LM a(vc.lm, Init{DType::F32, Device::CPU, &rng}), b(lc, Init{DType::F32, Device::CPU, &rng});
    a.load_state_dict(lm_ref, "checkpoint");
    b.load_state_dict(lm_init, out);
    NoGradGuard ng;
    const int T = 19;
    std::vector<int32_t> ids(T), pos(T);
    for (int t = 0; t < T; t++) ids[size_t(t)] = int32_t(ids_rng.randint(lc.vocab)), pos[size_t(t)] = t;
    auto logits = [&](const LM& m) {
      Tensor idt = Tensor::from_vector(ids, {T});
      Tensor h = m.hidden(embedding(idt, m.embed_tokens), Tensor::from_vector(pos, {T}), SeqInfo::dense(1, T, Device::CPU));
      return m.logits(h);
    };
    Tensor la = logits(a), lb = logits(b);
    CHECK(la.size(1) == lc.vocab);
    CHECK(same_bits(la, lb));
  }

  // vision tower: SigLIP config and weights
  json vj = read_json(out + "/vision/config.json");
  CHECK(vj["model_type"] == "siglip_vision_model");
  CHECK(vj["vision_use_head"] == false);
  ViTConfig vcfg = siglip_config(out + "/vision");
  CHECK(vcfg.image_size == vc.vit.image_size);
  CHECK(vcfg.patch_size == vc.vit.patch_size);
  CHECK(vcfg.dim == vc.vit.dim);
  CHECK(vcfg.depth == vc.vit.depth);
  CHECK(vcfg.heads == vc.vit.heads);
  CHECK(vcfg.hidden() == vc.vit.hidden());
  CHECK(vcfg.eps == vc.vit.eps);
  HFFolder fv = read_hf_folder(out + "/vision");
  CHECK(fv.weights.at("embeddings.patch_embedding.weight").dim() == 4);  // Conv2d layout
  auto vis_back = siglip_to_loom(fv.weights, vcfg, out);
  auto vis_ref = under(sd, "vision.");
  REQUIRE(vis_back.size() == vis_ref.size());
  for (auto& [k, v] : vis_ref) {
    INFO(k);
    REQUIRE(vis_back.count(k));
    CHECK(same_bits(vis_back.at(k), v));
  }
  read_json(out + "/vision/preprocessor_config.json");
  SafeTensors proj = load_safetensors(out + "/projector.safetensors");
  CHECK(same_bits(proj.at("weight"), sd.at("projector.weight")));
  CHECK(proj.metadata.at("shuffle") == std::to_string(vc.shuffle));

  // tokenizer files: the run's tokenizer.json copied; the config with the ChatML template
  CHECK(slurp(out + "/tokenizer.json") == slurp(run + "/tokenizer.json"));
  CHECK(Tokenizer::from_file(out + "/tokenizer.json").encode("What colour is the circle?") ==
        tok.encode("What colour is the circle?"));
  json tc = read_json(out + "/tokenizer_config.json");
  CHECK(tc["tokenizer_class"] == "PreTrainedTokenizerFast");
  CHECK(tc["chat_template"] == kChatTemplateJinja);
  CHECK_THAT(tc["chat_template"].get<std::string>(), Contains("<|im_start|>") && Contains("add_generation_prompt"));
  CHECK(tc["eos_token"] == "<|im_end|>");
  CHECK(tc["added_tokens_decoder"][std::to_string(tok.token_id("<image>"))]["content"] == "<image>");
  json gc = read_json(out + "/generation_config.json");
  CHECK(gc["eos_token_id"] == tok.token_id("<|im_end|>"));
  read_json(out + "/special_tokens_map.json");

  // the export command on the same run: refuses the now non-empty folder, naming it
  REQUIRE_THROWS_WITH(call(export_command, {run, "--hf", out}), Contains(out) && Contains("not empty"));
  std::system(("rm -rf " + out).c_str());
}

TEST_CASE("eval and export refuse bad input with the path in the message", "[eval][export]") {
  std::string empty = tmpdir("empty");
  mkdirs(empty);
  REQUIRE_THROWS_WITH(run_eval(empty, {}), Contains(empty) && Contains("checkpoint"));
  REQUIRE_THROWS_WITH(export_hf(empty, empty + "/out"), Contains(empty) && Contains("checkpoint"));
  REQUIRE_THROWS_WITH(run_eval(empty + "/nope", {}), Contains(empty + "/nope"));
  const std::string& run = vlm_run();
  REQUIRE_THROWS_WITH(call(export_command, {run}), Contains("--hf"));
  REQUIRE_THROWS_WITH(call(export_command, {run, "--hf"}), Contains("--hf"));
  REQUIRE_THROWS_WITH(call(eval_command, {}), Contains("usage"));
  REQUIRE_THROWS_WITH(run_eval(run, {"--eval.nope=1"}), Contains("nope"));
  // a non-empty output folder is refused and left as it was
  std::string busy = tmpdir("busy");
  mkdirs(busy);
  std::ofstream(busy + "/keep.txt") << "mine";
  REQUIRE_THROWS_WITH(export_hf(run, busy), Contains(busy) && Contains("not empty"));
  CHECK(!exists(busy + "/config.json"));
  CHECK(slurp(busy + "/keep.txt") == "mine");
  std::system(("rm -rf " + empty + " " + busy).c_str());
}

TEST_CASE("eval on a finished MIM run reproduces its probe; export refuses it", "[eval][export]") {
  if (!exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")) {
    WARN("Fashion-MNIST is not installed (make deps): MIM eval not tested");
    return;
  }
  std::string run = tmpdir("mim");
  uint64_t seed = fresh_seed();
  REQUIRE(call(train_command, {"vit_mim.cfg", "--train.out_dir=" + run, "--train.device=cpu",
                               "--train.seed=" + std::to_string(seed), "--data.train_samples=256",
                               "--data.val_samples=128", "--train.batch_size=16", "--train.steps=3",
                               "--train.warmup_steps=1", "--train.log_every=1", "--data.workers=1"}) == 0);
  json ref = last_eval(run);
  EvalReport r = run_eval(run, {"--train.device=cpu"});
  for (const char* k : {"step", "probe", "probe_raw_pixels", "probe_random_init"}) {
    INFO(k);
    REQUIRE(r.metrics.count(k));
    CHECK(json(r.metrics.at(k)).dump() == ref[k].dump());
  }
  CHECK_THAT(r.text, Contains("eval at step 3: linear probe"));
  REQUIRE_THROWS_WITH(export_hf(run, run + "/hf"), Contains("vit_mim") && Contains("language model"));
  CHECK(!exists(run + "/hf"));
  CHECK_THROWS_WITH(call(chat_command, {run, "--device", "cpu"}), Contains("model.kind = mim") && Contains("VLM run"));
  std::system(("rm -rf " + run).c_str());
}

// The export is the exact inverse of the import on folders that transformers wrote: HF -> ours
// -> HF gives every tensor back under its name, bit for bit (the SigLIP one goes through the
// Conv2d permutation and the q/k/v split), and the config reads back the same.
TEST_CASE("HF fixture folders survive import then export unchanged", "[export]") {
  std::string out = tmpdir("fixtures");
  {
    const std::string src = "tests/fixtures/llama_tiny_s0";
    LMConfig c = llama_config(src);
    auto hf = load_safetensors(src + "/model.safetensors").tensors;
    mkdirs(out + "/llama");
    write_llama_folder(out + "/llama", llama_to_loom(hf, c, src), c, {1, 2, -1}, 256);
    auto back = load_safetensors(out + "/llama/model.safetensors");
    CHECK(back.metadata.at("format") == "pt");
    REQUIRE(back.tensors.size() == hf.size());
    for (auto& [k, v] : hf) {
      INFO(k);
      REQUIRE(back.tensors.count(k));
      CHECK(same_bits(back.tensors.at(k), v));
    }
    LMConfig c2 = llama_config(out + "/llama");
    CHECK(c2.vocab == c.vocab);
    CHECK(c2.dim == c.dim);
    CHECK(c2.hidden == c.hidden);
    CHECK(c2.depth == c.depth);
    CHECK(c2.heads == c.heads);
    CHECK(c2.kv_heads == c.kv_heads);
    CHECK(c2.rope_theta == c.rope_theta);
    CHECK(c2.eps == c.eps);
    json j = read_json(out + "/llama/config.json");
    CHECK(j["pad_token_id"].is_null());
    CHECK(j["head_dim"] == read_json(src + "/config.json")["head_dim"]);
  }
  {
    const std::string src = "tests/fixtures/siglip_tiny_s0";
    ViTConfig c = siglip_config(src);
    auto hf = load_safetensors(src + "/model.safetensors").tensors;
    mkdirs(out + "/siglip");
    write_siglip_folder(out + "/siglip", siglip_to_loom(hf, c, src), c);
    auto back = load_safetensors(out + "/siglip/model.safetensors").tensors;
    REQUIRE(back.size() == hf.size());
    for (auto& [k, v] : hf) {
      INFO(k);
      REQUIRE(back.count(k));
      CHECK(same_bits(back.at(k), v));
    }
    json a = read_json(src + "/config.json"), b = read_json(out + "/siglip/config.json");
    for (const char* k : {"model_type", "image_size", "patch_size", "num_channels", "hidden_size", "intermediate_size",
                          "num_hidden_layers", "num_attention_heads", "hidden_act", "layer_norm_eps", "vision_use_head"}) {
      INFO(k);
      CHECK(a[k] == b[k]);
    }
  }
  // a state dict that lacks a tensor is refused, naming it
  {
    const std::string src = "tests/fixtures/llama_tiny_s0";
    LMConfig c = llama_config(src);
    auto ours = llama_to_loom(load_safetensors(src + "/model.safetensors").tensors, c, src);
    ours.erase("layers.1.up_proj.weight");
    mkdirs(out + "/partial");
    REQUIRE_THROWS_WITH(write_llama_folder(out + "/partial", ours, c, {}, 256), Contains("model.layers.1.mlp.up_proj.weight"));
  }
  std::system(("rm -rf " + out).c_str());
}

TEST_CASE("HF config.json: every number checked, the file and the key in the error", "[export]") {
  const std::string out = tmpdir("config");
  mkdirs(out);
  json base = read_json("tests/fixtures/llama_tiny_s0/config.json");
  auto with = [&](const char* key, const json& value) {
    json j = base;
    if (value.is_discarded()) j.erase(key);
    else j[key] = value;
    std::ofstream(out + "/config.json") << j.dump();
    return out;
  };
  CHECK(llama_config(with("hidden_size", base["hidden_size"])).dim == base["hidden_size"].get<int>());
  // a float past int's range was converted with undefined behaviour; 0 divided by zero later
  CHECK_THROWS_WITH(llama_config(with("hidden_size", 1e100)),
                    Contains(out + "/config.json") && Contains("\"hidden_size\"") && Contains("expected an integer"));
  CHECK_THROWS_WITH(llama_config(with("num_attention_heads", 0)), Contains("\"num_attention_heads\" = 0"));
  CHECK_THROWS_WITH(llama_config(with("num_hidden_layers", "12")), Contains("\"num_hidden_layers\" = \"12\""));
  CHECK_THROWS_WITH(llama_config(with("vocab_size", json::value_t::discarded)), Contains("missing \"vocab_size\""));
  CHECK_THROWS_WITH(llama_config(with("rms_norm_eps", -1.0)), Contains("\"rms_norm_eps\" = -1"));
  CHECK_THROWS_WITH(llama_config(with("num_key_value_heads", base["num_attention_heads"].get<int>() + 1)),
                    Contains("\"num_key_value_heads\""));
  json sig = read_json("tests/fixtures/siglip_tiny_s0/config.json");
  sig["hidden_size"] = 0;
  std::ofstream(out + "/config.json") << sig.dump();
  CHECK_THROWS_WITH(siglip_config(out), Contains("\"hidden_size\" = 0"));
  std::system(("rm -rf " + out).c_str());
}

TEST_CASE("sampling: greedy, temperature, top_k and top_p as HF's generate defines them", "[chat]") {
  uint64_t seed = fresh_seed();
  Rng rng(seed);
  // greedy: the argmax, ties to the lowest id, whatever top_k / top_p say
  std::vector<double> logits(50);
  for (double& l : logits) l = rng.normal();
  const int32_t best = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  CHECK(sample_next(logits, Sampling{}, rng) == best);
  CHECK(sample_next(logits, Sampling{0, 3, 0.5}, rng) == best);
  CHECK(sample_next({1.0, 3.0, 3.0, 2.0}, Sampling{}, rng) == 1);
  for (int i = 0; i < 50; i++) {  // a single candidate left: always the argmax
    CHECK(sample_next(logits, Sampling{1.0, 1, 1.0}, rng) == best);
    CHECK(sample_next(logits, Sampling{2.0, 0, 1e-9}, rng) == best);
  }
  // frequencies: probabilities 0.5, 0.3, 0.15, 0.05 at shuffled ids
  const std::vector<double> probs{0.5, 0.3, 0.15, 0.05};
  std::vector<int32_t> id = rng.permutation(4);
  std::vector<double> lg(4);
  for (int i = 0; i < 4; i++) lg[size_t(id[size_t(i)])] = std::log(probs[size_t(i)]) + 1.7;  // a shift changes nothing
  auto expect = [&](const Sampling& s, std::vector<double> want) {  // want: by rank, unnormalized
    double z = 0;
    for (double w : want) z += w;
    const int n = 40000;
    std::vector<int> count(4, 0);
    for (int i = 0; i < n; i++) count[size_t(sample_next(lg, s, rng))]++;
    for (int r = 0; r < 4; r++) {
      const double p = want[size_t(r)] / z, f = double(count[size_t(id[size_t(r)])]) / n;
      INFO("T " << s.temperature << " top_k " << s.top_k << " top_p " << s.top_p << " rank " << r << ": " << f
                << " drawn, " << p << " expected (seed " << seed << ")");
      CHECK(std::fabs(f - p) <= tol::kSamplingSigmas * std::sqrt(std::max(p * (1 - p), 1e-12) / n));
    }
  };
  expect({1.0, 0, 1.0}, {0.5, 0.3, 0.15, 0.05});
  expect({2.0, 0, 1.0}, {std::sqrt(0.5), std::sqrt(0.3), std::sqrt(0.15), std::sqrt(0.05)});  // p^(1/T)
  expect({1.0, 2, 1.0}, {0.5, 0.3, 0, 0});
  expect({1.0, 0, 0.79}, {0.5, 0.3, 0, 0});    // 0.5 + 0.3 reaches 0.79: the third is cut
  expect({1.0, 0, 0.81}, {0.5, 0.3, 0.15, 0});  // it does not reach 0.81: the third stays
  // top_p counts the mass left by top_k: 0.8 / 0.95 = 0.84 of the top 3 is under 0.9, not under 0.8
  expect({1.0, 3, 0.9}, {0.5, 0.3, 0.15, 0});
  expect({1.0, 3, 0.8}, {0.5, 0.3, 0, 0});
  // out of range: errors naming the option
  CHECK_THROWS_WITH(check_sampling({-1, 0, 1}), Contains("temperature"));
  CHECK_THROWS_WITH(check_sampling({1, -2, 1}), Contains("top_k"));
  CHECK_THROWS_WITH(check_sampling({1, 0, 0}), Contains("top_p"));
  CHECK_THROWS_WITH(check_sampling({1, 0, 1.5}), Contains("top_p"));
  CHECK_THROWS_WITH(check_sampling({std::nan(""), 0, 1}), Contains("temperature"));
}

TEST_CASE("chat on a finished run: greedy, sampled with a seed, bad options named", "[chat]") {
  const std::string& run = vlm_run();
  auto chat = [&](std::vector<std::string> args) {
    args.insert(args.begin(), run);
    args.insert(args.end(), {"--device", "cpu"});
    std::string out = run + "/chat.txt";
    int rc;
    {
      StdoutToFile capture(out);
      rc = call(chat_command, args);
    }
    REQUIRE(rc == 0);
    std::string text = slurp(out);
    INFO(text);
    CHECK_THAT(text, Contains("user: ") && Contains("assistant: "));
    return text;
  };
  const std::string greedy = chat({});
  CHECK(chat({"--temperature", "0", "--top_k", "3"}) == greedy);  // T 0: greedy whatever the rest
  const std::vector<std::string> sampled{"--temperature", "1.5", "--top_k", "20", "--top_p", "0.95", "--seed", "7",
                                         "--max_new_tokens", "12"};
  CHECK(chat(sampled) == chat(sampled));  // the seed fixes the draws
  for (auto bad : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--top_p", "0"}, "--top_p"}, {{"--top_p", "1.2"}, "--top_p"}, {{"--top_k", "2.5"}, "--top_k"},
           {{"--temperature", "-1"}, "--temperature"}, {{"--temperature", "hot"}, "--temperature"},
           {{"--seed", "-3"}, "--seed"}, {{"--max_new_tokens", "0"}, "--max_new_tokens"}, {{"--top_k"}, "--top_k"},
           {{"--bogus", "1"}, "--bogus"}}) {
    std::vector<std::string> args{run};
    args.insert(args.end(), bad.first.begin(), bad.first.end());
    INFO(bad.second);
    CHECK_THROWS_WITH(call(chat_command, args), Contains(bad.second));
  }
}
