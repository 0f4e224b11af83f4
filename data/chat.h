// chat.h: the ChatML template as SmolLM2 uses it, turned into ids and training labels.
//
//   <|im_start|>{role}\n{content}<|im_end|>\n      per turn
//
// A turn is encoded as the text after a special token, the way a whole templated string is:
// "<|im_start|>{role}\n{content}" and "<|im_end|>\n" are each encoded and their ids
// concatenated (the special tokens cut the text anyway). So a tokenizer whose front end
// depends on where a stretch of text starts sees each stretch as it would in the whole
// string: Llama 2's normalizer puts one "▁" before "{role}\n{content}", not one before the
// role and another before the content; Mistral's Metaspace(prepend_scheme "first") puts none.
// The labels need the content's tokens apart from the header's: when the header's ids are a
// prefix of the turn's, the rest is the content. When a token straddles the two (byte-level
// content that starts with whitespace: the pre-tokenizer may glue the header's "\n" to it),
// the header and the content are encoded on their own instead; there, and only there, the ids
// differ from a whole-string encoding.
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

// Throws std::invalid_argument for a role other than the three above, (from the tokenizer)
// std::out_of_range when <|im_start|> or <|im_end|> is not in the vocabulary, and
// std::logic_error when one is only a model-vocabulary piece, not cut out of text as a token.
// "<image>" inside content stays one id (the data layer expands it).
ChatEncoding apply_chat_template(const Tokenizer& tok, const std::vector<ChatTurn>& turns);

// The generation prompt: all turns, then "<|im_start|>assistant\n".
std::vector<int32_t> chat_prompt(const Tokenizer& tok, const std::vector<ChatTurn>& turns);

// The same template as a Jinja chat_template for HF's tokenizer_config.json (./train export):
// every turn "<|im_start|>{role}\n{content}<|im_end|>\n", no default system turn, and with
// add_generation_prompt the header "<|im_start|>assistant\n" that chat_prompt appends. HF
// encodes the rendered string as a whole; for content that does not start with whitespace
// that gives the ids apply_chat_template gives (see the top of this file).
inline constexpr const char* kChatTemplateJinja =
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

}  // namespace loom
