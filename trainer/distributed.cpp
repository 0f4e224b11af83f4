// distributed.cpp: how a run becomes ranks: the rank environment, the launcher, the TCP
// rendezvous and its monitor (see distributed.h). The collectives' side of data parallel is in
// data_parallel.cpp.
#include "trainer/distributed.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "tensor/dispatch.h"
#include "trainer/comm.h"
#include "trainer/config.h"
#include "trainer/net.h"

extern char** environ;

namespace loom {

EnvMap process_env() {
  EnvMap m;
  for (char** e = environ; e && *e; e++) {
    const char* eq = std::strchr(*e, '=');
    if (eq) m[std::string(*e, size_t(eq - *e))] = eq + 1;
  }
  return m;
}

// ------------------------------------------------------------------ environment
static int env_int(const EnvMap& env, const std::string& key) {
  const std::string& v = env.at(key);
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v.c_str(), &end, 10);
  LOOM_CHECK(!v.empty() && *end == 0 && errno == 0 && x >= 0 && x < (1 << 30),
             "%s = '%s' is not a non-negative integer", key.c_str(), v.c_str());
  return int(x);
}

static bool has(const EnvMap& env, const char* k) { return env.count(k) && !env.at(k).empty(); }

std::string slurm_first_host(const std::string& nodelist) {
  // the first entry: up to a comma that is not inside brackets
  std::string first;
  int depth = 0;
  for (char c : nodelist) {
    if (c == '[') depth++;
    if (c == ']') depth--;
    if (c == ',' && depth == 0) break;
    first += c;
  }
  size_t lb = first.find('[');
  if (lb == std::string::npos) return first;
  // prefix[01-04,07]suffix -> prefix01suffix
  size_t rb = first.find(']', lb);
  LOOM_CHECK(rb != std::string::npos, "SLURM_JOB_NODELIST '%s': unbalanced brackets", nodelist.c_str());
  std::string inner = first.substr(lb + 1, rb - lb - 1);
  size_t stop = inner.find_first_of(",-");
  return first.substr(0, lb) + inner.substr(0, stop) + first.substr(rb + 1);
}

DistEnv parse_dist_env(const EnvMap& env) {
  DistEnv d;
  if (has(env, "WORLD_SIZE") || has(env, "RANK")) {
    for (const char* k : {"RANK", "WORLD_SIZE"})
      LOOM_CHECK(has(env, k), "%s is set but %s is not (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                 "MASTER_PORT)", has(env, "RANK") ? "RANK" : "WORLD_SIZE", k);
    d.launcher = "torchrun";
    d.rank = env_int(env, "RANK");
    d.world = env_int(env, "WORLD_SIZE");
    d.local_rank = has(env, "LOCAL_RANK") ? env_int(env, "LOCAL_RANK") : d.rank;
    d.local_world = has(env, "LOCAL_WORLD_SIZE") ? env_int(env, "LOCAL_WORLD_SIZE") : d.world;
  } else if (has(env, "SLURM_PROCID") && has(env, "SLURM_NTASKS")) {
    d.launcher = "slurm";
    d.rank = env_int(env, "SLURM_PROCID");
    d.world = env_int(env, "SLURM_NTASKS");
    d.local_rank = has(env, "SLURM_LOCALID") ? env_int(env, "SLURM_LOCALID") : 0;
    if (has(env, "LOCAL_WORLD_SIZE")) d.local_world = env_int(env, "LOCAL_WORLD_SIZE");
    else if (has(env, "SLURM_NTASKS_PER_NODE")) d.local_world = std::atoi(env.at("SLURM_NTASKS_PER_NODE").c_str());
    else d.local_world = d.local_rank + 1;
    if (d.world > 1 && !has(env, "MASTER_ADDR"))
      LOOM_CHECK(has(env, "SLURM_JOB_NODELIST") || has(env, "SLURM_NODELIST"),
                 "Slurm rank %d of %d: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set", d.rank, d.world);
    if (!has(env, "MASTER_ADDR") && d.world > 1)
      d.master_addr = slurm_first_host(has(env, "SLURM_JOB_NODELIST") ? env.at("SLURM_JOB_NODELIST") : env.at("SLURM_NODELIST"));
  } else {
    return d;  // single process
  }
  LOOM_CHECK(d.world >= 1, "%s: WORLD_SIZE must be at least 1", d.launcher.c_str());
  LOOM_CHECK(d.rank < d.world, "%s: rank %d is not below the world size %d (RANK/SLURM_PROCID must be 0..%d)",
             d.launcher.c_str(), d.rank, d.world, d.world - 1);
  LOOM_CHECK(d.local_world >= 1 && d.local_rank < d.local_world,
             "%s: local rank %d is not below the local world size %d", d.launcher.c_str(), d.local_rank, d.local_world);
  if (has(env, "MASTER_ADDR")) d.master_addr = env.at("MASTER_ADDR");
  if (has(env, "MASTER_PORT")) d.master_port = env_int(env, "MASTER_PORT");
  else LOOM_CHECK(d.world == 1 || d.launcher == "slurm", "torchrun: WORLD_SIZE %d but MASTER_PORT is not set", d.world);
  LOOM_CHECK(d.master_port > 0 && d.master_port < 65535, "MASTER_PORT %d: the rendezvous uses MASTER_PORT+1, "
             "which must be a valid port", d.master_port);
  return d;
}

