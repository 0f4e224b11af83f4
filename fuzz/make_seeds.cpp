// make_seeds.cpp: writes the seed corpus of every fuzz target into OUT/<target>/, made from
// the repo's own fixtures and configs (run from the repo root):
//   safetensors  the fixtures' tensor tables with their three smallest tensors, and small
//                files of every dtype with metadata
//   config       configs/*.cfg, and one with overrides after a NUL byte
//   jsonl        valid LLaVA lines and one line per refusal reason
//   tokenizer    the fixtures' tokenizer.json files and a small trained one, each followed by
//                a NUL byte and text (ASCII, accents, CJK, emoji, special tokens)
//   image        PNG (grey, grey+alpha, RGB, RGBA) and JPEG (grey, RGB) images
//   idx          the first items of the Fashion-MNIST files (plain and gzip) when installed,
//                and small made-up IDX files otherwise
//   rows         data.synth_rows files: the reference's batch as tools/ref_vlm_rows.py writes
//                it, and one file per refusal reason
// Usage: make_seeds OUT
#include <dirent.h>
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb_image_write.h>

#include "data/fashion_mnist.h"
#include "data/tokenizer.h"
#include "tensor/safetensors.h"

using namespace loom;

static std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

static void put(const std::string& dir, const std::string& name, const std::string& bytes) {
  ::mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

static std::vector<std::string> list(const std::string& dir, const std::string& suffix) {
  std::vector<std::string> v;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string n = e->d_name;
      if (n.size() > suffix.size() && n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0)
        v.push_back(dir + "/" + n);
    }
    closedir(d);
  }
  std::sort(v.begin(), v.end());
  return v;
}

static void png_jpg(const std::string& dir) {
  int n = 0;
  for (int c : {1, 2, 3, 4})
    for (int w : {3, 9}) {
      std::vector<unsigned char> px(size_t(w) * 5 * c);
      for (size_t i = 0; i < px.size(); i++) px[i] = (unsigned char)(i * 37 + c);
      std::string p = dir + "/img" + std::to_string(n++) + ".png";
      stbi_write_png(p.c_str(), w, 5, c, px.data(), w * c);
      if (c == 1 || c == 3) {
        std::string q = dir + "/img" + std::to_string(n++) + ".jpg";
        stbi_write_jpg(q.c_str(), w, 5, c, px.data(), 80);
      }
    }
}

static void gz_write(const std::string& path, const std::string& bytes) {
  gzFile g = gzopen(path.c_str(), "wb");
  gzwrite(g, bytes.data(), unsigned(bytes.size()));
  gzclose(g);
}

