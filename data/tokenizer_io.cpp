// tokenizer_io.cpp: reading an HF tokenizer.json into a Tokenizer and writing one back.
// Unsupported or malformed entries are errors naming the file and the JSON path.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "data/tokenizer.h"
#include "data/tokenizer_impl.h"
#include "tensor/fileio.h"

namespace loom {

using ojson = nlohmann::ordered_json;  // keeps HF's key order (and the vocab in id order) on save

// ------------------------------------------------------------------ loading
namespace tokenizer_detail {

// A token id: a JSON integer in [0, kMaxTokenId]. get<int32_t>() would take a float too and
// convert it with undefined behaviour when it does not fit (the tokenizer fuzz target found
// 2.1e127), and an id in the billions would size the id tables (one entry per id up to the
// largest) in the tens of GB; the largest published vocabularies are ~260k ids.
constexpr int64_t kMaxTokenId = (int64_t(1) << 24) - 1;
int32_t token_id(const json& v, const std::string& origin, const std::string& path) {
  if (!v.is_number_integer()) {
    std::string got = v.dump();
    if (got.size() > 40) got = got.substr(0, 40) + "...";
    fail(origin, path, "expected an integer id, got " + got);
  }
  if (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t(kMaxTokenId) : v.get<int64_t>() > kMaxTokenId)
    fail(origin, path, "id " + v.dump() + " is out of range (at most " + std::to_string(kMaxTokenId) + ")");
  if (!v.is_number_unsigned() && v.get<int64_t>() < 0) fail(origin, path, "negative id");
  return int32_t(v.get<int64_t>());
}

std::string type_of(const json& j, const std::string& origin, const std::string& path) {
  auto it = j.find("type");
  if (!j.is_object() || it == j.end() || !it->is_string()) fail(origin, path + ".type", "missing");
  return it->get<std::string>();
}

}  // namespace tokenizer_detail

namespace {

bool opt_bool(const json& j, const char* key, bool dflt) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? dflt : it->get<bool>();
}

// {"String": s} (matched literally) or {"Regex": r}, as Split and Replace take it.
std::shared_ptr<text::Regex> parse_pattern(const json& pat, const std::string& origin, const std::string& path) {
  try {
    if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string())
      return std::make_shared<text::Regex>(pat["Regex"].get<std::string>());
    if (pat.is_object() && pat.contains("String") && pat["String"].is_string())
      return std::make_shared<text::Regex>(pat["String"].get<std::string>(), true);
  } catch (const std::runtime_error& e) {
    fail(origin, path, e.what());
  }
  fail(origin, path, "expected {\"Regex\": ...} or {\"String\": ...}");
}

std::string str_field(const json& j, const char* key, const std::string& origin, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) fail(origin, path + "." + key, "expected a string");
  return it->get<std::string>();
}

// A field that HF reads as one Rust char: exactly one code point.
uint32_t char_field(const json& j, const char* key, const std::string& origin, const std::string& path) {
  std::string s = str_field(j, key, origin, path);
  uint32_t cp = 0;
  int n = s.empty() ? 0 : text::utf8_seq(reinterpret_cast<const unsigned char*>(s.data()), s.size(), &cp);
  if (n <= 0 || size_t(n) != s.size()) fail(origin, path + "." + key, "expected one character, got \"" + s + "\"");
  return cp;
}

// Metaspace's prepend_scheme (default "always"); the older add_prefix_space = false means
// "never" and, as in HF, contradicts any other declared scheme.
Prepend parse_prepend(const json& j, const std::string& origin, const std::string& path) {
  Prepend p = Prepend::Always;
  if (j.contains("prepend_scheme") && !j["prepend_scheme"].is_null()) {
    std::string s = str_field(j, "prepend_scheme", origin, path);
    if (s == "first") p = Prepend::First;
    else if (s == "never") p = Prepend::Never;
    else if (s != "always") fail(origin, path + ".prepend_scheme", "unsupported prepend_scheme \"" + s + "\"");
  }
  if (!opt_bool(j, "add_prefix_space", true)) {
    if (p != Prepend::Never) fail(origin, path + ".add_prefix_space", "add_prefix_space does not match prepend_scheme");
    p = Prepend::Never;
  }
  return p;
}

