// tensor.cpp: storage, views, copies and conversions. Elementwise work goes through the
// kernels (kernels/kernels.inc: fill, convert, copy_strided) on the tensor's device.
#include "tensor/tensor.h"

#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdlib>
#include <numeric>
#include <sstream>

#include "tensor/dispatch.h"

namespace loom {

// ------------------------------------------------------------------ errors and shapes
void throw_error(const char* file, int line, const std::string& msg) {
  const char* base = file;
  for (const char* p = file; *p; p++)
    if (*p == '/') base = p + 1;
  throw std::runtime_error(msg + " (" + base + ":" + std::to_string(line) + ")");
}

std::string strformat(const char* fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

void throw_no_kernel(const char* what, const Tensor& t) {
  throw std::runtime_error(std::string("no ") + what + " kernel for " + t.desc() +
                           (t.is_cuda() ? " (CUDA kernels run in f32 and bf16)"
                                        : " (CPU kernels run in f32 and f64)"));
}

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); i++) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

int64_t shape_numel(const Shape& s) {
  // every size is >= 0 and the product of the nonzero ones fits 63 bits (the strides are
  // such products), so no tensor's size can wrap around
  int64_t n = 1, nonzero = 1;
  for (auto d : s) {
    LOOM_CHECK(d >= 0, "shape %s has a negative size", shape_str(s).c_str());
    LOOM_CHECK(d == 0 || nonzero <= INT64_MAX / d, "shape %s: the element count overflows 63 bits", shape_str(s).c_str());
    nonzero *= d ? d : 1;
    n *= d;
  }
  return n;
}

static Shape contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (int i = int(s.size()) - 1; i >= 0; i--) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

Shape broadcast_shapes(const Shape& a, const Shape& b) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; i++) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    LOOM_CHECK(da == db || da == 1 || db == 1, "shapes %s and %s do not broadcast",
               shape_str(a).c_str(), shape_str(b).c_str());
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// ------------------------------------------------------------------ half floats
float half_to_float(uint16_t h) { return half_bits_to_float(h); }
uint16_t float_to_half(float f) { return float_to_half_bits(f); }

// ------------------------------------------------------------------ storage
static std::atomic<size_t> g_cpu_bytes{0}, g_cpu_peak{0};
size_t cpu_bytes_in_use() { return g_cpu_bytes; }
size_t cpu_peak_bytes() { return g_cpu_peak; }
void cpu_reset_peak() { g_cpu_peak = size_t(g_cpu_bytes); }

Storage::Storage(size_t n, Device d) : bytes(n), device(d) {
  size_t alloc = std::max<size_t>(n, 1);
  if (d == Device::CPU) {
    data = std::aligned_alloc(64, (alloc + 63) / 64 * 64);
    LOOM_CHECK(data, "out of host memory allocating %zu bytes", n);
    size_t now = g_cpu_bytes += n;
    size_t peak = g_cpu_peak;
    while (now > peak && !g_cpu_peak.compare_exchange_weak(peak, now)) {}
  } else {
    data = cuda::device_malloc(alloc);
  }
}

Storage::Storage(void* d, size_t n, Device dev, std::shared_ptr<void> o)
    : data(d), bytes(n), device(dev), owner(std::move(o)) {
  if (!owner) owner = std::shared_ptr<void>(d, [](void*) {});  // marks the memory as borrowed
}

Storage::~Storage() {
  if (owner) return;  // borrowed: the owner frees it
  if (device == Device::CPU) {
    std::free(data);
    g_cpu_bytes -= bytes;
  } else {
    cuda::device_free(data);
  }
}

