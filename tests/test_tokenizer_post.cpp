// test_tokenizer_post.cpp: what runs after the BPE model in encode_full (data/tokenizer_post.cpp):
// pairs through each post-processor with their type ids, truncation of one sequence and of
// pairs with the overflowing windows, padding of one encoding and of a batch, and the JSON of
// all three.
//
// The tokenizer is the byte-level fixture (tests/fixtures/tokenizer_bpe1000_s0), whose
// pre-tokenizer puts every digit in a pre-token of its own: a string of n digits is n ids, so
// the lengths below are exact. The expected ids are spelled out from the definitions in HF
// tokenizers' source (processors/*.rs, utils/truncation.rs, utils/padding.rs,
// tokenizer/encoding.rs).
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <functional>

#include "data/tokenizer.h"
#include "tests/source_text.h"

using loom::Tokenizer;
using json = nlohmann::json;
using Ids = std::vector<int32_t>;
using Enc = Tokenizer::Encoding;
using Strategy = Tokenizer::Truncation::Strategy;

namespace {

using loom::test::read_all;

json fixture() {
  const std::string text = read_all("tests/fixtures/tokenizer_bpe1000_s0/tokenizer.json");
  REQUIRE(!text.empty());
  return json::parse(text);
}

// The fixture with these sections replaced (JSON text; "" leaves one as it is).
Tokenizer with(const std::string& post, const std::string& truncation = "", const std::string& padding = "") {
  json d = fixture();
  if (!post.empty()) d["post_processor"] = json::parse(post);
  if (!truncation.empty()) d["truncation"] = json::parse(truncation);
  if (!padding.empty()) d["padding"] = json::parse(padding);
  return Tokenizer::from_json(d.dump(), "post.json");
}

// n digits, starting at `from` and counting on modulo 10: n ids
std::string digits(int n, int from = 0) {
  std::string s;
  for (int i = 0; i < n; i++) s += char('0' + (from + i) % 10);
  return s;
}

Ids cat(std::initializer_list<Ids> parts) {
  Ids out;
  for (const Ids& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

Ids fill(size_t n, int32_t v) { return Ids(n, v); }

std::vector<uint8_t> mask(std::initializer_list<std::pair<size_t, uint8_t>> runs) {
  std::vector<uint8_t> m;
  for (auto [n, v] : runs) m.insert(m.end(), n, v);
  return m;
}

Ids head(const Ids& v, size_t n) { return Ids(v.begin(), v.begin() + std::ptrdiff_t(std::min(n, v.size()))); }
Ids tail(const Ids& v, size_t n) { return Ids(v.end() - std::ptrdiff_t(std::min(n, v.size())), v.end()); }

// Specials of the fixture: 0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>, 3 <image>.
const std::string kSpecials =
    R"("special_tokens":{"S":{"id":"S","ids":[1],"tokens":["<|im_start|>"]},)"
    R"("E":{"id":"E","ids":[2],"tokens":["<|im_end|>"]},"EE":{"id":"EE","ids":[2,0],"tokens":["<|im_end|>","<|endoftext|>"]}})";
std::string piece_s(const std::string& id, int type) {
  return R"({"SpecialToken":{"id":")" + id + R"(","type_id":)" + std::to_string(type) + "}}";
}
std::string piece_q(const std::string& id, int type) {
  return R"({"Sequence":{"id":")" + id + R"(","type_id":)" + std::to_string(type) + "}}";
}
// BERT's layout as a template: S A E, and S A E B:1 E:1
const std::string kBertTemplate = R"({"type":"TemplateProcessing","single":[)" + piece_s("S", 0) + "," + piece_q("A", 0) +
                                  "," + piece_s("E", 0) + R"(],"pair":[)" + piece_s("S", 0) + "," + piece_q("A", 0) + "," +
                                  piece_s("E", 0) + "," + piece_q("B", 1) + "," + piece_s("E", 1) + "]," + kSpecials + "}";

}  // namespace

TEST_CASE("tokenizer pairs: each post-processor's ids and type ids", "[tokenizer][post]") {
  const Tokenizer plain = with("null");
  const std::string ta = digits(5), tb = digits(3, 5);
  const Ids a = plain.encode(ta), b = plain.encode(tb);
  REQUIRE(a.size() == 5);
  REQUIRE(b.size() == 3);

  // no post-processor: the sequences one after the other, type 0 then 1; mask all ones
  for (bool special : {false, true}) {
    Enc e = plain.encode_full(ta, &tb, special);
    CHECK(e.ids == cat({a, b}));
    CHECK(e.type_ids == cat({fill(5, 0), fill(3, 1)}));
    CHECK(e.attention_mask == mask({{8, 1}}));
  }
  Enc one = plain.encode_full(ta, nullptr, true);
  CHECK(one.ids == a);
  CHECK(one.type_ids == fill(5, 0));

  // TemplateProcessing: its own pieces and type ids; without special tokens the sequences keep
  // the template's type ids
  Tokenizer tpl = with(kBertTemplate);
  Enc e = tpl.encode_full(ta, &tb, true);
  CHECK(e.ids == cat({{1}, a, {2}, b, {2}}));
  CHECK(e.type_ids == cat({fill(7, 0), fill(4, 1)}));
  e = tpl.encode_full(ta, &tb, false);
  CHECK(e.ids == cat({a, b}));
  CHECK(e.type_ids == cat({fill(5, 0), fill(3, 1)}));
  e = tpl.encode_full(ta, nullptr, true);
  CHECK(e.ids == cat({{1}, a, {2}}));
  CHECK(e.ids == tpl.encode(ta, true));  // the single path agrees with encode()
  // a special token of two ids, a sequence used twice, type ids other than 0 / 1
  Tokenizer odd = with(R"({"type":"TemplateProcessing","single":[)" + piece_q("A", 3) + "," + piece_s("EE", 2) +
                       R"(],"pair":[)" + piece_q("B", 4) + "," + piece_s("EE", 5) + "," + piece_q("A", 6) + "," +
                       piece_q("B", 7) + "]," + kSpecials + "}");
  e = odd.encode_full(ta, &tb, true);
  CHECK(e.ids == cat({b, {2, 0}, a, b}));
  CHECK(e.type_ids == cat({fill(3, 4), fill(2, 5), fill(5, 6), fill(3, 7)}));
  e = odd.encode_full(ta, nullptr, true);
  CHECK(e.ids == cat({a, {2, 0}}));
  CHECK(e.type_ids == cat({fill(5, 3), fill(2, 2)}));

  // BertProcessing: [CLS] A [SEP] type 0, B [SEP] type 1; without its tokens it changes nothing
  Tokenizer bert = with(R"({"type":"BertProcessing","sep":["<|im_end|>",2],"cls":["<|im_start|>",1]})");
  e = bert.encode_full(ta, &tb, true);
  CHECK(e.ids == cat({{1}, a, {2}, b, {2}}));
  CHECK(e.type_ids == cat({fill(7, 0), fill(4, 1)}));
  e = bert.encode_full(ta, &tb, false);
  CHECK(e.type_ids == cat({fill(5, 0), fill(3, 1)}));

  // RobertaProcessing: <s> A </s> </s> B </s>, every type id 0 (also without its tokens)
  Tokenizer roberta = with(R"({"type":"RobertaProcessing","sep":["<|im_end|>",2],"cls":["<|im_start|>",1],)"
                           R"("trim_offsets":true,"add_prefix_space":false})");
  e = roberta.encode_full(ta, &tb, true);
  CHECK(e.ids == cat({{1}, a, {2, 2}, b, {2}}));
  CHECK(e.type_ids == fill(12, 0));
  e = roberta.encode_full(ta, &tb, false);
  CHECK(e.ids == cat({a, b}));
  CHECK(e.type_ids == fill(8, 0));

  // Llama 3's Sequence [ByteLevel, template]: ByteLevel adds nothing
  Tokenizer llama3 = with(R"({"type":"Sequence","processors":[{"type":"ByteLevel","add_prefix_space":true,)"
                          R"("trim_offsets":false,"use_regex":true},)" + kBertTemplate + "]}");
  CHECK(llama3.encode_full(ta, &tb, true).ids == cat({{1}, a, {2}, b, {2}}));

  // Bert then a template: Bert keeps one part per sequence, the template's pair takes them
  Tokenizer chain = with(R"({"type":"Sequence","processors":[{"type":"BertProcessing","sep":["<|im_end|>",2],)"
                         R"("cls":["<|im_start|>",1]},)" + kBertTemplate + "]}");
  e = chain.encode_full(ta, &tb, true);
  CHECK(e.ids == cat({{1, 1}, a, {2, 2}, b, {2, 2}}));
  CHECK(e.type_ids == cat({fill(9, 0), fill(5, 1)}));
}

TEST_CASE("tokenizer pairs: what cannot be applied is refused when asked for, naming the path", "[tokenizer][post]") {
  const std::string ta = digits(4), tb = digits(2);
  auto refuses_pair = [&](const std::string& post, const std::string& key, const std::string& what) {
    Tokenizer t = with(post);
    CHECK(t.encode_full(ta, nullptr, true).ids == t.encode(ta, true));  // one sequence still works
    CHECK_THROWS_WITH(t.encode_full(ta, &tb, true),
                      Catch::Contains("post.json") && Catch::Contains(key) && Catch::Contains(what));
    CHECK_THROWS_WITH(t.encode_full(ta, &tb, false), Catch::Contains(key));
  };
  const std::string single = R"("single":[)" + piece_s("S", 0) + "," + piece_q("A", 0) + "]";
  refuses_pair(R"({"type":"TemplateProcessing",)" + single + "," + kSpecials + "}", "post_processor.pair",
               "expected an array");
  refuses_pair(R"({"type":"TemplateProcessing",)" + single + R"(,"pair":[)" + piece_q("A", 0) + "]," + kSpecials + "}",
               "post_processor.pair", "must use both sequences");
  refuses_pair(R"({"type":"TemplateProcessing",)" + single + R"(,"pair":[)" + piece_q("A", 0) + "," + piece_q("C", 1) +
                   "]," + kSpecials + "}",
               "post_processor.pair[1].Sequence.id", "\"A\" or \"B\", got \"C\"");
  refuses_pair(R"({"type":"TemplateProcessing",)" + single + R"(,"pair":[)" + piece_q("A", 0) + "," + piece_q("B", 1) +
                   "," + piece_s("X", 1) + "]," + kSpecials + "}",
               "post_processor.pair[2].SpecialToken.id", "\"X\" is not in post_processor.special_tokens");
  refuses_pair(R"({"type":"TemplateProcessing",)" + single + R"(,"pair":[)" + piece_q("A", 0) + "," + piece_q("B", 1) +
                   "," + piece_s("Z", 1) + R"(],"special_tokens":{"S":{"id":"S","ids":[1]},"Z":{"id":"Z","ids":[5000]}}})",
               "post_processor.pair", "id 5000 is past the vocabulary");
  // a negative type id is malformed wherever it is
  Tokenizer neg = with(R"({"type":"TemplateProcessing","single":[{"Sequence":{"id":"A","type_id":-1}}],"pair":[]})");
  CHECK_THROWS_WITH(neg.encode(ta, true), Catch::Contains("post_processor.single[0].Sequence.type_id"));
}

TEST_CASE("tokenizer truncation: one sequence, pairs, every strategy and direction", "[tokenizer][post]") {
  const Tokenizer plain = with("null");
  auto trunc = [](size_t max_length, const char* strategy = "LongestFirst", const char* direction = "Right") {
    return R"({"max_length":)" + std::to_string(max_length) + R"(,"strategy":")" + strategy + R"(","direction":")" +
           direction + R"(","stride":0})";
  };
  // one sequence: the first max_length ids, or the last ones from the left
  const std::string t12 = digits(12);
  const Ids a12 = plain.encode(t12);
  CHECK(with("null", trunc(5)).encode_full(t12, nullptr, false).ids == head(a12, 5));
  CHECK(with("null", trunc(5, "LongestFirst", "Left")).encode_full(t12, nullptr, false).ids == tail(a12, 5));
  CHECK(with("null", trunc(20)).encode_full(t12, nullptr, false).ids == a12);  // short enough: unchanged
  CHECK(with("null", trunc(0)).encode_full(t12, nullptr, false).ids.empty());
  // encode() never truncates
  CHECK(with("null", trunc(5)).encode(t12) == a12);
  // with special tokens, max_length counts the ones the post-processor adds (2 single, 3 pair)
  Tokenizer bert5 = with(kBertTemplate, trunc(5));
  CHECK(bert5.encode_full(t12, nullptr, true).ids == cat({{1}, head(a12, 3), {2}}));
  CHECK(bert5.encode_full(t12, nullptr, false).ids == head(a12, 5));
  Tokenizer bert2 = with(kBertTemplate, trunc(2));
  CHECK(bert2.encode_full(t12, nullptr, true).ids == Ids{1, 2});  // nothing left of the text
  CHECK_THROWS_WITH(bert2.encode_full(t12, &t12, true),
                    Catch::Contains("truncation.max_length 2") && Catch::Contains("3 ids") && Catch::Contains("a pair"));

  // pairs, LongestFirst: (lengths a, b, max_length) -> (kept a, kept b)
  struct Case {
    int na, nb;
    size_t max_length;
    size_t ka, kb;
  };
  for (Case c : {Case{3, 20, 10, 3, 7},    // only the longer one is cut
                 Case{20, 3, 10, 7, 3},    // the same with the longer first
                 Case{6, 20, 10, 5, 5},    // both cut: halves
                 Case{7, 20, 11, 5, 6},    // the odd id to the longer (the second)
                 Case{20, 7, 11, 6, 5},    // ... or the first, when it is the longer
                 Case{9, 9, 11, 5, 6},     // equal: the odd id to the second
                 Case{4, 4, 8, 4, 4},      // exactly max_length: unchanged
                 Case{12, 30, 10, 5, 5}}) {  // the shorter one over max_length too
    INFO("pair " << c.na << " + " << c.nb << " to " << c.max_length);
    const std::string sa = digits(c.na), sb = digits(c.nb, 3);
    const Ids ia = plain.encode(sa), ib = plain.encode(sb);
    CHECK(with("null", trunc(c.max_length)).encode_full(sa, &sb, false).ids == cat({head(ia, c.ka), head(ib, c.kb)}));
    CHECK(with("null", trunc(c.max_length, "LongestFirst", "Left")).encode_full(sa, &sb, false).ids ==
          cat({tail(ia, c.ka), tail(ib, c.kb)}));
    // the template's 3 ids come out of max_length first
    Enc e = with(kBertTemplate, trunc(c.max_length + 3)).encode_full(sa, &sb, true);
    CHECK(e.ids == cat({{1}, head(ia, c.ka), {2}, head(ib, c.kb), {2}}));
    CHECK(e.type_ids == cat({fill(c.ka + 2, 0), fill(c.kb + 1, 1)}));
  }
  // max_length 0 empties both
  const std::string s5 = digits(5), s3 = digits(3);
  CHECK(with("null", trunc(0)).encode_full(s5, &s3, false).ids.empty());

  // OnlyFirst / OnlySecond: all the excess from one sequence, or an error naming why
  const Ids i5 = plain.encode(s5), i3 = plain.encode(s3);
  CHECK(with("null", trunc(6, "OnlyFirst")).encode_full(s5, &s3, false).ids == cat({head(i5, 3), i3}));
  CHECK(with("null", trunc(6, "OnlyFirst", "Left")).encode_full(s5, &s3, false).ids == cat({tail(i5, 3), i3}));
  CHECK(with("null", trunc(6, "OnlySecond")).encode_full(s5, &s3, false).ids == cat({i5, head(i3, 1)}));
  CHECK(with("null", trunc(3, "OnlyFirst")).encode_full(s5, nullptr, false).ids == head(i5, 3));
  CHECK_THROWS_WITH(with("null", trunc(3, "OnlySecond")).encode_full(s5, &s3, false),
                    Catch::Contains("OnlySecond") && Catch::Contains("remove 5") && Catch::Contains("which has 3"));
  CHECK_THROWS_WITH(with("null", trunc(3, "OnlySecond")).encode_full(s5, nullptr, false),
                    Catch::Contains("OnlySecond needs a pair"));
  CHECK_THROWS_WITH(with("null", trunc(3, "OnlyFirst")).encode_full(s3, &s5, false), Catch::Contains("which has 3"));
  // short enough: no strategy runs, so OnlySecond without a pair is fine
  CHECK(with("null", trunc(8, "OnlySecond")).encode_full(s5, nullptr, false).ids == i5);
}

