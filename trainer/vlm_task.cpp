// vlm_task.cpp: datasets, tokenization, batches and generation for the VLM (see vlm_task.h).
#include "trainer/vlm_task.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>

#include "data/chat.h"
#include "data/fashion_mnist.h"
#include "data/jsonl.h"
#include "data/shapes.h"
#include "trainer/init_weights.h"

namespace loom {

static const std::vector<std::string> kSpecials = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"};

static bool file_exists(const std::string& p) {
  struct stat s;
  return stat(p.c_str(), &s) == 0;
}

VLMConfig vlm_config_from(const Config& cfg, int vocab, int image_token) {
  VLMConfig c;
  c.vit = vit_config_from(cfg);
  c.lm.vocab = cfg.get_int("model.lm_vocab") > 0 ? cfg.get_int("model.lm_vocab") : vocab;
  LOOM_CHECK(c.lm.vocab >= vocab, "%s: model.lm_vocab %d is smaller than the tokenizer's %d ids", cfg.source().c_str(),
             c.lm.vocab, vocab);
  c.lm.dim = cfg.get_int("model.lm_dim");
  c.lm.depth = cfg.get_int("model.lm_depth");
  c.lm.heads = cfg.get_int("model.lm_heads");
  c.lm.kv_heads = cfg.get_int("model.lm_kv_heads");
  c.lm.hidden = cfg.get_int("model.lm_hidden");
  c.lm.rope_theta = cfg.get_float("model.rope_theta");
  c.shuffle = cfg.get_int("model.shuffle");
  c.image_token = image_token;
  LOOM_CHECK(c.vit.grid() % c.shuffle == 0, "%s: the %dx%d patch grid does not divide by model.shuffle = %d",
             cfg.source().c_str(), c.vit.grid(), c.vit.grid(), c.shuffle);
  return c;
}

Sample encode_qa(const VLMData& d, const std::string& question, const std::string& answer, int image) {
  ChatEncoding e = apply_chat_template(*d.tok, {{"user", std::string(kImageTag) + "\n" + question}, {"assistant", answer}});
  Sample s;
  s.image = image;
  for (size_t i = 0; i < e.ids.size(); i++) {
    if (e.ids[i] == d.image_token) {  // one <image> id -> image_tokens positions, never trained
      s.ids.insert(s.ids.end(), size_t(d.image_tokens), d.image_token);
      s.labels.insert(s.labels.end(), size_t(d.image_tokens), kIgnoreLabel);
    } else {
      s.ids.push_back(e.ids[i]);
      s.labels.push_back(e.labels[i]);
    }
  }
  return s;
}

std::vector<int32_t> qa_prompt(const VLMData& d, const std::string& question) {
  std::vector<int32_t> ids = chat_prompt(*d.tok, {{"user", std::string(kImageTag) + "\n" + question}}), out;
  for (int32_t t : ids) {
    if (t == d.image_token) out.insert(out.end(), size_t(d.image_tokens), d.image_token);
    else out.push_back(t);
  }
  return out;
}

// Majority baseline: always answering a question type's most frequent training answer.
static void qa_baseline(VLMData& d, const std::vector<QA>& train_qa) {
  std::map<std::string, std::map<std::string, int>> counts;
  for (auto& q : train_qa) counts[q.qtype][q.answer]++;
  std::map<std::string, std::pair<int, int>> hit;  // qtype -> (correct, total) on validation
  for (auto& q : d.val) {
    auto& c = counts[q.qtype];
    std::string best;
    int bc = -1;
    for (auto& [a, n] : c)
      if (n > bc) bc = n, best = a;
    hit[q.qtype].first += q.answer == best;
    hit[q.qtype].second++;
    hit["all"].first += q.answer == best;
    hit["all"].second++;
  }
  d.baseline_text.clear();
  for (auto& [t, h] : hit) {
    d.baseline[t] = h.second ? double(h.first) / h.second : 0;
    char b[128];
    std::snprintf(b, sizeof b, "majority baseline %-10s %5.1f%%\n", t.c_str(), 100 * d.baseline[t]);
    d.baseline_text += b;
  }
}

VLMData build_vlm_data(const RunContext& ctx, int image_tokens) {
  const Config& cfg = ctx.cfg;
  VLMData d;
  d.image_size = cfg.get_int("model.image_size");
  d.channels = cfg.get_int("model.channels");
  d.image_tokens = image_tokens;
  std::string ds = cfg.get_str("data.dataset");
  uint64_t seed = uint64_t(cfg.get_int64("data.seed"));
  int ntrain = cfg.get_int("data.train_samples"), nval = cfg.get_int("data.val_samples");
  std::vector<QA> train_qa;
  if (ds == "shapes") {
    LOOM_CHECK(d.channels == 3, "%s: the shapes dataset is RGB: model.channels must be 3", cfg.source().c_str());
    // train = samples [0, ntrain), validation = [ntrain, ntrain + nval): disjoint by index
    // data.task = caption: the same scenes, each with "Describe the image." and its caption
    const bool caption = cfg.get_str("data.task") == "caption";
    for (int i = 0; i < ntrain + nval; i++) {
      VQASample s = make_shapes_sample(i, d.image_size, seed);
      d.images.push_back(std::move(s.image));
      QA q = caption ? QA{shapes_caption_prompt(), shapes_caption(s.objects), "caption", i}
                     : QA{s.question, s.answer, s.qtype, i};
      (i < ntrain ? train_qa : d.val).push_back(q);
    }
  } else if (ds == "fashion_mnist") {
    LOOM_CHECK(d.channels == 1 && d.image_size == 28, "%s: fashion_mnist images are 1x28x28 (model.channels = 1, "
               "model.image_size = 28)", cfg.source().c_str());
    ImageSet tr = load_fashion_mnist("train", "/usr/share/datasets/fashion-mnist", ntrain);
    ImageSet te = load_fashion_mnist("test", "/usr/share/datasets/fashion-mnist", nval);
    const auto& names = fashion_mnist_classes();
    size_t px = size_t(tr.c) * tr.h * tr.w;
    auto add = [&](const ImageSet& s, std::vector<QA>& out) {
      for (int i = 0; i < s.n; i++) {
        d.images.emplace_back(s.pixels.begin() + long(i * px), s.pixels.begin() + long((i + 1) * px));
        out.push_back({"What piece of clothing is this?", names[size_t(s.labels[size_t(i)])], "class",
                       int(d.images.size()) - 1});
      }
    };
    add(tr, train_qa);
    add(te, d.val);
  } else if (ds == "jsonl") {
    JsonlOptions o;
    o.image_size = d.image_size;
    o.channels = d.channels;
    o.strict = cfg.get_bool("data.strict");
    DataStats st;
    auto convs = load_llava_jsonl(cfg.get_str("data.path"), o, &st);
    std::printf("%s\n", st.summary().c_str());
    LOOM_CHECK(!convs.empty(), "%s: no usable conversations", cfg.get_str("data.path").c_str());
    int nv = std::min<int>(nval, int(convs.size()) / 10);
    for (size_t i = 0; i < convs.size(); i++) {
      auto& c = convs[i];
      d.images.push_back(std::move(c.image));
      std::string q = c.turns[0].value;
      size_t at = q.find(kImageTag);
      if (at != std::string::npos) q.erase(at, std::string(kImageTag).size());
      while (!q.empty() && (q[0] == '\n' || q[0] == ' ')) q.erase(0, 1);
      QA qa{q, c.turns.size() > 1 ? c.turns[1].value : "", "qa", int(d.images.size()) - 1};
      (int(i) >= int(convs.size()) - nv ? d.val : train_qa).push_back(qa);
    }
  } else if (ds == "synthetic") {
    // SPEC §3 timing workload: random images (a pool of 64) and random text of lognormal
    // length; no tokenizer text, no evaluation
    Rng r(seed);
    for (int i = 0; i < 64; i++) {
      std::vector<float> img(size_t(d.channels) * d.image_size * d.image_size);
      for (auto& x : img) x = float(r.normal());
      d.images.push_back(std::move(img));
    }
  } else {
    LOOM_CHECK(false, "%s: data.dataset = %s is not a VLM dataset (shapes, fashion_mnist, jsonl, synthetic)",
               cfg.source().c_str(), ds.c_str());
  }

  // tokenizer: given, the one model.init's run was trained with (cached here for eval,
  // export and chat of this run), cached from an earlier run, or trained on this corpus
  std::string tp = cfg.get_str("data.tokenizer"), cache = ctx.out_dir + "/tokenizer.json";
  const std::string init = cfg.get_str("model.init");
  if (tp.empty() && !init.empty()) {
    tp = vlm_init_tokenizer(init);
    std::printf("tokenizer %s (from model.init = %s)\n", tp.c_str(), init.c_str());
  }
  if (!tp.empty()) d.tok = std::make_shared<Tokenizer>(Tokenizer::from_file(tp));
  else if (file_exists(cache)) d.tok = std::make_shared<Tokenizer>(Tokenizer::from_file(cache));
  else {
    std::vector<std::string> corpus;
    for (auto& q : train_qa) corpus.push_back(q.question + "\n" + q.answer);
    // captions (stage 1) train the tokenizer stage 2 continues with: give it the questions too
    if (ds == "shapes" && cfg.get_str("data.task") == "caption")
      for (auto& t : shapes_corpus()) corpus.push_back(t);
    corpus.push_back("user\nassistant\nsystem\n");
    double t0 = now_ms();
    d.tok = std::make_shared<Tokenizer>(Tokenizer::train(corpus, cfg.get_int("data.vocab_size"), kSpecials));
    if (ctx.rank == 0) d.tok->save(cache);  // every rank trains the same one; one writer
    std::printf("trained a byte-level BPE tokenizer: %d ids in %.0f ms (cached in %s)\n", d.tok->vocab_size(),
                now_ms() - t0, cache.c_str());
  }
  if (!tp.empty()) {
    // A tokenizer.json made for another chat format (Llama 2, Mistral and Gemma ship
    // SentencePiece-kind files without ChatML) lacks some of these tokens: they are added as
    // special tokens after its vocabulary, as nanoVLM does through HF's add_special_tokens,
    // and the LM's embedding grows with them. A token only in the model vocabulary becomes a
    // special token with its id, so that it is cut out of the text as one token.
    std::string added;
    for (auto& s : kSpecials)
      if (!d.tok->has_token(s) || !d.tok->is_special(d.tok->token_id(s)))
        added += (added.empty() ? "" : ", ") + s + (d.tok->has_token(s) ? "" : " (new id)");
    if (!added.empty()) {
      int before = d.tok->vocab_size();
      d.tok = std::make_shared<Tokenizer>(d.tok->with_special_tokens(kSpecials));
      std::printf("tokenizer %s: added the chat special tokens %s; %d -> %d ids\n", tp.c_str(), added.c_str(),
                  before, d.tok->vocab_size());
    }
  }
  if (cfg.get_str("data.tokenizer").empty() && !init.empty() && ctx.rank == 0) d.tok->save(cache);
  for (auto& s : kSpecials)
    LOOM_CHECK(d.tok->has_token(s), "%s: the tokenizer lacks the special token %s", d.tok->origin().c_str(), s.c_str());
  d.image_token = d.tok->token_id("<image>");
  d.pad_id = d.tok->token_id("<|endoftext|>");
  d.end_id = d.tok->token_id("<|im_end|>");

  const int row = cfg.get_int("data.pack_max_length");
  std::vector<std::vector<int>> given_rows;  // data.synth_rows: the rows as given, not packed here
  if (ds == "synthetic") {  // samples: image tokens + lognormal(median, sigma) text tokens, the first
                           // synth_prompt_len of them a prompt without targets (as the reference's)
    Rng r(seed + 1);
    const int prompt = cfg.get_int("data.synth_prompt_len");
    int n = ntrain > 0 ? ntrain : 4096, V = cfg.get_int("model.lm_vocab") > 0 ? cfg.get_int("model.lm_vocab") : d.tok->vocab_size();
    double med = cfg.get_int("data.synth_median_len"), sig = cfg.get_float("data.synth_sigma");
    auto add_sample = [&](int L) {  // L text tokens after the image's
      Sample s;
      s.image = int(d.train.size()) % int(d.images.size());
      s.ids.assign(size_t(d.image_tokens), d.image_token);
      s.labels.assign(size_t(d.image_tokens), kIgnoreLabel);
      for (int t = 0; t < L; t++) {
        int32_t id = int32_t(4 + r.randint(V - 4));  // past the special tokens
        s.ids.push_back(id);
        s.labels.push_back(t < prompt ? kIgnoreLabel : id);
      }
      d.train.push_back(std::move(s));
    };
    const std::string rows_file = cfg.get_str("data.synth_rows");
    if (!rows_file.empty()) {  // each line a packed row of sample lengths, image tokens included
      for (const auto& lengths : read_row_lengths(rows_file, d.image_tokens, row)) {
        given_rows.emplace_back();
        for (int len : lengths) {
          given_rows.back().push_back(int(d.train.size()));
          add_sample(len - d.image_tokens);
        }
      }
    } else {
      for (int i = 0; i < n; i++) {
        int L = int(std::exp(r.normal() * sig + std::log(med)));
        add_sample(std::max(cfg.get_int("data.synth_min_len"), std::min(cfg.get_int("data.synth_max_len"), L)));
      }
    }
  }
  for (auto& q : train_qa) d.train.push_back(encode_qa(d, q.question, q.answer, q.image));
  for (auto& q : d.val) d.val_samples.push_back(encode_qa(d, q.question, q.answer, q.image));
  if (!given_rows.empty()) {
    std::printf("data.synth_rows: %zu rows, %zu samples, from %s (trained as given, not packed here)\n", given_rows.size(),
                d.train.size(), cfg.get_str("data.synth_rows").c_str());
    d.rows = given_rows;
    d.stats = PackingStats{};
    d.stats.max_len = row;
    d.stats.rows = int64_t(given_rows.size());
    for (const Sample& smp : d.train) d.stats.samples++, d.stats.real_tokens += int64_t(smp.ids.size());
  } else {
    d.rows = plan_rows(d.train, row, cfg.get_bool("data.use_sequence_packing"), cfg.get_bool("data.strict"), &d.stats);
  }
  LOOM_CHECK(!d.rows.empty(), "%s: no training sample fits data.pack_max_length = %d", cfg.source().c_str(), row);
  if (d.stats.too_long) std::printf("warning: %lld samples longer than %d tokens skipped\n", (long long)d.stats.too_long, row);
  qa_baseline(d, train_qa);
  return d;
}

VLMBatch to_device(const VLMData& d, const PackedBatch& pb, Device dev, DType dtype) {
  VLMBatch b;
  int64_t n = int64_t(pb.ids.size());
  size_t px = size_t(d.channels) * d.image_size * d.image_size;
  std::vector<float> img(pb.images.size() * px);
  for (size_t i = 0; i < pb.images.size(); i++) {
    const auto& src = d.images[size_t(pb.images[i])];
    std::copy(src.begin(), src.end(), img.begin() + long(i * px));
  }
  b.images = Tensor::from_vector(img, {int64_t(pb.images.size()), d.channels, d.image_size, d.image_size})
                 .to(dtype)
                 .to(dev);
  b.ids = Tensor::from_vector(pb.ids, {n}, dev);
  b.pos = Tensor::from_vector(pb.pos, {n}, dev);
  b.targets = Tensor::from_vector(pb.targets, {n}, dev);
  b.image_positions = Tensor::from_vector(pb.image_positions, {int64_t(pb.image_positions.size())}, dev);
  b.seq = SeqInfo::packed(pb.cu_seqlens, dev);
  set_loss_rows(b, pb.targets, dev);
  return b;
}

StagedBatch stage_batch(const VLMData& d, const PackedBatch& pb, const std::shared_ptr<PinnedPool>& pool, DType dtype,
                        int64_t loss_multiple) {
  const int64_t n = int64_t(pb.ids.size()), ni = int64_t(pb.images.size());
  const size_t px = size_t(d.channels) * d.image_size * d.image_size;
  const int64_t nip = int64_t(pb.image_positions.size()), ncu = int64_t(pb.cu_seqlens.size());
  std::vector<int32_t> rows, kept;
  loss_rows_of(pb.targets, rows, kept, loss_multiple);
  const int64_t nk = int64_t(rows.size());
  StagedBatch b(pool, StagedBatch::bytes_for({{dtype, ni * int64_t(px)}, {DType::I32, n}, {DType::I32, n},
                                              {DType::I32, n}, {DType::I32, nip}, {DType::I32, ncu},
                                              {DType::I32, nk}, {DType::I32, nk}}));
  void* img = b.add("images", dtype, {ni, d.channels, d.image_size, d.image_size});
  for (int64_t i = 0; i < ni; i++) {
    const float* src = d.images[size_t(pb.images[size_t(i)])].data();
    if (dtype == DType::BF16)
      for (size_t j = 0; j < px; j++) static_cast<bf16*>(img)[size_t(i) * px + j] = bf16(src[j]);
    else if (dtype == DType::F16)
      for (size_t j = 0; j < px; j++) static_cast<f16*>(img)[size_t(i) * px + j] = f16(src[j]);
    else if (dtype == DType::F64)
      for (size_t j = 0; j < px; j++) static_cast<double*>(img)[size_t(i) * px + j] = src[j];
    else
      std::copy(src, src + px, static_cast<float*>(img) + size_t(i) * px);
  }
  auto put = [&](const char* name, const std::vector<int32_t>& v) {
    std::copy(v.begin(), v.end(), b.add_as<int32_t>(name, DType::I32, {int64_t(v.size())}));
  };
  put("ids", pb.ids);
  put("pos", pb.pos);
  put("targets", pb.targets);
  put("image_positions", pb.image_positions);
  put("cu_seqlens", pb.cu_seqlens);
  put("loss_rows", rows);
  put("loss_targets", kept);
  LOOM_CHECK(ncu >= 2 && pb.cu_seqlens[0] == 0, "packed batch: cu_seqlens must start at 0 and hold a sequence");
  b.meta["nseq"] = ncu - 1;
  b.meta["max_seqlen"] = pb.max_seqlen;
  b.meta["images"] = ni;
  b.meta["real_tokens"] = pb.real_tokens;
  return b;
}

VLMBatch from_staged(const StagedBatch& b, const std::map<std::string, Tensor>& t) {
  VLMBatch v;
  v.images = t.at("images");
  v.ids = t.at("ids");
  v.pos = t.at("pos");
  v.targets = t.at("targets");
  v.image_positions = t.at("image_positions");
  v.seq.cu_q = t.at("cu_seqlens");
  v.seq.cu_k = v.seq.cu_q;
  v.seq.nseq = int(b.meta.at("nseq"));
  v.seq.max_seqlen = int(b.meta.at("max_seqlen"));
  if (t.count("loss_rows")) {
    v.loss_rows = t.at("loss_rows");
    v.loss_targets = t.at("loss_targets");
  }
  return v;
}

void check_sampling(const Sampling& s) {
  LOOM_CHECK(std::isfinite(s.temperature) && s.temperature >= 0, "sampling: temperature must be >= 0, got %g",
             s.temperature);
  LOOM_CHECK(s.top_k >= 0, "sampling: top_k must be >= 0 (0: every token), got %d", s.top_k);
  LOOM_CHECK(std::isfinite(s.top_p) && s.top_p > 0 && s.top_p <= 1, "sampling: top_p must be in (0, 1], got %g",
             s.top_p);
}

int32_t sample_next(std::vector<double> logits, const Sampling& s, Rng& rng) {
  LOOM_CHECK(!logits.empty(), "sample_next: no logits");
  const size_t V = logits.size();
  const size_t best = size_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  if (s.temperature <= 0) return int32_t(best);
  // candidates by descending logit (ties: lower id first), cut to top_k
  std::vector<int32_t> order(V);
  for (size_t i = 0; i < V; i++) order[i] = int32_t(i);
  size_t keep = s.top_k > 0 ? std::min(V, size_t(s.top_k)) : V;
  auto by_logit = [&](int32_t a, int32_t b) {
    const double la = logits[size_t(a)], lb = logits[size_t(b)];
    return la > lb || (la == lb && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + std::ptrdiff_t(keep), order.end(), by_logit);
  order.resize(keep);
  // softmax(logits / T) over the candidates (the largest first, so exp(0) = 1 is the max)
  const double mx = logits[size_t(order[0])];
  std::vector<double> p(keep);
  double z = 0;
  for (size_t i = 0; i < keep; i++) z += (p[i] = std::exp((logits[size_t(order[i])] - mx) / s.temperature));
  // nucleus: the shortest prefix whose mass reaches top_p of the total
  if (s.top_p < 1) {
    double cum = 0;
    size_t n = 0;
    while (n < keep && cum < s.top_p * z) cum += p[n++];
    keep = std::max<size_t>(n, 1);
    z = 0;
    for (size_t i = 0; i < keep; i++) z += p[i];
  }
  double u = rng.uniform() * z;
  for (size_t i = 0; i < keep; i++)
    if ((u -= p[i]) < 0) return order[i];
  return order[keep - 1];  // u rounded past the last candidate
}

std::vector<int32_t> generate(const VLM& m, const Tensor& image, const std::vector<int32_t>& prompt, int max_new,
                              int32_t stop_id, const Sampling& sampling, Rng& rng) {
  check_sampling(sampling);
  NoGradGuard ng;
  Device dev = m.lm.embed_tokens.device();
  int64_t n = int64_t(prompt.size());
  KVCache cache = m.lm.make_cache(n + max_new + 1);
  VLMBatch b;
  b.images = image;
  b.ids = Tensor::from_vector(prompt, {n}, dev);
  std::vector<int32_t> ip;
  for (int64_t i = 0; i < n; i++)
    if (prompt[size_t(i)] == m.cfg.image_token) ip.push_back(int32_t(i));
  b.image_positions = Tensor::from_vector(ip, {int64_t(ip.size())}, dev);
  if (ip.empty()) b.images = Tensor();
  Tensor h = m.lm.hidden_cached(m.embed(b), cache);  // prefill
  std::vector<int32_t> out;
  for (int t = 0; t < max_new; t++) {
    std::vector<double> logits = m.lm.logits(h.narrow(0, h.size(0) - 1, 1)).to_vector<double>();
    const int32_t next = sample_next(std::move(logits), sampling, rng);
    if (next == stop_id) break;
    out.push_back(next);
    Tensor id = Tensor::from_vector(std::vector<int32_t>{next}, {1}, dev);
    h = m.lm.hidden_cached(embedding(id, m.lm.embed_tokens), cache);
  }
  return out;
}

}  // namespace loom