// ------------------------------------------------------------------ random
uint64_t Rng::next_u64() {  // splitmix64: one word of state, passes BigCrush
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
double Rng::uniform() { return double(next_u64() >> 11) * (1.0 / 9007199254740992.0); }
double Rng::normal() {
  double u1 = uniform(), u2 = uniform();
  if (u1 < 1e-300) u1 = 1e-300;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}
int64_t Rng::randint(int64_t n) { return int64_t(next_u64() % uint64_t(n)); }
std::vector<int32_t> Rng::permutation(int n) {
  std::vector<int32_t> p(n);
  std::iota(p.begin(), p.end(), 0);
  for (int i = n - 1; i > 0; i--) std::swap(p[i], p[randint(i + 1)]);
  return p;
}

// ------------------------------------------------------------------ creation
Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (auto d : shape) LOOM_CHECK(d >= 0, "negative dimension in shape %s", shape_str(shape).c_str());
  auto impl = std::make_shared<TensorImpl>();
  int64_t numel = shape_numel(shape);
  LOOM_CHECK(numel <= INT64_MAX / int64_t(dtype_size(dtype)), "shape %s of %s: the size in bytes overflows 63 bits",
             shape_str(shape).c_str(), dtype_name(dtype));
  impl->storage = std::make_shared<Storage>(size_t(numel) * dtype_size(dtype), device);
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(impl);
}

Tensor Tensor::wrap(void* data, const Shape& shape, DType dtype, Device device, std::shared_ptr<void> owner) {
  for (auto d : shape) LOOM_CHECK(d >= 0, "negative dimension in shape %s", shape_str(shape).c_str());
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(data, size_t(shape_numel(shape)) * dtype_size(dtype), device, std::move(owner));
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  return Tensor(impl);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  return full(shape, 0.0, dtype, device);
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::empty_like(const Tensor& x) { return empty(x.shape(), x.dtype(), x.device()); }
Tensor Tensor::zeros_like(const Tensor& x) { return zeros(x.shape(), x.dtype(), x.device()); }

template <class T>
Tensor Tensor::from_vector(const std::vector<T>& v, const Shape& shape, Device device) {
  LOOM_CHECK(int64_t(v.size()) == shape_numel(shape), "from_vector: %zu values for shape %s",
             v.size(), shape_str(shape).c_str());
  Tensor t = empty(shape, dtype_of<T>(), Device::CPU);
  if (!v.empty()) std::memcpy(t.raw(), v.data(), v.size() * sizeof(T));
  return device == Device::CPU ? t : t.to(device);
}
template Tensor Tensor::from_vector(const std::vector<float>&, const Shape&, Device);
template Tensor Tensor::from_vector(const std::vector<double>&, const Shape&, Device);
template Tensor Tensor::from_vector(const std::vector<bf16>&, const Shape&, Device);
template Tensor Tensor::from_vector(const std::vector<int32_t>&, const Shape&, Device);
template Tensor Tensor::from_vector(const std::vector<int64_t>&, const Shape&, Device);
template Tensor Tensor::from_vector(const std::vector<uint8_t>&, const Shape&, Device);

// Random tensors are drawn on the host in double, then converted: the same seed gives the
// same numbers on every device and dtype.
Tensor Tensor::randn(const Shape& shape, Rng& rng, double std, DType dtype, Device device) {
  std::vector<double> v(size_t(shape_numel(shape)));
  for (auto& x : v) x = rng.normal() * std;
  return from_vector(v, shape).to(dtype).to(device);
}

Tensor Tensor::rand(const Shape& shape, Rng& rng, double lo, double hi, DType dtype, Device device) {
  std::vector<double> v(size_t(shape_numel(shape)));
  for (auto& x : v) x = lo + (hi - lo) * rng.uniform();
  return from_vector(v, shape).to(dtype).to(device);
}

// ------------------------------------------------------------------ properties
int64_t Tensor::size(int d) const {
  int n = dim();
  if (d < 0) d += n;
  LOOM_CHECK(d >= 0 && d < n, "dimension %d out of range for %s", d, desc().c_str());
  return impl_->shape[d];
}

bool Tensor::is_contiguous() const {
  int64_t acc = 1;
  for (int i = dim() - 1; i >= 0; i--) {
    if (impl_->shape[i] != 1 && impl_->strides[i] != acc) return false;
    acc *= impl_->shape[i];
  }
  return true;
}

std::string Tensor::desc() const {
  if (!impl_) return "undefined tensor";
  return std::string(dtype_name(dtype())) + shape_str(shape()) + " " + device_name(device());
}

void* Tensor::raw() const {
  return static_cast<char*>(impl_->storage->data) + impl_->offset * int64_t(dtype_size(dtype()));
}

template <class T> T* Tensor::data() const {
  LOOM_CHECK(impl_, "data() of an undefined tensor");
  LOOM_CHECK(dtype() == dtype_of<T>(), "expected a %s tensor, got %s", dtype_name(dtype_of<T>()),
             desc().c_str());
  return static_cast<T*>(raw());
}
template float* Tensor::data<float>() const;
template double* Tensor::data<double>() const;
template bf16* Tensor::data<bf16>() const;
template f16* Tensor::data<f16>() const;
template int32_t* Tensor::data<int32_t>() const;
template int64_t* Tensor::data<int64_t>() const;
template uint8_t* Tensor::data<uint8_t>() const;

Layout layout_of(const Tensor& t) {
  LOOM_CHECK(t.dim() <= Layout::kMaxDims, "%s has more than %d dims", t.desc().c_str(), Layout::kMaxDims);
  Layout l;
  l.ndim = t.dim();
  for (int i = 0; i < l.ndim; i++) {
    l.shape[i] = t.shape()[i];
    l.stride[i] = t.strides()[i];
  }
  return l;
}

// ------------------------------------------------------------------ views
static Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.impl()->storage;
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = base.dtype();
  return Tensor(impl);
}

