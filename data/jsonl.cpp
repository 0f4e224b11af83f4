// jsonl.cpp: LLaVA-style JSONL loader with per-line validation (reasons listed in jsonl.h).
// Lines are parsed in order, then images are decoded in parallel chunks, then the verdicts
// are applied in line order, so strict mode always reports the first bad line.
#include "data/jsonl.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "kernels/cpu/parallel.h"

namespace loom {

namespace {

struct Entry {
  int line = 0;
  std::string reason, message;  // reason empty: a candidate, pending its image
  ConversationSample sample;
  ImageStatus image_status = ImageStatus::Ok;
  std::string image_error;
};

size_t count_tags(const std::string& s) {
  size_t n = 0;
  for (size_t p = s.find(kImageTag); p != std::string::npos; p = s.find(kImageTag, p + 1)) n++;
  return n;
}

}  // namespace

bool parse_llava_line(const std::string& text, const std::string& base_dir, ConversationSample& sample,
                      std::string* reason, std::string* message) {
  struct {
    std::string reason, message;
    ConversationSample& sample;
  } e{"", "", sample};
  auto done = [&]() {
    if (reason) *reason = e.reason;
    if (message) *message = e.message;
    return e.reason.empty();
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& x) {
    e.reason = "bad_json";
    e.message = x.what();
    return done();
  }
  auto bad = [&](const std::string& why, const std::string& msg) {
    e.reason = why;
    e.message = msg;
    return done();
  };
  if (!j.is_object()) return bad("bad_schema", "line is not a JSON object");
  if (!j.contains("image") || !j["image"].is_string() || j["image"].get<std::string>().empty())
    return bad("bad_schema", "no \"image\" string");
  if (!j.contains("conversations") || !j["conversations"].is_array())
    return bad("bad_schema", "no \"conversations\" array");
  const auto& conv = j["conversations"];
  if (conv.empty()) return bad("bad_roles", "empty conversation");
  size_t tags = 0;
  for (size_t i = 0; i < conv.size(); i++) {
    const auto& t = conv[i];
    if (!t.is_object() || !t.contains("from") || !t["from"].is_string() || !t.contains("value") ||
        !t["value"].is_string())
      return bad("bad_schema", "turn " + std::to_string(i) + " lacks string \"from\" and \"value\"");
    Turn turn{t["from"].get<std::string>(), t["value"].get<std::string>()};
    const char* want = i % 2 == 0 ? "human" : "gpt";
    if (turn.from != want)
      return bad("bad_roles", "turn " + std::to_string(i) + " is from \"" + turn.from + "\", expected \"" + want +
                                  "\" (turns alternate human, gpt)");
    size_t n = count_tags(turn.value);
    if (n > 0 && turn.from != "human") return bad("bad_roles", "<image> in a gpt turn " + std::to_string(i));
    tags += n;
    e.sample.turns.push_back(std::move(turn));
  }
  if (conv.size() % 2 != 0) return bad("bad_roles", "conversation ends on a human turn (no answer)");
  if (tags == 0) return bad("no_image_tag", "no <image> tag in the conversation");
  if (tags > 1) return bad("multiple_image_tags", std::to_string(tags) + " <image> tags (exactly one expected)");
  std::filesystem::path p(j["image"].get<std::string>());
  e.sample.image_path = p.is_absolute() ? p.string() : (std::filesystem::path(base_dir) / p).lexically_normal().string();
  return done();
}

std::vector<ConversationSample> load_llava_jsonl(const std::string& path, const JsonlOptions& opt, DataStats* stats) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open JSONL file");
  const std::string base_dir = std::filesystem::path(path).parent_path().string();

  std::vector<Entry> entries;
  std::string text;
  for (int lineno = 1; std::getline(in, text); lineno++) {
    if (text.find_first_not_of(" \t\r\n") == std::string::npos) continue;
    Entry e;
    e.line = lineno;
    e.sample.line = lineno;
    parse_llava_line(text, base_dir.empty() ? "." : base_dir, e.sample, &e.reason, &e.message);
    entries.push_back(std::move(e));
  }

  std::vector<ConversationSample> out;
  std::map<std::string, int> warned;
  DataStats local;
  DataStats& st = stats ? *stats : local;
  const size_t chunk = 256;
  for (size_t c0 = 0; c0 < entries.size(); c0 += chunk) {
    const size_t c1 = std::min(entries.size(), c0 + chunk);
    // Images of this chunk, in parallel (decode dominates the load time).
    cpu::parallel_for_each(int64_t(c1 - c0), [&](int64_t k) {
      Entry& e = entries[c0 + size_t(k)];
      if (!e.reason.empty()) return;
      if (opt.image_size > 0)
        e.image_status = load_image_chw(e.sample.image_path, opt.image_size, opt.channels, e.sample.image,
                                        &e.image_error, opt.max_pixels);
      else
        e.image_status = probe_image(e.sample.image_path, nullptr, nullptr, &e.image_error, opt.max_pixels);
    });
    // Verdicts in line order.
    for (size_t i = c0; i < c1; i++) {
      Entry& e = entries[i];
      if (e.reason.empty() && e.image_status != ImageStatus::Ok) {
        e.reason = to_string(e.image_status);
        e.message = e.sample.image_path + ": " + e.image_error;
      }
      if (!e.reason.empty()) {
        std::string where = path + ":" + std::to_string(e.line);
        if (opt.strict) throw std::runtime_error(where + ": " + e.reason + ": " + e.message);
        if (warned[e.reason]++ < opt.max_warnings) {
          std::fprintf(stderr, "warning: %s: skipped (%s): %s\n", where.c_str(), e.reason.c_str(), e.message.c_str());
        }
        st.skip(e.reason, where + ": " + e.message);
        continue;
      }
      st.ok++;
      out.push_back(std::move(e.sample));
      if (opt.limit > 0 && int(out.size()) >= opt.limit) return out;
    }
  }
  return out;
}

}  // namespace loom
