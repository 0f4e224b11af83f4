/*
 * attention_cudnn.cu: the cuDNN backend of the attention op (kernels.inc attention_forward /
 * attention_backward), written against cuDNN 9's backend (graph) descriptor API, and the
 * process-wide choice between it and our kernels (attention.cu): train.attention =
 * auto | loom | cudnn (set_attention_backend, or LOOM_ATTENTION in the environment).
 *
 * Same math, shapes and conventions as attention.cu (the reference: kernels/cpu/attention.cpp):
 *   q, out, dout, dq [Nq, H, hd]   k, v, dk, dv [Nk, KV, hd]   lse [Nq, H] fp32 (natural log)
 *   cu_q, cu_k [nseq + 1] int32 on the device; causal = bottom-right aligned (query t of a
 *   sequence with Lq queries and Lk keys sees keys j <= t + Lk - Lq).
 *   forward: out = softmax(scale q k^T) v (=), lse saved (=).  backward: dq, dk, dv (=).
 *   Rows outside every sequence: out = dq = 0, lse = +inf; key rows outside: dk = dv = 0 (the
 *   prep kernel below writes those; cuDNN writes only the rows of the sequences). Causal queries
 *   that see no key (Lq > Lk): out = 0, lse = +inf, written after cuDNN when cu_q != cu_k.
 *
 * The graph (attention_cudnn_graph.cu) is the one the cuDNN frontend assembles for SDPA,
 *   in THD layout with ragged offsets, so cuDNN reads and writes our packed rows in place;
 *   a padding mask per sequence and the bottom-right causal mask. A dense batch (every
 *   sequence max_seqlen long, one cu_seqlens array for queries and keys: a ViT batch, a
 *   padded or benchmark batch) gets the plain graph instead: no offsets, no lengths, no
 *   padding mask, causal as row >= col, B and S exact (choose_key; if cuDNN cannot plan it,
 *   the ragged graph, logged once).
 *   bf16 only: f32 inputs under `cudnn` are rounded to bf16 around the call (temporaries from
 *   device_malloc); `auto` keeps f32 on our kernels. Head dims: multiples of 16 up to 128 (hd 40
 *   gave wrong dq rows on cuDNN 9.19).
 *   Needs compute capability >= 9.0 (the ragged lse of the backward is Hopper+) and cuDNN >= 9.6.
 * Plans: built the first time a (direction, B, S, H, KV, hd, causal) bucket is seen, cached
 *   for the process with a small device buffer for the per-call sequence lengths and offsets;
 *   one workspace (device_malloc) serves every plan, grown at plan building; the variant pack
 *   is kept while the call's pointers stay the same. A call is then one prep kernel (lengths,
 *   offsets, rows outside every sequence) and cudnnBackendExecute: no host sync, no
 *   allocation, capturable. Every cuDNN status goes through CUDNN_CHECK, which names the call.
 * auto: the first time a bucket is seen, both backends run on the call's own data (alternating,
 *   2 warm-up and 5 timed runs each, events, the medians), the faster is kept and logged once
 *   on stderr. Unsupported cases (hd, f32, GPU, deterministic backward) and a plan cuDNN cannot
 *   build go to our kernels, logged once; under `cudnn` they throw with the reason.
 * Napkin (B8 H16 T2048 hd128 causal): forward 137 GFLOP, backward 2.5x; bytes ~0.27 GB.
 *   Compute-bound: the figure of merit is TFLOP/s against the ~660 of H100/H200 bf16 mma.
 * Measured 2026-11-23, H100 80GB HBM3, cuDNN 9.19, b75ff14 (bench/bench_attention.cpp, median
 *   of 20; PyTorch 2.11 SDPA CUDNN_ATTENTION in the same run in brackets), ms fwd | fwd+bwd:
 *                         B8 H12 T1024 D64      B8 H16 T2048 D128 c   B4 H9 T2048 D64 c
 *     loom                0.108 | 0.515         0.430 | 2.162         0.106 | 0.410
 *     cudnn (this file)   0.093 | 0.343         0.314 | 1.866         0.089 | 0.441
 *     auto                0.093 | 0.348         0.304 | 1.880         0.088 | 0.391
 *     PyTorch CUDNN      (0.098 | 0.510)       (0.304 | 1.395)       (0.086 | 0.376)
 *   Then the dense graph (the benchmark's batches are dense), same GPU and versions, one run:
 *     cudnn (dense)       0.070 | 0.280         0.277 | 1.186         0.068 | 0.257
 *     auto                0.073 | 0.277         0.272 | 1.199         0.068 | 0.257
 *     PyTorch CUDNN      (0.098 | 0.389)       (0.292 | 1.456)       (0.088 | 0.426)
 *   The ragged graph's hd 128 causal backward (1.55 ms against PyTorch's 1.09) was the
 *   padding mask and the ragged layout PyTorch does not use: dense, 0.94 ms. Earlier the same day:
 *   per-call variant packs and one workspace per plan (fwd 0.095 / 0.318 / 0.091): the cached
 *   pack and the shared workspace gave 0.093 / 0.314 / 0.089 (within run-to-run spread).
 *   hd 40 (multiple of 8, not 16) ran but left whole dq rows at 0: multiples of 16 only.
 * Test: tests/cuda/test_cuda_attention_cudnn.cpp. On a CUDA machine:
 *   bash tools/gpu-run.sh test cudnn
 */
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/cuda/attention_cudnn.cuh"
#include "kernels/cuda/attention_tiles.cuh"

