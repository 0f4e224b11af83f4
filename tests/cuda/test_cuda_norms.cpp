// test_cuda_norms.cpp: kernels/cuda/norms.cu and norms_backward.cu (layernorm and rmsnorm
// (+ residual), forward and backward) against the loom::cpu reference, f32 and bf16
// (tests/cuda/cuda_kernel_test_util.h).
// Skipped without a GPU.
//   bash tools/gpu-kernels.sh tests/cuda/test_cuda_norms.cpp
#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "kernels/kernels.h"
#include "tests/tolerances.h"

#include "tests/cuda/cuda_kernel_test_util.h"

TEMPLATE_TEST_CASE("norms: layernorm / rmsnorm (+residual) forward and backward", "[norms]", float, bf16, f16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int C; };
  // C covers: tiny, < 32, warp paths (bf16 backward: 1 vector per lane at 64 and 200, 2 at 384,
  // 3 at 576 and 768, 4 at 1024), not a multiple of the vector (scalar), 128-thread and
  // 1024-thread groups, and the generic block-per-row kernel (5001 scalar, 40000 bf16 vectors)
  for (Case c : {Case{1, 1}, Case{7, 31}, Case{33, 64}, Case{5, 200}, Case{70, 384}, Case{65, 576}, Case{9, 768},
                 Case{6, 1024}, Case{4, 1030},
                 Case{3, 3000}, Case{2, 5001}, Case{2, 20000}, Case{1, 40000}}) {
    INFO("N " << c.N << " C " << c.C);
    const int64_t n = c.N * c.C;
    auto hx = rounded<T>(rnd(n, 50, -2.f, 3.f)), hr = rounded<T>(rnd(n, 51));
    auto hw = rounded<T>(rnd(c.C, 52, 0.5f, 1.5f)), hb = rounded<T>(rnd(c.C, 53));
    auto hd = rounded<T>(rnd(n, 54));
    DBuf<T> x(hx), r(hr), w(hw), b(hb), dout(hd);
    for (bool rms : {false, true}) {
      for (bool resid : {false, true}) {
        INFO((rms ? "rmsnorm" : "layernorm") << (resid ? " residual" : ""));
        std::vector<float> rout(n), rres(n), rmean(c.N), rrstd(c.N);
        DBuf<T> out(n), ro(n);
        DBuf<float> mean(c.N), rstd(c.N);
        std::vector<float> hin = hx;  // the normalized input (resid: the rounded sum)
        if (!resid) {
          if (rms) cpu::rmsnorm_forward(rout.data(), rrstd.data(), hx.data(), hw.data(), c.N, c.C, 1e-5, nullptr);
          else cpu::layernorm_forward(rout.data(), rmean.data(), rrstd.data(), hx.data(), hw.data(), hb.data(), c.N, c.C, 1e-6, nullptr);
          if (rms) cu::rmsnorm_forward(out.p, rstd.p, x.p, w.p, c.N, c.C, 1e-5, S());
          else cu::layernorm_forward(out.p, mean.p, rstd.p, x.p, w.p, b.p, c.N, c.C, 1e-6, S());
        } else {
          // the reference normalizes resid + x rounded to T, as the kernel does
          std::vector<float> sum(n);
          for (int64_t i = 0; i < n; i++) sum[i] = hr[i] + hx[i];
          sum = rounded<T>(sum);
          hin = sum;
          if (rms) cpu::rmsnorm_forward(rout.data(), rrstd.data(), sum.data(), hw.data(), c.N, c.C, 1e-5, nullptr);
          else cpu::layernorm_forward(rout.data(), rmean.data(), rrstd.data(), sum.data(), hw.data(), hb.data(), c.N, c.C, 1e-6, nullptr);
          if (rms) cu::residual_rmsnorm_forward(ro.p, out.p, rstd.p, r.p, x.p, w.p, c.N, c.C, 1e-5, S());
          else cu::residual_layernorm_forward(ro.p, out.p, mean.p, rstd.p, r.p, x.p, w.p, b.p, c.N, c.C, 1e-6, S());
          CHECK_CLOSE(ro.get(), sum, t, "resid_out");
        }
        CHECK_CLOSE(out.get(), rout, t, "out");
        CHECK_CLOSE(rstd.get(), rrstd, t, "rstd");
        if (!rms) CHECK_CLOSE(mean.get(), rmean, t, "mean");
        // backward from the reference's statistics (the same for both); the residual pair also
        // adds the gradient that reaches the sum by the residual stream (dresid: hr here)
        DBuf<float> smean(rmean), srstd(rrstd);
        DBuf<T> xin(hin);
        auto hdw = rounded<T>(rnd(c.C, 55)), hdb = rounded<T>(rnd(c.C, 56));
        std::vector<float> rdx(n), rdw = hdw, rdb = hdb;
        DBuf<T> dx(n), dw(hdw), db(hdb);
        dx.poison();
        const float* rres_in = resid ? hr.data() : nullptr;
        const T* dres_in = resid ? r.p : nullptr;
        if (rms) {
          cpu::rmsnorm_backward(rdx.data(), rres_in, rdw.data(), hd.data(), hin.data(), hw.data(), rrstd.data(), c.N,
                                c.C, nullptr);
          cu::rmsnorm_backward(dx.p, dres_in, dw.p, dout.p, xin.p, w.p, srstd.p, c.N, c.C, S());
        } else {
          cpu::layernorm_backward(rdx.data(), rres_in, rdw.data(), rdb.data(), hd.data(), hin.data(), hw.data(),
                                  rmean.data(), rrstd.data(), c.N, c.C, nullptr);
          cu::layernorm_backward(dx.p, dres_in, dw.p, db.p, dout.p, xin.p, w.p, smean.p, srstd.p, c.N, c.C, S());
          CHECK_CLOSE(db.get(), rdb, t, "dbias (+=)");
        }
        CHECK_CLOSE(dx.get(), rdx, t, "dinp");
        CHECK_CLOSE(dw.get(), rdw, t, "dweight (+=)");
      }
    }
  }
}

