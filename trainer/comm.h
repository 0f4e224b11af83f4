// comm.h: the collectives data parallel needs, behind plain types. Two backends:
//   loom::nccl  GPUs: the few NCCL calls (trainer/comm_nccl.cpp). In a build without NCCL
//               (CPU-only, or nccl.h not found) available() is false and every other call throws
//               saying so.
//   loom::tcp   the CPU: the same average over TCP between every pair of ranks
//               (trainer/comm_tcp.cpp), in every build; what PyTorch's gloo backend is to its
//               NCCL one.
#pragma once
#include <atomic>
#include <cstddef>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace loom::nccl {

bool available();
std::string version();                 // "2.28.9" (the library loaded), or why there is none
std::string unique_id();               // ncclGetUniqueId: 128 opaque bytes (rank 0)
void* init(const std::string& id, int world, int rank);  // ncclCommInitRank
void group_start();
void group_end();
// ncclGroupStart / ncclGroupEnd around a scope: the group ends when the scope does, also when a
// call inside it throws (an open group would hold every later NCCL call of the thread)
struct Group {
  Group() { group_start(); }
  ~Group() noexcept(false) {
    if (std::uncaught_exceptions() > 0) {
      try { group_end(); } catch (...) {}  // the first error is the one to report
    } else {
      group_end();
    }
  }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
};
// In place on `stream` (the compute stream): sum / world of every rank's buffer.
void all_reduce_avg(void* comm, void* buf, size_t count, DType dt, Stream stream);
// On `stream`: recv [world x count] = every rank's send [count], in rank order.
void all_gather(void* comm, const void* send, void* recv, size_t count, DType dt, Stream stream);
// On `stream`, in place: buf's `count` elements from rank `root` to every rank (in a group:
// one per rank for parts of unequal sizes, ZeRO-1's master weights)
void broadcast(void* comm, void* buf, size_t count, DType dt, int root, Stream stream);
// NCCL's asynchronous error of the communicator ("" when none)
std::string async_error(void* comm);
void abort(void* comm);
void destroy(void* comm);

}  // namespace loom::nccl

namespace loom::tcp {

// Data parallel on the CPU: every pair of ranks holds one connection (rank 0's to the others
// made first, when they join; through them the ranks learn each other's addresses and connect
// the rest). An average runs in windows of kChunkBytes, each cut into `world` parts; part q
// belongs to rank q:
//   1. every rank sends part q of its buffer to rank q and receives every rank's values of its
//      own part (all transfers in flight together: net::exchange);
//   2. it sums them in rank order in double precision, divides by the world size and rounds
//      once to the buffer's dtype;
//   3. it sends that part to every rank and receives theirs.
// So every rank gets the same bits (the weights stay identical without a broadcast), the same
// bits as a sum over the ranks in rank order would give, and the sum does not depend on
// timing. Each rank sends and receives 2 x (world - 1) / world x the buffer, as in a ring; a
// window needs (world - 1) / world x kChunkBytes of receive space. Gathers go through rank 0.
class Comm {
 public:
  static constexpr size_t kChunkBytes = size_t(1) << 22;
  // Rank 0, before the rendezvous: listen on a free port of every interface. The payload it
  // hands the rendezvous ("loom-tcp PORT") tells the other ranks where to connect.
  static Comm listen(int world, double timeout_s);
  std::string payload() const;
  // Rank 0: accept the other ranks (after the rendezvous has sent them the payload).
  void accept_ranks();
  // Ranks > 0: connect to rank 0 at `host` with rank 0's payload. accept_ranks() and connect()
  // return when every pair of ranks is connected (all ranks call one of them).
  static Comm connect(const std::string& host, const std::string& payload, int rank, int world, double timeout_s);

  Comm() = default;
  Comm(Comm&& o) noexcept;
  Comm& operator=(Comm&& o) noexcept;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  ~Comm();

  // In place: the element-wise mean of every rank's buffer (f32 or f64, host memory). A peer
  // that is gone or sends nothing for timeout_s seconds is an error naming it.
  void all_reduce_avg(void* buf, size_t count, DType dt);
  // recv [world x bytes] = every rank's `bytes` bytes of send, in rank order (any dtype: the
  // bytes are copied, not added). Rank 0 collects the parts and sends the whole to each rank.
  void all_gather(const void* send, void* recv, size_t bytes);
  // In place, parts of any sizes: rank r's bytes [bounds[r], bounds[r + 1]) of buf to every
  // rank (bounds has world + 1 entries, non-decreasing).
  void all_gather_parts(void* buf, const std::vector<size_t>& bounds);
  // How long an average waits for a peer (train.dist_timeout; the join uses the timeout given
  // to listen / connect).
  void set_timeout(double seconds) { timeout_ms_ = seconds * 1e3; }
  // A clock (net::now_ms) of the last sign of life of the run (Rendezvous::alive()): a wait for
  // a peer lasts until timeout_s after it, so that a rank busy alone (rank 0's evaluation, a
  // slow setup) is not taken for a lost one.
  void set_alive(const std::atomic<double>* last_alive_ms) { alive_ = last_alive_ms; }

 private:
  template <class T>
  void average(T* buf, size_t count);

  // every rank: accept the higher ranks' connections on listen_fd_, connect to the lower ones
  // (rank 0's already made) at the addresses in `table` ("port host" per rank; rank 0's unused)
  void connect_pairs(const std::vector<std::string>& table, double deadline_ms);
  // Accepts connections on listen_fd_ until ranks first .. world_ - 1 all have one, then closes
  // it. Each connection first sends its rank and then `extra` int32 words; one whose rank lies
  // outside that range, is taken already, or whose words `ok` refuses is not one of ours and is
  // closed; joined(rank, fd, words) is called for each one taken. When the deadline passes
  // first, the error is late(how many were taken).
  void accept_from(int first, int extra, double deadline_ms, const std::function<bool(const int32_t* words)>& ok,
                   const std::function<void(int rank, int fd, const int32_t* words)>& joined,
                   const std::function<std::string(int joined)>& late);

  int rank_ = 0, world_ = 1, listen_fd_ = -1, port_ = 0;
  double timeout_ms_ = 0;
  const std::atomic<double>* alive_ = nullptr;
  std::vector<int> fds_;     // fds_[q]: the connection to rank q (fds_[rank_] = -1)
  std::vector<char> parts_;  // an average's window: every rank's values of this rank's part
};

}  // namespace loom::tcp
