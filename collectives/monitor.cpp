#include "collectives/monitor.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "collectives/watchdog.h"
#include "hardware/host.h"

namespace tetra::collectives {

namespace {

// The monitor's own clock (steady: a step of the system clock is no silence).
int64_t mono_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
}

struct Peer {
  int fd = -1;
  std::string in;
  int rank = -1;
  std::string where;
  bool goodbye = false;  // said bye or fail: its closing is not a death
  int64_t heard_us = 0;  // mono_us()
};

struct State {
  std::mutex mu;
  bool running = false, server = false;
  int rank = 0, size = 1;
  MonitorOptions options;
  std::thread thread;
  int wake[2] = {-1, -1};
  std::atomic<bool> stop{false};
  std::atomic<bool> ending{false};
  std::mutex send_mu;
  // server: the clients and their latest reports; lines other threads want broadcast
  int listen_fd = -1;
  std::vector<std::string> outbox;  // guarded by mu
  std::map<int, Peer> peers;  // by fd
  std::map<int, std::vector<MemberProgress>> reports;  // by rank
  std::map<int, std::string> where;                    // by rank
  // client: the connection to rank 0
  Peer up;
  int64_t next_query = 1;
  std::map<int64_t, std::vector<MemberProgress>> answers;
  std::condition_variable answered;
  // a failure another rank reported: end after the grace period (mono_us)
  std::string failure;
  int64_t failure_deadline_us = 0;
  // Note [Silence]: from options.silence
  int64_t silent_us = 20'000'000, heartbeat_us = 2'000'000, stalled_us = 5'000'000;
};

State& st() {
  static State* s = new State;  // leaked: the monitor thread may run during static destruction
  return *s;
}
int st_size() { return st().size; }

// Reports when something changed: often enough that a death names a recent op, rarely
// enough that rank 0 is not flooded (a quarter second, 5 ms per rank beyond 50 ranks).
int64_t report_every_us() { return std::max<int64_t>(250'000, int64_t{5'000} * st_size()); }

