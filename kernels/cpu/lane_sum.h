// lane_sum.h: a row's sum in a fixed order that vectorizes.
//
// A loop `s += f(c)` is a chain: each add waits for the one before (3-4 cycles on current x86
// cores), and without -ffast-math the compiler may not reorder it, so a 64-wide row costs ~250
// cycles in adds alone. lane_sum keeps kLanes running sums instead: element c goes into lane
// c % kLanes, and the lanes are added pairwise at the end,
//   ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
// The lanes are independent, so the compiler holds them in one vector register (two for
// double on AVX2) and the loop runs at the speed of its loads. The order depends on C only:
// the same bits on every run and every thread count; other bits than the one running sum's
// (test_cpu_norms checks the results against the f64 reference within its tolerances).
#pragma once

namespace loom::cpu {

constexpr int kLanes = 8;

// sum over c in [0, C) of f(c), f(c) of type A
template <class A, class F>
inline A lane_sum(int C, F&& f) {
  A lane[kLanes] = {};
  int c = 0;
  for (; c + kLanes <= C; c += kLanes) {
#pragma GCC unroll 8
    for (int l = 0; l < kLanes; l++) lane[l] += f(c + l);
  }
  for (int l = 0; c + l < C; l++) lane[l] += f(c + l);  // the tail: element c + l is in lane l
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

}  // namespace loom::cpu
