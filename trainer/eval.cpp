// eval.cpp: the VLM evaluation and `./train eval` (see eval.h); the MIM probe is in
// mim_trainer.cpp beside the probes themselves.
#include "trainer/eval.h"

#include <sys/stat.h>

#include <cctype>
#include <cstdio>

#include "tensor/fileio.h"
#include "trainer/mim_trainer.h"

namespace loom {

static std::string trim(std::string s) {
  while (!s.empty() && std::isspace((unsigned char)s.back())) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace((unsigned char)s[i])) i++;
  return s.substr(i);
}

EvalReport evaluate_vlm(const VLM& m, const VLMData& d, const RunContext& ctx, int max_samples, int64_t step) {
  NoGradGuard ng;
  int n = std::min<int>(max_samples, int(d.val.size()));
  // validation loss on packed batches of the held-out samples
  std::vector<Sample> vs(d.val_samples.begin(), d.val_samples.begin() + n);
  auto rows = plan_rows(vs, ctx.cfg.get_int("data.pack_max_length"), true);
  double loss_sum = 0;
  int nb = 0;
  size_t per = size_t(std::max(1, ctx.cfg.get_int("train.batch_size")));
  for (size_t r = 0; r < rows.size(); r += per) {
    std::vector<std::vector<int>> chunk(rows.begin() + long(r), rows.begin() + long(std::min(rows.size(), r + per)));
    PackedBatch pb = build_batch(vs, chunk, ctx.cfg.get_int("data.pack_max_length"), d.pad_id, d.image_token);
    loss_sum += m.loss(to_device(d, pb, ctx.device, ctx.compute)).item();
    nb++;
  }
  const double val_loss = nb ? loss_sum / nb : 0;
  // exact-match answers by greedy generation
  std::map<std::string, std::pair<int, int>> by_type;  // qtype -> (correct, total)
  Rng rng(0);
  int correct = 0;
  std::vector<std::string> misses;  // the first few wrong answers, shown with the table
  for (int i = 0; i < n; i++) {
    const QA& q = d.val[size_t(i)];
    Tensor img = Tensor::from_vector(d.images[size_t(q.image)], {1, d.channels, d.image_size, d.image_size})
                     .to(ctx.compute)
                     .to(ctx.device);
    auto ids = generate(m, img, qa_prompt(d, q.question), ctx.cfg.get_int("eval.max_new_tokens"), d.end_id, Sampling{}, rng);
    const std::string got = trim(d.tok->decode(ids, true));
    bool ok = got == trim(q.answer);
    if (!ok && misses.size() < 3) misses.push_back("  \"" + q.question + "\" -> \"" + got + "\" (want \"" + q.answer + "\")\n");
    correct += ok;
    by_type[q.qtype].first += ok;
    by_type[q.qtype].second++;
  }
  const double accuracy = n ? double(correct) / n : 0;

  EvalReport r;
  r.metrics = {{"step", double(step)}, {"val_loss", val_loss}, {"accuracy", accuracy}};
  for (auto& [t, h] : by_type) r.metrics["acc_" + t] = double(h.first) / h.second;
  r.text = "eval at step " + std::to_string(step) + ": val loss " + std::to_string(val_loss) + "\n" +
           "answer accuracy (exact match, greedy) vs majority baseline:\n";
  char b[160];
  for (auto& [t, h] : by_type) {
    double base = d.baseline.count(t) ? d.baseline.at(t) : 0;
    std::snprintf(b, sizeof b, "  %-10s %5.1f%%  (%d/%d)   baseline %5.1f%%\n", t.c_str(), 100.0 * h.first / h.second,
                  h.first, h.second, 100 * base);
    r.text += b;
  }
  std::snprintf(b, sizeof b, "  %-10s %5.1f%%             baseline %5.1f%%", "all", 100 * accuracy,
                100 * (d.baseline.count("all") ? d.baseline.at("all") : 0));
  r.text += b;
  if (!misses.empty()) {
    r.text += "\nfirst wrong answers:\n";
    for (auto& m : misses) r.text += m;
    r.text.pop_back();
  }
  return r;
}

// The checkpoint's weights in the compute dtype, nothing trained.
// The run's layout (pack_like_optimizer: its frozen parts apart, the trained ones in the
// optimizer's flat order), then no gradients and one compute dtype.
static void prepare_for_eval(Module& m, const Config& cfg, DType compute) {
  freeze_prefixes(m, cfg.get_str("train.freeze"));
  pack_like_optimizer(m, cfg, compute);
  m.requires_grad_(false);
  cast_frozen(m, compute);
}

