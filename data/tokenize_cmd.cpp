// tokenize_cmd.cpp: `train tokenize`, the tokenizer on the command line.
//
//   train tokenize --tokenizer tokenizer.json < text.txt        -> [12,7,301,...]
//   train tokenize --tokenizer tokenizer.json --decode < ids.json -> the text
//   train tokenize --tokenizer tokenizer.json --add-special-tokens < text.txt -> [1,12,7,...]
//   train tokenize --tokenizer tokenizer.json --pair "second text" --max-length 16 < text.txt
//     -> {"ids":[...],"type_ids":[...],"attention_mask":[...],"special_tokens_mask":[...]}
//   train tokenize --tokenizer tokenizer.json --max-length 512 --stride 128 < long.txt
//     -> {"ids":[...],...,"overflowing":[{"ids":[...],...},...]}   (the windows cut off)
//
// Encode reads all of stdin as UTF-8 text (no special treatment of a trailing newline: it
// is part of the text) and prints the ids as one JSON array and a newline. --full (implied by
// --pair and --max-length) runs Tokenizer::encode_full instead, with the file's truncation and
// padding, and prints the encoding as one JSON object, with "overflowing" (the windows that
// truncation cut off, HF's Encoding.overflowing) when there are any. --decode reads a JSON
// array of ids and prints the text exactly, without adding a newline.
#include <nlohmann/json.hpp>

#include <cstring>
#include <iostream>
#include <iterator>
#include <optional>
#include <string>

#include "data/tokenizer.h"

namespace loom {

namespace {
const char* kUsage =
    "usage: train tokenize --tokenizer PATH [--decode] [--skip-special] [--add-special-tokens]\n"
    "                      [--full] [--pair TEXT] [--max-length N [--stride K]]\n"
    "  encode (default): stdin text -> JSON array of ids on stdout\n"
    "  --add-special-tokens: with encode, the post-processor's tokens too (e.g. BOS),\n"
    "                    as HF's encode(text) adds them by default\n"
    "  --full:           the whole pipeline (the file's truncation and padding, the\n"
    "                    post-processor's pair template): a JSON object of ids, type_ids,\n"
    "                    attention_mask and special_tokens_mask, and the windows that\n"
    "                    truncation cut off as \"overflowing\" (a list of such objects)\n"
    "  --pair TEXT:      TEXT as the second sequence of a pair (implies --full)\n"
    "  --max-length N:   truncate to N ids, longest sequence first, instead of the\n"
    "                    file's truncation (implies --full)\n"
    "  --stride K:       with --max-length, each overflowing window repeats the K ids\n"
    "                    before it (default 0)\n"
    "  --decode:         stdin JSON array of ids -> text on stdout\n"
    "  --skip-special:   with --decode, leave special tokens out\n";

// An encoding as one JSON object, in HF's field names; "overflowing" only when there are windows.
nlohmann::json encoding_json(const Tokenizer::Encoding& e) {
  nlohmann::json j{{"ids", e.ids}, {"type_ids", e.type_ids}, {"attention_mask", e.attention_mask},
                   {"special_tokens_mask", e.special_tokens_mask}};
  if (!e.overflowing.empty()) {
    j["overflowing"] = nlohmann::json::array();
    for (const Tokenizer::Encoding& w : e.overflowing) j["overflowing"].push_back(encoding_json(w));
  }
  return j;
}

}  // namespace

int tokenize_command(int argc, char** argv) {
  std::string path;
  bool decode = false, skip_special = false, add_special = false, full = false;
  std::optional<std::string> pair;
  std::optional<size_t> max_length, stride;
  // argv holds the options; a leading "tokenize" (the subcommand's own name) is skipped
  for (int i = argc > 0 && std::strcmp(argv[0], "tokenize") == 0 ? 1 : 0; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--tokenizer" && i + 1 < argc) {
      path = argv[++i];
    } else if (a.rfind("--tokenizer=", 0) == 0) {
      path = a.substr(std::strlen("--tokenizer="));
    } else if (a == "--decode") {
      decode = true;
    } else if (a == "--skip-special") {
      skip_special = true;
    } else if (a == "--add-special-tokens") {
      add_special = true;
    } else if (a == "--full") {
      full = true;
    } else if (a == "--pair" && i + 1 < argc) {
      pair = argv[++i];
      full = true;
    } else if ((a == "--max-length" || a == "--stride") && i + 1 < argc) {
      const std::string v = argv[++i];
      if (v.empty() || v.size() > 9 || v.find_first_not_of("0123456789") != std::string::npos) {
        std::cerr << "tokenize: " << a << " takes a count of ids (0 to 999999999), got \"" << v << "\"\n";
        return 2;
      }
      (a == "--stride" ? stride : max_length) = size_t(std::stoul(v));
      full = true;
    } else if (a == "--help" || a == "-h") {
      std::cout << kUsage;
      return 0;
    } else {
      std::cerr << "tokenize: unknown argument \"" << a << "\"\n" << kUsage;
      return 2;
    }
  }
  if (stride && !max_length) {
    std::cerr << "tokenize: --stride needs --max-length (the windows are what truncation cuts off)\n";
    return 2;
  }
  if (path.empty()) {
    std::cerr << "tokenize: --tokenizer PATH is required\n" << kUsage;
    return 2;
  }
  try {
    Tokenizer tok = Tokenizer::from_file(path);
    std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    if (!decode && full) {
      if (max_length) {
        Tokenizer::Truncation t;
        t.max_length = *max_length;
        t.stride = stride.value_or(0);
        try {
          tok = tok.with_truncation(t);
        } catch (const std::invalid_argument& err) {
          std::cerr << "tokenize: --stride: " << err.what() << "\n";
          return 2;
        }
      }
      Tokenizer::Encoding e;
      try {
        e = tok.encode_full(input, pair ? &*pair : nullptr, add_special);
      } catch (const std::invalid_argument& err) {
        std::cerr << "tokenize: stdin" << (pair ? " and --pair" : "") << ": " << err.what() << "\n";
        return 1;
      }
      std::cout << encoding_json(e).dump() << "\n";
      return 0;
    }
    if (!decode) {
      std::vector<int32_t> ids;
      try {
        ids = tok.encode(input, add_special);
      } catch (const std::invalid_argument& e) {
        std::cerr << "tokenize: stdin: " << e.what() << "\n";
        return 1;
      }
      std::cout << nlohmann::json(ids).dump() << "\n";
      return 0;
    }
    std::vector<int32_t> ids;
    try {
      ids = nlohmann::json::parse(input).get<std::vector<int32_t>>();
    } catch (const nlohmann::json::exception& e) {
      std::cerr << "tokenize: stdin: expected a JSON array of ids: " << e.what() << "\n";
      return 1;
    }
    std::cout << tok.decode(ids, skip_special);
    std::cout.flush();
    return 0;
  } catch (const std::exception& e) {  // tokenizer errors name the file themselves
    std::cerr << "tokenize: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace loom