static Shape infer_shape(Shape shape, int64_t numel, const std::string& what) {
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); i++) {
    if (shape[i] == -1) {
      LOOM_CHECK(infer < 0, "%s: more than one -1 in %s", what.c_str(), shape_str(shape).c_str());
      infer = int(i);
    } else known *= shape[i];
  }
  if (infer >= 0) {
    LOOM_CHECK(known > 0 && numel % known == 0, "%s: cannot infer -1 in %s for %lld elements",
               what.c_str(), shape_str(shape).c_str(), (long long)numel);
    shape[infer] = numel / known;
  }
  LOOM_CHECK(shape_numel(shape) == numel, "%s: shape %s does not hold %lld elements", what.c_str(),
             shape_str(shape).c_str(), (long long)numel);
  return shape;
}

Tensor Tensor::view(const Shape& shape) const {
  LOOM_CHECK(is_contiguous(), "view of a non-contiguous %s (use reshape or contiguous)", desc().c_str());
  Shape s = infer_shape(shape, numel(), "view of " + desc());
  return make_view(*this, s, contiguous_strides(s), offset());
}

Tensor Tensor::reshape(const Shape& shape) const {
  return is_contiguous() ? view(shape) : contiguous().view(shape);
}

Tensor Tensor::permute(const std::vector<int>& dims) const {
  LOOM_CHECK(int(dims.size()) == dim(), "permute: %zu dims for %s", dims.size(), desc().c_str());
  Shape s(dims.size()), st(dims.size());
  std::vector<bool> seen(dims.size());
  for (size_t i = 0; i < dims.size(); i++) {
    int d = dims[i] < 0 ? dims[i] + dim() : dims[i];
    LOOM_CHECK(d >= 0 && d < dim() && !seen[d], "permute: bad dims for %s", desc().c_str());
    seen[d] = true;
    s[i] = shape()[d];
    st[i] = strides()[d];
  }
  return make_view(*this, s, st, offset());
}

Tensor Tensor::transpose(int a, int b) const {
  std::vector<int> p(dim());
  std::iota(p.begin(), p.end(), 0);
  if (a < 0) a += dim();
  if (b < 0) b += dim();
  std::swap(p[a], p[b]);
  return permute(p);
}