std::string DistEnv::describe() const {
  return strformat("rank %d of %d (local %d of %d, %s), rendezvous %s:%d", rank, world, local_rank, local_world,
                   launcher.c_str(), master_addr.c_str(), rendezvous_port());
}

Shard shard_of(int64_t global, int rank, int world) {
  LOOM_CHECK(world >= 1 && rank >= 0 && rank < world, "shard_of: rank %d of %d", rank, world);
  LOOM_CHECK(global % world == 0, "shard_of: a global batch of %lld does not split into %d equal parts",
             (long long)global, world);
  int64_t per = global / world;
  return {rank * per, (rank + 1) * per};
}

std::string gpu_count_error(int want, int have, bool cuda_build) {
  if (!cuda_build)
    return strformat("train.gpus = %d: this is a CPU-only build (data parallel needs the CUDA build with NCCL)", want);
  if (have < want)
    return strformat("train.gpus = %d, but this machine has %d usable GPU%s", want, have, have == 1 ? "" : "s");
  return "";
}

int probe_gpu_count() {
#ifndef LOOM_CUDA
  return 0;
#else
  int p[2];
  if (pipe(p) != 0) return cuda::device_count();
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    int n = cuda::device_count();
    ssize_t w = write(p[1], &n, sizeof n);
    (void)w;
    _exit(0);
  }
  close(p[1]);
  int n = 0;
  ssize_t r = pid > 0 ? read(p[0], &n, sizeof n) : -1;
  close(p[0]);
  if (pid > 0) waitpid(pid, nullptr, 0);
  return r == ssize_t(sizeof n) ? n : 0;
#endif
}

// ------------------------------------------------------------------ launcher
static int free_port_pair() {
  // a port p whose p+1 is also free (MASTER_PORT and the rendezvous)
  for (int attempt = 0; attempt < 50; attempt++) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    if (bind(s, (sockaddr*)&a, sizeof a) != 0 || getsockname(s, (sockaddr*)&a, &len) != 0) {
      close(s);
      continue;
    }
    int p = ntohs(a.sin_port);
    close(s);
    if (p >= 65534) continue;
    int s2 = socket(AF_INET, SOCK_STREAM, 0);
    a.sin_port = htons(uint16_t(p + 1));
    bool ok = bind(s2, (sockaddr*)&a, sizeof a) == 0;
    close(s2);
    if (ok) return p;
  }
  LOOM_CHECK(false, "launcher: no free pair of local ports");
  return 0;
}

