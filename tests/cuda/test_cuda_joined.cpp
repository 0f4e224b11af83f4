// test_cuda_joined.cpp: the products that share an input as one GEMM on CUDA (autograd/ops.h:
// qkv_rope and mlp_swiglu on weights that are windows of one buffer, as the optimizer's flat
// buffers lay them out; qkv_rope_attention and qkv_attention, each one node with its attention)
// against the separate ops, and Tensor::copy_ / contiguous of strided CUDA views. Values and
// every gradient, in f32 and bf16; the weight-gradient branches beside the backward
// (train.side_weight_grads) against one stream, and data parallel's bucket averages ordered
// after them. Exits with code 4 (skipped) when no GPU is present.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "autograd/ops.h"
#include "kernels/kernels.h"
#include "optim/optimizer.h"
#include "tests/cuda/cuda_kernel_test_util.h"
#include "trainer/grad_buckets.h"
#include "tests/tolerances.h"

using namespace loom;
using std::vector;

// Weights of rows[i] rows each, one after another in b: windows of b whose gradients are windows
// of gb (the layout of the optimizer's flat buffers: the joined products), or, not joined, clones
// with gradients of their own
static vector<Tensor> weight_windows(const Tensor& b, const Tensor& gb, const vector<int64_t>& rows, bool joined) {
  vector<Tensor> w;
  int64_t r0 = 0;
  for (int64_t n : rows) {
    Tensor t = joined ? b.narrow(0, r0, n) : b.narrow(0, r0, n).clone();
    t.requires_grad_();
    if (joined) t.set_grad(gb.narrow(0, r0, n));
    w.push_back(t);
    r0 += n;
  }
  return w;
}

// The joined products of a Llama layer on the GPU (autograd/ops.h qkv_rope, mlp_swiglu): with the
// weights and their gradients as windows of one buffer (the optimizer's flat buffers) one GEMM
// runs for q|k|v and one for gate|up, with RoPE and SwiGLU on the joined rows; against the CPU
// f64 ops on separate weights (linear_many + rope, two GEMMs). Values and every gradient.
TEST_CASE("joined q|k|v and gate|up products on CUDA against separate weights on the CPU", "[optim]") {
  need_gpu();
  const int N = 53, C = 64, H = 3, KV = 1, hd = 16, I = 40;
  const int R = (H + 2 * KV) * hd;
  Rng rng(77);
  std::vector<int32_t> pv(N);
  for (int i = 0; i < N; i++) pv[size_t(i)] = (i * 7) % 23;
  Tensor pos = Tensor::from_vector(pv, {N});
  // inputs rounded to bf16 values (exact in every dtype below), so that the reference and the
  // bf16 run start from the same numbers; magnitudes ~0.5 keep the long sums' absolute error
  // (53-row weight gradients from bf16 intermediates) inside kCudaBF16's 2e-2
  auto in = [&](const Shape& sh, double std) { return Tensor::randn(sh, rng, std, DType::F64).to(DType::BF16).to(DType::F64); };
  Tensor x = in({N, C}, 0.5), buf = in({R + 2 * I, C}, 0.125), wd = in({C, I}, 0.15);
  Tensor rq = in({N, H, hd}, 0.5), rk = in({N, KV, hd}, 0.5), rv = in({N, KV, hd}, 0.5), rm = in({N, C}, 0.5);
  const std::vector<int64_t> rows = {H * hd, KV * hd, KV * hd, I, I};
  struct Out { std::vector<Tensor> vals, grads; };
  // joined: weights and gradients as windows of one buffer each (on `dev` in `dt`); else clones
  auto run = [&](Device dev, DType dt, bool joined) {
    auto mv = [&](const Tensor& t) { return t.to(dev).to(dt); };
    Tensor b = mv(buf), gb = Tensor::zeros({R + 2 * I, C}, dt, dev), xd = mv(x).requires_grad_(), wdd = mv(wd).requires_grad_();
    std::vector<Tensor> w = weight_windows(b, gb, rows, joined);
    Tensor p = pos.to(dev);
    auto qkv = qkv_rope(xd, w[0], w[1], w[2], p, H, KV, hd, 1e4);
    Tensor m = mlp_swiglu(xd, w[3], w[4], wdd);
    Tensor loss = add(add(sum(mul(qkv[0], mv(rq))), sum(mul(qkv[1], mv(rk)))),
                      add(sum(mul(qkv[2], mv(rv))), sum(mul(m, mv(rm)))));
    backward(loss);
    Out o{{qkv[0], qkv[1], qkv[2], m}, {xd.grad(), wdd.grad()}};
    for (auto& t : w) o.grads.push_back(t.grad());
    return o;
  };
  Out ref = run(Device::CPU, DType::F64, false);
  for (DType dt : {DType::F32, DType::BF16}) {
    Out got = run(Device::CUDA, dt, true);
    const tol::Tol& t = dt == DType::F32 ? tol::kCudaF32Gemm : tol::kCudaBF16;
    const char* vn[] = {"q", "k", "v", "mlp"};
    const char* gn[] = {"dx", "dWdown", "dWq", "dWk", "dWv", "dWgate", "dWup"};
    for (size_t i = 0; i < ref.vals.size(); i++)
      LOOM_CHECK_CLOSE(tol::compare(got.vals[i].to(Device::CPU).to_vector<double>(), ref.vals[i].to_vector<double>(), t, vn[i]));
    for (size_t i = 0; i < ref.grads.size(); i++)
      LOOM_CHECK_CLOSE(tol::compare(got.grads[i].to(Device::CPU).to_vector<double>(), ref.grads[i].to_vector<double>(), t, gn[i]));
  }
}

