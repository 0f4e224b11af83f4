// chat.h: the ChatML template as SmolLM2 uses it, turned into ids and training labels.
//
//   <|im_start|>{role}\n{content}<|im_end|>\n      per turn
//
// Each piece (header "<|im_start|>{role}\n", content, "<|im_end|>", "\n") is encoded on its
// own and the ids concatenated, so every token belongs to exactly one piece and the labels
// line up with the tokens. For ordinary content this equals encoding the whole templated
// string (special tokens cut the text anyway); content that starts with whitespace is where
// the two can differ: a whole-string encoding may glue the header's "\n" to it.
// With a SentencePiece-kind tokenizer whose normalizer prepends "▁" to every piece of text
// (Llama 2's Prepend), each piece here gets its own "▁", where a whole-string encoding has
// one per stretch of text between special tokens.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace loom {

struct ChatTurn {
  std::string role;  // "system" | "user" | "assistant"
  std::string content;
};

struct ChatEncoding {
  std::vector<int32_t> ids;
  // -100 everywhere except the assistant turns' content tokens and their <|im_end|>, which
  // carry their own id (the shift to next-token targets happens later, in packing).
  std::vector<int32_t> labels;
};

inline constexpr int32_t kIgnoreLabel = -100;

// Throws std::invalid_argument for a role other than the three above, and (from the
// tokenizer) std::out_of_range when <|im_start|> or <|im_end|> is not in the vocabulary.
// "<image>" inside content stays one id (the data layer expands it).
ChatEncoding apply_chat_template(const Tokenizer& tok, const std::vector<ChatTurn>& turns);

// The generation prompt: all turns, then "<|im_start|>assistant\n".
std::vector<int32_t> chat_prompt(const Tokenizer& tok, const std::vector<ChatTurn>& turns);

}  // namespace loom
