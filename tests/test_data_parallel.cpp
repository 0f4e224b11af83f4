// test_data_parallel.cpp: the CPU collectives (trainer/comm_tcp.cpp: the average and the gathers
// over TCP, ranks as threads on localhost) and what trainer/data_parallel.cpp builds on them
// (gather_over_ranks for a global InfoNCE, ZeRO-1's sharded optimizer). The launchers and the
// rendezvous: test_distributed.cpp; whole CPU runs of several processes: tests/data_parallel.sh.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "autograd/autograd.h"
#include "autograd/ops.h"
#include "optim/optimizer.h"
#include "trainer/distributed.h"
#include "trainer/net.h"
#include "tests/comm_test_util.h"

using namespace loom;
using Catch::Matchers::Contains;

template <class T>
static void check_tcp_average(int world, size_t n, uint32_t seed) {
  std::vector<tcp::Comm> c = tcp_ranks(world);
  std::vector<std::vector<T>> buf(static_cast<size_t>(world), std::vector<T>(n));
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, 3.0);
  for (auto& b : buf)
    for (T& x : b) x = T(nd(rng));
  std::vector<T> want(n);  // the mean in rank order in double, rounded once
  for (size_t i = 0; i < n; i++) {
    double s = 0;
    for (int r = 0; r < world; r++) s += double(buf[size_t(r)][i]);
    want[i] = T(s / world);
  }
  const DType dt = sizeof(T) == 4 ? DType::F32 : DType::F64;
  std::vector<std::thread> t;
  for (int r = 0; r < world; r++)
    t.emplace_back([&, r] { c[size_t(r)].all_reduce_avg(buf[size_t(r)].data(), n, dt); });
  for (auto& th : t) th.join();
  for (int r = 0; r < world; r++) {
    INFO("rank " << r << " of " << world << ", " << n << " elements");
    CHECK(std::memcmp(buf[size_t(r)].data(), want.data(), n * sizeof(T)) == 0);  // the same bits everywhere
  }
}

TEST_CASE("CPU collectives: every rank gets the same mean, summed in rank order, over several windows", "[distributed]") {
  const uint32_t seed = std::random_device{}();
  INFO("seed " << seed);
  const size_t per_chunk_f32 = tcp::Comm::kChunkBytes / 4;
  check_tcp_average<float>(3, per_chunk_f32 * 2 + 12345, seed);  // two whole chunks and a part
  check_tcp_average<double>(2, per_chunk_f32 / 2 + 7, seed + 1);  // one f64 chunk and a part
  check_tcp_average<float>(4, 1, seed + 2);                       // the loss: one value
  check_tcp_average<float>(5, 3, seed + 3);                       // fewer elements than ranks: empty parts
  check_tcp_average<double>(6, per_chunk_f32 / 2 + 1001, seed + 4);  // six parts of unequal sizes, two windows
}

TEST_CASE("CPU collectives: a gather puts every rank's part in rank order, the same bits on every rank", "[distributed]") {
  const uint32_t seed = std::random_device{}();
  INFO("seed " << seed);
  for (auto [world, n] : {std::pair<int, size_t>{3, 12345}, {2, tcp::Comm::kChunkBytes / 4 + 3}, {4, 1}}) {
    std::vector<tcp::Comm> c = tcp_ranks(world);
    std::mt19937 rng(seed + uint32_t(world));
    std::normal_distribution<float> nd(0.0f, 3.0f);
    std::vector<std::vector<float>> part(static_cast<size_t>(world), std::vector<float>(n));
    std::vector<float> want;
    for (auto& p : part) {
      for (float& x : p) x = nd(rng);
      want.insert(want.end(), p.begin(), p.end());
    }
    // every output starts as NaN: a part not written fails the comparison
    std::vector<std::vector<float>> out(static_cast<size_t>(world), std::vector<float>(n * static_cast<size_t>(world), NAN));
    std::vector<std::thread> t;
    for (int r = 0; r < world; r++)
      t.emplace_back([&, r] { c[size_t(r)].all_gather(part[size_t(r)].data(), out[size_t(r)].data(), n * 4); });
    for (auto& th : t) th.join();
    for (int r = 0; r < world; r++) {
      INFO("rank " << r << " of " << world << ", " << n << " floats a rank");
      CHECK(std::memcmp(out[size_t(r)].data(), want.data(), want.size() * 4) == 0);
    }
  }
}

