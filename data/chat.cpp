// chat.cpp: ChatML turns -> ids and labels (see chat.h).
#include "data/chat.h"

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

ChatEncoding apply_chat_template(const Tokenizer& tok, const std::vector<ChatTurn>& turns) {
  const int32_t im_start = tok.token_id("<|im_start|>");
  const int32_t im_end = tok.token_id("<|im_end|>");
  const std::vector<int32_t> newline = tok.encode("\n");
  ChatEncoding enc;
  for (size_t i = 0; i < turns.size(); i++) {
    const ChatTurn& t = turns[i];
    check_role(t.role, i);
    const bool trained = t.role == "assistant";
    append(enc.ids, enc.labels, {im_start}, false);
    append(enc.ids, enc.labels, tok.encode(t.role + "\n"), false);
    append(enc.ids, enc.labels, tok.encode(t.content), trained);
    append(enc.ids, enc.labels, {im_end}, trained);  // the model learns to stop
    append(enc.ids, enc.labels, newline, false);
  }
  return enc;
}

std::vector<int32_t> chat_prompt(const Tokenizer& tok, const std::vector<ChatTurn>& turns) {
  std::vector<int32_t> ids = apply_chat_template(tok, turns).ids;
  ids.push_back(tok.token_id("<|im_start|>"));
  std::vector<int32_t> header = tok.encode("assistant\n");
  ids.insert(ids.end(), header.begin(), header.end());
  return ids;
}

}  // namespace loom
