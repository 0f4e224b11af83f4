// fashion_mnist.cpp: IDX reader. An IDX file is a big-endian header (magic 0x0000 08 <ndim>,
// then ndim uint32 sizes) followed by unsigned bytes. zlib's gzread also reads files that
// are not compressed, so the plain and the .gz files share one path.
#include "data/fashion_mnist.h"

#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>

namespace loom {

const std::vector<std::string>& fashion_mnist_classes() {
  static const std::vector<std::string> v = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                             "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
  return v;
}

namespace {

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

// The .gz file, or the uncompressed one; throws naming the package when neither exists.
std::string find_idx(const std::string& dir, const std::string& stem) {
  for (const std::string& p : {dir + "/" + stem + ".gz", dir + "/" + stem})
    if (exists(p)) return p;
  throw std::runtime_error("Fashion-MNIST: " + dir + "/" + stem + ".gz not found (install the Debian package "
                           "dataset-fashion-mnist, or set data.path to a folder with the IDX files)");
}

struct Gz {
  gzFile f;
  explicit Gz(const std::string& p) : f(gzopen(p.c_str(), "rb")) {}
  ~Gz() {
    if (f) gzclose(f);
  }
};

// Read `bytes` bytes; false on a short read.
bool read_exact(gzFile f, void* dst, size_t bytes) {
  unsigned char* p = static_cast<unsigned char*>(dst);
  while (bytes > 0) {
    unsigned chunk = unsigned(std::min<size_t>(bytes, 1u << 30));
    int got = gzread(f, p, chunk);
    if (got <= 0) return false;
    p += got;
    bytes -= size_t(got);
  }
  return true;
}

uint32_t be32(const unsigned char* b) { return uint32_t(b[0]) << 24 | uint32_t(b[1]) << 16 | uint32_t(b[2]) << 8 | b[3]; }

}  // namespace

std::vector<unsigned char> read_idx(const std::string& path, int ndim, std::vector<uint32_t>& dims, int64_t limit) {
  if (ndim < 1 || ndim > 3) throw std::runtime_error("read_idx: ndim must be 1..3, got " + std::to_string(ndim));
  Gz gz(path);
  if (!gz.f) throw std::runtime_error("Fashion-MNIST: " + path + ": cannot open");
  unsigned char head[4];
  if (!read_exact(gz.f, head, 4)) throw std::runtime_error("Fashion-MNIST: " + path + ": truncated header");
  uint32_t magic = be32(head), want = 0x00000800u | uint32_t(ndim);
  if (magic != want) {
    char buf[128];
    std::snprintf(buf, sizeof buf, ": bad magic 0x%08x (expected 0x%08x, unsigned bytes, %d dims)", magic, want, ndim);
    throw std::runtime_error("Fashion-MNIST: " + path + buf);
  }
  dims.assign(size_t(ndim), 0);
  // every size >= 1 and the sizes bounded before any product (items x bytes per item is at
  // most 2^24 x 2^20, far from overflowing)
  uint64_t per_item = 1;
  for (int d = 0; d < ndim; d++) {
    if (!read_exact(gz.f, head, 4)) throw std::runtime_error("Fashion-MNIST: " + path + ": truncated header");
    dims[size_t(d)] = be32(head);
    if (dims[size_t(d)] == 0 || dims[size_t(d)] > (1u << 24))
      throw std::runtime_error("Fashion-MNIST: " + path + ": implausible size " + std::to_string(dims[size_t(d)]) +
                               " of dimension " + std::to_string(d) + " in the header (1..2^24)");
    if (d > 0) per_item *= dims[size_t(d)];
  }
  if (per_item > (1u << 20))
    throw std::runtime_error("Fashion-MNIST: " + path + ": implausible item size " + std::to_string(per_item) +
                             " bytes in the header (at most 2^20)");
  if (limit > 0 && uint64_t(limit) < dims[0]) dims[0] = uint32_t(limit);
  // Read in chunks as the data arrives: a header that claims more than the file holds fails
  // at the end of the data, not by allocating what it claims first.
  uint64_t total = uint64_t(dims[0]) * per_item;
  std::vector<unsigned char> data;
  const uint64_t chunk = 1u << 24;
  for (uint64_t done = 0; done < total;) {
    uint64_t n = std::min(chunk, total - done);
    data.resize(size_t(done + n));
    if (!read_exact(gz.f, data.data() + done, size_t(n)))
      throw std::runtime_error("Fashion-MNIST: " + path + ": truncated data (header says " + std::to_string(dims[0]) +
                               " items of " + std::to_string(per_item) + " bytes)");
    done += n;
  }
  return data;
}

ImageSet load_fashion_mnist(const std::string& split, const std::string& dir_in, int limit) {
  std::string prefix;
  if (split == "train") prefix = "train";
  else if (split == "test") prefix = "t10k";
  else throw std::runtime_error("Fashion-MNIST: split must be train or test, got '" + split + "'");
  const std::string dir = dir_in.empty() ? "/usr/share/datasets/fashion-mnist" : dir_in;
  std::string img_path = find_idx(dir, prefix + "-images-idx3-ubyte");
  std::string lab_path = find_idx(dir, prefix + "-labels-idx1-ubyte");

  std::vector<uint32_t> idims, ldims;
  std::vector<unsigned char> img = read_idx(img_path, 3, idims, limit);
  std::vector<unsigned char> lab = read_idx(lab_path, 1, ldims, limit);
  if (idims[0] != ldims[0])
    throw std::runtime_error("Fashion-MNIST: " + img_path + " has " + std::to_string(idims[0]) + " images but " +
                             lab_path + " has " + std::to_string(ldims[0]) + " labels");
  ImageSet s;
  s.n = int(idims[0]);
  s.c = 1;
  s.h = int(idims[1]);
  s.w = int(idims[2]);
  s.class_names = fashion_mnist_classes();
  s.pixels.resize(img.size());
  for (size_t i = 0; i < img.size(); i++) s.pixels[i] = (img[i] / 255.0f - 0.5f) / 0.5f;
  s.labels.resize(lab.size());
  for (size_t i = 0; i < lab.size(); i++) {
    if (lab[i] > 9)
      throw std::runtime_error("Fashion-MNIST: " + lab_path + ": label " + std::to_string(lab[i]) + " at item " +
                               std::to_string(i) + " is outside 0..9");
    s.labels[i] = lab[i];
  }
  return s;
}

}  // namespace loom