int launch_local(int n, int argc, char** argv, bool cuda) {
  if (cuda) {
    std::string err = gpu_count_error(n, probe_gpu_count(),
#ifdef LOOM_CUDA
                                      true
#else
                                      false
#endif
    );
    LOOM_CHECK(err.empty(), "%s", err.c_str());
    LOOM_CHECK(nccl::available(), "train.gpus = %d: %s", n, nccl::version().c_str());
  }
  // CPU ranks share the cores: each its share of threads (kernels/cpu/parallel.h), unless the user chose
  const int cores = std::max(1, int(std::thread::hardware_concurrency()));
  const std::string threads = std::getenv("OMP_NUM_THREADS") ? "" : std::to_string(std::max(1, cores / n));
  int port = free_port_pair();
  std::printf("launching %d ranks (%s), rendezvous on 127.0.0.1:%d; rank 0 logs here, the others in "
              "out_dir/rank_K.log\n", n, cuda ? "one per GPU" : strformat("CPU processes, %s threads each",
              threads.empty() ? std::getenv("OMP_NUM_THREADS") : threads.c_str()).c_str(), port + 1);
  std::fflush(stdout);
  std::vector<pid_t> pids(size_t(n), -1);
  for (int r = 0; r < n; r++) {
    pid_t pid = fork();
    LOOM_CHECK(pid >= 0, "launcher: fork failed: %s", std::strerror(errno));
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (!cuda && !threads.empty()) setenv("OMP_NUM_THREADS", threads.c_str(), 1);
      setpgid(0, getppid() == 1 ? 0 : getpgid(getppid()));
      std::vector<char*> args(argv, argv + argc);
      args.push_back(nullptr);
      execv("/proc/self/exe", args.data());
      std::fprintf(stderr, "launcher: exec of rank %d failed: %s\n", r, std::strerror(errno));
      _exit(127);
    }
    pids[size_t(r)] = pid;
  }
  int first_rc = 0, alive = n;
  double stop_deadline = 0;
  auto now_s = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  while (alive > 0) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) {
      if (stop_deadline > 0 && now_s() > stop_deadline) {
        for (pid_t p : pids)
          if (p > 0) kill(p, SIGKILL);
        stop_deadline = 0;
      }
      usleep(50000);
      continue;
    }
    int r = -1;
    for (int i = 0; i < n; i++)
      if (pids[size_t(i)] == pid) r = i;
    if (r < 0) continue;
    pids[size_t(r)] = -1;
    alive--;
    int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (rc != 0 && first_rc == 0) {
      first_rc = rc;
      if (WIFSIGNALED(status))
        std::fprintf(stderr, "launcher: rank %d was killed by signal %d (%s); stopping the other ranks\n", r,
                     WTERMSIG(status), strsignal(WTERMSIG(status)));
      else
        std::fprintf(stderr, "launcher: rank %d exited with status %d; stopping the other ranks\n", r, rc);
      // the ranks notice on their own (the rendezvous link); a terminate, then a kill, in case one hangs
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGTERM);
      stop_deadline = now_s() + 20;
    }
  }
  return first_rc;
}

// GPU LOCAL_RANK of the visible ones becomes this process's only GPU (CUDA_VISIBLE_DEVICES).
static void narrow_to_rank_gpu(const EnvMap& env, const DistEnv& d) {
#ifndef LOOM_CUDA
  (void)env;
  LOOM_CHECK(false, "%s: data parallel on GPUs needs the CUDA build with NCCL; this is a CPU-only build (train.device "
             "= cpu trains the ranks on the CPU)", d.describe().c_str());
#else
  LOOM_CHECK(nccl::available(), "%s: %s", d.describe().c_str(), nccl::version().c_str());
  int have = probe_gpu_count();
  if (have == 1 && d.local_world > 1) {
    // the launcher gave each rank its own GPU (srun --gpus-per-task=1, --gpu-bind=single, or
    // CUDA_VISIBLE_DEVICES set per rank): the one visible GPU is this rank's. (Two ranks that
    // both see one shared GPU are refused by NCCL's init: "Duplicate GPU detected".)
    std::printf("rank %d: one GPU visible to this process: this rank's (bound by the launcher)\n", d.rank);
    return;
  }
  LOOM_CHECK(d.local_rank < have, "rank %d: LOCAL_RANK %d needs GPU %d, but this machine shows %d usable GPU%s "
             "(LOCAL_WORLD_SIZE %d)", d.rank, d.local_rank, d.local_rank, have, have == 1 ? "" : "s", d.local_world);
  std::string vis = env.count("CUDA_VISIBLE_DEVICES") ? env.at("CUDA_VISIBLE_DEVICES") : "";
  std::string pick = std::to_string(d.local_rank);
  if (!vis.empty()) {
    std::vector<std::string> ids;
    size_t a = 0;
    while (a <= vis.size()) {
      size_t b = vis.find(',', a);
      if (b == std::string::npos) b = vis.size();
      ids.push_back(vis.substr(a, b - a));
      a = b + 1;
    }
    if (size_t(d.local_rank) < ids.size()) pick = ids[size_t(d.local_rank)];
  }
  setenv("CUDA_VISIBLE_DEVICES", pick.c_str(), 1);
  // CUDA reads the variable when it initializes: a process that initialized it before this
  // point still sees every GPU and would share GPU 0 with the other ranks
  const int seen = cuda::device_count();
  LOOM_CHECK(seen == 1, "rank %d: CUDA sees %d GPUs after CUDA_VISIBLE_DEVICES=%s: it was initialized before the "
             "rank chose its GPU, and every rank would run on the same one", d.rank, seen, pick.c_str());
#endif
}