// A Llama layer's attention from its input in one node (autograd/ops.h qkv_rope_attention): with
// the weights as windows of one buffer and sequences of >= 512 tokens, bf16 on CUDA runs the
// backward that writes the joined product's gradient rows itself (attention_backward_qkv). Against
// qkv_rope + attention: on the CPU in f64 (separate weights, the reference), on CUDA in f32 (the
// joined op's two-call path), and on CUDA in bf16 with the same joined weights (the same forward
// bits; gradients within bf16's tolerance, dq's reductions running in another order).
TEST_CASE("qkv_rope_attention against qkv_rope and attention", "[optim][attention]") {
  need_gpu();
  const int C = 64, H = 2, KV = 1, hd = 64, R = (H + 2 * KV) * hd;
  const std::vector<int32_t> cuv = {0, 600, 1130};
  const int N = 1130;
  Rng rng(91);
  std::vector<int32_t> pv(N);
  for (int i = 0; i < N; i++) pv[size_t(i)] = i < 600 ? i : i - 600;
  auto in = [&](const Shape& sh, double std) { return Tensor::randn(sh, rng, std, DType::F64).to(DType::BF16).to(DType::F64); };
  Tensor x = in({N, C}, 0.5), buf = in({R, C}, 0.125), rout = in({N, H * hd}, 0.5);
  const std::vector<int64_t> rows = {H * hd, KV * hd, KV * hd};
  struct Out { Tensor val; std::vector<Tensor> grads; };
  auto run = [&](Device dev, DType dt, bool joined, bool one_node) {
    auto mv = [&](const Tensor& t) { return t.to(dev).to(dt); };
    // clones: on the CPU in f64 mv hands back x itself, whose gradient would pile up run after run
    Tensor b = mv(buf).clone(), gb = Tensor::zeros({R, C}, dt, dev), xd = mv(x).clone().requires_grad_();
    std::vector<Tensor> w = weight_windows(b, gb, rows, joined);
    SeqInfo seq = SeqInfo::packed(cuv, dev);
    Tensor p = Tensor::from_vector(pv, {N}).to(dev);
    const double scale = 1.0 / std::sqrt(double(hd));
    Tensor a;
    if (one_node) {
      a = qkv_rope_attention(xd, w[0], w[1], w[2], p, seq, H, KV, hd, 1e4, scale);
    } else {
      auto qkv = qkv_rope(xd, w[0], w[1], w[2], p, H, KV, hd, 1e4);
      a = reshape(attention(qkv[0], qkv[1], qkv[2], seq, true, scale), {N, H * hd});
    }
    backward(sum(mul(a, mv(rout))));
    Out o{a, {xd.grad()}};
    for (auto& t : w) o.grads.push_back(t.grad());
    return o;
  };
  const char* gn[] = {"dx", "dWq", "dWk", "dWv"};
  auto compare = [&](const Out& got, const Out& want, const tol::Tol& t) {
    LOOM_CHECK_CLOSE(tol::compare(got.val.to(Device::CPU).to_vector<double>(), want.val.to(Device::CPU).to_vector<double>(), t, "attention out"));
    for (size_t i = 0; i < want.grads.size(); i++)
      LOOM_CHECK_CLOSE(tol::compare(got.grads[i].to(Device::CPU).to_vector<double>(),
                                    want.grads[i].to(Device::CPU).to_vector<double>(), t, gn[i]));
  };
  Out ref = run(Device::CPU, DType::F64, false, false);
  {
    INFO("CPU f64, one node with joined weights");
    compare(run(Device::CPU, DType::F64, true, true), ref, tol::kSameMathF64);
  }
  {
    INFO("CUDA f32, one node with joined weights");
    compare(run(Device::CUDA, DType::F32, true, true), ref, tol::kCudaF32Gemm);
  }
  {
    INFO("CUDA bf16, one node against the two ops, joined weights both");
    Out one = run(Device::CUDA, DType::BF16, true, true), two = run(Device::CUDA, DType::BF16, true, false);
    CHECK(one.val.to(Device::CPU).to_vector<double>() == two.val.to(Device::CPU).to_vector<double>());
    compare(one, two, tol::kCudaBF16);
  }
}