namespace loom::cuda {

// ============================================================================ the setting
namespace {
AttentionBackend parse_backend_env() {
  const char* e = std::getenv("LOOM_ATTENTION");
  if (!e || !*e) return AttentionBackend::Loom;
  const std::string s(e);
  if (s == "auto") return AttentionBackend::Auto;
  if (s == "cudnn") return AttentionBackend::Cudnn;
  if (s == "loom") return AttentionBackend::Loom;
  throw std::invalid_argument("LOOM_ATTENTION must be auto, loom or cudnn, got '" + s + "'");
}
std::atomic<int>& backend_flag() {
  static std::atomic<int> b{int(parse_backend_env())};
  return b;
}
}  // namespace

void set_attention_backend(AttentionBackend b) { backend_flag() = int(b); }
AttentionBackend attention_backend() { return AttentionBackend(backend_flag().load()); }
const char* attention_backend_name(AttentionBackend b) {
  return b == AttentionBackend::Auto ? "auto" : b == AttentionBackend::Cudnn ? "cudnn" : "loom";
}

#if LOOM_HAVE_CUDNN

namespace {

using namespace attn;
using namespace cudnn_sdpa;

// ---------------------------------------------------------------------------- prep kernel
// meta (int32): seq_q[B], seq_kv[B], off_q[B+1], off_k[B+1], off_lse[B+1]. Sequences nseq..B-1
// are empty. The same launch zeroes the rows outside every sequence: rows of x [rows, width]
// before cu[0] or from cu[nseq] on get 0 (and stat [rows, nstat] +inf when given).
template <class T>
__global__ void cudnn_prep(int32_t* __restrict__ meta, const int32_t* __restrict__ cu_q,
                           const int32_t* __restrict__ cu_k, int nseq, int B, int H, int KV, int hd,
                           T* __restrict__ x0, float* __restrict__ stat0, int64_t rows0, int width0, int nstat0,
                           const int32_t* __restrict__ cu0, T* __restrict__ x1, T* __restrict__ x2,
                           int64_t rows1, int width1, const int32_t* __restrict__ cu1) {
  pdl_entry();
  if (blockIdx.x == 0) {
    int32_t *sq = meta, *sk = meta + B, *oq = meta + 2 * B, *ok = oq + B + 1, *ol = ok + B + 1;
    for (int b = threadIdx.x; b <= B; b += blockDim.x) {
      const int i = min(b, nseq);
      if (b < B) {
        sq[b] = b < nseq ? cu_q[b + 1] - cu_q[b] : 0;
        sk[b] = b < nseq ? cu_k[b + 1] - cu_k[b] : 0;
      }
      oq[b] = cu_q[i] * H * hd;
      ok[b] = cu_k[i] * KV * hd;
      ol[b] = cu_q[i] * H;
    }
  }
  // rows outside: [0, cu[0]) and [cu[nseq], rows)
  auto zero = [&](T* x, float* stat, int64_t rows, int width, int nstat, const int32_t* cu, T* xb) {
    if (!x) return;
    const int64_t a = cu[0], e = cu[nseq], n_out = (a + (rows - e)) * width;
    for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < n_out;
         idx += int64_t(gridDim.x) * blockDim.x) {
      int64_t r = idx / width, c = idx % width;
      if (r >= a) r = e + (r - a);
      x[r * width + c] = from_float<T>(0.f);
      if (xb) xb[r * width + c] = from_float<T>(0.f);
      if (stat && c < nstat) stat[r * nstat + c] = INFINITY;
    }
  };
  zero(x0, stat0, rows0, width0, nstat0, cu0, nullptr);
  zero(x1, nullptr, rows1, width1, 0, cu1, x2);
}

// Causal with Lq > Lk: queries t < Lq - Lk see no key. Our convention for them is out = 0 and
// lse = +inf (a backward then gives them dq = 0 and no dk, dv contribution); cuDNN's fully
// masked rows are overwritten here. One block per sequence; launched only when cu_q != cu_k.
__global__ void cudnn_fix_unseen(bf* __restrict__ out, float* __restrict__ lse, const int32_t* __restrict__ cu_q,
                                 const int32_t* __restrict__ cu_k, int H, int hd) {
  pdl_entry();
  const int i = blockIdx.x, q0 = cu_q[i], Lq = cu_q[i + 1] - q0, Lk = cu_k[i + 1] - cu_k[i];
  const int64_t n = Lq > Lk ? int64_t(Lq - Lk) : 0, w = int64_t(H) * hd;
  for (int64_t idx = threadIdx.x; idx < n * w; idx += blockDim.x) out[int64_t(q0) * w + idx] = __float2bfloat16(0.f);
  for (int64_t idx = threadIdx.x; idx < n * H; idx += blockDim.x) lse[int64_t(q0) * H + idx] = INFINITY;
}

__global__ void f32_to_bf16(bf* __restrict__ y, const float* __restrict__ x, int64_t n) {
  pdl_entry();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16(x[i]);
}
__global__ void bf16_to_f32(float* __restrict__ y, const bf* __restrict__ x, int64_t n) {
  pdl_entry();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __bfloat162float(x[i]);
}

// ---------------------------------------------------------------------------- support
int device_cc_major() {
  static int major = [] {
    int dev = 0, m = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev));
    return m;
  }();
  return major;
}

