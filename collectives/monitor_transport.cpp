#include "collectives/monitor_transport.h"

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
#include <cstdlib>
#include <cstring>
#include <thread>

#include "hardware/env.h"
#include "hardware/host.h"

namespace tetra::collectives::monitor {

int64_t mono_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
}

std::string text_of(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

std::string string_field(const nlohmann::json& j, const char* key) {
  if (!j.is_object()) return "";
  const auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

std::string line_limit_text(size_t limit) {
  return limit >= (size_t{1} << 20) ? std::to_string(limit >> 20) + " MiB" : std::to_string(limit) + " bytes";
}

bool send_all(int fd, const std::string& line) {
  if (fd < 0) return false;
  std::string msg = line + "\n";
  size_t off = 0;
  while (off < msg.size()) {
    const ssize_t n = ::send(fd, msg.data() + off, msg.size() - off, MSG_NOSIGNAL);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return false;
    }
    off += static_cast<size_t>(n);
  }
  return true;
}

Read read_lines(Connection& p, std::vector<std::string>& lines, size_t limit) {
  char buf[65536];
  const ssize_t n = ::recv(p.fd, buf, sizeof(buf), MSG_DONTWAIT);
  if (n == 0) return Read::kClosed;
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? Read::kOpen : Read::kClosed;
  p.in.append(buf, static_cast<size_t>(n));
  bool too_long = false;
  size_t start = 0, nl;
  while ((nl = p.in.find('\n', p.scanned)) != std::string::npos) {
    if (p.skipping || nl - start > limit) too_long = too_long || !p.skipping;
    else lines.push_back(p.in.substr(start, nl - start));
    p.skipping = false;
    start = p.scanned = nl + 1;
  }
  p.in.erase(0, start);
  p.scanned = p.in.size();
  if (p.in.size() > limit) {
    too_long = too_long || !p.skipping;
    p.skipping = true;
    p.in.clear();
    p.scanned = 0;
  }
  return too_long ? Read::kTooLong : Read::kOpen;
}

bool next_line(Connection& p, std::vector<std::string>& queue, Deadline until, size_t limit, std::string& line) {
  while (queue.empty()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    if (left <= 0) return false;
    pollfd f{p.fd, POLLIN, 0};
    if (::poll(&f, 1, static_cast<int>(std::min<int64_t>(left, 1000))) < 0 && errno != EINTR) return false;
    if (f.revents && read_lines(p, queue, limit) != Read::kOpen) return false;
  }
  line = queue.front();
  queue.erase(queue.begin());
  return true;
}

namespace {

// One attempt at host:port, waiting at most `patience` for the connection (an address of
// another network may drop packets instead of refusing them). -1 and `why` on failure.
int try_connect(const std::string& host, const std::string& port, Duration patience, std::string& why) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    why = gai_strerror(rc);
    return -1;
  }
  int found = -1;
  for (addrinfo* a = res; a && found < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const int flags = ::fcntl(fd, F_GETFL);
    ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
    int err = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const int ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(patience).count());
      if (::poll(&p, 1, ms) == 1) {
        socklen_t len = sizeof(err);
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      } else {
        err = ETIMEDOUT;
      }
    }
    if (err == 0) {
      ::fcntl(fd, F_SETFL, flags);
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      found = fd;
    } else {
      why = std::strerror(err);
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  return found;
}

// Rank 0's address as it shares it: "name,10.0.0.1,192.168.1.7:port", its hostname and its
// interfaces' addresses (or TETRA_MONITOR_ADDR alone), so that a host where the name does
// not resolve, or resolves to another address, still reaches it.
std::string advertised_address(int port) {
  std::vector<std::string> names;
  if (std::string host = env::text(env::kMonitorAddr); !host.empty()) {
    names.push_back(std::move(host));
  } else {
    names.push_back(hardware::network_name());
    for (const std::string& a : hardware::ipv4_addresses()) names.push_back(a);
  }
  const std::string tail = ":" + std::to_string(port);
  std::string out;
  for (const std::string& n : names)
    if (out.size() + n.size() + 1 + tail.size() <= 255) out += (out.empty() ? "" : ",") + n;
  return out + tail;
}

}  // namespace

int connect_to(const std::string& address, Deadline deadline) {
  const size_t colon = address.rfind(':');
  const std::string port = address.substr(colon + 1);
  std::vector<std::string> hosts;
  for (size_t b = 0; b < colon;) {
    const size_t e = std::min(address.find(',', b), colon);
    hosts.push_back(address.substr(b, e - b));
    b = e + 1;
  }
  std::vector<std::string> why(hosts.size(), "no attempt");
  while (Clock::now() < deadline) {
    for (size_t i = 0; i < hosts.size(); ++i) {
      const int fd = try_connect(hosts[i], port, std::chrono::seconds(2), why[i]);
      if (fd >= 0) return fd;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::string tried;
  for (size_t i = 0; i < hosts.size(); ++i) tried += (i ? "; " : "") + hosts[i] + ": " + why[i];
  throw CommError("monitor: cannot connect to rank 0 on port " + port + " (" + tried +
                  "). Set TETRA_MONITOR_ADDR to an address of rank 0's host that this host reaches");
}

// Note [Monitor listens]: only where the ranks are told to connect. TETRA_MONITOR_ADDR
// given as an IPv4 address of this host: that address alone. A world on one network
// namespace of one kernel (one host, no test hosts): loopback alone, unreachable from
// any other machine. Otherwise every interface, since the ranks are told each of them.
Listener listen_for_ranks(bool one_network) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw CommError(std::string("monitor: socket: ") + std::strerror(errno));
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  const std::optional<std::string> host_env = env::get(env::kMonitorAddr);
  in_addr given{};
  const bool numeric = host_env && ::inet_pton(AF_INET, host_env->c_str(), &given) == 1;
  addr.sin_addr.s_addr = numeric ? given.s_addr : htonl(one_network ? INADDR_LOOPBACK : INADDR_ANY);
  const std::optional<std::string> port_env = env::get(env::kMonitorPort);
  addr.sin_port = htons(static_cast<uint16_t>(port_env ? std::atoi(port_env->c_str()) : 0));
  int bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  if (bound != 0 && numeric && errno == EADDRNOTAVAIL) {  // an address others reach this host at (NAT)
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  }
  if (bound != 0 || ::listen(fd, 1024) != 0) {
    const std::string e = std::strerror(errno);
    ::close(fd);
    throw CommError("monitor: cannot listen on port " + port_env.value_or("(any)") + ": " + e +
                    " (TETRA_MONITOR_PORT picks another)");
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  Listener l;
  l.fd = fd;
  l.address = one_network && !host_env ? "127.0.0.1:" + std::to_string(ntohs(addr.sin_port))
                                       : advertised_address(ntohs(addr.sin_port));
  return l;
}

void WakePipe::open() {
  if (::pipe(fds_) != 0) throw CommError(std::string("monitor: pipe: ") + std::strerror(errno));
  ::fcntl(fds_[0], F_SETFL, O_NONBLOCK);
}

void WakePipe::close() {
  for (int& fd : fds_) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
}

void WakePipe::wake() {
  ssize_t ignored = ::write(fds_[1], "x", 1);
  (void)ignored;
}

void WakePipe::drain() {
  char b[64];
  while (::read(fds_[0], b, sizeof(b)) > 0) {
  }
}

}  // namespace tetra::collectives::monitor
