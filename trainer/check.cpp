// check.cpp: fixture checks against PyTorch / HF goldens (see check.h).
#include "trainer/check.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sys/stat.h>

#include "nn/mim.h"
#include "nn/vlm.h"

namespace loom {

using json = nlohmann::json;

// Relative error in f64 for f64 runs (PyTorch's float64 goldens: only summation order
// differs). f32 on CUDA: ~1e-7 per op rounding compounded through a few layers and
// cancellations in small gradients; 1e-4 relative in norm leaves a 10x margin over what
// the f32 CPU path shows.
static constexpr double kTolF64 = 1e-6, kTolF32 = 1e-4;
// --train.attention=cudnn: cuDNN's fused attention is bf16, so the f32 model's attention runs
// on bf16-rounded q, k, v (and dout, out) with fp32 accumulation: the bf16-operand band.
static constexpr double kTolBf16Attention = 2e-2;

CheckRow make_row(const std::string& name, const Tensor& got, const Tensor& ref) {
  auto g = got.to_vector<double>(), r = ref.to_vector<double>();
  LOOM_CHECK(g.size() == r.size(), "%s: %zu values, reference has %zu", name.c_str(), g.size(), r.size());
  double num = 0, den = 0, max_abs = 0;
  for (size_t i = 0; i < g.size(); i++) {
    num += (g[i] - r[i]) * (g[i] - r[i]);
    den += r[i] * r[i];
    double e = std::fabs(g[i] - r[i]);
    max_abs = std::isnan(e) ? INFINITY : std::max(max_abs, e);
  }
  CheckRow row{name, (long long)g.size(), std::sqrt(num), std::sqrt(den)};
  row.max_abs = max_abs;
  return row;
}

// Relative error ||got - ref|| / ||ref||. A reference gradient more than 1e6 times smaller than
// the largest one is analytically zero (e.g. a key bias: softmax ignores a per-row shift) and
// holds only the reference's rounding noise; it is measured against the largest gradient norm.
static void finalize_rows(std::vector<CheckRow>& rows) {
  double largest = 0;
  for (auto& r : rows) largest = std::max(largest, r.ref_norm);
  for (auto& r : rows) {
    r.vs_largest = r.ref_norm < 1e-6 * largest;
    double den = r.vs_largest ? largest : r.ref_norm;
    r.rel_err = den > 0 ? r.err_norm / den : r.err_norm;
  }
}

static json meta_json(const SafeTensors& st, const std::string& key) {
  auto it = st.metadata.find(key);
  LOOM_CHECK(it != st.metadata.end(), "%s: metadata has no '%s'", st.path.c_str(), key.c_str());
  try {
    return json::parse(it->second);
  } catch (const std::exception& e) {
    LOOM_CHECK(false, "%s: metadata '%s' is not JSON: %s", st.path.c_str(), key.c_str(), e.what());
  }
}

// The numbers of a fixture's metadata, each checked with the file and the key in the error: an
// integer must be a JSON integer in [lo, hi] (a float past int's range would convert with
// undefined behaviour, a string would surface as nlohmann's error without the file), a real a
// finite number. `where`: the file and the metadata entry.
static int meta_int_value(const json& v, const std::string& where, const std::string& key, int64_t lo, int64_t hi) {
  bool ok = v.is_number_integer();
  if (ok && v.is_number_unsigned()) ok = v.get<uint64_t>() <= uint64_t(hi) && int64_t(v.get<uint64_t>()) >= lo;
  else if (ok) ok = v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
  LOOM_CHECK(ok, "%s: \"%s\" = %s, expected an integer in [%lld, %lld]", where.c_str(), key.c_str(), v.dump().c_str(),
             (long long)lo, (long long)hi);
  return int(v.get<int64_t>());
}
static int meta_int(const json& j, const std::string& where, const char* key, int dflt, int64_t lo = 1,
                    int64_t hi = 1 << 24) {
  return j.contains(key) ? meta_int_value(j[key], where, key, lo, hi) : dflt;
}
template <class R>
static R meta_real(const json& j, const std::string& where, const char* key, R dflt) {
  if (!j.contains(key)) return dflt;
  LOOM_CHECK(j[key].is_number() && std::isfinite(j[key].get<double>()), "%s: \"%s\" = %s, expected a finite number",
             where.c_str(), key, j[key].dump().c_str());
  return j[key].get<R>();
}

ViTConfig vit_from_json(const json& j, const std::string& where) {
  ViTConfig c;
  c.image_size = meta_int(j, where, "image_size", c.image_size);
  c.patch_size = meta_int(j, where, "patch_size", c.patch_size);
  c.channels = meta_int(j, where, "channels", c.channels);
  c.dim = meta_int(j, where, "dim", c.dim);
  c.depth = meta_int(j, where, "depth", c.depth);
  c.heads = meta_int(j, where, "heads", c.heads);
  c.mlp_ratio = meta_int(j, where, "mlp_ratio", c.mlp_ratio);
  c.eps = meta_real(j, where, "eps", c.eps);
  return c;
}

LMConfig lm_from_json(const json& j, const std::string& where) {
  LMConfig c;
  c.vocab = meta_int(j, where, "vocab", c.vocab);
  c.dim = meta_int(j, where, "dim", c.dim);
  c.depth = meta_int(j, where, "depth", c.depth);
  c.heads = meta_int(j, where, "heads", c.heads);
  c.kv_heads = meta_int(j, where, "kv_heads", c.kv_heads);
  c.hidden = meta_int(j, where, "hidden", c.hidden);
  c.rope_theta = meta_real(j, where, "rope_theta", c.rope_theta);
  c.eps = meta_real(j, where, "eps", c.eps);
  return c;
}

// "param.x.y" -> {"x.y": tensor}
static std::map<std::string, Tensor> with_prefix(const SafeTensors& st, const std::string& prefix) {
  std::map<std::string, Tensor> m;
  for (auto& [k, v] : st.tensors)
    if (k.rfind(prefix, 0) == 0) m[k.substr(prefix.size())] = v;
  return m;
}

static Tensor index_input(const SafeTensors& st, const std::string& name, Device dev) {
  return st.at(name).to(DType::I32).to(dev);
}

static void compare_grads(Module& m, const SafeTensors& st, CheckResult& r) {
  for (auto& [name, t] : m.named_parameters()) {
    std::string key = "grad." + name;
    if (!st.has(key)) continue;  // no-grad parameters (the EMA target)
    Tensor g = t->grad().defined() ? t->grad() : Tensor::zeros_like(*t);
    r.rows.push_back(make_row(name, g, st.at(key)));
  }
  for (auto& [k, v] : st.tensors)
    if (k.rfind("grad.", 0) == 0) {
      bool found = false;
      for (auto& row : r.rows) found |= "grad." + row.name == k;
      LOOM_CHECK(found, "%s: gradient '%s' has no parameter in the model", st.path.c_str(), k.c_str());
    }
}

static CheckResult check_mim(const SafeTensors& st, Device dev, DType dt) {
  json c = meta_json(st, "config");
  const std::string where = st.path + ": metadata 'config'";
  LOOM_CHECK(c.is_object() && c.contains("vit") && c["vit"].is_object(), "%s: expected an object with \"vit\"",
             where.c_str());
  MIMConfig mc;
  mc.vit = vit_from_json(c["vit"], where + ".vit");
  mc.pred_dim = meta_int(c, where, "pred_dim", mc.pred_dim);
  mc.pred_depth = meta_int(c, where, "pred_depth", mc.pred_depth);
  mc.pred_heads = meta_int(c, where, "pred_heads", mc.pred_heads);
  mc.mask_ratio = meta_real(c, where, "mask_ratio", mc.mask_ratio);
  mc.tau = meta_real(c, where, "tau", mc.tau);
  mc.ema = meta_real(c, where, "ema", mc.ema);
  LOOM_CHECK(!c.contains("contrastive") || c["contrastive"].is_boolean(), "%s: \"contrastive\" must be true or false",
             where.c_str());
  mc.contrastive = c.value("contrastive", mc.contrastive);
  mc.contrastive_weight = meta_real(c, where, "contrastive_weight", mc.contrastive_weight);
  Rng rng(0);
  LatentMIM m(mc, Init{dt, dev, &rng});
  m.load_state_dict(with_prefix(st, "param."), st.path);
  m.target.requires_grad_(false);
  std::vector<MIMView> views;
  for (int i = 0; st.has("input.view" + std::to_string(i)); i++) {
    std::string s = std::to_string(i);
    views.push_back({st.at("input.view" + s).to(dt).to(dev), index_input(st, "input.keep" + s, dev),
                     index_input(st, "input.masked" + s, dev)});
  }
  Tensor loss = m.forward(views);
  backward(loss);
  CheckResult r;
  r.kind = "mim";
  r.rows.push_back(make_row("loss", loss, st.at("output.loss")));
  compare_grads(m, st, r);
  return r;
}

static CheckResult check_vlm(const SafeTensors& st, Device dev, DType dt) {
  VLMConfig vc;
  const json vit = meta_json(st, "vit"), lm = meta_json(st, "lm");
  LOOM_CHECK(vit.is_object() && lm.is_object(), "%s: metadata 'vit' and 'lm' must be JSON objects", st.path.c_str());
  vc.vit = vit_from_json(vit, st.path + ": metadata 'vit'");
  vc.lm = lm_from_json(lm, st.path + ": metadata 'lm'");
  vc.shuffle = meta_int_value(meta_json(st, "shuffle"), st.path + ": metadata", "shuffle", 1, 64);
  vc.image_token = meta_int_value(meta_json(st, "image_token"), st.path + ": metadata", "image_token", 0, 1 << 24);
  Rng rng(0);
  VLM m(vc, Init{dt, dev, &rng});
  m.load_state_dict(with_prefix(st, "param."), st.path);
  VLMBatch b;
  auto ids = st.at("input.ids").to_vector<int32_t>();
  std::vector<int32_t> img_pos;
  for (size_t i = 0; i < ids.size(); i++)
    if (ids[i] == vc.image_token) img_pos.push_back(int32_t(i));
  int64_t n = int64_t(ids.size());
  b.images = st.at("input.images").to(dt).to(dev);
  b.ids = Tensor::from_vector(ids, {n}, dev);
  b.pos = st.at("input.pos").to(DType::I32).reshape({n}).to(dev);
  b.targets = st.at("input.targets").to(DType::I32).reshape({n}).to(dev);
  b.image_positions = Tensor::from_vector(img_pos, {int64_t(img_pos.size())}, dev);
  // Segments: runs of one document inside a row (input.doc_id; padding is -1 and, as in the
  // reference's mask, attends only to itself: one segment per padding token). Without doc_id,
  // the fixture's cu_seqlens, with any tail as one more segment.
  std::vector<int32_t> cu{0};
  if (st.has("input.doc_id")) {
    Tensor doc = st.at("input.doc_id").to(DType::I32);
    auto dv = doc.to_vector<int32_t>();
    int64_t row = doc.dim() == 2 ? doc.size(1) : n;
    for (int64_t t = 1; t <= n; t++) {
      bool boundary = t == n || t % row == 0 || dv[size_t(t)] != dv[size_t(t - 1)] || dv[size_t(t)] < 0;
      if (boundary) cu.push_back(int32_t(t));
    }
  } else {
    cu = st.at("input.cu_seqlens").to_vector<int32_t>();
    if (!cu.empty() && cu.back() < n) cu.push_back(int32_t(n));
  }
  b.seq = SeqInfo::packed(cu, dev);
  // the rows with a target and their targets, as the loader's batches carry them (VLM::loss
  // then takes only those rows through the tied head)
  set_loss_rows(b, b.targets.to_vector<int32_t>(), dev);
  Tensor loss = m.loss(b);
  backward(loss);
  CheckResult r;
  r.kind = "vlm";
  r.rows.push_back(make_row("loss", loss, st.at("output.loss")));
  compare_grads(m, st, r);
  return r;
}

static bool is_dir(const std::string& p) {
  struct stat s;
  return stat(p.c_str(), &s) == 0 && S_ISDIR(s.st_mode);
}

CheckResult run_check(const std::string& path, const std::string& device) {
  LOOM_CHECK(device == "cpu" || device == "cuda", "--device must be cpu or cuda, got '%s'", device.c_str());
  Device dev = device == "cuda" ? Device::CUDA : Device::CPU;
  if (dev == Device::CUDA) LOOM_CHECK(cuda::available(), "--device cuda: no usable GPU (or built without CUDA)");
  DType dt = dev == Device::CUDA ? DType::F32 : DType::F64;
  CheckResult r;
  if (is_dir(path)) {
    r = check_hf_folder(path, int(dev), int(dt));
  } else {
    SafeTensors st = load_safetensors(path);
    if (st.metadata.count("config")) r = check_mim(st, dev, dt);
    else if (st.metadata.count("vit") && st.metadata.count("lm")) r = check_vlm(st, dev, dt);
    else LOOM_CHECK(false, "%s: not a MIM or VLM fixture (metadata needs 'config' or 'vit' + 'lm')", path.c_str());
  }
  finalize_rows(r.rows);
  r.tolerance = dt == DType::F64 ? kTolF64 : kTolF32;
  for (auto& row : r.rows) r.worst = std::max(r.worst, std::isnan(row.rel_err) ? INFINITY : row.rel_err);
  return r;
}

int check_command(int argc, char** argv) {
  std::string path, device = "cpu", attention = "loom";
  for (int i = 0; i < argc; i++) {
    std::string a = argv[i];
    if (a.rfind("--device=", 0) == 0) device = a.substr(9);
    else if (a == "--device" && i + 1 < argc) device = argv[++i];
    else if (a.rfind("--train.attention=", 0) == 0) attention = a.substr(18);
    else if (a == "--train.attention" && i + 1 < argc) attention = argv[++i];
    else if (a.rfind("--", 0) == 0) {
      std::fprintf(stderr, "check: unknown option %s (usage: ./train check FIXTURE [--device cpu|cuda] [--train.attention=auto|loom|cudnn])\n", a.c_str());
      return 2;
    } else path = a;
  }
  if (path.empty()) {
    std::fprintf(stderr, "usage: ./train check FIXTURE [--device cpu|cuda] [--train.attention=auto|loom|cudnn]\n"
                         "  FIXTURE: mim_*.safetensors, vlm_*.safetensors, or an HF folder with golden.safetensors\n");
    return 2;
  }
  LOOM_CHECK(attention == "auto" || attention == "loom" || attention == "cudnn",
             "--train.attention must be auto, loom or cudnn, got '%s'", attention.c_str());
  const bool cudnn = attention == "cudnn" && device == "cuda";
  if (device == "cuda")
    cuda::set_attention_backend(attention == "cudnn" ? cuda::AttentionBackend::Cudnn
                                : attention == "auto" ? cuda::AttentionBackend::Auto
                                                      : cuda::AttentionBackend::Loom);
  CheckResult r = run_check(path, device);
  if (cudnn) r.tolerance = kTolBf16Attention;
  std::printf("check %s (%s, %s on %s, attention %s)\n", path.c_str(), r.kind.c_str(), device == "cpu" ? "f64" : "f32",
              device.c_str(), cudnn ? "cudnn: bf16" : device == "cuda" ? attention.c_str() : "cpu reference");
  std::printf("%-56s %10s %12s %12s\n", "tensor", "numel", "rel err", "max abs");
  for (auto& row : r.rows)
    std::printf("%-56s %10lld %12.3e %12.3e%s%s\n", row.name.c_str(), row.numel, row.rel_err, row.max_abs,
                row.vs_largest ? "  (reference ~0: vs largest gradient)" : "", row.rel_err <= r.tolerance ? "" : "  FAIL");
  std::printf("worst %.3e, tolerance %.0e: %s\n", r.worst, r.tolerance, r.ok() ? "PASS" : "FAIL");
  return r.ok() ? 0 : 1;
}

}  // namespace loom
