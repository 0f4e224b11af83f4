// optim_test_util.h: the shapes and helpers test_optim.cpp and test_optim_ema.cpp share.
#pragma once
#include <type_traits>

#include "tensor/tensor.h"
#include "tests/tolerances.h"

namespace loom::optim_test {

constexpr int N = 3, I = 7, O = 5;  // rows, in features, out features: no multiple of anything

// The tolerance of a T computation against the f64 reference.
template <class T> tol::Tol tol_of() { return std::is_same_v<T, double> ? tol::kSameMathF64 : tol::kCpuF32; }

// a batch of inputs [N, I] in T
template <class T> Tensor rand_x(Rng& rng) { return Tensor::randn({N, I}, rng, 1.0, dtype_of<T>()); }

}  // namespace loom::optim_test