// Never throws: a name with bytes that are not UTF-8 is written with U+FFFD instead.
std::string text_of(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

bool send_line(int fd, const std::string& line) {
  if (fd < 0) return false;
  std::lock_guard<std::mutex> lock(st().send_mu);
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

// Reads what is there; false on EOF or error. Complete lines go to `lines`.
bool read_lines(Peer& p, std::vector<std::string>& lines) {
  char buf[65536];
  const ssize_t n = ::recv(p.fd, buf, sizeof(buf), MSG_DONTWAIT);
  if (n == 0) return false;
  if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
  p.in.append(buf, static_cast<size_t>(n));
  size_t start = 0, nl;
  while ((nl = p.in.find('\n', start)) != std::string::npos) {
    lines.push_back(p.in.substr(start, nl - start));
    start = nl + 1;
  }
  p.in.erase(0, start);
  return true;
}

// The op a rank was last in, from its latest report.
std::string last_seen(const std::vector<MemberProgress>& report) {
  const MemberProgress* best = nullptr;
  for (const MemberProgress& m : report) {
    if (m.running && (!best || !best->running || m.current.started_us > best->current.started_us)) best = &m;
    else if (!m.running && m.has_last && (!best || (!best->running && m.last.started_us > best->last.started_us))) best = &m;
  }
  if (!best) return "it had reported no op";
  return "it was last in " + (best->running ? best->current : best->last).describe_at(wall_us());
}

[[noreturn]] void end_process(const std::string& text) {
  const std::string path = FlightRecorder::dump("peer lost: " + text);
  std::fflush(stdout);
  std::fprintf(stderr, "\ntetra: %s; ending this rank (exit status %d: a peer was lost)%s%s\n", text.c_str(),
               kExitPeerLost, path.empty() ? "" : "; flight recorder: ", path.c_str());
  std::fflush(stderr);
  std::_Exit(kExitPeerLost);
}

void lost(const std::string& text) {
  if (st().ending.load()) return;
  end_process(text);
}

std::string report_json() {
  nlohmann::json comms = nlohmann::json::array();
  for (const MemberProgress& m : local_progress())
    if (m.group && m.group->agreed) comms.push_back(to_json(m));
  return text_of(nlohmann::json({{"t", "report"}, {"where", process_description()}, {"comms", std::move(comms)}}));
}

std::vector<MemberProgress> parse_report(const nlohmann::json& comms) {
  std::vector<MemberProgress> out;
  for (const auto& c : comms) out.push_back(member_progress_from_json(c));
  return out;
}

std::string who(int rank, const std::string& where) {
  return "rank " + std::to_string(rank) + (where.empty() ? "" : " (" + where + ")");
}

// Note [Silence]: whether this process itself did not run (its loop came round `gap` late:
// a paused machine, SIGSTOP, a debugger, a starved CPU). Then every silence it measured
// is its own, and the caller restarts its peers' clocks instead of blaming them.
bool stalled(int64_t& last_turn_us, int64_t now) {
  const int64_t gap = now - last_turn_us;
  last_turn_us = now;
  if (gap <= st().stalled_us) return false;
  std::fprintf(stderr,
               "tetra: rank %d (%s): the monitor did not run for %s (this machine or process was stopped or starved); "
               "the other ranks' silence over that time is not held against them\n",
               st().rank, process_description().c_str(), seconds_text(gap).c_str());
  return true;
}

// ---- server (rank 0) ----------------------------------------------------------------------

void server_broadcast(const std::string& line, int except_fd = -1) {
  for (auto& [fd, p] : st().peers)
    if (fd != except_fd) send_line(fd, line);
}

void server_line(Peer& p, const std::string& line);

// The other ranks lost with the first (a host that dies takes all its ranks at once):
// those whose connections close within `window`, and those as silent as a lost one.
// Their lines up to the end are read as usual.
std::vector<int> also_lost(int first_fd, std::chrono::milliseconds window) {
  State& s = st();
  std::vector<int> out;
  std::set<int> done = {first_fd};
  const int64_t now = mono_us();
  for (auto& [fd, q] : s.peers)
    if (!done.count(fd) && !q.goodbye && q.rank >= 0 && now - q.heard_us > s.silent_us) {
      done.insert(fd);
      out.push_back(q.rank);
    }
  for (const Deadline end = Clock::now() + window; Clock::now() < end;) {
    std::vector<pollfd> fds;
    for (auto& [fd, q] : s.peers)
      if (!done.count(fd) && !q.goodbye && q.rank >= 0) fds.push_back({fd, POLLIN, 0});
    if (fds.empty() || ::poll(fds.data(), fds.size(), 20) < 0) break;
    for (const pollfd& f : fds) {
      if (!f.revents) continue;
      Peer& q = s.peers[f.fd];
      std::vector<std::string> lines;
      const bool open = read_lines(q, lines);
      for (const auto& l : lines) server_line(q, l);
      if (!open && !q.goodbye) {
        done.insert(f.fd);
        out.push_back(q.rank);
      }
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void server_peer_gone(Peer& p, const std::string& how) {
  State& s = st();
  const std::vector<int> others = also_lost(p.fd, std::chrono::milliseconds(300));
  std::string text;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    text = who(p.rank, s.where[p.rank]) + " died: " + how + "; " + last_seen(s.reports[p.rank]);
    if (!others.empty()) {
      text += "; lost at the same moment:";
      for (size_t i = 0; i < others.size(); ++i) text += (i ? ", " : " ") + who(others[i], s.where[others[i]]);
    }
  }
  server_broadcast(text_of(nlohmann::json({{"t", "lost"}, {"text", text}})), p.fd);
  lost(text);
}

void server_line(Peer& p, const std::string& line) {
  State& s = st();
  nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return;
  const std::string t = j.value("t", "");
  p.heard_us = mono_us();
  if (t == "hello") {
    p.rank = j.value("rank", -1);
    // Rank 0's own report at once: a rank that joins knows where rank 0 runs (its host and
    // pid) before the next periodic report, should rank 0 die first.
    send_line(p.fd, report_json());
    std::lock_guard<std::mutex> lock(s.mu);
    s.where[p.rank] = j.value("where", "");
  } else if (t == "report") {
    std::lock_guard<std::mutex> lock(s.mu);
    s.reports[p.rank] = parse_report(j.value("comms", nlohmann::json::array()));
  } else if (t == "bye") {
    p.goodbye = true;
  } else if (t == "fail") {
    p.goodbye = true;
    std::string text;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      text = who(p.rank, s.where[p.rank]) + " failed: " + j.value("message", "");
      if (s.failure.empty()) {
        s.failure = text;
        s.failure_deadline_us = mono_us() + std::chrono::duration_cast<std::chrono::microseconds>(s.options.failure_grace).count();
      }
    }
    server_broadcast(text_of(nlohmann::json({{"t", "failed"}, {"text", text}})), p.fd);
  } else if (t == "query") {
    const std::string id = j.value("identity", "");
    nlohmann::json members = nlohmann::json::array();
    {
      std::lock_guard<std::mutex> lock(s.mu);
      for (const auto& [rank, report] : s.reports)
        if (rank != p.rank)
          for (const MemberProgress& m : report)
            if (m.group && m.group->identity == id) members.push_back(to_json(m));
    }
    for (const MemberProgress& m : local_progress())
      if (m.group && m.group->identity == id) members.push_back(to_json(m));
    send_line(p.fd, text_of(nlohmann::json({{"t", "state"}, {"id", j.value("id", int64_t{0})}, {"members", members}})));
  }
}

void server_loop_body() {
  State& s = st();
  std::string last_report;
  int64_t last_sent = 0, last_turn = mono_us();
  for (;;) {
    std::vector<std::string> out;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      out.swap(s.outbox);
    }
    for (const auto& line : out) server_broadcast(line);
    if (s.stop.load()) return;
    std::vector<pollfd> fds;
    fds.push_back({s.wake[0], POLLIN, 0});
    fds.push_back({s.listen_fd, POLLIN, 0});
    for (auto& [fd, p] : s.peers) fds.push_back({fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), 250);
    if (stalled(last_turn, mono_us()))
      for (auto& [fd, p] : s.peers) p.heard_us = mono_us();
    if (fds[0].revents) {
      char b[64];
      while (::read(s.wake[0], b, sizeof(b)) > 0) {
      }
    }
    if (fds[1].revents & POLLIN) {
      const int fd = ::accept(s.listen_fd, nullptr, nullptr);
      if (fd >= 0) {
        Peer p;
        p.fd = fd;
        p.heard_us = mono_us();
        s.peers[fd] = p;
      }
    }
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Peer& p = s.peers[fds[i].fd];
      std::vector<std::string> lines;
      const bool open = read_lines(p, lines);
      for (const auto& l : lines) server_line(p, l);
      if (!open) {
        ::close(p.fd);
        const Peer gone = p;
        s.peers.erase(gone.fd);
        if (!gone.goodbye && gone.rank >= 0 && !s.stop.load()) {
          Peer copy = gone;
          copy.fd = -1;
          server_peer_gone(copy, "its connection closed without a goodbye (killed, out of memory, or crashed)");
        }
      }
    }
    const int64_t now = mono_us();
    // Rank 0's own progress and heartbeat, so the others can name it if it dies.
    if (now - last_sent >= report_every_us()) {
      std::string r = report_json();
      if (r != last_report || now - last_sent >= s.heartbeat_us) {
        server_broadcast(r);
        last_report = std::move(r);
        last_sent = now;
      }
    }
    for (auto& [fd, p] : s.peers)
      if (!p.goodbye && p.rank >= 0 && now - p.heard_us > s.silent_us) {
        Peer copy = p;
        server_peer_gone(copy, "no word from it for " + seconds_text(s.silent_us) +
                                   " (its host stopped, or the network to it)");
      }
    std::string failure;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (!s.failure.empty() && now >= s.failure_deadline_us) failure = s.failure;
    }
    if (!failure.empty()) lost(failure);
  }
}