DistEnv select_rank_device(const EnvMap& env, const std::string& out_dir, bool cuda) {
  DistEnv d = parse_dist_env(env);
  if (!d.distributed()) return d;
  if (cuda) narrow_to_rank_gpu(env, d);
  if (d.rank != 0 && !out_dir.empty()) {
    std::string p = out_dir + "/rank_" + std::to_string(d.rank) + ".log";
    std::string mk = out_dir;
    // the run folder may not exist yet (rank 0 creates it too)
    for (size_t i = 1; i <= mk.size(); i++)
      if (i == mk.size() || mk[i] == '/') mkdir(mk.substr(0, i).c_str(), 0755);
    if (!std::freopen(p.c_str(), "w", stdout)) std::fprintf(stderr, "rank %d: cannot write %s\n", d.rank, p.c_str());
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
  }
  return d;
}

// ------------------------------------------------------------------ TCP rendezvous
// Frames: 4-byte big-endian length of (type + body), 1 type byte, body.
//   'H' hello (rank world host), 'I' rank 0's payload, 'E' error (join refused),
//   'A' abort (text), 'B' goodbye, 'K' keep-alive (a busy rank: Rendezvous::set_busy).
namespace {

bool read_frame(int fd, char& type, std::string& body, double deadline_ms) {
  unsigned char len[4];
  if (!net::read_all(fd, len, 4, deadline_ms)) return false;
  uint32_t n = (uint32_t(len[0]) << 24) | (uint32_t(len[1]) << 16) | (uint32_t(len[2]) << 8) | len[3];
  if (n < 1 || n > (1u << 20)) return false;
  std::string buf(n, '\0');
  if (!net::read_all(fd, buf.data(), n, deadline_ms)) return false;
  type = buf[0];
  body = buf.substr(1);
  return true;
}

}  // namespace

double Rendezvous::now_ms_() { return net::now_ms(); }

bool Rendezvous::send_frame(int fd, char type, const std::string& body) {
  if (fd < 0) return false;
  std::lock_guard<std::mutex> l(send_mu_);
  uint32_t n = uint32_t(body.size() + 1);
  std::string buf(4, '\0');
  buf[0] = char(n >> 24), buf[1] = char(n >> 16), buf[2] = char(n >> 8), buf[3] = char(n);
  buf += type;
  buf += body;
  return net::write_all(fd, buf.data(), buf.size());
}

std::string config_fingerprint(const Config& cfg) {
  static const std::set<std::string> local = {"model.lm_init", "model.vision_init", "model.init", "data.path",
                                              "data.val_path", "data.tokenizer", "data.synth_rows", "data.workers",
                                              "train.out_dir", "train.resume"};
  std::string out;
  for (auto& [k, v] : cfg.values())
    if (!local.count(k)) out += k + "=" + v + "\n";
  return out;
}

std::string config_difference(const std::string& rank0, const std::string& other) {
  if (rank0 == other) return "";
  auto parse = [](const std::string& text) {
    std::map<std::string, std::string> m;
    size_t at = 0;
    while (at < text.size()) {
      size_t end = text.find('\n', at);
      if (end == std::string::npos) end = text.size();
      const std::string line = text.substr(at, end - at);
      const size_t eq = line.find('=');
      if (eq != std::string::npos) m[line.substr(0, eq)] = line.substr(eq + 1);
      at = end + 1;
    }
    return m;
  };
  const auto a = parse(rank0), b = parse(other);
  std::vector<std::string> diffs;
  for (auto& [k, v] : b) {
    auto it = a.find(k);
    if (it == a.end()) diffs.push_back(k + " = " + v + " (rank 0: no such key)");
    else if (it->second != v) diffs.push_back(k + " = " + v + " (rank 0: " + it->second + ")");
  }
  for (auto& [k, v] : a)
    if (!b.count(k)) diffs.push_back(k + " missing (rank 0: " + v + ")");
  std::string out;
  for (size_t i = 0; i < diffs.size() && i < 8; i++) out += (i ? ", " : "") + diffs[i];
  if (diffs.size() > 8) out += strformat(" and %zu more", diffs.size() - 8);
  return out.empty() ? "the configs differ" : out;
}