// Empty when cuDNN can run the case (bf16 after conversion for f32), else the reason.
std::string unsupported(bool is_f32, bool backward, int64_t Nq, int64_t Nk, int H, int KV, int hd) {
  (void)is_f32;
  // hd 40 (a multiple of 8, not of 16) ran and gave dq = 0 on whole rows (H100, cuDNN 9.19,
  // tests/cuda/test_cuda_attention_cudnn.cpp): multiples of 16 only.
  if (hd % 16 != 0 || hd > 128) return "head dim " + std::to_string(hd) + " (cuDNN backend: multiples of 16 up to 128)";
  if (device_cc_major() < 9) return "compute capability " + std::to_string(device_cc_major()) + ".x (needs 9.0+)";
  if (cudnnGetVersion() < 90600) return "cuDNN " + std::to_string(cudnnGetVersion()) + " (needs 9.6+)";
  if (Nq * H * hd >= (int64_t(1) << 31) || Nk * KV * hd >= (int64_t(1) << 31))
    return "more than 2^31 elements (int32 ragged offsets)";
  if (backward && deterministic_attention()) return "a deterministic backward (cuDNN adds dq with atomics)";
  return "";
}

template <class T>
void run_prep(Plan& P, const Key& k, const int32_t* cu_q, const int32_t* cu_k, int nseq, T* x0, float* stat0,
              int64_t rows0, int width0, int nstat0, const int32_t* cu0, T* x1, T* x2, int64_t rows1, int width1,
              const int32_t* cu1, cudaStream_t s) {
  launch_kernel(cudnn_prep<dev_t<T>>, 32, 256, 0, s, P.meta, cu_q, cu_k, nseq, k.B, k.H, k.KV, k.hd, dptr(x0), stat0,
                rows0, width0, nstat0, cu0, dptr(x1), dptr(x2), rows1, width1, cu1);
  LAUNCH_CHECK();
}

