// distributed.h: data-parallel training on several GPUs (one process per GPU, NCCL), or in
// several CPU processes (averages over TCP: comm.h's tcp::Comm). distributed.cpp: the rank
// environment, the launcher and the rendezvous; data_parallel.cpp: DataParallel and
// gather_over_ranks.
//
// How a run becomes several processes (README "Several GPUs"):
//   ./train CONFIG --train.gpus=N      this process is a launcher: it starts N copies of itself
//                                      with the torchrun variables set (MASTER_ADDR 127.0.0.1,
//                                      a free MASTER_PORT), waits, and stops the rest when one fails
//   ./train CONFIG --train.device=cpu --train.procs=N
//                                      the same for N processes on the CPU
//   torchrun ... ./train CONFIG        RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//                                      MASTER_ADDR, MASTER_PORT
//   srun ./train CONFIG                SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
//                                      SLURM_NTASKS_PER_NODE (or LOCAL_WORLD_SIZE), MASTER_ADDR or
//                                      the first host of SLURM_JOB_NODELIST, MASTER_PORT or 29500
//
// Each rank uses GPU LOCAL_RANK of the GPUs it sees (CUDA_VISIBLE_DEVICES is narrowed to that
// one before CUDA starts, so every thread of the process uses it). With train.device = cpu (or
// auto on a machine without GPUs) the ranks train on the CPU.
//
// The NCCL unique id (on the CPU: the port of rank 0's collectives) travels over a small TCP
// side channel (Rendezvous): rank 0 listens on MASTER_ADDR:MASTER_PORT+1 (torchrun's own agent
// holds MASTER_PORT), every other rank connects, says {rank, world size, host}, and gets the id
// back once all WORLD_SIZE ranks have joined. A wrong WORLD_SIZE, a duplicate RANK or an unreachable MASTER_ADDR are errors within
// train.dist_join_timeout seconds. The connections stay open for the whole run: they are how a
// dead rank is noticed (its socket closes without a goodbye; rank 0 tells the others which rank
// was lost) and how a rank that stopped making progress (a hung collective: no step finished in
// train.dist_timeout seconds, or NCCL's asynchronous error) stops all of them.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tensor/tensor.h"
#include "trainer/comm.h"
#include "trainer/grad_buckets.h"

namespace loom {

class Config;
class Optimizer;

using EnvMap = std::map<std::string, std::string>;
EnvMap process_env();

struct DistEnv {
  int rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string launcher = "single";  // single | torchrun | slurm
  bool distributed() const { return world > 1; }
  int rendezvous_port() const { return master_port + 1; }
  std::string describe() const;  // "rank 1 of 4 (local 1 of 2, torchrun), rendezvous host:port"
};

// From torchrun's (RANK, WORLD_SIZE, ...) or Slurm's (SLURM_PROCID, SLURM_NTASKS, ...) variables;
// torchrun's win when both are set. Inconsistent values (RANK >= WORLD_SIZE, a missing partner
// variable, a non-number) throw with the variable's name.
DistEnv parse_dist_env(const EnvMap& env);
// "node[01-04,07],gpu12" -> "node01"; "a,b" -> "a"; "host" -> "host"
std::string slurm_first_host(const std::string& nodelist);

// The rank's part [begin, end) of a global batch of `global` items split over `world` ranks
// (contiguous, equal parts: rank r holds [r*global/world, (r+1)*global/world)).
struct Shard {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
Shard shard_of(int64_t global, int rank, int world);

// ./train's own launcher (train.gpus = N > 1, or train.procs = N > 1 on the CPU, and no rank
// variables in the environment): argv is the full command line (argv[0] the executable). Starts
// N ranks, returns the exit code: 0 when all succeed, else the first failure's (the others are
// stopped). CPU ranks (`cuda` false) share the cores: each gets OMP_NUM_THREADS = cores / N
// unless the variable is set.
int launch_local(int n, int argc, char** argv, bool cuda = true);
// The error when `want` GPUs are asked for and `have` are usable ("" when fine).
std::string gpu_count_error(int want, int have, bool cuda_build);
// GPUs the CUDA runtime reports, asked in a forked child so that this process's CUDA state
// (and its CUDA_VISIBLE_DEVICES) stays untouched; 0 in a CPU-only build.
int probe_gpu_count();

// Differentiable all-gather of rows: out [world * n, ...] holds every rank's x [n, ...] in rank
// order, `gather(x, out)` moving the data (a collective every rank calls). The backward hands
// x this rank's rows of out's gradient times `world`: the adjoint of a gather sums the
// gradients every rank computed for these rows, and when every rank computes the same loss of
// the gathered rows (the global InfoNCE: each holds all of them) that sum is world times its
// own. Under data parallel, whose gradients are a mean over the ranks, the update is then the
// one of a single process holding the whole batch.
Tensor gather_over_ranks(const Tensor& x, int rank, int world,
                         const std::function<void(const Tensor& x, Tensor& out)>& gather);

// ------------------------------------------------------------------ TCP rendezvous and monitor
// What every rank of a run must agree on: "section.key=value" lines of every key except those
// that may differ between machines (paths of files and folders, data.workers). Ranks started with
// other values (a torchrun node given other overrides) would train different models, or the
// same one differently, without an error: their averages only need equal sizes. The trainer
// passes a config with train.device and train.dtype resolved (`auto` -> cuda, bf16, ...).
std::string config_fingerprint(const Config& cfg);
// "" when equal, else the keys that differ, "train.lr = 0.001 (rank 0: 0.0003), ..."
std::string config_difference(const std::string& rank0, const std::string& other);

class Rendezvous {
 public:
  // Rank 0 listens on env.rendezvous_port() (all interfaces) and waits for the other ranks;
  // the others connect to env.master_addr (retrying until the timeout). `payload` (rank 0's:
  // the NCCL unique id) reaches every rank: payload() after construction. Each rank sends its
  // `fingerprint` (config_fingerprint) with its hello; a rank whose fingerprint differs from
  // rank 0's stops every rank with an error naming the keys ("" on both sides: not checked).
  Rendezvous(const DistEnv& env, const std::string& payload, double join_timeout_s,
             const std::string& fingerprint = "");
  ~Rendezvous();
  const std::string& payload() const { return payload_; }

