// attention_tiles.cuh: the tile primitives the tensor-core attention kernels share
// (attention_fwd.cu, attention_bwd.cu, attention_bwd_single.cu, attention_sm90.cu): cp.async
// staging into XOR-swizzled shared memory, ldmatrix fragments, mma.sync m16n8k16 (bf16 in,
// fp32 accumulate), the C -> A fragment repack that keeps the score tile in registers, the
// per-tile pieces the two backward schedules share, and the host entry points of each file.
// See attention.cu's header for the algorithm, the reading order and the measured versions.
#pragma once
#include <algorithm>
#include <cstdlib>
#include <functional>

#include "kernels/cuda/common.cuh"

namespace loom::cuda::attn {

using bf = __nv_bfloat16;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// 2^x on the SFU with denormal results flushed to 0 (ex2.approx.ftz). exp2f is the same MUFU.EX2
// wrapped in a compare and two multiplies that keep results below 2^-126 as denormals: three
// more instructions per score for values a softmax adds to a sum of at least 1. The
// warp-specialized forward's profile (H100) counted 765 instructions per thread per key tile
// of which 198 were these fix-ups. Used by the wgmma forwards; the mma.sync kernels keep exp2f
// (with this one ptxas spilled a few registers in two of their instantiations).
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// smem_addr, cp_async16, cp_async_commit, cp_async_wait: common.cuh (the norm backward uses them too)
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
// c[16x8] += a[16x16] b[16x8], bf16 inputs, fp32 accumulators (thread: rows lane/4 and +8,
// columns 2 (lane%4) and +1 of c).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low half: the lower column
  return *reinterpret_cast<uint32_t*>(&v);
}

// Block -> (tile, pair) for the kernels whose blocks each own one tile of one pair: a
// (head, sequence) pair and a query tile in the forwards, a (kv head, sequence) pair and a key
// tile in the backwards. The pairs go in chunks of `chunk` whose rows share L2 (host:
// chunk_pairs), and inside a chunk tile 0 of every pair runs first, then tile 1, ... The
// caller numbers the tiles so that tile 0 is the longest (causal: the forward's last query
// tile, the backward's first key tile), so that over the whole grid the long blocks start first
// and the short ones fill the tail. Numbering per pair instead (every tile of pair 0, then
// pair 1, ...; chunk = 1) leaves the causal forward's last waves half empty: B4 H9 T2048 hd 64
// (396 blocks of 1..11 tiles on 132 SMs) took 0.081 ms that way and 0.068 in this order (H100).
struct BlockTile {
  int tile, pair;
};
__device__ __forceinline__ BlockTile block_tile(int b, int ntiles, int npairs, int chunk) {
  const int per_chunk = chunk * ntiles, c = b / per_chunk, within = b % per_chunk;
  const int pc = min(chunk, npairs - c * chunk);  // the last chunk may hold fewer pairs
  return {within / pc, c * chunk + within % pc};
}
// A dense batch: one cu_seqlens for queries and keys and Nq = Nk = nseq * max_seqlen. The
// contract of attention_forward (kernels.inc) makes every sequence of such a batch max_seqlen
// long, sequence i rows [i S, (i + 1) S) (the CPU reference checks it), so the kernels need
// not read the offsets: cuDNN's dense graph, and the wgmma kernels' bounds (dense_seqlen).
inline bool dense_batch(const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk) {
  return cu_q == cu_k && Nq == Nk && Nq == int64_t(nseq) * max_seqlen;
}
// The sequence length the wgmma kernels take as `dense` (their bounds from the block's
// sequence index, no load before the first TMA; seq_bounds in wgmma.cuh): max_seqlen for a
// dense batch, 0 otherwise. LOOM_ATTN_DENSE=0 gives 0 always (read at every call: the tests
// run both paths).
inline int dense_seqlen(const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk) {
  const char* e = std::getenv("LOOM_ATTN_DENSE");
  if (e && e[0] == '0' && e[1] == 0) return 0;
  return dense_batch(cu_q, cu_k, nseq, max_seqlen, Nq, Nk) ? max_seqlen : 0;
}