Rendezvous::Rendezvous(const DistEnv& env, const std::string& payload, double join_timeout_s,
                       const std::string& fingerprint)
    : env_(env) {
  const double deadline = now_ms_() + join_timeout_s * 1e3;
  const int port = env.rendezvous_port();
  fds_.assign(size_t(env.world), -1);
  hosts_.assign(size_t(env.world), "");
  done_.assign(size_t(env.world), false);
  auto fail_all = [&](const std::string& msg) {
    for (int fd : fds_)
      if (fd >= 0) {
        send_frame(fd, 'E', msg);
        close(fd);
      }
    fds_.assign(size_t(env.world), -1);
    LOOM_CHECK(false, "%s", msg.c_str());
  };
  if (env.rank == 0) {
    payload_ = payload;
    int ls = net::listen_any(port, nullptr, "rendezvous: rank 0 (MASTER_PORT+1)");
    int joined = 1;
    while (joined < env.world) {
      int fd = net::accept_until(ls, deadline);
      if (fd < 0) {
        std::string missing;
        for (int r = 1; r < env.world; r++)
          if (fds_[size_t(r)] < 0) missing += (missing.empty() ? "" : ",") + std::to_string(r);
        close(ls);
        fail_all(strformat("rendezvous: only %d of WORLD_SIZE %d ranks joined rank 0 within %.0f s (missing ranks "
                           "%s): is WORLD_SIZE right, and did every rank start?", joined, env.world, join_timeout_s,
                           missing.c_str()));
      }
      char type = 0;
      std::string body;
      if (!read_frame(fd, type, body, std::min(deadline, now_ms_() + 10000)) || type != 'H') {
        close(fd);  // not one of ours (a port scan, a stale process)
        continue;
      }
      int r = -1, w = -1;
      char host[256] = {0};
      std::sscanf(body.c_str(), "%d %d %255s", &r, &w, host);
      const size_t nl = body.find('\n');
      const std::string theirs = nl == std::string::npos ? std::string() : body.substr(nl + 1);
      if (w != env.world) {
        std::string msg = strformat("rendezvous: rank %d (host %s) says WORLD_SIZE %d, rank 0 says %d: every rank "
                                    "must be started with the same WORLD_SIZE", r, host, w, env.world);
        send_frame(fd, 'E', msg);
        close(fd);
        close(ls);
        fail_all(msg);
      }
      if (r <= 0 || r >= env.world || fds_[size_t(r)] >= 0) {
        std::string msg = strformat("rendezvous: two processes claim rank %d (host %s): every RANK must be unique",
                                    r, host);
        send_frame(fd, 'E', msg);
        close(fd);
        close(ls);
        fail_all(msg);
      }
      const std::string diff = config_difference(fingerprint, theirs);
      if (!diff.empty()) {
        std::string msg = strformat("rendezvous: rank %d (host %s) was started with another config than rank 0: %s. "
                                    "Every rank must get the same config and overrides (paths and data.workers "
                                    "may differ)", r, host, diff.c_str());
        send_frame(fd, 'E', msg);
        close(fd);
        close(ls);
        fail_all(msg);
      }
      fds_[size_t(r)] = fd;
      hosts_[size_t(r)] = host;
      joined++;
    }
    close(ls);
    for (int r = 1; r < env.world; r++) send_frame(fds_[size_t(r)], 'I', payload_);
    return;
  }
  // other ranks: connect to rank 0 (it may start later: retry until the deadline)
  std::string why;
  int fd = net::connect_until(env.master_addr, port, deadline, &why);
  LOOM_CHECK(fd != -2, "rendezvous: rank %d cannot resolve MASTER_ADDR '%s': %s", env.rank, env.master_addr.c_str(),
             why.c_str());
  LOOM_CHECK(fd >= 0, "rendezvous: rank %d cannot reach rank 0 at %s:%d (MASTER_ADDR, MASTER_PORT+1) within %.0f s: "
             "%s. Is MASTER_ADDR right, and is rank 0 running?", env.rank, env.master_addr.c_str(), port,
             join_timeout_s, why.c_str());
  fds_[0] = fd;
  send_frame(fd, 'H', strformat("%d %d %s\n", env.rank, env.world, net::host_name().c_str()) + fingerprint);
  char type = 0;
  std::string body;
  // rank 0 answers once every rank has joined (it waits at most its own join timeout)
  bool got = read_frame(fd, type, body, deadline + 15000);
  if (!got || type != 'I') {
    close(fd);
    fds_[0] = -1;
    LOOM_CHECK(type != 'E' || !got, "%s", body.c_str());
    LOOM_CHECK(false, "rendezvous: rank %d connected to rank 0 at %s:%d but got no payload (the NCCL id or the CPU "
               "collectives' port; rank 0 ended or the other ranks did not all join)", env.rank, env.master_addr.c_str(), port);
  }
  payload_ = body;
}

