// images.cpp: PNG/JPEG decoding, bilinear resize, image folders, DataStats.
// PNG goes through stb_image (this is the one translation unit that compiles it); JPEG goes
// through libjpeg-turbo when the build found it (LOOM_HAVE_LIBJPEG, Debian's
// libjpeg62-turbo-dev), else through stb_image too. The image fuzz target found that the
// JPEG decoder of Debian 12's stb_image reads out of bounds on corrupt entropy-coded data
// (tests/fuzz/image/jpeg_huffman_decode_negative_index), which no check in front of it can
// rule out; libjpeg-turbo is fuzzed continuously upstream.
#include "data/images.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "kernels/cpu/parallel.h"

#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#ifndef LOOM_HAVE_LIBJPEG
#define STBI_ONLY_JPEG
#endif
#define STBI_FAILURE_USERMSG
#include <stb_image.h>

#ifdef LOOM_HAVE_LIBJPEG
#include <csetjmp>
#include <jpeglib.h>
#endif

namespace fs = std::filesystem;

namespace loom {

// ------------------------------------------------------------------ DataStats
void DataStats::skip(const std::string& reason, const std::string& example) {
  if (skipped[reason]++ == 0 && !example.empty()) first_example[reason] = example;
}

int64_t DataStats::total_skipped() const {
  int64_t n = 0;
  for (const auto& kv : skipped) n += kv.second;
  return n;
}

int64_t DataStats::count(const std::string& reason) const {
  auto it = skipped.find(reason);
  return it == skipped.end() ? 0 : it->second;
}

std::string DataStats::summary() const {
  std::string s = std::to_string(ok) + " samples ok, " + std::to_string(total_skipped()) + " skipped";
  if (skipped.empty()) return s;
  s += " (";
  bool first = true;
  for (const auto& kv : skipped) {
    s += (first ? "" : ", ") + kv.first + " " + std::to_string(kv.second);
    first = false;
  }
  s += ")";
  for (const auto& kv : first_example) s += "; first " + kv.first + ": " + kv.second;
  return s;
}

// ------------------------------------------------------------------ decoding
const char* to_string(ImageStatus s) {
  switch (s) {
    case ImageStatus::Ok: return "ok";
    case ImageStatus::Missing: return "missing_image";
    case ImageStatus::DecodeError: return "corrupt_image";
    case ImageStatus::TooLarge: return "image_too_large";
  }
  return "?";
}

void resize_bilinear_hwc_to_chw(const unsigned char* src, int w, int h, int c, float* dst, int size) {
  // Half-pixel centres: destination pixel d samples source coordinate (d + 0.5) * scale - 0.5,
  // clamped at 0 like torch (align_corners=False). No antialias: downscaling by more than 2x
  // aliases, as torch's default does.
  const float sx = float(w) / size, sy = float(h) / size;
  std::vector<int> x0(size), x1(size);
  std::vector<float> fx(size);
  for (int d = 0; d < size; d++) {
    float s = std::max(0.0f, (d + 0.5f) * sx - 0.5f);
    x0[d] = std::min(int(s), w - 1);
    x1[d] = std::min(x0[d] + 1, w - 1);
    fx[d] = s - x0[d];
  }
  for (int dy = 0; dy < size; dy++) {
    float s = std::max(0.0f, (dy + 0.5f) * sy - 0.5f);
    int y0 = std::min(int(s), h - 1), y1 = std::min(y0 + 1, h - 1);
    float fy = s - y0;
    const unsigned char* r0 = src + size_t(y0) * w * c;
    const unsigned char* r1 = src + size_t(y1) * w * c;
    for (int dx = 0; dx < size; dx++)
      for (int ch = 0; ch < c; ch++) {
        float top = r0[x0[dx] * c + ch] * (1 - fx[dx]) + r0[x1[dx] * c + ch] * fx[dx];
        float bot = r1[x0[dx] * c + ch] * (1 - fx[dx]) + r1[x1[dx] * c + ch] * fx[dx];
        dst[(size_t(ch) * size + dy) * size + dx] = (top * (1 - fy) + bot * fy) / 255.0f;
      }
  }
}

// JPEG Huffman tables checked before stb sees them. The stb_image of Debian 12
// (libstb-dev 0.0~git20220908) builds a table before checking that its 16 code counts sum to
// at most 256, and a DHT segment with more writes past the 257-entry size array (found by
// the image fuzz target; the inputs are kept in tests/fuzz/image/). stb skips bytes between
// markers until it finds an 0xFF, so the segments it would read cannot be told from a
// walk of the marker chain; every 0xFF 0xC4 in the file is checked instead (entropy-coded
// data stuffs each 0xFF data byte as FF 00, so a real DHT is never missed; a payload that
// happens to hold FF C4 followed by an impossible table is refused, which no encoder writes).
#ifndef LOOM_HAVE_LIBJPEG
static bool jpeg_huffman_tables_ok(const unsigned char* d, size_t n, std::string* error) {
  // stb takes a file for a JPEG when it starts with SOI after any number of 0xFF fill bytes
  size_t start = 0;
  while (start < n && d[start] == 0xFF) start++;
  if (start == 0 || start >= n || d[start] != 0xD8) return true;  // not a JPEG: stb's checks decide
  for (size_t p = start + 1; p + 4 <= n; p++) {
    if (d[p] != 0xFF || d[p + 1] != 0xC4) continue;
    // tables of 1 + 16 counts + symbols, read the way stb reads them: while the segment
    // length left is > 0, past the segment's end if the counts say so; bytes past the end of
    // the file read as 0
    long left = long(size_t(d[p + 2]) << 8 | d[p + 3]) - 2;
    size_t q = p + 4;
    while (left > 0 && q < n) {
      size_t symbols = 0;
      for (size_t i = 1; i <= 16 && q + i < n; i++) symbols += d[q + i];
      if (symbols > 256) {
        if (error) *error = "corrupt JPEG: Huffman table with " + std::to_string(symbols) + " codes (at most 256)";
        return false;
      }
      q += 17 + symbols;
      left -= long(17 + symbols);
    }
  }
  return true;
}
#endif

// PNG chunks checked before stb sees them (both found by the image fuzz target; the inputs
// are kept in tests/fuzz/image/):
//  - a chunk whose length runs past the end of the file is refused: stb reallocates its data
//    buffer to the claimed IDAT size first (up to 2 GB for a 100-byte file) and only then
//    finds the bytes missing;
//  - IDAT chunks of length 0 are dropped: stb copies a chunk with memcpy into its buffer,
//    which is still NULL when the first IDAT is empty, and memcpy(NULL, p, 0) is undefined
//    behaviour. An empty IDAT holds no data: the copy without it decodes to the same image.
//    That includes an empty IDAT cut off inside its CRC at the end of the file (stb reads its
//    header and copies its 0 bytes all the same).
// Returns false with `error` set for a refused file; `out` holds the copy when one was made.
static bool png_chunks_ok(const unsigned char* d, size_t n, std::vector<unsigned char>& out, std::string* error) {
  static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', 0x0D, 0x0A, 0x1A, 0x0A};
  if (n < 8 || std::memcmp(d, sig, 8) != 0) return true;  // not a PNG
  auto len_at = [&](size_t p) { return size_t(d[p]) << 24 | size_t(d[p + 1]) << 16 | size_t(d[p + 2]) << 8 | d[p + 3]; };
  auto empty_idat = [&](size_t p) { return len_at(p) == 0 && std::memcmp(d + p + 4, "IDAT", 4) == 0; };
  bool any_empty = false;
  size_t p = 8;
  for (; p + 8 <= n; p += 12 + len_at(p)) {  // length (4, big-endian), type (4), data, CRC (4)
    if (len_at(p) > n - p - 8) {
      if (error)
        *error = "corrupt PNG: chunk '" + std::string(reinterpret_cast<const char*>(d + p + 4), 4) + "' at byte " +
                 std::to_string(p) + " claims " + std::to_string(len_at(p)) + " bytes, the file has " +
                 std::to_string(n - p - 8) + " left";
      return false;
    }
    any_empty |= empty_idat(p);
    if (len_at(p) + 12 > n - p || std::memcmp(d + p + 4, "IEND", 4) == 0) break;  // stb reads no further
  }
  if (!any_empty) return true;
  out.assign(d, d + 8);
  for (p = 8; p + 8 <= n;) {
    size_t whole = 12 + len_at(p);
    if (empty_idat(p)) {  // dropped, also when the file ends inside its CRC (stb would read it)
      p = std::min(n, p + whole);
      continue;
    }
    if (whole > n - p) break;
    out.insert(out.end(), d + p, d + p + whole);
    p += whole;
  }
  out.insert(out.end(), d + p, d + n);  // whatever follows the last whole chunk, as it was
  return true;
}

#ifdef LOOM_HAVE_LIBJPEG
// libjpeg reports errors through a callback that must not return: it longjmps back here. A
// warning (corrupt data: a bad Huffman code, a premature end) is an error too, so a damaged
// file is refused rather than decoded into garbage. Only plain data lives in the frame
// between setjmp and longjmp.
struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char msg[JMSG_LENGTH_MAX];
};

