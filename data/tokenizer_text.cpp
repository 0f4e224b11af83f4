// tokenizer_text.cpp: UTF-8, the byte-level map, PCRE2 regexes and normalizers for the
// tokenizer (see tokenizer_text.h).
#include "data/tokenizer_text.h"

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#ifdef LOOM_HAVE_UTF8PROC
#include <utf8proc.h>
#endif

namespace loom::text {

// ------------------------------------------------------------------ UTF-8
int utf8_seq(const unsigned char* p, size_t n, uint32_t* cp) {
  const unsigned char b = p[0];
  if (b < 0x80) {
    *cp = b;
    return 1;
  }
  // The first byte fixes the length and the allowed range of the second byte, which rules
  // out overlong forms (E0 80..9F, F0 80..8F), surrogates (ED A0..BF) and > U+10FFFF (F4 90..).
  int len;
  uint32_t c;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    len = 2, c = b & 0x1F;
  } else if (b >= 0xE0 && b <= 0xEF) {
    len = 3, c = b & 0x0F;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    len = 4, c = b & 0x07;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return -1;  // a stray continuation byte, C0/C1 or F5..FF
  }
  for (int k = 1; k < len; k++) {
    if (size_t(k) >= n || p[k] < lo || p[k] > hi) return -k;
    c = (c << 6) | (p[k] & 0x3F);
    lo = 0x80, hi = 0xBF;
  }
  *cp = c;
  return len;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

size_t find_invalid_utf8(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    int k = utf8_seq(p + i, s.size() - i, &cp);
    if (k < 0) return i;
    i += size_t(k);
  }
  return std::string::npos;
}

std::string utf8_lossy(const std::string& bytes) {
  std::string out;
  out.reserve(bytes.size());
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  for (size_t i = 0; i < bytes.size();) {
    uint32_t cp;
    int k = utf8_seq(p + i, bytes.size() - i, &cp);
    if (k > 0) {
      out.append(bytes, i, size_t(k));
      i += size_t(k);
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD for the maximal ill-formed subpart
      i += size_t(-k);
    }
  }
  return out;
}

bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

bool is_word_char(uint32_t cp) {
  static const Regex word("\\w");
  std::string s;
  append_utf8(s, cp);
  std::vector<std::pair<size_t, size_t>> m;
  word.find_all(s, m);
  return !m.empty();
}

