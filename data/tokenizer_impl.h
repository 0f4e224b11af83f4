// tokenizer_impl.h: the state behind a Tokenizer, shared by tokenizer.cpp (encode, decode),
// tokenizer_spm.cpp (normalizers, Metaspace, decoders), tokenizer_io.cpp (load, save) and
// tokenizer_post.cpp (truncation, post-processor, padding). Internal to data/tokenizer*.cpp.
#pragma once
#include <nlohmann/json.hpp>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "data/tokenizer.h"
#include "data/tokenizer_text.h"

namespace loom {

using json = nlohmann::json;

namespace tokenizer_detail {

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// HF's Metaspace prepend_scheme: when the replacement character is put before a piece.
enum class Prepend { Always, First, Never };

// One normalizer step: a Unicode form or Lowercase, Prepend (a prefix on non-empty text) or
// Replace (every match of a pattern by `content`).
struct NormStep {
  enum Kind { Form, PrependText, Replace } kind = Form;
  text::NormForm form = text::NormForm::NFC;
  std::string content;
  std::shared_ptr<text::Regex> re;  // Replace
};

// One pre-tokenizer step. Digits is a Split on \p{N} (HF: char::is_numeric, i.e. Nd|Nl|No).
// Metaspace writes ' ' as `replacement`, may prepend it, and may split before each one.
struct PreStep {
  enum Kind { Split, ByteLevel, Metaspace } kind = Split;
  bool add_prefix_space = false, use_regex = true;      // ByteLevel
  std::shared_ptr<text::Regex> re;                      // Split / Digits; Metaspace: the replacement
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  std::string replacement;                              // Metaspace
  Prepend prepend = Prepend::Always;
  bool split = true;
};

// One decoder step; decoders map a list of token strings to another (HF's decode_chain),
// and the result is joined with "".
struct DecodeStep {
  enum Kind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace } kind = ByteLevel;
  std::shared_ptr<text::Regex> re;  // Replace: the pattern
  std::string content;              // Replace: the replacement
  uint32_t ch = 0;                  // Strip: the character; Metaspace: the replacement
  size_t start = 0, stop = 0;       // Strip: at most this many from the start / the end
  Prepend prepend = Prepend::Always;
};

// GPT-2's pre-tokenizer regex, which HF's ByteLevel(use_regex=true) applies.
inline constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// One step of the post-processor (tokenizer_post.cpp), HF's PostProcessor::process_encodings:
// it maps the list of parts (at first one per sequence, each with its type ids) to another
// list; the parts are joined at the end. A Sequence of processors is flattened into its steps;
// ByteLevel changes no id and adds no step.
struct PostPart {
  std::vector<int32_t> ids, type_ids;
  std::vector<uint8_t> special;  // 1: a token a post-processor added (Encoding::special_tokens_mask)
  // the windows truncation cut off (HF's Encoding::overflowing), each a part of its own; after a
  // merge a window may hold windows too, as HF's merge_with nests them (tokenizer_post.cpp)
  std::vector<PostPart> overflowing;
};
struct PostPiece {            // one entry of a template
  int seq = -1;               // 0: sequence A, 1: sequence B, -1: the special token's ids
  std::vector<int32_t> ids;   // a special token's ids
  int32_t type_id = 0;
};
struct PostStep {
  enum Kind { Bert, Roberta, Template } kind = Template;
  std::string path;                      // its JSON path, for errors
  int32_t cls = 0, sep = 0;              // Bert, Roberta
  std::vector<PostPiece> single, pair;   // Template
  std::string pair_error;                // Template: why its pair template cannot be applied
  size_t added(bool is_pair) const;      // HF's added_tokens(is_pair)
  // throws std::runtime_error (prefixed with `origin`) where HF cannot go on either
  std::vector<PostPart> apply(std::vector<PostPart> parts, bool add_special, const std::string& origin) const;
};

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

inline uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }

// tokenizer_spm.cpp: every match of re in s replaced by content (HF's Replace).
std::string replace_all(const std::string& s, const text::Regex& re, const std::string& content);
// Metaspace's rewrite of one piece before its split: ' ' -> replacement, then the prefix that
// prepend_scheme asks for (`first`: the piece starts the original text).
std::string metaspace_rewrite(const PreStep& st, const std::string& piece, bool first);

