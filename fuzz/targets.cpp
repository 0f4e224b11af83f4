// targets.cpp: the fuzz targets (see targets.h).
#include "fuzz/targets.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>

#include "data/fashion_mnist.h"
#include "data/images.h"
#include "data/jsonl.h"
#include "data/packing.h"
#include "data/tokenizer.h"
#include "tensor/safetensors.h"
#include "trainer/config.h"

namespace loom::fuzz {

namespace {

// A broken property: report and abort (the fuzzer keeps the input).
[[noreturn]] void broken(const std::string& what) {
  std::fprintf(stderr, "fuzz property broken: %s\n", what.c_str());
  std::abort();
}

// The input cut at its first NUL byte: (before, after); after is empty when there is none.
std::pair<std::string, std::string> split_nul(const uint8_t* data, size_t size) {
  std::string s(reinterpret_cast<const char*>(data), size);
  size_t z = s.find('\0');
  if (z == std::string::npos) return {s, ""};
  return {s.substr(0, z), s.substr(z + 1)};
}

}  // namespace

int safetensors(const uint8_t* data, size_t size) {
  try {
    SafeTensors st = parse_safetensors(std::string(reinterpret_cast<const char*>(data), size), "fuzz.safetensors");
    for (auto& [name, t] : st.tensors)
      if (t.nbytes() > int64_t(size)) broken("tensor '" + name + "' holds more bytes than the file");
  } catch (const std::exception&) {
  }
  return 0;
}

int config(const uint8_t* data, size_t size) {
  auto [text, rest] = split_nul(data, size);
  try {
    Config c = Config::parse(text, "fuzz.cfg");
    size_t a = 0;
    while (a < rest.size()) {
      size_t b = rest.find('\n', a);
      if (b == std::string::npos) b = rest.size();
      c.apply_override(rest.substr(a, b - a));
      a = b + 1;
    }
    std::string d = c.dump();
    Config again = Config::parse(d, "fuzz.cfg");  // the same origin: the header names it
    if (again.dump() != d) broken("dump() does not parse back to itself:\n" + d);
    validate_config(c);
  } catch (const std::exception&) {
  }
  return 0;
}

int jsonl(const uint8_t* data, size_t size) {
  std::string line(reinterpret_cast<const char*>(data), size);
  try {
    ConversationSample s;
    std::string reason, message;
    if (parse_llava_line(line, "/nonexistent", s, &reason, &message)) {
      size_t tags = 0;
      for (size_t i = 0; i < s.turns.size(); i++) {
        if (s.turns[i].from != (i % 2 ? "gpt" : "human")) broken("accepted turns that do not alternate");
        for (size_t p = s.turns[i].value.find(kImageTag); p != std::string::npos; p = s.turns[i].value.find(kImageTag, p + 1))
          tags++;
      }
      if (tags != 1 || s.turns.size() % 2 || s.image_path.empty()) broken("accepted a line breaking the schema");
    } else if (reason.empty()) {
      broken("refused a line without a reason");
    }
  } catch (const std::exception&) {
  }
  return 0;
}

int tokenizer(const uint8_t* data, size_t size) {
  static const Tokenizer fallback = Tokenizer::train(
      {"What colour is the square? red", "How many circles are there? 3", "Où est le triangle ? 左上 🙂"}, 300,
      {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"});
  auto [json, text] = split_nul(data, size);
  const Tokenizer* tok = &fallback;
  Tokenizer loaded = fallback;
  try {
    loaded = Tokenizer::from_json(json, "fuzz tokenizer.json");
    tok = &loaded;
  } catch (const std::exception&) {
  }
  try {
    std::vector<int32_t> ids = tok->encode(text);
    for (int32_t id : ids)
      if (id < 0 || id >= tok->vocab_size()) broken("encode produced id " + std::to_string(id) + " outside the vocabulary");
    std::string back = tok->decode(ids);
    if (tok == &fallback && back != text) broken("the byte-level tokenizer does not round-trip valid UTF-8");
    std::vector<int32_t> with;
    try {
      with = tok->encode(text, true);
    } catch (const std::runtime_error&) {  // a post-processor loom cannot apply: refused, as documented
      return 0;
    }
    std::vector<int32_t> expect = tok->special_prefix();
    expect.insert(expect.end(), ids.begin(), ids.end());
    expect.insert(expect.end(), tok->special_suffix().begin(), tok->special_suffix().end());
    if (with != expect) broken("encode(text, true) is not the post-processor's tokens around encode(text)");
    for (int32_t id : with)
      if (id < 0 || id >= tok->vocab_size()) broken("the post-processor added id " + std::to_string(id) + " outside the vocabulary");
  } catch (const std::invalid_argument&) {  // not valid UTF-8: refused, as documented
  } catch (const std::exception&) {
  }
  // The whole pipeline (truncation, the pair template, padding; a second NUL starts the pair):
  // whatever it refuses, it returns four vectors of one length, ids of the vocabulary and masks
  // of 0 / 1 (without special tokens, only padding is special), and one sequence without
  // truncation or padding is encode()'s ids.
  // The same holds for every overflowing window (nested ones too), and without truncation
  // there are none.
  const size_t z = text.find('\0');
  const std::string first = text.substr(0, z), second = z == std::string::npos ? "" : text.substr(z + 1);
  for (bool special : {false, true}) {
    try {
      Tokenizer::Encoding e = tok->encode_full(first, z == std::string::npos ? nullptr : &second, special);
      std::function<void(const Tokenizer::Encoding&)> valid = [&](const Tokenizer::Encoding& w) {
        if (w.type_ids.size() != w.ids.size() || w.attention_mask.size() != w.ids.size() ||
            w.special_tokens_mask.size() != w.ids.size())
          broken("encode_full returned ids, type ids and masks of different lengths");
        for (size_t i = 0; i < w.ids.size(); i++)
          if (w.special_tokens_mask[i] > 1 || (!special && w.attention_mask[i] == 1 && w.special_tokens_mask[i] != 0))
            broken("encode_full's special-tokens mask marks a text token, or holds more than 1");
        for (int32_t id : w.ids)
          if (id < 0 || id >= tok->vocab_size()) broken("encode_full produced id " + std::to_string(id) + " outside the vocabulary");
        for (uint8_t m : w.attention_mask)
          if (m > 1) broken("encode_full's attention mask holds " + std::to_string(m));
        for (const Tokenizer::Encoding& o : w.overflowing) valid(o);
      };
      valid(e);
      if (!tok->truncation() && !e.overflowing.empty()) broken("overflowing windows without truncation");
      if (z == std::string::npos && !tok->truncation() && !tok->padding() && e.ids != tok->encode(first, special))
        broken("encode_full of one sequence without truncation or padding is not encode()");
    } catch (const std::exception&) {  // refused: not UTF-8, a truncation the lengths cannot meet, a malformed section
    }
  }
  return 0;
}

int image(const uint8_t* data, size_t size) {
  for (int channels : {1, 3}) {
    std::vector<float> out;
    std::string err;
    try {
      ImageStatus st = decode_image_chw(data, size, 8, channels, out, &err, int64_t(1) << 20);
      if (st == ImageStatus::Ok && out.size() != size_t(channels) * 64) broken("decoded image of the wrong size");
      if (st != ImageStatus::Ok && err.empty()) broken("refused an image without a reason");
    } catch (const std::exception&) {
    }
  }
  return 0;
}

int idx(const uint8_t* data, size_t size) {
  // read_idx reads through zlib from a file: the input goes to one per process, under $TMPDIR
  // (or /tmp), removed when the process exits
  static const std::string path = [] {
    const char* t = std::getenv("TMPDIR");
    static std::string p = std::string(t && *t ? t : "/tmp") + "/loom_fuzz_idx_" + std::to_string(::getpid());
    static const pid_t owner = ::getpid();
    std::atexit([] {
      if (::getpid() == owner) std::remove(p.c_str());
    });
    return p;
  }();
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(data), std::streamsize(size));
  }
  for (int ndim = 1; ndim <= 3; ndim++) {
    try {
      std::vector<uint32_t> dims;
      std::vector<unsigned char> d = read_idx(path, ndim, dims, 0);
      uint64_t n = 1;
      for (uint32_t x : dims) n *= x;
      if (dims.size() != size_t(ndim) || d.size() != n) broken("read_idx returned sizes that disagree with its data");
    } catch (const std::exception&) {
    }
  }
  return 0;
}

int rows(const uint8_t* data, size_t size) {
  std::vector<std::vector<int>> r;
  try {
    r = parse_row_lengths(std::string(reinterpret_cast<const char*>(data), size), "fuzz.rows", 49, 2048);
  } catch (const std::exception&) {
    return 0;
  }
  if (r.empty()) broken("rows: accepted without a row");
  for (const auto& row : r) {
    if (row.empty()) broken("rows: an empty row");
    int64_t total = 0;
    for (int L : row) {
      if (L <= 49 || L > 2048) broken("rows: a sample of " + std::to_string(L) + " tokens");
      total += L;
    }
    if (total > 2048) broken("rows: a row of " + std::to_string(total) + " tokens");
  }
  return 0;
}

const std::vector<Named>& all_targets() {
  static const std::vector<Named> v = {{"safetensors", safetensors}, {"config", config}, {"jsonl", jsonl},
                                       {"tokenizer", tokenizer},     {"image", image},   {"idx", idx},
                                       {"rows", rows}};
  return v;
}

}  // namespace loom::fuzz
