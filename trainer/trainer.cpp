// trainer.cpp: the vlm_sft / vlm_pretrain trainers and the dispatch of ./train CONFIG. The MIM
// trainer is in mim_trainer.cpp, the chat command in chat.cpp. One step: batch (prefetched) ->
// forward -> backward (x grad_accum) -> clip -> NaN guard -> AdamW -> log / eval / save.
#include "trainer/trainer.h"

#include <cmath>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>

#include "nn/hf.h"
#include "trainer/distributed.h"
#include "trainer/eval.h"
#include "trainer/init_weights.h"
#include "trainer/mim_trainer.h"
#include "trainer/prefetch.h"
#include "trainer/step_log.h"
#include "trainer/vlm_task.h"

namespace loom {

// FLOPs of one VLM training step (SPEC §3: 3x forward; forward = 2 x matmul params per
// token + attention 4 n D per token per layer with n the mean attended length).
static double vlm_step_flops(const VLMConfig& c, const PackedBatch& pb) {
  double lm_mat = 0;
  int hd = c.lm.head_dim();
  lm_mat += double(c.lm.depth) * (double(c.lm.dim) * (c.lm.heads + 2 * c.lm.kv_heads) * hd +
                                 double(c.lm.heads) * hd * c.lm.dim + 3.0 * c.lm.dim * c.lm.hidden);
  lm_mat += double(c.lm.vocab) * c.lm.dim;
  double attn_tok = 0;  // sum over tokens of the attended length (causal: position + 1)
  for (size_t i = 0; i + 1 < pb.cu_seqlens.size(); i++) {
    double L = pb.cu_seqlens[i + 1] - pb.cu_seqlens[i];
    attn_tok += L * (L + 1) / 2;
  }
  double lm = 2 * lm_mat * double(pb.real_tokens) + 4.0 * c.lm.dim * c.lm.depth * attn_tok;
  int N = c.vit.num_patches();
  double vit_mat = double(c.vit.depth) * (4.0 * c.vit.dim * c.vit.dim + 2.0 * c.vit.hidden() * c.vit.dim);
  double vit = double(pb.images.size()) * N * (2 * vit_mat + 4.0 * N * c.vit.dim * c.vit.depth);
  return 3 * (lm + vit);
}

static double memory_mb(Device d) {
  return d == Device::CUDA ? double(cuda::bytes_in_use()) / 1048576.0 : double(cpu_bytes_in_use()) / 1048576.0;
}

// Initial weights: an HF folder, a checkpoint or run folder, or a .safetensors file
// (trainer/init_weights.h).
static void init_vlm_from(VLM& m, const Config& cfg) {
  std::string whole = cfg.get_str("model.init"), lm_init = cfg.get_str("model.lm_init"), vis = cfg.get_str("model.vision_init");
  if (!whole.empty()) {  // config rules: then lm_init and vision_init are empty
    m.load_state_dict(vlm_init_weights(whole), whole);
    std::printf("initialized vision, projector and lm from %s\n", whole.c_str());
  }
  if (!lm_init.empty()) {
    auto w = lm_init_weights(lm_init, m.lm.cfg);
    if (int64_t added = grow_embedding(w, m.lm.embed_tokens))
      std::printf("lm embedding widened to %lld ids: the %lld past %s's keep their fresh initialization\n",
                  (long long)m.lm.cfg.vocab, (long long)added, lm_init.c_str());
    m.lm.load_state_dict(w, lm_init);
    std::printf("initialized lm from %s\n", lm_init.c_str());
  }
  if (!vis.empty()) {
    m.vision.load_state_dict(vision_init_weights(vis, m.vision.cfg), vis);
    std::printf("initialized vision from %s\n", vis.c_str());
  }
}

// The frozen vision tower one micro-batch ahead of the step (train.vision_ahead; train_vlm's
// loop). launch() uploads a staged batch and enqueues the tower's forward on it; on CUDA both go
// to the side stream (kernels.h), which first waits for the main stream's work enqueued so far
// (so that the side pool's blocks the main stream read, e.g. the features of two micro-batches
// back, are free on the GPU too). take() hands out the oldest launched batch and makes the main
// stream wait for its features. S: the loader's item type, with the StagedBatch as .batch.
template <class S>
class VisionAhead {
 public:
  struct Item {
    S staged;
    VLMBatch batch;
    Tensor features;        // [images, tokens, width] or undefined (a batch without images)
    void* ready = nullptr;  // CUDA: recorded on the side stream after the features
  };
  VisionAhead(Device device, Uploader& up, std::function<Tensor(const Tensor&)> tower)
      : cuda_(device == Device::CUDA), up_(up), tower_(std::move(tower)) {
    if (!cuda_) return;
    mark_ = cuda::event_create();
    for (void*& e : ready_) e = cuda::event_create();
  }
  ~VisionAhead() {
    items_.clear();
    if (!cuda_) return;
    cuda::event_destroy(mark_);  // (a pending event is released once it completes)
    for (void* e : ready_) cuda::event_destroy(e);
  }
  VisionAhead(const VisionAhead&) = delete;
  VisionAhead& operator=(const VisionAhead&) = delete;
  bool empty() const { return items_.empty(); }