// ---- client (the other ranks) -----------------------------------------------------------

void client_line(const std::string& line) {
  State& s = st();
  nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return;
  const std::string t = j.value("t", "");
  if (t == "lost") {
    lost(j.value("text", "a rank died"));
  } else if (t == "failed") {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.failure.empty()) {
      s.failure = j.value("text", "a rank failed");
      s.failure_deadline_us = mono_us() + std::chrono::duration_cast<std::chrono::microseconds>(s.options.failure_grace).count();
    }
  } else if (t == "bye") {
    s.up.goodbye = true;
  } else if (t == "report") {
    std::lock_guard<std::mutex> lock(s.mu);
    s.where[0] = j.value("where", "");
    s.reports[0] = parse_report(j.value("comms", nlohmann::json::array()));
  } else if (t == "state") {
    std::lock_guard<std::mutex> lock(s.mu);
    s.answers[j.value("id", int64_t{0})] = parse_report(j.value("members", nlohmann::json::array()));
    s.answered.notify_all();
  }
}

void client_loop_body() {
  State& s = st();
  std::string last_report;
  int64_t last_sent = 0, last_turn = mono_us();
  while (!s.stop.load()) {
    pollfd fds[2] = {{s.wake[0], POLLIN, 0}, {s.up.fd, POLLIN, 0}};
    ::poll(fds, 2, 250);
    if (stalled(last_turn, mono_us())) s.up.heard_us = mono_us();
    if (fds[0].revents) {
      char b[64];
      while (::read(s.wake[0], b, sizeof(b)) > 0) {
      }
    }
    if (fds[1].revents) {
      s.up.heard_us = mono_us();
      std::vector<std::string> lines;
      const bool open = read_lines(s.up, lines);
      for (const auto& l : lines) client_line(l);
      if (!open) {
        if (s.up.goodbye || s.stop.load()) return;  // rank 0 ended cleanly
        {
          std::lock_guard<std::mutex> lock(s.mu);
          if (!s.failure.empty()) {
            // Rank 0 failed and said so: its end is no death; the grace period runs on.
            ::close(s.up.fd);
            s.up.fd = -1;
            continue;
          }
        }
        std::string failure;
        {
          std::lock_guard<std::mutex> lock(s.mu);
          failure = s.failure.empty() ? who(0, s.where[0]) +
                                            " died: its monitor connection closed without a goodbye (killed, out of "
                                            "memory, or crashed); " + last_seen(s.reports[0])
                                      : s.failure;
        }
        lost(failure);
        return;
      }
    }
    const int64_t now = mono_us();
    if (s.up.fd >= 0 && !s.up.goodbye && now - s.up.heard_us > s.silent_us) {
      std::string text;
      {
        std::lock_guard<std::mutex> lock(s.mu);
        text = who(0, s.where[0]) + " died: no word from it for " + seconds_text(s.silent_us) +
               " (its host stopped, or the network to it); " + last_seen(s.reports[0]);
      }
      lost(text);
    }
    if (now - last_sent >= report_every_us()) {
      std::string r = report_json();
      if (s.up.fd >= 0 && (r != last_report || now - last_sent >= s.heartbeat_us)) {
        send_line(s.up.fd, r);
        last_report = std::move(r);
        last_sent = now;
      }
    }
    std::string failure;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (!s.failure.empty() && now >= s.failure_deadline_us) failure = s.failure;
    }
    if (!failure.empty()) lost(failure);
  }
}