extern "C" {
static void jpeg_on_error(j_common_ptr c) {
  JpegError* e = reinterpret_cast<JpegError*>(c->err);
  (*c->err->format_message)(c, e->msg);
  std::longjmp(e->jump, 1);
}
static void jpeg_on_message(j_common_ptr c, int level) {
  if (level < 0) jpeg_on_error(c);  // a warning: corrupt data
}
}

// JPEG -> interleaved 8-bit pixels with `channels` (1 grey, 3 RGB); header_only: sizes only.
static ImageStatus decode_jpeg(const unsigned char* d, size_t n, int channels, int64_t max_pixels, bool header_only,
                               std::vector<unsigned char>& px, int* w, int* h, std::string* error) {
  jpeg_decompress_struct cinfo;
  JpegError err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_on_error;
  err.mgr.emit_message = jpeg_on_message;
  ImageStatus status = ImageStatus::DecodeError;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    if (error) *error = std::string("corrupt JPEG (") + err.msg + ")";
    return ImageStatus::DecodeError;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, d, static_cast<unsigned long>(n));
  jpeg_read_header(&cinfo, TRUE);
  *w = int(cinfo.image_width);
  *h = int(cinfo.image_height);
  if (int64_t(*w) * *h > max_pixels) {
    status = ImageStatus::TooLarge;
  } else if (header_only) {
    status = ImageStatus::Ok;
  } else {
    cinfo.out_color_space = channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
    cinfo.dct_method = JDCT_ISLOW;
    jpeg_start_decompress(&cinfo);
    px.resize(size_t(*w) * size_t(*h) * size_t(channels));
    while (cinfo.output_scanline < cinfo.output_height) {
      JSAMPROW row = px.data() + size_t(cinfo.output_scanline) * size_t(*w) * size_t(channels);
      jpeg_read_scanlines(&cinfo, &row, 1);
    }
    jpeg_finish_decompress(&cinfo);
    status = ImageStatus::Ok;
  }
  jpeg_destroy_decompress(&cinfo);
  if (status == ImageStatus::TooLarge && error)
    *error = std::to_string(*w) + "x" + std::to_string(*h) + " is over the limit of " + std::to_string(max_pixels) + " pixels";
  return status;
}
#endif