Key make_key(bool backward, int nseq, int max_seqlen, int H, int KV, int hd, bool causal, bool dense) {
  if (dense) return Key{backward, nseq, max_seqlen, H, KV, hd, causal, true};
  return Key{backward, pow2_at_least(std::max(nseq, 1), 1), pow2_at_least(max_seqlen, 64), H, KV, hd, causal, false};
}

// A dense batch (attention_tiles.cuh's dense_batch: every sequence max_seqlen long, one
// cu_seqlens) is the layout a graph without ragged offsets reads. Such a batch takes the dense
// bucket when cuDNN builds its plan; otherwise (an engine that refuses it) the ragged bucket,
// logged once.

// The variant-pack entries only the ragged graph has: -inf for the padding mask (the dense
// graph uses it for the causal mask only), sequence lengths and offsets (P.meta, written by
// the prep kernel).
void add_ragged_entries(Plan& P, const Key& k, std::vector<int64_t>& uids, std::vector<void*>& ptrs) {
  if (k.dense) {
    if (k.causal) uids.push_back(kNegInf), ptrs.push_back(&P.neg_inf);
    return;
  }
  int32_t* m = P.meta;
  const int B = k.B;
  uids.insert(uids.end(), {kNegInf, kSeqQ, kSeqKV, kOffQ, kOffK, kOffLse});
  ptrs.insert(ptrs.end(), {&P.neg_inf, m, m + B, m + 2 * B, m + 3 * B + 1, m + 4 * B + 2});
}

// bf16 forward through the plan of k (built by the caller)
void fwd_bf16(Plan& P, const Key& k, bf* out, float* lse, const bf* q, const bf* kk, const bf* v, const int32_t* cu_q,
              const int32_t* cu_k, int nseq, int64_t Nq, double scale, cudaStream_t s) {
  if (!k.dense)  // a dense batch has no rows outside its sequences and no lengths to write
    run_prep<bf16>(P, k, cu_q, cu_k, nseq, reinterpret_cast<bf16*>(out), lse, Nq, k.H * k.hd, k.H, cu_q, nullptr,
                   nullptr, 0, 0, cu_k, s);
  P.scale = float(scale);
  std::vector<int64_t> uids{kQ, kK, kV, kO, kLse, kScale};
  std::vector<void*> ptrs{(void*)q, (void*)kk, (void*)v, (void*)out, (void*)lse, &P.scale};
  add_ragged_entries(P, k, uids, ptrs);
  execute(P, uids, ptrs, s);
  if (k.causal && cu_q != cu_k) {  // never dense (one cu_seqlens)
    launch_kernel(cudnn_fix_unseen, nseq, 256, 0, s, out, lse, cu_q, cu_k, k.H, k.hd);
    LAUNCH_CHECK();
  }
}

void bwd_bf16(Plan& P, const Key& k, bf* dq, bf* dk, bf* dv, const bf* dout, const bf* q, const bf* kk, const bf* v,
              const bf* out, const float* lse, float* ws, const int32_t* cu_q, const int32_t* cu_k, int nseq,
              int64_t Nq, int64_t Nk, double scale, cudaStream_t s) {
  if (!k.dense)
    run_prep<bf16>(P, k, cu_q, cu_k, nseq, reinterpret_cast<bf16*>(dq), nullptr, Nq, k.H * k.hd, 0, cu_q,
                   reinterpret_cast<bf16*>(dk), reinterpret_cast<bf16*>(dv), Nk, k.KV * k.hd, cu_k, s);
  P.scale = float(scale);
  float* dq_acc = ws;
  float* delta = ws + Nq * k.H * k.hd;
  std::vector<int64_t> uids{kQ, kK, kV, kO, kLse, kDO, kDQ, kDK, kDV, kDQAcc, kDelta, kScale, kOne};
  std::vector<void*> ptrs{(void*)q,  (void*)kk, (void*)v,      (void*)out,   (void*)lse, (void*)dout, (void*)dq,
                          (void*)dk, (void*)dv, (void*)dq_acc, (void*)delta, &P.scale,   &P.one};
  add_ragged_entries(P, k, uids, ptrs);
  execute(P, uids, ptrs, s);
}