static std::string idx_bytes(const std::vector<uint32_t>& dims, const std::vector<unsigned char>& data) {
  std::string s = {0, 0, 8, char(dims.size())};
  for (uint32_t d : dims) s += {char(d >> 24), char(d >> 16), char(d >> 8), char(d)};
  return s + std::string(data.begin(), data.end());
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds OUT\n");
    return 2;
  }
  std::string out = argv[1];
  ::mkdir(out.c_str(), 0755);

  // safetensors
  std::string sd = out + "/safetensors";
  int n = 0;
  std::vector<std::string> fixtures = list("tests/fixtures", ".safetensors");
  for (const char* d : {"tests/fixtures/holdout", "tests/fixtures/llama_tiny_s0", "tests/fixtures/siglip_tiny_s0"})
    for (auto& f : list(d, ".safetensors")) fixtures.push_back(f);
  for (auto& f : fixtures) {
    SafeTensors st = load_safetensors(f);
    std::vector<std::pair<int64_t, std::string>> by_size;
    for (auto& [k, t] : st.tensors) by_size.push_back({t.numel(), k});
    std::sort(by_size.begin(), by_size.end());
    std::map<std::string, Tensor> small;
    for (size_t i = 0; i < by_size.size() && i < 3; i++) small[by_size[i].second] = st.tensors[by_size[i].second];
    std::map<std::string, std::string> meta;
    for (auto& [k, v] : st.metadata) meta[k] = v.substr(0, 200);
    std::string p = sd + "_tmp.safetensors";
    ::mkdir(sd.c_str(), 0755);
    save_safetensors(p, small, meta);
    put(sd, "fixture" + std::to_string(n++), slurp(p));
    std::remove(p.c_str());
  }
  {
    std::map<std::string, Tensor> t = {{"f32", Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3})},
                                       {"f64", Tensor::from_vector(std::vector<double>{1.5}, {1})},
                                       {"empty", Tensor::empty({0, 3}, DType::F32)}};
    std::string p = out + "/st.tmp";
    save_safetensors(p, t, {{"format", "pt"}});
    put(sd, "dtypes", slurp(p));
    std::remove(p.c_str());
  }
  // an F16 / BF16 / I64 / BOOL table written by hand (the writer never emits F16 or BOOL)
  {
    std::string h = R"({"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[1],"data_offsets":[4,6]},)"
                    R"("c":{"dtype":"I64","shape":[1],"data_offsets":[6,14]},"d":{"dtype":"BOOL","shape":[2],"data_offsets":[14,16]}})";
    uint64_t hl = h.size();
    std::string s(reinterpret_cast<const char*>(&hl), 8);
    put(sd, "hand", s + h + std::string(16, '\x3c'));
  }

  // config
  n = 0;
  for (auto& f : list("configs", ".cfg")) put(out + "/config", "cfg" + std::to_string(n++), slurp(f));
  put(out + "/config", "overrides",
      slurp("configs/vlm_sft.cfg") + std::string(1, '\0') + "--train.lr=5e-4\n--model.kind=mim\n--train.out_dir=\"a b\"");

  // jsonl
  const char* lines[] = {
      R"({"image": "a.png", "conversations": [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A red circle."}]})",
      R"({"image": "d/b.jpg", "conversations": [{"from": "human", "value": "Look: <image>"}, {"from": "gpt", "value": "ok"}, {"from": "human", "value": "and?"}, {"from": "gpt", "value": "no"}]})",
      R"({"image": "/abs/c.png", "conversations": [{"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "x"}]})",
      R"({"image": "a.png", "conversations": [{"from": "gpt", "value": "<image>"}]})",
      R"({"image": 3, "conversations": []})",
      R"([1, 2, {"image": "a.png"}])",
      R"({"image": "a.png", "conversations": [{"from": "human", "value": "\u00e9\ud83d\ude00 <image>"}, {"from": "gpt", "value": "\u0000"}]})",
  };
  n = 0;
  for (const char* l : lines) put(out + "/jsonl", "line" + std::to_string(n++), l);

  // tokenizer
  std::string texts = std::string(1, '\0') + "What colour is the square?<|im_end|> Où? 左上 🙂 123  \t\n<image>";
  n = 0;
  for (const char* f : {"tests/fixtures/tokenizer_bpe1000_s0/tokenizer.json", "tests/fixtures/tokenizer_train_hf/tokenizer.json",
                        "tests/fixtures/tokenizer_spm_llama2/tokenizer.json", "tests/fixtures/tokenizer_spm_gemma/tokenizer.json",
                        "tests/fixtures/tokenizer_spm_mistral/tokenizer.json"})
    put(out + "/tokenizer", "fixture" + std::to_string(n++), slurp(f) + texts);
  Tokenizer small = Tokenizer::train({"a small corpus for a small tokenizer", "What colour is it? red 12"}, 290,
                                     {"<|endoftext|>", "<image>"});
  put(out + "/tokenizer", "small", small.to_json() + texts);
  // the steps after the model: truncation, BERT's post-processor, padding, and a pair
  Tokenizer::Truncation tr;
  tr.max_length = 9;
  Tokenizer::Padding pd;
  pd.multiple_of = 8;
  nlohmann::json doc = nlohmann::json::parse(small.with_truncation(tr).with_padding(pd).to_json());
  doc["post_processor"] = {{"type", "BertProcessing"},
                           {"sep", {"<image>", small.token_id("<image>")}},
                           {"cls", {"<|endoftext|>", small.token_id("<|endoftext|>")}}};
  put(out + "/tokenizer", "pipeline", doc.dump() + texts + std::string(1, '\0') + "How many circles? 3");

  // image
  ::mkdir((out + "/image").c_str(), 0755);
  png_jpg(out + "/image");

  // idx
  std::string id = out + "/idx";
  ::mkdir(id.c_str(), 0755);
  try {
    std::vector<uint32_t> dims;
    auto img = read_idx("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz", 3, dims, 2);
    put(id, "images2", idx_bytes(dims, img));
    gz_write(id + "/images2.gz", idx_bytes(dims, img));
    auto lab = read_idx("/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz", 1, dims, 16);
    put(id, "labels16", idx_bytes(dims, lab));
    gz_write(id + "/labels16.gz", idx_bytes(dims, lab));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_seeds: %s (made-up IDX seeds only)\n", e.what());
  }
  put(id, "made_up3", idx_bytes({2, 3, 4}, std::vector<unsigned char>(24, 7)));
  put(id, "made_up1", idx_bytes({5}, {0, 1, 2, 3, 9}));
  put(id, "made_up2", idx_bytes({2, 2}, {1, 2, 3, 4}));
  // rows (data.synth_rows)
  const char* row_files[] = {
      "# torch_ref.py vlm_batch (packed): 8 rows of 2048 tokens, 41 samples\n290 290 290 290 290 290 290\n1051 991\n"
      "827 823 398\n308 308 308 308 308 308 200\n429 429 429 429 332\n457 456 456 456 223\n"
      "290 289 289 289 289 289 288\n462 462 462 460 202\n",
      "100, 200,\t300 # a comment\r\n\n2048\n",
      "100 2049\n", "1000 1000 100\n", "49 100\n", "100 -3\n", "+100\n", "1e3\n", "99999999999999999999\n",
      "# nothing\n",
  };
  n = 0;
  for (const char* f : row_files) put(out + "/rows", "rows" + std::to_string(n++), f);
  std::printf("seeds written to %s\n", out.c_str());
  return 0;
}