Tensor Tensor::narrow(int d, int64_t start, int64_t length) const {
  if (d < 0) d += dim();
  LOOM_CHECK(d >= 0 && d < dim() && start >= 0 && length >= 0 && start + length <= shape()[d],
             "narrow(dim %d, start %lld, length %lld) out of range for %s", d, (long long)start,
             (long long)length, desc().c_str());
  Shape s = shape();
  s[d] = length;
  return make_view(*this, s, strides(), offset() + start * strides()[d]);
}

Tensor Tensor::expand(const Shape& shape) const {
  LOOM_CHECK(shape.size() >= size_t(dim()), "expand %s to %s", desc().c_str(), shape_str(shape).c_str());
  size_t lead = shape.size() - dim();
  Shape st(shape.size(), 0);
  for (size_t i = 0; i < shape.size(); i++) {
    if (i < lead) continue;
    int64_t have = this->shape()[i - lead];
    LOOM_CHECK(have == shape[i] || have == 1, "expand %s to %s", desc().c_str(), shape_str(shape).c_str());
    st[i] = have == 1 ? 0 : strides()[i - lead];
  }
  return make_view(*this, shape, st, offset());
}

// ------------------------------------------------------------------ copies
// Which storage types each backend's storage kernels exist for.
template <class Dev, class T> constexpr bool storage_kernel_exists() {
  if constexpr (std::is_same_v<Dev, CpuTag>) return true;
  else return std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, f16> ||
              std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>;
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  Tensor out = empty(shape(), dtype(), device());
  out.copy_(*this);
  return out;
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), dtype(), device());
  out.copy_(*this);
  return out;
}

// contiguous copy of `src` (same dtype and device) into `dst` (contiguous)
static void strided_copy_same(const Tensor& dst, const Tensor& src) {
  dispatch_any(src, [&](auto dev, auto zero) {
    using T = decltype(zero);
    if constexpr (storage_kernel_exists<decltype(dev), T>())
      KERNEL(dev, copy_strided)(static_cast<T*>(dst.raw()), static_cast<const T*>(src.raw()),
                                layout_of(src), stream_for(dev));
    else throw_no_kernel("strided copy", src);
  });
}

// dst (contiguous, dtype To) = convert(src contiguous, dtype From), both on the CPU
static void convert_cpu(const Tensor& dst, const Tensor& src) {
  auto n = src.numel();
  auto from = [&](auto to_zero) {
    using To = decltype(to_zero);
    To* o = static_cast<To*>(dst.raw());
    switch (src.dtype()) {
      case DType::F32: return cpu::convert(o, static_cast<const float*>(src.raw()), n, nullptr);
      case DType::F64: return cpu::convert(o, static_cast<const double*>(src.raw()), n, nullptr);
      case DType::BF16: return cpu::convert(o, static_cast<const bf16*>(src.raw()), n, nullptr);
      case DType::F16: return cpu::convert(o, static_cast<const f16*>(src.raw()), n, nullptr);
      case DType::I32: return cpu::convert(o, static_cast<const int32_t*>(src.raw()), n, nullptr);
      case DType::I64: return cpu::convert(o, static_cast<const int64_t*>(src.raw()), n, nullptr);
      case DType::U8: return cpu::convert(o, static_cast<const uint8_t*>(src.raw()), n, nullptr);
      default: throw_no_kernel("conversion", src);
    }
  };
  switch (dst.dtype()) {
    case DType::F32: return from(float{});
    case DType::F64: return from(double{});
    case DType::BF16: return from(bf16{});
    case DType::F16: return from(f16{});
    case DType::I32: return from(int32_t{});
    case DType::I64: return from(int64_t{});
    default: throw_no_kernel("conversion to this dtype", dst);
  }
}