// The global InfoNCE of data parallel (train.dist_infonce = global): every rank gathers the
// pooled features of all ranks, so its loss is the loss of the whole batch, and its rows' gradient
// (times the world size, which the ranks' gradient mean divides again) is the whole batch's.
TEST_CASE("gather_over_ranks: a global InfoNCE over ranks is the whole batch's, loss and gradient", "[distributed]") {
  const uint32_t seed = std::random_device{}();
  INFO("seed " << seed);
  const int world = 2, B = 5, D = 7;
  const double tau = 0.1;
  Rng rng(seed);
  Tensor a = Tensor::randn({world * B, D}, rng, 1.0, DType::F64), b = Tensor::randn({world * B, D}, rng, 1.0, DType::F64);
  a.requires_grad_(true);
  b.requires_grad_(true);
  Tensor whole = infonce_loss(a, b, tau);  // one process with the whole batch
  backward(whole);
  const std::vector<double> ga = a.grad().to_vector<double>(), gb = b.grad().to_vector<double>();
  const double loss_whole = whole.item();

  std::vector<tcp::Comm> c = tcp_ranks(world);
  std::vector<double> loss(world, NAN);
  std::vector<std::vector<double>> da(world), db(world);
  std::vector<std::thread> t;
  for (int r = 0; r < world; r++)
    t.emplace_back([&, r] {
      Tensor ar = a.narrow(0, int64_t(r) * B, B).clone(), br = b.narrow(0, int64_t(r) * B, B).clone();
      ar.requires_grad_(true);
      br.requires_grad_(true);
      auto gather = [&](const Tensor& x, Tensor& out) {
        c[size_t(r)].all_gather(x.raw(), out.raw(), size_t(x.numel()) * 8);
      };
      Tensor l = infonce_loss(gather_over_ranks(ar, r, world, gather), gather_over_ranks(br, r, world, gather), tau);
      backward(l);
      loss[size_t(r)] = l.item();
      da[size_t(r)] = ar.grad().to_vector<double>();
      db[size_t(r)] = br.grad().to_vector<double>();
    });
  for (auto& th : t) th.join();
  for (int r = 0; r < world; r++) {
    INFO("rank " << r);
    CHECK(loss[size_t(r)] == loss_whole);  // the same inputs in the same order: the same bits
    for (int i = 0; i < B * D; i++) {
      CHECK(da[size_t(r)][size_t(i)] == world * ga[size_t(r * B * D + i)]);
      CHECK(db[size_t(r)][size_t(i)] == world * gb[size_t(r * B * D + i)]);
    }
  }
}

