// tensor.h: n-dimensional strided views over reference-counted storage on the CPU or a GPU.
//
// A Tensor is a handle (shared_ptr) to a TensorImpl: storage + shape + strides (in elements)
// + offset + dtype. Views (reshape of a contiguous tensor, permute, transpose, narrow) share
// storage. The methods here are raw: they record nothing for autograd. The differentiable
// versions of the same views are the free functions in autograd/ops.h (loom::reshape, ...),
// which is what nn/ uses.
//
// Autograd state lives on the impl (requires_grad, grad, the producing tape node's index)
// so that the tape (autograd/) can find it; tensor/ itself never reads it.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "tensor/dtype.h"

namespace loom {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

// Raw bytes on one device. CUDA storage comes from the caching allocator.
struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device = Device::CPU;
  Storage(size_t bytes, Device device);
  // Memory owned elsewhere (a pinned batch slab, a device input slot): never freed here;
  // `owner` keeps it alive as long as a tensor views it.
  Storage(void* data, size_t bytes, Device device, std::shared_ptr<void> owner);
  ~Storage();
  std::shared_ptr<void> owner;  // set for borrowed memory
  // Set by autograd when this buffer became the gradient of more than one tensor without a
  // copy (the two inputs of an add get the output's gradient): it is then never updated in
  // place; the next accumulation writes a new buffer (copy on write).
  bool grad_shared = false;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

// CPU allocation statistics (what a test reads to bound the peak of an op).
size_t cpu_bytes_in_use();
size_t cpu_peak_bytes();
void cpu_reset_peak();

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape, strides;
  int64_t offset = 0;
  DType dtype = DType::F32;
  // autograd (owned by autograd/)
  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;
  int64_t tape_id = -1;  // index of the producing node in the current tape, -1 for leaves
};

// Seeded random numbers, identical on every platform (no std:: distributions).
// State is one 64-bit word (checkpointable).
struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed = 0) : state(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
  uint64_t next_u64();
  double uniform();                  // [0, 1)
  double normal();                   // standard normal (Box-Muller)
  int64_t randint(int64_t n);        // [0, n)
  std::vector<int32_t> permutation(int n);
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- creation
  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::CPU);
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::CPU);
  static Tensor full(const Shape& shape, double value, DType dtype = DType::F32,
                     Device device = Device::CPU);
  template <class T>
  static Tensor from_vector(const std::vector<T>& v, const Shape& shape, Device device = Device::CPU);
  static Tensor randn(const Shape& shape, Rng& rng, double std = 1.0, DType dtype = DType::F32,
                      Device device = Device::CPU);
  static Tensor rand(const Shape& shape, Rng& rng, double lo = 0.0, double hi = 1.0,
                     DType dtype = DType::F32, Device device = Device::CPU);
  // a contiguous view of memory owned elsewhere (see Storage's borrowing constructor)
  static Tensor wrap(void* data, const Shape& shape, DType dtype, Device device, std::shared_ptr<void> owner);
  // a fresh tensor like x (same shape, dtype, device), uninitialized / zeros
  static Tensor empty_like(const Tensor& x);
  static Tensor zeros_like(const Tensor& x);

  // ---- properties
  bool defined() const { return bool(impl_); }
  const Shape& shape() const { return impl_->shape; }
  const Shape& strides() const { return impl_->strides; }
  int64_t offset() const { return impl_->offset; }
  int dim() const { return int(impl_->shape.size()); }
  int64_t size(int d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(impl_->shape); }
  DType dtype() const { return impl_->dtype; }
  Device device() const { return impl_->storage->device; }
  bool is_cuda() const { return device() == Device::CUDA; }
  bool is_contiguous() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype()); }
  std::string desc() const;  // "f32[4, 7] cpu"

  // Typed pointer to the first element; throws when T does not match the dtype.
  template <class T> T* data() const;
  void* raw() const;

  // ---- raw views and copies (no autograd)
  Tensor view(const Shape& shape) const;  // contiguous only; one dim may be -1
  Tensor reshape(const Shape& shape) const;  // view when contiguous, else a copy
  Tensor permute(const std::vector<int>& dims) const;
  Tensor transpose(int a, int b) const;
  Tensor narrow(int dim, int64_t start, int64_t length) const;
  Tensor expand(const Shape& shape) const;  // broadcast view (stride 0), numpy rules
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;
  void copy_(const Tensor& src);  // same shape; any dtype/device; src may be strided
  void fill_(double value);
  void zero_() { fill_(0.0); }

  // host copies
  template <class T> std::vector<T> to_vector() const;  // converts from any dtype
  double item() const;                                   // numel() == 1

  // ---- autograd state (used by autograd/)
  bool requires_grad() const { return impl_ && impl_->requires_grad; }
  Tensor& requires_grad_(bool on = true) { impl_->requires_grad = on; return *this; }
  Tensor grad() const { return impl_->grad ? Tensor(impl_->grad) : Tensor(); }
  void set_grad(const Tensor& g) { impl_->grad = g.impl_; }

  const std::shared_ptr<TensorImpl>& impl() const { return impl_; }
  bool same(const Tensor& o) const { return impl_ == o.impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// Layout of a tensor for the strided kernels (throws past Layout::kMaxDims).
Layout layout_of(const Tensor& t);
// Broadcast shape of two shapes (numpy rules); throws naming both shapes.
Shape broadcast_shapes(const Shape& a, const Shape& b);

// Throwing precondition with a formatted message: LOOM_CHECK(cond, "expected ...", ...)
[[noreturn]] void throw_error(const char* file, int line, const std::string& msg);
std::string strformat(const char* fmt, ...);
#define LOOM_CHECK(cond, ...) \
  do { if (!(cond)) ::loom::throw_error(__FILE__, __LINE__, ::loom::strformat(__VA_ARGS__)); } while (0)

}  // namespace loom
