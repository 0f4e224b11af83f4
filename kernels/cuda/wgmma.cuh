// wgmma.cuh: the Hopper (sm_90a) primitives of the wgmma attention forwards (attention_sm90.cu,
// the lock-step kernel; attention_sm90_ws.cu, the warp-specialized one): 128-byte-swizzled
// shared tiles and their matrix descriptors, wgmma issue / commit / wait for m64n64k16 and
// m64n128k16 (bf16 in, fp32 accumulate), mbarriers, the named barriers that order
// warpgroups, TMA loads, and the tile pieces both forwards share (rows outside every sequence,
// one key tile of the online softmax, the output epilogue). Compiled only into sm_90a code (the callers guard their bodies with
// __CUDA_ARCH_FEAT_SM90_ALL).
#pragma once
#include <cuda.h>  // CUtensorMap (the TMA descriptor type; no driver library is linked)

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention_tiles.cuh"

namespace loom::cuda::attn {
namespace {

// Element offset of (row r, 16-byte chunk c) in an R-row tile stored as 64-column halves with
// the 128-byte swizzle (chunk c & 7 of row r lands at chunk (c & 7) ^ (r & 7)).
template <int R>
__device__ __forceinline__ int sw128(int r, int c) {
  return (c >> 3) * (R * 64) + r * 64 + (((c & 7) ^ (r & 7)) << 3);
}
// Rows [0, R) of a global [*, HD] matrix (row stride `stride`) into an sw128 tile; rows >=
// nvalid zero-filled.
template <int HD, int R, int NT>
__device__ __forceinline__ void load_tile_sw128(bf* s, const bf* src, int64_t stride, int nvalid) {
  constexpr int NC = HD / 8;
  for (int idx = threadIdx.x; idx < R * NC; idx += NT) {
    const int r = idx / NC, c = idx % NC;
    const bool ok = r < nvalid;
    cp_async16(s + sw128<R>(r, c), ok ? src + r * stride + c * 8 : src, ok);
  }
}
// Shared-memory matrix descriptor, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t sdesc(const bf* p, uint32_t lbo_bytes) {
  const uint64_t a = smem_addr(p);
  return ((a & 0x3FFFF) >> 4) | (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16) | (uint64_t(1024 >> 4) << 32) |
         (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N of this warpgroup's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Orders a wgmma wait after the instructions that compute v. wgmma.wait_group has no register
// operands, and ptxas's scheduler hoists it into the first stall of whatever follows the issue
// (so a consumer would wait for its products before its softmax instead of during it); it does
// keep a shared-memory store before the wait, so storing a value that depends on the work
// (the row sums depend on every exponential) pins that work ahead of it. slot: a word of
// shared memory of this thread's own, never read.
__device__ __forceinline__ void order_before_wait(float* slot, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(smem_addr(slot)), "f"(v) : "memory");
}
// cp.async writes are generic-proxy writes; wgmma reads through the async proxy.
__device__ __forceinline__ void fence_smem_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Ties registers a wgmma uses asynchronously to this point. Accumulators (float): the compiler
// reads them only after the wait (the wgmma asm "writes" them at issue, the hardware before the
// wait returns). A fragments (uint32_t): the compiler keeps them, and does not reuse their
// registers, until after the wait.
template <class T, int N>
__device__ __forceinline__ void fence_regs(T (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; i++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      if constexpr (std::is_same<T, float>::value) asm volatile("" : "+f"(d[i][e])::"memory");
      else asm volatile("" : "+r"(d[i][e])::"memory");
    }
}

// D[64 x N] (+)= A[64 x 16] B[16 x N]. wgmma_ss: A and B from shared memory; accumulate 0
// overwrites D. wgmma_rs: A from registers in mma.sync's A-fragment layout (warp w of the
// warpgroup holds rows 16w..16w+15). TB = 0: B is K-major ([N][K] rows), 1: MN-major.
// N = 8 x the first extent of d (16, 32, 64, 80 or 128).
// TA = 1 (wgmma_ss only): A is MN-major too, stored [K][M] (the backward's dQ = dS K reads
// dS from its transposed [keys][queries] tile).
template <int TB, int TA = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[8][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, %36, %35;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(da), "l"(db), "r"(accumulate), "n"(TB), "n"(TA));
}
// m64n32k16, both operands from shared memory (the hd 64 backward's half of dQ).
template <int TB, int TA = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[4][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
      "%16, %17, p, 1, 1, %20, %19;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(da), "l"(db), "r"(accumulate), "n"(TB), "n"(TA));
}
// m64n16k16, both operands from shared memory (the whole-sequence forward's short last key
// tile: 16 keys of S = Q K^T).
template <int TB, int TA = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[2][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7}, "
      "%8, %9, p, 1, 1, %12, %11;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
      : "l"(da), "l"(db), "r"(accumulate), "n"(TB), "n"(TA));
}
// m64n80k16, both operands from shared memory (the whole-sequence forward's last two key tiles
// as one when the last holds at most 16 keys: 196 tokens' keys 128-195 as 80 of S = Q K^T).
template <int TB, int TA = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[10][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, "
      "%40, %41, p, 1, 1, %44, %43;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3])
      : "l"(da), "l"(db), "r"(accumulate), "n"(TB), "n"(TA));
}
template <int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB), "r"(1));
}
template <int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[16][4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, %67;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(da), "l"(db), "r"(accumulate), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(TB), "r"(1));
}