// Pairs per chunk for block_tile: chunks whose shared rows (pair_bytes each) take about 32 MB
// (H100 / H200 L2: 50 MB), split evenly so that the last chunk is not a small tail.
// LOOM_ATTN_CHUNK_PAIRS=n sets n (read at every call: tests run both; =1 is the per-pair order).
inline int chunk_pairs(int npairs, double pair_bytes) {
  if (npairs <= 0) return 1;
  if (const char* e = std::getenv("LOOM_ATTN_CHUNK_PAIRS")) return std::max(1, std::min(npairs, std::atoi(e)));
  const int fit = pair_bytes > 0 ? std::max(1, int(32.0 * 1024 * 1024 / pair_bytes)) : npairs;
  return ceil_div(npairs, ceil_div(npairs, std::max(1, fit)));
}

// The warp-specialized forward's block -> (first query row, head, sequence): block_tile over
// the grid (query tiles, H, sequences) read as one linear index (x fastest), pairs (head,
// sequence) with the heads of one kv head side by side (host: chunk_pairs of the K / V rows a
// head reads). Causal: tile 0 is the sequence's last query tile (it sees the most keys);
// bidirectional: every whole tile costs the same and tile 0 is the first, so that the
// sequences' partial last tiles (fewer rows, less work) run in the tail. Every pair's partial
// last tile after all the whole tiles of the grid instead measured the same (B8 H12 T1024 hd 64
// 0.087-0.089 against 0.088-0.090 ms; T1100 and hd 128 T2000 within 1%; H100, 2026-11-24). (The
// lock-step and mma.sync forwards keep blockIdx's order, longest tile of each head first: the
// decoding's live registers made ptxas spill 48 / 116 bytes in two of their instantiations.)
struct FwdTile {
  int qs, h, seq;
};
__device__ __forceinline__ FwdTile fwd_tile(int BR, int H, int nseq, int chunk, bool causal) {
  const int nt = int(gridDim.x), b = int(blockIdx.x) + nt * (int(blockIdx.y) + int(gridDim.y) * int(blockIdx.z));
  const BlockTile bt = block_tile(b, nt, H * nseq, chunk);
  return {(causal ? nt - 1 - bt.tile : bt.tile) * BR, bt.pair % H, bt.pair / H};
}
// Causal: chunks of heads whose K / V rows (bf16) take ~32 MB. Bidirectional: one pair per
// chunk, i.e. each head's tiles side by side, reading the same K / V tiles at the same time: all
// its tiles cost the same, so there is no long block to start first, and spreading the running
// blocks over all heads made B8 H12 T1024 hd 128 slower (0.120 vs 0.114 ms, H100,
// 2026-11-24), while the causal shapes gained 2-17% (B4 H9 T2048 hd 64: 0.081 -> 0.068 ms).
inline int fwd_chunk_pairs(int H, int KV, int nseq, int max_seqlen, int hd, bool causal) {
  const double kv_bytes = double(std::max(max_seqlen, 1)) * hd * 4.0 / (H / KV);
  return chunk_pairs(H * nseq, causal ? kv_bytes : 1e300);
}

// Element offset of (row r, 16-byte chunk c) in a [rows, HD] bf16 tile. The chunk index is
// XORed with the row's position inside a 128-byte line group so that the 8 rows one ldmatrix
// reads fall in 8 different bank groups (no conflicts) for every HD in 16..128.
template <int HD>
__device__ __forceinline__ int swz(int r, int c) {
  constexpr int NC = HD / 8, NCS = NC < 8 ? NC : 8, RPL = 8 / NCS;
  return r * HD + ((c ^ ((r / RPL) & (NCS - 1))) * 8);
}
// Pointer an ldmatrix lane passes: row r, column col (a multiple of 8).
template <int HD>
__device__ __forceinline__ const bf* at(const bf* s, int r, int col) {
  return s + swz<HD>(r, col / 8);
}

