// test_distributed.cpp: the CPU-testable parts of data parallel (trainer/distributed.h): the
// launchers' environments, the batch shards, the GPU-count errors, the TCP rendezvous that
// carries the NCCL unique id, with its monitor, and the CPU collectives (ranks as threads on
// localhost). Whole CPU runs of several processes: tests/data_parallel.sh.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "autograd/autograd.h"
#include "autograd/ops.h"
#include "optim/optimizer.h"
#include "trainer/config.h"
#include "trainer/distributed.h"
#include "trainer/trainer.h"

using namespace loom;
using Catch::Matchers::Contains;

static double secs() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// a MASTER_PORT whose rendezvous port (MASTER_PORT + 1) is free now
static int free_master_port() {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  REQUIRE(bind(s, (sockaddr*)&a, sizeof a) == 0);
  REQUIRE(getsockname(s, (sockaddr*)&a, &len) == 0);
  int p = ntohs(a.sin_port);
  close(s);
  return p - 1;
}

static DistEnv env_of(int rank, int world, int port) {
  DistEnv d;
  d.rank = rank;
  d.world = world;
  d.local_rank = rank;
  d.local_world = world;
  d.master_addr = "127.0.0.1";
  d.master_port = port;
  d.launcher = "torchrun";
  return d;
}

