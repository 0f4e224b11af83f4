// mim_trainer.cpp: LatentMIM training on Fashion-MNIST or an image folder, with EMA target and
// a probe evaluation (see mim_trainer.h).
#include "trainer/mim_trainer.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "data/fashion_mnist.h"
#include "data/images.h"
#include "kernels/cpu/parallel.h"
#include "nn/mim.h"
#include "trainer/distributed.h"
#include "trainer/prefetch.h"
#include "trainer/staging.h"
#include "trainer/step_log.h"

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
  std::vector<uint8_t> right(static_cast<size_t>(std::max<int64_t>(m, 0)));  // per test image, summed below
  cpu::parallel_for(m, [&](int64_t i) {
    std::vector<std::pair<float, int>> sims(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; j++) {
      float s = 0;
      for (int t = 0; t < d; t++) s += b[size_t(i) * d + t] * a[size_t(j) * d + t];
      sims[size_t(j)] = {-s, ytr[size_t(j)]};
    }
    std::partial_sort(sims.begin(), sims.begin() + k, sims.end());
    std::vector<double> votes(size_t(classes), 0);
    for (int t = 0; t < k; t++) votes[size_t(sims[size_t(t)].second)] += std::exp(-sims[size_t(t)].first / 0.07);
    right[size_t(i)] = int32_t(std::max_element(votes.begin(), votes.end()) - votes.begin()) == yte[size_t(i)];
  });
  int64_t correct = 0;
  for (uint8_t r : right) correct += r;
  return double(correct) / double(std::max<int64_t>(m, 1));
}