#ifdef LOOM_CUDA
// dst = convert(src), both contiguous on the GPU, for the pairs the CUDA backend has
static bool convert_cuda(const Tensor& dst, const Tensor& src) {
  auto n = src.numel();
  Stream s = cuda::default_stream();
  auto from = [&](auto to_zero) -> bool {
    using To = decltype(to_zero);
    To* o = static_cast<To*>(dst.raw());
    switch (src.dtype()) {
      case DType::F32: cuda::convert(o, static_cast<const float*>(src.raw()), n, s); return true;
      case DType::BF16: cuda::convert(o, static_cast<const bf16*>(src.raw()), n, s); return true;
      case DType::F16: cuda::convert(o, static_cast<const f16*>(src.raw()), n, s); return true;
      case DType::I32: cuda::convert(o, static_cast<const int32_t*>(src.raw()), n, s); return true;
      case DType::I64: cuda::convert(o, static_cast<const int64_t*>(src.raw()), n, s); return true;
      default: return false;
    }
  };
  switch (dst.dtype()) {
    case DType::F32: return from(float{});
    case DType::BF16: return from(bf16{});
    case DType::F16: return from(f16{});
    case DType::I32: return from(int32_t{});
    case DType::I64: return from(int64_t{});
    default: return false;
  }
}
#endif

// A window of a contiguous buffer (a narrow): per row a contiguous run of `width` elements,
// the other dims collapsing to `rows` rows `pitch` elements apart. False for other layouts.
struct Window2D {
  int64_t width = 1, rows = 1, pitch = -1;
};
static bool window_2d(const Tensor& t, Window2D* w) {
  int k = t.dim();
  while (k > 0 && (t.shape()[size_t(k - 1)] == 1 || t.strides()[size_t(k - 1)] == w->width))
    w->width *= t.shape()[size_t(--k)];
  bool ok = true;
  for (int i = k - 1; i >= 0; i--) {
    if (t.shape()[size_t(i)] == 1) continue;
    if (w->pitch < 0) w->pitch = t.strides()[size_t(i)];
    else ok &= t.strides()[size_t(i)] == w->pitch * w->rows;
    w->rows *= t.shape()[size_t(i)];
  }
  if (w->pitch < 0) w->pitch = w->width;
  return ok && w->pitch >= w->width;  // (a broadcast dim, stride 0, is no window)
}