EvalReport run_eval(const std::string& path, const std::vector<std::string>& overrides) {
  const std::string ck = resolve_checkpoint(path, "eval");
  Config cfg = Config::parse(checkpoint_config_text(ck), ck + "/trainer.json");
  // every weight comes from the checkpoint: the weights it started from may be gone
  for (const char* k : {"model.init", "model.lm_init", "model.vision_init"}) cfg.set(k, "");
  for (auto& o : overrides) cfg.apply_override(o);
  // A run trained in bf16 / fp16 on a GPU is evaluated in f32 where it lands on the CPU (whose
  // kernels run f32 / f64): the weights are the f32 masters either way.
  const std::string dev = cfg.get_str("train.device"), dt = cfg.get_str("train.dtype");
  if ((dt == "bf16" || dt == "fp16") && (dev == "cpu" || (dev == "auto" && !cuda::available()))) {
    std::printf("# train.dtype = %s needs a GPU: evaluating in f32 on the CPU\n", dt.c_str());
    cfg.set("train.dtype", "f32");
  }
  validate_config(cfg);
  const TrainerState st = read_checkpoint_state(ck);
  RunContext ctx = make_context(cfg);
  ctx.out_dir = parent_dir(ck);  // the run folder, where the run cached its tokenizer
  const std::string trainer = cfg.get_str("train.trainer");
  std::printf("# eval of %s (%s, step %lld): device %s, compute %s\n", ck.c_str(), trainer.c_str(), (long long)st.step,
              device_name(ctx.device), dtype_name(ctx.compute));
  Rng init_rng(0);  // every weight comes from the checkpoint
  const std::string weights = ck + "/model.safetensors";
  if (trainer == "vit_mim") {
    MIMConfig mc = mim_config_from(cfg);
    MIMData d = load_mim_data(cfg, mc.vit);
    LOOM_CHECK(d.test.n > 0, "eval: %s: data.dataset = %s has no test split for the probe", ck.c_str(),
               cfg.get_str("data.dataset").c_str());
    LatentMIM m(mc, Init{DType::F32, ctx.device, &init_rng});
    m.load_state_dict(load_checkpoint_model(ck), weights);
    prepare_for_eval(m, cfg, ctx.compute);
    return evaluate_mim(m.encoder, d, ctx, st.extra, st.step);
  }
  struct stat sb;
  LOOM_CHECK(!cfg.get_str("data.tokenizer").empty() || stat((ctx.out_dir + "/tokenizer.json").c_str(), &sb) == 0,
             "eval: %s/tokenizer.json (the tokenizer the run trained) is missing and data.tokenizer is empty",
             ctx.out_dir.c_str());
  VLMConfig probe = vlm_config_from(cfg, 1, 0);
  VLMData d = build_vlm_data(ctx, probe.image_tokens());
  LOOM_CHECK(!d.val.empty(), "eval: %s: data.dataset = %s has no held-out questions", ck.c_str(),
             cfg.get_str("data.dataset").c_str());
  LOOM_CHECK(cfg.get_int("eval.samples") > 0, "eval: %s: eval.samples = 0 asks for no evaluation", ck.c_str());
  VLMConfig vc = vlm_config_from(cfg, d.tok->vocab_size(), d.image_token);
  VLM m(vc, Init{DType::F32, ctx.device, &init_rng});
  m.load_state_dict(load_checkpoint_model(ck), weights);
  prepare_for_eval(m, cfg, ctx.compute);
  std::printf("%s", d.baseline_text.c_str());
  return evaluate_vlm(m, d, ctx, cfg.get_int("eval.samples"), st.step);
}

int eval_command(int argc, char** argv) {
  const char* usage = "usage: ./train eval RUN_OR_CHECKPOINT [--section.key=value ...]";
  std::string path;
  std::vector<std::string> overrides;
  for (int i = 0; i < argc; i++) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      LOOM_CHECK(a.find('=') != std::string::npos, "eval: argument '%s': overrides look like --section.key=value (%s)",
                 a.c_str(), usage);
      overrides.push_back(a);
    } else {
      LOOM_CHECK(path.empty(), "eval: two folders given ('%s', '%s'); %s", path.c_str(), a.c_str(), usage);
      path = a;
    }
  }
  LOOM_CHECK(!path.empty(), "eval: no run or checkpoint folder given; %s", usage);
  EvalReport r = run_eval(path, overrides);
  std::printf("%s\n", r.text.c_str());
  return 0;
}

}  // namespace loom
