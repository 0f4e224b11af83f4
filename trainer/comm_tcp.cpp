// comm_tcp.cpp: data parallel's collectives on the CPU over TCP (see comm.h): the ranks' connections,
// the average between every pair of ranks, the gathers through rank 0.
#include <unistd.h>

#include <algorithm>
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

// The joining protocol: a rank r > 0 listens on a port of its own, connects to rank 0 and sends
// {r, that port}; rank 0 notes where each connection came from and, once all have joined,
// sends every rank the table "port address" per rank (address "" for rank 0 and for ranks on
// rank 0's machine, which joined through a loopback address: they are reached as rank 0 is).
// Then each rank connects to the ranks below it and accepts those above it (connect_pairs).
namespace {

bool is_loopback(const std::string& a) { return a.empty() || a.rfind("127.", 0) == 0 || a == "::1"; }

void send_text(int fd, const std::string& t, int to) {
  const uint32_t n = uint32_t(t.size());
  LOOM_CHECK(net::write_all(fd, &n, sizeof n) && net::write_all(fd, t.data(), t.size()),
             "data parallel (CPU): rank 0 lost rank %d while sending it the ranks' addresses", to);
}

}  // namespace

void Comm::accept_from(int first, int extra, double deadline_ms, const std::function<bool(const int32_t*)>& ok,
                       const std::function<void(int, int, const int32_t*)>& joined,
                       const std::function<std::string(int)>& late) {
  int32_t words[4] = {-1, 0, 0, 0};  // {rank, extra words...}
  LOOM_CHECK(extra >= 0 && extra < 4, "tcp::Comm::accept_from: %d extra words", extra);
  const size_t bytes = sizeof(int32_t) * size_t(1 + extra);
  for (int n = 0; n < world_ - first;) {
    int fd = net::accept_until(listen_fd_, deadline_ms);
    LOOM_CHECK(fd >= 0, "%s", late(n).c_str());
    words[0] = -1;
    if (!net::read_all(fd, words, bytes, deadline_ms) || words[0] < first || words[0] >= world_ ||
        fds_[size_t(words[0])] >= 0 || !ok(words + 1)) {
      close(fd);  // not one of ours
      continue;
    }
    fds_[size_t(words[0])] = fd;
    joined(words[0], fd, words + 1);
    n++;
  }
  close(listen_fd_);
  listen_fd_ = -1;
}

void Comm::accept_ranks() {
  LOOM_CHECK(rank_ == 0 && listen_fd_ >= 0, "tcp::Comm::accept_ranks: rank 0's, once");
  const double deadline = net::now_ms() + timeout_ms_;
  std::vector<std::string> table(size_t(world_), "0 ");
  // each rank's hello: {rank, the port it listens on}
  accept_from(
      1, 1, deadline, [](const int32_t* port) { return port[0] > 0 && port[0] <= 65535; },
      [&](int r, int fd, const int32_t* port) {
        const std::string from = net::peer_address(fd);
        table[size_t(r)] = std::to_string(port[0]) + " " + (is_loopback(from) ? "" : from);
      },
      [&](int n) {
        return strformat("data parallel (CPU): only %d of %d ranks connected to rank 0's port %d within %.0f s", n + 1,
                         world_, port_, timeout_ms_ / 1e3);
      });
  std::string text;
  for (const std::string& row : table) text += row + "\n";
  for (int r = 1; r < world_; r++) send_text(fds_[size_t(r)], text, r);
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
  const double deadline = net::now_ms() + c.timeout_ms_;
  int mine = 0;  // the port the ranks above this one connect to
  const std::string what = "data parallel (CPU): rank " + std::to_string(rank);
  c.listen_fd_ = net::listen_any(0, &mine, what.c_str());
  std::string why;
  int fd = net::connect_until(host, c.port_, deadline, &why);
  LOOM_CHECK(fd >= 0, "data parallel (CPU): rank %d cannot reach rank 0 at %s:%d: %s", rank, host.c_str(), c.port_,
             why.c_str());
  c.fds_.assign(size_t(world), -1);
  c.fds_[0] = fd;
  int32_t hello[2] = {rank, mine};
  LOOM_CHECK(net::write_all(fd, hello, sizeof hello), "data parallel (CPU): rank %d: lost rank 0 while joining", rank);
  uint32_t n = 0;
  std::string text;
  bool ok = net::read_all(fd, &n, sizeof n, deadline) && n < (1u << 24);
  if (ok) text.resize(n), ok = net::read_all(fd, text.data(), n, deadline);
  LOOM_CHECK(ok, "data parallel (CPU): rank %d: rank 0 sent no table of the ranks' addresses within %.0f s", rank,
             timeout_s);
  std::vector<std::string> table;
  for (size_t at = 0, nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1) table.push_back(text.substr(at, nl - at));
  LOOM_CHECK(int(table.size()) == world, "data parallel (CPU): rank %d: a table of %zu addresses for %d ranks", rank,
             table.size(), world);
  for (std::string& row : table) {  // "port address": an empty address is rank 0's host
    const size_t sp = row.find(' ');
    if (sp != std::string::npos && sp + 1 == row.size()) row += host;
  }
  c.connect_pairs(table, deadline);
  return c;
}