TEST_CASE("tokenizer padding: fixed, the batch's longest, multiples, left", "[tokenizer][post]") {
  const Tokenizer plain = with("null");
  const std::string s5 = digits(5), s3 = digits(3), s9 = digits(9);
  const Ids i5 = plain.encode(s5), i3 = plain.encode(s3), i9 = plain.encode(s9);
  auto padding = [](const std::string& strategy, const char* direction = "Right", const std::string& multiple = "null") {
    return R"({"strategy":)" + strategy + R"(,"direction":")" + direction + R"(","pad_to_multiple_of":)" + multiple +
           R"(,"pad_id":3,"pad_type_id":7,"pad_token":"<image>"})";
  };
  Enc e = with("null", "", padding(R"({"Fixed":8})")).encode_full(s5, nullptr, false);
  CHECK(e.ids == cat({i5, fill(3, 3)}));
  CHECK(e.type_ids == cat({fill(5, 0), fill(3, 7)}));
  CHECK(e.attention_mask == mask({{5, 1}, {3, 0}}));
  e = with("null", "", padding(R"({"Fixed":8})", "Left")).encode_full(s5, nullptr, false);
  CHECK(e.ids == cat({fill(3, 3), i5}));
  CHECK(e.attention_mask == mask({{3, 0}, {5, 1}}));
  CHECK(with("null", "", padding(R"({"Fixed":4})")).encode_full(s5, nullptr, false).ids == i5);  // never shortened
  // one sequence, BatchLongest: itself, rounded up to the multiple
  CHECK(with("null", "", padding(R"("BatchLongest")")).encode_full(s5, nullptr, false).ids == i5);
  CHECK(with("null", "", padding(R"("BatchLongest")", "Right", "4")).encode_full(s5, nullptr, false).ids ==
        cat({i5, fill(3, 3)}));
  CHECK(with("null", "", padding(R"({"Fixed":9})", "Right", "4")).encode_full(s5, nullptr, false).ids.size() == 12);

  // a batch: to its longest, after each encoding's own truncation and template
  Tokenizer t = with(kBertTemplate, R"({"max_length":8,"strategy":"LongestFirst","direction":"Right","stride":0})",
                     padding(R"("BatchLongest")"));
  std::vector<std::string> texts = {s5, s3, s9};
  std::vector<Enc> batch = t.encode_batch(texts, nullptr, true);
  REQUIRE(batch.size() == 3);
  CHECK(batch[0].ids == cat({{1}, i5, {2}, fill(1, 3)}));
  CHECK(batch[1].ids == cat({{1}, i3, {2}, fill(3, 3)}));
  CHECK(batch[2].ids == cat({{1}, head(i9, 6), {2}}));
  CHECK(batch[1].attention_mask == mask({{5, 1}, {3, 0}}));
  CHECK(batch[1].type_ids == cat({fill(5, 0), fill(3, 7)}));
  // the special-tokens mask: the template's [CLS] and [SEP] and the padding, not the text
  CHECK(batch[1].special_tokens_mask == mask({{1, 1}, {3, 0}, {4, 1}}));
  CHECK(batch[2].special_tokens_mask == mask({{1, 1}, {6, 0}, {1, 1}}));
  CHECK(t.encode_full(s3, nullptr, false).special_tokens_mask == mask({{3, 0}}));  // no template tokens, no padding
  std::vector<std::string> pairs = {s3, s3, s3};
  batch = t.encode_batch(texts, &pairs, true);
  // max_length 8 less the pair template's 3: 5 ids for the two sequences, halves when both are cut
  CHECK(batch[0].ids == cat({{1}, head(i5, 3), {2}, head(i3, 2), {2}}));  // 5 + 3: 3 and 2
  CHECK(batch[1].ids == cat({{1}, head(i3, 2), {2}, head(i3, 3), {2}}));  // 3 + 3: 2 and 3
  CHECK(batch[2].ids == cat({{1}, head(i9, 3), {2}, head(i3, 2), {2}}));  // 9 + 3: 3 and 2
  for (const Enc& b : batch) CHECK(b.ids.size() == 8);
  std::vector<std::string> two = {s3, s3};
  CHECK_THROWS_WITH(t.encode_batch(texts, &two, true), Catch::Contains("3 texts but 2 pairs"));
  CHECK(t.encode_batch({}, nullptr, true).empty());
}

