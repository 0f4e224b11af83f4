// config_rules.cpp: the constraints of every config key (ranges, divisibility, combinations),
// checked once when a config is resolved (Config::load, after the overrides), before any
// data, model or run folder is made. Each broken rule is one line naming the key, its value
// and the rule:
//
//   configs/vlm_sft.cfg (with overrides): 2 config errors:
//     train.batch_size = 0: must be >= 1
//     model.image_size = 30: must be a multiple of model.patch_size = 4 (the ViT's patch grid)
//
// The upper bounds are far above any run this code can train; they keep every size product
// the trainers form (tokens per step, pixels per batch, embedding tables) inside int32/int64.
#include <sys/stat.h>

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "trainer/config.h"

namespace loom {

namespace {

struct Rules {
  const Config& c;
  std::vector<std::string> errors;

  int64_t i(const char* k) const { return c.get_int64(k); }
  double f(const char* k) const { return c.get_float(k); }
  std::string s(const char* k) const { return c.get_str(k); }

  static std::string num(double v) {
    std::ostringstream o;
    o << v;
    return o.str();
  }
  void bad(const std::string& key, const std::string& value, const std::string& rule) {
    errors.push_back(key + " = " + (value.empty() ? "\"\"" : value) + ": " + rule);
  }
  // lo <= value <= hi; false (and an error) otherwise
  bool int_range(const char* k, int64_t lo, int64_t hi) {
    int64_t v = i(k);
    if (v >= lo && v <= hi) return true;
    if (v < lo) bad(k, std::to_string(v), "must be >= " + std::to_string(lo));
    else bad(k, std::to_string(v), "must be <= " + std::to_string(hi));
    return false;
  }
  // lo < value (open) or lo <= value (closed), and value <= hi (or < hi when hi_open)
  bool float_range(const char* k, double lo, bool lo_open, double hi, bool hi_open) {
    double v = f(k);
    bool ok = (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
    if (!ok) {
      std::string rule = "must be in " + std::string(lo_open ? "(" : "[") + num(lo) + ", " +
                         (std::isinf(hi) ? "inf" : num(hi)) + (hi_open ? ")" : "]");
      bad(k, num(v), rule);
    }
    return ok;
  }
  void multiple(const char* k, const char* of, const std::string& why) {
    int64_t a = i(k), b = i(of);
    if (b > 0 && a % b != 0)
      bad(k, std::to_string(a), "must be a multiple of " + std::string(of) + " = " + std::to_string(b) + " (" + why + ")");
  }
  void path_exists(const char* k, bool want_file) {
    std::string p = s(k);
    if (p.empty()) return;
    struct stat st;
    if (::stat(p.c_str(), &st) != 0) bad(k, p, "no such file or folder");
    else if (want_file && !S_ISREG(st.st_mode)) bad(k, p, "must be a file");
  }
};

constexpr int64_t kMaxDim = 1 << 16;      // widths, heads, hidden sizes
constexpr int64_t kMaxCount = 1 << 30;    // steps, samples, intervals
constexpr int64_t kMaxImage = 1 << 13;    // image side in pixels

}  // namespace

void validate_config(const Config& c) {
  Rules r{c, {}};
  std::string kind = r.s("model.kind"), trainer = r.s("train.trainer"), ds = r.s("data.dataset");
  bool vlm = kind == "vlm", mim = kind == "mim";

  // ---------------------------------------------------------------- model: the ViT
  bool img_ok = r.int_range("model.image_size", 1, kMaxImage);
  bool patch_ok = r.int_range("model.patch_size", 1, kMaxImage);
  if (img_ok && patch_ok) {
    if (r.i("model.patch_size") > r.i("model.image_size"))
      r.bad("model.patch_size", std::to_string(r.i("model.patch_size")),
            "must be <= model.image_size = " + std::to_string(r.i("model.image_size")));
    else r.multiple("model.image_size", "model.patch_size", "the ViT's patch grid");
  }
  int64_t ch = r.i("model.channels");
  const bool ch_ok = ch == 1 || ch == 3;  // the size products below use it only when it is
  if (!ch_ok) r.bad("model.channels", std::to_string(ch), "must be 1 (grey) or 3 (RGB)");
  bool vit_ok = r.int_range("model.vit_dim", 1, kMaxDim) & r.int_range("model.vit_heads", 1, kMaxDim);
  r.int_range("model.vit_depth", 1, 1024);
  r.int_range("model.vit_mlp_ratio", 1, 64);
  if (vit_ok) r.multiple("model.vit_dim", "model.vit_heads", "the head width is vit_dim / vit_heads");
  if (vit_ok && r.s("model.pos_init") == "sincos" && r.i("model.vit_dim") % 4 != 0)
    r.bad("model.vit_dim", std::to_string(r.i("model.vit_dim")),
          "must be a multiple of 4 with model.pos_init = sincos (sine and cosine of the row and of the column)");
  // the patch grid side, 0 when the rules above already failed
  int64_t grid = img_ok && patch_ok && r.i("model.patch_size") <= r.i("model.image_size") &&
                         r.i("model.image_size") % r.i("model.patch_size") == 0
                     ? r.i("model.image_size") / r.i("model.patch_size")
                     : 0;

  // ---------------------------------------------------------------- model: the LM (VLM)
  r.int_range("model.lm_vocab", 0, 1 << 24);
  bool lm_ok = r.int_range("model.lm_dim", 1, kMaxDim) & r.int_range("model.lm_heads", 1, kMaxDim) &
               r.int_range("model.lm_kv_heads", 1, kMaxDim);
  r.int_range("model.lm_depth", 1, 1024);
  r.int_range("model.lm_hidden", 1, 1 << 18);
  r.float_range("model.rope_theta", 0, true, INFINITY, false);
  if (lm_ok) {
    r.multiple("model.lm_dim", "model.lm_heads", "the head width is lm_dim / lm_heads");
    r.multiple("model.lm_heads", "model.lm_kv_heads", "grouped-query attention shares each kv head among lm_heads / lm_kv_heads query heads");
    int64_t hd = r.i("model.lm_dim") / r.i("model.lm_heads");
    if (r.i("model.lm_dim") % r.i("model.lm_heads") == 0 && hd % 2 != 0)
      r.bad("model.lm_dim", std::to_string(r.i("model.lm_dim")),
            "lm_dim / lm_heads = " + std::to_string(hd) + " must be even (RoPE rotates pairs of dimensions)");
  }
  bool shuffle_ok = r.int_range("model.shuffle", 1, 64);
  if (vlm && shuffle_ok && grid > 0 && grid % r.i("model.shuffle") != 0)
    r.bad("model.shuffle", std::to_string(r.i("model.shuffle")),
          "must divide the patch grid side model.image_size / model.patch_size = " + std::to_string(r.i("model.image_size")) +
              " / " + std::to_string(r.i("model.patch_size")) + " = " + std::to_string(grid) + " (pixel shuffle)");

  // ---------------------------------------------------------------- model: MIM
  bool pred_ok = r.int_range("model.pred_dim", 1, kMaxDim) & r.int_range("model.pred_heads", 1, kMaxDim);
  r.int_range("model.pred_depth", 1, 1024);
  if (mim && pred_ok) r.multiple("model.pred_dim", "model.pred_heads", "the head width is pred_dim / pred_heads");
  if (mim && pred_ok && r.s("model.pos_init") == "sincos" && r.i("model.pred_dim") % 4 != 0)
    r.bad("model.pred_dim", std::to_string(r.i("model.pred_dim")),
          "must be a multiple of 4 with model.pos_init = sincos (the predictor's positions use the same table)");
  if (r.float_range("model.mask_ratio", 0, false, 1, true) && mim && grid > 0) {
    int64_t n = grid * grid, keep = int64_t(std::nearbyint(double(n) * (1.0 - r.f("model.mask_ratio"))));
    if (keep < 1 || keep >= n)
      r.bad("model.mask_ratio", Rules::num(r.f("model.mask_ratio")),
            "keeps round(" + std::to_string(n) + " patches x (1 - mask_ratio)) = " + std::to_string(keep) +
                "; at least one patch must be kept and one masked");
  }
  r.float_range("model.tau", 0, true, INFINITY, false);
  r.float_range("model.ema", 0, false, 1, false);
  r.float_range("model.contrastive_weight", 0, false, INFINITY, false);
  r.path_exists("model.lm_init", false);
  r.path_exists("model.vision_init", false);
  if (mim && !r.s("model.lm_init").empty()) r.bad("model.lm_init", r.s("model.lm_init"), "only a VLM (model.kind = vlm) has an LM");
  r.path_exists("model.init", false);
  if (mim && !r.s("model.init").empty()) r.bad("model.init", r.s("model.init"), "continues a VLM (model.kind = vlm); a MIM encoder goes in a VLM's model.vision_init");
  for (const char* part : {"model.lm_init", "model.vision_init"})
    if (!r.s("model.init").empty() && !r.s(part).empty())
      r.bad(part, r.s(part), "model.init = " + r.s("model.init") + " already gives every part; leave " + part + " empty");

  // ---------------------------------------------------------------- combinations
  bool trainer_vlm = trainer == "vlm_sft" || trainer == "vlm_pretrain";
  if (trainer_vlm && !vlm) r.bad("train.trainer", trainer, "needs model.kind = vlm (model.kind is " + kind + ")");
  if (trainer == "vit_mim" && !mim) r.bad("train.trainer", trainer, "needs model.kind = mim (model.kind is " + kind + ")");
  if (vlm && ds == "image_folder") r.bad("data.dataset", ds, "is a MIM dataset (VLM: shapes, fashion_mnist, jsonl, synthetic)");
  if (mim && (ds == "shapes" || ds == "jsonl"))
    r.bad("data.dataset", ds, "is a VLM dataset (MIM: fashion_mnist, image_folder, synthetic)");
  if ((ds == "jsonl" || ds == "image_folder") && r.s("data.path").empty())
    r.bad("data.path", "", "data.dataset = " + ds + " needs a path");
  if (r.s("data.task") == "caption" && !(ds == "shapes" && vlm))
    r.bad("data.task", "caption", "captions are generated by the shapes dataset (data.dataset = shapes, model.kind = vlm); "
          "data.dataset = " + ds);
  if (ds == "shapes" && vlm && ch != 3) r.bad("model.channels", std::to_string(ch), "the shapes dataset is RGB: must be 3");
  if (ds == "fashion_mnist" && (ch != 1 || r.i("model.image_size") != 28))
    r.bad(ch != 1 ? "model.channels" : "model.image_size", std::to_string(ch != 1 ? ch : r.i("model.image_size")),
          "fashion_mnist images are 1x28x28: model.channels = 1 and model.image_size = 28");
  if (c.get_str("train.dtype") == "bf16" && c.get_str("train.device") == "cpu")
    r.bad("train.dtype", "bf16", "needs train.device = cuda or auto (the CPU kernels run f32/f64)");
  if (c.get_str("train.dtype") == "fp16" && c.get_str("train.device") == "cpu")
    r.bad("train.dtype", "fp16", "needs train.device = cuda or auto (the CPU kernels run f32/f64)");

  // ---------------------------------------------------------------- data
  r.path_exists("data.path", false);
  r.path_exists("data.val_path", false);
  r.path_exists("data.tokenizer", true);
  if (vlm && r.s("data.tokenizer").empty())
    r.int_range("data.vocab_size", 260, 1 << 20);  // 4 special tokens + 256 bytes at least
  r.int_range("data.train_samples", 0, kMaxCount);
  r.int_range("data.val_samples", 0, kMaxCount);
  if (ds == "shapes" && vlm && r.i("data.train_samples") < 1)
    r.bad("data.train_samples", std::to_string(r.i("data.train_samples")), "must be >= 1 (shapes generates that many)");
  bool row_ok = r.int_range("data.pack_max_length", 1, 1 << 20);
  if (vlm && row_ok && grid > 0 && shuffle_ok && grid % r.i("model.shuffle") == 0) {
    int64_t it = (grid / r.i("model.shuffle")) * (grid / r.i("model.shuffle"));
    if (r.i("data.pack_max_length") <= it)
      r.bad("data.pack_max_length", std::to_string(r.i("data.pack_max_length")),
            "must exceed the " + std::to_string(it) + " image tokens of one sample ((image_size / patch_size / shuffle)^2)");
  }
  r.int_range("data.workers", 0, 256);
  bool smin = r.int_range("data.synth_min_len", 1, 1 << 20), smax = r.int_range("data.synth_max_len", 1, 1 << 20);
  r.int_range("data.synth_median_len", 1, 1 << 20);
  r.int_range("data.synth_prompt_len", 0, 1 << 20);
  r.float_range("data.synth_sigma", 0, false, 10, false);
  if (smin && smax && r.i("data.synth_max_len") < r.i("data.synth_min_len"))
    r.bad("data.synth_max_len", std::to_string(r.i("data.synth_max_len")),
          "must be >= data.synth_min_len = " + std::to_string(r.i("data.synth_min_len")));
  if (ds == "synthetic" && vlm && r.i("model.lm_vocab") > 0 && r.i("model.lm_vocab") <= 4)
    r.bad("model.lm_vocab", std::to_string(r.i("model.lm_vocab")), "synthetic text needs ids past the 4 special tokens");
  r.int_range("data.max_image_pixels", 1, int64_t(1) << 32);
  r.path_exists("data.synth_rows", true);
  if (!r.s("data.synth_rows").empty() && !(ds == "synthetic" && vlm))
    r.bad("data.synth_rows", r.s("data.synth_rows"), "gives the rows of synthetic VLM data: needs data.dataset = synthetic and model.kind = vlm");

  // ---------------------------------------------------------------- train
  r.int_range("train.steps", 1, kMaxCount);
  bool bs_ok = r.int_range("train.batch_size", 1, 1 << 20);
  bool acc_ok = r.int_range("train.grad_accum", 1, 1 << 16);
  if (bs_ok && acc_ok && row_ok && vlm && r.i("train.batch_size") * r.i("data.pack_max_length") > (int64_t(1) << 31) - 1)
    r.bad("train.batch_size", std::to_string(r.i("train.batch_size")),
          "batch_size x data.pack_max_length = " + std::to_string(r.i("train.batch_size") * r.i("data.pack_max_length")) +
              " tokens per step must fit int32 (cu_seqlens)");
  if (bs_ok && img_ok && ch_ok && r.i("train.batch_size") * ch * r.i("model.image_size") * r.i("model.image_size") > (int64_t(1) << 40))
    r.bad("train.batch_size", std::to_string(r.i("train.batch_size")), "batch_size x channels x image_size^2 exceeds 2^40 pixels");
  if (r.float_range("train.lr", 0, true, INFINITY, false) && r.float_range("train.min_lr", 0, false, INFINITY, false) &&
      r.f("train.min_lr") > r.f("train.lr"))
    r.bad("train.min_lr", Rules::num(r.f("train.min_lr")), "must be <= train.lr = " + Rules::num(r.f("train.lr")));
  r.int_range("train.warmup_steps", 0, kMaxCount);  // longer than train.steps: the run ends inside the warmup
  r.float_range("train.weight_decay", 0, false, 1e3, false);
  r.float_range("train.beta1", 0, false, 1, true);
  r.float_range("train.beta2", 0, false, 1, true);
  r.float_range("train.eps", 0, true, 1, false);
  r.float_range("train.grad_clip", 0, false, INFINITY, false);
  r.float_range("train.momentum", 0, false, 1, true);
  r.int_range("train.log_every", 1, kMaxCount);
  r.int_range("train.side_weight_grads_lag", 1, 1 << 20);
  r.int_range("train.eval_every", 0, kMaxCount);
  r.int_range("train.save_every", 0, kMaxCount);
  r.int_range("train.keep_last", 1, 1 << 20);
  if (r.s("train.out_dir").empty()) r.bad("train.out_dir", "", "must name a folder");
  r.float_range("train.lr_scale_embeddings", 0, false, 1e6, false);
  r.float_range("train.lr_scale_projector", 0, false, 1e6, false);
  r.float_range("train.lr_scale_norms", 0, false, 1e6, false);
  double ewd = r.f("train.embeddings_weight_decay");
  if (ewd != -1 && !(ewd >= 0 && ewd <= 1e3))
    r.bad("train.embeddings_weight_decay", Rules::num(ewd), "must be -1 (train.weight_decay) or in [0, 1000]");
  r.int_range("train.max_nan_skips", 1, 1 << 20);
  r.float_range("train.loss_scale", 1, false, 16777216, false);
  r.int_range("train.loss_scale_window", 1, 1 << 30);
  r.int_range("train.stop_at", 0, kMaxCount);
  r.int_range("train.gpus", 0, 1024);  // 0 and 1: one process
  r.int_range("train.procs", 0, 1024);
  r.float_range("train.dist_bucket_mb", 0, false, 1e6, false);  // 0: one average after the backward
  if (r.s("train.dist_infonce") == "global" && !(r.s("model.kind") == "mim" && r.c.get_bool("model.contrastive")))
    r.bad("train.dist_infonce", "global", "gathers the contrastive MIM's InfoNCE features: needs model.kind = mim and "
          "model.contrastive = true");
  r.int_range("train.zero_stage", 0, 1);
  r.float_range("train.dist_join_timeout", 0, true, 1e6, false);
  r.float_range("train.dist_timeout", 0, true, 1e6, false);

  // ---------------------------------------------------------------- eval
  r.int_range("eval.samples", 0, kMaxCount);
  r.int_range("eval.max_new_tokens", 1, 1 << 16);
  r.int_range("eval.knn_k", 1, 1 << 16);

  if (r.errors.empty()) return;
  std::string src = c.source().empty() ? "config" : c.source();
  std::string msg = src + ": " + std::to_string(r.errors.size()) + " config error" + (r.errors.size() > 1 ? "s" : "") + ":";
  for (auto& e : r.errors) msg += "\n  " + e;
  throw std::runtime_error(msg);
}

}  // namespace loom