void Comm::connect_pairs(const std::vector<std::string>& table, double deadline_ms) {
  for (int q = 1; q < rank_; q++) {
    const std::string& row = table[size_t(q)];
    const size_t sp = row.find(' ');
    const int port = std::atoi(row.c_str());
    const std::string addr = sp == std::string::npos ? "" : row.substr(sp + 1);
    std::string why;
    int fd = net::connect_until(addr, port, deadline_ms, &why);
    LOOM_CHECK(fd >= 0, "data parallel (CPU): rank %d cannot reach rank %d at %s:%d: %s", rank_, q, addr.c_str(), port,
               why.c_str());
    int32_t r = rank_;
    LOOM_CHECK(net::write_all(fd, &r, sizeof r), "data parallel (CPU): rank %d: lost rank %d while joining", rank_, q);
    fds_[size_t(q)] = fd;
  }
  accept_from(
      rank_ + 1, 0, deadline_ms, [](const int32_t*) { return true; }, [](int, int, const int32_t*) {},
      [&](int n) {
        return strformat("data parallel (CPU): rank %d: only %d of the %d ranks above it connected within %.0f s",
                         rank_, n, world_ - rank_ - 1, timeout_ms_ / 1e3);
      });
}

Comm::Comm(Comm&& o) noexcept { *this = std::move(o); }

Comm& Comm::operator=(Comm&& o) noexcept {
  std::swap(rank_, o.rank_);
  std::swap(world_, o.world_);
  std::swap(listen_fd_, o.listen_fd_);
  std::swap(port_, o.port_);
  std::swap(timeout_ms_, o.timeout_ms_);
  std::swap(fds_, o.fds_);
  std::swap(parts_, o.parts_);
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
  const size_t world = size_t(world_), me = size_t(rank_);
  const size_t window = std::max(kChunkBytes / sizeof(T), world);
  std::vector<net::Transfer> ts;
  std::vector<int> peer;  // ts[i] goes to rank peer[i]
  auto run = [&] {
    const int bad = net::exchange(ts, net::now_ms() + timeout_ms_, alive_, timeout_ms_);
    LOOM_CHECK(bad < 0, "data parallel (CPU): rank %d lost rank %d during an average (it stopped, or sent nothing for "
               "%.0f s)", rank_, bad < 0 ? -1 : peer[size_t(bad)], timeout_ms_ / 1e3);
  };
  for (size_t at = 0; at < count; at += window) {
    const size_t n = std::min(window, count - at);
    T* p = buf + at;
    auto lo = [&](size_t q) { return n * q / world; };  // part q: [lo(q), lo(q + 1))
    const size_t m0 = lo(me), m = lo(me + 1) - m0;
    parts_.resize(world * m * sizeof(T));
    T* got = reinterpret_cast<T*>(parts_.data());  // got[q * m + i]: rank q's value of element m0 + i
    ts.clear(), peer.clear();
    for (size_t q = 0; q < world; q++)  // part q to rank q, every rank's values of this rank's part back
      if (q != me)
        ts.push_back({fds_[q], reinterpret_cast<const char*>(p + lo(q)), (lo(q + 1) - lo(q)) * sizeof(T),
                      reinterpret_cast<char*>(got + q * m), m * sizeof(T)}),
            peer.push_back(int(q));
    run();
    for (size_t i = 0; i < m; i++) {  // in rank order, in double, rounded once
      double s = 0;
      for (size_t q = 0; q < world; q++) s += double(q == me ? p[m0 + i] : got[q * m + i]);
      p[m0 + i] = T(s / world_);
    }
    ts.clear(), peer.clear();
    for (size_t q = 0; q < world; q++)  // this rank's mean to every rank, theirs back
      if (q != me)
        ts.push_back({fds_[q], reinterpret_cast<const char*>(p + m0), m * sizeof(T), reinterpret_cast<char*>(p + lo(q)),
                      (lo(q + 1) - lo(q)) * sizeof(T)}),
            peer.push_back(int(q));
    run();
  }
}

}  // namespace loom::tcp
