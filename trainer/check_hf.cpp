// check_hf.cpp: `./train check` on HF model folders (LlamaForCausalLM, SiglipVisionModel) with
// their golden.safetensors (SPEC §2).
#include <cmath>
#include <sys/stat.h>

#include "nn/hf.h"
#include "trainer/check.h"

namespace loom {

static void compare_hf_grads(const std::map<std::string, Tensor>& hf_grads, const SafeTensors& golden, CheckResult& r) {
  for (auto& [k, ref] : golden.tensors) {
    if (k.rfind("grad.", 0) != 0) continue;
    std::string name = k.substr(5);
    if (name.rfind("vision_model.", 0) == 0) name = name.substr(13);
    if (name == "pixel_values") continue;
    auto it = hf_grads.find(name);
    LOOM_CHECK(it != hf_grads.end(), "%s: no gradient for '%s' in the model", golden.path.c_str(), name.c_str());
    r.rows.push_back(make_row("grad " + name, it->second, ref));
  }
}

static std::map<std::string, Tensor> grads_of(Module& m) {
  std::map<std::string, Tensor> g;
  for (auto& [n, t] : m.named_parameters()) g[n] = t->grad().defined() ? t->grad() : Tensor::zeros_like(*t);
  return g;
}

CheckResult check_hf_folder(const std::string& dir, int device, int dtype) {
  Device dev = Device(device);
  DType dt = DType(dtype);
  HFFolder f = read_hf_folder(dir);
  SafeTensors golden = load_safetensors(dir + "/golden.safetensors");
  Rng rng(0);
  CheckResult r;
  if (f.model_type == "llama") {
    LMConfig c = llama_config(dir);
    LM lm(c, Init{dt, dev, &rng});
    lm.load_state_dict(llama_to_loom(f.weights, c, dir + "/model.safetensors"), dir);
    Tensor ids = golden.at("input.ids").to(DType::I32), labels = golden.at("input.labels").to(DType::I32);
    int B = int(ids.size(0)), T = int(ids.size(1));
    auto lv = labels.to_vector<int32_t>();
    std::vector<int32_t> tgt(size_t(B) * T, -100), pos(size_t(B) * T);
    for (int b = 0; b < B; b++)
      for (int t = 0; t < T; t++) {
        pos[size_t(b) * T + t] = t;
        if (t + 1 < T) tgt[size_t(b) * T + t] = lv[size_t(b) * T + t + 1];  // HF shifts inside the model
      }
    int64_t n = int64_t(B) * T;
    Tensor idf = ids.reshape({n}).to(dev);
    Tensor x = embedding(idf, lm.embed_tokens);
    Tensor h = lm.hidden(x, Tensor::from_vector(pos, {n}, dev), SeqInfo::dense(B, T, dev));
    {
      NoGradGuard ng;
      r.rows.push_back(make_row("logits", lm.logits(h), golden.at("output.logits")));
    }
    Tensor loss = lm.loss(h, Tensor::from_vector(tgt, {n}, dev));
    backward(loss);
    r.kind = "llama";
    r.rows.insert(r.rows.begin(), make_row("loss", loss, golden.at("output.loss")));
    compare_hf_grads(loom_to_llama(grads_of(lm), c), golden, r);
  } else if (f.model_type == "siglip_vision_model" || f.model_type == "siglip") {
    ViTConfig c = siglip_config(dir);
    ViT vit(c, Init{dt, dev, &rng});
    vit.load_state_dict(siglip_to_loom(f.weights, c, dir + "/model.safetensors"), dir);
    Tensor px = golden.at("input.pixel_values").to(dt).to(dev).requires_grad_();
    Tensor R = golden.at("input.R").to(dt).to(dev);
    Tensor hs = vit.forward(px);
    r.rows.push_back(make_row("last_hidden_state", hs, golden.at("output.last_hidden_state")));
    backward(sum(mul(hs, R)));
    r.kind = "siglip";
    r.rows.push_back(make_row("grad pixel_values", px.grad(), golden.at("grad.pixel_values")));
    compare_hf_grads(loom_to_siglip(grads_of(vit), c), golden, r);
  } else {
    LOOM_CHECK(false, "%s: model_type '%s' is not supported (llama, siglip_vision_model)", dir.c_str(),
               f.model_type.c_str());
  }
  return r;
}

}  // namespace loom
