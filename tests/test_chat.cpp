// test_chat.cpp: data/chat.{h,cpp} (ChatML ids and labels) on the HF fixture tokenizer.
#include <catch2/catch.hpp>

#include <random>

#include "data/chat.h"

using namespace loom;

namespace {
Tokenizer fixture() { return Tokenizer::from_file("tests/fixtures/tokenizer_bpe1000_s0/tokenizer.json"); }

std::string templated(const std::vector<ChatTurn>& turns) {
  std::string s;
  for (const auto& t : turns) s += "<|im_start|>" + t.role + "\n" + t.content + "<|im_end|>\n";
  return s;
}

// The labelled positions must be exactly the assistant contents and their <|im_end|>.
void check_labels(const Tokenizer& tok, const std::vector<ChatTurn>& turns, const ChatEncoding& enc) {
  REQUIRE(enc.ids.size() == enc.labels.size());
  std::vector<int32_t> expect_trained;
  for (const auto& t : turns)
    if (t.role == "assistant") {
      auto c = tok.encode(t.content);
      expect_trained.insert(expect_trained.end(), c.begin(), c.end());
      expect_trained.push_back(tok.token_id("<|im_end|>"));
    }
  std::vector<int32_t> trained;
  for (size_t i = 0; i < enc.ids.size(); i++) {
    if (enc.labels[i] == kIgnoreLabel) continue;
    REQUIRE(enc.labels[i] == enc.ids[i]);  // labelled with its own id, unshifted
    trained.push_back(enc.ids[i]);
  }
  CHECK(trained == expect_trained);
}
}  // namespace

TEST_CASE("chat: ChatML ids equal the whole templated string; labels on assistant turns", "[chat]") {
  Tokenizer tok = fixture();
  std::vector<ChatTurn> turns = {{"system", "You are a helpful assistant."},
                                 {"user", "<image>\nWhat colour is the square?"},
                                 {"assistant", "Red."},
                                 {"user", "And how many shapes are there? Count 1, 2, 3."},
                                 {"assistant", "There are 3 shapes."}};
  ChatEncoding enc = apply_chat_template(tok, turns);
  CHECK(enc.ids == tok.encode(templated(turns)));
  check_labels(tok, turns, enc);
  CHECK(std::count(enc.ids.begin(), enc.ids.end(), tok.token_id("<image>")) == 1);
  CHECK(std::count(enc.ids.begin(), enc.ids.end(), tok.token_id("<|im_start|>")) == 5);
  // the first tokens are the system header, untrained
  CHECK(enc.ids[0] == tok.token_id("<|im_start|>"));
  CHECK(enc.labels[0] == kIgnoreLabel);
  CHECK(tok.decode(enc.ids) == templated(turns));

  std::vector<int32_t> prompt = chat_prompt(tok, {turns[0], turns[1]});
  CHECK(prompt == tok.encode(templated({turns[0], turns[1]}) + "<|im_start|>assistant\n"));
}

TEST_CASE("chat: labels stay aligned for awkward contents", "[chat]") {
  Tokenizer tok = fixture();
  std::mt19937 rng(5);
  static const char* bits[] = {" ", "\n", "  lead", "trail  ", "<image>", "42", "\xF0\x9F\x98\x80", "ok", "\t"};
  for (int trial = 0; trial < 50; trial++) {
    std::vector<ChatTurn> turns;
    int n = 1 + int(rng() % 5);
    for (int i = 0; i < n; i++) {
      std::string c;
      for (int k = int(rng() % 6); k > 0; k--) c += bits[rng() % 9];
      turns.push_back({i % 2 ? "assistant" : "user", c});
    }
    ChatEncoding enc = apply_chat_template(tok, turns);
    check_labels(tok, turns, enc);
    CHECK(tok.decode(enc.ids) == templated(turns));  // nothing lost at the piece boundaries
  }
  // an empty conversation is empty; an assistant-only turn with empty content trains <|im_end|>
  CHECK(apply_chat_template(tok, {}).ids.empty());
  ChatEncoding e = apply_chat_template(tok, {{"assistant", ""}});
  CHECK(std::count_if(e.labels.begin(), e.labels.end(), [](int32_t l) { return l != kIgnoreLabel; }) == 1);
}

TEST_CASE("chat: bad role and a tokenizer without ChatML tokens are errors", "[chat]") {
  Tokenizer tok = fixture();
  CHECK_THROWS_WITH(apply_chat_template(tok, {{"asistant", "x"}}), Catch::Contains("asistant"));
  Tokenizer plain = Tokenizer::train({"hello world"}, 300, {"<|endoftext|>"});
  CHECK_THROWS_WITH(apply_chat_template(plain, {{"user", "hi"}}), Catch::Contains("<|im_start|>"));
}

TEST_CASE("chat: SentencePiece-kind tokenizers with the ChatML tokens added equal the whole string", "[chat]") {
  // Llama 2's normalizer prepends "▁" to each stretch of text between special tokens and
  // Mistral's Metaspace("first") only to the text's start: a turn encoded in pieces would get
  // extra "▁" tokens, so the turn is encoded as it stands in the templated string
  for (const char* kind : {"llama2", "gemma", "mistral"}) {
    INFO(kind);
    Tokenizer tok = Tokenizer::from_file(std::string("tests/fixtures/tokenizer_spm_") + kind + "/tokenizer.json")
                        .with_special_tokens({"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"});
    std::vector<ChatTurn> turns = {{"system", "Be brief."},
                                   {"user", "<image>\nWhat colour is the square?"},
                                   {"assistant", "Red."},
                                   {"user", "And now?"},
                                   {"assistant", "Blue, I think."}};
    ChatEncoding enc = apply_chat_template(tok, turns);
    CHECK(enc.ids == tok.encode(templated(turns)));
    REQUIRE(enc.labels.size() == enc.ids.size());
    std::vector<int32_t> trained;
    for (size_t i = 0; i < enc.ids.size(); i++)
      if (enc.labels[i] != kIgnoreLabel) trained.push_back(enc.ids[i]);
    CHECK(tok.decode(trained) == "Red.<|im_end|>Blue, I think.<|im_end|>");
    CHECK(std::count(enc.ids.begin(), enc.ids.end(), tok.token_id("<image>")) == 1);
    std::vector<int32_t> prompt = chat_prompt(tok, {turns[0], turns[1]});
    CHECK(prompt == tok.encode(templated({turns[0], turns[1]}) + "<|im_start|>assistant\n"));
  }
}