  // Watch the peers on a thread: a peer's socket closing without goodbye(), an abort message,
  // `poll()` returning a non-empty error (NCCL's asynchronous error) or no heartbeat() for
  // stall_timeout_s seconds call on_fault(message) once (from the monitor thread; the message
  // names the lost rank). Peers are told so that every rank stops.
  void start_monitor(std::function<void(const std::string&)> on_fault, std::function<std::string()> poll,
                     double stall_timeout_s);
  void heartbeat() { last_beat_ms_.store(now_ms_()); }
  // This rank is busy alone for a while (rank 0's evaluation or checkpoint, the setup before the
  // first step; calls nest): while busy, its monitor counts it as alive and says so to the
  // peers about every 250 ms ('K' frames, relayed by rank 0 to every rank), whose watchdogs and CPU
  // collectives then wait for it (alive()) instead of stopping the run.
  void set_busy(bool on) { busy_ += on ? 1 : -1; }
  // The steady-clock time (net::now_ms) of the last heartbeat, this rank's or a busy peer's.
  const std::atomic<double>* alive() const { return &last_beat_ms_; }
  // A clean end: tell the peers, stop watching.
  void goodbye();
  // Tell the peers this rank is failing (message relayed by rank 0 to every rank).
  void tell_abort(const std::string& why);

 private:
  static double now_ms_();
  void monitor_loop(double stall_timeout_s);
  void fault(const std::string& why);
  bool send_frame(int fd, char type, const std::string& body);

