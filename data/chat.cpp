// chat.cpp: ChatML turns -> ids and labels (see chat.h).
#include "data/chat.h"

#include <algorithm>
#include <stdexcept>

namespace loom {

namespace {
void append(std::vector<int32_t>& ids, std::vector<int32_t>& labels,
            const std::vector<int32_t>& piece, bool trained) {
  ids.insert(ids.end(), piece.begin(), piece.end());
  if (trained) labels.insert(labels.end(), piece.begin(), piece.end());
  else labels.insert(labels.end(), piece.size(), kIgnoreLabel);
}

void check_role(const std::string& role, size_t i) {
  if (role != "system" && role != "user" && role != "assistant")
    throw std::invalid_argument("chat turn " + std::to_string(i) + ": unknown role \"" + role +
                                "\" (expected system, user or assistant)");
}
}  // namespace

namespace {
// ids of `text` encoded as it is in a templated string: right after the special token
// `after` (whose own id, first in the encoding, is dropped)
std::vector<int32_t> encode_after(const Tokenizer& tok, const std::string& after, int32_t after_id,
                                  const std::string& text) {
  std::vector<int32_t> ids = tok.encode(after + text);
  if (ids.empty() || ids[0] != after_id)
    throw std::logic_error("chat: " + after + " is not cut out of the text as one token by " + tok.origin());
  ids.erase(ids.begin());
  return ids;
}
}  // namespace

ChatEncoding apply_chat_template(const Tokenizer& tok, const std::vector<ChatTurn>& turns) {
  const int32_t im_start = tok.token_id("<|im_start|>");
  const int32_t im_end = tok.token_id("<|im_end|>");
  const std::vector<int32_t> newline = encode_after(tok, "<|im_end|>", im_end, "\n");
  ChatEncoding enc;
  for (size_t i = 0; i < turns.size(); i++) {
    const ChatTurn& t = turns[i];
    check_role(t.role, i);
    const bool trained = t.role == "assistant";
    std::vector<int32_t> header = encode_after(tok, "<|im_start|>", im_start, t.role + "\n");
    std::vector<int32_t> turn = encode_after(tok, "<|im_start|>", im_start, t.role + "\n" + t.content), content;
    if (turn.size() >= header.size() && std::equal(header.begin(), header.end(), turn.begin()))
      content.assign(turn.begin() + long(header.size()), turn.end());
    else  // a token straddles header and content: each on its own
      content = encode_after(tok, "<|im_start|>", im_start, t.content);
    append(enc.ids, enc.labels, {im_start}, false);
    append(enc.ids, enc.labels, header, false);
    append(enc.ids, enc.labels, content, trained);
    append(enc.ids, enc.labels, {im_end}, trained);  // the model learns to stop
    append(enc.ids, enc.labels, newline, false);
  }
  return enc;
}

std::vector<int32_t> chat_prompt(const Tokenizer& tok, const std::vector<ChatTurn>& turns) {
  std::vector<int32_t> ids = apply_chat_template(tok, turns).ids;
  const int32_t im_start = tok.token_id("<|im_start|>");
  ids.push_back(im_start);
  std::vector<int32_t> header = encode_after(tok, "<|im_start|>", im_start, "assistant\n");
  ids.insert(ids.end(), header.begin(), header.end());
  return ids;
}

}  // namespace loom