// ------------------------------------------------------------------------ mbarriers
// An mbarrier in shared memory counts arrivals; a phase completes when `count` arrivals have
// come, and its parity flips. A waiter names the parity of the phase it waits for (0 for the
// first use, 1 for the second, ...), so the same barrier serves every round of a ring buffer.
// The first 1024-byte aligned byte of the dynamic shared memory (TMA's 128-byte swizzle and the
// wgmma descriptors need it). The array itself is offset, instead of its address being rounded
// as an integer: a pointer that went through uintptr_t is no longer known to be in shared
// memory, and every access through it became a generic LD / ST with 64-bit address arithmetic
// (the backward's consumers spent 16 generic loads, 24 generic stores and ~60 address
// instructions per query tile on lse, delta and dS^T that way; with this, fwd+bwd on the SPEC
// shapes 0.358 / 1.381 / 0.270 -> 0.355 / 1.360 / 0.263 ms, H100, same call, 2026-11-24).
__device__ __forceinline__ unsigned char* smem_align1024(unsigned char* raw) {
  return raw + ((1024u - (smem_addr(raw) & 1023u)) & 1023u);
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
#ifdef LOOM_MBAR_WATCHDOG  // a debugging build (-DLOOM_MBAR_WATCHDOG): report a wait that never ends
  uint32_t spins = 0;
#endif
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
#ifdef LOOM_MBAR_WATCHDOG
    if (!done && ++spins == (1u << 20))
      printf("mbar_wait: block %d thread %d waits at shared 0x%x for parity %u\n", int(blockIdx.x), int(threadIdx.x),
             smem_addr(bar), parity);
#endif
  }
}
// The next phase of `bar` also waits for `bytes` bytes of asynchronous (TMA) copies; this
// thread's arrival is one of the barrier's count.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// TMA: the box at element coordinates (c0, c1, c2) of the tensor map (innermost first) into
// shared memory at dst, laid out as the map's swizzle says; the bytes count toward `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}
// TMA reduction: adds the box at shared src, laid out as the map's swizzle says, into global
// memory at element coordinates (c0, c1, c2) (fp32 add, elementwise atomic; rows past the
// tensor are dropped). An async bulk group: commit it, and wait for it before src is rewritten.
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, int c0, int c1, int c2, const void* src) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// TMA store: the box at shared src, laid out as the map's swizzle says, to global memory at
// element coordinates (c0, c1, c2) (rows and columns past the tensor are not written). An async
// bulk group, as tma_reduce_add_3d.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, int c0, int c1, int c2, const void* src) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// this thread's bulk groups: all but the newest N have read their shared memory source
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// ... and have completed (their writes to global memory are done)
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// Named barriers 1..15 (0 is __syncthreads): `threads` threads take part, those that sync
// wait for the rest, those that arrive do not wait.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ------------------------------------------------------------------------ forward tile pieces
// What both wgmma forwards do the same way. A warpgroup's 64 x N accumulator has mma.sync's C
// layout per warp: thread (g = lane / 4, t = lane % 4) of warp w holds rows 16w + g (c0, c1)
// and 16w + g + 8 (c2, c3), columns 8n + 2t and + 1 of n-tile n.