// Rows [0, R) of a global matrix (row r at src + r * stride) into a swizzled tile; rows >=
// nvalid are zero-filled (so masked keys multiply finite zeros, never stale NaN).
template <int HD, int R, int NT>
__device__ __forceinline__ void load_tile(bf* s, const bf* src, int64_t stride, int nvalid) {
  constexpr int NC = HD / 8;
  for (int idx = threadIdx.x; idx < R * NC; idx += NT) {
    const int r = idx / NC, c = idx % NC;
    const bool ok = r < nvalid;
    cp_async16(s + swz<HD>(r, c), ok ? src + r * stride + c * 8 : src, ok);
  }
}
// A-operand fragment (16 rows from r0, k columns k0..k0+15) of a row-major tile.
template <int HD>
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const bf* s, int r0, int k0, int lane) {
  ldsm_x4(a, at<HD>(s, r0 + (lane & 7) + ((lane >> 3) & 1) * 8, k0 + (lane >> 4) * 8));
}
// B-operand fragments of two n-tiles (n0, n0+8) for k-step k0, from a tile whose rows are
// the n dimension (K in S = Q K^T): b[0..1] n-tile n0, b[2..3] n-tile n0+8.
template <int HD>
__device__ __forceinline__ void frag_b_rows_n(uint32_t (&b)[4], const bf* s, int n0, int k0, int lane) {
  ldsm_x4(b, at<HD>(s, n0 + (lane & 7) + (lane >> 4) * 8, k0 + ((lane >> 3) & 1) * 8));
}
// Same, from a tile whose rows are the k dimension (V in O = P V), transposed on load.
template <int HD>
__device__ __forceinline__ void frag_b_rows_k(uint32_t (&b)[4], const bf* s, int k0, int n0, int lane) {
  ldsm_x4_t(b, at<HD>(s, k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8));
}
// The C fragments of n-tiles 2kk, 2kk+1 (16 x 16 fp32) as the A fragment of the next product.
template <int N>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c)[N][4], int kk) {
  a[0] = pack_bf16(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack_bf16(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack_bf16(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack_bf16(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}
// Writes the warp's 16 rows of acc (C layout) into rows r0.. of a swizzled tile, then copies
// them to global (row r at dst + r * stride) for rows < nvalid, 16 bytes per lane.
template <int HD>
__device__ __forceinline__ void store_rows(bf* s, int r0, const float (&acc)[HD / 8][4], float mul,
                                           bf* dst, int64_t stride, int nvalid, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int dt = 0; dt < HD / 8; dt++) {
    const int col = dt * 8 + 2 * t;
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const int row = r0 + g + 8 * r;
      *reinterpret_cast<uint32_t*>(s + swz<HD>(row, col / 8) + (col & 7)) =
          pack_bf16(acc[dt][2 * r] * mul, acc[dt][2 * r + 1] * mul);
    }
  }
  __syncwarp();
  constexpr int NC = HD / 8;
  for (int idx = lane; idx < 16 * NC; idx += 32) {
    const int r = idx / NC, c = idx % NC;
    if (r0 + r < nvalid)
      *reinterpret_cast<uint4*>(dst + int64_t(r0 + r) * stride + c * 8) =
          *reinterpret_cast<const uint4*>(s + swz<HD>(r0 + r, c));
  }
}

// Host entry points of attention_cudnn.cu (the cuDNN backend and the train.attention choice).
// Return true when the call ran on cuDNN; false leaves it to our kernels. run_loom runs the
// call on our kernels (the `auto` probe times it against cuDNN the first time a shape is seen).
template <class T>
bool cudnn_attention_forward(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* cu_q,
                             const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV,
                             int hd, bool causal, double scale, cudaStream_t s, const std::function<void()>& run_loom);
template <class T>
bool cudnn_attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const T* out,
                              const float* lse, float* ws, const int32_t* cu_q, const int32_t* cu_k, int nseq,
                              int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd, bool causal, double scale,
                              cudaStream_t s, const std::function<void()>& run_loom);
// The bf16 backward of attention_backward_qkv without RoPE on cuDNN: dq | dk | dv written straight
// into the joined rows dqkv [N, (H + 2 KV) hd] by a dense plan with strided gradients. Runs (true)
// only where cuDNN takes the call anyway (train.attention = cudnn, or auto's choice for its dense
// bucket) and the batch is dense; false leaves the call to the caller.
bool cudnn_attention_backward_rows(bf* dqkv, const bf* dout, const bf* q, const bf* k, const bf* v, const bf* out,
                                   const float* lse, float* ws, const int32_t* cu, int nseq, int max_seqlen, int64_t N,
                                   int H, int KV, int hd, bool causal, double scale, cudaStream_t s);
// Under train.attention = auto, the choice already made for the bucket of a bf16 call: 1 cuDNN,
// 0 loom's kernels (also for a case cuDNN cannot run, and without cuDNN), -1 not probed yet.
// attention_backward_qkv asks it: its joined path runs where the choice is loom's kernels.
int cudnn_auto_choice(bool backward, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd,
                      bool causal, bool dense);

// Host entry points of attention_sm90.cu (the wgmma forwards). available: built for sm_90a
// (LOOM_SM90A), running on a compute-capability 9.0 device, hd 64 or 128, and not turned off
// with LOOM_ATTN_SM90=0. fwd_sm90 runs the warp-specialized kernel (attention_sm90_ws.cu,
// fwd_sm90_ws) unless LOOM_ATTN_SM90=1 selects the lock-step one.
bool fwd_sm90_available(int hd);
// Writes every row of out and lse (rows outside every sequence: 0 and +inf). nseq, max_seqlen > 0.
void fwd_sm90(bf* out, float* lse, const bf* q, const bf* k, const bf* v, const int32_t* cu_q,
              const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd,
              bool causal, float scale_log2, cudaStream_t s);
// attention_sm90_ws.cu (its TMA loads need 16-byte aligned q, k, v)
bool fwd_sm90_ws_supported(const void* q, const void* k, const void* v);
void fwd_sm90_ws(bf* out, float* lse, const bf* q, const bf* k, const bf* v, const int32_t* cu_q,
                 const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd,
                 bool causal, float scale_log2, cudaStream_t s);

// attention_sm90_bwd.cu: the warp-specialized wgmma backward's middle launch (dk, dv =,
// dq_acc +=; attention_bwd_single.cu runs the launches before and after it). available: the
// wgmma forwards are (fwd_sm90_available), the longest sequence has at least 128 tokens (512
// for causal hd 64; LOOM_ATTN_BWD_WS_MIN overrides), both row counts are > 0 and q, k, v,
// dout and the dq_acc workspace are 16-byte aligned (else the mma.sync single pass runs).
bool bwd_sm90_ws_available(int hd, bool causal, int max_seqlen, int64_t Nq, int64_t Nk, const void* q, const void* k,
                           const void* v, const void* dout, const void* dq_acc);
// The warp-specialized backward's block order for a batch of unequal sequences: its blocks
// (128 keys of one kv head and one sequence) take the (sequence, key tile) items longest first,
// by their query-tile rounds, so that the long blocks start in the first wave and the short ones
// fill the tail (the chunked order of block_tile left 26% of the multiprocessors' time idle on
// the PyTorch reference's packed VLM batch, bench/RESULTS.md 2026-12-01 second). The host plans
// it (bwd_sm90_order: allocates `order`, or returns an empty plan where block_tile's order
// stays: dense batches (dense_seqlen; with LOOM_ATTN_DENSE=0 they take the plan too), one
// sequence, LOOM_ATTN_BWD_ORDER=0, more than kBwdOrderMaxItems items or kBwdOrderMaxBuckets
// buckets); attn_bwd_prep's last block builds it (build_bwd_order), bwd_sm90_ws reads it, the
// caller frees `order` after.
constexpr int kBwdWsBC = 128, kBwdWsBR = 64;  // the warp-specialized backward's key / query tiles
struct BwdOrder {
  int32_t* order = nullptr;  // [nseq * n_kt] items seq * n_kt + key tile; null: no plan
  const int32_t* cu_q = nullptr;
  const int32_t* cu_k = nullptr;
  int nseq = 0, n_kt = 0, nbuckets = 0;  // buckets: query-tile counts 0 .. nbuckets - 1
  bool causal = false;
};
constexpr int kBwdOrderMaxBuckets = 1024, kBwdOrderMaxItems = 16384;
// The query tiles (kBwdWsBR rows) a block of keys from ks meets in one head: from the first query
// that sees key ks (causal, bottom-right: shift Lk - Lq) to the sequence's end. The backward's
// block walks these; the order counts them.
struct QueryTiles {
  int t_min, n_qt;
};
__device__ __forceinline__ QueryTiles bwd_query_tiles(int ks, int Lq, int Lk, bool causal) {
  const int t_min = causal ? max(0, ks - (Lk - Lq)) : 0;
  return {t_min, t_min < Lq ? (Lq - t_min + kBwdWsBR - 1) / kBwdWsBR : 0};
}
BwdOrder bwd_sm90_order(const int32_t* cu_q, const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk,
                        bool causal);
// One block (any size up to 1024 threads) sorts the items by descending rounds: a count per
// round number (items past their sequence's keys last), the counts' prefix sums, then each
// item at its bucket's next place (atomics: items of equal rounds land in any order, which
// changes no result, since every item's dk and dv come from one block and dq's additions are
// unordered anyway).
__device__ __forceinline__ int bwd_order_key(const BwdOrder& o, int item) {
  const int seq = item / o.n_kt, ks = (item % o.n_kt) * kBwdWsBC;
  const int Lq = o.cu_q[seq + 1] - o.cu_q[seq], Lk = o.cu_k[seq + 1] - o.cu_k[seq];
  if (ks >= Lk) return o.nbuckets;  // no keys: the block leaves at once
  return o.nbuckets - 1 - min(bwd_query_tiles(ks, Lq, Lk, o.causal).n_qt, o.nbuckets - 1);
}
__device__ __forceinline__ void build_bwd_order(const BwdOrder& o) {
  __shared__ int pos[kBwdOrderMaxBuckets + 1];
  __shared__ int part[1024];
  const int tid = int(threadIdx.x), nt = int(blockDim.x), nb = o.nbuckets + 1, items = o.nseq * o.n_kt;
  for (int b = tid; b < nb; b += nt) pos[b] = 0;
  __syncthreads();
  for (int i = tid; i < items; i += nt) atomicAdd(&pos[bwd_order_key(o, i)], 1);
  __syncthreads();
  const int per = (nb + nt - 1) / nt, lo = min(nb, tid * per), hi = min(nb, lo + per);
  int sum = 0;
  for (int b = lo; b < hi; b++) sum += pos[b];
  part[tid] = sum;
  __syncthreads();
  for (int off = 1; off < nt; off *= 2) {  // inclusive scan of the threads' sums
    const int add = tid >= off ? part[tid - off] : 0;
    __syncthreads();
    part[tid] += add;
    __syncthreads();
  }
  int run = tid ? part[tid - 1] : 0;
  for (int b = lo; b < hi; b++) {
    const int c = pos[b];
    pos[b] = run;
    run += c;
  }
  __syncthreads();
  for (int i = tid; i < items; i += nt) o.order[atomicAdd(&pos[bwd_order_key(o, i)], 1)] = i;
}
// The gradients of a joined q|k|v product (attention_backward_qkv, hd 64): dk and dv go into
// the rows of dqkv [N, (H + 2 KV) 64] (row stride `stride`; 0: dk and dv as attention_backward
// writes them). With pos (the LM's RoPE) dk is rotated by -angle at positions pos, with
// rope_table.h's table (rows < table_rows) or, past it, the double formula; without (a ViT's
// joined product) it is stored as it is.
struct QkvRope {
  const int32_t* pos = nullptr;  // null: no rotation
  const float2* table = nullptr;
  int table_rows = 0;
  double log_theta = 0;
  int64_t stride = 0;
};
void bwd_sm90_ws(bf* dk, bf* dv, float* dq_acc, const bf* dout, const bf* q, const bf* k, const bf* v,
                 const float* lse, const float* delta, const int32_t* cu_q, const int32_t* cu_k, int nseq,
                 int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd, bool causal, float scale,
                 cudaStream_t s, const QkvRope& rope = QkvRope(), const int32_t* order = nullptr);
// attention_bwd_single.cu: the backward with dq, dk, dv written into dqkv's rows (with pos: dq
// and dk rotated by -angle), for q, k, v of one joined product (Nq == Nk == N, one cu_seqlens).
// Only where bwd_qkv_joined_available holds: bf16 q, k, v, dout, hd 64, and either the
// warp-specialized backward (bwd_sm90_ws_available) or, without pos, a dense batch of one key
// tile a sequence (<= 64 tokens: the persistent attn_bwd_one_tile, storing dq itself).
bool bwd_qkv_joined_available(int hd, bool causal, int nseq, int max_seqlen, int64_t N, const int32_t* cu,
                              const int32_t* pos, const void* q, const void* k, const void* v, const void* dout,
                              const void* dq_acc, const void* dqkv);
void bwd_qkv_joined(bf* dqkv, float* dq_acc, float* delta, const bf* dout, const bf* out, const bf* q, const bf* k,
                    const bf* v, const float* lse, const int32_t* cu, const int32_t* pos, int nseq, int max_seqlen,
                    int64_t N, int H, int KV, bool causal, float scale, double theta, cudaStream_t s);

// ---- single-pass backward (attention_bwd_single.cu, attn_bwd_v2_atomic_dq)
// Stores four 8x8 bf16 matrices transposed: register r[i] holds matrix i in the mma C layout
// (lane: row lane/4, columns 2 (lane%4) and +1, packed); lanes 8i..8i+7 pass the addresses of
// the 8 rows of matrix i as it lands in shared memory (= its columns in registers), 16 bytes
// each. sm_90 has stmatrix; before it each lane writes its 8 halves one by one.
__device__ __forceinline__ void stsm_x4_t(void* p, const uint32_t (&r)[4], int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  (void)lane;
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n"
               ::"r"(smem_addr(p)), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
#else
  // lane holds (row lane/4, columns c, c+1) of each matrix: in memory, column c is the row
  // whose address lane 8i + c passed, and lane/4 the element inside it
  const int g = lane >> 2, c = 2 * (lane & 3);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const bf* v = reinterpret_cast<const bf*>(&r[i]);
#pragma unroll
    for (int e = 0; e < 2; e++) {
      const unsigned long long row = __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(p), 8 * i + c + e);
      reinterpret_cast<bf*>(row)[g] = v[e];
    }
  }
  __syncwarp();