TEST_CASE("tokenizer truncation and padding: JSON in and out, setters, malformed entries", "[tokenizer][post]") {
  const Tokenizer plain = with("null");
  CHECK(!plain.truncation());
  CHECK(!plain.padding());

  Tokenizer::Truncation tr;
  tr.max_length = 7;
  tr.strategy = Strategy::OnlySecond;
  tr.left = true;
  tr.stride = 1;
  Tokenizer::Padding pd;
  pd.fixed = true;
  pd.length = 16;
  pd.left = true;
  pd.multiple_of = 8;
  pd.pad_id = 3;
  pd.pad_type_id = 1;
  pd.pad_token = "<image>";
  Tokenizer t = plain.with_truncation(tr).with_padding(pd);
  // written in HF's form and read back the same
  json doc = json::parse(t.to_json());
  CHECK(doc["truncation"] == json::parse(R"({"direction":"Left","max_length":7,"strategy":"OnlySecond","stride":1})"));
  CHECK(doc["padding"] == json::parse(R"({"strategy":{"Fixed":16},"direction":"Left","pad_to_multiple_of":8,)"
                                      R"("pad_id":3,"pad_type_id":1,"pad_token":"<image>"})"));
  Tokenizer back = Tokenizer::from_json(t.to_json(), "back.json");
  REQUIRE(back.truncation());
  CHECK(back.truncation()->max_length == 7);
  CHECK(back.truncation()->strategy == Strategy::OnlySecond);
  CHECK(back.truncation()->left);
  CHECK(back.truncation()->stride == 1);
  REQUIRE(back.padding());
  CHECK(back.padding()->fixed);
  CHECK(back.padding()->length == 16);
  CHECK(back.padding()->multiple_of == 8);
  CHECK(back.padding()->pad_type_id == 1);
  CHECK(back.padding()->pad_token == "<image>");
  // and applied: 5 + 3 to 7 from the second's start, padded on the left to 16
  const std::string s5 = digits(5), s3 = digits(3);
  Enc e = back.encode_full(s5, &s3, false);
  CHECK(e.ids == cat({fill(9, 3), plain.encode(s5), tail(plain.encode(s3), 2)}));
  // what was cut off: the second's first 2 ids (1 shared with the kept ones), paired with the first
  REQUIRE(e.overflowing.size() == 1);
  CHECK(e.overflowing[0].ids == cat({fill(9, 3), plain.encode(s5), head(plain.encode(s3), 2)}));
  // a stride as long as what the second keeps: HF stops there (a panic), loom refuses
  tr.stride = 2;
  CHECK_THROWS_WITH(back.with_truncation(tr).encode_full(s5, &s3, false),
                    Catch::Contains("stride 2") && Catch::Contains("2 ids the second sequence"));
  // switched off again
  CHECK(!back.with_truncation(std::nullopt).with_padding(std::nullopt).truncation());
  CHECK(json::parse(back.with_padding(std::nullopt).to_json())["padding"].is_null());

  // the setters refuse what HF refuses, and what would not fit
  Tokenizer bert = with(kBertTemplate);
  tr = Tokenizer::Truncation{};
  tr.max_length = 6;
  tr.stride = 5;  // over 6 - 2
  CHECK_THROWS_WITH(bert.with_truncation(tr), Catch::Contains("stride 5") && Catch::Contains("2 ids"));
  tr.stride = 4;
  CHECK(bert.with_truncation(tr).truncation()->stride == 4);
  pd = Tokenizer::Padding{};
  pd.pad_id = 5000;
  CHECK_THROWS_WITH(plain.with_padding(pd), Catch::Contains("padding id 5000"));
  pd.pad_id = 0;
  pd.fixed = true;
  pd.length = size_t(1) << 30;
  CHECK_THROWS_WITH(plain.with_padding(pd), Catch::Contains("over 2^20"));

  // malformed sections load (encode never needs them) and are refused by encode_full, naming
  // the key; defaults fill what HF's serde defaults fill
  auto refuses = [&](const std::string& truncation, const std::string& padding, const std::string& key,
                     const std::string& what) {
    Tokenizer m = with("null", truncation, padding);
    CHECK(m.encode(s5) == plain.encode(s5));
    CHECK_THROWS_WITH(m.encode_full(s5, nullptr, false),
                      Catch::Contains("post.json") && Catch::Contains(key) && Catch::Contains(what));
  };
  refuses(R"({"max_length":4,"strategy":"Middle","stride":0})", "", "truncation.strategy", "LongestFirst, OnlyFirst");
  refuses(R"({"strategy":"OnlyFirst","stride":0})", "", "truncation.max_length", "missing");
  refuses(R"({"max_length":-4})", "", "truncation.max_length", "non-negative integer");
  refuses(R"({"max_length":4,"direction":"Up"})", "", "truncation.direction", "\"Left\" or \"Right\"");
  refuses(R"([4])", "", "truncation", "an object or null");
  refuses("", R"({"strategy":"Longest"})", "padding.strategy", "BatchLongest");
  refuses("", R"({"strategy":{"Fixed":1e12}})", "padding.strategy.Fixed", "non-negative integer");
  refuses("", R"({"strategy":{"Fixed":100000000}})", "padding.strategy.Fixed", "largest loom takes");
  refuses("", R"({"strategy":"BatchLongest","pad_id":1000})", "padding.pad_id", "past the vocabulary");
  refuses("", R"({"strategy":"BatchLongest","pad_token":5})", "padding.pad_token", "a string");
  Tokenizer bare = with("null", R"({"max_length":4})", R"({})");
  CHECK(bare.truncation()->strategy == Strategy::LongestFirst);
  CHECK(!bare.truncation()->left);
  CHECK(!bare.padding()->fixed);
  CHECK(bare.padding()->pad_id == 0);
  CHECK(bare.encode_full(s5, nullptr, false).ids == head(plain.encode(s5), 4));
  CHECK_THROWS_WITH(with("null", R"({"max_length":"x"})").truncation(), Catch::Contains("truncation.max_length"));
}