Rendezvous::~Rendezvous() {
  stop_ = true;
  if (monitor_.joinable()) monitor_.join();
  for (int fd : fds_)
    if (fd >= 0) close(fd);
}

void Rendezvous::start_monitor(std::function<void(const std::string&)> on_fault, std::function<std::string()> poll,
                               double stall_timeout_s) {
  on_fault_ = std::move(on_fault);
  poll_ = std::move(poll);
  heartbeat();
  monitor_ = std::thread([this, stall_timeout_s] { monitor_loop(stall_timeout_s); });
}

void Rendezvous::fault(const std::string& why) {
  if (faulted_.exchange(true)) return;
  // tell the others: rank 0 tells every rank, the others tell rank 0 (which relays)
  for (size_t r = 0; r < fds_.size(); r++)
    if (fds_[r] >= 0 && !done_[r]) send_frame(fds_[r], 'A', why);
  if (on_fault_) on_fault_(why);
}

void Rendezvous::monitor_loop(double stall_timeout_s) {
  double last_keep_alive = 0;
  while (!stop_ && !faulted_) {
    if (busy_.load() > 0) {  // alive, and the peers hear so four times a second
      heartbeat();
      if (now_ms_() - last_keep_alive >= 250) {
        last_keep_alive = now_ms_();
        for (size_t r = 0; r < fds_.size(); r++)
          if (fds_[r] >= 0 && !done_[r]) send_frame(fds_[r], 'K', "");
      }
    }
    std::vector<pollfd> pfs;
    std::vector<int> who;
    for (size_t r = 0; r < fds_.size(); r++)
      if (fds_[r] >= 0 && !done_[r]) {
        pfs.push_back({fds_[r], POLLIN, 0});
        who.push_back(int(r));
      }
    int k = pfs.empty() ? (usleep(200000), 0) : ::poll(pfs.data(), nfds_t(pfs.size()), 200);
    if (stop_) return;
    for (size_t i = 0; k > 0 && i < pfs.size(); i++) {
      if (!(pfs[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      int r = who[i];
      char type = 0;
      std::string body;
      bool ok = read_frame(pfs[i].fd, type, body, now_ms_() + 5000);
      if (stop_) return;
      if (ok && type == 'B') {
        done_[size_t(r)] = true;
        continue;
      }
      if (ok && type == 'K') {  // a busy rank is alive; rank 0 passes it on to the others
        heartbeat();
        if (env_.rank == 0)
          for (size_t q = 1; q < fds_.size(); q++)
            if (q != size_t(r) && fds_[q] >= 0 && !done_[q]) send_frame(fds_[q], 'K', "");
        continue;
      }
      std::string peer = env_.rank == 0 ? strformat("rank %d (host %s)", r, hosts_[size_t(r)].c_str()) : "rank 0";
      if (ok && type == 'A') fault(body);
      else fault(strformat("lost %s: its connection closed without a goodbye (the process died or was killed)",
                           peer.c_str()));
      return;
    }
    if (poll_) {
      std::string e = poll_();
      if (!e.empty()) {
        fault(strformat("rank %d: %s", env_.rank, e.c_str()));
        return;
      }
    }
    if (stall_timeout_s > 0 && now_ms_() - last_beat_ms_.load() > stall_timeout_s * 1e3) {
      fault(strformat("rank %d: no training step finished in %g s (train.dist_timeout): a hung collective or a "
                      "stalled rank", env_.rank, stall_timeout_s));
      return;
    }
  }
}

void Rendezvous::goodbye() {
  stop_ = true;
  if (monitor_.joinable() && std::this_thread::get_id() != monitor_.get_id()) monitor_.join();
  for (size_t r = 0; r < fds_.size(); r++)
    if (fds_[r] >= 0) send_frame(fds_[r], 'B', "");
}

void Rendezvous::tell_abort(const std::string& why) {
  if (faulted_.exchange(true)) return;
  for (size_t r = 0; r < fds_.size(); r++)
    if (fds_[r] >= 0 && !done_[r]) send_frame(fds_[r], 'A', why);
}

}  // namespace loom
