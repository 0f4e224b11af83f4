// tokenizer.cpp: encoding and decoding with an HF byte-level BPE tokenizer (the pipeline is
// described in tokenizer.h). Loading and saving: tokenizer_io.cpp; training: bpe_trainer.cpp.
//
// Matching HF id for id depends on details that are easy to get wrong; each is marked
// "HF:" below where it is implemented.
#include "data/tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <queue>
#include <stdexcept>

#include "data/tokenizer_impl.h"
#include "data/tokenizer_text.h"

namespace loom {

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
// pieces by behaviour; empty pieces are dropped. Appends [begin, end) byte ranges of s.
void split_by(const std::string& s, const text::Regex& re, Behavior behavior, bool invert,
              std::vector<std::pair<size_t, size_t>>& out) {
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
    if (e > b) out.emplace_back(b, e);
}

struct PreToken {
  std::string s;
  bool first;  // starts at offset 0 of the original text
};
}  // namespace

void Tokenizer::Impl::pre_tokenize(const std::string& s, bool first, std::vector<std::string>& out) const {
  std::vector<PreToken> cur, next;
  if (!s.empty()) cur.push_back({s, first});
  static const text::Regex gpt2(kGpt2Pattern);
  std::vector<std::pair<size_t, size_t>> ranges;
  auto cut = [&](const PreToken& p, const text::Regex& pattern, Behavior behavior, bool invert) {
    ranges.clear();
    split_by(p.s, pattern, behavior, invert, ranges);
    for (auto [b, e] : ranges) next.push_back({p.s.substr(b, e - b), p.first && b == 0});
  };
  for (const PreStep& st : pre) {
    next.clear();
    for (PreToken& p : cur) {
      if (st.kind == PreStep::Split) {
        cut(p, *st.re, st.behavior, st.invert);
      } else if (st.kind == PreStep::Metaspace) {
        PreToken m{metaspace_rewrite(st, p.s, p.first), p.first};
        if (st.split) cut(m, *st.re, Behavior::MergedWithNext, false);  // HF: before each "▁"
        else if (!m.s.empty()) next.push_back(std::move(m));
      } else {
        // HF: the prefix space is added to every piece reaching ByteLevel, not only the first
        if (st.add_prefix_space && p.s[0] != ' ') p.s.insert(p.s.begin(), ' ');
        size_t at = next.size();
        if (st.use_regex) cut(p, gpt2, Behavior::Isolated, false);
        else next.push_back(p);
        for (size_t k = at; k < next.size(); k++) next[k].s = text::bytes_to_chars(next[k].s);
      }
    }
    cur.swap(next);
  }
  for (auto& p : cur) out.push_back(std::move(p.s));
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
  if (word.size() >= kCacheMaxLen) {
    bpe_uncached(word, out);
    return;
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
          // HF leaves a pending unk pending here: it lands after these byte tokens
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

// ------------------------------------------------------------------ encode / decode
namespace {
// every encode entry point refuses text that is not UTF-8, naming the first bad byte
void require_utf8(const std::string& text) {
  size_t bad = text::find_invalid_utf8(text);
  if (bad != std::string::npos)
    throw std::invalid_argument("tokenizer: text is not valid UTF-8 at byte " + std::to_string(bad));
}
}  // namespace

std::vector<std::string> Tokenizer::pre_tokenize(const std::string& text) const {
  require_utf8(text);
  std::vector<std::string> out;
  impl_->pre_tokenize(impl_->normalize(text), true, out);
  return out;
}

const std::vector<int32_t>& Tokenizer::special_prefix() const { return impl_->post_prefix; }
const std::vector<int32_t>& Tokenizer::special_suffix() const { return impl_->post_suffix; }

std::vector<Tokenizer::Impl::Split> Tokenizer::Impl::splits(const std::string& text) const {
  std::vector<Split> out;
  std::vector<std::string> words;
  for (const Segment& raw : split_added(text, raw_trie)) {
    if (raw.id >= 0) {
      out.push_back({raw.id, {}});
      continue;
    }
    std::string norm = normalize(text.substr(raw.begin, raw.end - raw.begin));
    for (const Segment& seg : split_added(norm, norm_trie)) {
      if (seg.id >= 0) {
        out.push_back({seg.id, {}});
        continue;
      }
      words.clear();
      // HF: Metaspace's "first" looks at where the piece starts in the original text
      pre_tokenize(norm.substr(seg.begin, seg.end - seg.begin), raw.begin == 0 && seg.begin == 0, words);
      for (std::string& w : words) out.push_back({-1, std::move(w)});
    }
  }
  return out;
}

std::vector<int32_t> Tokenizer::Impl::encode_limited(const std::string& text, size_t max_tokens, bool left) const {
  require_utf8(text);
  const std::vector<Split> sp = splits(text);
  std::vector<std::vector<int32_t>> ids(sp.size());
  size_t total = 0, lo = 0, hi = sp.size();  // the splits kept: [lo, hi)
  for (size_t k = 0; k < sp.size(); k++) {
    const size_t i = left ? sp.size() - 1 - k : k;
    if (left) lo = i;
    else hi = i + 1;
    if (sp[i].id >= 0) {  // already a token: counted, never the stop
      ids[i] = {sp[i].id};
      total += 1;
      continue;
    }
    bpe(sp[i].word, ids[i]);
    total += ids[i].size();
    if (total >= max_tokens) break;
  }
  std::vector<int32_t> out;
  for (size_t i = lo; i < hi; i++) out.insert(out.end(), ids[i].begin(), ids[i].end());
  return out;
}

std::vector<int32_t> Tokenizer::encode(const std::string& text, bool add_special_tokens) const {
  require_utf8(text);
  const Impl& im = *impl_;
  if (add_special_tokens && !im.post_error.empty()) throw std::runtime_error(im.post_error);
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = im.post_prefix;
  for (const Impl::Split& s : im.splits(text)) {
    if (s.id >= 0) ids.push_back(s.id);
    else im.bpe(s.word, ids);
  }
  if (add_special_tokens) ids.insert(ids.end(), im.post_suffix.begin(), im.post_suffix.end());
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  const Impl& im = *impl_;
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); i++) {
    int32_t id = ids[i];
    if (id < 0 || size_t(id) >= im.id_kind.size() || im.id_kind[size_t(id)] == 0)
      throw std::out_of_range("tokenizer " + im.origin + ": decode: id " + std::to_string(id) +
                              " (at " + std::to_string(i) + ") is not in the vocabulary");
    if (skip_special && (im.id_kind[size_t(id)] & 4)) continue;
    toks.push_back(im.id_to_tok[size_t(id)]);
  }
  if (im.has_decoder) return im.run_decoders(std::move(toks));
  std::string out;  // HF without a decoder: the tokens joined by spaces
  for (size_t i = 0; i < toks.size(); i++) out += (i ? " " : "") + toks[i];
  return out;
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
}  // namespace loom