// Truncation's overflowing windows, expectations spelled out from HF's Encoding::truncate,
// merge_with and pad: which ids each window holds, in which order, their type ids and masks,
// the nesting of a pair's windows, and the refusals. Under truncation HF (0.23+) runs the model
// on the pre-tokens only until max_length ids are reached, so the windows hold what that last
// pre-token brought past max_length: the texts here are single pre-tokens of one id a letter
// ("zqxjvkwybf": 10 ids), and one case checks the early exit itself.
TEST_CASE("tokenizer overflowing windows: stride, directions, pairs, padding", "[tokenizer][post]") {
  const Tokenizer plain = with("null");
  const std::string t10 = "zqxjvkwybf";
  const Ids x = plain.encode(t10);
  REQUIRE(x.size() == 10);
  REQUIRE(plain.pre_tokenize(t10).size() == 1);
  auto part = [&](size_t a, size_t b) { return Ids(x.begin() + std::ptrdiff_t(a), x.begin() + std::ptrdiff_t(b)); };
  auto trunc = [&](const std::string& post, int max_length, int stride, const char* dir, const char* strategy = "LongestFirst",
                   const std::string& padding = "") {
    return with(post, R"({"max_length":)" + std::to_string(max_length) + R"(,"stride":)" + std::to_string(stride) +
                          R"(,"direction":")" + dir + R"(","strategy":")" + strategy + R"("})", padding);
  };
  auto ids_of = [](const std::vector<Enc>& v) {
    std::vector<Ids> out;
    for (const Enc& e : v) out.push_back(e.ids);
    return out;
  };

  // one sequence, Right: windows of 4 starting every 4 - stride ids until one reaches the end
  Enc e = trunc("null", 4, 1, "Right").encode_full(t10, nullptr, false);
  CHECK(e.ids == part(0, 4));
  CHECK(ids_of(e.overflowing) == std::vector<Ids>{part(3, 7), part(6, 10)});
  for (const Enc& w : e.overflowing) {
    CHECK(w.type_ids == fill(4, 0));
    CHECK(w.attention_mask == mask({{4, 1}}));
    CHECK(w.special_tokens_mask == mask({{4, 0}}));
    CHECK(w.overflowing.empty());
  }
  e = trunc("null", 4, 0, "Right").encode_full(t10, nullptr, false);
  CHECK(ids_of(e.overflowing) == std::vector<Ids>{part(4, 8), part(8, 10)});
  // Left: the last 4 kept, windows ending every 4 - stride ids earlier until one reaches the start
  e = trunc("null", 4, 1, "Left").encode_full(t10, nullptr, false);
  CHECK(e.ids == part(6, 10));
  CHECK(ids_of(e.overflowing) == std::vector<Ids>{part(3, 7), part(0, 4)});
  e = trunc("null", 4, 0, "Left").encode_full(t10, nullptr, false);
  CHECK(ids_of(e.overflowing) == std::vector<Ids>{part(2, 6), part(0, 2)});
  e = trunc("null", 4, 3, "Right").encode_full(t10, nullptr, false);  // a step of 1
  CHECK(e.overflowing.size() == 6);
  CHECK(e.overflowing.back().ids == part(6, 10));
  // nothing cut, nothing over
  CHECK(trunc("null", 10, 2, "Right").encode_full(t10, nullptr, false).overflowing.empty());
  // max_length 0: everything in one window
  e = trunc("null", 0, 0, "Right").encode_full(t10, nullptr, false);
  CHECK(e.ids.empty());
  REQUIRE(e.overflowing.size() == 1);
  CHECK(e.overflowing[0].ids == x);

  // the post-processor wraps every window as it wraps the encoding (S A E: 2 of the 6 ids)
  e = trunc(kBertTemplate, 6, 1, "Right").encode_full(t10, nullptr, true);
  CHECK(e.ids == cat({{1}, part(0, 4), {2}}));
  REQUIRE(e.overflowing.size() == 2);
  CHECK(e.overflowing[1].ids == cat({{1}, part(6, 10), {2}}));
  CHECK(e.overflowing[1].special_tokens_mask == mask({{1, 1}, {4, 0}, {1, 1}}));
  CHECK(e.overflowing[1].type_ids == fill(6, 0));

  // a pair, LongestFirst to 6 (3 + 3) with stride 1: a's and b's windows paired as HF's
  // merge_with pairs them, the windows keeping the type ids they were cut with
  const std::string ta = "zqxjv", tb = "kwybf";  // one pre-token each
  const Ids a = plain.encode(ta), b = plain.encode(tb);
  REQUIRE(a.size() == 5);
  REQUIRE(b.size() == 5);
  auto sub = [](const Ids& v, size_t i, size_t j) { return Ids(v.begin() + std::ptrdiff_t(i), v.begin() + std::ptrdiff_t(j)); };
  e = trunc("null", 6, 1, "Right").encode_full(ta, &tb, false);
  CHECK(e.ids == cat({sub(a, 0, 3), sub(b, 0, 3)}));
  CHECK(e.type_ids == cat({fill(3, 0), fill(3, 1)}));
  REQUIRE(e.overflowing.size() == 3);
  const Ids a2b2 = cat({sub(a, 2, 5), sub(b, 2, 5)});
  CHECK(e.overflowing[0].ids == cat({sub(a, 2, 5), sub(b, 0, 3)}));  // a's window with b
  CHECK(ids_of(e.overflowing[0].overflowing) == std::vector<Ids>{a2b2});  // ... and b's window inside it
  CHECK(e.overflowing[1].ids == a2b2);  // a's window with b's window
  CHECK(e.overflowing[1].overflowing.empty());
  CHECK(e.overflowing[2].ids == cat({sub(a, 0, 3), sub(b, 2, 5)}));  // a (its window nested) with b's window
  CHECK(ids_of(e.overflowing[2].overflowing) == std::vector<Ids>{a2b2});
  for (const Enc& w : e.overflowing) CHECK(w.type_ids == cat({fill(3, 0), fill(3, 1)}));
  // BERT's layout as a template around the pair: the special tokens around every window
  e = trunc(kBertTemplate, 9, 1, "Right").encode_full(ta, &tb, true);  // 9 - 3 added: 3 + 3 again
  REQUIRE(e.overflowing.size() == 3);
  CHECK(e.overflowing[1].ids == cat({{1}, sub(a, 2, 5), {2}, sub(b, 2, 5), {2}}));
  CHECK(e.overflowing[1].type_ids == cat({fill(5, 0), fill(4, 1)}));
  CHECK(e.overflowing[1].special_tokens_mask == mask({{1, 1}, {3, 0}, {1, 1}, {3, 0}, {1, 1}}));
  // OnlySecond: only b has windows, each paired with the whole of a
  e = trunc("null", 8, 1, "Right", "OnlySecond").encode_full(ta, &tb, false);
  CHECK(e.ids == cat({a, sub(b, 0, 3)}));
  CHECK(ids_of(e.overflowing) == std::vector<Ids>{cat({a, sub(b, 2, 5)})});

  // padding: every window to the same length, pads marked special with attention 0;
  // BatchLongest pads to the longest encoding, the windows not counted
  e = trunc("null", 4, 0, "Right", "LongestFirst", R"({"strategy":{"Fixed":6},"pad_id":3,"pad_type_id":7})")
          .encode_full(t10, nullptr, false);
  CHECK(e.ids == cat({part(0, 4), fill(2, 3)}));
  REQUIRE(e.overflowing.size() == 2);
  CHECK(e.overflowing[1].ids == cat({part(8, 10), fill(4, 3)}));
  CHECK(e.overflowing[1].type_ids == cat({fill(2, 0), fill(4, 7)}));
  CHECK(e.overflowing[1].attention_mask == mask({{2, 1}, {4, 0}}));
  CHECK(e.overflowing[1].special_tokens_mask == mask({{2, 0}, {4, 1}}));
  const std::vector<Enc> batch =
      trunc("null", 4, 0, "Right", "LongestFirst", R"({"strategy":"BatchLongest","pad_id":3})")
          .encode_batch({t10, digits(2)}, nullptr, false);
  CHECK(batch[0].overflowing[1].ids == cat({part(8, 10), fill(2, 3)}));
  CHECK(batch[1].ids == cat({plain.encode(digits(2)), fill(2, 3)}));

  // HF's early exit: the model stops at the pre-token that reaches max_length (digits are one
  // pre-token each: 4 of 10 run, no window), an added token counts without being the stop, and
  // Left runs from the end; without truncation, or for the first sequence under OnlySecond,
  // every pre-token runs
  const std::string d10 = digits(10);
  const Ids dx = plain.encode(d10);
  e = trunc("null", 4, 1, "Right").encode_full(d10, nullptr, false);
  CHECK(e.ids == head(dx, 4));
  CHECK(e.overflowing.empty());
  e = trunc("null", 4, 1, "Left").encode_full(d10, nullptr, false);
  CHECK(e.ids == tail(dx, 4));
  CHECK(e.overflowing.empty());
  e = trunc("null", 4, 1, "Right").encode_full("012<|im_end|>3456", nullptr, false);  // 0 1 2 </s> 3: 5 ids
  CHECK(e.ids == cat({plain.encode("012"), {2}}));
  CHECK(ids_of(e.overflowing) == std::vector<Ids>{cat({{2}, plain.encode("3")})});
  e = trunc("null", 2, 0, "Right").encode_full("01" + t10, nullptr, false);  // 0 1, then the word is not run
  CHECK(e.ids == plain.encode("01"));
  CHECK(e.overflowing.empty());
  e = trunc("null", 3, 0, "Right").encode_full("01" + t10, nullptr, false);  // the word runs: 12 ids, 3 kept
  CHECK(e.ids == cat({plain.encode("01"), part(0, 1)}));
  CHECK(ids_of(e.overflowing) == std::vector<Ids>{part(1, 4), part(4, 7), part(7, 10)});
  e = trunc("null", 12, 0, "Right", "OnlySecond").encode_full(d10, &t10, false);  // the first runs whole
  CHECK(e.ids == cat({dx, part(0, 2)}));
  CHECK(ids_of(e.overflowing) == std::vector<Ids>{cat({dx, part(2, 4)}), cat({dx, part(4, 6)}),
                                                  cat({dx, part(6, 8)}), cat({dx, part(8, 10)})});

  // refused: a stride not under what a sequence keeps (HF panics), in a pair too
  CHECK_THROWS_WITH(trunc("null", 4, 4, "Right").encode_full(t10, nullptr, false),
                    Catch::Contains("stride 4") && Catch::Contains("4 ids the sequence"));
  CHECK_THROWS_WITH(trunc("null", 6, 3, "Left").encode_full(ta, &tb, false),
                    Catch::Contains("stride 3") && Catch::Contains("3 ids the first sequence"));
  // and a pair whose windows would pair into more than 2^26 ids (~3 x 2999^2 windows of 2 ids;
  // "a" x 3000 is one pre-token of 3000 ids)
  const std::string a3000(3000, 'a');
  REQUIRE(plain.encode(a3000).size() == 3000);
  CHECK_THROWS_WITH(trunc("null", 2, 0, "Right").encode_full(a3000, &a3000, false), Catch::Contains("2^26"));
  // one sequence: a window per id of a long pre-token (stride one under the kept length)
  CHECK_THROWS_WITH(trunc("null", 30000, 29999, "Right").encode_full(std::string(40000, 'a'), nullptr, false),
                    Catch::Contains("10000 overflowing windows") && Catch::Contains("2^26"));
  CHECK(trunc("null", 30000, 29000, "Right").encode_full(std::string(40000, 'a'), nullptr, false).overflowing.size() == 10);
  CHECK(trunc("null", 2, 0, "Right").encode_full(std::string(300, 'a'), &t10, false).overflowing.size() ==
        299 * 9 + 299 + 9);  // m k + m + k at the top
}