#endif
}
// dst[0..1] += (a, b) in global memory, fp32, one vector reduction (sm_90) or two atomics.
// dst must be 8-byte aligned.
__device__ __forceinline__ void red_add_f32x2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// ---- v2 backward, shared by attn_bwd_dkdv_v2 (attention_bwd.cu) and the single pass
// Pieces of a key-tile block's work per query tile, used by attn_bwd_dkdv_v2 and the single
// pass. A warp owns 16 keys (rows warp*16.. of sK / sV); cQ, cO, cL, cD are the current
// query tile's Q, dO, lse * log2(e) and delta in shared memory.

// Q, dO (rows qt.. of query head h, nq of them valid) into buffer buf; lse and delta beside them
// (+inf / 0 past nq, so that p = 0 there).
template <int HD, int BRQ, int NT>
__device__ __forceinline__ void load_q_dout_tile(bf* sQ, bf* sO, float* sL, float* sD, int buf, const bf* q,
                                                 const bf* dout, const float* lse, const float* delta,
                                                 int q0, int qt, int h, int H, int Lq) {
  const int nq = min(BRQ, Lq - qt);
  const int64_t qstride = int64_t(H) * HD, off = (int64_t(q0) + qt) * qstride + h * HD;
  load_tile<HD, BRQ, NT>(sQ + buf * BRQ * HD, q + off, qstride, nq);
  load_tile<HD, BRQ, NT>(sO + buf * BRQ * HD, dout + off, qstride, nq);
  for (int i = threadIdx.x; i < BRQ; i += NT) {
    const bool ok = i < nq;
    const int64_t st = (int64_t(q0) + qt + i) * H + h;
    sL[buf * BRQ + i] = ok ? lse[st] * kLog2e : INFINITY;
    sD[buf * BRQ + i] = ok ? delta[st] : 0.f;
  }
}

