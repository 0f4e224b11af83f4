// safetensors.cpp: strict reader and atomic writer (format in safetensors.h).
#include "tensor/safetensors.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tensor/fileio.h"

namespace loom {

using json = nlohmann::json;

static bool parse_dtype(const std::string& s, DType* out) {
  static const std::map<std::string, DType> m = {
      {"F32", DType::F32}, {"BF16", DType::BF16}, {"F64", DType::F64}, {"I32", DType::I32},
      {"I64", DType::I64}, {"U8", DType::U8},     {"F16", DType::F16}, {"BOOL", DType::U8}};
  auto it = m.find(s);
  if (it == m.end()) return false;
  *out = it->second;
  return true;
}

static const char* dtype_tag(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F64: return "F64";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
    case DType::F16: return "F16";
  }
  return "?";
}

const Tensor& SafeTensors::at(const std::string& name) const {
  auto it = tensors.find(name);
  LOOM_CHECK(it != tensors.end(), "%s: no tensor named '%s'", path.c_str(), name.c_str());
  return it->second;
}

SafeTensors load_safetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  LOOM_CHECK(f.good(), "%s: cannot open", path.c_str());
  f.seekg(0, std::ios::end);
  std::streamoff n = f.tellg();
  LOOM_CHECK(n >= 0, "%s: cannot read (not a regular file?)", path.c_str());
  f.seekg(0);
  std::string bytes(size_t(n), '\0');
  f.read(bytes.data(), n);
  LOOM_CHECK(f.good() || n == 0, "%s: short read", path.c_str());
  return parse_safetensors(bytes, path);
}

// a * b, false when the product does not fit 63 bits (a, b >= 0)
static bool mul_fits(uint64_t a, uint64_t b, uint64_t* out) {
  if (a != 0 && b > uint64_t(INT64_MAX) / a) return false;
  *out = a * b;
  return true;
}

