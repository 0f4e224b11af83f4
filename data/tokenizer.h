// tokenizer.h: a BPE tokenizer that reads and writes HF `tokenizer.json` files and encodes
// id for id like HF tokenizers, plus a byte-level BPE trainer. Both families of BPE files
// load: byte-level (GPT-2, SmolLM2: every byte one printable character) and SentencePiece
// conversions (Llama 2, Gemma, Mistral: spaces as U+2581 "▁", characters missing from the
// vocabulary as <0xXX> byte tokens with byte_fallback).
//
// Encoding runs the HF pipeline, in this order:
//   1. added tokens: the text is cut at every added token (leftmost, then longest match).
//      Tokens with normalized=false (all special tokens) are matched on the raw text, the
//      others on the normalized text; their ids are emitted as they are.
//   2. normalizer (null | NFC | NFD | NFKC | NFKD | Lowercase | Prepend | Replace |
//      Sequence) on each piece between added tokens.
//   3. pre-tokenizer (null | ByteLevel | Metaspace | Digits | Split | Sequence): pieces cut
//      into pre-tokens; ByteLevel maps every byte to one printable character (GPT-2's
//      bytes_to_unicode); Metaspace writes ' ' as "▁", prepends one (prepend_scheme
//      always | first: only to the piece that starts the text | never) and may split.
//   4. model BPE: each pre-token is split into characters (a character not in the
//      vocabulary becomes its <0xXX> byte tokens with byte_fallback, else unk, consecutive
//      unks fused with fuse_unk), then the pair of adjacent symbols with the lowest merge
//      rank is merged (leftmost first) until none is left. Results are cached per pre-token
//      (those under 256 bytes, as HF does).
// Decoding: ids -> token strings (special ones skipped on request) -> the decoder chain
// (ByteLevel | Replace | ByteFallback | Fuse | Strip | Metaspace | Sequence; none: the
// tokens joined by ' ') -> the strings joined. Invalid UTF-8 becomes U+FFFD as HF does:
// ByteLevel per ill-formed subpart, ByteFallback once per byte of an invalid run.
//
//   5. post-processor, only when encode is asked to add special tokens (HF's
//      add_special_tokens=True): the ids its single-sequence template puts before and after
//      the text (TemplateProcessing, BertProcessing, RobertaProcessing, ByteLevel, Sequence;
//      e.g. Llama's BOS). Without the request, as the chat pipeline encodes, none are added.
// encode() stops there, as transformers' tokenizers do unless asked for more. encode_full()
// runs what HF tokenizers' own Tokenizer.encode(text, pair) runs after step 4
// (data/tokenizer_post.cpp):
//   truncation (the file's "truncation", or with_truncation) of one sequence or of a pair,
//   the post-processor with its pair template and type ids, then padding (the file's
//   "padding", or with_padding), and returns ids, type ids, the attention mask and the
//   special-tokens mask.
// What truncation cuts off comes back as HF returns it: Encoding::overflowing, windows of the
// kept length that overlap by `stride` ids, post-processed and padded like the encoding. Under
// truncation the model runs on the pre-tokens only until max_length ids are reached, as HF
// tokenizers 0.23+ does (its early exit), so the windows stop where that pre-token stops.
//
// A Tokenizer is immutable after construction and safe to use from several threads (the
// per-pre-token cache is guarded by a mutex); copies share the same state.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace loom {

class Tokenizer {
 public:
  // Load an HF tokenizer.json. Errors (std::runtime_error) name the file and, for
  // unsupported or malformed entries, the JSON path (e.g. "pre_tokenizer.pretokenizers[1].type").
  static Tokenizer from_file(const std::string& path);
  static Tokenizer from_json(const std::string& json_text, const std::string& origin);

  // Train byte-level BPE on texts (SmolLM2-style pre-tokenizer: individual digits, then the
  // GPT-2 byte-level regex split), up to vocab_size entries, special tokens first, then the
  // 256 byte characters, then one entry per merge. Follows HF's BpeTrainer: the most
  // frequent pair wins, ties go to the smaller (left id, right id).
  static Tokenizer train(const std::vector<std::string>& texts, int vocab_size,
                         const std::vector<std::string>& special_tokens);

  // A copy with `tokens` added as special tokens, as HF's add_special_tokens does: a token
  // that is already an added token stays as it is, one in the model vocabulary becomes an
  // added token with its id, any other gets the next free id (vocab_size(), then on).
  // Like every special token, they are cut out of the raw text before normalization.
  Tokenizer with_special_tokens(const std::vector<std::string>& tokens) const;

  void save(const std::string& path) const;   // HF-compatible tokenizer.json
  std::string to_json() const;                 // the same document as a string

