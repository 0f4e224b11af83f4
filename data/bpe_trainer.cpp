// bpe_trainer.cpp: byte-level BPE training, step for step what HF's BpeTrainer does, so that
// a tokenizer trained here on the same words has the same vocabulary and merges.
//
//   1. words: every text is pre-tokenized (individual digits, then ByteLevel with the GPT-2
//      regex, as SmolLM2) and the byte-level pre-tokens are counted. Special tokens inside
//      the texts are not cut out (HF's trainer does not either).
//   2. vocabulary: the special tokens (ids 0..S-1), then the alphabet -- the 256 byte
//      characters plus any other character seen -- sorted by code point.
//   3. pair counts over all words (weighted by word count) and, per pair, the words that
//      hold it. A max-heap orders the pairs by count, ties to the smaller (left, right) id
//      pair. Counts in the heap are lazy: a popped pair whose count changed since it was
//      pushed goes back with the new count.
//   4. merge the top pair in the words that hold it, left to right without overlap, and
//      update the counts of the neighbouring pairs; the pairs the merge created enter the
//      heap. Repeat until the vocabulary holds vocab_size entries or no pair is left.
// Like HF, the merged pair's own count is not reset (it is never popped again because its
// word list is spent), and a merged string that already exists keeps its old id.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <queue>
#include <set>
#include <stdexcept>
#include <unordered_map>

#include "data/tokenizer.h"
#include "data/tokenizer_text.h"

namespace loom {

namespace {

using json = nlohmann::json;  // key order is irrelevant here: save() writes HF's order

uint64_t key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

struct Word {
  std::vector<int32_t> sym;
  int64_t count;
};

// HF's Word::merge: replace every non-overlapping (a, b), left to right, by c and report the
// changed neighbour pairs as (pair, +1/-1).
void merge_word(Word& w, int32_t a, int32_t b, int32_t c, std::vector<std::pair<uint64_t, int>>& changes) {
  std::vector<int32_t>& s = w.sym;
  for (size_t i = 0; i < s.size(); i++) {
    if (s[i] != a || i + 1 >= s.size() || s[i + 1] != b) continue;
    if (i > 0) {
      changes.push_back({key(s[i - 1], a), -1});
      changes.push_back({key(s[i - 1], c), +1});
    }
    s[i] = c;
    s.erase(s.begin() + std::ptrdiff_t(i) + 1);
    if (i + 1 < s.size()) {
      changes.push_back({key(b, s[i + 1]), -1});
      changes.push_back({key(c, s[i + 1]), +1});
    }
  }
}

struct Entry {
  int64_t count;
  uint64_t pair;
  size_t where;  // index into the list of word-index sets
};
// std::priority_queue pops the largest: more frequent first, then the smaller pair
struct EntryLess {
  bool operator()(const Entry& x, const Entry& y) const {
    return x.count != y.count ? x.count < y.count : x.pair > y.pair;
  }
};

json pipeline_config() {
  json pre = {{"type", "Sequence"},
               {"pretokenizers",
                {{{"type", "Digits"}, {"individual_digits", true}},
                 {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                  {"use_regex", true}}}}};
  json dec = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true},
               {"use_regex", true}};
  json doc;
  doc["version"] = "1.0";
  doc["truncation"] = nullptr;
  doc["padding"] = nullptr;
  doc["added_tokens"] = json::array();
  doc["normalizer"] = nullptr;
  doc["pre_tokenizer"] = pre;
  doc["post_processor"] = nullptr;
  doc["decoder"] = dec;
  doc["model"] = {{"type", "BPE"}, {"vocab", json::object()}, {"merges", json::array()}};
  return doc;
}

}  // namespace