// HF's own encodings (tests/fixtures/tokenizer_post/pipeline.json, written by
// tools/make_post_goldens.py where HF tokenizers is installed): each post-processor of
// golden.json with pairs, then truncation (every strategy and direction) and padding settings
// on BERT's and Llama 3's; the sections as HF writes them, so that loom also reads HF's form.
// Where HF raised an error, loom must refuse too. The file is made on a machine with HF
// tokenizers (tests/fixtures/README.md); without it this case says so and checks nothing.
TEST_CASE("tokenizer pipeline: HF's encodings of pairs, truncation and padding", "[tokenizer][post]") {
  const std::string text = read_all("tests/fixtures/tokenizer_post/pipeline.json");
  if (text.empty()) {
    WARN("tests/fixtures/tokenizer_post/pipeline.json is not made yet (tools/make_post_goldens.py)");
    return;
  }
  const json g = json::parse(text);
  const auto& probes = g.at("strings");
  const size_t n = probes.size();
  std::vector<std::string> firsts, seconds;
  for (size_t i = 0; i < n; i++) firsts.push_back(probes[i]), seconds.push_back(probes[n - 1 - i]);
  REQUIRE(g.at("runs").size() >= 6);
  size_t with_windows = 0;
  for (const auto& r : g.at("runs")) {
    INFO("run " << r.at("name").get<std::string>());
    json doc = json::parse(read_all("tests/fixtures/" + r.at("fixture").get<std::string>() + "/tokenizer.json"));
    for (const char* k : {"post_processor", "truncation", "padding"}) doc[k] = r.at(k);
    const Tokenizer t = Tokenizer::from_json(doc.dump(), "pipeline.json");
    const bool batch = !r.at("padding").is_null();
    const bool single = r.value("single", false);  // each probe alone, not the pairs
    // the runs whose overflowing windows HF's encodings hold (not the pairs cut to 4 or 8 ids,
    // whose nested windows would make the file megabytes; none in files before 2026-12-07)
    const bool windows_recorded = r.value("overflowing_recorded", false);
    with_windows += windows_recorded;
    const std::vector<std::string>* second = single ? nullptr : &seconds;
    auto encode_all = [&](bool special) {
      std::vector<Enc> got;
      if (batch) got = t.encode_batch(firsts, second, special);
      else for (size_t i = 0; i < n; i++) got.push_back(t.encode_full(firsts[i], second ? &seconds[i] : nullptr, special));
      return got;
    };
    // an encoding and its overflowing windows (nested as HF nests a pair's), field by field
    std::function<void(const Enc&, const json&, const std::string&)> same = [&](const Enc& got, const json& want,
                                                                               const std::string& where) {
      INFO(where);
      CHECK(got.ids == want.at("ids").get<Ids>());
      CHECK(got.type_ids == want.at("type_ids").get<Ids>());
      CHECK(got.attention_mask == want.at("attention_mask").get<std::vector<uint8_t>>());
      if (want.contains("special_tokens_mask"))
        CHECK(got.special_tokens_mask == want.at("special_tokens_mask").get<std::vector<uint8_t>>());
      if (!windows_recorded) return;
      const json none = json::array();
      const json& windows = want.contains("overflowing") ? want.at("overflowing") : none;
      REQUIRE(got.overflowing.size() == windows.size());
      for (size_t k = 0; k < windows.size(); k++) same(got.overflowing[k], windows[k], where + " window " + std::to_string(k));
    };
    for (const auto& res : r.at("results")) {
      const bool special = res.at("add_special_tokens");
      INFO("add_special_tokens " << special);
      if (res.contains("error")) {
        INFO("HF: " << res.at("error").get<std::string>());
        bool refused = false;  // HF's run stopped at the first input it refused
        try {
          encode_all(special);
        } catch (const std::exception&) {
          refused = true;
        }
        CHECK(refused);
        continue;
      }
      const std::vector<Enc> got = encode_all(special);
      REQUIRE(got.size() == res.at("encodings").size());
      for (size_t i = 0; i < got.size(); i++) same(got[i], res.at("encodings")[i], (single ? "probe " : "pair ") + std::to_string(i));
    }
  }
  if (with_windows == 0) WARN("pipeline.json predates the overflowing windows: none were compared");
}
