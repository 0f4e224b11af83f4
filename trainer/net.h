// net.h: the blocking TCP pieces that data parallel is built from: the rendezvous and its
// monitor (trainer/distributed.cpp) and the CPU collectives (trainer/comm_tcp.cpp).
//
// Every wait has a deadline in milliseconds of the steady clock (now_ms()), so that a peer that
// stops answering is an error after a known time, never a hang.
#pragma once
#include <atomic>
#include <cstddef>
#include <string>
#include <vector>

namespace loom::net {

double now_ms();  // steady clock, milliseconds

// Sends all n bytes (no SIGPIPE when the peer is gone); false when the connection failed.
bool write_all(int fd, const void* p, size_t n);
// Reads exactly n bytes before deadline_ms; false on end of stream, error or timeout. With
// `alive`, the deadline moves to *alive + grace_ms when that is later (a peer known to be busy
// elsewhere: data parallel's keep-alive, trainer/distributed.h).
bool read_all(int fd, void* p, size_t n, double deadline_ms, const std::atomic<double>* alive = nullptr,
              double grace_ms = 0);

// A listening socket on `port` of every interface (IPv6 accepting IPv4 too where the machine
// has IPv6); port 0 takes a free one. Returns the socket and sets *bound to its port; throws
// "<what> cannot listen on port P: <reason>".
int listen_any(int port, int* bound, const char* what);
// Accepts one connection before deadline_ms (TCP_NODELAY set); -1 on timeout.
int accept_until(int listen_fd, double deadline_ms);
// Connects to host:port, retrying every 200 ms until deadline_ms (the peer may start later);
// returns the socket (TCP_NODELAY set), -1 with *why (the last error) when the deadline passed, or
// -2 with *why when the name does not resolve.
int connect_until(const std::string& host, int port, double deadline_ms, std::string* why);

std::string host_name();
// The numeric address of a connected socket's peer ("10.1.2.3", "::1"; an IPv4 peer of an IPv6
// socket in its IPv4 form); "" when the socket has none.
std::string peer_address(int fd);

// Several sockets at once: on each, `send_n` bytes from `send` are written and `recv_n` bytes
// into `recv` are read, all in flight together (poll), so that peers sending to each other
// cannot block one another. Returns -1 when every transfer is complete, or the index of one
// whose peer failed, closed, or left its transfer unfinished at deadline_ms (moved by `alive`
// as in read_all).
struct Transfer {
  int fd;
  const char* send;
  size_t send_n;
  char* recv;
  size_t recv_n;
};
int exchange(std::vector<Transfer>& transfers, double deadline_ms, const std::atomic<double>* alive = nullptr,
             double grace_ms = 0);

}  // namespace loom::net