  void launch(S staged) {
    LOOM_CHECK(items_.size() < 2, "VisionAhead: at most two batches in flight (take() one first)");
    Item it;
    it.staged = std::move(staged);
    if (cuda_) {
      cuda::event_record(mark_, cuda::main_stream());
      cuda::side_scope_begin();
      cuda::stream_wait_event(cuda::side_stream(), mark_);
    }
    try {
      it.batch = from_staged(it.staged.batch, up_.upload(it.staged.batch));
      if (it.batch.images.defined() && it.batch.images.size(0) > 0) {
        NoGradGuard ng;
        it.features = tower_(it.batch.images);
      }
      if (cuda_) {
        it.ready = ready_[launched_++ % 2];  // two: one taken and waited for, one in flight
        cuda::event_record(it.ready, cuda::side_stream());
      }
    } catch (...) {
      if (cuda_) cuda::side_scope_end();
      throw;
    }
    if (cuda_) cuda::side_scope_end();
    items_.push_back(std::move(it));
  }

  Item take() {
    LOOM_CHECK(!items_.empty(), "VisionAhead: take() without a launched batch");
    Item it = std::move(items_.front());
    items_.pop_front();
    if (it.ready) cuda::stream_wait_event(cuda::main_stream(), it.ready);
    return it;
  }