// f32 under `cudnn`: the same call on bf16 copies (rounded inputs, outputs widened back).
struct Bf16Copy {
  bf* p = nullptr;
  int64_t n = 0;
  Bf16Copy(const float* x, int64_t n_, cudaStream_t s) : n(n_) {
    p = static_cast<bf*>(device_malloc(sizeof(bf) * size_t(std::max<int64_t>(n, 1))));
    if (x && n > 0) {
      launch_kernel(f32_to_bf16, std::min(ceil_div(n, 256), 4096), 256, 0, s, p, x, n);
      LAUNCH_CHECK();
    }
  }
  void widen(float* y, cudaStream_t s) const {
    if (n > 0) {
      launch_kernel(bf16_to_f32, std::min(ceil_div(n, 256), 4096), 256, 0, s, y, p, n);
      LAUNCH_CHECK();
    }
  }
  ~Bf16Copy() { device_free(p); }
  Bf16Copy(const Bf16Copy&) = delete;
  Bf16Copy& operator=(const Bf16Copy&) = delete;
};

// ---------------------------------------------------------------------------- auto
std::mutex& choice_mu() {
  static std::mutex m;
  return m;
}
std::map<Key, bool>& choices() {  // bucket -> cuDNN is faster
  static auto* m = new std::map<Key, bool>();
  return *m;
}
void log_once(const std::string& what) {
  static std::mutex mu;
  static auto* seen = new std::vector<std::string>();
  std::lock_guard<std::mutex> lock(mu);
  if (std::find(seen->begin(), seen->end(), what) != seen->end()) return;
  seen->push_back(what);
  std::fprintf(stderr, "attention: %s\n", what.c_str());
}

// The probe: f and g alternate (2 warm-up runs each, then 5 timed runs each, events around
// each run); the medians, so that clock ramps and first-run costs fall on neither side.
std::pair<float, float> time_pair_ms(const std::function<void()>& f, const std::function<void()>& g, cudaStream_t s) {
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  auto once = [&](const std::function<void()>& x) {
    CUDA_CHECK(cudaEventRecord(a, s));
    x();
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms;
  };
  std::vector<float> tf, tg;
  for (int i = 0; i < 7; i++) {
    const float x = once(f), y = once(g);
    if (i >= 2) tf.push_back(x), tg.push_back(y);
  }
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  std::sort(tf.begin(), tf.end());
  std::sort(tg.begin(), tg.end());
  return {tf[tf.size() / 2], tg[tg.size() / 2]};
}

// Runs the call with cuDNN (returns true) or leaves it to our kernels (false). run_cudnn
// executes the call on cuDNN; run_loom on ours (used by the auto probe).
bool dispatch(const Key& k, bool is_f32, int64_t Nq, int64_t Nk, const std::function<void(Plan&)>& run_cudnn,
              const std::function<void()>& run_loom, cudaStream_t s) {
  const AttentionBackend mode = attention_backend();
  if (mode == AttentionBackend::Loom) return false;
  const std::string why = unsupported(is_f32, k.backward, Nq, Nk, k.H, k.KV, k.hd);
  if (mode == AttentionBackend::Cudnn) {
    if (!why.empty())
      throw std::invalid_argument("attention " + k.str() + ": train.attention = cudnn, but cuDNN's fused attention "
                                  "cannot run it: " + why + " (use auto or loom)");
    Plan& P = get_plan(k);
    if (!P.plan)
      throw std::runtime_error("attention " + k.str() + ": train.attention = cudnn, but " + P.error);
    run_cudnn(P);
    return true;
  }
  // auto
  if (is_f32) {
    log_once("auto: f32 attention runs on loom's kernels (cuDNN's fused attention is bf16)");
    return false;
  }
  if (!why.empty()) {
    log_once("auto: " + k.str() + " runs on loom's kernels: cuDNN cannot run " + why);
    return false;
  }
  int known = -1;  // the cached choice: 1 cuDNN, 0 loom
  {
    std::lock_guard<std::mutex> lock(choice_mu());
    auto it = choices().find(k);
    if (it != choices().end()) known = it->second ? 1 : 0;
  }
  if (known == 1) run_cudnn(get_plan(k));
  if (known >= 0) return known == 1;
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(s, &cap));
  if (cap != cudaStreamCaptureStatusNone) {
    log_once("auto: " + k.str() + " first seen during graph capture: loom's kernels (no timing possible)");
    return false;
  }
  Plan* P = nullptr;
  try {
    P = &get_plan(k);
  } catch (const std::exception& e) {
    log_once("auto: " + k.str() + ": building the cuDNN plan failed (" + e.what() + "): loom's kernels");
  }
  bool use = false;
  if (P && P->plan) {
    const auto [ms_loom, ms_cudnn] = time_pair_ms(run_loom, [&] { run_cudnn(*P); }, s);
    use = ms_cudnn < ms_loom;
    char b[256];
    std::snprintf(b, sizeof b, "auto: %s: loom %.3f ms, cudnn %.3f ms -> %s", k.str().c_str(), ms_loom, ms_cudnn,
                  use ? "cudnn" : "loom");
    log_once(b);
  } else if (P) {
    log_once("auto: " + k.str() + ": " + P->error + ": loom's kernels");
  }
  {
    std::lock_guard<std::mutex> lock(choice_mu());
    choices()[k] = use;
  }
  if (use) run_cudnn(*P);  // the call's outputs come from the chosen backend
  return use;
}