// PNG or JPEG bytes -> interleaved 8-bit pixels with `channels`, after the checks above;
// header_only: only the size (and its limit).
static ImageStatus decode_pixels(const unsigned char* data, size_t bytes, int channels, int64_t max_pixels,
                                 bool header_only, std::vector<unsigned char>& px, int* w, int* h, std::string* error) {
  *w = *h = 0;
#ifdef LOOM_HAVE_LIBJPEG
  if (bytes >= 2 && data[0] == 0xFF && data[1] == 0xD8)
    return decode_jpeg(data, bytes, channels, max_pixels, header_only, px, w, h, error);
#else
  if (!jpeg_huffman_tables_ok(data, bytes, error)) return ImageStatus::DecodeError;  // before any stb call
#endif
  std::vector<unsigned char> png;
  if (!png_chunks_ok(data, bytes, png, error)) return ImageStatus::DecodeError;
  if (!png.empty()) {
    data = png.data();
    bytes = png.size();
  }
  int comp = 0;
  if (bytes > size_t(INT32_MAX) || !stbi_info_from_memory(data, int(bytes), w, h, &comp)) {
    if (error) *error = std::string("not a PNG/JPEG or corrupt header (") + stbi_failure_reason() + ")";
    return ImageStatus::DecodeError;
  }
  if (int64_t(*w) * *h > max_pixels) {
    if (error) *error = std::to_string(*w) + "x" + std::to_string(*h) + " is over the limit of " + std::to_string(max_pixels) + " pixels";
    return ImageStatus::TooLarge;
  }
  if (header_only) return ImageStatus::Ok;
  unsigned char* p = stbi_load_from_memory(data, int(bytes), w, h, &comp, channels);
  if (!p) {
    if (error) *error = std::string("decode failed (") + stbi_failure_reason() + ")";
    return ImageStatus::DecodeError;
  }
  px.assign(p, p + size_t(*w) * size_t(*h) * size_t(channels));
  stbi_image_free(p);
  return ImageStatus::Ok;
}