// The monitor must never take the process down: whatever escapes ends the monitoring
// with a line on stderr, and the job goes on without it.
void guarded(void (*body)(), const char* role) {
  try {
    body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tetra: the monitor's %s stopped: %s (dead ranks will no longer be named)\n", role, e.what());
  }
}
void server_loop() { guarded(server_loop_body, "server"); }
void client_loop() { guarded(client_loop_body, "client"); }

// Rank 0's address to every rank, over the world (its first op).
std::string share_address(Communicator& world, const std::string& mine, Duration timeout) {
  at::Tensor bytes = at::zeros({256}, at::kByte);
  if (world.rank() == 0) std::memcpy(bytes.data_ptr(), mine.data(), std::min<size_t>(mine.size(), 255));
  BroadcastOptions o;
  o.timeout = timeout;
  world.broadcast(bytes, o)->wait();
  return std::string(static_cast<const char*>(bytes.data_ptr()));
}

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
  if (const char* host = std::getenv("TETRA_MONITOR_ADDR"); host && *host) {
    names.emplace_back(host);
  } else {
    names.push_back(hardware::hostname());
    for (const std::string& a : hardware::ipv4_addresses()) names.push_back(a);
  }
  const std::string tail = ":" + std::to_string(port);
  std::string out;
  for (const std::string& n : names)
    if (out.size() + n.size() + 1 + tail.size() <= 255) out += (out.empty() ? "" : ",") + n;
  return out + tail;
}

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

}  // namespace

