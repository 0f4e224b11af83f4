// images.h: image decoding (PNG/JPEG), bilinear resize, image folders, and the counters the
// loaders share.
//
// Decoding never crashes the run on a bad file: it returns a status the caller counts
// (DataStats) and reports once in the log. Images are float CHW normalized like every
// dataset here: (x / 255 - 0.5) / 0.5, i.e. in [-1, 1].
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace loom {

// A labelled set of same-size images.
struct ImageSet {
  int n = 0, c = 0, h = 0, w = 0;
  std::vector<float> pixels;    // [n, c, h, w], (x - 0.5) / 0.5
  std::vector<int32_t> labels;  // [n]; -1 = unlabelled
  std::vector<std::string> class_names;  // label -> name, when known
};

// Per-reason counts of skipped samples, shared by the loaders; `summary()` is the log line.
struct DataStats {
  int64_t ok = 0;
  std::map<std::string, int64_t> skipped;  // reason -> count
  std::map<std::string, std::string> first_example;  // reason -> first "file:line: message"
  void skip(const std::string& reason, const std::string& example = "");
  int64_t total_skipped() const;
  int64_t count(const std::string& reason) const;
  // "1000 samples ok, 7 skipped (bad_json 3, missing_image 4); first: ..." (no newline)
  std::string summary() const;
};

enum class ImageStatus { Ok, Missing, DecodeError, TooLarge };
const char* to_string(ImageStatus s);  // "ok", "missing_image", "corrupt_image", "image_too_large"

// Decode `path`, convert to `channels` (1 grey or 3 RGB), resize to size x size (bilinear,
// half-pixel centres like torch's interpolate(align_corners=False) without antialias) and
// write [channels, size, size] floats to `out`. Images with more than max_pixels pixels are
// refused from the header alone, before any decode. `error` gets a readable reason.
ImageStatus load_image_chw(const std::string& path, int size, int channels, std::vector<float>& out,
                           std::string* error = nullptr, int64_t max_pixels = int64_t(1) << 26);
// The same from bytes in memory (a PNG or JPEG file's contents).
ImageStatus decode_image_chw(const unsigned char* data, size_t bytes, int size, int channels,
                             std::vector<float>& out, std::string* error = nullptr,
                             int64_t max_pixels = int64_t(1) << 26);
// Header check only: format recognised and size within the limit (no pixel decode).
ImageStatus probe_image(const std::string& path, int* w, int* h, std::string* error = nullptr,
                        int64_t max_pixels = int64_t(1) << 26);

// Bilinear resize of interleaved 8-bit HWC pixels to float CHW in [0, 1] (no normalization).
void resize_bilinear_hwc_to_chw(const unsigned char* src, int w, int h, int c, float* dst, int size);

// Every .png/.jpg/.jpeg (any case) under `dir`, recursively, sorted by path.
std::vector<std::string> list_images(const std::string& dir);

// An image folder: the class of an image is its first-level subfolder (sorted names give
// labels 0..K-1); images directly in `dir` are unlabelled (-1). Bad images are skipped and
// counted in `stats`. limit > 0 keeps the first `limit` images.
ImageSet load_image_folder(const std::string& dir, int size, int channels, DataStats* stats = nullptr,
                           int limit = 0, int64_t max_pixels = int64_t(1) << 26);

}  // namespace loom