 private:
  bool cuda_;
  Uploader& up_;
  std::function<Tensor(const Tensor&)> tower_;
  std::deque<Item> items_;
  void* mark_ = nullptr;
  void* ready_[2] = {nullptr, nullptr};
  int64_t launched_ = 0;
};

// The shapes a CUDA run rounds its packed batches to (round_batch_shapes, loss_rows_of), so that
// batches share them and a graph captured for one replays for the others, and how many graphs
// a run keeps. Their cost: empty sequences (blocks that exit at once) and loss rows without a
// target (at most 255 more rows through the head: under 2% of bench_vlm_sft's).
constexpr int kGraphSeqMultiple = 8, kGraphLenMultiple = 256, kGraphLossMultiple = 256, kMaxStepGraphs = 64;

static int train_vlm(const RunContext& ctx) {
  const Config& cfg = ctx.cfg;
  double t_setup = now_ms();
  VLMConfig probe = vlm_config_from(cfg, 1, 0);
  VLMData d = build_vlm_data(ctx, probe.image_tokens());
  VLMConfig vc = vlm_config_from(cfg, d.tok->vocab_size(), d.image_token);
  std::printf("%s\n%s", d.stats.log_lines().c_str(), d.baseline_text.c_str());
  Rng init_rng(ctx.seed);
  VLM m(vc, Init{DType::F32, ctx.device, &init_rng});
  init_vlm_from(m, cfg);
  freeze_prefixes(m, cfg.get_str("train.freeze"));
  m.vision.checkpoint_blocks = m.lm.checkpoint_blocks = cfg.get_bool("train.grad_checkpointing");
  for (auto& b : m.vision.blocks) b->keep_gelu = cfg.get_str("train.keep_gelu") != "false";  // true | encoder
  for (auto& b : m.lm.layers) b->keep_swiglu = cfg.get_bool("train.keep_swiglu");
  std::printf("%s (vision %.3fM, projector %.3fM, lm %.3fM)\n", describe_params(m).c_str(),
              m.vision.num_parameters() / 1e6, m.projector.num_parameters() / 1e6, m.lm.num_parameters() / 1e6);
  OptimConfig oc = optim_config_from(cfg);
  Optimizer opt(param_groups_from(m, cfg), oc, ctx.compute, ctx.device);
  if (ctx.dp) ctx.dp->shard_optimizer(opt);  // train.zero_stage = 1
  cast_frozen(m, ctx.compute);
  const Tensor loss_scale = setup_loss_scaling(opt, ctx);  // fp16 only
  std::printf("optimizer %s\n", opt.backend().c_str());

  int64_t steps = cfg.get_int64("train.steps"), start = 0;
  int bs = cfg.get_int("train.batch_size"), accum = std::max(1, cfg.get_int("train.grad_accum"));
  int row = cfg.get_int("data.pack_max_length");
  TrainerState st = start_run(ctx, cfg.get_str("train.resume"), m, opt);
  start = st.step;
  // batch of micro-step s: rows [s*bs, (s+1)*bs) of the epoch's shuffled row order. Data
  // parallel: the micro-step's global batch is rows [s*G, (s+1)*G), G = bs x world, and this
  // rank takes its part [rank*bs, (rank+1)*bs) (the same permutation on every rank).
  int64_t nrows = int64_t(d.rows.size());
  const int world = ctx.world;
  const int64_t G = int64_t(bs) * world;
  auto global_row = [&, nrows](int64_t g) {
    Rng r(ctx.seed * 1000003ull + uint64_t(g / nrows));
    std::vector<int32_t> perm = r.permutation(int(nrows));
    return size_t(perm[size_t(g % nrows)]);
  };
  auto make = [&, nrows](int64_t micro) {
    std::vector<std::vector<int>> rows;
    const Shard mine = shard_of(G, ctx.rank, world);
    for (int64_t i = mine.begin; i < mine.end; i++) rows.push_back(d.rows[global_row(micro * G + i)]);
    return build_batch(d.train, rows, row, d.pad_id, d.image_token);
  };
  // Data parallel: each rank's loss is a mean over its own target tokens; scaling it by
  // local_targets * world / global_targets makes the average over ranks the mean over the
  // global batch's targets (what one GPU with the whole batch computes). Per packed row: its
  // target and real token counts, so that every rank knows the global batch's totals.
  std::vector<int64_t> row_targets, row_tokens;
  if (world > 1) {
    for (auto& r : d.rows) {
      int64_t t = 0, n = 0;
      for (int si : r) {
        const Sample& smp = d.train[size_t(si)];
        n += int64_t(smp.ids.size());
        for (size_t k = 0; k + 1 < smp.labels.size(); k++) t += smp.labels[k + 1] != -100;
      }
      row_targets.push_back(t);
      row_tokens.push_back(n);
    }
    std::printf("data parallel: %d ranks x %d rows = global batch %lld packed rows per micro-step\n", world, bs,
                (long long)G);
  }
  // What the loader threads hand over: the batch already in page-locked memory (images in the
  // compute dtype), with the FLOPs of its step counted on the way.
  struct Staged {
    StagedBatch batch;
    double flops = 0;
    int64_t real_tokens = 0;      // of the global batch (all ranks)
    double loss_scale = 1.0;      // data parallel: local_targets * world / global_targets
  };
  auto pool = std::make_shared<PinnedPool>(ctx.device);
  // data.repeat_batch: every micro-batch is the first one (the PyTorch reference's bench
  // trains one batch over and over; with it the step times compare like for like)
  const bool repeat_batch = cfg.get_bool("data.repeat_batch");
  // On CUDA the host-side shapes are rounded (round_batch_shapes, loss_rows_of) so that batches
  // share them and one captured graph serves many steps; graphs on or off, the same rounding.
  const bool round_shapes = ctx.device == Device::CUDA;
  auto make_staged = [&](int64_t micro) {
    if (repeat_batch) micro = 0;
    PackedBatch pb = make(micro);
    if (round_shapes) round_batch_shapes(pb, kGraphSeqMultiple, kGraphLenMultiple);
    Staged st;
    st.flops = vlm_step_flops(vc, pb);
    st.real_tokens = pb.real_tokens;
    if (world > 1) {
      int64_t tg = 0, ng = 0;
      for (int64_t i = 0; i < G; i++) {
        size_t r = global_row(micro * G + i);
        tg += row_targets[r];
        ng += row_tokens[r];
      }
      st.real_tokens = ng;
      st.loss_scale = tg > 0 ? double(pb.target_tokens) * world / double(tg) : 1.0;
    }
    st.batch = stage_batch(d, pb, pool, ctx.compute, round_shapes ? kGraphLossMultiple : 1);
    return st;
  };
  std::printf("setup %.1f s; %lld training samples in %lld packed rows, %d rows per step, %d loader thread%s\n",
              (now_ms() - t_setup) / 1e3, (long long)d.train.size(), (long long)nrows, bs * accum, ctx.loader_threads,
              ctx.loader_threads == 1 ? "" : "s");

  if (cfg.get_bool("train.dry_run")) {
    PackedBatch pb = make(0);
    double t0 = now_ms();
    Tensor loss = m.loss(to_device(d, pb, ctx.device, ctx.compute));
    backward(loss);
    std::printf("dry run: one step, loss %.4f, %.1f ms, memory %.1f MB, %s\n", loss.item(), now_ms() - t0,
                memory_mb(ctx.device), describe_params(m).c_str());
    return 0;
  }

  RunLog log(ctx, start > 0);
  NanGuard guard(cfg.get_int("train.max_nan_skips"));
  AsyncStepLog slog(ctx, log, guard, "tok/s", loss_scale);
  Uploader up(ctx.device);
  Prefetcher<Staged> loader(make_staged, start * accum, steps * accum, ctx.loader_threads, 4);
  // A frozen vision tower runs one micro-batch ahead: the forward of micro-batch i + 1 is
  // enqueued before the LM step of micro-batch i, on CUDA on the side stream (kernels.h) so that
  // it computes beside the step; the step waits for it (an event) only where it reads the
  // features. The math is the same as in the step (no dropout, no randomness in the tower).
  bool vision_frozen = m.vision.num_parameters() > 0;
  for (auto& [n, t] : m.vision.named_parameters()) vision_frozen = vision_frozen && !t->requires_grad();
  // (not while profiling: the profile times the step's ops between events on one stream)
  const bool wanted = vision_frozen && cfg.get_bool("train.vision_ahead");
  const bool ahead = wanted && !cfg.get_bool("train.profile");
  if (wanted && !ahead)
    std::printf("vision tower: frozen, its forward inside the step (train.profile times one stream)\n");
  if (ahead)
    std::printf("vision tower: frozen, its forward for the next micro-batch runs %s (train.vision_ahead)\n",
                ctx.device == Device::CUDA ? "on a second CUDA stream beside the LM step" : "before the LM step");
  // CUDA graphs: one per batch shape (StepGraphCache), where a step is one forward and
  // backward of one batch whose scalars need no host: no accumulation, one rank (its loss
  // scale is the host's per batch), the tower in the step, not profiling.
  const char* eager_why = !cfg.get_bool("train.cuda_graph") ? "train.cuda_graph=false"
                          : cfg.get_bool("train.profile")   ? "profiling"
                          : accum > 1                       ? "train.grad_accum > 1"
                          : world > 1                       ? "several ranks"
                          : ahead                           ? "the frozen tower runs ahead (train.vision_ahead)"
                                                            : nullptr;
  const bool use_graphs = ctx.device == Device::CUDA && !eager_why;
  StepGraphCache graphs(kMaxStepGraphs);
  constexpr int64_t kEagerSteps = 3;  // before any capture: plans, first-use setup, the allocator warm
  if (ctx.device == Device::CUDA) {
    if (use_graphs)
      std::printf("step: eager for %lld steps, then one CUDA graph per batch shape (image count, sequences in "
                  "multiples of %d, loss rows in multiples of %d), captured once a shape has come 4 times in 16 "
                  "steps and replayed after, at most %d (train.cuda_graph)\n",
                  (long long)kEagerSteps, kGraphSeqMultiple, kGraphLossMultiple, kMaxStepGraphs);
    else
      std::printf("step: eager (%s)\n", eager_why);
  }
  VisionAhead<Staged> va(ctx.device, up, [&](const Tensor& images) { return m.vision_features(images); });
  const int64_t last_micro = steps * accum;
  int64_t eval_every = cfg.get_int64("train.eval_every"), save_every = cfg.get_int64("train.save_every");
  int64_t epoch_rows_seen = start * accum * G;
  const double grad_clip = cfg.get_float("train.grad_clip");
  // The step's end: the loss in f32 (averaged over the ranks with the gradients), clip, skip a
  // non-finite step and AdamW, all decided on the device; returns {loss, norm}.
  auto optimizer_step = [&](const Tensor& loss_sum) -> std::vector<Tensor> {
    NoGradGuard ng;
    Tensor loss_f32 = loss_sum.dtype() == DType::F32 ? loss_sum : loss_sum.to(DType::F32);
    if (ctx.dp) {  // gradients and the step's loss averaged over the ranks, before the clip
      loss_f32 = loss_f32.clone();
      ctx.dp->reduce(opt, loss_f32);
    }
    Tensor norm = opt.clip_grad_norm(grad_clip, loss_f32.device() == ctx.device ? loss_f32 : Tensor());
    opt.step();
    opt.zero_grad();
    profile_phase("optimizer (clip, AdamW, zero)");
    return {loss_f32, norm};
  };
  // Forward and backward of one micro-batch, its gradients scaled by f (1 on one GPU without
  // accumulation); returns the unscaled loss. `last`: the step's last micro-batch, whose
  // backward data parallel's gradient buckets watch (their averages run beside it).
  auto forward_backward = [&](const VLMBatch& vb, const Tensor& features, double f, bool last) -> Tensor {
    Tensor loss;
    {
      ProfileRange r("forward");
      loss = m.loss(vb, features);
    }
    Tensor scaled = f != 1.0 ? scale(loss, f) : loss;
    {
      ProfileRange r("backward");
      if (ctx.dp && last) ctx.dp->begin_backward(opt);
      backward(scaled, loss_scale.defined() ? loss_scale.reshape(scaled.shape()) : Tensor());  // fp16: seed S
    }
    return loss;
  };
  // One whole step of one batch (the graphs' body): forward, backward, the optimizer.
  auto whole_step = [&](const StagedBatch& sb, const std::map<std::string, Tensor>& t) -> std::vector<Tensor> {
    Tensor loss = forward_backward(from_staged(sb, t), Tensor(), 1.0, true);
    ProfileRange r("optimizer");
    return optimizer_step(loss);
  };
  profile_enable(cfg.get_bool("train.profile"));
  set_side_weight_grads(cfg.get_bool("train.side_weight_grads"));
  set_side_weight_grads_lag(cfg.get_int("train.side_weight_grads_lag"));
  for (int64_t s = start; s < steps; s++) {
    double wait = 0, flops = 0;
    int64_t tokens = 0;
    Tensor loss_sum;  // the step's mean loss over its micro-batches, on the device
    std::vector<Tensor> out;  // {loss, norm}
    const double lr = lr_at(s, steps, cfg.get_int64("train.warmup_steps"), cfg.get_float("train.lr"),
                            cfg.get_float("train.min_lr"), cfg.get_str("train.schedule"));
    slog.begin_step();
    opt.set_lr(lr);  // a fill on the device, outside any captured graph
    for (int a = 0; a < accum; a++) {
      const int64_t micro = s * accum + a;
      double w0 = now_ms();
      Staged sb;
      VLMBatch vb;
      Tensor features;  // the frozen tower's output for this micro-batch, computed ahead
      if (ahead) {
        if (va.empty()) va.launch(loader.next());  // the run's first micro-batch
        if (micro + 1 < last_micro) va.launch(loader.next());  // the next one's tower, beside this step
        VisionAhead<Staged>::Item it = va.take();  // the main stream waits for its features here
        sb = std::move(it.staged);
        vb = it.batch;
        features = it.features;
      } else {
        sb = loader.next();
      }
      wait += now_ms() - w0;
      profile_add("data (waiting for the loader, host)", now_ms() - w0);
      // an epoch is every row seen once; data.repeat_batch sees one batch only: no epochs
      if (!repeat_batch && epoch_rows_seen % nrows < G && epoch_rows_seen > 0)
        log.event("epoch", {{"step", double(s)}}, "epoch " + std::to_string(epoch_rows_seen / nrows) + "\n" + d.stats.log_lines());
      epoch_rows_seen += G;
      tokens += sb.real_tokens;
      flops += sb.flops;
      if (a == 0) profile_mark();
      if (use_graphs) {  // accum == 1: this micro-batch is the step
        auto inputs = up.upload(sb.batch);
        StepGraph* g = graphs.find(shape_key(sb.batch, {"nseq", "max_seqlen"}), s - start >= kEagerSteps);
        if (g) {
          g->static_inputs(inputs);
          g->load(inputs);  // batch -> the graph's input addresses, on the GPU
          up.step_done();
          if (!g->ready()) {
            g->capture([&] { return whole_step(sb.batch, g->static_inputs(inputs)); });
            std::printf("step %lld: captured into CUDA graph %zu (%lld images, %lld sequences, %lld loss rows)\n",
                        (long long)(s + 1), graphs.size(), (long long)sb.batch.meta.at("images"),
                        (long long)sb.batch.meta.at("nseq"), (long long)inputs.at("loss_rows").numel());
          }
          g->launch();
          out = g->outputs();
        } else {
          out = whole_step(sb.batch, inputs);
          up.step_done();
        }
        break;
      }
      if (!ahead) vb = from_staged(sb.batch, up.upload(sb.batch));
      profile_phase("data (upload)");
      const double f = sb.loss_scale / accum;  // 1 on one GPU without accumulation
      Tensor loss = forward_backward(vb, features, f, a == accum - 1);
      up.step_done();
      NoGradGuard ng;
      Tensor l = f != 1.0 ? scale(loss, f) : loss;
      loss_sum = loss_sum.defined() ? add(loss_sum, l) : l;
    }
    if (out.empty()) {
      ProfileRange opt_range("optimizer");
      out = optimizer_step(loss_sum);
    }
    const Tensor& loss_f32 = out[0];
    const Tensor& norm = out[1];
    if (ctx.dp) ctx.dp->heartbeat();
    slog.post({s + 1, steps, lr, wait, double(tokens), flops}, loss_f32, norm, opt.control().narrow(0, 1, 1));
    profile_step_end();
    bool last = s + 1 == steps;
    bool stop = cfg.get_int64("train.stop_at") > 0 && s + 1 >= cfg.get_int64("train.stop_at") && !last;
    bool eval_now = ((eval_every > 0 && (s + 1) % eval_every == 0) || last) && !d.val.empty() && ctx.rank == 0 &&
                    cfg.get_int("eval.samples") > 0;
    bool save_now = (save_every > 0 && (s + 1) % save_every == 0) || last || stop;
    slog.flush(eval_now || save_now || stop);
    if (eval_now) {
      DataParallel::Busy busy(ctx.dp);  // rank 0 alone: the other ranks wait in the next step
      EvalReport e = evaluate_vlm(m, d, ctx, last ? cfg.get_int("eval.samples") : std::min(100, cfg.get_int("eval.samples")),
                                  s + 1);
      log.event("eval", e.metrics, e.text);
    }
    if (save_now) {
      DataParallel::Busy busy(ctx.rank == 0 ? ctx.dp : nullptr);  // rank 0 writes the files alone
      st.step = s + 1;
      st.extra["nan_skipped"] = double(guard.skipped());
      save_checkpoint(ctx, m, opt, st);
    }
    if (eval_now || save_now) slog.restart_timing();
    if (stop) {
      std::printf("stopped at step %lld (train.stop_at); resume with --train.resume=latest\n", (long long)(s + 1));
      break;
    }
  }
  slog.flush(true);
  if (use_graphs)
    std::printf("CUDA graphs: %zu batch shapes captured, %lld of %lld steps ran as one\n", graphs.size(),
                (long long)graphs.replays(), (long long)(steps - start));
  log.finish();
  if (cfg.get_bool("train.profile")) std::printf("%s", profile_report().c_str());
  return 0;
}

int train_command(int argc, char** argv) {
  std::string path = argv[0];
  std::vector<std::string> overrides;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    LOOM_CHECK(a.rfind("--", 0) == 0 && a.find('=') != std::string::npos,
               "argument '%s': overrides look like --section.key=value", a.c_str());
    overrides.push_back(a);
  }
  Config cfg = Config::load(path, overrides);
  EnvMap env = process_env();
  DistEnv de = parse_dist_env(env);
  std::string dev = cfg.get_str("train.device");
  {  // the file's [section.cuda] / [section.cpu] values for the device this run uses
    if (dev == "auto") {
      // A rank chooses its GPU by setting CUDA_VISIBLE_DEVICES (select_rank_device), which
      // CUDA reads once, when it initializes: a rank (or a launcher of ranks) asks a child
      // process instead, so that CUDA is not initialized here. Asking CUDA itself made every
      // rank of `--train.gpus=2` with device = auto see both GPUs and take GPU 0 (NCCL:
      // "Duplicate GPU detected").
      const bool ranks = de.distributed() || cfg.get_int("train.gpus") > 1;
      dev = (ranks ? probe_gpu_count() > 0 : cuda::available()) ? "cuda" : "cpu";
    }
    cfg.apply_device_sections(dev);
  }
  std::string trainer = cfg.get_str("train.trainer");
  LOOM_CHECK(trainer == "vlm_sft" || trainer == "vlm_pretrain" || trainer == "vit_mim",
             "%s: train.trainer '%s' (vlm_sft, vlm_pretrain, vit_mim)", cfg.source().c_str(), trainer.c_str());
  auto run = [&](const RunContext& ctx) {
    struct ResetScale {  // fp16's loss scale is the run's: the fused losses stop using it after
      ~ResetScale() { set_loss_scale(Tensor()); }
    } reset;
    return trainer == "vit_mim" ? train_mim(ctx) : train_vlm(ctx);
  };
  // Several GPUs or CPU processes (trainer/distributed.h): a launcher when train.gpus (or
  // train.procs) > 1 and no launcher's environment says this process is a rank; a rank when it does.
  const int gpus = cfg.get_int("train.gpus"), procs = cfg.get_int("train.procs");
  const bool cpu = dev == "cpu";
  LOOM_CHECK(gpus <= 1 || procs <= 1, "%s: train.gpus = %d and train.procs = %d: ranks on GPUs (train.gpus) or on the "
             "CPU (train.procs), not both", cfg.source().c_str(), gpus, procs);
  const int ranks = std::max(gpus, procs);
  if (!de.distributed() && ranks > 1) {
    // train.gpus asks for GPUs (with device auto on a machine without them, the launcher says
    // how many there are); train.procs for the CPU
    LOOM_CHECK(gpus <= 1 || cfg.get_str("train.device") != "cpu", "%s: train.gpus = %d with train.device = cpu: "
               "train.procs = %d starts that many CPU processes", cfg.source().c_str(), gpus, gpus);
    LOOM_CHECK(procs <= 1 || cpu, "%s: train.procs = %d starts CPU processes and needs train.device = cpu (it is %s; "
               "train.gpus = %d for GPUs)", cfg.source().c_str(), procs, cfg.get_str("train.device").c_str(), procs);
    std::vector<char*> args = {const_cast<char*>("train")};
    for (int i = 0; i < argc; i++) args.push_back(argv[i]);
    return launch_local(ranks, int(args.size()), args.data(), gpus > 1);
  }
  if (!de.distributed()) return run(open_run(cfg));
  LOOM_CHECK(ranks <= 1 || ranks == de.local_world, "train.%s = %d, but the launcher (%s) started %d ranks on this "
             "machine (LOCAL_WORLD_SIZE): leave train.%s out under torchrun / srun", gpus > 1 ? "gpus" : "procs",
             ranks, de.launcher.c_str(), de.local_world, gpus > 1 ? "gpus" : "procs");
  LOOM_CHECK(!cfg.get_bool("train.dry_run"), "train.dry_run is a one-process check: run it without several ranks");
  de = select_rank_device(env, cfg.get_str("train.out_dir"), !cpu);
  RunContext ctx = open_run(cfg, de.rank, de.world);
  // the ranks compare resolved values: `auto` on one rank and what it resolves to on another
  // are the same run
  Config resolved = cfg;
  resolved.set("train.device", device_name(ctx.device), "resolved");
  resolved.set("train.dtype", ctx.compute == DType::BF16 ? "bf16" : ctx.compute == DType::F16 ? "fp16" : "f32",
               "resolved");
  DataParallel dp(de, resolved, ctx.device);
  ctx.dp = &dp;
  std::printf("%s\n", dp.backend().c_str());
  int rc;
  try {
    rc = run(ctx);
  } catch (const std::exception& e) {
    dp.fail(e.what());
    throw;
  }
  dp.finish();
  return rc;
}

}  // namespace loom