// ZeRO-1 (Optimizer::shard): ranks as threads, each with the same parameters and gradients;
// every rank's weights and the gathered state must be what one unsharded optimizer computes,
// bit for bit, and checkpoints must move between the two layouts.
TEST_CASE("ZeRO-1: sharded optimizers give the unsharded weights and state, and load each other's", "[distributed]") {
  const uint32_t seed = std::random_device{}();
  INFO("seed " << seed);
  const int world = 3;
  // group sizes: 300 x 7 + 130 (parts of 640 / 704 / 786 elements, bounds multiples of 64),
  // and 5 + 2 (smaller than one part: ranks 0 and 1 own nothing)
  struct Params {
    Tensor w, b, g, h;
    std::vector<ParamGroup> groups() {
      return {{"decay", 1.0, 0.1, {{"w", &w}, {"b", &b}}}, {"no_decay", 0.5, 0.0, {{"g", &g}, {"h", &h}}}};
    }
    explicit Params(uint32_t s) {
      Rng r(s);
      w = Tensor::randn({300, 7}, r);
      b = Tensor::randn({130}, r);
      g = Tensor::randn({5}, r);
      h = Tensor::randn({2}, r);
      for (Tensor* t : {&w, &b, &g, &h}) t->requires_grad_(true);
    }
  };
  for (std::string kind : {"adamw", "sgd"}) {
    INFO(kind);
    OptimConfig oc;
    oc.kind = kind;
    auto set_grads = [&](Params& p, int step) {  // the same on every rank, as after the average
      Rng r(seed + uint32_t(step));
      for (Tensor* t : {&p.w, &p.b, &p.g, &p.h}) t->grad().copy_(Tensor::randn(t->shape(), r, 0.3));
    };
    auto train = [&](Params& p, Optimizer& o, int from, int to) {
      for (int k = from; k < to; k++) {
        set_grads(p, k);
        o.clip_grad_norm(1.0);
        o.step(1e-2 * (k + 1));
      }
    };
    Params ref_p(seed);
    Optimizer ref(ref_p.groups(), oc, DType::F32, Device::CPU);
    train(ref_p, ref, 0, 3);
    std::map<std::string, Tensor> ref_sd;  // copies: state_dict() hands out the live buffers
    for (auto& [k, t] : ref.state_dict()) ref_sd[k] = t.clone();

    std::vector<tcp::Comm> c = tcp_ranks(world);
    std::vector<std::unique_ptr<Params>> ps;
    std::vector<std::unique_ptr<Optimizer>> os;
    for (int r = 0; r < world; r++) {
      ps.push_back(std::make_unique<Params>(seed));
      os.push_back(std::make_unique<Optimizer>(ps.back()->groups(), oc, DType::F32, Device::CPU));
      os.back()->shard(r, world, [&c, r](Tensor& flat, const std::vector<int64_t>& bounds) {
        std::vector<size_t> b;
        for (int64_t x : bounds) b.push_back(size_t(x) * 4);
        c[size_t(r)].all_gather_parts(flat.raw(), b);
      });
    }
    CHECK(os[0]->owned_parameters() + os[1]->owned_parameters() + os[2]->owned_parameters() == ref.num_parameters());
    CHECK(os[2]->owned_parameters() < ref.num_parameters() / 2);
    std::vector<std::map<std::string, Tensor>> sds(world);
    auto on_ranks = [&](const std::function<void(int)>& f) {
      std::vector<std::thread> t;
      for (int r = 0; r < world; r++) t.emplace_back([&, r] { f(r); });
      for (auto& th : t) th.join();
    };
    on_ranks([&](int r) {
      train(*ps[size_t(r)], *os[size_t(r)], 0, 3);
      sds[size_t(r)] = os[size_t(r)]->state_dict();  // a collective: every rank at once
    });
    auto same = [](const Tensor& a, const Tensor& b) { return a.to_vector<float>() == b.to_vector<float>(); };
    for (int r = 0; r < world; r++) {
      INFO("rank " << r);
      CHECK(same(ps[size_t(r)]->w, ref_p.w));
      CHECK(same(ps[size_t(r)]->h, ref_p.h));
      REQUIRE(sds[size_t(r)].size() == ref_sd.size());
      for (auto& [k, t] : ref_sd) {
        INFO(k);
        CHECK(same(sds[size_t(r)].at(k), t));
      }
    }
    // the sharded state into one unsharded optimizer, the unsharded into fresh sharded ones:
    // three more steps everywhere, the same weights and state again
    Params one_p(seed + 99);
    Optimizer one(one_p.groups(), oc, DType::F32, Device::CPU);
    one.load_state_dict(sds[1], "sharded");
    train(one_p, one, 3, 6);
    train(ref_p, ref, 3, 6);
    on_ranks([&](int r) {
      *ps[size_t(r)] = Params(seed + 7);  // other weights: all of them must come from the state
      os[size_t(r)] = std::make_unique<Optimizer>(ps[size_t(r)]->groups(), oc, DType::F32, Device::CPU);
      os[size_t(r)]->shard(r, world, [&c, r](Tensor& flat, const std::vector<int64_t>& bounds) {
        std::vector<size_t> b;
        for (int64_t x : bounds) b.push_back(size_t(x) * 4);
        c[size_t(r)].all_gather_parts(flat.raw(), b);
      });
    });
    on_ranks([&](int r) {
      os[size_t(r)]->load_state_dict(ref_sd, "unsharded");
      train(*ps[size_t(r)], *os[size_t(r)], 3, 6);
      sds[size_t(r)] = os[size_t(r)]->state_dict();
    });
    const auto ref6 = ref.state_dict(), one6 = one.state_dict();
    for (auto& [k, t] : ref6) {
      INFO(k);
      CHECK(same(one6.at(k), t));
      for (int r = 0; r < world; r++) CHECK(same(sds[size_t(r)].at(k), t));
    }
    CHECK(same(one_p.b, ref_p.b));
    CHECK(same(ps[0]->b, ref_p.b));
    // sharding a trained optimizer would restart its moments: refused
    CHECK_THROWS_WITH(one.shard(0, 2, [](Tensor&, const std::vector<int64_t>&) {}), Contains("after 6 steps"));
  }
}

