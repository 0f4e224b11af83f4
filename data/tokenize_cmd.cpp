// tokenize_cmd.cpp: `train tokenize`, the tokenizer on the command line.
//
//   train tokenize --tokenizer tokenizer.json < text.txt        -> [12,7,301,...]
//   train tokenize --tokenizer tokenizer.json --decode < ids.json -> the text
//   train tokenize --tokenizer tokenizer.json --add-special-tokens < text.txt -> [1,12,7,...]
//
// Encode reads all of stdin as UTF-8 text (no special treatment of a trailing newline: it
// is part of the text) and prints the ids as one JSON array and a newline. --decode reads a
// JSON array of ids and prints the text exactly, without adding a newline.
#include <nlohmann/json.hpp>

#include <cstring>
#include <iostream>
#include <iterator>
#include <string>

#include "data/tokenizer.h"

namespace loom {

namespace {
const char* kUsage =
    "usage: train tokenize --tokenizer PATH [--decode] [--skip-special] [--add-special-tokens]\n"
    "  encode (default): stdin text -> JSON array of ids on stdout\n"
    "  --add-special-tokens: with encode, the post-processor's tokens too (e.g. BOS),\n"
    "                    as HF's encode(text) adds them by default\n"
    "  --decode:         stdin JSON array of ids -> text on stdout\n"
    "  --skip-special:   with --decode, leave special tokens out\n";
}

int tokenize_command(int argc, char** argv) {
  std::string path;
  bool decode = false, skip_special = false, add_special = false;
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
    } else if (a == "--help" || a == "-h") {
      std::cout << kUsage;
      return 0;
    } else {
      std::cerr << "tokenize: unknown argument \"" << a << "\"\n" << kUsage;
      return 2;
    }
  }
  if (path.empty()) {
    std::cerr << "tokenize: --tokenizer PATH is required\n" << kUsage;
    return 2;
  }
  try {
    Tokenizer tok = Tokenizer::from_file(path);
    std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
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