// st = P^T and dpt = dS^T (the warp's 16 keys x BRQ queries, C layout): S^T = K Q^T and
// dP^T = V dO^T by mma, then p = exp2(s scale log2(e) - lse), masked past Lk and above the
// causal diagonal (query tile starting at qt), dS^T = p (dP^T - delta).
template <int HD, int BRQ>
__device__ __forceinline__ void dkdv_p_ds(float (&st)[BRQ / 8][4], float (&dpt)[BRQ / 8][4], const bf* sK,
                                          const bf* sV, const bf* cQ, const bf* cO, const float* cL,
                                          const float* cD, int warp, int lane, int key0, int Lk, bool need_mask,
                                          bool causal, int qt, int shift, float scale_log2) {
  const int t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < BRQ / 8; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) st[nt][e] = dpt[nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < HD / 16; kk++) {
    uint32_t ka[4], va[4];
    frag_a<HD>(ka, sK, warp * 16, kk * 16, lane);
    frag_a<HD>(va, sV, warp * 16, kk * 16, lane);
#pragma unroll
    for (int np = 0; np < BRQ / 16; np++) {
      uint32_t b[4];
      frag_b_rows_n<HD>(b, cQ, np * 16, kk * 16, lane);  // S^T = K Q^T
      mma_bf16(st[2 * np], ka, b[0], b[1]);
      mma_bf16(st[2 * np + 1], ka, b[2], b[3]);
      frag_b_rows_n<HD>(b, cO, np * 16, kk * 16, lane);  // dP^T = V dO^T
      mma_bf16(dpt[2 * np], va, b[0], b[1]);
      mma_bf16(dpt[2 * np + 1], va, b[2], b[3]);
    }
  }
