// tokenizer_post.cpp: what HF tokenizers runs after the BPE model (tokenizer.h, encode_full):
//   1. truncation of one sequence or a pair (HF's truncate_encodings), with max_length less
//      the tokens the post-processor will add when special tokens are asked for;
//   2. the post-processor as a list of steps over "parts" (HF's process_encodings): the
//      sequences' ids and type ids go in (type id 0 for the first, 1 for the second), each
//      step maps the list of parts to another, and the parts are joined at the end;
//   3. padding to a fixed length or to the batch's longest (HF's pad_encodings).
// The reading of the three JSON sections lives here too, so that one file says what each
// field does. Reference: the tokenizers crate's processors/{template,bert,roberta,sequence}.rs
// and utils/{truncation,padding}.rs, whose behaviour this follows step by step.
#include <algorithm>
#include <stdexcept>

#include "data/tokenizer.h"
#include "data/tokenizer_impl.h"

namespace loom {
namespace tokenizer_detail {

namespace {

// A padding length or multiple above this is refused: a file asking for a billion pads would
// otherwise allocate gigabytes per encoding (published files pad to at most a few thousand).
constexpr size_t kMaxPadLength = size_t(1) << 20;

// A non-negative JSON integer, or `dflt` when the key is absent or null (no default: required).
size_t size_field(const json& j, const char* key, const std::string& origin, const std::string& path,
                  const std::optional<size_t>& dflt, size_t most = SIZE_MAX) {
  auto it = j.find(key);
  const std::string p = path + "." + key;
  if (it == j.end() || it->is_null()) {
    if (!dflt) fail(origin, p, "missing");
    return *dflt;
  }
  if (!it->is_number_integer() || (!it->is_number_unsigned() && it->get<int64_t>() < 0))
    fail(origin, p, "expected a non-negative integer, got " + it->dump().substr(0, 40));
  const uint64_t v = it->get<uint64_t>();
  if (v > most) fail(origin, p, it->dump() + " is over the largest loom takes (" + std::to_string(most) + ")");
  return size_t(v);
}

bool left_direction(const json& j, const std::string& origin, const std::string& path) {
  auto it = j.find("direction");
  if (it == j.end() || it->is_null()) return false;  // HF's default: Right
  if (*it == "Left") return true;
  if (*it == "Right") return false;
  fail(origin, path + ".direction", "expected \"Left\" or \"Right\", got " + it->dump().substr(0, 40));
}

// One template ("single" or "pair") of a TemplateProcessing. The single template takes
// sequence "A" exactly once; the pair template must use both (as HF validates it) and may
// repeat them.
std::vector<PostPiece> parse_template(const json& j, const char* key, const std::string& origin,
                                      const std::string& path, bool pair) {
  const std::string tp = path + "." + key;
  auto arr = j.find(key);
  if (arr == j.end() || !arr->is_array()) fail(origin, tp, "expected an array");
  auto specials = j.find("special_tokens");
  std::vector<PostPiece> out;
  int count[2] = {0, 0};
  for (size_t i = 0; i < arr->size(); i++) {
    const json& item = (*arr)[i];
    const std::string p = tp + "[" + std::to_string(i) + "]";
    if (!item.is_object() || item.size() != 1 || !(item.contains("Sequence") || item.contains("SpecialToken")))
      fail(origin, p, "expected {\"SpecialToken\": ...} or {\"Sequence\": ...}");
    const bool seq = item.contains("Sequence");
    const json& body = item.begin().value();
    const std::string pb = p + (seq ? ".Sequence" : ".SpecialToken");
    if (!body.is_object() || !body.contains("id") || !body["id"].is_string()) fail(origin, pb + ".id", "expected a string");
    const std::string name = body["id"].get<std::string>();
    PostPiece piece;
    piece.type_id = int32_t(size_field(body, "type_id", origin, pb, size_t(0), INT32_MAX));
    if (seq) {
      if (name == "A") piece.seq = 0;
      else if (pair && name == "B") piece.seq = 1;
      else if (pair) fail(origin, pb + ".id", "expected sequence \"A\" or \"B\", got \"" + name + "\"");
      else fail(origin, pb + ".id", "the single template takes sequence \"A\" only, got \"" + name + "\"");
      count[piece.seq]++;
    } else {
      if (specials == j.end() || !specials->is_object() || !specials->contains(name))
        fail(origin, pb + ".id", "\"" + name + "\" is not in " + path + ".special_tokens");
      const json& entry = (*specials)[name];
      const std::string pi = path + ".special_tokens[\"" + name + "\"].ids";
      if (!entry.is_object() || !entry.contains("ids") || !entry["ids"].is_array() || entry["ids"].empty())
        fail(origin, pi, "expected a non-empty array of ids");
      for (size_t k = 0; k < entry["ids"].size(); k++)
        piece.ids.push_back(token_id(entry["ids"][k], origin, pi + "[" + std::to_string(k) + "]"));
    }
    out.push_back(std::move(piece));
  }
  if (!pair && count[0] != 1)
    fail(origin, tp, "expected sequence \"A\" once, found it " + std::to_string(count[0]) + " times");
  if (pair && (count[0] == 0 || count[1] == 0))
    fail(origin, tp, "the pair template must use both sequences \"A\" and \"B\" (found \"A\" " +
                         std::to_string(count[0]) + " and \"B\" " + std::to_string(count[1]) + " times)");
  return out;
}

// Overflowing windows that would hold more ids than this are refused: a long pre-token cut
// with a stride just under the kept length makes one window per id, and HF's merge_with pairs
// every window of one sequence with every window of the other (~3 x m x n encodings of up to
// the kept length each): gigabytes for adversarial input.
constexpr double kMaxWindowIds = double(size_t(1) << 26);

// HF's Encoding::truncate: keep max_len ids (the first, or with direction Left the last) and
// put the rest in `overflowing`: windows of max_len ids that overlap the one before by `stride`
// ids, in order away from the kept end (the last window may be shorter). max_len 0 moves the
// whole part into one window. `what` names the sequence for the error (HF panics there).
void truncate_part(PostPart& p, size_t max_len, size_t stride, bool left, const std::string& origin,
                   const char* what) {
  const size_t n = p.ids.size();
  if (max_len >= n) return;
  if (max_len == 0) {
    PostPart whole = std::move(p);
    p = PostPart{};
    p.overflowing.push_back(std::move(whole));
    return;
  }
  if (stride >= max_len)
    throw std::invalid_argument("tokenizer " + origin + ": truncation stride " + std::to_string(stride) +
                                " is not under the " + std::to_string(max_len) + " ids the " + what +
                                " keeps (max_length less the post-processor's ids, and a pair's share)");
  const size_t step = max_len - stride;
  std::vector<std::pair<size_t, size_t>> ranges;  // [start, stop) of the kept ids, then of each window
  if (!left) {
    for (size_t start = 0; start < n; start += step) {
      const size_t stop = std::min(start + max_len, n);
      ranges.emplace_back(start, stop);
      if (stop == n) break;
    }
  } else {
    for (size_t back = 0; back < n; back += step) {  // windows end at n, n - step, n - 2 step, ...
      const size_t stop = n - back;
      const size_t start = stop > max_len ? stop - max_len : 0;
      ranges.emplace_back(start, stop);
      if (start == 0) break;
    }
  }
  if (double(ranges.size()) * double(max_len) > kMaxWindowIds)
    throw std::invalid_argument("tokenizer " + origin + ": truncation of the " + what + " (" + std::to_string(n) +
                                " ids) to " + std::to_string(max_len) + " with stride " + std::to_string(stride) +
                                " makes " + std::to_string(ranges.size() - 1) + " overflowing windows, over 2^26 ids");
  auto slice = [&](std::pair<size_t, size_t> r) {
    PostPart w;
    w.ids.assign(p.ids.begin() + std::ptrdiff_t(r.first), p.ids.begin() + std::ptrdiff_t(r.second));
    w.type_ids.assign(p.type_ids.begin() + std::ptrdiff_t(r.first), p.type_ids.begin() + std::ptrdiff_t(r.second));
    w.special.assign(p.special.begin() + std::ptrdiff_t(r.first), p.special.begin() + std::ptrdiff_t(r.second));
    return w;
  };
  PostPart out = slice(ranges[0]);
  for (size_t i = 1; i < ranges.size(); i++) out.overflowing.push_back(slice(ranges[i]));
  p = std::move(out);
}

// HF's truncate_encodings on one sequence (b null) or a pair, to max_length ids together.
void truncate(PostPart& a, PostPart* b, const Tokenizer::Truncation& t, size_t max_length, const std::string& origin) {
  using S = Tokenizer::Truncation::Strategy;
  const size_t stride = t.stride;
  if (max_length == 0) {
    truncate_part(a, 0, stride, t.left, origin, "first sequence");
    if (b) truncate_part(*b, 0, stride, t.left, origin, "second sequence");
    return;
  }
  const size_t total = a.ids.size() + (b ? b->ids.size() : 0);
  if (total <= max_length) return;
  const size_t remove = total - max_length;
  if (t.strategy == S::LongestFirst) {
    if (!b) {
      truncate_part(a, max_length, stride, t.left, origin, "sequence");
      return;
    }
    // n1 the shorter sequence's length: the longer one is cut to what the shorter leaves, but
    // not below the shorter; when both are still too long, each gets half (the extra odd id
    // to the longer; to the second when they are equal)
    size_t n1 = a.ids.size(), n2 = b->ids.size();
    const bool swapped = n1 > n2;
    if (swapped) std::swap(n1, n2);
    n2 = n1 > max_length ? n1 : std::max(n1, max_length - n1);
    if (n1 + n2 > max_length) {
      n1 = max_length / 2;
      n2 = n1 + max_length % 2;
    }
    if (swapped) std::swap(n1, n2);
    truncate_part(a, n1, stride, t.left, origin, "first sequence");
    truncate_part(*b, n2, stride, t.left, origin, "second sequence");
  } else {
    const bool first = t.strategy == S::OnlyFirst;
    PostPart* target = first ? &a : b;
    if (!target)
      throw std::invalid_argument("tokenizer " + origin + ": truncation strategy OnlySecond needs a pair of sequences");
    if (target->ids.size() <= remove)
      throw std::invalid_argument("tokenizer " + origin + ": truncation to " + std::to_string(max_length) + " ids (" +
                                  (first ? "OnlyFirst" : "OnlySecond") + ") must remove " + std::to_string(remove) +
                                  " ids from the " + (first ? "first" : "second") + " sequence, which has " +
                                  std::to_string(target->ids.size()));
    truncate_part(*target, target->ids.size() - remove, stride, t.left, origin,
                  first ? "first sequence" : "second sequence");
  }
  const size_t m = a.overflowing.size(), k = b ? b->overflowing.size() : 0;
  if (m > 0 && k > 0 && 3.0 * double(m + 1) * double(k + 1) * double(a.ids.size() + b->ids.size() + 1) > kMaxWindowIds)
    throw std::invalid_argument("tokenizer " + origin + ": truncation leaves " + std::to_string(m) + " and " +
                                std::to_string(k) + " overflowing windows of the two sequences, whose pairing "
                                "would make over 2^26 ids (a longer max_length, or a shorter stride)");
}

// HF's Encoding::merge_with: `pair` appended to `self`; the windows are paired as HF pairs them:
// each of self's windows with pair and with each of pair's windows, then self (with its own
// windows, which nest) with each of pair's windows.
void merge_with(PostPart& self, const PostPart& pair) {
  std::vector<PostPart> windows;
  for (const PostPart& so : self.overflowing) {
    PostPart n = so;
    merge_with(n, pair);
    windows.push_back(std::move(n));
    for (const PostPart& po : pair.overflowing) {
      PostPart m = so;
      merge_with(m, po);
      windows.push_back(std::move(m));
    }
  }
  for (const PostPart& po : pair.overflowing) {
    PostPart n = self;
    merge_with(n, po);
    windows.push_back(std::move(n));
  }
  self.ids.insert(self.ids.end(), pair.ids.begin(), pair.ids.end());
  self.type_ids.insert(self.type_ids.end(), pair.type_ids.begin(), pair.type_ids.end());
  self.special.insert(self.special.end(), pair.special.begin(), pair.special.end());
  self.overflowing = std::move(windows);
}

Tokenizer::Encoding to_encoding(const PostPart& p) {
  Tokenizer::Encoding e;
  e.ids = p.ids;
  e.type_ids = p.type_ids;
  e.special_tokens_mask = p.special;
  e.attention_mask.assign(p.ids.size(), 1);
  for (const PostPart& w : p.overflowing) e.overflowing.push_back(to_encoding(w));
  return e;
}

// HF's Encoding::pad: the windows first (to the same length), then the encoding itself unless
// it is already that long.
void pad_one(Tokenizer::Encoding& e, size_t len, const Tokenizer::Padding& p) {
  for (Tokenizer::Encoding& w : e.overflowing) pad_one(w, len, p);
  if (e.ids.size() >= len) return;
  const size_t n = len - e.ids.size();
  auto at = [&](auto& v) { return p.left ? v.begin() : v.end(); };
  e.ids.insert(at(e.ids), n, p.pad_id);
  e.type_ids.insert(at(e.type_ids), n, p.pad_type_id);
  e.attention_mask.insert(at(e.attention_mask), n, uint8_t(0));
  e.special_tokens_mask.insert(at(e.special_tokens_mask), n, uint8_t(1));
}

// HF's pad_encodings: every encoding (and its windows) to the fixed length or the longest
// encoding's (windows not counted), rounded up to the multiple; longer ones stay as they are.
void pad(std::vector<Tokenizer::Encoding>& encs, const Tokenizer::Padding& p) {
  size_t len = 0;
  if (p.fixed) len = p.length;
  else for (const auto& e : encs) len = std::max(len, e.ids.size());
  if (p.multiple_of > 0 && len % p.multiple_of) len += p.multiple_of - len % p.multiple_of;
  for (Tokenizer::Encoding& e : encs) pad_one(e, len, p);
}

}  // namespace

// ------------------------------------------------------------------ the post-processor
void parse_post(const json& j, const std::string& origin, const std::string& path, std::vector<PostStep>& out) {
  if (j.is_null()) return;
  const std::string t = type_of(j, origin, path);
  if (t == "ByteLevel") return;  // it trims offsets only
  if (t == "Sequence") {  // its processors one after the other on the same list of parts
    auto it = j.find("processors");
    if (it == j.end() || !it->is_array()) fail(origin, path + ".processors", "expected an array");
    for (size_t i = 0; i < it->size(); i++)
      parse_post((*it)[i], origin, path + ".processors[" + std::to_string(i) + "]", out);
    return;
  }
  PostStep st;
  st.path = path;
  if (t == "BertProcessing" || t == "RobertaProcessing") {
    auto token = [&](const char* key) {  // ["[CLS]", 101]
      auto it = j.find(key);
      if (it == j.end() || !it->is_array() || it->size() != 2 || !(*it)[0].is_string())
        fail(origin, path + "." + key, "expected [token, id]");
      return token_id((*it)[1], origin, path + "." + key + "[1]");
    };
    st.kind = t == "BertProcessing" ? PostStep::Bert : PostStep::Roberta;
    st.cls = token("cls");
    st.sep = token("sep");
    out.push_back(std::move(st));
    return;
  }
  if (t != "TemplateProcessing")
    fail(origin, path + ".type", "unsupported post-processor \"" + t +
         "\" (TemplateProcessing, BertProcessing, RobertaProcessing, ByteLevel, Sequence)");
  st.kind = PostStep::Template;
  st.single = parse_template(j, "single", origin, path, false);
  try {  // a pair template loom cannot apply matters only to pairs
    st.pair = parse_template(j, "pair", origin, path, true);
  } catch (const std::runtime_error& e) {
    st.pair_error = e.what();
    st.pair.clear();
  }
  out.push_back(std::move(st));
}

size_t PostStep::added(bool is_pair) const {
  if (kind == Bert) return is_pair ? 3 : 2;
  if (kind == Roberta) return is_pair ? 4 : 2;
  size_t n = 0;
  for (const PostPiece& p : is_pair ? pair : single) n += p.ids.size();
  return n;
}

std::vector<PostPart> PostStep::apply(std::vector<PostPart> parts, bool add_special, const std::string& origin) const {
  // `before` p `after`, the same around each of p's windows (as BERT's and RoBERTa's
  // processors wrap them); type_ids 0 for all of them with `zero_types` (RoBERTa's windows)
  auto wrap = [](const PostPart& p, int32_t before, int32_t before_type, int32_t after, int32_t after_type,
                 bool zero_types, auto& self) -> PostPart {
    PostPart out;
    if (before >= 0) out.ids.push_back(before), out.type_ids.push_back(before_type), out.special.push_back(1);
    out.ids.insert(out.ids.end(), p.ids.begin(), p.ids.end());
    if (zero_types) out.type_ids.insert(out.type_ids.end(), p.ids.size(), 0);
    else out.type_ids.insert(out.type_ids.end(), p.type_ids.begin(), p.type_ids.end());
    out.special.insert(out.special.end(), p.special.begin(), p.special.end());
    out.ids.push_back(after), out.type_ids.push_back(after_type), out.special.push_back(1);
    for (const PostPart& w : p.overflowing)
      out.overflowing.push_back(self(w, before, before_type, after, after_type, zero_types, self));
    return out;
  };
  switch (kind) {
    case Roberta:  // RoBERTa has no token types: all 0, with or without its tokens
      for (PostPart& p : parts) p.type_ids.assign(p.ids.size(), 0);  // (HF leaves the windows' types here)
      if (!add_special) return parts;
      for (size_t i = 0; i < parts.size(); i++)  // <s> A </s>, then </s> B </s>
        parts[i] = wrap(parts[i], i == 0 ? cls : sep, 0, sep, 0, true, wrap);
      return parts;
    case Bert:  // [CLS] A [SEP] with type 0, then B [SEP] with type 1
      if (!add_special) return parts;
      for (size_t i = 0; i < parts.size(); i++)
        parts[i] = i == 0 ? wrap(parts[i], cls, 0, sep, 0, false, wrap) : wrap(parts[i], -1, 0, sep, 1, false, wrap);
      return parts;
    case Template: {
      if (parts.size() == 2 && !pair_error.empty()) throw std::runtime_error(pair_error);
      if (parts.size() != 1 && parts.size() != 2)
        throw std::runtime_error("tokenizer " + origin + ": " + path + ": a TemplateProcessing given " +
                                 std::to_string(parts.size()) + " parts by the processors before it (it takes one "
                                 "sequence or a pair; HF cannot apply it either)");
      std::vector<PostPart> out;  // one part per piece of the template
      for (const PostPiece& piece : parts.size() == 1 ? single : pair) {
        if (piece.seq >= 0) {
          PostPart p = parts[size_t(piece.seq)];  // with its windows, whose types HF leaves as they are
          p.type_ids.assign(p.ids.size(), piece.type_id);
          out.push_back(std::move(p));
        } else if (add_special) {
          out.push_back(PostPart{piece.ids, std::vector<int32_t>(piece.ids.size(), piece.type_id),
                                 std::vector<uint8_t>(piece.ids.size(), uint8_t(1)), {}});
        }
      }
      return out;
    }
  }
  return parts;
}

}  // namespace tokenizer_detail

std::vector<PostPart> Tokenizer::Impl::run_post(std::vector<PostPart> parts, bool add_special) const {
  for (size_t i = 0; i < parts.size(); i++) {  // (the windows keep the types they were cut with)
    parts[i].type_ids.assign(parts[i].ids.size(), int32_t(i));
    parts[i].special.assign(parts[i].ids.size(), uint8_t(0));
  }
  for (const PostStep& st : post) parts = st.apply(std::move(parts), add_special, origin);
  return parts;
}

size_t Tokenizer::Impl::post_added(bool is_pair) const {
  size_t n = 0;
  for (const PostStep& st : post) n += st.added(is_pair);
  return n;
}

void Tokenizer::Impl::finish_post() {
  auto past = [&](int32_t id) { return size_t(id) >= id_to_tok.size(); };
  auto past_msg = [&](const std::string& path, int32_t id) {
    return "tokenizer " + origin + ": " + path + ": id " + std::to_string(id) + " is past the vocabulary (" +
           std::to_string(id_to_tok.size()) + " ids)";
  };
  for (PostStep& st : post) {
    std::vector<int32_t> ids;  // every id the step adds to one sequence
    if (st.kind != PostStep::Template) ids = {st.cls, st.sep};
    for (const PostPiece& p : st.single) ids.insert(ids.end(), p.ids.begin(), p.ids.end());
    for (int32_t id : ids)
      if (post_error.empty() && past(id)) post_error = past_msg(st.path, id);
    for (const PostPiece& p : st.pair)
      for (int32_t id : p.ids)
        if (st.pair_error.empty() && past(id)) st.pair_error = past_msg(st.path + ".pair", id);
  }
  if (post_error.empty()) {  // the ids around one sequence: run the steps on a marker
    try {
      std::vector<PostPart> parts = run_post({PostPart{{-1}, {0}, {0}}}, true);
      std::vector<int32_t> all;
      for (const PostPart& p : parts) all.insert(all.end(), p.ids.begin(), p.ids.end());
      if (std::count(all.begin(), all.end(), -1) != 1)
        throw std::runtime_error("tokenizer " + origin + ": post_processor: its steps repeat the sequence " +
                                 std::to_string(std::count(all.begin(), all.end(), -1)) + " times");
      auto at = std::find(all.begin(), all.end(), -1);
      post_prefix.assign(all.begin(), at);
      post_suffix.assign(at + 1, all.end());
    } catch (const std::runtime_error& e) {
      post_error = e.what();
    }
  }
  if (!post_error.empty()) post.clear(), post_prefix.clear(), post_suffix.clear();  // nothing half-applied
  if (padding && past(padding->pad_id)) {
    padding_error = past_msg("padding.pad_id", padding->pad_id);
    padding.reset();
  }
}

// ------------------------------------------------------------------ truncation and padding: JSON
namespace tokenizer_detail {

Tokenizer::Truncation parse_truncation(const json& j, const std::string& origin) {
  const std::string path = "truncation";
  if (!j.is_object()) fail(origin, path, "expected an object or null");
  Tokenizer::Truncation t;
  t.max_length = size_field(j, "max_length", origin, path, std::nullopt);
  t.stride = size_field(j, "stride", origin, path, size_t(0));
  t.left = left_direction(j, origin, path);
  auto s = j.find("strategy");
  using S = Tokenizer::Truncation::Strategy;
  if (s == j.end() || s->is_null() || *s == "LongestFirst") t.strategy = S::LongestFirst;
  else if (*s == "OnlyFirst") t.strategy = S::OnlyFirst;
  else if (*s == "OnlySecond") t.strategy = S::OnlySecond;
  else fail(origin, path + ".strategy", "expected LongestFirst, OnlyFirst or OnlySecond, got " + s->dump().substr(0, 40));
  return t;
}

Tokenizer::Padding parse_padding(const json& j, const std::string& origin) {
  const std::string path = "padding";
  if (!j.is_object()) fail(origin, path, "expected an object or null");
  Tokenizer::Padding p;
  auto s = j.find("strategy");
  if (s == j.end() || s->is_null() || *s == "BatchLongest") {
    p.fixed = false;
  } else if (s->is_object() && s->size() == 1 && s->contains("Fixed")) {
    p.fixed = true;
    p.length = size_field(*s, "Fixed", origin, path + ".strategy", std::nullopt, kMaxPadLength);
  } else {
    fail(origin, path + ".strategy", "expected \"BatchLongest\" or {\"Fixed\": n}, got " + s->dump().substr(0, 40));
  }
  p.left = left_direction(j, origin, path);
  p.multiple_of = size_field(j, "pad_to_multiple_of", origin, path, size_t(0), kMaxPadLength);
  if (j.contains("pad_id") && !j["pad_id"].is_null()) p.pad_id = token_id(j["pad_id"], origin, path + ".pad_id");
  p.pad_type_id = int32_t(size_field(j, "pad_type_id", origin, path, size_t(0), INT32_MAX));
  auto tok = j.find("pad_token");
  if (tok != j.end() && !tok->is_null()) {
    if (!tok->is_string()) fail(origin, path + ".pad_token", "expected a string");
    p.pad_token = tok->get<std::string>();
  }
  return p;
}

json truncation_json(const Tokenizer::Truncation& t) {
  using S = Tokenizer::Truncation::Strategy;
  const char* strategy = t.strategy == S::OnlyFirst ? "OnlyFirst" : t.strategy == S::OnlySecond ? "OnlySecond" : "LongestFirst";
  return json{{"direction", t.left ? "Left" : "Right"}, {"max_length", t.max_length}, {"strategy", strategy},
              {"stride", t.stride}};
}

json padding_json(const Tokenizer::Padding& p) {
  json strategy = p.fixed ? json{{"Fixed", p.length}} : json("BatchLongest");
  return json{{"strategy", strategy},
              {"direction", p.left ? "Left" : "Right"},
              {"pad_to_multiple_of", p.multiple_of ? json(p.multiple_of) : json()},
              {"pad_id", p.pad_id},
              {"pad_type_id", p.pad_type_id},
              {"pad_token", p.pad_token}};
}

}  // namespace tokenizer_detail

// ------------------------------------------------------------------ the public calls
Tokenizer::Encoding Tokenizer::encode_full(const std::string& text, const std::string* pair,
                                           bool add_special_tokens) const {
  const Impl& im = *impl_;
  for (const std::string* e : {&im.truncation_error, &im.padding_error})
    if (!e->empty()) throw std::runtime_error(*e);
  if (!im.post_error.empty() && (add_special_tokens || pair)) throw std::runtime_error(im.post_error);
  std::vector<PostPart> parts(pair ? 2 : 1);
  for (size_t i = 0; i < parts.size(); i++) {
    const std::string& s = i == 0 ? text : *pair;
    // under truncation HF (0.23+) stops the model once a sequence has max_length ids (not for
    // the first one under OnlySecond): what it cut off, and so the overflowing windows, ends
    // with the pre-token that reached max_length, not with the text
    const Truncation* t = im.truncation ? &*im.truncation : nullptr;
    if (t && !(t->strategy == Truncation::Strategy::OnlySecond && i == 0))
      parts[i].ids = im.encode_limited(s, t->max_length, t->left);
    else
      parts[i].ids = encode(s, false);
  }
  for (size_t i = 0; i < parts.size(); i++) {  // as HF's model encodes them: type i, nothing special
    parts[i].type_ids.assign(parts[i].ids.size(), int32_t(i));
    parts[i].special.assign(parts[i].ids.size(), uint8_t(0));
  }
  if (im.truncation) {
    const size_t added = add_special_tokens ? im.post_added(pair != nullptr) : 0;
    if (added > im.truncation->max_length)
      throw std::invalid_argument("tokenizer " + im.origin + ": truncation.max_length " +
                                  std::to_string(im.truncation->max_length) + " leaves no room for the " +
                                  std::to_string(added) + " ids the post-processor adds to " +
                                  (pair ? "a pair" : "one sequence"));
    truncate(parts[0], pair ? &parts[1] : nullptr, *im.truncation, im.truncation->max_length - added, im.origin);
  }
  parts = im.run_post(std::move(parts), add_special_tokens);
  PostPart all;  // HF's Encoding::merge of the parts, windows paired as it pairs them
  for (const PostPart& p : parts) merge_with(all, p);
  std::vector<Encoding> out{to_encoding(all)};
  if (im.padding) pad(out, *im.padding);
  return std::move(out[0]);
}

std::vector<Tokenizer::Encoding> Tokenizer::encode_batch(const std::vector<std::string>& texts,
                                                         const std::vector<std::string>* pairs,
                                                         bool add_special_tokens) const {
  if (pairs && pairs->size() != texts.size())
    throw std::invalid_argument("tokenizer " + impl_->origin + ": encode_batch: " + std::to_string(texts.size()) +
                                " texts but " + std::to_string(pairs->size()) + " pairs");
  std::vector<Encoding> out;
  out.reserve(texts.size());
  for (size_t i = 0; i < texts.size(); i++)
    out.push_back(encode_full(texts[i], pairs ? &(*pairs)[i] : nullptr, add_special_tokens));
  if (impl_->padding) pad(out, *impl_->padding);
  return out;
}

std::optional<Tokenizer::Truncation> Tokenizer::truncation() const {
  if (!impl_->truncation_error.empty()) throw std::runtime_error(impl_->truncation_error);
  return impl_->truncation;
}

std::optional<Tokenizer::Padding> Tokenizer::padding() const {
  if (!impl_->padding_error.empty()) throw std::runtime_error(impl_->padding_error);
  return impl_->padding;
}

Tokenizer Tokenizer::with_truncation(const std::optional<Truncation>& t) const {
  const Impl& im = *impl_;
  if (t) {  // HF's enable_truncation: the stride must fit in what the single template leaves
    const int64_t room = int64_t(t->max_length) - int64_t(im.post_added(false));
    if (t->stride > 0 && int64_t(t->stride) > room)
      throw std::invalid_argument("tokenizer " + im.origin + ": truncation stride " + std::to_string(t->stride) +
                                  " is over max_length " + std::to_string(t->max_length) + " less the " +
                                  std::to_string(im.post_added(false)) + " ids the post-processor adds");
  }
  json doc = json::parse(to_json());
  doc["truncation"] = t ? truncation_json(*t) : json();
  return from_json(doc.dump(), im.origin);
}

Tokenizer Tokenizer::with_padding(const std::optional<Padding>& p) const {
  const Impl& im = *impl_;
  if (p) {
    if ((p->fixed && p->length > kMaxPadLength) || p->multiple_of > kMaxPadLength)
      throw std::invalid_argument("tokenizer " + im.origin + ": padding to " +
                                  std::to_string(std::max(p->length, p->multiple_of)) + " is over 2^20");
    if (p->pad_id < 0 || p->pad_id >= vocab_size())
      throw std::invalid_argument("tokenizer " + im.origin + ": padding id " + std::to_string(p->pad_id) +
                                  " is not in the vocabulary (" + std::to_string(vocab_size()) + " ids)");
    if (p->pad_type_id < 0)
      throw std::invalid_argument("tokenizer " + im.origin + ": padding type id " + std::to_string(p->pad_type_id) +
                                  " is negative");
  }
  json doc = json::parse(to_json());
  doc["padding"] = p ? padding_json(*p) : json();
  return from_json(doc.dump(), im.origin);
}

}  // namespace loom