  DistEnv env_;
  std::string payload_;
  std::vector<int> fds_;                 // rank 0: one per rank (fds_[0] = -1); others: fds_[0] = rank 0
  std::vector<std::string> hosts_;       // rank 0: peers' host names
  std::vector<bool> done_;               // peer said goodbye
  std::mutex send_mu_;
  std::thread monitor_;
  std::atomic<bool> stop_{false}, faulted_{false};
  std::atomic<double> last_beat_ms_{0};
  std::atomic<int> busy_{0};
  std::function<void(const std::string&)> on_fault_;
  std::function<std::string()> poll_;
};

// ------------------------------------------------------------------ NCCL data parallel
// One per rank when world > 1: the rendezvous, the NCCL communicator and the watchdog.
class DataParallel {
 public:
  // `device`: CUDA averages with NCCL on the compute stream, the CPU over TCP (tcp::Comm).
  DataParallel(const DistEnv& env, const Config& cfg, Device device);
  ~DataParallel();
  int rank() const { return env_.rank; }
  int world() const { return env_.world; }
  const DistEnv& env() const { return env_; }
  // Before the backward whose gradients reduce() averages (the last micro-batch's): with
  // train.dist_bucket_mb > 0 each bucket of gradients (trainer/grad_buckets.h) is averaged as
  // soon as this backward has written it, on CUDA on comm_stream() after an event, on the CPU
  // on a thread of this object, while the backward goes on. Without it, reduce() averages
  // whole buffers after the backward.
  void begin_backward(Optimizer& opt);
  // After backward: average every flat gradient buffer of `opt` (or what the buckets have not
  // sent yet, then wait for them) and the step's loss (an f32 device scalar, in place) over
  // the ranks; on CUDA ordered on the compute stream (graph-capturable). The clip norm, the
  // non-finite skip and the update then see the same values on every rank.
  void reduce(Optimizer& opt, Tensor& loss);
  // Average one device tensor in place (CUDA: f32/bf16 on the compute stream; CPU: f32/f64).
  void all_reduce_avg(Tensor& t);
  // gather_over_ranks() with this run's collectives (CUDA: NCCL on the compute stream,
  // graph-capturable; CPU: over TCP): x [n, ...] of every rank -> [world * n, ...]. Outside a
  // bucketed backward only.
  Tensor all_gather_rows(const Tensor& x);
  // Stops the run (on every rank, with the same message) unless `value` is the same on every
  // rank: every rank's value is gathered (f64) and compared. Waits for the device: for
  // start-up checks (the step a resumed run starts from).
  void check_same(const std::string& what, double value, const std::string& hint);
  // The same comparison without stopping: true on every rank when all values are equal (a
  // collective; `values` gets "rank 0: v, rank 1: v, ...").
  bool same_on_all_ranks(double value, std::string* values = nullptr);
  // train.zero_stage = 1: shards `opt` over the ranks (Optimizer::shard, ZeRO stage 1), its
  // master weights' parts then gathered after every update (CUDA: one ncclBroadcast per rank in
  // a group, on the compute stream; CPU: over TCP). Before the first step and any resume.
  void shard_optimizer(Optimizer& opt);
  // After every step. The first one also ends the setup's busy time (the constructor starts
  // it: loading the data, building the model, rank 0's baselines may take long on one rank).
  void heartbeat() {
    if (in_setup_) {
      in_setup_ = false;
      rv_->set_busy(false);
    }
    rv_->heartbeat();
  }
  // While one lives, this rank is busy alone (Rendezvous::set_busy): rank 0 around its
  // evaluation and checkpoint writing. A null dp (one process) does nothing.
  struct Busy {
    explicit Busy(DataParallel* dp) : dp_(dp) {
      if (dp_) dp_->rv_->set_busy(true);
    }
    ~Busy() {
      if (dp_) dp_->rv_->set_busy(false);
    }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;
    DataParallel* dp_;
  };
  void finish();                          // clean end (before the process exits)
  void fail(const std::string& why);      // this rank is failing: tell the others
  std::string backend() const;            // one log line

 private:
  void launch(const Tensor& buffer, int64_t offset, int64_t numel);  // one bucket's average, in the background
  void join();                                                        // wait for every launched one

  DistEnv env_;
  Device device_;
  std::unique_ptr<Rendezvous> rv_;
  // NCCL's communicator (CUDA): written once by the constructor, read by the monitor thread too
  std::atomic<void*> comm_{nullptr};
  tcp::Comm tcp_;         // the CPU's
  // gradient buckets (train.dist_bucket_mb > 0)
  double bucket_mb_ = 0;
  int zero_stage_ = 0;
  std::unique_ptr<GradBuckets> buckets_;
  const Optimizer* bucket_opt_ = nullptr;
  bool in_backward_ = false;   // begin_backward() ran, reduce() not yet
  bool learned_logged_ = false;
  std::vector<void*> events_;  // CUDA: one per bucket launched in a backward, reused every step
  size_t next_event_ = 0;
  void* joined_ = nullptr;
  struct Job {
    void* data;
    size_t count;
    DType dtype;
  };
  std::thread worker_;  // CPU: averages the launched buckets in launch order
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool working_ = false, stopping_ = false;
  std::exception_ptr error_;
  bool finished_ = false;
  bool in_setup_ = true;  // until the first heartbeat
};

// Set up this process as a rank (when the environment says it is one): with `cuda`, checks the
// GPU count and narrows CUDA_VISIBLE_DEVICES to GPU LOCAL_RANK (before any CUDA call); for ranks
// other than 0, sends stdout to out_dir/rank_K.log. Returns the parsed environment.
DistEnv select_rank_device(const EnvMap& env, const std::string& out_dir, bool cuda = true);

}  // namespace loom