#pragma unroll
  for (int nt = 0; nt < BRQ / 8; nt++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int qc = nt * 8 + 2 * t + (e & 1);  // query column inside the tile
      float p = exp2f(st[nt][e] * scale_log2 - cL[qc]);  // rows past Lq have lse +inf: p = 0
      if (need_mask) {
        const int key = key0 + 8 * (e >> 1);
        if (key >= Lk || (causal && key > qt + qc + shift)) p = 0.f;
      }
      st[nt][e] = p;
      dpt[nt][e] = p * (dpt[nt][e] - cD[qc]);  // dS^T
    }
}

// dV += P^T dO and dK += dS^T Q for queries 16 kk..16 kk+15 (pa, da: A fragments of P^T, dS^T).
template <int HD>
__device__ __forceinline__ void dkdv_accumulate(float (&dva)[HD / 8][4], float (&dka)[HD / 8][4],
                                                const uint32_t (&pa)[4], const uint32_t (&da)[4], const bf* cQ,
                                                const bf* cO, int kk, int lane) {
#pragma unroll
  for (int dd = 0; dd < HD / 16; dd++) {
    uint32_t b[4];
    frag_b_rows_k<HD>(b, cO, kk * 16, dd * 16, lane);  // dV += P^T dO
    mma_bf16(dva[2 * dd], pa, b[0], b[1]);
    mma_bf16(dva[2 * dd + 1], pa, b[2], b[3]);
    frag_b_rows_k<HD>(b, cQ, kk * 16, dd * 16, lane);  // dK += dS^T Q
    mma_bf16(dka[2 * dd], da, b[0], b[1]);
    mma_bf16(dka[2 * dd + 1], da, b[2], b[3]);
  }
}