// The bucket of a call: the dense one when the batch is dense and cuDNN builds its plan
// (supported cases only, outside graph capture: a first dense shape met during capture takes
// the ragged bucket, whose plan the capture then needs anyway), else the ragged one.
Key choose_key(bool backward, bool is_f32, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd,
               bool causal, bool dense, cudaStream_t s) {
  const Key ragged = make_key(backward, nseq, max_seqlen, H, KV, hd, causal, false);
  // only where dispatch() may run cuDNN: a supported case, and not f32 under auto (ours)
  if (!dense || (is_f32 && attention_backend() == AttentionBackend::Auto) ||
      !unsupported(is_f32, backward, Nq, Nk, H, KV, hd).empty())
    return ragged;
  const Key k = make_key(backward, nseq, max_seqlen, H, KV, hd, causal, true);
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(s, &cap));
  if (cap != cudaStreamCaptureStatusNone) {
    const Plan* built = find_plan(k);
    return built && built->plan ? k : ragged;
  }
  try {
    Plan& P = get_plan(k);
    if (P.plan) return k;
    log_once(k.str() + ": " + P.error + ": the ragged graph instead");
  } catch (const std::exception& e) {
    log_once(k.str() + ": building the dense plan failed (" + e.what() + "): the ragged graph instead");
  }
  return ragged;
}

// f16: this backend builds bf16 graphs only; f16 attention runs on our kernels (under `cudnn`
// a clear error).
bool f16_on_loom() {
  if (attention_backend() == AttentionBackend::Cudnn)
    throw std::invalid_argument("attention: train.attention = cudnn, but the cuDNN backend runs bf16 (and f32 through "
                                "bf16 copies), not f16: use auto or loom with train.dtype = fp16");
  log_once("auto: f16 attention runs on loom's kernels (the cuDNN backend builds bf16 graphs)");
  return false;
}

}  // namespace

int attention_cudnn_dense_plans() { return dense_plans(); }

template <class T>
bool attn::cudnn_attention_forward(T* out, float* lse, const T* q, const T* k, const T* v, const int32_t* cu_q,
                             const int32_t* cu_k, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV,
                             int hd, bool causal, double scale, cudaStream_t s, const std::function<void()>& run_loom) {
  if (nseq <= 0 || max_seqlen <= 0 || Nq == 0 || attention_backend() == AttentionBackend::Loom) return false;
  if constexpr (std::is_same<T, f16>::value) return f16_on_loom();
  constexpr bool f32 = std::is_same<T, float>::value;
  const Key key = choose_key(false, f32, nseq, max_seqlen, Nq, Nk, H, KV, hd, causal,
                             attn::dense_batch(cu_q, cu_k, nseq, max_seqlen, Nq, Nk), s);
  return dispatch(key, f32, Nq, Nk, [&](Plan& P) {
    if constexpr (f32) {
      Bf16Copy bq(q, Nq * H * hd, s), bk(k, Nk * KV * hd, s), bv(v, Nk * KV * hd, s), bo(nullptr, Nq * H * hd, s);
      fwd_bf16(P, key, bo.p, lse, bq.p, bk.p, bv.p, cu_q, cu_k, nseq, Nq, scale, s);
      bo.widen(out, s);
    } else {
      fwd_bf16(P, key, reinterpret_cast<bf*>(out), lse, reinterpret_cast<const bf*>(q), reinterpret_cast<const bf*>(k),
               reinterpret_cast<const bf*>(v), cu_q, cu_k, nseq, Nq, scale, s);
    }
  }, run_loom, s);
}