MIMConfig mim_config_from(const Config& cfg) {
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

MIMData load_mim_data(const Config& cfg, const ViTConfig& vit) {
  MIMData d;
  ImageSet& train = d.train;
  ImageSet& test = d.test;
  std::string ds = cfg.get_str("data.dataset");
  int ntrain = cfg.get_int("data.train_samples"), nval = cfg.get_int("data.val_samples");
  if (ds == "fashion_mnist") {
    std::string dir = cfg.get_str("data.path").empty() ? "/usr/share/datasets/fashion-mnist" : cfg.get_str("data.path");
    train = load_fashion_mnist("train", dir, ntrain);
    test = load_fashion_mnist("test", dir, nval);
  } else if (ds == "image_folder") {
    DataStats st;
    ImageSet all = load_image_folder(cfg.get_str("data.path"), vit.image_size, vit.channels, &st);
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
    train.c = vit.channels;
    train.h = train.w = vit.image_size;
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
  LOOM_CHECK(train.h == vit.image_size && train.w == vit.image_size && train.c == vit.channels,
             "%s: images are %dx%dx%d but the model expects %dx%dx%d (model.channels, model.image_size)",
             cfg.source().c_str(), train.c, train.h, train.w, vit.channels, vit.image_size, vit.image_size);
  std::printf("%d training images, %d for the probe's test split\n", train.n, test.n);
  int probe_n = std::min(train.n, 10000);  // the probe trains on the first 10k training images
  d.probe_train = train;
  d.probe_train.n = probe_n;
  d.probe_train.pixels.resize(size_t(probe_n) * train.c * train.h * train.w);
  d.probe_train.labels.resize(size_t(probe_n));
  return d;
}

EvalReport evaluate_mim(const ViT& encoder, const MIMData& d, const RunContext& ctx,
                        const std::map<std::string, double>& baselines, int64_t step) {
  const Config& cfg = ctx.cfg;
  double acc = probe(encode_all(encoder, d.probe_train, ctx), d.probe_train, encode_all(encoder, d.test, ctx), d.test,
                     encoder.cfg.dim, cfg);
  EvalReport r;
  r.metrics = baselines;
  r.metrics["step"] = double(step);
  r.metrics["probe"] = acc;
  auto base = [&](const char* k) { return baselines.count(k) ? baselines.at(k) : 0.0; };
  char txt[256];
  std::snprintf(txt, sizeof txt, "eval at step %lld: %s probe %.2f%% (raw pixels %.2f%%, random-init encoder %.2f%%)",
                (long long)step, cfg.get_str("eval.probe").c_str(), 100 * acc, 100 * base("probe_raw_pixels"),
                100 * base("probe_random_init"));
  r.text = txt;
  return r;
}

int train_mim(const RunContext& ctx) {
  const Config& cfg = ctx.cfg;
  MIMConfig mc = mim_config_from(cfg);
  MIMData data = load_mim_data(cfg, mc.vit);
  const ImageSet &train = data.train, &test = data.test, &probe_tr = data.probe_train;
  Rng init_rng(ctx.seed);
  LatentMIM m(mc, Init{DType::F32, ctx.device, &init_rng});
  freeze_prefixes(m, cfg.get_str("train.freeze"));
  m.encoder.checkpoint_blocks = m.checkpoint_blocks = cfg.get_bool("train.grad_checkpointing");
  const std::string keep_gelu = cfg.get_str("train.keep_gelu");  // false | true | encoder
  for (auto& b : m.encoder.blocks) b->keep_gelu = keep_gelu != "false";
  for (auto& b : m.pred_blocks) b->keep_gelu = keep_gelu == "true";
  m.target.requires_grad_(false);
  m.target_side_stream = cfg.get_bool("train.target_side_stream");  // CUDA only (nn/mim.h)
  m.shared_target = cfg.get_bool("train.shared_target");  // the views below are masks of one batch of images
  if (ctx.dp && cfg.get_str("train.dist_infonce") == "global") {
    DataParallel* dp = ctx.dp;
    m.gather_pooled = [dp](const Tensor& x) { return dp->all_gather_rows(x); };
    std::printf("data parallel: the InfoNCE's negatives are every rank's batch (train.dist_infonce = global)\n");
  }
  std::printf("%s\n", describe_params(m).c_str());
  OptimConfig oc = optim_config_from(cfg);
  Optimizer opt(param_groups_from(m, cfg), oc, ctx.compute, ctx.device);
  if (ctx.dp) ctx.dp->shard_optimizer(opt);  // train.zero_stage = 1
  cast_frozen(m, ctx.compute);
  EMA ema(m.target, opt, "encoder.");
  // The EMA in AdamW's pass over the masters (EMA::fuse: the same values, one read of the encoder's
  // masters instead of two); LOOM_EMA_FUSED=0 keeps the EMA's own kernels, for A/B runs.
  const char* ema_fused = std::getenv("LOOM_EMA_FUSED");
  if (!(ema_fused && std::string(ema_fused) == "0")) ema.fuse(opt, mc.ema);
  const Tensor loss_scale = setup_loss_scaling(opt, ctx);  // fp16 only
  std::printf("optimizer %s\n", opt.backend().c_str());

  int64_t steps = cfg.get_int64("train.steps"), start = 0;
  std::string ck;
  TrainerState st = start_run(ctx, cfg.get_str("train.resume"), m, opt, ema.masters("target."), &ck);
  start = st.step;
  std::map<std::string, double> baselines = st.extra;
  if (ck.empty() && !cfg.get_bool("train.dry_run") && test.n > 0 && ctx.rank == 0) {
    // the two baselines the trained encoder must beat: raw pixels, and this random encoder
    int d = train.c * train.h * train.w;
    baselines["probe_raw_pixels"] = probe(probe_tr.pixels, probe_tr, test.pixels, test, d, cfg);
    baselines["probe_random_init"] = probe(encode_all(m.encoder, probe_tr, ctx), probe_tr, encode_all(m.encoder, test, ctx),
                                           test, mc.vit.dim, cfg);
    std::printf("%s probe: raw pixels %.2f%%, random-init encoder %.2f%%\n", cfg.get_str("eval.probe").c_str(),
                100 * baselines["probe_raw_pixels"], 100 * baselines["probe_random_init"]);
  }

  int B = cfg.get_int("train.batch_size"), nviews = mc.contrastive ? 2 : 1;
  // Data parallel: the step's global batch is B x world images drawn as one batch of that size
  // would be on one GPU; this rank builds rows [rank*B, (rank+1)*B) of it (the same random
  // draws on every rank), so N GPUs with B each see exactly what one GPU with N*B sees.
  const int Bg = B * ctx.world;
  const Shard mine = shard_of(Bg, ctx.rank, ctx.world);
  if (ctx.world > 1)
    std::printf("data parallel: %d ranks x batch %d = global batch %d images per step\n", ctx.world, B, Bg);
  size_t px = size_t(train.c) * train.h * train.w;
  int N = mc.vit.num_patches(), K = mc.keep_count();
  // A batch is built by a loader thread straight into page-locked memory: the images already
  // in the compute dtype (bf16 on the GPU: half the bytes of f32, no conversion in the step),
  // then each view's kept and masked patch indices. The main thread only enqueues its upload.
  const DType img_dt = ctx.compute;
  auto pool = std::make_shared<PinnedPool>(ctx.device);
  std::vector<std::pair<DType, int64_t>> layout = {{img_dt, int64_t(B) * int64_t(px)}};
  for (int v = 0; v < nviews; v++) {
    layout.push_back({DType::I32, int64_t(B) * K});
    layout.push_back({DType::I32, int64_t(B) * (N - K)});
  }
  const size_t batch_bytes = StagedBatch::bytes_for(layout);
  const bool repeat_batch = cfg.get_bool("data.repeat_batch");  // every step the first batch
  auto make = [&](int64_t s) {
    if (repeat_batch) s = 0;
    Rng r(ctx.seed * 7919ull + uint64_t(s) * 104729ull + 17);
    StagedBatch b(pool, batch_bytes);
    void* img = b.add("images", img_dt, {B, train.c, train.h, train.w});
    for (int gi = 0; gi < Bg; gi++) {
      int idx = int(r.randint(train.n));
      if (gi < mine.begin || gi >= mine.end) continue;
      const int i = gi - int(mine.begin);
      const float* src = train.pixels.data() + size_t(idx) * px;
      if (img_dt == DType::BF16)
        for (size_t j = 0; j < px; j++) static_cast<bf16*>(img)[size_t(i) * px + j] = bf16(src[j]);
      else if (img_dt == DType::F16)
        for (size_t j = 0; j < px; j++) static_cast<f16*>(img)[size_t(i) * px + j] = f16(src[j]);
      else if (img_dt == DType::F64)
        for (size_t j = 0; j < px; j++) static_cast<double*>(img)[size_t(i) * px + j] = src[j];
      else
        std::copy(src, src + px, static_cast<float*>(img) + size_t(i) * px);
    }
    for (int v = 0; v < nviews; v++) {
      int32_t* keep = b.add_as<int32_t>("keep" + std::to_string(v), DType::I32, {B, K});
      int32_t* masked = b.add_as<int32_t>("masked" + std::to_string(v), DType::I32, {B, N - K});
      for (int gi = 0; gi < Bg; gi++) {
        auto p = r.permutation(N);
        if (gi < mine.begin || gi >= mine.end) continue;
        const int i = gi - int(mine.begin);
        std::copy(p.begin(), p.begin() + K, keep + size_t(i) * K);
        std::copy(p.begin() + K, p.end(), masked + size_t(i) * (N - K));
      }
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
  // With train.shared_target the target's blocks but the last run once per image (nn/mim.h):
  // its N-token forward counts (depth - 1 + views) / depth times per image instead of views times.
  const bool shared_target = m.shared_target && m.batch_views && nviews > 1;
  const double target_passes =
      shared_target ? double(mc.vit.depth - 1 + nviews) / double(mc.vit.depth) : double(nviews);
  double step_flops = double(B) * (nviews * (3.0 * K * vit_tok(mc.vit, K) + 3.0 * N * vit_tok(pc, N)) +
                                   target_passes * N * vit_tok(mc.vit, N));
  if (shared_target)
    std::printf("the EMA target's first %d blocks run once for both views (train.shared_target)\n", mc.vit.depth - 1);

  Uploader up(ctx.device);
  // forward + backward of one batch; returns the loss as a device scalar (no host read)
  auto run_step = [&](const StagedBatch& b) {
    auto t = up.upload(b);
    std::vector<MIMView> views;
    for (int v = 0; v < nviews; v++)
      views.push_back({t["images"], t["keep" + std::to_string(v)], t["masked" + std::to_string(v)]});
    Tensor loss = m.forward(views);
    backward(loss);
    return loss;
  };
  if (cfg.get_bool("train.dry_run")) {
    double t0 = now_ms();
    double l = run_step(make(0)).item();
    std::printf("dry run: one step, loss %.4f, %.1f ms, %s\n", l, now_ms() - t0, describe_params(m).c_str());
    return 0;
  }

  // One whole step: forward, backward, clip, the non-finite skip, AdamW, EMA, zero_grad. All of
  // it on the device, so that it can be captured into a CUDA graph; returns {loss, norm}.
  const double grad_clip = cfg.get_float("train.grad_clip");
  auto body = [&](const std::map<std::string, Tensor>& t) -> std::vector<Tensor> {
    std::vector<MIMView> views;
    for (int v = 0; v < nviews; v++)
      views.push_back({t.at("images"), t.at("keep" + std::to_string(v)), t.at("masked" + std::to_string(v))});
    Tensor loss;
    {
      ProfileRange r("forward");
      loss = m.forward(views);
    }
    {
      ProfileRange r("backward");
      if (ctx.dp) ctx.dp->begin_backward(opt);  // gradient buckets averaged beside the backward
      backward(loss, loss_scale.defined() ? loss_scale.reshape(loss.shape()) : Tensor());  // fp16: seed S
    }
    ProfileRange r("optimizer");
    if (loss.dtype() != DType::F32) loss = cast(loss, DType::F32);
    if (ctx.dp) ctx.dp->reduce(opt, loss);  // gradients and loss averaged over the ranks
    Tensor norm = opt.clip_grad_norm(grad_clip, loss);
    opt.step();
    ema.update(mc.ema);
    opt.zero_grad();
    profile_phase("optimizer (clip, AdamW, EMA, zero)");
    return {loss, norm};
  };
  const bool use_graph = ctx.device == Device::CUDA && cfg.get_bool("train.cuda_graph") && !cfg.get_bool("train.profile");
  constexpr int64_t kEagerSteps = 3;  // before the capture: plans, kernels' first-use setup, the allocator warm
  StepGraph graph;
  if (ctx.device == Device::CUDA)
    std::printf("step: %s\n", use_graph ? "eager for 3 steps, then captured into one CUDA graph and replayed (train.cuda_graph)"
                                         : "eager (train.cuda_graph=false or profiling)");

  RunLog log(ctx, start > 0);
  NanGuard guard(cfg.get_int("train.max_nan_skips"));
  AsyncStepLog slog(ctx, log, guard, "img/s", loss_scale);
  std::printf("%d loader thread%s\n", ctx.loader_threads, ctx.loader_threads == 1 ? "" : "s");
  Prefetcher<StagedBatch> loader(make, start, steps, ctx.loader_threads, 4);
  int64_t eval_every = cfg.get_int64("train.eval_every"), save_every = cfg.get_int64("train.save_every");
  profile_enable(cfg.get_bool("train.profile"));
  set_side_weight_grads(cfg.get_bool("train.side_weight_grads"));
  set_side_weight_grads_lag(cfg.get_int("train.side_weight_grads_lag"));
  for (int64_t s = start; s < steps; s++) {
    double w0 = now_ms();
    StagedBatch b = loader.next();
    double wait = now_ms() - w0;
    profile_add("data (waiting for the loader, host)", wait);
    profile_mark();
    double lr = lr_at(s, steps, cfg.get_int64("train.warmup_steps"), cfg.get_float("train.lr"),
                      cfg.get_float("train.min_lr"), cfg.get_str("train.schedule"));
    opt.set_lr(lr);  // a fill on the device, outside any captured graph
    slog.begin_step();
    auto inputs = up.upload(b);
    profile_phase("data (upload, lr)");
    std::vector<Tensor> out;
    if (use_graph && s - start >= kEagerSteps) {
      graph.static_inputs(inputs);
      graph.load(inputs);  // batch -> the graph's input addresses, on the GPU
      up.step_done();
      if (!graph.ready()) {
        graph.capture([&] { return body(graph.static_inputs(inputs)); });
        std::printf("step %lld: captured into a CUDA graph\n", (long long)(s + 1));
      }
      graph.launch();
      out = graph.outputs();
    } else {
      out = body(inputs);
      up.step_done();
    }
    if (ctx.dp) ctx.dp->heartbeat();
    slog.post({s + 1, steps, lr, wait, double(nviews * Bg), step_flops}, out[0], out[1], opt.control().narrow(0, 1, 1));
    profile_step_end();
    bool last = s + 1 == steps;
    bool stop = cfg.get_int64("train.stop_at") > 0 && s + 1 >= cfg.get_int64("train.stop_at") && !last;
    bool eval_now = ((eval_every > 0 && (s + 1) % eval_every == 0) || last) && test.n > 0 && ctx.rank == 0;
    bool save_now = (save_every > 0 && (s + 1) % save_every == 0) || last || stop;
    slog.flush(eval_now || save_now || stop);
    if (eval_now) {
      DataParallel::Busy busy(ctx.dp);  // rank 0 alone: the other ranks wait in the next step
      EvalReport e = evaluate_mim(m.encoder, data, ctx, baselines, s + 1);
      log.event("eval", e.metrics, e.text);
    }
    if (save_now) {
      DataParallel::Busy busy(ctx.rank == 0 ? ctx.dp : nullptr);  // rank 0 writes the files alone
      st.step = s + 1;
      st.extra = baselines;
      save_checkpoint(ctx, m, opt, st, ema.masters("target."));
    }
    if (eval_now || save_now) slog.restart_timing();
    if (stop) {
      std::printf("stopped at step %lld (train.stop_at); resume with --train.resume=latest\n", (long long)(s + 1));
      break;
    }
  }
  slog.flush(true);
  log.finish();
  if (cfg.get_bool("train.profile")) std::printf("%s", profile_report().c_str());
  return 0;
}

}  // namespace loom
