// comm_tcp.cpp: data parallel's average on the CPU, over TCP through rank 0 (see comm.h).
#include <unistd.h>

#include <cstring>

#include "trainer/comm.h"
#include "trainer/net.h"

namespace loom::tcp {

static constexpr const char* kPrefix = "loom-tcp ";

Comm Comm::listen(int world, double timeout_s) {
  Comm c;
  c.rank_ = 0;
  c.world_ = world;
  c.timeout_ms_ = timeout_s * 1e3;
  c.listen_fd_ = net::listen_any(0, &c.port_, "data parallel (CPU): rank 0");
  c.fds_.assign(size_t(world), -1);
  return c;
}

std::string Comm::payload() const { return kPrefix + std::to_string(port_); }

void Comm::accept_ranks() {
  LOOM_CHECK(rank_ == 0 && listen_fd_ >= 0, "tcp::Comm::accept_ranks: rank 0's, once");
  const double deadline = net::now_ms() + timeout_ms_;
  for (int joined = 1; joined < world_;) {
    int fd = net::accept_until(listen_fd_, deadline);
    LOOM_CHECK(fd >= 0, "data parallel (CPU): only %d of %d ranks connected to rank 0's port %d within %.0f s", joined,
               world_, port_, timeout_ms_ / 1e3);
    int32_t r = -1;
    if (!net::read_all(fd, &r, sizeof r, deadline) || r <= 0 || r >= world_ || fds_[size_t(r)] >= 0) {
      close(fd);  // not one of ours
      continue;
    }
    fds_[size_t(r)] = fd;
    joined++;
  }
  close(listen_fd_);
  listen_fd_ = -1;
}

Comm Comm::connect(const std::string& host, const std::string& payload, int rank, int world, double timeout_s) {
  LOOM_CHECK(payload.rfind(kPrefix, 0) == 0,
             "data parallel (CPU): rank %d trains on the CPU but rank 0 does not (its payload is not a CPU "
             "collectives' port: is train.device the same on every rank?)", rank);
  Comm c;
  c.rank_ = rank;
  c.world_ = world;
  c.timeout_ms_ = timeout_s * 1e3;
  c.port_ = std::atoi(payload.c_str() + std::strlen(kPrefix));
  std::string why;
  int fd = net::connect_until(host, c.port_, net::now_ms() + c.timeout_ms_, &why);
  LOOM_CHECK(fd >= 0, "data parallel (CPU): rank %d cannot reach rank 0 at %s:%d: %s", rank, host.c_str(), c.port_,
             why.c_str());
  int32_t r = rank;
  LOOM_CHECK(net::write_all(fd, &r, sizeof r), "data parallel (CPU): rank %d: lost rank 0 while joining", rank);
  c.fds_ = {fd};
  return c;
}

Comm::Comm(Comm&& o) noexcept { *this = std::move(o); }

Comm& Comm::operator=(Comm&& o) noexcept {
  std::swap(rank_, o.rank_);
  std::swap(world_, o.world_);
  std::swap(listen_fd_, o.listen_fd_);
  std::swap(port_, o.port_);
  std::swap(timeout_ms_, o.timeout_ms_);
  std::swap(fds_, o.fds_);
  std::swap(sum_, o.sum_);
  std::swap(peer_, o.peer_);
  return *this;
}

Comm::~Comm() {
  for (int fd : fds_)
    if (fd >= 0) close(fd);
  if (listen_fd_ >= 0) close(listen_fd_);
}

void Comm::all_reduce_avg(void* buf, size_t count, DType dt) {
  if (world_ == 1 || count == 0) return;
  if (dt == DType::F32) average(static_cast<float*>(buf), count);
  else if (dt == DType::F64) average(static_cast<double*>(buf), count);
  else LOOM_CHECK(false, "data parallel (CPU): no average for dtype %s (f32, f64)", dtype_name(dt));
}

void Comm::all_gather(const void* send, void* recv, size_t bytes) {
  char* out = static_cast<char*>(recv);
  if (send != out + size_t(rank_) * bytes) std::memcpy(out + size_t(rank_) * bytes, send, bytes);
  std::vector<size_t> bounds(size_t(world_) + 1);
  for (int r = 0; r <= world_; r++) bounds[size_t(r)] = size_t(r) * bytes;
  all_gather_parts(recv, bounds);
}

void Comm::all_gather_parts(void* buf, const std::vector<size_t>& bounds) {
  LOOM_CHECK(bounds.size() == size_t(world_) + 1, "tcp::Comm::all_gather_parts: %zu bounds for %d ranks",
             bounds.size(), world_);
  char* p = static_cast<char*>(buf);
  const size_t all = bounds.back() - bounds.front();
  if (world_ == 1 || all == 0) return;
  auto part = [&](int r) { return std::make_pair(p + bounds[size_t(r)], bounds[size_t(r) + 1] - bounds[size_t(r)]); };
  const double deadline = net::now_ms() + timeout_ms_;
  if (rank_ != 0) {  // send this rank's part, get the whole back
    auto [mine, n] = part(rank_);
    LOOM_CHECK(net::write_all(fds_[0], mine, n) &&
                   net::read_all(fds_[0], p + bounds.front(), all, deadline, alive_, timeout_ms_),
               "data parallel (CPU): rank %d lost rank 0 during a gather (it stopped, or sent nothing for %.0f s)",
               rank_, timeout_ms_ / 1e3);
    return;
  }
  for (int r = 1; r < world_; r++) {
    auto [theirs, n] = part(r);
    LOOM_CHECK(net::read_all(fds_[size_t(r)], theirs, n, deadline, alive_, timeout_ms_),
               "data parallel (CPU): rank 0 lost rank %d during a gather (it stopped, or sent nothing for %.0f s)", r,
               timeout_ms_ / 1e3);
  }
  for (int r = 1; r < world_; r++)
    LOOM_CHECK(net::write_all(fds_[size_t(r)], p + bounds.front(), all),
               "data parallel (CPU): rank 0 lost rank %d during a gather", r);
}

template <class T>
void Comm::average(T* buf, size_t count) {
  const size_t per = kChunkBytes / sizeof(T);
  for (size_t at = 0; at < count; at += per) {
    const size_t n = std::min(per, count - at), bytes = n * sizeof(T);
    T* p = buf + at;
    const double deadline = net::now_ms() + timeout_ms_;
    if (rank_ != 0) {  // send the chunk, get the mean back
      LOOM_CHECK(net::write_all(fds_[0], p, bytes) && net::read_all(fds_[0], p, bytes, deadline, alive_, timeout_ms_),
                 "data parallel (CPU): rank %d lost rank 0 during an average (it stopped, or sent nothing for %.0f "
                 "s)", rank_, timeout_ms_ / 1e3);
      continue;
    }
    sum_.assign(p, p + n);  // rank 0's values, then every other rank's in rank order
    peer_.resize(bytes);
    const T* peer = reinterpret_cast<const T*>(peer_.data());
    for (int r = 1; r < world_; r++) {
      LOOM_CHECK(net::read_all(fds_[size_t(r)], peer_.data(), bytes, deadline, alive_, timeout_ms_),
                 "data parallel (CPU): rank 0 lost rank %d during an average (it stopped, or sent nothing for %.0f s)",
                 r, timeout_ms_ / 1e3);
      for (size_t i = 0; i < n; i++) sum_[i] += double(peer[i]);
    }
    for (size_t i = 0; i < n; i++) p[i] = T(sum_[i] / world_);  // rounded once
    for (int r = 1; r < world_; r++)
      LOOM_CHECK(net::write_all(fds_[size_t(r)], p, bytes), "data parallel (CPU): rank 0 lost rank %d during an average",
                 r);
  }
}

}  // namespace loom::tcp