void Monitor::start(Communicator& world, const MonitorOptions& options) {
  State& s = st();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.running || world.size() == 1) return;
  }
  if (options.silence < std::chrono::seconds(1))
    throw CommError("monitor: the silence after which a peer is lost must be at least 1 s, got " +
                    std::to_string(options.silence.count()) + " ms");
  s.options = options;
  const auto us = [](Duration d) { return std::chrono::duration_cast<std::chrono::microseconds>(d).count(); };
  s.silent_us = us(options.silence);
  s.heartbeat_us = std::min<int64_t>(2'000'000, s.silent_us / 4);
  s.stalled_us = std::max<int64_t>(1'000'000, std::min<int64_t>(5'000'000, s.silent_us / 4));
  s.rank = world.rank();
  s.size = world.size();
  s.server = world.rank() == 0;
  s.stop = false;
  s.ending = false;
  std::string address;
  if (s.server) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) throw CommError(std::string("monitor: socket: ") + std::strerror(errno));
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    const char* port_env = std::getenv("TETRA_MONITOR_PORT");
    addr.sin_port = htons(static_cast<uint16_t>(port_env ? std::atoi(port_env) : 0));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 1024) != 0) {
      const std::string e = std::strerror(errno);
      ::close(fd);
      throw CommError("monitor: cannot listen on port " + std::string(port_env ? port_env : "(any)") + ": " + e +
                      " (TETRA_MONITOR_PORT picks another)");
    }
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    s.listen_fd = fd;
    address = advertised_address(ntohs(addr.sin_port));
  }
  address = share_address(world, address, options.timeout);
  if (::pipe(s.wake) != 0) throw CommError(std::string("monitor: pipe: ") + std::strerror(errno));
  ::fcntl(s.wake[0], F_SETFL, O_NONBLOCK);
  if (!s.server) {
    s.up = Peer{};
    // Rank 0 listened before it shared its addresses: a rank that reaches none of them
    // within 20 s will not (a name that does not resolve here, a network between).
    s.up.fd = connect_to(address, Clock::now() + std::min<Duration>(options.timeout, std::chrono::seconds(20)));
    s.up.heard_us = mono_us();
    send_line(s.up.fd, text_of(nlohmann::json({{"t", "hello"}, {"rank", s.rank}, {"where", process_description()}})));
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.where[s.rank] = process_description();
    s.running = true;
  }
  s.thread = std::thread(s.server ? server_loop : client_loop);
}

namespace {

// Ends the monitor thread after the goodbye (or failure) line `last` went out, and closes
// everything: a process that is ending must not leave the thread running into its exit
// (static destruction).
void halt(const std::string& last) {
  State& s = st();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.running) return;
    s.running = false;
    if (s.server) s.outbox.push_back(last);  // the server thread sends it before it stops
  }
  s.ending = true;
  if (!s.server) send_line(s.up.fd, last);
  s.stop = true;
  ssize_t ignored = ::write(s.wake[1], "x", 1);
  (void)ignored;
  if (s.thread.joinable()) s.thread.join();
  if (s.server) {
    for (auto& [fd, p] : s.peers) ::close(fd);
    s.peers.clear();
    ::close(s.listen_fd);
    s.listen_fd = -1;
  } else if (s.up.fd >= 0) {
    ::close(s.up.fd);
    s.up.fd = -1;
  }
  ::close(s.wake[0]);
  ::close(s.wake[1]);
  std::lock_guard<std::mutex> lock(s.mu);
  s.reports.clear();
  s.failure.clear();
  s.outbox.clear();
}

}  // namespace

void Monitor::stop() { halt(R"({"t":"bye"})"); }

void Monitor::report_failure(const std::string& message) {
  State& s = st();
  s.ending = true;
  const std::string first = message.substr(0, std::min<size_t>(message.size(), 2000));
  halt(s.server ? text_of(nlohmann::json({{"t", "failed"}, {"text", who(0, process_description()) + " failed: " + first}}))
                : text_of(nlohmann::json({{"t", "fail"}, {"message", first}})));
}

void Monitor::ending() { st().ending = true; }

void Monitor::settle(Duration wait) {
  if (!running() || st().ending.load()) return;
  const Deadline end = Clock::now() + wait;
  while (Clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

bool Monitor::running() {
  State& s = st();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.running;
}

std::vector<MemberProgress> Monitor::remote_members(const std::string& identity) {
  State& s = st();
  std::unique_lock<std::mutex> lock(s.mu);
  if (!s.running) return {};
  if (s.server) {
    std::vector<MemberProgress> out;
    for (const auto& [rank, report] : s.reports)
      for (const MemberProgress& m : report)
        if (m.group && m.group->identity == identity) out.push_back(m);
    return out;
  }
  const int64_t id = s.next_query++;
  lock.unlock();
  send_line(s.up.fd, text_of(nlohmann::json({{"t", "query"}, {"id", id}, {"identity", identity}})));
  lock.lock();
  s.answered.wait_for(lock, std::chrono::seconds(3), [&] { return s.answers.count(id) != 0; });
  auto it = s.answers.find(id);
  if (it == s.answers.end()) return {};
  std::vector<MemberProgress> out = std::move(it->second);
  s.answers.erase(it);
  // The answer holds this process's own members too (rank 0 cannot tell them apart).
  const std::string here = process_description();
  out.erase(std::remove_if(out.begin(), out.end(), [&](const MemberProgress& m) { return m.where == here; }), out.end());
  return out;
}

}  // namespace tetra::collectives