TEST_CASE("CPU collectives: a peer that is gone or silent is an error naming it", "[distributed]") {
  SECTION("rank 2 closed its connection") {
    std::vector<tcp::Comm> c = tcp_ranks(3);
    c[2] = tcp::Comm();  // its socket closes
    std::vector<float> x(1000, 1.0f);
    std::thread t([&] {
      std::vector<float> y(1000, 2.0f);
      try {
        c[1].all_reduce_avg(y.data(), y.size(), DType::F32);
      } catch (const std::exception&) {
      }
    });
    CHECK_THROWS_WITH(c[0].all_reduce_avg(x.data(), x.size(), DType::F32), Contains("rank 0 lost rank 2"));
    c[0] = tcp::Comm();  // rank 1 now waits on a closed rank 0
    t.join();
  }
  SECTION("rank 1 sends nothing within the timeout") {
    std::vector<tcp::Comm> c = tcp_ranks(2);
    c[0].set_timeout(0.5);
    std::vector<double> x(10, 1.0);
    double t0 = secs();
    CHECK_THROWS_WITH(c[0].all_reduce_avg(x.data(), x.size(), DType::F64), Contains("rank 0 lost rank 1"));
    CHECK(secs() - t0 < 3);
  }
  SECTION("connections that are not ranks are closed while the ranks join; too few ranks is an error") {
    tcp::Comm c0 = tcp::Comm::listen(3, 10);
    const std::string payload = c0.payload();
    const int port = std::atoi(payload.c_str() + payload.find(' ') + 1);
    // before the ranks: a stranger that sends rank 7 of 3, one that claims rank 1 with port 0,
    // and one that connects and says nothing (closed after its read fails when it hangs up)
    std::vector<int> strangers;
    for (auto hello : {std::pair<int32_t, int32_t>{7, 5000}, {1, 0}, {-1, -1}}) {
      std::string why;
      int fd = net::connect_until("127.0.0.1", port, secs() * 1e3 + 5000, &why);
      REQUIRE(fd >= 0);
      if (hello.first >= 0) {
        int32_t w[2] = {hello.first, hello.second};
        REQUIRE(net::write_all(fd, w, sizeof w));
      } else {
        close(fd);
        fd = -1;
      }
      strangers.push_back(fd);
    }
    std::vector<tcp::Comm> c(3);
    std::vector<std::thread> t;
    for (int r = 1; r < 3; r++)
      t.emplace_back([&, r] { c[size_t(r)] = tcp::Comm::connect("127.0.0.1", payload, r, 3, 10); });
    c0.accept_ranks();
    for (auto& th : t) th.join();
    c[0] = std::move(c0);
    std::vector<std::thread> avg;
    std::vector<std::vector<float>> v = {{1.f}, {2.f}, {6.f}};
    for (int r = 0; r < 3; r++) avg.emplace_back([&, r] { c[size_t(r)].all_reduce_avg(v[size_t(r)].data(), 1, DType::F32); });
    for (auto& th : avg) th.join();
    for (int r = 0; r < 3; r++) CHECK(v[size_t(r)][0] == 3.f);
    for (int fd : strangers)
      if (fd >= 0) close(fd);

    tcp::Comm lone = tcp::Comm::listen(2, 0.3);  // rank 1 never comes
    CHECK_THROWS_WITH(lone.accept_ranks(), Contains("only 1 of 2 ranks connected to rank 0's port"));
  }
  SECTION("a dtype it cannot average, and a rank 0 that is not on the CPU") {
    std::vector<tcp::Comm> c = tcp_ranks(2);
    int32_t i = 1;
    CHECK_THROWS_WITH(c[0].all_reduce_avg(&i, 1, DType::I32), Contains("no average for dtype"));
    CHECK_THROWS_WITH(tcp::Comm::connect("127.0.0.1", std::string(128, 'x'), 1, 2, 1),
                      Contains("rank 0 does not") && Contains("train.device"));
  }
}
