// net.h: the blocking TCP pieces that data parallel is built from: the rendezvous and its
// monitor (trainer/distributed.cpp) and the CPU collectives (trainer/comm_tcp.cpp).
//
// Every wait has a deadline in milliseconds of the steady clock (now_ms()), so that a peer that
// stops answering is an error after a known time, never a hang.
#pragma once
#include <atomic>
#include <cstddef>
#include <string>

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

}  // namespace loom::net