SafeTensors parse_safetensors(const std::string& bytes, const std::string& path) {
  uint64_t file_size = bytes.size();
  LOOM_CHECK(file_size >= 8, "%s: %llu bytes is too short for a safetensors file", path.c_str(),
             (unsigned long long)file_size);
  uint64_t hlen = 0;
  std::memcpy(&hlen, bytes.data(), 8);
  LOOM_CHECK(hlen <= file_size - 8 && hlen < (100u << 20), "%s: header length %llu exceeds the file (%llu bytes)",
             path.c_str(), (unsigned long long)hlen, (unsigned long long)file_size);
  json h;
  try {
    h = json::parse(bytes.begin() + 8, bytes.begin() + 8 + std::ptrdiff_t(hlen));
  } catch (const std::exception& e) {
    LOOM_CHECK(false, "%s: header is not valid JSON: %s", path.c_str(), e.what());
  }
  LOOM_CHECK(h.is_object(), "%s: header is not a JSON object", path.c_str());
  uint64_t data_size = file_size - 8 - hlen;
  const char* data = bytes.data() + 8 + hlen;

  SafeTensors st;
  st.path = path;
  struct Span { uint64_t begin, end; std::string name; };
  std::vector<Span> spans;

  for (auto& [name, e] : h.items()) {
    if (name == "__metadata__") {
      LOOM_CHECK(e.is_object(), "%s: __metadata__ is not an object", path.c_str());
      for (auto& [k, v] : e.items()) {
        LOOM_CHECK(v.is_string(), "%s: metadata '%s' is not a string", path.c_str(), k.c_str());
        st.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    LOOM_CHECK(e.is_object() && e.contains("dtype") && e.contains("shape") && e.contains("data_offsets"),
               "%s: tensor '%s' lacks dtype, shape or data_offsets", path.c_str(), name.c_str());
    DType dt;
    LOOM_CHECK(e["dtype"].is_string() && parse_dtype(e["dtype"].get<std::string>(), &dt),
               "%s: tensor '%s' has unsupported dtype %s", path.c_str(), name.c_str(), e["dtype"].dump().c_str());
    Shape shape;
    LOOM_CHECK(e["shape"].is_array(), "%s: tensor '%s' shape is not an array", path.c_str(), name.c_str());
    // Every product is checked: [4294967296, 1073741824] must not wrap to 0 bytes. The
    // product of the nonzero sizes must fit too (the strides of [0, 2^40, 2^40] would not).
    uint64_t want = dtype_size(dt), nonzero = dtype_size(dt);
    for (auto& d : e["shape"]) {
      LOOM_CHECK(d.is_number_unsigned(), "%s: tensor '%s' has a bad dimension %s", path.c_str(), name.c_str(), d.dump().c_str());
      uint64_t v = d.get<uint64_t>();
      LOOM_CHECK(v <= uint64_t(INT64_MAX) && mul_fits(nonzero, v ? v : 1, &nonzero),
                 "%s: tensor '%s' shape %s: the size in bytes overflows 63 bits", path.c_str(), name.c_str(),
                 e["shape"].dump().c_str());
      want *= v;  // <= nonzero: cannot overflow
      shape.push_back(int64_t(v));
    }
    auto& off = e["data_offsets"];
    LOOM_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
               "%s: tensor '%s' data_offsets must be two unsigned integers", path.c_str(), name.c_str());
    uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    LOOM_CHECK(b <= en && en <= data_size, "%s: tensor '%s' offsets [%llu, %llu) outside the %llu data bytes",
               path.c_str(), name.c_str(), (unsigned long long)b, (unsigned long long)en, (unsigned long long)data_size);
    LOOM_CHECK(en - b == want, "%s: tensor '%s' holds %llu bytes, shape %s of %s needs %llu", path.c_str(),
               name.c_str(), (unsigned long long)(en - b), shape_str(shape).c_str(), dtype_tag(dt),
               (unsigned long long)want);
    spans.push_back({b, en, name});
    Tensor t = Tensor::empty(shape, dt == DType::F16 ? DType::F32 : dt);
    if (dt == DType::F16) {
      const char* src = data + b;
      float* o = t.data<float>();
      for (int64_t i = 0; i < t.numel(); i++) {
        uint16_t v;
        std::memcpy(&v, src + 2 * i, 2);
        o[i] = half_to_float(v);
      }
    } else if (want) {
      std::memcpy(t.raw(), data + b, want);
    }
    st.tensors[name] = t;
  }
  // by (begin, end): a zero-size tensor at the offset where the next one starts comes first
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  uint64_t pos = 0;
  for (auto& s : spans) {
    LOOM_CHECK(s.begin >= pos, "%s: tensor '%s' overlaps the previous tensor", path.c_str(), s.name.c_str());
    LOOM_CHECK(s.begin == pos, "%s: %llu unused bytes before tensor '%s'", path.c_str(),
               (unsigned long long)(s.begin - pos), s.name.c_str());
    pos = s.end;
  }
  LOOM_CHECK(pos == data_size, "%s: %llu trailing bytes after the last tensor%s", path.c_str(),
             (unsigned long long)(data_size - pos), spans.empty() ? "" : (" '" + spans.back().name + "'").c_str());
  return st;
}

void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  std::vector<Tensor> host;
  uint64_t pos = 0;
  for (auto& [name, t] : tensors) {  // std::map: sorted names, a stable layout
    LOOM_CHECK(t.defined(), "save %s: tensor '%s' is undefined", path.c_str(), name.c_str());
    Tensor c = t.to(Device::CPU).contiguous();
    host.push_back(c);
    h[name] = {{"dtype", dtype_tag(c.dtype())}, {"shape", c.shape()}, {"data_offsets", {pos, pos + c.nbytes()}}};
    pos += c.nbytes();
  }
  std::string hs = h.dump();
  while ((hs.size() + 8) % 8) hs += ' ';  // keep the data 8-byte aligned
  uint64_t hl = hs.size();
  std::vector<ByteSpan> pieces = {{&hl, 8}, {hs.data(), hs.size()}};
  for (auto& c : host) pieces.push_back({c.raw(), size_t(c.nbytes())});
  write_file_atomic(path, pieces);
}

}  // namespace loom