// A ViT block's attention from its normed input in one node (autograd/ops.h qkv_attention): its
// backward writes dq | dk | dv as the rows of one gradient (attention_backward_qkv without RoPE;
// bf16 on CUDA: the one-tile backward at 49 tokens, the warp-specialized one at 196), so that the
// projection's backward is one product each for dx, dW and db. Against linear_split + attention:
// on the CPU in f64 (the reference), on CUDA in f32 (the strided copies), and in bf16 against the
// two ops on CUDA (the same forward bits; gradients within bf16's tolerance: the products sum in
// another order).
TEST_CASE("qkv_attention against linear_split and attention", "[optim][attention]") {
  need_gpu();
  const int C = 96, H = 2, hd = 64, D = H * hd;
  Rng rng(uint64_t(std::random_device{}()));
  for (const int L : {49, 196}) {
    const int B = L == 49 ? 7 : 3, N = B * L;
    auto in = [&](const Shape& sh, double std) { return Tensor::randn(sh, rng, std, DType::F64).to(DType::BF16).to(DType::F64); };
    Tensor x = in({N, C}, 0.5), w = in({3 * D, C}, 0.1), b = in({3 * D}, 0.1), rout = in({N, D}, 0.5);
    struct Out { Tensor val; std::vector<Tensor> grads; };
    auto run = [&](Device dev, DType dt, bool one_node) {
      auto mv = [&](const Tensor& t) { return t.to(dev).to(dt).clone(); };
      Tensor xd = mv(x).requires_grad_(), wd = mv(w).requires_grad_(), bd = mv(b).requires_grad_();
      SeqInfo seq = SeqInfo::dense(B, L, dev);
      const double scale = 1.0 / std::sqrt(double(hd));
      Tensor a;
      if (one_node) {
        a = qkv_attention(xd, wd, bd, seq, H, scale);
      } else {
        auto p = linear_split(xd, wd, bd, 3);
        a = reshape(attention(reshape(p[0], {N, H, hd}), reshape(p[1], {N, H, hd}), reshape(p[2], {N, H, hd}), seq,
                              false, scale),
                    {N, D});
      }
      backward(sum(mul(a, mv(rout))));
      return Out{a, {xd.grad(), wd.grad(), bd.grad()}};
    };
    const char* gn[] = {"dx", "dW", "db"};
    auto compare = [&](const Out& got, const Out& want, const tol::Tol& t) {
      LOOM_CHECK_CLOSE(tol::compare(got.val.to(Device::CPU).to_vector<double>(), want.val.to(Device::CPU).to_vector<double>(), t, "attention out"));
      for (size_t i = 0; i < want.grads.size(); i++)
        LOOM_CHECK_CLOSE(tol::compare(got.grads[i].to(Device::CPU).to_vector<double>(),
                                      want.grads[i].to(Device::CPU).to_vector<double>(), t, gn[i]));
    };
    INFO(L << " tokens a sequence, " << B << " sequences");
    Out ref = run(Device::CPU, DType::F64, false);
    {
      INFO("CPU f64, one node");
      compare(run(Device::CPU, DType::F64, true), ref, tol::kSameMathF64);
    }
    {
      INFO("CUDA f32, one node");
      compare(run(Device::CUDA, DType::F32, true), ref, tol::kCudaF32Gemm);
    }
    {
      INFO("CUDA bf16, one node against the two ops");
      Out one = run(Device::CUDA, DType::BF16, true), two = run(Device::CUDA, DType::BF16, false);
      CHECK(one.val.to(Device::CPU).to_vector<double>() == two.val.to(Device::CPU).to_vector<double>());
      compare(one, two, tol::kCudaBF16);
    }
  }
}

