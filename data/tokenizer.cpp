// tokenizer.cpp: loading, encoding, decoding and saving HF byte-level BPE tokenizer.json
// files (the pipeline is described in tokenizer.h). The trainer is in bpe_trainer.cpp.
//
// Matching HF id for id depends on details that are easy to get wrong; each is marked
// "HF:" below where it is implemented.
#include "data/tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <mutex>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "data/tokenizer_text.h"

namespace loom {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;  // keeps HF's key order (and the vocab in id order) on save

namespace {

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// One pre-tokenizer step. Digits is a Split on \p{N} (HF: char::is_numeric, i.e. Nd|Nl|No).
struct PreStep {
  bool byte_level = false;
  bool add_prefix_space = false, use_regex = true;      // ByteLevel
  std::shared_ptr<text::Regex> re;                      // Split / Digits
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
};

// GPT-2's pre-tokenizer regex, which HF's ByteLevel(use_regex=true) applies.
const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

struct AddedToken {
  int32_t id;
  std::string content;
  bool single_word, lstrip, rstrip, normalized, special;
};

// Byte trie over added-token contents: leftmost, then longest match (HF uses Aho-Corasick
// with MatchKind::LeftmostLongest).
struct Trie {
  struct Node {
    std::unordered_map<unsigned char, int> next;
    int token = -1;  // index into Impl::added
  };
  std::vector<Node> nodes{1};
  void insert(const std::string& s, int token) {
    int n = 0;
    for (unsigned char c : s) {
      auto it = nodes[n].next.find(c);
      if (it == nodes[n].next.end()) {
        nodes.emplace_back();
        it = nodes[n].next.emplace(c, int(nodes.size()) - 1).first;
      }
      n = it->second;
    }
    if (nodes[n].token < 0) nodes[n].token = token;
  }
  bool empty() const { return nodes.size() == 1; }
  // longest token starting at s[i]: its length and index, or {0, -1}
  std::pair<size_t, int> longest_at(const std::string& s, size_t i) const {
    std::pair<size_t, int> best{0, -1};
    int n = 0;
    for (size_t j = i; j < s.size(); j++) {
      auto it = nodes[n].next.find((unsigned char)s[j]);
      if (it == nodes[n].next.end()) break;
      n = it->second;
      if (nodes[n].token >= 0) best = {j + 1 - i, nodes[n].token};
    }
    return best;
  }
};

struct Segment {
  int32_t id;  // an added token's id, or -1 for text to tokenize
  size_t begin, end;
};

uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

[[noreturn]] void fail(const std::string& origin, const std::string& path, const std::string& msg) {
  throw std::runtime_error("tokenizer " + origin + ": " + path + ": " + msg);
}

}  // namespace

struct Tokenizer::Impl {
  std::string origin;
  // model
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_tok;  // model vocabulary and added tokens, by id
  std::vector<uint8_t> id_kind;        // bit 0: in the model vocab, bit 1: added, bit 2: special
  std::vector<std::string> model_tok;  // model vocabulary only, by id (for save)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a, b) -> (rank, merged id)
  std::vector<std::pair<int32_t, int32_t>> merge_list;                // in rank order
  int32_t unk_id = -1;
  std::string unk_token;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  // pipeline
  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_ids;
  Trie raw_trie, norm_trie;  // added tokens matched before / after normalization
  std::vector<text::NormForm> normalizers;
  std::vector<PreStep> pre;
  bool byte_level_decoder = true;  // else HF's no-decoder fallback: join tokens with ' '
  // kept verbatim for save()
  json normalizer_json, pre_json, post_json, decoder_json, truncation_json, padding_json;
  // per pre-token cache (HF keeps one too); bounded so a long run cannot grow it forever
  static constexpr size_t kCacheCap = 1 << 18;
  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  std::vector<Segment> split_added(const std::string& s, const Trie& trie) const;
  std::string normalize(std::string s) const {
    for (auto f : normalizers) s = text::normalize(s, f);
    return s;
  }
  void pre_tokenize(const std::string& s, std::vector<std::string>& out) const;
  void bpe(const std::string& word, std::vector<int32_t>& out) const;
  void bpe_uncached(const std::string& word, std::vector<int32_t>& out) const;
};

// ------------------------------------------------------------------ added tokens
std::vector<Segment> Tokenizer::Impl::split_added(const std::string& s, const Trie& trie) const {
  std::vector<Segment> segs;
  size_t done = 0;  // end of the last emitted segment
  for (size_t i = 0; !trie.empty() && i < s.size();) {
    auto [len, tok] = trie.longest_at(s, i);
    if (tok < 0) {
      i++;
      continue;
    }
    const AddedToken& t = added[size_t(tok)];
    size_t b = i, e = i + len;
    auto cp_before = [&](size_t at, uint32_t* cp) {  // the code point ending at byte `at`
      size_t k = at;
      while (k > 0 && (static_cast<unsigned char>(s[k - 1]) & 0xC0) == 0x80) k--;
      if (k > 0) k--;
      text::utf8_seq(reinterpret_cast<const unsigned char*>(s.data()) + k, at - k, cp);
      return k;
    };
    auto cp_at = [&](size_t at, uint32_t* cp) {
      return size_t(text::utf8_seq(reinterpret_cast<const unsigned char*>(s.data()) + at,
                                   s.size() - at, cp));
    };
    if (t.single_word) {  // HF: only when not glued to a word character on either side
      uint32_t cp;
      bool left_ok = b == 0 || (cp_before(b, &cp), !text::is_word_char(cp));
      bool right_ok = e == s.size() || (cp_at(e, &cp), !text::is_word_char(cp));
      if (!left_ok || !right_ok) {
        i = e;  // HF's iterator resumes after the skipped match
        continue;
      }
    }
    if (t.lstrip) {  // HF: swallow the whitespace before it, but not past the previous segment
      uint32_t cp;
      while (b > done) {
        size_t k = cp_before(b, &cp);
        if (!text::is_white_space(cp)) break;
        b = k;
      }
    }
    if (t.rstrip) {
      uint32_t cp;
      while (e < s.size()) {
        size_t k = cp_at(e, &cp);
        if (!text::is_white_space(cp)) break;
        e += k;
      }
    }
    if (done < b) segs.push_back({-1, done, b});
    segs.push_back({t.id, b, e});
    done = i = e;
  }
  if (done < s.size()) segs.push_back({-1, done, s.size()});
  return segs;
}

// ------------------------------------------------------------------ pre-tokenizer
namespace {
// HF's NormalizedString::split: cut s at the regex's matches and keep/merge/remove the
// pieces by behaviour; empty pieces are dropped.
void split_by(const std::string& s, const text::Regex& re, Behavior behavior, bool invert,
              std::vector<std::string>& out) {
  std::vector<std::pair<size_t, size_t>> m;
  re.find_all(s, m);
  struct Piece {
    size_t b, e;
    bool match;
  };
  std::vector<Piece> ps;
  size_t prev = 0;
  for (auto [b, e] : m) {
    if (prev != b) ps.push_back({prev, b, false});
    ps.push_back({b, e, true});
    prev = e;
  }
  if (prev != s.size()) ps.push_back({prev, s.size(), false});
  if (invert)
    for (auto& p : ps) p.match = !p.match;
  std::vector<std::pair<size_t, size_t>> keep;
  bool prev_match = false;
  switch (behavior) {
    case Behavior::Removed:
      for (auto& p : ps)
        if (!p.match) keep.emplace_back(p.b, p.e);
      break;
    case Behavior::Isolated:
      for (auto& p : ps) keep.emplace_back(p.b, p.e);
      break;
    case Behavior::MergedWithPrevious:
      for (auto& p : ps) {
        if (p.match && !prev_match && !keep.empty()) keep.back().second = p.e;
        else keep.emplace_back(p.b, p.e);
        prev_match = p.match;
      }
      break;
    case Behavior::MergedWithNext:
      for (size_t k = ps.size(); k-- > 0;) {
        auto& p = ps[k];
        if (p.match && !prev_match && !keep.empty()) keep.back().first = p.b;
        else keep.emplace_back(p.b, p.e);
        prev_match = p.match;
      }
      std::reverse(keep.begin(), keep.end());
      break;
    case Behavior::Contiguous:
      for (auto& p : ps) {
        if (p.match == prev_match && !keep.empty()) keep.back().second = p.e;
        else keep.emplace_back(p.b, p.e);
        prev_match = p.match;
      }
      break;
  }
  for (auto [b, e] : keep)
    if (e > b) out.push_back(s.substr(b, e - b));
}
}  // namespace

void Tokenizer::Impl::pre_tokenize(const std::string& s, std::vector<std::string>& out) const {
  std::vector<std::string> cur, next;
  if (!s.empty()) cur.push_back(s);
  static const text::Regex gpt2(kGpt2Pattern);
  for (const PreStep& st : pre) {
    next.clear();
    for (std::string& p : cur) {
      if (!st.byte_level) {
        split_by(p, *st.re, st.behavior, st.invert, next);
        continue;
      }
      // HF: the prefix space is added to every piece reaching ByteLevel, not only the first
      if (st.add_prefix_space && p[0] != ' ') p.insert(p.begin(), ' ');
      size_t first = next.size();
      if (st.use_regex) split_by(p, gpt2, Behavior::Isolated, false, next);
      else next.push_back(p);
      for (size_t k = first; k < next.size(); k++) next[k] = text::bytes_to_chars(next[k]);
    }
    cur.swap(next);
  }
  for (auto& p : cur) out.push_back(std::move(p));
}

// ------------------------------------------------------------------ BPE
void Tokenizer::Impl::bpe(const std::string& word, std::vector<int32_t>& out) const {
  if (ignore_merges) {  // HF: a pre-token that is itself in the vocabulary is one token
    auto it = vocab.find(word);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = cache.find(word);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  bpe_uncached(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(cache_mu);
  if (cache.size() < kCacheCap) cache.emplace(word, std::move(ids));
}

// The merge loop of HF's Word::merge_all: a min-heap of candidate merges keyed by
// (rank, position); symbols form a linked list, a merged-away symbol gets len 0, and a
// popped candidate that no longer matches its pair is stale and skipped. O(n log n) per
// pre-token, so 4000-character runs are no problem.
void Tokenizer::Impl::bpe_uncached(const std::string& word, std::vector<int32_t>& out) const {
  struct Sym {
    int32_t id;
    int prev, next;
    size_t len;
  };
  std::vector<Sym> sym;
  const auto* p = reinterpret_cast<const unsigned char*>(word.data());
  int32_t pending_unk = -1;  // HF: unknown characters become unk (fused when fuse_unk)
  auto add = [&](int32_t id, size_t len) {
    int n = int(sym.size());
    sym.push_back({id, n - 1, n + 1, len});
  };
  for (size_t i = 0; i < word.size();) {
    uint32_t cp;
    int k = text::utf8_seq(p + i, word.size() - i, &cp);
    size_t len = size_t(k > 0 ? k : 1);
    auto it = vocab.find(word.substr(i, len));
    if (it != vocab.end()) {
      if (pending_unk >= 0) add(unk_id, 0), pending_unk = -1;
      add(it->second, len);
    } else {
      bool done = false;
      if (byte_fallback) {  // HF: <0xXX> tokens for the bytes, if all of them exist
        std::vector<int32_t> bytes;
        for (size_t j = i; j < i + len; j++) {
          char name[8];
          std::snprintf(name, sizeof name, "<0x%02X>", unsigned(p[j]));
          auto bt = vocab.find(name);
          if (bt == vocab.end()) break;
          bytes.push_back(bt->second);
        }
        if (bytes.size() == len) {
          if (pending_unk >= 0) add(unk_id, 0), pending_unk = -1;
          for (int32_t b : bytes) add(b, 1);
          done = true;
        }
      }
      if (!done && unk_id >= 0) {
        if (pending_unk >= 0 && !fuse_unk) add(unk_id, 0);
        pending_unk = unk_id;
      }
      // no unk token: HF drops the character
    }
    i += len;
  }
  if (pending_unk >= 0) add(unk_id, 0);
  if (sym.empty()) return;
  sym.back().next = -1;
  for (auto& s : sym) s.len = std::max<size_t>(s.len, 1);  // len 0 marks "merged away"

  struct Cand {
    int32_t rank, pos, new_id;
  };
  auto later = [](const Cand& a, const Cand& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::priority_queue<Cand, std::vector<Cand>, decltype(later)> heap(later);
  auto push_pair = [&](int pos) {
    int nx = sym[size_t(pos)].next;
    if (nx < 0) return;
    auto it = merges.find(pair_key(sym[size_t(pos)].id, sym[size_t(nx)].id));
    if (it != merges.end()) heap.push({it->second.first, pos, it->second.second});
  };
  for (int i = 0; i + 1 < int(sym.size()); i++) push_pair(i);
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    Sym& left = sym[size_t(c.pos)];
    if (left.len == 0 || left.next < 0) continue;
    Sym& right = sym[size_t(left.next)];
    auto it = merges.find(pair_key(left.id, right.id));
    if (it == merges.end() || it->second.second != c.new_id) continue;  // stale candidate
    left.id = c.new_id;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (right.next >= 0) sym[size_t(right.next)].prev = c.pos;
    if (left.prev >= 0) push_pair(left.prev);
    push_pair(c.pos);
  }
  for (const Sym& s : sym)
    if (s.len > 0) out.push_back(s.id);
}

// ------------------------------------------------------------------ loading
namespace {

bool opt_bool(const json& j, const char* key, bool dflt) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? dflt : it->get<bool>();
}

std::string type_of(const json& j, const std::string& origin, const std::string& path) {
  auto it = j.find("type");
  if (!j.is_object() || it == j.end() || !it->is_string()) fail(origin, path + ".type", "missing");
  return it->get<std::string>();
}

void parse_normalizer(const json& j, const std::string& origin, const std::string& path,
                      std::vector<text::NormForm>& out) {
  if (j.is_null()) return;
  std::string t = type_of(j, origin, path);
  if (t == "Sequence") {
    const json& list = j.at("normalizers");
    for (size_t i = 0; i < list.size(); i++)
      parse_normalizer(list[i], origin, path + ".normalizers[" + std::to_string(i) + "]", out);
  } else if (t == "NFC") {
    out.push_back(text::NormForm::NFC);
  } else if (t == "NFD") {
    out.push_back(text::NormForm::NFD);
  } else if (t == "NFKC") {
    out.push_back(text::NormForm::NFKC);
  } else if (t == "NFKD") {
    out.push_back(text::NormForm::NFKD);
  } else if (t == "Lowercase") {
    out.push_back(text::NormForm::Lowercase);
  } else {
    fail(origin, path + ".type", "unsupported normalizer \"" + t + "\"");
  }
}

void parse_pre(const json& j, const std::string& origin, const std::string& path,
               std::vector<PreStep>& out) {
  if (j.is_null()) return;
  std::string t = type_of(j, origin, path);
  PreStep st;
  if (t == "Sequence") {
    const json& list = j.at("pretokenizers");
    for (size_t i = 0; i < list.size(); i++)
      parse_pre(list[i], origin, path + ".pretokenizers[" + std::to_string(i) + "]", out);
    return;
  } else if (t == "ByteLevel") {
    st.byte_level = true;
    st.add_prefix_space = opt_bool(j, "add_prefix_space", true);
    st.use_regex = opt_bool(j, "use_regex", true);
  } else if (t == "Digits") {
    // HF: individual digits are each isolated; otherwise runs of digits ("Contiguous")
    st.re = std::make_shared<text::Regex>(opt_bool(j, "individual_digits", false) ? "\\p{N}" : "\\p{N}+");
  } else if (t == "Split") {
    const json& pat = j.at("pattern");
    try {
      if (pat.contains("Regex")) st.re = std::make_shared<text::Regex>(pat["Regex"].get<std::string>());
      else if (pat.contains("String")) st.re = std::make_shared<text::Regex>(pat["String"].get<std::string>(), true);
      else fail(origin, path + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    } catch (const std::runtime_error& e) {
      if (std::string(e.what()).rfind("tokenizer ", 0) == 0) throw;
      fail(origin, path + ".pattern", e.what());
    }
    static const std::pair<const char*, Behavior> names[] = {
        {"Removed", Behavior::Removed}, {"Isolated", Behavior::Isolated},
        {"MergedWithPrevious", Behavior::MergedWithPrevious},
        {"MergedWithNext", Behavior::MergedWithNext}, {"Contiguous", Behavior::Contiguous}};
    std::string b = j.at("behavior").get<std::string>();
    auto it = std::find_if(std::begin(names), std::end(names), [&](auto& n) { return b == n.first; });
    if (it == std::end(names)) fail(origin, path + ".behavior", "unsupported behavior \"" + b + "\"");
    st.behavior = it->second;
    st.invert = opt_bool(j, "invert", false);
  } else {
    fail(origin, path + ".type", "unsupported pre_tokenizer \"" + t + "\"");
  }
  out.push_back(std::move(st));
}

bool parse_decoder(const json& j, const std::string& origin, const std::string& path) {
  if (j.is_null()) return false;
  std::string t = type_of(j, origin, path);
  if (t == "ByteLevel") return true;
  if (t == "Sequence" && j.at("decoders").size() == 1)
    return parse_decoder(j.at("decoders")[0], origin, path + ".decoders[0]");
  fail(origin, path + ".type", "unsupported decoder \"" + t + "\"");
}

std::shared_ptr<Tokenizer::Impl> build(const json& doc, const std::string& origin) {
  auto im = std::make_shared<Tokenizer::Impl>();
  im->origin = origin;
  if (!doc.is_object()) fail(origin, "(root)", "expected a JSON object");
  auto section = [&](const char* key) { return doc.contains(key) ? doc[key] : json(); };
  const json model = section("model");
  if (!model.is_object()) fail(origin, "model", "missing");
  std::string mt = model.value("type", std::string("BPE"));  // HF omits it in some old files
  if (mt != "BPE") fail(origin, "model.type", "unsupported model \"" + mt + "\" (only BPE)");
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0)
    fail(origin, "model.dropout", "BPE dropout is not supported");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(k) && !model[k].is_null() && !model[k].get<std::string>().empty())
      fail(origin, std::string("model.") + k, "not supported (byte-level BPE has none)");
  im->fuse_unk = opt_bool(model, "fuse_unk", false);
  im->byte_fallback = opt_bool(model, "byte_fallback", false);
  im->ignore_merges = opt_bool(model, "ignore_merges", false);

  int32_t max_id = -1;
  const json& vocab = model.at("vocab");
  if (!vocab.is_object()) fail(origin, "model.vocab", "expected an object {token: id}");
  im->vocab.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    int32_t id = it.value().get<int32_t>();
    if (id < 0) fail(origin, "model.vocab[\"" + it.key() + "\"]", "negative id");
    im->vocab[it.key()] = id;
    max_id = std::max(max_id, id);
  }
  im->model_tok.resize(size_t(max_id + 1));
  for (auto& [tok, id] : im->vocab) im->model_tok[size_t(id)] = tok;
  if (model.contains("unk_token") && !model["unk_token"].is_null()) {
    im->unk_token = model["unk_token"].get<std::string>();
    auto it = im->vocab.find(im->unk_token);
    if (it == im->vocab.end()) fail(origin, "model.unk_token", "\"" + im->unk_token + "\" not in the vocab");
    im->unk_id = it->second;
  }

  const json& merges = model.contains("merges") ? model["merges"] : json::array();
  im->merge_list.reserve(merges.size());
  im->merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); i++) {
    std::string path = "model.merges[" + std::to_string(i) + "]", a, b;
    const json& m = merges[i];
    if (m.is_string()) {  // "a b" (older files)
      std::string s = m.get<std::string>();
      size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        fail(origin, path, "expected \"left right\", got \"" + s + "\"");
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2) {  // ["a", "b"]
      a = m[0].get<std::string>(), b = m[1].get<std::string>();
    } else {
      fail(origin, path, "expected a string or a pair of strings");
    }
    auto ia = im->vocab.find(a), ib = im->vocab.find(b), ic = im->vocab.find(a + b);
    if (ia == im->vocab.end() || ib == im->vocab.end() || ic == im->vocab.end())
      fail(origin, path, "token of \"" + a + "\" + \"" + b + "\" not in the vocab");
    // HF builds its merge map with collect(): a repeated pair keeps the later rank
    im->merges[pair_key(ia->second, ib->second)] = {int32_t(i), ic->second};
    im->merge_list.emplace_back(ia->second, ib->second);
  }

  const json added = section("added_tokens");
  for (size_t i = 0; i < added.size(); i++) {
    const json& t = added[i];
    AddedToken a{t.at("id").get<int32_t>(), t.at("content").get<std::string>(),
                 opt_bool(t, "single_word", false), opt_bool(t, "lstrip", false),
                 opt_bool(t, "rstrip", false), opt_bool(t, "normalized", true),
                 opt_bool(t, "special", false)};
    if (a.id < 0) fail(origin, "added_tokens[" + std::to_string(i) + "].id", "negative id");
    if (a.content.empty()) fail(origin, "added_tokens[" + std::to_string(i) + "].content", "empty");
    max_id = std::max(max_id, a.id);
    im->added_ids[a.content] = a.id;
    im->added.push_back(std::move(a));
  }

  im->normalizer_json = section("normalizer");
  im->pre_json = section("pre_tokenizer");
  im->post_json = section("post_processor");
  im->decoder_json = section("decoder");
  im->truncation_json = section("truncation");
  im->padding_json = section("padding");
  parse_normalizer(im->normalizer_json, origin, "normalizer", im->normalizers);
  parse_pre(im->pre_json, origin, "pre_tokenizer", im->pre);
  im->byte_level_decoder = parse_decoder(im->decoder_json, origin, "decoder");

  im->id_to_tok.resize(size_t(max_id + 1));
  im->id_kind.assign(size_t(max_id + 1), 0);
  for (auto& [tok, id] : im->vocab) im->id_to_tok[size_t(id)] = tok, im->id_kind[size_t(id)] |= 1;
  for (size_t i = 0; i < im->added.size(); i++) {
    const AddedToken& a = im->added[i];
    im->id_to_tok[size_t(a.id)] = a.content;
    im->id_kind[size_t(a.id)] |= a.special ? 6 : 2;
    // HF: special and normalized=false tokens are found in the raw text, the others in the
    // normalized text (and are normalized themselves first)
    if (a.special || !a.normalized) im->raw_trie.insert(a.content, int(i));
    else im->norm_trie.insert(im->normalize(a.content), int(i));
  }
  return im;
}

}  // namespace

