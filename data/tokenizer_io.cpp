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

// Written to a temporary name and renamed (tensor/fileio.h): a run killed while caching its
// tokenizer never leaves a half-written tokenizer.json for the resume to read.
void Tokenizer::save(const std::string& path) const {
  std::string text = to_json() + "\n";
  write_file_atomic(path, {{text.data(), text.size()}});
}

}  // namespace loom