// train.side_weight_grads (autograd.h weight_grads): every weight-gradient product of the ops
// that have one (linear, linear_split, mlp_gelu with the activation kept and recomputed,
// mlp_swiglu joined and apart, qkv_attention, qkv_rope_attention) on the side stream beside the
// main stream's input gradients must give the same bits as one stream, and every gradient must be
// complete when backward() returns. The output projection's weight is also read by a matmul, whose
// backward adds into its gradient on the main stream after a branch wrote it (the join before a
// main-stream write). The 1-D parameters' gradients are windows of one buffer, as in the
// optimizer's flat buffers: the biases (written by branches, fc1's by the main stream's DGELU
// product) beside two LayerNorms' gains and shifts (written by the main stream), so that the
// main stream writes bytes of a buffer that pending branches write other bytes of.
// Deterministic attention, so that the two runs can be the same bits; fresh inputs every run.
TEST_CASE("weight gradients beside the backward: the same bits as one stream", "[optim][attention]") {
  need_gpu();
  const int C = 128, H = 2, hd = 64, I = 96, L = 49, B = 5, N = B * L;
  Rng rng(uint64_t(std::random_device{}()));
  auto in = [&](const Shape& sh, double std) { return Tensor::randn(sh, rng, std, DType::F64).to(DType::BF16); };
  Tensor x = in({N, C}, 0.5), wqkv = in({3 * C, C}, 0.08), bqkv = in({3 * C}, 0.1), wo = in({C, C}, 0.08),
         bo = in({C}, 0.1), w1 = in({4 * C, C}, 0.08), b1 = in({4 * C}, 0.1), w2 = in({C, 4 * C}, 0.05),
         b2 = in({C}, 0.1), lm = in({3 * C + 3 * I, C}, 0.08), wd = in({C, I}, 0.08), wd2 = in({C, I}, 0.08),
         ws = in({2 * C, C}, 0.08), r = in({N, C}, 0.5), g1 = in({C}, 0.1), s1 = in({C}, 0.1),
         g2 = in({C}, 0.1), s2 = in({C}, 0.1);
  std::vector<int32_t> pv(static_cast<size_t>(N));
  for (int i = 0; i < N; i++) pv[size_t(i)] = i % L;
  const Tensor pos = Tensor::from_vector(pv, {N}).to(Device::CUDA);
  const bool was_det = cuda::deterministic_attention();
  cuda::set_deterministic_attention(true);
  auto run = [&](bool side) {
    set_side_weight_grads(side);
    auto mv = [](const Tensor& t) { return t.to(Device::CUDA).clone().requires_grad_(); };
    std::vector<Tensor> p = {mv(x), mv(wqkv), mv(bqkv), mv(wo), mv(bo), mv(w1), mv(b1), mv(w2), mv(b2), mv(wd), mv(wd2), mv(ws),
                             mv(g1), mv(s1), mv(g2), mv(s2)};
    // one gradient buffer for the 1-D parameters, in an order that interleaves branch-written
    // windows (biases) with main-stream-written ones (b1, the norms)
    const int one_d[] = {2, 12, 4, 13, 6, 14, 8, 15};
    int64_t flat_n = 0;
    for (int i : one_d) flat_n += p[size_t(i)].numel();
    Tensor flat = Tensor::zeros({flat_n}, DType::BF16, Device::CUDA);
    int64_t at = 0;
    for (int i : one_d) {
      p[size_t(i)].set_grad(flat.narrow(0, at, p[size_t(i)].numel()));
      at += p[size_t(i)].numel();
    }
    // the Llama weights as windows of one buffer (q | k | v, gate | up: the joined products), and
    // a second gate | up apart (clones: mlp_swiglu's separate products)
    Tensor lmb = lm.to(Device::CUDA).clone(), glm = Tensor::zeros_like(lmb);
    std::vector<Tensor> lw = weight_windows(lmb, glm, {C, C, C, I, I}, true);
    std::vector<Tensor> lw2 = weight_windows(lm.to(Device::CUDA).clone(), glm, {C, C, C, I, I}, false);
    SeqInfo seq = SeqInfo::dense(B, L, Device::CUDA);
    const double scale = 1.0 / std::sqrt(double(hd));
    // wo through a matmul first: its backward runs last and adds into wo's gradient on the main
    // stream after the linear's branch wrote it
    Tensor x0 = add(p[0], matmul(p[0], p[3], false, true));
    Tensor a = qkv_attention(x0, p[1], p[2], seq, H, scale);
    Tensor y = linear(a, p[3], p[4], x0);
    Tensor z = mlp_gelu(layernorm(y, p[12], p[13], 1e-6), p[5], p[6], p[7], p[8], y, /*keep_activation=*/false);
    z = mlp_gelu(layernorm(z, p[14], p[15], 1e-6), p[5], p[6], p[7], p[8], z,
                 /*keep_activation=*/true);  // the same weights again
    Tensor u = qkv_rope_attention(z, lw[0], lw[1], lw[2], pos, seq, H, H, hd, 1e4, scale);
    u = mlp_swiglu(u, lw[3], lw[4], p[9], u);
    u = mlp_swiglu(u, lw2[3], lw2[4], p[10], u);
    std::vector<Tensor> sp = linear_split(u, p[11], Tensor(), 2);
    Tensor v = add(sp[0], sp[1]);
    backward(sum(mul(v, r.to(Device::CUDA))));
    std::vector<Tensor> g;
    for (auto& t : p) g.push_back(t.grad().to(Device::CPU));  // each copy waits for the main stream only
    g.push_back(glm.to(Device::CPU));
    for (int i : {3, 4}) g.push_back(lw2[size_t(i)].grad().to(Device::CPU));
    set_side_weight_grads(false);
    return g;
  };
  const char* names[] = {"dx", "dWqkv", "dbqkv", "dWo", "dbo", "dW1", "db1", "dW2", "db2", "dWdown", "dWdown2",
                         "dWsplit", "dgain1", "dshift1", "dgain2", "dshift2", "d(q|k|v|gate|up)", "dWgate2", "dWup2"};
  std::vector<Tensor> one = run(false), two = run(true);
  cuda::set_deterministic_attention(was_det);
  for (size_t i = 0; i < one.size(); i++) {
    INFO(names[i]);
    CHECK(one[i].to_vector<double>() == two[i].to_vector<double>());
  }
}

