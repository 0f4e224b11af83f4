// safetensors.h: read and write the safetensors format (8-byte little-endian header size, a
// JSON header {name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}, then the raw
// little-endian data). Reads are strict: every offset, size and overlap is checked, and an
// error names the file and the tensor.
#pragma once
#include <map>
#include <string>

#include "tensor/tensor.h"

namespace loom {

struct SafeTensors {
  std::map<std::string, Tensor> tensors;  // CPU tensors; F16 is widened to F32 on load
  std::map<std::string, std::string> metadata;
  const Tensor& at(const std::string& name) const;  // throws naming the file and the tensor
  bool has(const std::string& name) const { return tensors.count(name) > 0; }
  std::string path;
};

SafeTensors load_safetensors(const std::string& path);
// The same from the bytes of a file in memory; `path` names it in error messages.
SafeTensors parse_safetensors(const std::string& bytes, const std::string& path);
// Writes tensors (any device; copied to the host) with their own dtypes. Written to
// path + ".tmp", fsync'ed and renamed (tensor/fileio.h), so a reader never sees a
// half-written file; a failed write (disk full) throws with the system's reason.
void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace loom
