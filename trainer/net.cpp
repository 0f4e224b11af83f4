// net.cpp: blocking TCP helpers with deadlines (see net.h).
#include "trainer/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "tensor/tensor.h"

namespace loom::net {

double now_ms() {
  using namespace std::chrono;
  return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= size_t(w);
  }
  return true;
}

bool read_all(int fd, void* data, size_t n, double deadline_ms, const std::atomic<double>* alive, double grace_ms) {
  char* p = static_cast<char*>(data);
  while (n) {
    if (alive) deadline_ms = std::max(deadline_ms, alive->load() + grace_ms);
    int wait = int(std::max(0.0, deadline_ms - now_ms()));
    pollfd pf{fd, POLLIN, 0};
    int k = ::poll(&pf, 1, std::min(wait, 1000));
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) {
      if (alive) deadline_ms = std::max(deadline_ms, alive->load() + grace_ms);
      if (now_ms() >= deadline_ms) return false;
      continue;
    }
    ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= size_t(r);
  }
  return true;
}

static void no_delay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int listen_any(int port, int* bound, const char* what) {
  int ls = socket(AF_INET6, SOCK_STREAM, 0);
  const bool v6 = ls >= 0;
  if (!v6) ls = socket(AF_INET, SOCK_STREAM, 0);
  LOOM_CHECK(ls >= 0, "%s: socket: %s", what, std::strerror(errno));
  int one = 1, zero = 0;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int rc;
  if (v6) {
    setsockopt(ls, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(uint16_t(port));
    rc = bind(ls, (sockaddr*)&a, sizeof a);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(uint16_t(port));
    rc = bind(ls, (sockaddr*)&a, sizeof a);
  }
  if (rc != 0 || listen(ls, 128) != 0) {
    int e = errno;
    close(ls);
    LOOM_CHECK(false, "%s cannot listen on port %d: %s", what, port, std::strerror(e));
  }
  sockaddr_storage got{};
  socklen_t len = sizeof got;
  getsockname(ls, (sockaddr*)&got, &len);
  if (bound)
    *bound = got.ss_family == AF_INET6 ? ntohs(((sockaddr_in6*)&got)->sin6_port) : ntohs(((sockaddr_in*)&got)->sin_port);
  return ls;
}

int accept_until(int ls, double deadline_ms) {
  while (true) {
    int wait = int(deadline_ms - now_ms());
    if (wait <= 0) return -1;
    pollfd pf{ls, POLLIN, 0};
    int k = ::poll(&pf, 1, std::min(wait, 1000));
    if (k <= 0) continue;  // EINTR or this second's wait; the deadline is checked above
    int fd = accept(ls, nullptr, nullptr);
    if (fd < 0) continue;
    no_delay(fd);
    return fd;
  }
}

int connect_until(const std::string& host, int port, double deadline_ms, std::string* why) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  int gai = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (gai != 0) {
    *why = gai_strerror(gai);
    return -2;
  }
  int fd = -1;
  *why = "no attempt";
  while (fd < 0) {
    for (addrinfo* ai = res; ai && fd < 0; ai = ai->ai_next) {
      int s = socket(ai->ai_family, SOCK_STREAM, 0);
      if (s < 0) continue;
      int fl = fcntl(s, F_GETFL, 0);
      fcntl(s, F_SETFL, fl | O_NONBLOCK);
      int rc = connect(s, ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd pf{s, POLLOUT, 0};
        int wait = int(std::max(1.0, std::min(2000.0, deadline_ms - now_ms())));
        if (::poll(&pf, 1, wait) == 1) {
          int e = 0;
          socklen_t el = sizeof e;
          getsockopt(s, SOL_SOCKET, SO_ERROR, &e, &el);
          rc = e == 0 ? 0 : -1;
          errno = e;
        } else {
          errno = ETIMEDOUT;
        }
      }
      if (rc == 0) {
        fcntl(s, F_SETFL, fl);
        fd = s;
      } else {
        *why = std::strerror(errno);
        close(s);
      }
    }
    if (fd >= 0 || now_ms() >= deadline_ms) break;
    usleep(200000);
  }
  freeaddrinfo(res);
  if (fd >= 0) no_delay(fd);
  return fd;
}

std::string host_name() {
  char h[256] = {0};
  gethostname(h, sizeof h - 1);
  return h;
}

std::string peer_address(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (getpeername(fd, (sockaddr*)&a, &len) != 0) return "";
  char h[NI_MAXHOST] = {0};
  if (getnameinfo((sockaddr*)&a, len, h, sizeof h, nullptr, 0, NI_NUMERICHOST) != 0) return "";
  std::string s = h;
  if (s.rfind("::ffff:", 0) == 0 && s.find('.') != std::string::npos) s = s.substr(7);  // an IPv4 peer
  return s;
}

int exchange(std::vector<Transfer>& ts, double deadline_ms, const std::atomic<double>* alive, double grace_ms) {
  std::vector<pollfd> pf;
  std::vector<size_t> at;  // pf[j] is ts[at[j]]
  while (true) {
    pf.clear();
    at.clear();
    for (size_t i = 0; i < ts.size(); i++) {
      short ev = short((ts[i].send_n ? POLLOUT : 0) | (ts[i].recv_n ? POLLIN : 0));
      if (ev) pf.push_back({ts[i].fd, ev, 0}), at.push_back(i);
    }
    if (pf.empty()) return -1;
    if (alive) deadline_ms = std::max(deadline_ms, alive->load() + grace_ms);
    const double left = deadline_ms - now_ms();
    if (left <= 0) return int(at[0]);  // the first transfer still waiting
    int k = ::poll(pf.data(), nfds_t(pf.size()), int(std::min(left, 1000.0)) + 1);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) continue;  // this second's wait; the deadline is checked above
    for (size_t j = 0; j < pf.size(); j++) {
      Transfer& t = ts[at[j]];
      const short re = pf[j].revents;
      if (!re) continue;
      bool moved = false;
      if (t.recv_n && (re & (POLLIN | POLLHUP | POLLERR))) {
        ssize_t r = ::recv(t.fd, t.recv, t.recv_n, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return int(at[j]);
        if (r > 0) t.recv += r, t.recv_n -= size_t(r), moved = true;
      }
      if (t.send_n && (re & (POLLOUT | POLLHUP | POLLERR))) {
        ssize_t w = ::send(t.fd, t.send, t.send_n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w == 0 || (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return int(at[j]);
        if (w > 0) t.send += w, t.send_n -= size_t(w), moved = true;
      }
      if (!moved && (re & (POLLERR | POLLNVAL))) return int(at[j]);
    }
  }
}

}  // namespace loom::net