// Data parallel's gradient buckets with the weight-gradient branches on: a bucket is complete on
// the host when its parameters' last nodes are done, but their last writes may still be running
// on the side stream. Each launch here snapshots its bucket on the comm stream after
// wait_for_gradient_writes (what DataParallel::launch does before NCCL's average), and every
// snapshot must equal the bucket's final gradients bit for bit. The first layer's input needs no
// gradient, so its node is one weight-gradient branch (a ~0.4 ms product) and nothing on the
// main stream: without the wait on the branches the snapshot of w1 is taken while that product
// runs. Nothing is allocated inside the steps (inputs and snapshots made before them), so that
// no cudaMalloc synchronizes the device and hides a missing wait.
TEST_CASE("gradient buckets read the weight-gradient branches' writes", "[optim][distributed]") {
  need_gpu();
  const int64_t N = 32768, C0 = 4096, C = 1024;
  Rng rng(uint64_t(std::random_device{}()));
  auto param = [&](const Shape& sh, double std) {
    return Tensor::randn(sh, rng, std, DType::F64).to(DType::F32).to(Device::CUDA).requires_grad_();
  };
  Tensor w1 = param({C, C0}, 0.015), b1 = param({C}, 0.1), w2 = param({C, C}, 0.03), b2 = param({C}, 0.1);
  std::vector<ParamGroup> groups = {{"matrices", 1.0, 0.0, {{"w1", &w1}, {"w2", &w2}}},
                                    {"vectors", 1.0, 0.0, {{"b1", &b1}, {"b2", &b2}}}};
  Optimizer opt(groups, OptimConfig{}, DType::BF16, Device::CUDA);
  const Tensor x = Tensor::randn({N, C0}, rng, 1.0, DType::F64).to(DType::BF16).to(Device::CUDA);  // no gradient
  const Tensor r = Tensor::randn({N, C}, rng, 1.0, DType::F64).to(DType::BF16).to(Device::CUDA);
  struct Snap {
    GradBuckets::Bucket bucket;
    Tensor values;
    void* event = nullptr;
    bool taken = false;
  };
  std::vector<Snap> snaps;
  auto launch = [&](const Tensor& buf, const GradBuckets::Bucket& b) {
    for (auto& sn : snaps)
      if (sn.bucket.buffer == b.buffer && sn.bucket.offset == b.offset) {
        REQUIRE_FALSE(sn.taken);
        wait_for_gradient_writes(cuda::comm_stream(), sn.event);
        const size_t es = dtype_size(buf.dtype());
        cuda::memcpy_d2d(sn.values.raw(), static_cast<const char*>(buf.raw()) + size_t(b.offset) * es,
                         size_t(b.numel) * es, cuda::comm_stream());
        sn.taken = true;
        return;
      }
    FAIL("a bucket that GradBuckets did not list");
  };
  GradBuckets gb(opt.grad_buffers(), opt.grad_offsets(), 1 << 20, launch);  // a weight a bucket
  for (auto& b : gb.buckets())
    snaps.push_back({b, Tensor::empty({b.numel}, DType::BF16, Device::CUDA), cuda::event_create(false)});
  set_side_weight_grads(true);
  for (int step = 0; step < 4; step++) {
    INFO("backward " << step);
    for (auto& sn : snaps) sn.taken = false;
    opt.zero_grad();
    Tensor y = linear(gelu(linear(x, w1, b1)), w2, b2);
    gb.begin();
    backward(sum(mul(y, r)));
    gb.finish();
    cuda::synchronize();  // the comm stream's copies too
    if (step > 0) CHECK(gb.launched_early() >= 1);  // launched while the backward was still going on
    for (auto& sn : snaps) {
      INFO("bucket at " << sn.bucket.offset << " of buffer " << sn.bucket.buffer);
      REQUIRE(sn.taken);
      const Tensor now = opt.grad_buffers()[size_t(sn.bucket.buffer)].narrow(0, sn.bucket.offset, sn.bucket.numel);
      const std::vector<double> got = sn.values.to(Device::CPU).to_vector<double>(),
                                want = now.to(Device::CPU).to_vector<double>();
      int64_t differ = 0;  // a count, not the vectors: a failure prints one number, not 4M
      for (size_t i = 0; i < want.size(); i++) differ += got[i] != want[i] ? 1 : 0;
      CHECK(differ == 0);
    }
  }
  set_side_weight_grads(false);
  for (auto& sn : snaps) cuda::event_destroy(sn.event);
}