template <class T>
bool attn::cudnn_attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const T* out,
                              const float* lse, float* ws, const int32_t* cu_q, const int32_t* cu_k, int nseq,
                              int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd, bool causal, double scale,
                              cudaStream_t s, const std::function<void()>& run_loom) {
  if (nseq <= 0 || max_seqlen <= 0 || Nq == 0 || attention_backend() == AttentionBackend::Loom) return false;
  if constexpr (std::is_same<T, f16>::value) return f16_on_loom();
  constexpr bool f32 = std::is_same<T, float>::value;
  const Key key = choose_key(true, f32, nseq, max_seqlen, Nq, Nk, H, KV, hd, causal,
                             attn::dense_batch(cu_q, cu_k, nseq, max_seqlen, Nq, Nk), s);
  return dispatch(key, f32, Nq, Nk, [&](Plan& P) {
    if constexpr (f32) {
      const int64_t nq = Nq * H * hd, nk = Nk * KV * hd;
      Bf16Copy bdo(dout, nq, s), bq(q, nq, s), bk(k, nk, s), bv(v, nk, s), bo(out, nq, s);
      Bf16Copy bdq(nullptr, nq, s), bdk(nullptr, nk, s), bdv(nullptr, nk, s);
      bwd_bf16(P, key, bdq.p, bdk.p, bdv.p, bdo.p, bq.p, bk.p, bv.p, bo.p, lse, ws, cu_q, cu_k, nseq, Nq, Nk, scale, s);
      bdq.widen(dq, s);
      bdk.widen(dk, s);
      bdv.widen(dv, s);
    } else {
      bwd_bf16(P, key, reinterpret_cast<bf*>(dq), reinterpret_cast<bf*>(dk), reinterpret_cast<bf*>(dv),
               reinterpret_cast<const bf*>(dout), reinterpret_cast<const bf*>(q), reinterpret_cast<const bf*>(k),
               reinterpret_cast<const bf*>(v), reinterpret_cast<const bf*>(out), lse, ws, cu_q, cu_k, nseq, Nq, Nk,
               scale, s);
    }
  }, run_loom, s);
}

// The joined backward (header): only where cuDNN runs the call anyway (train.attention = cudnn,
// or auto's choice already made for the call's dense bucket), so there is no probe here; the
// joined plan is built outside graph capture (the trainers' eager steps come first) and a
// capture finds it built. Anything else (a ragged batch, no plan) returns false: the caller's
// scratch and copies.
bool attn::cudnn_attention_backward_rows(bf* dqkv, const bf* dout, const bf* q, const bf* k, const bf* v,
                                         const bf* out, const float* lse, float* ws, const int32_t* cu, int nseq,
                                         int max_seqlen, int64_t N, int H, int KV, int hd, bool causal, double scale,
                                         cudaStream_t s) {
  const AttentionBackend be = attention_backend();
  if (nseq <= 0 || max_seqlen <= 0 || N == 0 || be == AttentionBackend::Loom ||
      !unsupported(false, true, N, N, H, KV, hd).empty() || !attn::dense_batch(cu, cu, nseq, max_seqlen, N, N))
    return false;
  if (be == AttentionBackend::Auto &&
      attn::cudnn_auto_choice(true, nseq, max_seqlen, N, N, H, KV, hd, causal, /*dense=*/true) != 1)
    return false;
  Key key = make_key(true, nseq, max_seqlen, H, KV, hd, causal, true);
  key.ld = (H + 2 * KV) * hd;
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(s, &cap));
  Plan* P = nullptr;
  if (cap != cudaStreamCaptureStatusNone) {
    P = find_plan(key);
  } else {
    try {
      P = &get_plan(key);
    } catch (const std::exception& e) {
      log_once(key.str() + ": building the plan failed (" + e.what() + "): three packed gradients and copies");
      return false;
    }
  }
  if (!P || !P->plan) {
    if (P) log_once(key.str() + ": " + P->error + ": three packed gradients and copies");
    return false;
  }
  bwd_bf16(*P, key, dqkv, dqkv + int64_t(H) * hd, dqkv + int64_t(H + KV) * hd, dout, q, k, v, out, lse, ws, cu, cu,
           nseq, N, N, scale, s);
  return true;
}