void parse_normalizer(const json& j, const std::string& origin, const std::string& path,
                      std::vector<NormStep>& out) {
  if (j.is_null()) return;
  std::string t = type_of(j, origin, path);
  static const std::pair<const char*, text::NormForm> forms[] = {
      {"NFC", text::NormForm::NFC}, {"NFD", text::NormForm::NFD}, {"NFKC", text::NormForm::NFKC},
      {"NFKD", text::NormForm::NFKD}, {"Lowercase", text::NormForm::Lowercase}};
  auto form = std::find_if(std::begin(forms), std::end(forms), [&](auto& f) { return t == f.first; });
  NormStep n;
  if (t == "Sequence") {
    const json& list = j.at("normalizers");
    for (size_t i = 0; i < list.size(); i++)
      parse_normalizer(list[i], origin, path + ".normalizers[" + std::to_string(i) + "]", out);
    return;
  } else if (form != std::end(forms)) {
    n.form = form->second;
  } else if (t == "Prepend") {
    n.kind = NormStep::PrependText;
    n.content = str_field(j, "prepend", origin, path);
  } else if (t == "Replace") {
    n.kind = NormStep::Replace;
    n.re = parse_pattern(j.contains("pattern") ? j["pattern"] : json(), origin, path + ".pattern");
    n.content = str_field(j, "content", origin, path);
  } else {
    fail(origin, path + ".type", "unsupported normalizer \"" + t + "\"");
  }
  out.push_back(std::move(n));
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
    st.kind = PreStep::ByteLevel;
    st.add_prefix_space = opt_bool(j, "add_prefix_space", true);
    st.use_regex = opt_bool(j, "use_regex", true);
  } else if (t == "Metaspace") {
    st.kind = PreStep::Metaspace;
    uint32_t cp = char_field(j, "replacement", origin, path);
    text::append_utf8(st.replacement, cp);
    st.re = std::make_shared<text::Regex>(st.replacement, true);
    st.prepend = parse_prepend(j, origin, path);
    st.split = opt_bool(j, "split", true);
  } else if (t == "Digits") {
    // HF: individual digits are each isolated; otherwise runs of digits ("Contiguous")
    st.re = std::make_shared<text::Regex>(opt_bool(j, "individual_digits", false) ? "\\p{N}" : "\\p{N}+");
  } else if (t == "Split") {
    st.re = parse_pattern(j.contains("pattern") ? j["pattern"] : json(), origin, path + ".pattern");
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

void parse_decoder(const json& j, const std::string& origin, const std::string& path,
                   std::vector<DecodeStep>& out) {
  std::string t = type_of(j, origin, path);
  DecodeStep d;
  if (t == "Sequence") {
    const json& list = j.at("decoders");
    for (size_t i = 0; i < list.size(); i++)
      parse_decoder(list[i], origin, path + ".decoders[" + std::to_string(i) + "]", out);
    return;
  } else if (t == "ByteLevel") {
    d.kind = DecodeStep::ByteLevel;
  } else if (t == "Replace") {
    d.kind = DecodeStep::Replace;
    d.re = parse_pattern(j.contains("pattern") ? j["pattern"] : json(), origin, path + ".pattern");
    d.content = str_field(j, "content", origin, path);
  } else if (t == "ByteFallback") {
    d.kind = DecodeStep::ByteFallback;
  } else if (t == "Fuse") {
    d.kind = DecodeStep::Fuse;
  } else if (t == "Strip") {
    d.kind = DecodeStep::Strip;
    d.ch = char_field(j, "content", origin, path);
    for (const char* k : {"start", "stop"})
      if (!j.contains(k) || !j[k].is_number_unsigned())
        fail(origin, path + "." + k, "expected a count (a non-negative integer)");
    d.start = j["start"].get<size_t>(), d.stop = j["stop"].get<size_t>();
  } else if (t == "Metaspace") {
    d.kind = DecodeStep::Metaspace;
    d.ch = char_field(j, "replacement", origin, path);
    d.prepend = parse_prepend(j, origin, path);
  } else {
    fail(origin, path + ".type", "unsupported decoder \"" + t + "\"");
  }
  out.push_back(std::move(d));
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
    const int32_t id = token_id(it.value(), origin, "model.vocab[\"" + it.key() + "\"]");
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
    AddedToken a{token_id(t.at("id"), origin, "added_tokens[" + std::to_string(i) + "].id"),
                 t.at("content").get<std::string>(),
                 opt_bool(t, "single_word", false), opt_bool(t, "lstrip", false),
                 opt_bool(t, "rstrip", false), opt_bool(t, "normalized", true),
                 opt_bool(t, "special", false)};
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
  im->has_decoder = !im->decoder_json.is_null();
  if (im->has_decoder) parse_decoder(im->decoder_json, origin, "decoder", im->decoders);
  // A post-processor, truncation or padding loom cannot apply is not a loading error (encode
  // without special tokens, what the chat pipeline does, never needs them): it is reported
  // when an encode asks for it.
  try {
    parse_post(im->post_json, origin, "post_processor", im->post);
  } catch (const std::runtime_error& e) {
    im->post_error = e.what();
  }
  try {
    if (!im->truncation_json.is_null()) im->truncation = parse_truncation(im->truncation_json, origin);
  } catch (const std::runtime_error& e) {
    im->truncation_error = e.what();
  }
  try {
    if (!im->padding_json.is_null()) im->padding = parse_padding(im->padding_json, origin);
  } catch (const std::runtime_error& e) {
    im->padding_error = e.what();
  }

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
  im->finish_post();
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

Tokenizer Tokenizer::with_special_tokens(const std::vector<std::string>& tokens) const {
  const Impl& im = *impl_;
  json doc = json::parse(to_json());
  int32_t next = int32_t(im.id_kind.size());
  for (const std::string& t : tokens) {
    if (t.empty()) throw std::invalid_argument("tokenizer " + im.origin + ": an added token cannot be empty");
    if (im.added_ids.count(t)) continue;
    bool listed = false;  // given twice in `tokens`
    for (const json& a : doc["added_tokens"]) listed = listed || a["content"] == t;
    if (listed) continue;
    auto v = im.vocab.find(t);
    int32_t id = v != im.vocab.end() ? v->second : next++;
    doc["added_tokens"].push_back({{"id", id}, {"content", t}, {"single_word", false}, {"lstrip", false},
                                   {"rstrip", false}, {"normalized", false}, {"special", true}});
  }
  return from_json(doc.dump(), im.origin);
}

// Written to a temporary name and renamed (tensor/fileio.h): a run killed while caching its
// tokenizer never leaves a half-written tokenizer.json for the resume to read.
void Tokenizer::save(const std::string& path) const {
  std::string text = to_json() + "\n";
  write_file_atomic(path, {{text.data(), text.size()}});
}

}  // namespace loom