Tokenizer Tokenizer::from_json(const std::string& json_text, const std::string& origin) {
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::exception& e) {
    throw std::runtime_error("tokenizer " + origin + ": malformed JSON: " + e.what());
  }
  try {
    return Tokenizer(build(doc, origin));
  } catch (const json::exception& e) {  // a field of the wrong type or a missing key
    throw std::runtime_error("tokenizer " + origin + ": unexpected content: " + e.what());
  }
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("tokenizer " + path + ": cannot open file");
  std::stringstream ss;
  ss << f.rdbuf();
  return from_json(ss.str(), path);
}

// ------------------------------------------------------------------ encode / decode
std::vector<std::string> Tokenizer::pre_tokenize(const std::string& text) const {
  size_t bad = text::find_invalid_utf8(text);
  if (bad != std::string::npos)
    throw std::invalid_argument("tokenizer: text is not valid UTF-8 at byte " + std::to_string(bad));
  std::vector<std::string> out;
  impl_->pre_tokenize(impl_->normalize(text), out);
  return out;
}

std::vector<int32_t> Tokenizer::encode(const std::string& text) const {
  size_t bad = text::find_invalid_utf8(text);
  if (bad != std::string::npos)
    throw std::invalid_argument("tokenizer: text is not valid UTF-8 at byte " + std::to_string(bad));
  const Impl& im = *impl_;
  std::vector<int32_t> ids;
  std::vector<std::string> words;
  for (const Segment& raw : im.split_added(text, im.raw_trie)) {
    if (raw.id >= 0) {
      ids.push_back(raw.id);
      continue;
    }
    std::string norm = im.normalize(text.substr(raw.begin, raw.end - raw.begin));
    for (const Segment& seg : im.split_added(norm, im.norm_trie)) {
      if (seg.id >= 0) {
        ids.push_back(seg.id);
        continue;
      }
      words.clear();
      im.pre_tokenize(norm.substr(seg.begin, seg.end - seg.begin), words);
      for (const std::string& w : words) im.bpe(w, ids);
    }
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  const Impl& im = *impl_;
  std::string bytes;
  for (size_t i = 0; i < ids.size(); i++) {
    int32_t id = ids[i];
    if (id < 0 || size_t(id) >= im.id_kind.size() || im.id_kind[size_t(id)] == 0)
      throw std::out_of_range("tokenizer " + im.origin + ": decode: id " + std::to_string(id) +
                              " (at " + std::to_string(i) + ") is not in the vocabulary");
    if (skip_special && (im.id_kind[size_t(id)] & 4)) continue;
    const std::string& tok = im.id_to_tok[size_t(id)];
    if (!im.byte_level_decoder) {
      if (!bytes.empty()) bytes += ' ';
      bytes += tok;
      continue;
    }
    // HF's ByteLevel decoder: a token whose characters all come from the byte map becomes
    // those bytes; any other token (e.g. an added "<|im_start|>" with a space) stays as is
    std::string tb;
    const auto* p = reinterpret_cast<const unsigned char*>(tok.data());
    bool all = true;
    for (size_t k = 0; k < tok.size() && all;) {
      uint32_t cp;
      int n = text::utf8_seq(p + k, tok.size() - k, &cp);
      int b = n > 0 ? text::char_to_byte(cp) : -1;
      if (b < 0) all = false;
      else tb += char(b), k += size_t(n);
    }
    bytes += all ? tb : tok;
  }
  return text::utf8_lossy(bytes);
}

// ------------------------------------------------------------------ lookups and save
int32_t Tokenizer::token_id(const std::string& token) const {
  auto a = impl_->added_ids.find(token);
  if (a != impl_->added_ids.end()) return a->second;
  auto v = impl_->vocab.find(token);
  if (v != impl_->vocab.end()) return v->second;
  throw std::out_of_range("tokenizer " + impl_->origin + ": no token \"" + token + "\"");
}

bool Tokenizer::has_token(const std::string& token) const {
  return impl_->added_ids.count(token) || impl_->vocab.count(token);
}

const std::string& Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || size_t(id) >= impl_->id_kind.size() || impl_->id_kind[size_t(id)] == 0)
    throw std::out_of_range("tokenizer " + impl_->origin + ": no id " + std::to_string(id));
  return impl_->id_to_tok[size_t(id)];
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && size_t(id) < impl_->id_kind.size() && (impl_->id_kind[size_t(id)] & 4);
}