// A block's sequence bounds and the bounds of all sequences, loaded at once: a block's first
// global loads are on its critical path (its tiles' loads need them), and they took two round
// trips before (the bounds of all sequences, then the block's own after the branch that tests
// them). With this and the tensor maps' prefetch, a B8 H12 T1024 hd 64 forward block of ~30k
// cycles issues its Q load 2.0k cycles after its start instead of 2.3k (per-block clock
// stamps, H100, 2026-11-25; attention_sm90_ws.cu's header, item 7).
struct SeqBounds {
  int q0, Lq, k0, Lk, lo, hi;  // lo, hi: cu_q[0], cu_q[nseq]
};
// dense > 0: a dense batch (attention_tiles.cuh's dense_seqlen), every sequence `dense` rows
// long, whose bounds follow from seq with no load at all.
__device__ __forceinline__ SeqBounds seq_bounds(const int32_t* cu_q, const int32_t* cu_k, int seq, int nseq,
                                                int dense) {
  if (dense > 0) return {seq * dense, dense, seq * dense, dense, 0, nseq * dense};
  const int a = cu_q[seq], b = cu_q[seq + 1], c = cu_k[seq], d = cu_k[seq + 1], lo = cu_q[0], hi = cu_q[nseq];
  return {a, b - a, c, d - c, lo, hi};
}
// Fetches a TMA descriptor (a __grid_constant__ kernel parameter) ahead of its first use.
__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* m) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(m)) : "memory");
}

// Rows outside every sequence, [0, cu_q[0]) and [cu_q[nseq], Nq), get out = 0 and lse = +inf
// (usually there are none). Every block of the grid takes a strided share of them over all heads
// before its own tile (and before its early exits): no second launch and no extra grid slice.
// An extra z-slice of H x tiles blocks did this before; each of them held a whole
// multiprocessor's shared memory for a moment at the end of the grid, 72 such blocks at
// B8 H12 T1024 hd 64 and 256 at B8 H16 T2048 hd 128. NT: threads per block. lo, hi: cu_q[0] and
// cu_q[nseq], which the caller loads together with its own sequence's bounds (SeqBounds).
template <int HD, int NT>
__device__ __forceinline__ void zero_rows_outside(bf* out, float* lse, int64_t lo, int64_t hi, int64_t Nq, int H) {
  const int64_t n_out = lo + (Nq - hi);
  if (n_out == 0) return;
  constexpr int NCH = HD / 8;  // 16-byte chunks per row
  const int64_t nb = int64_t(gridDim.x) * gridDim.y * gridDim.z;
  const int64_t b = blockIdx.x + int64_t(gridDim.x) * (blockIdx.y + int64_t(gridDim.y) * blockIdx.z);
  for (int64_t i = b * NT + threadIdx.x; i < n_out * H * NCH; i += nb * NT) {
    const int64_t jh = i / NCH, j = jh / H, h = jh % H, row = j < lo ? j : hi + (j - lo);
    const int c = int(i % NCH);
    *reinterpret_cast<uint4*>(out + (row * H + h) * HD + c * 8) = make_uint4(0u, 0u, 0u, 0u);
    if (c == 0) lse[row * H + h] = INFINITY;
  }
}

