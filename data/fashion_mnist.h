// fashion_mnist.h: the Fashion-MNIST IDX files (gzip-compressed or plain), as installed by
// the Debian package dataset-fashion-mnist in /usr/share/datasets/fashion-mnist:
//   train-images-idx3-ubyte.gz  train-labels-idx1-ubyte.gz   (60000 images)
//   t10k-images-idx3-ubyte.gz   t10k-labels-idx1-ubyte.gz    (10000 images)
// 28x28 grey images, labels 0..9; pixels normalized like every dataset here: (x/255 - 0.5)/0.5.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "data/images.h"

namespace loom {

// split: "train" or "test". limit > 0 reads only the first `limit` images.
// Errors (std::runtime_error): missing files (naming the path and the Debian package),
// bad magic, truncated data or image/label counts that disagree (naming the file).
ImageSet load_fashion_mnist(const std::string& split, const std::string& dir = "/usr/share/datasets/fashion-mnist",
                            int limit = 0);

// One IDX file of unsigned bytes (gzip or plain) with `ndim` dimensions (1..3): its sizes in
// `dims` (dims[0] cut to `limit` when limit > 0) and the data. Throws naming the file on a bad
// magic, an implausible or zero size, or truncated data.
std::vector<unsigned char> read_idx(const std::string& path, int ndim, std::vector<uint32_t>& dims, int64_t limit = 0);

// The ten class names, label order.
const std::vector<std::string>& fashion_mnist_classes();

}  // namespace loom