// ------------------------------------------------------------------ byte level
namespace {
struct ByteMap {
  std::string to_char[256];
  int16_t to_byte[324];  // every mapped code point is < 256 + 68
  ByteMap() {
    for (auto& b : to_byte) b = -1;
    int extra = 0;
    for (int b = 0; b < 256; b++) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      uint32_t cp = printable ? uint32_t(b) : uint32_t(256 + extra++);
      append_utf8(to_char[b], cp);
      to_byte[cp] = int16_t(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}
}  // namespace

const std::string& byte_to_char(uint8_t b) { return byte_map().to_char[b]; }

int char_to_byte(uint32_t cp) { return cp < 324 ? byte_map().to_byte[cp] : -1; }

std::string bytes_to_chars(const std::string& s) {
  const ByteMap& m = byte_map();
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char c : s) out += m.to_char[c];
  return out;
}

// ------------------------------------------------------------------ regex
namespace {
// Oniguruma's \s (HF's regex engine) is exactly Unicode White_Space. PCRE2's \s (with UCP)
// also matches U+180E MONGOLIAN VOWEL SEPARATOR, which left White_Space in Unicode 6.3; so
// \s and \S are spelled out as the White_Space list. Escapes and character classes are
// tracked so that "\\s" (a backslash, then 's') stays as it is.
const char* kWhiteSpace =
    "\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"
    "\\x{3000}";

std::string spell_out_spaces(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); i++) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char d = p[i + 1];
      i++;
      if (d == 's') {
        out += in_class ? kWhiteSpace : std::string("[") + kWhiteSpace + "]";
      } else if (d == 'S' && !in_class) {
        out += std::string("[^") + kWhiteSpace + "]";
      } else {
        out += c;
        out += d;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // a ']' right after '[' or '[^' is a literal member, not the end of the class
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

struct MatchScratch {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* ctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchScratch() {
    md = pcre2_match_data_create(1, nullptr);  // only the whole match is read
    ctx = pcre2_match_context_create(nullptr);
    // JIT's default 32 KiB stack can run out on 10^4-character whitespace runs.
    stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (stack) pcre2_jit_stack_assign(ctx, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(ctx);
    if (stack) pcre2_jit_stack_free(stack);
  }
};
}  // namespace

Regex::Regex(const std::string& pattern, bool literal) : pattern_(pattern) {
  std::string p = literal ? pattern : spell_out_spaces(pattern);
  uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), opts, &err,
                                   &off, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw std::runtime_error("regex \"" + pattern + "\": " + reinterpret_cast<char*>(msg) +
                             " at offset " + std::to_string(off));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // failure leaves the interpreter, still correct
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Regex::find_all(const std::string& s, std::vector<std::pair<size_t, size_t>>& out) const {
  thread_local MatchScratch scratch;
  auto* code = static_cast<pcre2_code*>(code_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  out.clear();
  size_t start = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (start <= s.size()) {
    // callers hand in valid UTF-8 only (encode checks its input once)
    int rc = pcre2_match(code, subject, s.size(), start, PCRE2_NO_UTF_CHECK, scratch.md, scratch.ctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw std::runtime_error("regex \"" + pattern_ + "\": match failed: " +
                               reinterpret_cast<char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(scratch.md);
    size_t b = ov[0], e = ov[1];
    if (b == e && have_last && last_end == e) {
      // Oniguruma's find_iter: no empty match right after the previous one; step one char
      if (start >= s.size()) break;
      uint32_t cp;
      int k = utf8_seq(reinterpret_cast<const unsigned char*>(s.data()) + start, s.size() - start, &cp);
      start += size_t(k > 0 ? k : 1);
      continue;
    }
    out.emplace_back(b, e);
    have_last = true;
    last_end = e;
    start = e;
  }
}

// ------------------------------------------------------------------ normalizers
bool have_unicode_normalization() {
#ifdef LOOM_HAVE_UTF8PROC
  return true;
#else
  return false;
#endif
}

std::string normalize(const std::string& s, NormForm f) {
#ifdef LOOM_HAVE_UTF8PROC
  if (f == NormForm::Lowercase) {
    std::string out;
    const auto* p = reinterpret_cast<const unsigned char*>(s.data());
    for (size_t i = 0; i < s.size();) {
      uint32_t cp;
      int k = utf8_seq(p + i, s.size() - i, &cp);
      if (k <= 0) throw std::invalid_argument("normalize: invalid UTF-8");
      // HF lowers char by char with Rust's to_lowercase, whose one multi-character mapping
      // (SpecialCasing, unconditional) is U+0130 -> "i" U+0307; utf8proc gives plain "i"
      if (cp == 0x130) out += "i\xCC\x87";
      else append_utf8(out, uint32_t(utf8proc_tolower(utf8proc_int32_t(cp))));
      i += size_t(k);
    }
    return out;
  }
  int opts = UTF8PROC_STABLE;
  if (f == NormForm::NFC || f == NormForm::NFKC) opts |= UTF8PROC_COMPOSE;
  if (f == NormForm::NFD || f == NormForm::NFKD) opts |= UTF8PROC_DECOMPOSE;
  if (f == NormForm::NFKC || f == NormForm::NFKD) opts |= UTF8PROC_COMPAT;
  utf8proc_uint8_t* dst = nullptr;
  // explicit length (no NULLTERM): text may hold U+0000
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                    utf8proc_ssize_t(s.size()), &dst, utf8proc_option_t(opts));
  if (n < 0) throw std::invalid_argument(std::string("normalize: ") + utf8proc_errmsg(n));
  std::string out(reinterpret_cast<char*>(dst), size_t(n));
  free(dst);
  return out;
#else
  if (f == NormForm::Lowercase) {
    std::string out = s;
    for (char& c : out)
      if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
    return out;
  }
  static std::once_flag once;
  std::call_once(once, [] {
    std::fprintf(stderr,
                 "tokenizer: built without utf8proc, Unicode normalization (NFC/NFD/NFKC/NFKD) "
                 "skipped; encodings of non-normalized text may differ from HF\n");
  });
  return s;
#endif
}

}  // namespace loom::text
