// test_distributed.cpp: the CPU-testable parts of trainer/distributed.cpp: the launchers'
// environments, the batch shards, the GPU-count errors, the TCP rendezvous that carries the NCCL
// unique id, with its monitor. The CPU collectives and what data parallel builds on them:
// test_data_parallel.cpp. Whole CPU runs of several processes: tests/data_parallel.sh.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <set>
#include <string>
#include <thread>

#include "trainer/config.h"
#include "trainer/distributed.h"
#include "trainer/trainer.h"
#include "tests/comm_test_util.h"

using namespace loom;
using Catch::Matchers::Contains;

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