TEST_CASE("torchrun environment", "[distributed]") {
  EnvMap e = {{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
              {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29400"}};
  DistEnv d = parse_dist_env(e);
  CHECK(d.launcher == "torchrun");
  CHECK(d.rank == 3);
  CHECK(d.world == 8);
  CHECK(d.local_rank == 1);
  CHECK(d.local_world == 2);
  CHECK(d.master_addr == "node7");
  CHECK(d.rendezvous_port() == 29401);  // torchrun's agent holds MASTER_PORT itself
  CHECK(d.distributed());

  CHECK(!parse_dist_env({}).distributed());
  CHECK(parse_dist_env({}).launcher == "single");

  EnvMap bad = e;
  bad["RANK"] = "8";
  CHECK_THROWS_WITH(parse_dist_env(bad), Contains("rank 8 is not below the world size 8"));
  bad = e;
  bad["WORLD_SIZE"] = "two";
  CHECK_THROWS_WITH(parse_dist_env(bad), Contains("WORLD_SIZE = 'two'"));
  bad = e;
  bad.erase("WORLD_SIZE");
  CHECK_THROWS_WITH(parse_dist_env(bad), Contains("WORLD_SIZE"));
  bad = e;
  bad.erase("MASTER_PORT");
  CHECK_THROWS_WITH(parse_dist_env(bad), Contains("MASTER_PORT"));
  bad = e;
  bad["LOCAL_RANK"] = "2";
  CHECK_THROWS_WITH(parse_dist_env(bad), Contains("local rank 2"));
}

TEST_CASE("Slurm environment and node lists", "[distributed]") {
  CHECK(slurm_first_host("node[01-04,07],gpu12") == "node01");
  CHECK(slurm_first_host("gpu[3,5]") == "gpu3");
  CHECK(slurm_first_host("a,b") == "a");
  CHECK(slurm_first_host("host") == "host");
  CHECK(slurm_first_host("rack1-[10-11]-ib") == "rack1-10-ib");

  EnvMap e = {{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
              {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_JOB_NODELIST", "gpu[07-08]"}};
  DistEnv d = parse_dist_env(e);
  CHECK(d.launcher == "slurm");
  CHECK(d.rank == 5);
  CHECK(d.world == 8);
  CHECK(d.local_rank == 1);
  CHECK(d.local_world == 4);
  CHECK(d.master_addr == "gpu07");
  CHECK(d.master_port == 29500);
  e["MASTER_ADDR"] = "10.0.0.2";
  e["MASTER_PORT"] = "1234";
  d = parse_dist_env(e);
  CHECK(d.master_addr == "10.0.0.2");
  CHECK(d.master_port == 1234);
  // torchrun's variables win over Slurm's (torchrun inside an allocation)
  e["RANK"] = "0";
  e["WORLD_SIZE"] = "2";
  CHECK(parse_dist_env(e).launcher == "torchrun");
  // a one-task job is a single process
  CHECK(!parse_dist_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}).distributed());
  CHECK_THROWS_WITH(parse_dist_env({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}}), Contains("SLURM_JOB_NODELIST"));
}

TEST_CASE("shards of a global batch are disjoint, cover it, and are what one process would see", "[distributed]") {
  for (int world : {1, 2, 3, 8}) {
    int64_t global = 24;
    std::set<int64_t> seen;
    for (int r = 0; r < world; r++) {
      Shard s = shard_of(global, r, world);
      CHECK(s.size() == global / world);
      CHECK(s.begin == r * (global / world));
      for (int64_t i = s.begin; i < s.end; i++) CHECK(seen.insert(i).second);
    }
    CHECK(int64_t(seen.size()) == global);
  }
  CHECK_THROWS_WITH(shard_of(10, 0, 3), Contains("does not split into 3"));
  CHECK_THROWS(shard_of(10, 2, 2));
}

TEST_CASE("GPU count errors", "[distributed]") {
  CHECK(gpu_count_error(2, 2, true).empty());
  CHECK(gpu_count_error(2, 8, true).empty());
  CHECK_THAT(gpu_count_error(4, 2, true), Contains("train.gpus = 4, but this machine has 2 usable GPUs"));
  CHECK_THAT(gpu_count_error(2, 0, false), Contains("CPU-only build"));
}

TEST_CASE("./train --train.gpus=2 without GPUs is a clear error", "[distributed]") {
  if (probe_gpu_count() >= 2) return;  // a machine with GPUs: the GPU scripts cover the launch
  std::vector<std::string> args = {"vlm_sft.cfg", "--train.gpus=2", "--train.out_dir=runs/test_dist_nogpu"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  double t0 = secs();
  CHECK_THROWS_WITH(train_command(int(argv.size()), argv.data()),
                    Contains("train.gpus = 2") && (Contains("usable GPU") || Contains("CPU-only build")));
  CHECK(secs() - t0 < 10);
}

TEST_CASE("rendezvous: rank 0's payload reaches every rank; goodbye is a clean end", "[distributed]") {
  const int port = free_master_port(), world = 3;
  const std::string id(128, '\x5a');
  std::string got[3];
  std::atomic<int> faults{0};
  {
    std::unique_ptr<Rendezvous> rv[3];
    std::thread ranks[2];
    for (int r = 1; r < world; r++)
      ranks[r - 1] = std::thread([&, r] { rv[r] = std::make_unique<Rendezvous>(env_of(r, world, port), "", 10); });
    rv[0] = std::make_unique<Rendezvous>(env_of(0, world, port), id, 10);
    for (auto& t : ranks) t.join();
    for (int r = 0; r < world; r++) {
      got[r] = rv[r]->payload();
      rv[r]->start_monitor([&](const std::string&) { faults++; }, nullptr, 0);
    }
    for (int r = world - 1; r >= 0; r--) rv[r]->goodbye();
    usleep(300000);
  }
  for (int r = 0; r < world; r++) CHECK(got[r] == id);
  CHECK(faults == 0);
}

TEST_CASE("rendezvous: a rank that dies is named to the others", "[distributed]") {
  const int port = free_master_port(), world = 3;
  std::unique_ptr<Rendezvous> rv[3];
  std::thread ranks[2];
  for (int r = 1; r < world; r++)
    ranks[r - 1] = std::thread([&, r] { rv[r] = std::make_unique<Rendezvous>(env_of(r, world, port), "", 10); });
  rv[0] = std::make_unique<Rendezvous>(env_of(0, world, port), std::string(128, 'x'), 10);
  for (auto& t : ranks) t.join();
  std::mutex mu;
  std::string msg0, msg1;
  std::atomic<int> n{0};
  rv[0]->start_monitor([&](const std::string& m) { std::lock_guard<std::mutex> l(mu); msg0 = m; n++; }, nullptr, 0);
  rv[1]->start_monitor([&](const std::string& m) { std::lock_guard<std::mutex> l(mu); msg1 = m; n++; }, nullptr, 0);
  double t0 = secs();
  rv[2].reset();  // rank 2 "dies": its sockets close without a goodbye
  while (n < 2 && secs() - t0 < 10) usleep(20000);
  CHECK(secs() - t0 < 5);
  std::lock_guard<std::mutex> l(mu);
  CHECK_THAT(msg0, Contains("lost rank 2"));
  CHECK_THAT(msg1, Contains("lost rank 2"));  // relayed by rank 0
}

TEST_CASE("rendezvous: a rank without progress stops the run", "[distributed]") {
  const int port = free_master_port();
  std::unique_ptr<Rendezvous> rv1;
  std::thread t([&] { rv1 = std::make_unique<Rendezvous>(env_of(1, 2, port), "", 10); });
  Rendezvous rv0(env_of(0, 2, port), "id", 10);
  t.join();
  std::atomic<int> n{0};
  std::string m0, m1;
  rv0.start_monitor([&](const std::string& m) { m0 = m; n++; }, nullptr, 0);
  rv1->start_monitor([&](const std::string& m) { m1 = m; n++; }, nullptr, 0.5);  // never beats
  double t0 = secs();
  while (n < 2 && secs() - t0 < 10) usleep(20000);
  CHECK(n == 2);
  CHECK_THAT(m1, Contains("no training step finished in 0.5 s"));
  CHECK_THAT(m0, Contains("rank 1: no training step"));
  rv0.goodbye();
  rv1.reset();
}

static std::vector<tcp::Comm> tcp_ranks(int world);

// Rank 2 busy alone for 2.5 s (an evaluation, a slow setup) with a stall limit of 0.8 s on every
// rank and no heartbeat anywhere: its keep-alives, relayed by rank 0 to rank 1, keep every
// watchdog quiet. Once it is no longer busy, the silence stops the run as before.
TEST_CASE("rendezvous: a rank busy alone keeps every watchdog waiting", "[distributed]") {
  const int port = free_master_port(), world = 3;
  std::unique_ptr<Rendezvous> rv[3];
  std::thread ranks[2];
  for (int r = 1; r < world; r++)
    ranks[r - 1] = std::thread([&, r] { rv[r] = std::make_unique<Rendezvous>(env_of(r, world, port), "", 10); });
  rv[0] = std::make_unique<Rendezvous>(env_of(0, world, port), "id", 10);
  for (auto& t : ranks) t.join();
  std::atomic<int> n{0};
  std::mutex mu;
  std::string msg1;
  rv[2]->set_busy(true);
  rv[2]->set_busy(true);  // nested: two scopes
  for (int r = 0; r < world; r++)
    rv[r]->start_monitor(
        [&, r](const std::string& m) {
          std::lock_guard<std::mutex> l(mu);
          if (r == 1) msg1 = m;
          n++;
        },
        nullptr, 0.8);
  const double t0 = secs();
  while (secs() - t0 < 2.5 && n == 0) usleep(20000);
  CHECK(n == 0);
  rv[2]->set_busy(false);
  usleep(300000);
  CHECK(n == 0);  // still inside one scope
  rv[2]->set_busy(false);
  const double t1 = secs();
  while (n < 3 && secs() - t1 < 10) usleep(20000);
  CHECK(n == 3);
  CHECK(secs() - t1 < 5);
  std::lock_guard<std::mutex> l(mu);
  CHECK_THAT(msg1, Contains("no training step finished in 0.8 s"));
}

// The CPU collectives wait for a peer that is busy alone (rank 0 evaluating before its next
// average) as long as its keep-alives come, then average as usual.
TEST_CASE("CPU collectives wait for a busy rank past their timeout", "[distributed]") {
  const int port = free_master_port();
  std::unique_ptr<Rendezvous> rv1;
  std::thread t([&] { rv1 = std::make_unique<Rendezvous>(env_of(1, 2, port), "", 10); });
  Rendezvous rv0(env_of(0, 2, port), "id", 10);
  t.join();
  std::atomic<int> faults{0};
  rv0.start_monitor([&](const std::string&) { faults++; }, nullptr, 0);
  rv1->start_monitor([&](const std::string&) { faults++; }, nullptr, 0);
  std::vector<tcp::Comm> c = tcp_ranks(2);
  for (auto& comm : c) comm.set_timeout(0.8);
  c[1].set_alive(rv1->alive());
  std::vector<float> a = {1, 2, 3}, b = {3, 4, 5};
  std::string err;
  std::thread waiting([&] {
    try {
      c[1].all_reduce_avg(b.data(), b.size(), DType::F32);  // waits for rank 0
    } catch (const std::exception& e) {
      err = e.what();
    }
  });
  rv0.set_busy(true);
  usleep(2500000);  // three timeouts long
  rv0.set_busy(false);
  c[0].all_reduce_avg(a.data(), a.size(), DType::F32);
  waiting.join();
  INFO(err);
  CHECK(err.empty());
  CHECK(a == std::vector<float>({2, 3, 4}));
  CHECK(b == a);
  CHECK(faults == 0);
  // without the keep-alive the same wait is an error after the timeout
  std::thread silent([&] {
    try {
      c[1].all_reduce_avg(b.data(), b.size(), DType::F32);
    } catch (const std::exception& e) {
      err = e.what();
    }
  });
  silent.join();
  CHECK_THAT(err, Contains("rank 1 lost rank 0"));
  rv0.goodbye();
  rv1->goodbye();
}

TEST_CASE("rendezvous: NCCL's asynchronous error stops every rank", "[distributed]") {
  const int port = free_master_port();
  std::unique_ptr<Rendezvous> rv1;
  std::thread t([&] { rv1 = std::make_unique<Rendezvous>(env_of(1, 2, port), "", 10); });
  Rendezvous rv0(env_of(0, 2, port), "id", 10);
  t.join();
  std::atomic<int> n{0};
  std::string m0;
  rv0.start_monitor([&](const std::string& m) { m0 = m; n++; }, [] { return std::string("NCCL asynchronous error: x"); }, 0);
  rv1->start_monitor([&](const std::string&) { n++; }, nullptr, 0);
  double t0 = secs();
  while (n < 2 && secs() - t0 < 10) usleep(20000);
  CHECK(n == 2);
  CHECK_THAT(m0, Contains("rank 0: NCCL asynchronous error"));
  rv1.reset();
}

TEST_CASE("rendezvous errors: wrong WORLD_SIZE, missing ranks, unreachable MASTER_ADDR", "[distributed]") {
  SECTION("a rank with another WORLD_SIZE") {
    const int port = free_master_port();
    std::string e1;
    std::thread t([&] {
      try {
        Rendezvous r(env_of(1, 3, port), "", 10);
      } catch (const std::exception& e) {
        e1 = e.what();
      }
    });
    double t0 = secs();
    CHECK_THROWS_WITH(Rendezvous(env_of(0, 2, port), "id", 10), Contains("says WORLD_SIZE 3, rank 0 says 2"));
    t.join();
    CHECK_THAT(e1, Contains("says WORLD_SIZE 3, rank 0 says 2"));
    CHECK(secs() - t0 < 5);
  }
  SECTION("a rank started with another config") {
    const int port = free_master_port();
    Config a = Config::load("vit_mim.cfg"), b = Config::load("vit_mim.cfg", {"--train.zero_stage=1", "--train.lr=0.01",
                                                                              "--train.out_dir=/elsewhere"});
    std::string e1;
    std::thread t([&] {
      try {
        Rendezvous r(env_of(1, 2, port), "", 10, config_fingerprint(b));
      } catch (const std::exception& e) {
        e1 = e.what();
      }
    });
    const std::string want = "train.zero_stage = 1 (rank 0: 0)";
    CHECK_THROWS_WITH(Rendezvous(env_of(0, 2, port), "id", 10, config_fingerprint(a)),
                      Contains("rank 1") && Contains("another config than rank 0") && Contains(want) &&
                          Contains("train.lr = 0.01 (rank 0: "));
    t.join();
    CHECK_THAT(e1, Contains(want));
    CHECK_THAT(e1, !Contains("out_dir"));  // a path may differ between machines
  }
  SECTION("fewer ranks than WORLD_SIZE") {
    const int port = free_master_port();
    double t0 = secs();
    CHECK_THROWS_WITH(Rendezvous(env_of(0, 2, port), "id", 1), Contains("only 1 of WORLD_SIZE 2 ranks joined") &&
                                                                   Contains("missing ranks 1"));
    CHECK(secs() - t0 < 4);
  }
  SECTION("nobody listens at MASTER_ADDR") {
    const int port = free_master_port();
    double t0 = secs();
    CHECK_THROWS_WITH(Rendezvous(env_of(1, 2, port), "", 1), Contains("cannot reach rank 0 at 127.0.0.1"));
    CHECK(secs() - t0 < 4);
  }
  SECTION("an unknown host name") {
    DistEnv d = env_of(1, 2, free_master_port());
    d.master_addr = "no-such-host.invalid";
    CHECK_THROWS_WITH(Rendezvous(d, "", 1), Contains("cannot resolve MASTER_ADDR 'no-such-host.invalid'"));
  }
}

TEST_CASE("config fingerprints: paths may differ, nothing else", "[distributed]") {
  Config a = Config::load("vlm_sft.cfg");
  CHECK(config_difference(config_fingerprint(a), config_fingerprint(a)).empty());
  Config paths = Config::load("vlm_sft.cfg", {"--train.out_dir=/scratch/x", "--data.workers=7", "--train.resume=latest"});
  CHECK(config_difference(config_fingerprint(a), config_fingerprint(paths)).empty());
  Config other = Config::load("vlm_sft.cfg", {"--train.batch_size=3", "--model.lm_depth=1"});
  const std::string d = config_difference(config_fingerprint(a), config_fingerprint(other));
  CHECK_THAT(d, Contains("train.batch_size = 3 (rank 0: ") && Contains("model.lm_depth = 1 (rank 0: "));
  CHECK_THAT(config_difference("a=1\nb=2\n", "a=1\nc=2\n"), Contains("c = 2 (rank 0: no such key)") &&
                                                                  Contains("b missing (rank 0: 2)"));
  std::string many0, many1;
  for (int i = 0; i < 12; i++) {
    many0 += "k" + std::to_string(i) + "=0\n";
    many1 += "k" + std::to_string(i) + "=1\n";
  }
  CHECK_THAT(config_difference(many0, many1), Contains("and 4 more"));
}

// ------------------------------------------------------------------ the CPU collectives
// world ranks as threads: rank 0 listens, the rest connect with its payload (as after the rendezvous)
static std::vector<tcp::Comm> tcp_ranks(int world) {
  std::vector<tcp::Comm> c(static_cast<size_t>(world));
  c[0] = tcp::Comm::listen(world, 10);
  const std::string payload = c[0].payload();
  std::vector<std::thread> t;
  for (int r = 1; r < world; r++)
    t.emplace_back([&, r] { c[size_t(r)] = tcp::Comm::connect("127.0.0.1", payload, r, world, 10); });
  c[0].accept_ranks();
  for (auto& th : t) th.join();
  return c;
}

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

TEST_CASE("CPU collectives: every rank gets the same mean, summed in rank order, over several chunks", "[distributed]") {
  const uint32_t seed = std::random_device{}();
  INFO("seed " << seed);
  const size_t per_chunk_f32 = tcp::Comm::kChunkBytes / 4;
  check_tcp_average<float>(3, per_chunk_f32 * 2 + 12345, seed);  // two whole chunks and a part
  check_tcp_average<double>(2, per_chunk_f32 / 2 + 7, seed + 1);  // one f64 chunk and a part
  check_tcp_average<float>(4, 1, seed + 2);                       // the loss: one value
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
  SECTION("a dtype it cannot average, and a rank 0 that is not on the CPU") {
    std::vector<tcp::Comm> c = tcp_ranks(2);
    int32_t i = 1;
    CHECK_THROWS_WITH(c[0].all_reduce_avg(&i, 1, DType::I32), Contains("no average for dtype"));
    CHECK_THROWS_WITH(tcp::Comm::connect("127.0.0.1", std::string(128, 'x'), 1, 2, 1),
                      Contains("rank 0 does not") && Contains("train.device"));
  }
}

TEST_CASE("train.procs: CPU ranks need the CPU device; train.gpus is not for the CPU", "[distributed]") {
  auto run = [](std::vector<std::string> args) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    return train_command(int(argv.size()), argv.data());
  };
  CHECK_THROWS_WITH(run({"vit_mim.cfg", "--train.procs=2", "--train.device=cuda", "--train.out_dir=runs/test_procs"}),
                    Contains("train.procs = 2 starts CPU processes and needs train.device = cpu (it is cuda"));
  CHECK_THROWS_WITH(run({"vit_mim.cfg", "--train.gpus=2", "--train.device=cpu", "--train.out_dir=runs/test_procs"}),
                    Contains("train.procs = 2 starts that many CPU processes"));
  CHECK_THROWS_WITH(run({"vit_mim.cfg", "--train.gpus=2", "--train.procs=2", "--train.out_dir=runs/test_procs"}),
                    Contains("not both"));
}