// tokenizer_io.cpp: a token id (a JSON integer in [0, 2^24)) and an object's "type" string,
// or an error naming the path.
int32_t token_id(const json& v, const std::string& origin, const std::string& path);
std::string type_of(const json& j, const std::string& origin, const std::string& path);

// tokenizer_post.cpp: the post-processor's steps from its JSON (a Sequence flattened; throws
// naming the path), and the file's truncation and padding (throw naming the path).
void parse_post(const json& j, const std::string& origin, const std::string& path, std::vector<PostStep>& out);
Tokenizer::Truncation parse_truncation(const json& j, const std::string& origin);
Tokenizer::Padding parse_padding(const json& j, const std::string& origin);
json truncation_json(const Tokenizer::Truncation& t);  // HF's serialized form
json padding_json(const Tokenizer::Padding& p);

[[noreturn]] inline void fail(const std::string& origin, const std::string& path, const std::string& msg) {
  throw std::runtime_error("tokenizer " + origin + ": " + path + ": " + msg);
}

}  // namespace tokenizer_detail

using namespace tokenizer_detail;

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
  std::vector<NormStep> normalizers;
  std::vector<PreStep> pre;
  bool has_decoder = true;  // else HF's no-decoder fallback: join the tokens with ' '
  std::vector<DecodeStep> decoders;
  // the post-processor (tokenizer_post.cpp): its steps, the ids they put around one text
  // (encode(text, true)), or why it cannot be applied (then no steps: nothing half-applied)
  std::vector<PostStep> post;
  std::vector<int32_t> post_prefix, post_suffix;
  std::string post_error;
  // truncation and padding (tokenizer_post.cpp), or why the file's cannot be applied
  std::optional<Tokenizer::Truncation> truncation;
  std::optional<Tokenizer::Padding> padding;
  std::string truncation_error, padding_error;
  // kept verbatim for save()
  json normalizer_json, pre_json, post_json, decoder_json, truncation_json, padding_json;
  // per pre-token cache (HF keeps one too); bounded so a long run cannot grow it forever.
  // Only short pre-tokens are kept (HF: under 256 bytes): without a pre-tokenizer (Llama 2,
  // Gemma) a pre-token is a whole stretch of text, which would rarely be seen again.
  static constexpr size_t kCacheCap = 1 << 18, kCacheMaxLen = 256;
  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  std::vector<Segment> split_added(const std::string& s, const Trie& trie) const;
  std::string normalize(std::string s) const;  // tokenizer_spm.cpp
  // `first`: s starts at offset 0 of the original text (Metaspace's prepend_scheme "first")
  void pre_tokenize(const std::string& s, bool first, std::vector<std::string>& out) const;
  std::string run_decoders(std::vector<std::string> tokens) const;  // tokenizer_spm.cpp
  // the post-processor over these parts (HF's PostProcessor::process before the join)
  std::vector<PostPart> run_post(std::vector<PostPart> parts, bool add_special) const;
  size_t post_added(bool is_pair) const;
  // after the id tables are built: the steps' ids checked against them, post_prefix and
  // post_suffix found (or post_error set and the steps dropped)
  void finish_post();
  void bpe(const std::string& word, std::vector<int32_t>& out) const;
  void bpe_uncached(const std::string& word, std::vector<int32_t>& out) const;
  // Steps 1-3 of encode on valid UTF-8: the text's splits in order, HF's PreTokenizedString
  // splits: an added token (id >= 0) or a pre-token for BPE (word).
  struct Split {
    int32_t id;
    std::string word;
  };
  std::vector<Split> splits(const std::string& text) const;
  // HF tokenizers' early exit under truncation (0.23+, PreTokenizedString::tokenize_with_limit):
  // BPE runs on the splits in order (from the end with `left`) until the ids reach max_tokens,
  // and the splits past that one are dropped; an added token counts without stopping there.
  std::vector<int32_t> encode_limited(const std::string& text, size_t max_tokens, bool left) const;
};

}  // namespace loom