TEST_CASE("Tensor::copy_ into a window of a CUDA tensor, from every kind of source", "[cuda][tensor]") {
  // A window (narrow) of a contiguous CUDA tensor takes one 2-D copy; a contiguous CUDA source
  // of its dtype goes straight into it, the others (CPU, another dtype, strided) through a
  // contiguous temporary. The columns outside the window keep their poison.
  need_gpu();
  Rng rng(uint64_t(std::random_device{}()));
  const int64_t R = 37, C = 21, c0 = 5, w = 9;
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor host = Tensor::randn({R, w}, rng, 1.0, DType::F32).to(dt);   // the values, as dt
    Tensor wide = Tensor::randn({R, w + 7}, rng, 1.0, DType::F32).to(dt);
    wide.narrow(1, 3, w).copy_(host);                                   // a strided source of the same values
    const std::vector<std::pair<const char*, Tensor>> sources = {
        {"CUDA contiguous", host.to(Device::CUDA)},
        {"CPU", host},
        {"CUDA f64", host.to(DType::F64).to(Device::CUDA)},
        {"CUDA strided", wide.to(Device::CUDA).narrow(1, 3, w)}};
    for (const auto& [what, src] : sources) {
      INFO(what << ", " << dtype_name(dt));
      Tensor dst = Tensor::full({R, C}, std::nan(""), dt, Device::CUDA);
      dst.narrow(1, c0, w).copy_(src);
      std::vector<double> got = dst.to(Device::CPU).to_vector<double>(), want = host.to_vector<double>();
      for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) {
          const double g = got[size_t(r * C + c)];
          if (c < c0 || c >= c0 + w) CHECK(std::isnan(g));
          else CHECK(g == want[size_t(r * w + c - c0)]);
        }
    }
  }
}