ImageStatus decode_image_chw(const unsigned char* data, size_t bytes, int size, int channels,
                             std::vector<float>& out, std::string* error, int64_t max_pixels) {
  if (channels != 1 && channels != 3) throw std::runtime_error("decode_image: channels must be 1 or 3, got " + std::to_string(channels));
  if (size <= 0) throw std::runtime_error("decode_image: size must be > 0, got " + std::to_string(size));
  std::vector<unsigned char> px;
  int w = 0, h = 0;
  ImageStatus st = decode_pixels(data, bytes, channels, max_pixels, false, px, &w, &h, error);
  if (st != ImageStatus::Ok) return st;
  out.resize(size_t(channels) * size * size);
  resize_bilinear_hwc_to_chw(px.data(), w, h, channels, out.data(), size);
  for (float& v : out) v = (v - 0.5f) / 0.5f;
  return ImageStatus::Ok;
}

namespace {
bool read_file(const std::string& path, std::vector<unsigned char>& buf) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  f.seekg(0, std::ios::end);
  std::streamoff n = f.tellg();
  if (n < 0) return false;
  f.seekg(0);
  buf.resize(size_t(n));
  f.read(reinterpret_cast<char*>(buf.data()), n);
  return bool(f) || n == 0;
}
}  // namespace

ImageStatus load_image_chw(const std::string& path, int size, int channels, std::vector<float>& out,
                           std::string* error, int64_t max_pixels) {
  std::vector<unsigned char> buf;
  if (!fs::is_regular_file(path) || !read_file(path, buf)) {
    if (error) *error = "cannot open " + path;
    return ImageStatus::Missing;
  }
  return decode_image_chw(buf.data(), buf.size(), size, channels, out, error, max_pixels);
}

ImageStatus probe_image(const std::string& path, int* w, int* h, std::string* error, int64_t max_pixels) {
  // the whole file, through the same checks as a decode (stb's header parse reads a JPEG's
  // Huffman tables before its frame header)
  std::vector<unsigned char> buf;
  if (!fs::is_regular_file(path) || !read_file(path, buf)) {
    if (error) *error = "cannot open " + path;
    return ImageStatus::Missing;
  }
  std::vector<unsigned char> px;
  int ww = 0, hh = 0;
  ImageStatus st = decode_pixels(buf.data(), buf.size(), 3, max_pixels, true, px, &ww, &hh, error);
  if (w) *w = ww;
  if (h) *h = hh;
  return st;
}

// ------------------------------------------------------------------ folders
std::vector<std::string> list_images(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw std::runtime_error(dir + ": not a directory");
  std::vector<std::string> out;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink, ec);
       it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) break;
    if (!it->is_regular_file(ec)) continue;
    std::string ext = it->path().extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char ch) { return std::tolower(ch); });
    if (ext == ".png" || ext == ".jpg" || ext == ".jpeg") out.push_back(it->path().string());
  }
  if (ec) throw std::runtime_error(dir + ": cannot list: " + ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

ImageSet load_image_folder(const std::string& dir, int size, int channels, DataStats* stats, int limit,
                           int64_t max_pixels) {
  std::vector<std::string> files = list_images(dir);
  if (limit > 0 && int(files.size()) > limit) files.resize(limit);
  // Classes: first-level subfolders, sorted (labels follow the sorted names).
  std::vector<std::string> classes;
  std::vector<std::string> cls_of(files.size());
  for (size_t i = 0; i < files.size(); i++) {
    std::string rel = fs::path(files[i]).lexically_relative(dir).string();
    size_t slash = rel.find('/');
    if (slash != std::string::npos) cls_of[i] = rel.substr(0, slash);
    if (!cls_of[i].empty()) classes.push_back(cls_of[i]);
  }
  std::sort(classes.begin(), classes.end());
  classes.erase(std::unique(classes.begin(), classes.end()), classes.end());

  std::vector<std::vector<float>> px(files.size());
  std::vector<ImageStatus> st(files.size());
  std::vector<std::string> err(files.size());
  cpu::parallel_for_each(int64_t(files.size()), [&](int64_t i) {
    st[i] = load_image_chw(files[i], size, channels, px[i], &err[i], max_pixels);
  });

  ImageSet set;
  set.c = channels;
  set.h = set.w = size;
  set.class_names = classes;
  const size_t per = size_t(channels) * size * size;
  for (size_t i = 0; i < files.size(); i++) {
    if (st[i] != ImageStatus::Ok) {
      if (stats) stats->skip(to_string(st[i]), files[i] + ": " + err[i]);
      continue;
    }
    if (stats) stats->ok++;
    set.pixels.insert(set.pixels.end(), px[i].begin(), px[i].begin() + per);
    int32_t label = -1;
    if (!cls_of[i].empty())
      label = int32_t(std::lower_bound(classes.begin(), classes.end(), cls_of[i]) - classes.begin());
    set.labels.push_back(label);
    set.n++;
  }
  return set;
}

}  // namespace loom