TEST_CASE("norms: backward is deterministic at a large shape", "[norms]") {
  need_gpu();
  const int64_t N = 4099;
  const int C = 768;
  auto hx = rounded<bf16>(rnd(N * C, 57)), hd = rounded<bf16>(rnd(N * C, 58)), hw = rounded<bf16>(rnd(C, 59));
  std::vector<float> rm(N), rr(N), ro(N * C);
  cpu::layernorm_forward(ro.data(), rm.data(), rr.data(), hx.data(), hw.data(), hw.data(), N, C, 1e-6, nullptr);
  DBuf<bf16> x(hx), d(hd), w(hw), dx(N * C);
  DBuf<float> m(rm), r(rr);
  std::vector<float> first;
  for (int rep = 0; rep < 3; rep++) {
    DBuf<bf16> dw(std::vector<float>(C, 0.f)), db(std::vector<float>(C, 0.f));
    cu::layernorm_backward(dx.p, static_cast<const bf16*>(nullptr), dw.p, db.p, d.p, x.p, w.p, m.p, r.p, N, C, S());
    auto g = dw.get();
    auto gb = db.get();
    g.insert(g.end(), gb.begin(), gb.end());
    if (rep == 0) first = g;
    else CHECK(g == first);
  }
}

// Runs f with the environment variable name set to value, then puts it back as it was (the
// kernels read their LOOM_* switches at every call).
static void with_env(const char* name, const char* value, const std::function<void()>& f) {
  const char* before = std::getenv(name);
  const std::string keep = before ? before : "";
  setenv(name, value, 1);
  f();
  if (before) setenv(name, keep.c_str(), 1);
  else unsetenv(name);
}