// One key tile of the online softmax, in the log2 domain (attention.cu's header): S (64 x BC,
// keys kb..) is masked where masked (keys past Lk; causal: key > row + shift; row0 is this
// thread's first row in the sequence) and becomes exp2(S scale - m) in place; mrow becomes the
// new running maximum, corr the factor for what was accumulated before and sum this tile's
// row sums (each thread's part; the quad t = 0..3 shares a row). The caller rescales O and l.
template <int BC>
__device__ __forceinline__ void online_softmax_tile(float (&s)[BC / 8][4], bool masked, int kb, int Lk, bool causal,
                                                    int row0, int shift, int t, float scale_log2, float (&mrow)[2],
                                                    float (&corr)[2], float (&sum)[2]) {
  if (masked) {
#pragma unroll
    for (int nt = 0; nt < BC / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int col = kb + nt * 8 + 2 * t + (e & 1), row = row0 + (e >> 1) * 8;
        if (col >= Lk || (causal && col > row + shift)) s[nt][e] = -INFINITY;
      }
  }
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < BC / 8; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(mrow[r], mx * scale_log2);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row that saw nothing yet
    corr[r] = exp2_ftz(mrow[r] - m_use);
    mrow[r] = m_new;
    sum[r] = 0.f;
#pragma unroll
    for (int nt = 0; nt < BC / 8; nt++) {
      s[nt][2 * r] = exp2_ftz(fmaf(s[nt][2 * r], scale_log2, -m_use));
      s[nt][2 * r + 1] = exp2_ftz(fmaf(s[nt][2 * r + 1], scale_log2, -m_use));
      sum[r] += s[nt][2 * r] + s[nt][2 * r + 1];
    }
  }
}

// The end of a warpgroup's rows: out = O / l and lse = (m + log2 l) ln 2 (+inf for a row that
// saw no key), for the rows that lie in the sequence. Each warp stages its 16 rows in its own
// rows of the block's sw128 Q tile sQ (BR rows; the warpgroup's products that read them are
// done), then stores them 16 bytes per lane. wr: the warpgroup's first row in the block's tile,
// qs: the tile's first row in the sequence, nq: the tile's rows in the sequence, obase: out at
// the tile's first row and this head.
template <int HD, int BR>
__device__ __forceinline__ void store_out_rows(bf* obase, float* lse_seq, bf* sQ, const float (&o)[HD / 8][4],
                                               const float (&mrow)[2], const float (&lrow)[2], int wr, int qs,
                                               int nq, int Lq, int64_t qstride, int H) {
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float l = lrow[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[r] = l > 0.f ? 1.f / l : 0.f;
    const int row = qs + wr + warp * 16 + g + 8 * r;
    if (t == 0 && row < Lq) lse_seq[int64_t(row) * H] = l > 0.f ? (mrow[r] + log2f(l)) * kLn2 : INFINITY;
  }
  const int r0 = wr + warp * 16;
#pragma unroll
  for (int dt = 0; dt < HD / 8; dt++)
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int row = r0 + g + 8 * r;
      *reinterpret_cast<uint32_t*>(sQ + sw128<BR>(row, dt) + 2 * t) =
          pack_bf16(o[dt][2 * r] * inv[r], o[dt][2 * r + 1] * inv[r]);
    }
  __syncwarp();
  constexpr int NCH = HD / 8;
  for (int idx = lane; idx < 16 * NCH; idx += 32) {
    const int r = idx / NCH, ch = idx % NCH;
    if (r0 + r < nq)
      *reinterpret_cast<uint4*>(obase + int64_t(r0 + r) * qstride + ch * 8) =
          *reinterpret_cast<const uint4*>(sQ + sw128<BR>(r0 + r, ch));
  }
}

}  // namespace

// A TMA descriptor of a [rows, heads, hd] bf16 tensor (row-major, as attention takes q, k, v,
// out and dout) read in boxes of 64 head-dim columns x one head x box_rows rows, 128-byte
// swizzle: each box lands as one 64-column half of an sw128 tile (attention_sm90_ws.cu).
CUtensorMap make_map(const bf* base, int64_t rows, int heads, int hd, int box_rows);
// The same for bf16 or fp32 elements with boxes of box_cols columns (128-byte swizzle: box_cols
// x element size <= 128 bytes).
CUtensorMap make_map_3d(const void* base, bool f32, int64_t rows, int heads, int hd, int box_cols, int box_rows);

}  // namespace loom::cuda::attn