Tokenizer Tokenizer::train(const std::vector<std::string>& texts, int vocab_size,
                           const std::vector<std::string>& special_tokens) {
  json doc = pipeline_config();
  const Tokenizer shell = from_json(doc.dump(), "<trained>");

  // 1. words (sorted, so that runs are reproducible; the result does not depend on it)
  std::map<std::string, int64_t> counts;
  for (const std::string& t : texts)
    for (std::string& w : shell.pre_tokenize(t)) counts[std::move(w)]++;

  // 2. specials, then the alphabet by code point
  std::vector<std::string> id2w;
  std::unordered_map<std::string, int32_t> w2id;
  auto add = [&](const std::string& s) {
    auto it = w2id.find(s);
    if (it != w2id.end()) return it->second;
    id2w.push_back(s);
    return w2id[s] = int32_t(id2w.size() - 1);
  };
  for (const std::string& s : special_tokens) add(s);
  std::set<uint32_t> alphabet;
  for (int b = 0; b < 256; b++) {
    uint32_t cp;
    const std::string& c = text::byte_to_char(uint8_t(b));
    text::utf8_seq(reinterpret_cast<const unsigned char*>(c.data()), c.size(), &cp);
    alphabet.insert(cp);
  }
  std::vector<Word> words;
  words.reserve(counts.size());
  std::vector<std::vector<uint32_t>> word_cps;
  for (auto& [w, n] : counts) {
    std::vector<uint32_t> cps;
    const auto* p = reinterpret_cast<const unsigned char*>(w.data());
    for (size_t i = 0; i < w.size();) {
      uint32_t cp;
      i += size_t(text::utf8_seq(p + i, w.size() - i, &cp));  // pre-tokens are valid UTF-8
      cps.push_back(cp);
      alphabet.insert(cp);
    }
    word_cps.push_back(std::move(cps));
    words.push_back({{}, n});
  }
  for (uint32_t cp : alphabet) {
    std::string s;
    text::append_utf8(s, cp);
    add(s);
  }
  for (size_t i = 0; i < words.size(); i++)
    for (uint32_t cp : word_cps[i]) {
      std::string s;
      text::append_utf8(s, cp);
      words[i].sym.push_back(w2id.at(s));
    }

  // 3. pair counts and where each pair occurs
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::vector<std::vector<int32_t>> where_sets;
  std::priority_queue<Entry, std::vector<Entry>, EntryLess> heap;
  {
    std::unordered_map<uint64_t, std::vector<int32_t>> where;
    for (size_t wi = 0; wi < words.size(); wi++) {
      const auto& s = words[wi].sym;
      for (size_t i = 0; i + 1 < s.size(); i++) {
        uint64_t k = key(s[i], s[i + 1]);
        pair_count[k] += words[wi].count;
        auto& v = where[k];
        if (v.empty() || v.back() != int32_t(wi)) v.push_back(int32_t(wi));
      }
    }
    for (auto& [k, v] : where) {
      if (pair_count[k] <= 0) continue;
      where_sets.push_back(std::move(v));
      heap.push({pair_count[k], k, where_sets.size() - 1});
    }
  }

  // 4. merge until the vocabulary is full
  std::vector<std::pair<int32_t, int32_t>> merges;
  std::vector<std::pair<uint64_t, int>> changes;
  while (int(id2w.size()) < vocab_size && !heap.empty()) {
    Entry top = heap.top();
    heap.pop();
    int64_t now = pair_count[top.pair];
    if (top.count != now) {
      top.count = now;
      heap.push(top);
      continue;
    }
    if (top.count < 1) break;
    const int32_t a = int32_t(top.pair >> 32), b = int32_t(top.pair & 0xFFFFFFFFu);
    const int32_t c = add(id2w[size_t(a)] + id2w[size_t(b)]);
    merges.emplace_back(a, b);
    std::unordered_map<uint64_t, std::vector<int32_t>> created;
    for (int32_t wi : where_sets[top.where]) {
      changes.clear();
      merge_word(words[size_t(wi)], a, b, c, changes);
      for (auto [k, d] : changes) {
        pair_count[k] += d * words[size_t(wi)].count;
        if (d > 0) {
          auto& v = created[k];
          if (v.empty() || v.back() != wi) v.push_back(wi);
        }
      }
    }
    where_sets[top.where].clear();
    where_sets[top.where].shrink_to_fit();
    for (auto& [k, v] : created) {
      if (pair_count[k] <= 0) continue;
      where_sets.push_back(std::move(v));
      heap.push({pair_count[k], k, where_sets.size() - 1});
    }
  }

  // the trained tokenizer as an HF document
  json added = json::array();
  for (const std::string& s : special_tokens)
    added.push_back({{"id", w2id.at(s)}, {"content", s}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  doc["added_tokens"] = added;
  json vocab = json::object();
  for (size_t i = 0; i < id2w.size(); i++) vocab[id2w[i]] = int32_t(i);
  json ms = json::array();
  for (auto [a, b] : merges) ms.push_back({id2w[size_t(a)], id2w[size_t(b)]});
  doc["model"] = {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                  {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                  {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
                  {"vocab", std::move(vocab)}, {"merges", ms}};
  return from_json(doc.dump(), "<trained>");
}

}  // namespace loom