TEST_CASE("Tensor::contiguous of strided CUDA views: windows, transposes, broadcasts", "[cuda][tensor]") {
  // into a contiguous tensor of the same device and dtype in one pass: a window by one 2-D copy,
  // other layouts by the strided kernel; the values against the same views on the CPU
  need_gpu();
  Rng rng(uint64_t(std::random_device{}()));
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor host = Tensor::randn({6, 11, 13}, rng, 1.0, DType::F32).to(dt), dev = host.to(Device::CUDA);
    Tensor row = Tensor::randn({1, 13}, rng, 1.0, DType::F32).to(dt);
    const std::vector<std::pair<const char*, std::function<Tensor(const Tensor&)>>> views = {
        {"window of the last dim", [](const Tensor& t) { return t.narrow(2, 4, 7); }},
        {"window of the middle dim", [](const Tensor& t) { return t.narrow(1, 2, 5); }},
        {"window of both", [](const Tensor& t) { return t.narrow(1, 1, 9).narrow(2, 3, 1); }},
        {"transpose", [](const Tensor& t) { return t.transpose(1, 2); }}};
    for (const auto& [what, view] : views) {
      INFO(what << ", " << dtype_name(dt));
      Tensor v = view(dev);
      REQUIRE_FALSE(v.is_contiguous());
      Tensor c = v.contiguous();
      CHECK(c.is_contiguous());
      CHECK(c.to(Device::CPU).to_vector<double>() == view(host).contiguous().to_vector<double>());
    }
    INFO("broadcast, " << dtype_name(dt));
    Tensor b = row.to(Device::CUDA).expand({5, 13}).contiguous();
    std::vector<double> got = b.to(Device::CPU).to_vector<double>(), want = row.to_vector<double>();
    for (int i = 0; i < 5 * 13; i++) CHECK(got[size_t(i)] == want[size_t(i % 13)]);
  }
}