int attn::cudnn_auto_choice(bool backward, int nseq, int max_seqlen, int64_t Nq, int64_t Nk, int H, int KV, int hd,
                            bool causal, bool dense) {
  if (!unsupported(false, backward, Nq, Nk, H, KV, hd).empty()) return 0;
  // a dense batch is in the dense bucket, or in the ragged one where cuDNN refused the dense plan
  const Key ragged = make_key(backward, nseq, max_seqlen, H, KV, hd, causal, false);
  const Key exact = make_key(backward, nseq, max_seqlen, H, KV, hd, causal, true);
  std::lock_guard<std::mutex> lock(choice_mu());
  for (const Key* k : {&exact, &ragged}) {
    if (k == &exact && !dense) continue;
    auto it = choices().find(*k);
    if (it != choices().end()) return it->second ? 1 : 0;
  }
  return -1;
}

void reset_attention_choices() {
  std::lock_guard<std::mutex> lock(choice_mu());
  choices().clear();
}

#else  // built without cuDNN: `auto` is loom, `cudnn` says why

namespace {
bool no_cudnn() {
  if (attention_backend() == AttentionBackend::Cudnn)
    throw std::runtime_error("attention: train.attention = cudnn, but loom was built without cuDNN "
                             "(cudnn.h / libcudnn not found at configure time)");
  return false;
}
}  // namespace

template <class T>
bool attn::cudnn_attention_forward(T*, float*, const T*, const T*, const T*, const int32_t*, const int32_t*, int, int,
                             int64_t, int64_t, int, int, int, bool, double, cudaStream_t,
                             const std::function<void()>&) {
  return no_cudnn();
}
template <class T>
bool attn::cudnn_attention_backward(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, const float*, float*,
                              const int32_t*, const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double,
                              cudaStream_t, const std::function<void()>&) {
  return no_cudnn();
}
bool attn::cudnn_attention_backward_rows(bf*, const bf*, const bf*, const bf*, const bf*, const bf*, const float*,
                                         float*, const int32_t*, int, int, int64_t, int, int, int, bool, double,
                                         cudaStream_t) {
  return false;  // `cudnn` without cuDNN already failed in the forward
}
void reset_attention_choices() {}
int attention_cudnn_dense_plans() { return 0; }
int attn::cudnn_auto_choice(bool, int, int, int64_t, int64_t, int, int, int, bool, bool) { return 0; }

#endif  // LOOM_HAVE_CUDNN

template bool attn::cudnn_attention_forward<float>(float*, float*, const float*, const float*, const float*, const int32_t*,
                                             const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double,
                                             cudaStream_t, const std::function<void()>&);
template bool attn::cudnn_attention_forward<bf16>(bf16*, float*, const bf16*, const bf16*, const bf16*, const int32_t*,
                                            const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double,
                                            cudaStream_t, const std::function<void()>&);
template bool attn::cudnn_attention_forward<f16>(f16*, float*, const f16*, const f16*, const f16*, const int32_t*,
                                            const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double,
                                            cudaStream_t, const std::function<void()>&);
template bool attn::cudnn_attention_backward<float>(float*, float*, float*, const float*, const float*, const float*,
                                              const float*, const float*, const float*, float*, const int32_t*,
                                              const int32_t*, int, int, int64_t, int64_t, int, int, int, bool, double,
                                              cudaStream_t, const std::function<void()>&);
template bool attn::cudnn_attention_backward<bf16>(bf16*, bf16*, bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
                                             const bf16*, const float*, float*, const int32_t*, const int32_t*, int,
                                             int, int64_t, int64_t, int, int, int, bool, double, cudaStream_t,
                                             const std::function<void()>&);
template bool attn::cudnn_attention_backward<f16>(f16*, f16*, f16*, const f16*, const f16*, const f16*, const f16*,
                                             const f16*, const float*, float*, const int32_t*, const int32_t*, int,
                                             int, int64_t, int64_t, int, int, int, bool, double, cudaStream_t,
                                             const std::function<void()>&);

}  // namespace loom::cuda
