// attention_cudnn.cuh: what the two files of the cuDNN attention backend share:
// attention_cudnn.cu (the calls, the checks and the auto choice) and attention_cudnn_graph.cu
// (the SDPA graph built with cuDNN 9's backend descriptor API, its plans and their execution).
// Only with cuDNN (LOOM_HAVE_CUDNN).
#pragma once
#if LOOM_HAVE_CUDNN
#include <cudnn.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda/attention_tiles.cuh"

namespace loom::cuda {

[[noreturn]] void cudnn_fail(const char* expr, cudnnStatus_t s, const char* file, int line);
#define CUDNN_CHECK(expr)                                                                    \
  do {                                                                                       \
    cudnnStatus_t _s = (expr);                                                               \
    if (_s != CUDNN_STATUS_SUCCESS) ::loom::cuda::cudnn_fail(#expr, _s, __FILE__, __LINE__); \
  } while (0)
// cudnnBackendSetAttribute with the attribute's name in the error message
#define SET_ATTR(desc, attr, type, n, ptr) CUDNN_CHECK(cudnnBackendSetAttribute(desc, attr, type, n, ptr))

namespace cudnn_sdpa {

using D = cudnnBackendDescriptor_t;

// Owns every descriptor it creates (the plan is built from them and kept with them).
struct Descs {
  std::vector<D> all;
  ~Descs() {
    for (auto it = all.rbegin(); it != all.rend(); ++it) cudnnBackendDestroyDescriptor(*it);
  }
};

// Unique ids of the tensors the caller supplies in the variant pack.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kLse, kScale, kSeqQ, kSeqKV, kOffQ, kOffK, kOffLse, kNegInf, kOne,
  kDO, kDQ, kDK, kDV, kDQAcc, kDelta, kVirtual = 100
};

// A plan bucket. Ragged (packed rows): B and S are nseq and max_seqlen rounded up to powers
// of two. Dense (every sequence max_seqlen long, one cu_seqlens for queries and keys): B and S
// exactly, and the graph has no offsets, no sequence lengths and no padding mask.
struct Key {
  bool backward;
  int B, S, H, KV, hd;
  bool causal;
  bool dense = false;
  // Dense backward only: dq, dk, dv written as column blocks of one row of `ld` elements (the
  // joined [N, (H + 2 KV) hd] gradient of attention_backward_qkv); 0: three packed tensors.
  int ld = 0;
  bool operator<(const Key& o) const {
    return std::tie(backward, B, S, H, KV, hd, causal, dense, ld) <
           std::tie(o.backward, o.B, o.S, o.H, o.KV, o.hd, o.causal, o.dense, o.ld);
  }
  std::string str() const {
    char b[160];
    std::snprintf(b, sizeof b, "%s %s%d %s%d H%d KV%d hd%d %s%s", backward ? "backward" : "forward", dense ? "dense B" : "B<=",
                  B, dense ? "S" : "S<=", S, H, KV, hd, causal ? "causal" : "full", ld ? " joined rows" : "");
    return b;
  }
};

struct Plan {
  Descs descs;
  D plan = nullptr;
  int64_t workspace_bytes = 0;
  // the variant pack of the last call, reused while the pointers and scalars are the same
  Descs pack_desc;
  D pack = nullptr;
  std::vector<void*> pack_ptrs;
  float scale = 0.f, neg_inf = -INFINITY, one = 1.f;
  int32_t* meta = nullptr;  // seq_q, seq_kv, off_q, off_k, off_lse (see cudnn_prep)
  std::string error;        // non-empty: cuDNN cannot run this bucket
};

int pow2_at_least(int x, int lo);
cudnnHandle_t handle();
// The plan of a bucket, built on first use. Throws on a cuDNN API error; a graph no engine
// supports comes back with P.error set.
Plan& get_plan(const Key& k);
// The plan of a bucket if it was built, else nullptr (builds nothing: safe during capture).
Plan* find_plan(const Key& k);
// How many dense buckets have a plan (tests: the dense graph was taken).
int dense_plans();
// Runs P with the variant pack of uids -> ptrs (device pointers, and the plan's own scalars at
// stable addresses); the pack is rebuilt only when a pointer changed.
void execute(Plan& P, const std::vector<int64_t>& uids, std::vector<void*> ptrs, cudaStream_t s);

}  // namespace cudnn_sdpa
}  // namespace loom::cuda
#endif  // LOOM_HAVE_CUDNN
