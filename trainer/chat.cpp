// chat.cpp: ./train chat, a trained VLM answering one prompt about one image (or a generated
// scene), sampled as HF generate samples (trainer/vlm_task.h: generate, sample_next).
#include <cstdio>
#include <string>
#include <vector>

#include "data/images.h"
#include "data/shapes.h"
#include "trainer/trainer.h"
#include "trainer/vlm_task.h"

namespace loom {

// ./train chat CHECKPOINT --image IMG [--prompt TEXT] [--temperature T] [--top_k K] [--top_p P]
//                        [--seed S] [--max_new_tokens N] [--device D]
int chat_command(int argc, char** argv) {
  std::string ck, image, prompt, device = "auto";
  Sampling sampling;
  uint64_t seed = 0;
  int max_new = 32;
  for (int i = 0; i < argc; i++) {
    std::string a = argv[i];
    auto val = [&](const char* name) -> std::string {
      LOOM_CHECK(i + 1 < argc, "chat: %s needs a value", name);
      return argv[++i];
    };
    auto number = [&](const char* name, double lo, double hi, bool integer) {  // the whole value, in range
      std::string v = val(name);
      int64_t n = 0;
      double x = 0;
      bool ok = integer ? parse_int(v, &n) : parse_float(v, &x);
      if (integer) x = double(n);
      LOOM_CHECK(ok && x >= lo && x <= hi, "chat: %s: expected %s in [%g, %g], got \"%s\"", name,
                 integer ? "an integer" : "a number", lo, hi, v.c_str());
      return x;
    };
    if (a == "--image") image = val("--image");
    else if (a == "--prompt") prompt = val("--prompt");
    else if (a == "--temperature") sampling.temperature = number("--temperature", 0, 1e6, false);
    else if (a == "--top_k") sampling.top_k = int(number("--top_k", 0, 1e9, true));
    else if (a == "--top_p") sampling.top_p = number("--top_p", 1e-12, 1, false);
    else if (a == "--seed") seed = uint64_t(number("--seed", 0, 9007199254740992.0, true));
    else if (a == "--max_new_tokens") max_new = int(number("--max_new_tokens", 1, 1e6, true));
    else if (a == "--device") device = val("--device");
    else if (a.rfind("--", 0) == 0) LOOM_CHECK(false, "chat: unknown option %s", a.c_str());
    else ck = a;
  }
  LOOM_CHECK(!ck.empty(), "usage: ./train chat CHECKPOINT --image IMG [--prompt TEXT] [--temperature T] [--top_k K] "
                          "[--top_p P] [--seed S] [--max_new_tokens N]");
  check_sampling(sampling);
  ck = resolve_checkpoint(ck == "latest" ? "runs/vlm_sft" : ck, "chat");  // a run folder: its newest checkpoint
  Config cfg = Config::parse(checkpoint_config_text(ck), ck + "/trainer.json");
  LOOM_CHECK(cfg.get_str("model.kind") == "vlm", "chat: %s holds a model.kind = %s run; chat needs a VLM run",
             ck.c_str(), cfg.get_str("model.kind").c_str());
  cfg.set("train.device", device);
  cfg.set("train.out_dir", ck + "/..");
  for (const char* k : {"model.init", "model.lm_init", "model.vision_init"}) cfg.set(k, "");  // the checkpoint has all
  const bool caption = cfg.get_str("data.task") == "caption";
  RunContext ctx;
  ctx.cfg = cfg;
  ctx.out_dir = ck + "/..";
  bool gpu = cuda::available();
  ctx.device = (device == "cuda" || (device == "auto" && gpu)) ? Device::CUDA : Device::CPU;
  ctx.compute = DType::F32;
  VLMConfig probe = vlm_config_from(cfg, 1, 0);
  VLMData d = build_vlm_data(ctx, probe.image_tokens());
  VLMConfig vc = vlm_config_from(cfg, d.tok->vocab_size(), d.image_token);
  Rng rng(0);
  VLM m(vc, Init{DType::F32, ctx.device, &rng});
  m.load_state_dict(load_checkpoint_model(ck), ck + "/model.safetensors");
  std::vector<float> px;
  std::string err;
  if (image.empty()) {  // no image given: a fresh scene from the default dataset
    VQASample s = make_shapes_sample(987654321, d.image_size, 7);
    px = s.image;
    if (prompt.empty()) prompt = caption ? shapes_caption_prompt() : s.question;
    std::printf("(no --image: a generated scene; the expected answer is \"%s\")\n",
                prompt == shapes_caption_prompt() ? shapes_caption(s.objects).c_str()
                                                  : answer_shapes_question(s.objects, prompt).c_str());
  } else {
    ImageStatus stt = load_image_chw(image, d.image_size, d.channels, px, &err);
    LOOM_CHECK(stt == ImageStatus::Ok, "chat: %s: %s %s", image.c_str(), to_string(stt), err.c_str());
  }
  if (prompt.empty()) prompt = caption ? shapes_caption_prompt() : "What colour is the circle?";
  Tensor img = Tensor::from_vector(px, {1, d.channels, d.image_size, d.image_size}).to(ctx.device);
  Rng sample_rng(seed);
  auto ids = generate(m, img, qa_prompt(d, prompt), max_new, d.end_id, sampling, sample_rng);
  std::printf("user: %s\nassistant: %s\n", prompt.c_str(), d.tok->decode(ids, true).c_str());
  return 0;
}

}  // namespace loom