// The warp-per-row backward with rows in flight (norm_bwd_rows, the default for 16-byte vectors)
// against v2 (LOOM_NORM_BWD_ST=0), within the table's tolerance (another grid adds the rows into
// other partials; the count of dinp values whose bits differ is printed). Vectors per lane 1-4, 2 and 3 stages,
// more rows than the resident warps and fewer, with and without dresid.
TEMPLATE_TEST_CASE("norms: the rows-in-flight backward against v2", "[norms]", float, bf16) {
  need_gpu();
  using T = TestType;
  const auto t = tol_of<T>();
  struct Case { int64_t N; int C; };
  for (Case c : {Case{4099, 64}, Case{3, 384}, Case{2500, 576}, Case{4099, 768}, Case{1500, 1024}}) {
    const int64_t n = c.N * c.C;
    auto hx = rounded<T>(rnd(n, 60, -2.f, 3.f)), hr = rounded<T>(rnd(n, 61)), hd = rounded<T>(rnd(n, 62));
    auto hw = rounded<T>(rnd(c.C, 63, 0.5f, 1.5f));
    std::vector<float> hm(c.N), hs(c.N), ho(n);
    cpu::layernorm_forward(ho.data(), hm.data(), hs.data(), hx.data(), hw.data(), hw.data(), c.N, c.C, 1e-6, nullptr);
    DBuf<T> x(hx), r(hr), d(hd), w(hw);
    DBuf<float> m(hm), rs(hs);
    for (bool rms : {false, true})
      for (bool resid : {false, true})
        for (const char* st : {"2", "3"}) {
          INFO("N " << c.N << " C " << c.C << (rms ? " rmsnorm" : " layernorm") << (resid ? " dresid" : "")
                    << " stages " << st);
          std::vector<float> dx[2], dw[2], db[2];
          int i = 0;
          for (const char* which : {"0", st}) {
            DBuf<T> gx(n), gw(std::vector<float>(c.C, 0.f)), gb(std::vector<float>(c.C, 0.f));
            gx.poison();
            const T* dres = resid ? r.p : nullptr;
            with_env("LOOM_NORM_BWD_ST", which, [&] {
              if (rms) cu::rmsnorm_backward(gx.p, dres, gw.p, d.p, x.p, w.p, rs.p, c.N, c.C, S());
              else cu::layernorm_backward(gx.p, dres, gw.p, gb.p, d.p, x.p, w.p, m.p, rs.p, c.N, c.C, S());
            });
            dx[i] = gx.get(), dw[i] = gw.get(), db[i] = gb.get();
            i++;
          }
          REQUIRE(dx[0].size() == dx[1].size());
          size_t ndiff = 0;
          for (size_t j = 0; j < dx[0].size(); j++) ndiff += std::memcmp(&dx[0][j], &dx[1][j], sizeof(float)) != 0;
          INFO(ndiff << " of " << dx[0].size() << " dinp values differ from v2's");
          std::printf("rows-in-flight backward N %lld C %d %s%s stages %s: %zu of %zu dinp values differ from v2's\n",
                      (long long)c.N, c.C, rms ? "rmsnorm" : "layernorm", resid ? " dresid" : "", st, ndiff,
                      dx[0].size());
          CHECK_CLOSE(dx[1], dx[0], t, "dinp");
          CHECK_CLOSE(dw[1], dw[0], t, "dweight");
          if (!rms) CHECK_CLOSE(db[1], db[0], t, "dbias");
        }
  }
}

// The rows-in-flight backward's block partials: the 8 warps' rows summed after one barrier
// (default) and in v2's eight turns (LOOM_NORM_BWD_TURNS=1) add the same terms in the same order
// on the same grid, so dweight and dbias (and dinp, untouched by the change) agree bit for bit.
// Vectors per lane 1-4, fewer rows than the resident warps and many more, dweight accumulating
// into a nonzero start.
TEST_CASE("norms: the backward's block partials after one barrier and in eight turns, bit for bit", "[norms]") {
  need_gpu();
  using T = bf16;
  struct Case { int64_t N; int C; };
  for (Case c : {Case{12544, 768}, Case{50, 384}, Case{20000, 576}, Case{3001, 256}, Case{777, 1024}}) {
    const int64_t n = c.N * c.C;
    auto hx = rounded<T>(rnd(n, 70, -2.f, 3.f)), hr = rounded<T>(rnd(n, 71)), hd = rounded<T>(rnd(n, 72));
    auto hw = rounded<T>(rnd(c.C, 73, 0.5f, 1.5f)), h0 = rounded<T>(rnd(c.C, 74));
    std::vector<float> hm(c.N), hs(c.N), ho(n);
    cpu::layernorm_forward(ho.data(), hm.data(), hs.data(), hx.data(), hw.data(), hw.data(), c.N, c.C, 1e-6, nullptr);
    DBuf<T> x(hx), r(hr), d(hd), w(hw);
    DBuf<float> m(hm), rs(hs);
    for (bool rms : {false, true}) {
      INFO("N " << c.N << " C " << c.C << (rms ? " rmsnorm" : " layernorm"));
      std::vector<float> dx[2], dw[2], db[2];
      int i = 0;
      for (const char* turns : {"1", "0"}) {
        DBuf<T> gx(n), gw(h0), gb(h0);
        gx.poison();
        with_env("LOOM_NORM_BWD_TURNS", turns, [&] {
          if (rms) cu::rmsnorm_backward(gx.p, r.p, gw.p, d.p, x.p, w.p, rs.p, c.N, c.C, S());
          else cu::layernorm_backward(gx.p, r.p, gw.p, gb.p, d.p, x.p, w.p, m.p, rs.p, c.N, c.C, S());
        });
        dx[i] = gx.get(), dw[i] = gw.get(), db[i] = gb.get();
        i++;
      }
      CHECK(dx[1] == dx[0]);
      CHECK(dw[1] == dw[0]);
      CHECK(db[1] == db[0]);
    }
  }
}
