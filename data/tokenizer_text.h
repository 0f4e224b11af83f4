// tokenizer_text.h: the text machinery under the tokenizer: strict UTF-8, GPT-2's byte <->
// character map, a PCRE2 regex that splits like HF's (Oniguruma) find_iter, and the Unicode
// normalizers. Internal to data/tokenizer*.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace loom::text {

// ------------------------------------------------------------------ UTF-8
// Length (1..4) of the well-formed UTF-8 sequence at p (n bytes available) and its code point
// in *cp; when ill-formed, minus the length of its maximal subpart (Unicode 3.9: the bytes
// that one U+FFFD replaces, as Rust's from_utf8_lossy does).
int utf8_seq(const unsigned char* p, size_t n, uint32_t* cp);
void append_utf8(std::string& out, uint32_t cp);
// Offset of the first ill-formed byte, or npos when s is valid UTF-8.
size_t find_invalid_utf8(const std::string& s);
// Bytes -> string with every ill-formed subpart replaced by U+FFFD.
std::string utf8_lossy(const std::string& bytes);
// Unicode White_Space (what Rust's char::is_whitespace and Oniguruma's \s accept).
bool is_white_space(uint32_t cp);
// Unicode \w (letters, marks, digits, connector punctuation), for added tokens' single_word.
bool is_word_char(uint32_t cp);

// ------------------------------------------------------------------ byte level
// GPT-2's bytes_to_unicode: the printable bytes '!'..'~', 0xA1..0xAC, 0xAE..0xFF map to the
// same code point, the other 68 bytes to U+0100.. in byte order, so that every byte is one
// visible character and a vocabulary never holds spaces or control bytes.
const std::string& byte_to_char(uint8_t b);       // the UTF-8 of the character for byte b
int char_to_byte(uint32_t cp);                     // the byte, or -1 when cp is not one
std::string bytes_to_chars(const std::string& s);  // map every byte of s

// ------------------------------------------------------------------ regex
// A compiled PCRE2 pattern (UTF, Unicode properties). HF compiles its patterns with
// Oniguruma, whose \s is exactly White_Space; PCRE2's also takes U+180E, so \s and \S are
// rewritten as the White_Space list.
class Regex {
 public:
  // literal: match the pattern text as a plain string (HF's Split "String" pattern).
  explicit Regex(const std::string& pattern, bool literal = false);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Every match in s, left to right, as [begin, end) byte offsets. Like Oniguruma's
  // find_iter, an empty match right where the previous match ended is skipped.
  void find_all(const std::string& s, std::vector<std::pair<size_t, size_t>>& out) const;
  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8
};

// ------------------------------------------------------------------ normalizers
enum class NormForm { NFC, NFD, NFKC, NFKD, Lowercase };
// Apply one normalizer. Without utf8proc the Unicode forms are skipped (said once on stderr)
// and Lowercase only lowers ASCII.
std::string normalize(const std::string& s, NormForm f);
bool have_unicode_normalization();

}  // namespace loom::text
