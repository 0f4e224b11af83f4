// tokenizer_spm.cpp: the pipeline steps that SentencePiece-kind tokenizer.json files use
// (Llama 2, Gemma, Mistral: BPE converted from SentencePiece, spaces written as U+2581 "▁",
// unknown characters as <0xXX> byte tokens), and the decoders of both kinds:
//   normalizers   Prepend, Replace (and the Unicode forms, Lowercase)
//   pre-tokenizer Metaspace's rewrite of each piece (its split is tokenizer.cpp's split_by)
//   decoders      ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, run as a chain
// Each follows HF tokenizers' implementation of the same name; "HF:" marks the details that
// decide whether the output matches.
#include <cstdio>

#include "data/tokenizer_impl.h"
#include "data/tokenizer_text.h"

namespace loom {

namespace tokenizer_detail {

// HF's NormalizedString::replace with a pattern: every match (an empty one too, which
// inserts `content`) is replaced; Oniguruma's find_iter order, as Regex::find_all gives.
std::string replace_all(const std::string& s, const text::Regex& re, const std::string& content) {
  std::vector<std::pair<size_t, size_t>> m;
  re.find_all(s, m);
  if (m.empty()) return s;
  std::string out;
  size_t prev = 0;
  for (auto [b, e] : m) {
    out.append(s, prev, b - prev);
    out += content;
    prev = e;
  }
  out.append(s, prev, std::string::npos);
  return out;
}

std::string metaspace_rewrite(const PreStep& st, const std::string& piece, bool first) {
  // HF: only the ASCII space is replaced (not tabs or newlines)
  std::string s;
  s.reserve(piece.size() + 3);
  for (char c : piece) {
    if (c == ' ') s += st.replacement;
    else s += c;
  }
  // HF: "first" means the piece begins at offset 0 of the original text, so a piece after
  // a special token gets no prefix; an empty piece never gets one (prepend is a no-op on it)
  bool starts = s.compare(0, st.replacement.size(), st.replacement) == 0;
  bool want = st.prepend == Prepend::Always || (st.prepend == Prepend::First && first);
  if (want && !starts && !s.empty()) s.insert(0, st.replacement);
  return s;
}

}  // namespace tokenizer_detail

std::string Tokenizer::Impl::normalize(std::string s) const {
  for (const NormStep& n : normalizers) {
    switch (n.kind) {
      case NormStep::Form:
        s = text::normalize(s, n.form);
        break;
      case NormStep::PrependText:  // HF: only non-empty text gets the prefix
        if (!s.empty()) s.insert(0, n.content);
        break;
      case NormStep::Replace:
        s = replace_all(s, *n.re, n.content);
        break;
    }
  }
  return s;
}

// ------------------------------------------------------------------ decoders
namespace {

std::vector<uint32_t> code_points(const std::string& s) {
  std::vector<uint32_t> cps;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0xFFFD;
    int k = text::utf8_seq(p + i, s.size() - i, &cp);
    if (k <= 0) cp = 0xFFFD;  // vocabulary strings come from JSON: always valid
    cps.push_back(cp);
    i += size_t(k > 0 ? k : -k);
  }
  return cps;
}

// HF's ByteFallback: a 6-byte token "<0x" h h ">" whose two characters parse as a byte with
// Rust's u8::from_str_radix(_, 16), which takes either case and also a leading '+'.
int byte_token(const std::string& t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  int hi = hex(t[3]), lo = hex(t[4]);
  if (t[3] == '+' && lo >= 0) return lo;
  return hi >= 0 && lo >= 0 ? hi * 16 + lo : -1;
}

void bytes_from_tokens(std::vector<std::string>& toks) {
  std::vector<std::string> out;
  std::string run;  // the bytes of consecutive byte tokens
  size_t run_len = 0;
  auto flush = [&] {
    if (run_len == 0) return;
    // HF: a run that is valid UTF-8 becomes its text; otherwise every byte of the run
    // becomes one U+FFFD (not one per ill-formed subpart, as a lossy decode would)
    if (text::find_invalid_utf8(run) == std::string::npos) out.push_back(run);
    else out.insert(out.end(), run_len, "\xEF\xBF\xBD");
    run.clear();
    run_len = 0;
  };
  for (std::string& t : toks) {
    int b = byte_token(t);
    if (b >= 0) {
      run += char(b);
      run_len++;
    } else {
      flush();
      out.push_back(std::move(t));
    }
  }
  flush();
  toks.swap(out);
}

}  // namespace

std::string Tokenizer::Impl::run_decoders(std::vector<std::string> toks) const {
  for (const DecodeStep& d : decoders) {
    switch (d.kind) {
      case DecodeStep::ByteLevel: {
        // HF: a token whose characters all come from the byte map becomes those bytes, any
        // other token (e.g. an added "<|im_start|>") its own text; then one lossy string
        std::string bytes;
        for (const std::string& t : toks) {
          std::string tb;
          bool all = true;
          for (uint32_t cp : code_points(t)) {
            int b = text::char_to_byte(cp);
            if (b < 0) {
              all = false;
              break;
            }
            tb += char(b);
          }
          bytes += all ? tb : t;
        }
        toks.assign(1, text::utf8_lossy(bytes));
        break;
      }
      case DecodeStep::Replace:
        for (std::string& t : toks) t = replace_all(t, *d.re, d.content);
        break;
      case DecodeStep::ByteFallback:
        bytes_from_tokens(toks);
        break;
      case DecodeStep::Fuse: {
        std::string all;
        for (const std::string& t : toks) all += t;
        toks.assign(1, std::move(all));
        break;
      }
      case DecodeStep::Strip:
        for (std::string& t : toks) {
          std::vector<uint32_t> cps = code_points(t);
          size_t b = 0, e = cps.size();
          while (b < d.start && b < e && cps[b] == d.ch) b++;
          while (cps.size() - e < d.stop && e > b && cps[e - 1] == d.ch) e--;
          std::string s;
          for (size_t k = b; k < e; k++) text::append_utf8(s, cps[k]);
          t = std::move(s);
        }
        break;
      case DecodeStep::Metaspace:
        // HF: the replacement becomes ' ', except in the first token, where it is dropped
        // (every occurrence, not only a leading one) unless prepend_scheme is "never"
        for (size_t i = 0; i < toks.size(); i++) {
          std::string s;
          for (uint32_t cp : code_points(toks[i])) {
            if (cp != d.ch) text::append_utf8(s, cp);
            else if (i > 0 || d.prepend == Prepend::Never) s += ' ';
          }
          toks[i] = std::move(s);
        }
        break;
    }
  }
  std::string out;
  for (const std::string& t : toks) out += t;
  return out;
}

}  // namespace loom