int Tokenizer::vocab_size() const { return int(impl_->id_kind.size()); }
int Tokenizer::num_merges() const { return int(impl_->merge_list.size()); }
const std::string& Tokenizer::origin() const { return impl_->origin; }

std::string Tokenizer::to_json() const {
  const Impl& im = *impl_;
  auto conv = [](const json& j) { return ojson::parse(j.dump()); };
  ojson doc;
  doc["version"] = "1.0";
  doc["truncation"] = conv(im.truncation_json);
  doc["padding"] = conv(im.padding_json);
  ojson added = ojson::array();
  for (const AddedToken& a : im.added)
    added.push_back({{"id", a.id}, {"content", a.content}, {"single_word", a.single_word},
                     {"lstrip", a.lstrip}, {"rstrip", a.rstrip}, {"normalized", a.normalized},
                     {"special", a.special}});
  doc["added_tokens"] = added;
  doc["normalizer"] = conv(im.normalizer_json);
  doc["pre_tokenizer"] = conv(im.pre_json);
  doc["post_processor"] = conv(im.post_json);
  doc["decoder"] = conv(im.decoder_json);
  ojson model;
  model["type"] = "BPE";
  model["dropout"] = nullptr;
  model["unk_token"] = im.unk_id >= 0 ? ojson(im.unk_token) : ojson();
  model["continuing_subword_prefix"] = nullptr;
  model["end_of_word_suffix"] = nullptr;
  model["fuse_unk"] = im.fuse_unk;
  model["byte_fallback"] = im.byte_fallback;
  model["ignore_merges"] = im.ignore_merges;
  // Built as text: ordered_json's object insert is a linear search, too slow for 10^5 keys.
  std::string vocab_text = "{";
  for (size_t id = 0; id < im.model_tok.size(); id++) {
    if (!(im.id_kind[id] & 1)) continue;
    if (vocab_text.size() > 1) vocab_text += ",";
    vocab_text += ojson(im.model_tok[id]).dump() + ":" + std::to_string(id);
  }
  vocab_text += "}";
  model["vocab"] = nullptr;
  ojson merges = ojson::array();
  for (auto [a, b] : im.merge_list) merges.push_back({im.model_tok[size_t(a)], im.model_tok[size_t(b)]});
  model["merges"] = std::move(merges);
  doc["model"] = std::move(model);
  std::string text = doc.dump();
  // splice the vocabulary into its placeholder; inside a dumped string every quote is
  // escaped, so the placeholder text cannot occur anywhere else
  const std::string ph = "\"vocab\":null,\"merges\":";
  size_t at = text.rfind(ph);
  text.replace(at, ph.size(), "\"vocab\":" + vocab_text + ",\"merges\":");
  return text;
}

void Tokenizer::save(const std::string& path) const {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("tokenizer: cannot write " + path);
  f << to_json() << "\n";
  if (!f) throw std::runtime_error("tokenizer: error writing " + path);
}

}  // namespace loom