void Tensor::copy_(const Tensor& src) {
  LOOM_CHECK(src.shape() == shape(), "copy_: source %s into %s", src.desc().c_str(), desc().c_str());
  if (numel() == 0) return;
  Tensor s = src;
  const size_t es = dtype_size(dtype());
  // 1. make the source contiguous on its own device
  if (!s.is_contiguous()) {
    // into a contiguous tensor of its device and dtype: one pass, no temporary (a window on the
    // GPU: one 2-D copy, ~2x the generic strided kernel's speed on 384-byte rows); not when
    // both are views of one storage (they could overlap: the temporary below keeps that safe)
    if (is_contiguous() && s.device() == device() && s.dtype() == dtype() && s.impl()->storage != impl()->storage) {
      Window2D w;
      if (device() == Device::CUDA && window_2d(s, &w))
        cuda::memcpy_2d(raw(), size_t(w.width) * es, s.raw(), size_t(w.pitch) * es, size_t(w.width) * es,
                        size_t(w.rows), cuda::default_stream());
      else strided_copy_same(*this, s);
      return;
    }
    Tensor c = empty(s.shape(), s.dtype(), s.device());
    strided_copy_same(c, s);
    s = c;
  }
  // (a strided CUDA destination takes its 2-D copy straight from a contiguous CUDA source)
  const bool direct = !is_contiguous() && device() == Device::CUDA && s.device() == Device::CUDA &&
                      s.dtype() == dtype() && s.impl()->storage != impl()->storage;
  Tensor d = is_contiguous() ? *this : direct ? s : empty(shape(), dtype(), device());
  // 2. dtype conversion (on the source device when possible)
  if (s.dtype() != d.dtype()) {
    Tensor c = empty(s.shape(), d.dtype(), s.device());
    bool done = false;
#ifdef LOOM_CUDA
    if (s.is_cuda()) done = convert_cuda(c, s);
#endif
    if (!done) {
      if (s.is_cuda()) {  // rare pairs (f64 on a GPU): through the host
        Tensor h = s.to(Device::CPU), hc = empty(s.shape(), d.dtype(), Device::CPU);
        convert_cpu(hc, h);
        c = hc.to(s.device());
      } else convert_cpu(c, s);
    }
    s = c;
  }
  // 3. device transfer into d
  size_t nb = size_t(numel()) * es;
  if (s.device() == Device::CPU && d.device() == Device::CPU) std::memcpy(d.raw(), s.raw(), nb);
  else if (s.device() == Device::CPU) cuda::memcpy_h2d(d.raw(), s.raw(), nb, cuda::default_stream());
  else if (d.device() == Device::CPU) cuda::memcpy_d2h(d.raw(), s.raw(), nb, cuda::default_stream());
  else if (!d.same(s)) cuda::memcpy_d2d(d.raw(), s.raw(), nb, cuda::default_stream());
  // 4. strided destination: scatter the contiguous result back through our strides
  if (!d.same(*this) && device() == Device::CUDA) {
    // (a window of a contiguous tensor, a narrow: one 2-D copy)
    Window2D w;
    LOOM_CHECK(window_2d(*this, &w), "copy_ into a strided CUDA tensor %s: only windows of contiguous tensors are supported",
               desc().c_str());
    cuda::memcpy_2d(raw(), size_t(w.pitch) * es, d.raw(), size_t(w.width) * es, size_t(w.width) * es, size_t(w.rows),
                    cuda::default_stream());
    return;
  }
  if (!d.same(*this)) {
    dispatch_any(*this, [&](auto, auto zero) {
      using T = decltype(zero);
      const T* in = static_cast<const T*>(d.raw());
      T* out = static_cast<T*>(raw());
      Layout l = layout_of(*this);
      int64_t n = numel();
      std::vector<int64_t> idx(l.ndim, 0);
      for (int64_t i = 0; i < n; i++) {
        int64_t off = 0;
        for (int k = 0; k < l.ndim; k++) off += idx[k] * l.stride[k];
        out[off] = in[i];
        for (int k = l.ndim - 1; k >= 0; k--) {
          if (++idx[k] < l.shape[k]) break;
          idx[k] = 0;
        }
      }
    });
  }
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  Tensor out = empty(shape(), dtype(), device);
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(DType dt) const {
  if (dt == dtype()) return *this;
  Tensor out = empty(shape(), dt, device());
  out.copy_(*this);
  return out;
}

void Tensor::fill_(double value) {
  LOOM_CHECK(is_contiguous(), "fill_ of a non-contiguous %s", desc().c_str());
  if (numel() == 0) return;
  dispatch_any(*this, [&](auto dev, auto zero) {
    using T = decltype(zero);
    if constexpr (storage_kernel_exists<decltype(dev), T>() && !std::is_same_v<T, uint8_t>)
      KERNEL(dev, fill)(static_cast<T*>(raw()), value, numel(), stream_for(dev));
    else if constexpr (std::is_same_v<T, uint8_t> && std::is_same_v<decltype(dev), CpuTag>)
      std::memset(raw(), int(value), size_t(numel()));
    else throw_no_kernel("fill", *this);
  });
}

template <class T> std::vector<T> Tensor::to_vector() const {
  Tensor h = to(Device::CPU).to(dtype_of<T>()).contiguous();
  std::vector<T> v(size_t(h.numel()));
  if (!v.empty()) std::memcpy(v.data(), h.raw(), v.size() * sizeof(T));
  return v;
}
template std::vector<float> Tensor::to_vector() const;
template std::vector<double> Tensor::to_vector() const;
template std::vector<int32_t> Tensor::to_vector() const;
template std::vector<int64_t> Tensor::to_vector() const;

double Tensor::item() const {
  LOOM_CHECK(numel() == 1, "item() of %s", desc().c_str());
  return to_vector<double>()[0];
}

}  // namespace loom