// Opts a kernel in to more than 48 KB of dynamic shared memory (once per instantiation).
template <class K>
inline void set_smem(K kernel, int bytes) {
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// ---- host entry points of the attention files (attention.cu chooses among them)
// attention_v1.cu: v1_warp_per_row, T = float or bf16, any hd <= 128. Writes every row.
template <class T>
void fwd_v1(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* cu_q,
            const int32_t* cu_k, int nseq, int64_t Nq, int H, int KV, int hd, bool causal,
            float scale_log2, cudaStream_t s);
template <class T>
void bwd_v1(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,
            const float* delta, const int32_t* cu_q, const int32_t* cu_k, int nseq, int64_t Nq,
            int64_t Nk, int H, int KV, int hd, bool causal, float scale, cudaStream_t s);
// attention_fwd.cu: v2 forward, hd 16/32/64/128, nseq and max_seqlen > 0. Rows outside every
// sequence are left to the caller.
void fwd_v2(bf* out, float* lse, const bf* q, const bf* k, const bf* v, const int32_t* cu_q,
            const int32_t* cu_k, int nseq, int max_seqlen, int H, int KV, int hd, bool causal,
            float scale_log2, cudaStream_t s);
// attention_bwd.cu: the two-pass (deterministic) v2 backward, hd 16/32/64/128; delta computed
// before, rows outside every sequence left to the caller.
void bwd_v2(bf* dq, bf* dk, bf* dv, const bf* dout, const bf* q, const bf* k, const bf* v,
            const float* lse, const float* delta, const int32_t* cu_q, const int32_t* cu_k, int nseq,
            int max_seqlen, int H, int KV, int hd, bool causal, float scale, cudaStream_t s);
// attention_bwd_single.cu: the single pass, hd 64/128; computes delta and writes every row.
void bwd_v2_atomic(bf* dq, bf* dk, bf* dv, float* dq_acc, float* delta, const bf* dout, const bf* out,
                   const bf* q, const bf* k, const bf* v, const float* lse, const int32_t* cu_q,
                   const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV,
                   int hd, bool causal, float scale, cudaStream_t s);

}  // namespace loom::cuda::attn
