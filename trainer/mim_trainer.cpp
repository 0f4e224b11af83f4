// mim_trainer.cpp: LatentMIM training on Fashion-MNIST or an image folder, with EMA target and
// a probe evaluation (see mim_trainer.h).
#include "trainer/mim_trainer.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>

#include "data/fashion_mnist.h"
#include "data/images.h"
#include "nn/mim.h"
#include "trainer/prefetch.h"

namespace loom {

double ridge_probe(const std::vector<float>& xtr, const std::vector<int32_t>& ytr, const std::vector<float>& xte,
                   const std::vector<int32_t>& yte, int d, int classes) {
  using M = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  int64_t n = int64_t(ytr.size()), m = int64_t(yte.size());
  M X = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(xtr.data(), n, d).cast<double>();
  M T = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(xte.data(), m, d).cast<double>();
  // standardize with the train statistics, append a bias column
  Eigen::RowVectorXd mu = X.colwise().mean();
  Eigen::RowVectorXd sd = ((X.rowwise() - mu).array().square().colwise().mean()).sqrt().max(1e-6);
  X = ((X.rowwise() - mu).array().rowwise() / sd.array()).matrix();
  T = ((T.rowwise() - mu).array().rowwise() / sd.array()).matrix();
  M Y = M::Constant(n, classes, -1.0 / classes);
  for (int64_t i = 0; i < n; i++) Y(i, ytr[size_t(i)]) += 1.0;
  M A = X.transpose() * X;
  A.diagonal().array() += 1e-3 * double(n);  // ridge: a small multiple of the sample count
  M W = A.ldlt().solve(X.transpose() * Y);
  Eigen::RowVectorXd b = Y.colwise().mean();  // X is centered: the bias is the mean target
  M P = (T * W).rowwise() + b;
  int64_t correct = 0;
  for (int64_t i = 0; i < m; i++) {
    Eigen::Index j;
    P.row(i).maxCoeff(&j);
    correct += int32_t(j) == yte[size_t(i)];
  }
  return double(correct) / double(std::max<int64_t>(m, 1));
}

double knn_probe(const std::vector<float>& xtr, const std::vector<int32_t>& ytr, const std::vector<float>& xte,
                 const std::vector<int32_t>& yte, int d, int classes, int k) {
  int64_t n = int64_t(ytr.size()), m = int64_t(yte.size());
  auto normed = [d](const std::vector<float>& x) {
    std::vector<float> o(x);
    for (size_t r = 0; r < o.size() / size_t(d); r++) {
      double s = 0;
      for (int j = 0; j < d; j++) s += double(o[r * d + j]) * o[r * d + j];
      float inv = float(1.0 / std::max(std::sqrt(s), 1e-12));
      for (int j = 0; j < d; j++) o[r * d + j] *= inv;
    }
    return o;
  };
  std::vector<float> a = normed(xtr), b = normed(xte);
  int64_t correct = 0;
#pragma omp parallel for reduction(+ : correct) schedule(dynamic, 16)
  for (int64_t i = 0; i < m; i++) {
    std::vector<std::pair<float, int>> sims(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; j++) {
      float s = 0;
      for (int t = 0; t < d; t++) s += b[size_t(i) * d + t] * a[size_t(j) * d + t];
      sims[size_t(j)] = {-s, ytr[size_t(j)]};
    }
    std::partial_sort(sims.begin(), sims.begin() + k, sims.end());
    std::vector<double> votes(size_t(classes), 0);
    for (int t = 0; t < k; t++) votes[size_t(sims[size_t(t)].second)] += std::exp(-sims[size_t(t)].first / 0.07);
    correct += int32_t(std::max_element(votes.begin(), votes.end()) - votes.begin()) == yte[size_t(i)];
  }
  return double(correct) / double(std::max<int64_t>(m, 1));
}

static MIMConfig mim_config_from(const Config& cfg) {
  MIMConfig c;
  c.vit = vit_config_from(cfg);
  c.pred_dim = cfg.get_int("model.pred_dim");
  c.pred_depth = cfg.get_int("model.pred_depth");
  c.pred_heads = cfg.get_int("model.pred_heads");
  c.mask_ratio = cfg.get_float("model.mask_ratio");
  c.tau = cfg.get_float("model.tau");
  c.ema = cfg.get_float("model.ema");
  c.contrastive = cfg.get_bool("model.contrastive");
  c.contrastive_weight = cfg.get_float("model.contrastive_weight");
  return c;
}

// Mean-pooled encoder features of every image (no grad), in batches.
static std::vector<float> encode_all(const ViT& enc, const ImageSet& s, const RunContext& ctx) {
  NoGradGuard ng;
  size_t px = size_t(s.c) * s.h * s.w;
  int B = 256, D = enc.cfg.dim;
  std::vector<float> out(size_t(s.n) * D);
  for (int i = 0; i < s.n; i += B) {
    int b = std::min(B, s.n - i);
    std::vector<float> img(s.pixels.begin() + long(i * px), s.pixels.begin() + long((i + b) * px));
    Tensor x = Tensor::from_vector(img, {b, s.c, s.h, s.w}).to(ctx.compute).to(ctx.device);
    auto f = mean_pool(enc.forward(x)).to_vector<float>();
    std::copy(f.begin(), f.end(), out.begin() + long(size_t(i) * D));
  }
  return out;
}

static double probe(const std::vector<float>& ftr, const ImageSet& tr, const std::vector<float>& fte, const ImageSet& te,
                    int d, const Config& cfg) {
  int classes = 1 + *std::max_element(tr.labels.begin(), tr.labels.end());
  if (cfg.get_str("eval.probe") == "knn") return knn_probe(ftr, tr.labels, fte, te.labels, d, classes, cfg.get_int("eval.knn_k"));
  return ridge_probe(ftr, tr.labels, fte, te.labels, d, classes);
}

int train_mim(const RunContext& ctx) {
  const Config& cfg = ctx.cfg;
  MIMConfig mc = mim_config_from(cfg);
  std::string ds = cfg.get_str("data.dataset");
  ImageSet train, test;
  int ntrain = cfg.get_int("data.train_samples"), nval = cfg.get_int("data.val_samples");
  if (ds == "fashion_mnist") {
    std::string dir = cfg.get_str("data.path").empty() ? "/usr/share/datasets/fashion-mnist" : cfg.get_str("data.path");
    train = load_fashion_mnist("train", dir, ntrain);
    test = load_fashion_mnist("test", dir, nval);
  } else if (ds == "image_folder") {
    DataStats st;
    ImageSet all = load_image_folder(cfg.get_str("data.path"), mc.vit.image_size, mc.vit.channels, &st);
    std::printf("%s\n", st.summary().c_str());
    int nv = std::min(nval, all.n / 5);
    size_t px = size_t(all.c) * all.h * all.w;
    train = all;
    test = all;
    train.n = all.n - nv;
    test.n = nv;
    train.pixels.resize(size_t(train.n) * px);
    train.labels.resize(size_t(train.n));
    test.pixels.assign(all.pixels.begin() + long(size_t(train.n) * px), all.pixels.end());
    test.labels.assign(all.labels.begin() + train.n, all.labels.end());
  } else if (ds == "synthetic") {  // SPEC §3 timing workload: random images, no probe
    Rng r(uint64_t(cfg.get_int64("data.seed")));
    train.n = 512;
    train.c = mc.vit.channels;
    train.h = train.w = mc.vit.image_size;
    train.pixels.resize(size_t(train.n) * train.c * train.h * train.w);
    for (auto& x : train.pixels) x = float(r.normal());
    train.labels.assign(size_t(train.n), 0);
    test = train;
    test.n = 0;
    test.pixels.clear();
    test.labels.clear();
  } else {
    LOOM_CHECK(false, "%s: data.dataset = %s is not an image dataset for vit_mim (fashion_mnist, image_folder, synthetic)",
               cfg.source().c_str(), ds.c_str());
  }
  LOOM_CHECK(train.h == mc.vit.image_size && train.w == mc.vit.image_size && train.c == mc.vit.channels,
             "%s: images are %dx%dx%d but the model expects %dx%dx%d (model.channels, model.image_size)",
             cfg.source().c_str(), train.c, train.h, train.w, mc.vit.channels, mc.vit.image_size, mc.vit.image_size);
  std::printf("%d training images, %d for the probe's test split\n", train.n, test.n);

  Rng init_rng(ctx.seed);
  LatentMIM m(mc, Init{DType::F32, ctx.device, &init_rng});
  freeze_prefixes(m, cfg.get_str("train.freeze"));
  m.target.requires_grad_(false);
  std::printf("%s\n", describe_params(m).c_str());
  OptimConfig oc = optim_config_from(cfg);
  Optimizer opt(param_groups_from(m, cfg), oc, ctx.compute, ctx.device);
  cast_frozen(m, ctx.compute);
  EMA ema(m.target, opt, "encoder.");

  int probe_n = std::min(train.n, 10000);  // the probe trains on the first 10k training images
  ImageSet probe_tr = train;
  probe_tr.n = probe_n;
  probe_tr.pixels.resize(size_t(probe_n) * train.c * train.h * train.w);
  probe_tr.labels.resize(size_t(probe_n));
  int64_t steps = cfg.get_int64("train.steps"), start = 0;
  std::string ck = find_checkpoint(ctx, cfg.get_str("train.resume"));
  TrainerState st;
  std::map<std::string, double> baselines;
  if (!ck.empty()) {
    st = load_checkpoint(ck, m, opt);
    start = st.step;
    baselines = st.extra;
    std::printf("resumed from %s at step %lld\n", ck.c_str(), (long long)start);
  } else if (!cfg.get_bool("train.dry_run") && test.n > 0) {
    // the two baselines the trained encoder must beat: raw pixels, and this random encoder
    int d = train.c * train.h * train.w;
    baselines["probe_raw_pixels"] = probe(probe_tr.pixels, probe_tr, test.pixels, test, d, cfg);
    baselines["probe_random_init"] = probe(encode_all(m.encoder, probe_tr, ctx), probe_tr, encode_all(m.encoder, test, ctx),
                                           test, mc.vit.dim, cfg);
    std::printf("%s probe: raw pixels %.2f%%, random-init encoder %.2f%%\n", cfg.get_str("eval.probe").c_str(),
                100 * baselines["probe_raw_pixels"], 100 * baselines["probe_random_init"]);
  }

  int B = cfg.get_int("train.batch_size"), nviews = mc.contrastive ? 2 : 1;
  size_t px = size_t(train.c) * train.h * train.w;
  struct Batch {
    std::vector<float> images;
    std::vector<std::vector<int32_t>> keep, masked;
  };
  int N = mc.vit.num_patches(), K = mc.keep_count();
  auto make = [&](int64_t s) {
    Rng r(ctx.seed * 7919ull + uint64_t(s) * 104729ull + 17);
    Batch b;
    b.images.resize(size_t(B) * px);
    for (int i = 0; i < B; i++) {
      int idx = int(r.randint(train.n));
      std::copy(train.pixels.begin() + long(size_t(idx) * px), train.pixels.begin() + long(size_t(idx + 1) * px),
                b.images.begin() + long(size_t(i) * px));
    }
    for (int v = 0; v < nviews; v++) {
      std::vector<int32_t> keep(size_t(B) * K), masked(size_t(B) * (N - K));
      for (int i = 0; i < B; i++) {
        auto p = r.permutation(N);
        std::copy(p.begin(), p.begin() + K, keep.begin() + long(size_t(i) * K));
        std::copy(p.begin() + K, p.end(), masked.begin() + long(size_t(i) * (N - K)));
      }
      b.keep.push_back(keep);
      b.masked.push_back(masked);
    }
    return b;
  };
  // FLOPs of a step (SPEC §3): encoder 3x on K patches, target 1x on N, predictor 3x on N
  auto vit_tok = [](const ViTConfig& c, int n) {
    return 2.0 * c.depth * (4.0 * c.dim * c.dim + 2.0 * c.hidden() * c.dim) + 4.0 * c.depth * n * c.dim;
  };
  ViTConfig pc;
  pc.dim = mc.pred_dim;
  pc.depth = mc.pred_depth;
  pc.heads = mc.pred_heads;
  double step_flops = nviews * double(B) * (3.0 * K * vit_tok(mc.vit, K) + N * vit_tok(mc.vit, N) + 3.0 * N * vit_tok(pc, N));

  auto run_step = [&](const Batch& b) {
    Tensor imgs = Tensor::from_vector(b.images, {B, train.c, train.h, train.w}).to(ctx.compute).to(ctx.device);
    std::vector<MIMView> views;
    for (int v = 0; v < nviews; v++)
      views.push_back({imgs, Tensor::from_vector(b.keep[size_t(v)], {B, K}, ctx.device),
                       Tensor::from_vector(b.masked[size_t(v)], {B, N - K}, ctx.device)});
    Tensor loss = m.forward(views);
    backward(loss);
    return loss.item();
  };
  if (cfg.get_bool("train.dry_run")) {
    double t0 = now_ms();
    double l = run_step(make(0));
    std::printf("dry run: one step, loss %.4f, %.1f ms, %s\n", l, now_ms() - t0, describe_params(m).c_str());
    return 0;
  }

  RunLog log(ctx, start > 0);
  NanGuard guard(cfg.get_int("train.max_nan_skips"));
  Prefetcher<Batch> loader(make, start, steps, std::max(1, cfg.get_int("data.workers")), 4);
  int64_t eval_every = cfg.get_int64("train.eval_every"), save_every = cfg.get_int64("train.save_every");
  profile_enable(cfg.get_bool("train.profile"));
  for (int64_t s = start; s < steps; s++) {
    double t0 = now_ms(), w0 = now_ms();
    Batch b = loader.next();
    double wait = now_ms() - w0;
    profile_add("data (waiting for the loader)", wait);
    profile_mark();
    double loss = run_step(b);
    double o0 = now_ms();
    double norm = opt.clip_grad_norm(cfg.get_float("train.grad_clip")).item();
    double lr = lr_at(s, steps, cfg.get_int64("train.warmup_steps"), cfg.get_float("train.lr"),
                      cfg.get_float("train.min_lr"), cfg.get_str("train.schedule"));
    bool ok = guard.ok(s + 1, loss, norm);
    if (ok) {
      opt.step(lr);
      ema.update(mc.ema);
    }
    opt.zero_grad();
    if (ctx.device == Device::CUDA) cuda::synchronize();
    profile_add("optimizer (clip, AdamW, EMA, zero)", now_ms() - o0);
    double ms = now_ms() - t0;
    double mem = ctx.device == Device::CUDA ? cuda::bytes_in_use() / 1048576.0 : cpu_bytes_in_use() / 1048576.0;
    log.step({s + 1, steps, loss, lr, norm, ms, wait, nviews * B / (ms / 1e3), "img/s",
              ctx.device == Device::CUDA ? step_flops / (ms / 1e3) / 989e12 : -1, mem, !ok});
    bool last = s + 1 == steps;
    bool stop = cfg.get_int64("train.stop_at") > 0 && s + 1 >= cfg.get_int64("train.stop_at") && !last;
    if (((eval_every > 0 && (s + 1) % eval_every == 0) || last) && test.n > 0) {
      double acc = probe(encode_all(m.encoder, probe_tr, ctx), probe_tr, encode_all(m.encoder, test, ctx), test,
                         mc.vit.dim, cfg);
      std::map<std::string, double> v = baselines;
      v["step"] = double(s + 1);
      v["probe"] = acc;
      char txt[256];
      std::snprintf(txt, sizeof txt, "eval at step %lld: %s probe %.2f%% (raw pixels %.2f%%, random-init encoder %.2f%%)",
                    (long long)(s + 1), cfg.get_str("eval.probe").c_str(), 100 * acc, 100 * baselines["probe_raw_pixels"],
                    100 * baselines["probe_random_init"]);
      log.event("eval", v, txt);
    }
    if ((save_every > 0 && (s + 1) % save_every == 0) || last || stop) {
      st.step = s + 1;
      st.extra = baselines;
      save_checkpoint(ctx, m, opt, st);
    }
    if (stop) {
      std::printf("stopped at step %lld (train.stop_at); resume with --train.resume=latest\n", (long long)(s + 1));
      break;
    }
  }
  log.finish();
  if (cfg.get_bool("train.profile")) std::printf("%s", profile_report(steps - start).c_str());
  return 0;
}

}  // namespace loom
