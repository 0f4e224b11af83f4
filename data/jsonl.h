// jsonl.h: LLaVA-style conversation data, one JSON object per line (SPEC section 4):
//   {"image": "rel/path.png",
//    "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
//                      {"from": "gpt",   "value": "A red circle."}, ...]}
// Image paths are relative to the JSONL file's folder (absolute paths are kept).
//
// Every line is validated. A bad line is skipped with a warning and counted by reason in
// DataStats, or, in strict mode, is a std::runtime_error naming file:line and the reason:
//   bad_json             not valid JSON
//   bad_schema           not an object, no "image" string, no "conversations" array, a turn
//                        without string "from"/"value"
//   missing_image        the image file does not exist
//   corrupt_image        not a decodable PNG/JPEG
//   image_too_large      more pixels than max_pixels (checked from the header)
//   no_image_tag         no "<image>" in any turn
//   multiple_image_tags  a second "<image>"
//   bad_roles            turns do not alternate human, gpt, human, gpt, ... ending on gpt,
//                        or the <image> tag is not in a human turn
// Blank lines are ignored.
#pragma once
#include <string>
#include <vector>

#include "data/images.h"

namespace loom {

inline constexpr const char* kImageTag = "<image>";

struct Turn {
  std::string from;   // "human" or "gpt"
  std::string value;  // the text; the human turn with the image holds exactly one "<image>"
};

struct ConversationSample {
  std::string image_path;    // resolved path
  std::vector<float> image;  // [channels, image_size, image_size]; empty when image_size == 0
  std::vector<Turn> turns;
  int line = 0;              // 1-based line in the JSONL file
};

struct JsonlOptions {
  int image_size = 0;   // > 0: decode and resize every image now; 0: check the header only
  int channels = 3;
  bool strict = false;  // throw on the first bad line instead of skipping it
  int64_t max_pixels = int64_t(1) << 26;
  int limit = 0;        // > 0: stop after this many good samples
  int max_warnings = 5; // warnings printed to stderr per reason; the rest are only counted
};

// Parse and validate one line (no image access): true and `sample` (turns, resolved
// image_path) filled, or false with the reason (one of the names above) and a message.
bool parse_llava_line(const std::string& line, const std::string& base_dir, ConversationSample& sample,
                      std::string* reason, std::string* message);

// Load and validate `path`. `stats` (optional) receives ok and per-reason skip counts.
std::vector<ConversationSample> load_llava_jsonl(const std::string& path, const JsonlOptions& opt = {},
                                                 DataStats* stats = nullptr);

}  // namespace loom
