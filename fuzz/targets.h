// targets.h: the fuzz targets, one per parser that reads user files. Each takes the bytes of
// one input and must return normally for every input: a bad input is a thrown
// std::exception (caught here) and nothing else. A crash, a sanitizer report, a hang, an
// allocation beyond the fuzzer's limit or a broken property (abort) is a defect.
//
// The same functions are the fuzzers' entry points (fuzz/fuzz_main.cpp, `make fuzz`) and
// the replay of the regression inputs kept under tests/fuzz/<target>/ (tests/test_fuzz.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace loom::fuzz {

using Target = int (*)(const uint8_t* data, size_t size);

// safetensors header + tensor table + data (parse_safetensors)
int safetensors(const uint8_t* data, size_t size);
// a .cfg file, then after the first NUL byte one "--section.key=value" override per line;
// then validate_config; property: dump() parses back to the same dump()
int config(const uint8_t* data, size_t size);
// one LLaVA JSONL line (parse_llava_line); property: an accepted line has one <image> tag
// and alternating turns ending on gpt
int jsonl(const uint8_t* data, size_t size);
// a tokenizer.json, then after the first NUL byte text to encode (with a small trained
// tokenizer when the JSON is refused); property: ids are in the vocabulary and decode
int tokenizer(const uint8_t* data, size_t size);
// a PNG or JPEG file decoded through stb with the loaders' pixel limit, 1 and 3 channels
int image(const uint8_t* data, size_t size);
// an IDX file (gzip or plain) read as 1, 2 and 3 dimensions (read_idx)
int idx(const uint8_t* data, size_t size);
// a data.synth_rows file (parse_row_lengths: 49 image tokens, rows of 2048 tokens); property:
// every accepted row holds samples of 50..2048 tokens that sum to at most 2048
int rows(const uint8_t* data, size_t size);

struct Named {
  const char* name;
  Target fn;
};
const std::vector<Named>& all_targets();

}  // namespace loom::fuzz
