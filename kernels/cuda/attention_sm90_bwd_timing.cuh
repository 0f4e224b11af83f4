/*
 * attention_sm90_bwd_timing.cuh: the timing build of attention_sm90_bwd.cu's kernel
 * (-DLOOM_ATTN_BWD_TIMING). The kernel sums clock64 cycles of a block's phases into
 * g_bwd_timing (consumer 0's first thread; the producer's first thread for its own), and
 * bwd_timing_report prints the means after each launch (it synchronizes the stream):
 *   [0] blocks with work, [1] rounds (query tiles x heads), [2] rounds with a mask (consumer 0),
 *   [3] entry -> K, V in shared memory, [4] -> the first Q / dO tile, [5] the round loop,
 *   [6] the end (dQ reductions read, dK / dV stored), [7] waits on a full stage inside the loop,
 *   [8] waits for the turn, [9] the producer's waits on an empty stage, [10] its partial
 *   (cp.async) tiles, [11] its lse / delta loads, [12] the blocks' spans in ns (globaltimer),
 *   [13] the first start, [14] the last end (ns).
 * In the kernel, ATTNB_T(statements) holds the timing code: it compiles to nothing without the
 * define, and both host calls return at once. docs/kernels/attention.md ("The backward's blocks
 * longest first") has what the stamps found.
 */
#pragma once
#include <cstdio>

#include "kernels/cuda/common.cuh"

namespace loom::cuda::attn {
namespace {

#ifdef LOOM_ATTN_BWD_TIMING
__device__ unsigned long long g_bwd_timing[15];
#define ATTNB_T(...) __VA_ARGS__
__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

void bwd_timing_reset(cudaStream_t s) {
  unsigned long long z[15] = {};
  z[13] = ~0ull;  // the first start: a minimum
  CUDA_CHECK(cudaMemcpyToSymbolAsync(g_bwd_timing, z, sizeof z, 0, cudaMemcpyHostToDevice, s));
}

void bwd_timing_report(int hd, int launched, cudaStream_t s) {
  unsigned long long t[15];
  CUDA_CHECK(cudaMemcpyFromSymbolAsync(t, g_bwd_timing, sizeof t, 0, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  const double b = t[0] ? double(t[0]) : 1.0, r = t[1] ? double(t[1]) : 1.0;
  std::fprintf(stderr,
               "attn_bwd timing: hd %d, %d launched / %llu working blocks, %llu rounds (%.1f a block, %.0f%% masked); "
               "cycles a block: to K/V %.0f, to the first tile %.0f, loop %.0f (%.0f a round; full waits %.0f, turn "
               "waits %.0f), end %.0f; producer a block: empty waits %.0f, partial tiles %.0f, lse/delta %.0f; "
               "span %.1f us, blocks' spans %.1f us each, SM fill %.1f%%\n",
               hd, launched, t[0], t[1], r / b, 100.0 * t[2] / r, t[3] / b, t[4] / b, t[5] / b, t[5] / r,
               t[7] / b, t[8] / b, t[6] / b, t[9] / b, t[10] / b, t[11] / b, (t[14] - t[13]) / 1e3, t[12] / b / 1e3,
               100.0 * t[12] / (double(sm_count()) * double(t[14] - t[13])));
}
#else
#define ATTNB_T(...)
void bwd_timing_reset(cudaStream_t) {}
void bwd_timing_report(int, int, cudaStream_t) {}
#endif

}  // namespace
}  // namespace loom::cuda::attn