  // Added and special tokens found in `text` become their ids. Throws std::invalid_argument
  // when text is not valid UTF-8 (the byte offset is in the message). add_special_tokens:
  // the post-processor's tokens around the ids (HF's default is true, loom's false: the chat
  // template writes its special tokens into the text itself); a file whose post-processor
  // cannot be applied (unknown type, malformed, ids past the vocabulary) loads, and this
  // throws std::runtime_error naming the file and the JSON path.
  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens = false) const;
  // The ids encode(text, true) puts before and after the text (empty without a post-processor).
  const std::vector<int32_t>& special_prefix() const;
  const std::vector<int32_t>& special_suffix() const;
  // HF's truncation parameters (tokenizer.json's "truncation"). With a pair, LongestFirst
  // shortens the longer sequence first (HF's exact split, also when both must be cut),
  // OnlyFirst / OnlySecond cut one and fail when it is too short. With special tokens
  // requested, max_length counts the ones the post-processor adds.
  struct Truncation {
    enum class Strategy { LongestFirst, OnlyFirst, OnlySecond };
    size_t max_length = 512;
    size_t stride = 0;  // ids each overflowing window shares with the one before it
    Strategy strategy = Strategy::LongestFirst;
    bool left = false;  // direction "Left": the tokens are dropped from the start
  };
  // HF's padding parameters (tokenizer.json's "padding"): to `length` when `fixed` (strategy
  // {"Fixed": n}), else to the longest encoding of the batch ("BatchLongest"), rounded up to a
  // multiple of `multiple_of` (0: none); never shortens. Pads carry attention mask 0.
  struct Padding {
    bool fixed = false;
    size_t length = 0;
    bool left = false;  // direction "Left": the pads go first
    size_t multiple_of = 0;
    int32_t pad_id = 0, pad_type_id = 0;
    std::string pad_token = "[PAD]";
  };
  struct Encoding {
    std::vector<int32_t> ids, type_ids;  // type ids: 0 / 1 for the first / second sequence, or as the template says
    std::vector<uint8_t> attention_mask;  // 1 for a token, 0 for padding
    std::vector<uint8_t> special_tokens_mask;  // 1 for a token the post-processor added and for padding
    // HF's `overflowing`: the ids truncation cut off, in windows of the length it kept (the last
    // may be shorter) that repeat the `stride` ids before them, in order away from the kept
    // end; each window goes through the post-processor and padding as the encoding does. With
    // a pair, HF's merge pairs the windows of the two sequences: each window of the first with
    // the whole second and with each of its windows, then the whole first (its windows nested
    // inside) with each window of the second; this follows it, nesting included. As in HF
    // tokenizers 0.23+, whose model stops under truncation at the pre-token that reaches
    // max_length, the windows cover what that pre-token brought past it, not the rest of the text.
    std::vector<Encoding> overflowing;
  };
  // HF tokenizers' Tokenizer.encode(text, pair, add_special_tokens): encode() of each
  // sequence, then truncation, the post-processor (its pair template when `pair` is given) and
  // padding. Throws std::invalid_argument for text that is not UTF-8 or a truncation the
  // sequences cannot meet (naming the strategy and lengths; also a stride not under the ids a
  // sequence keeps, and windows, or a pair's windows paired, of over 2^26 ids), std::runtime_error naming the
  // file and JSON path when the file's truncation, padding or post-processor cannot be applied.
  Encoding encode_full(const std::string& text, const std::string* pair, bool add_special_tokens) const;
  // encode_full of each text (with pairs[i] when pairs is given; the sizes must agree), then
  // padding over the batch (BatchLongest: to the longest of them), as HF's encode_batch.
  std::vector<Encoding> encode_batch(const std::vector<std::string>& texts, const std::vector<std::string>* pairs,
                                     bool add_special_tokens) const;
  // The file's truncation / padding (nullopt: none); throws naming the JSON path when malformed.
  std::optional<Truncation> truncation() const;
  std::optional<Padding> padding() const;
  // Copies with other parameters (nullopt: none), written by save() in HF's form. As HF's
  // enable_truncation, a stride greater than max_length less the tokens the single template
  // adds is refused (std::invalid_argument), and so is a padding length over 2^20.
  Tokenizer with_truncation(const std::optional<Truncation>& t) const;
  Tokenizer with_padding(const std::optional<Padding>& p) const;

  // Ids outside the vocabulary throw std::out_of_range naming the id.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  int32_t token_id(const std::string& token) const;  // throws naming the token if absent
  bool has_token(const std::string& token) const;
  const std::string& id_to_token(int32_t id) const;  // the vocabulary string (byte-level form)
  bool is_special(int32_t id) const;                 // an added token with special=true
  int vocab_size() const;                             // max id + 1
  int num_merges() const;
  const std::string& origin() const;                  // file name or "<trained>"

  // Steps 2-3 of the pipeline without added-token matching: the pre-tokens of `text` as BPE
  // sees them (byte-level characters, or "▁" for spaces; what the trainer counts). The text
  // counts as the start of the input (Metaspace's prepend_scheme "first" applies).
  std::vector<std::string> pre_tokenize(const std::string& text) const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// `train tokenize --tokenizer tokenizer.json [--decode] [--skip-special]`: reads all of
// stdin; prints the ids as a JSON array (encode) or the text (--decode, JSON array in).
// argv holds the options (a leading "tokenize" is skipped, so both main's argv + 2 and
// argv + 1 work). Returns the process exit code (0 ok, 1 error, 2 usage); errors go to stderr.
int tokenize_command(int argc, char** argv);

}  // namespace loom
