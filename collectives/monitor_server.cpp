#include "collectives/monitor_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <set>

namespace tetra::collectives::monitor {

Server::Server(const MonitorOptions& options, int size, std::string key, int listen_fd)
    : Session(options, 0, size, std::move(key)), listen_fd_(listen_fd) {}

Server::~Server() { close_connections(); }

std::vector<MemberProgress> Server::remote_members(const std::string& identity) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!running_) return {};
  std::vector<MemberProgress> out;
  for (const auto& [rank, report] : reports_)
    for (const MemberProgress& m : report)
      if (m.group && m.group->identity == identity) out.push_back(m);
  return out;
}

// The server's thread sends it before it stops.
void Server::say(const std::string& last) {
  std::lock_guard<std::mutex> lock(mu_);
  outbox_.push_back(last);
}

void Server::close_connections() {
  for (auto& [fd, p] : peers_) ::close(fd);
  peers_.clear();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

void Server::broadcast(const std::string& line, int except_fd) {
  for (auto& [fd, p] : peers_)
    if (fd != except_fd && p.proven) send_line(fd, line);
}

// Names a refused connection on stderr: at once for the first from an address, then at
// most once per kRefusalQuiet with the count since (flush: the counts due now).
void Server::print_refusals(const std::string& host, Refusals& r, int64_t now) {
  int64_t n = 0;
  std::string why;
  for (const auto& [reason, count] : r.since) {
    n += count;
    why += (why.empty() ? "" : "; ") + (count > 1 ? std::to_string(count) + " x " : "") + reason;
  }
  if (n == 0) return;
  std::fprintf(stderr, "tetra: rank 0 (%s): the monitor refused %s from %s: %s\n", process_description().c_str(),
               n == 1 ? ("a connection" + std::string(r.printed_us ? "" : " (the first)")).c_str()
                      : (std::to_string(n) + " connections in " + seconds_text(now - r.printed_us)).c_str(),
               n == 1 ? r.last.c_str() : host.c_str(), why.c_str());
  r.printed_us = now;
  r.since.clear();
}

// `why` is one of a few fixed texts, so that a flood is summed by reason in one line.
void Server::name_refusal(const std::string& address, const std::string& why) {
  ++refused_total_;
  const int64_t now = mono_us();
  const std::string host = address.substr(0, address.rfind(':'));
  if (refusals_.size() > 4096 && !refusals_.count(host)) refusals_.clear();  // a crowd of addresses: bounded
  Refusals& r = refusals_[host];
  ++r.since[why];
  r.last = address;
  if (r.printed_us == 0 || now - r.printed_us >= kRefusalQuiet_us) print_refusals(host, r, now);
}

// `all`: every count not named yet (the monitor is stopping), else those due.
void Server::flush_refusals(int64_t now, bool all) {
  for (auto& [host, r] : refusals_)
    if (!r.since.empty() && (all || now - r.printed_us >= kRefusalQuiet_us)) print_refusals(host, r, now);
}

// The first line of a connection that has not proved the key: it must be a hello with the
// right proof for a rank of the world that is not connected already.
void Server::hello(Peer& p, const std::string& line) {
  Hello h;
  p.refused = check_hello(line, p.nonce, key_, size_, h);
  if (!p.refused.empty()) return;
  for (const auto& [fd, q] : peers_)
    if (fd != p.fd && q.proven && q.rank == h.rank) {
      p.refused = "rank " + std::to_string(h.rank) + " is connected already";
      return;
    }
  p.proven = true;
  p.rank = h.rank;
  p.heard_us = mono_us();
  send_line(p.fd, welcome_line(key_, p.nonce, h));
  // Rank 0's own report at once: a rank that joins knows where rank 0 runs (its host and
  // pid) before the next periodic report, should rank 0 die first.
  send_line(p.fd, report_json());
  std::lock_guard<std::mutex> lock(mu_);
  where_[p.rank] = h.where;
}

// The other ranks lost with the first (a host that dies takes all its ranks at once):
// those whose connections close within `window`, and those as silent as a lost one.
// Their lines up to the end are read as usual.
std::vector<int> Server::also_lost(int first_fd, std::chrono::milliseconds window) {
  std::vector<int> out;
  std::set<int> done = {first_fd};
  const int64_t now = mono_us();
  for (auto& [fd, q] : peers_)
    if (!done.count(fd) && !q.goodbye && q.rank >= 0 && now - q.heard_us > silent_us_) {
      done.insert(fd);
      out.push_back(q.rank);
    }
  for (const Deadline end = Clock::now() + window; Clock::now() < end;) {
    std::vector<pollfd> fds;
    for (auto& [fd, q] : peers_)
      if (!done.count(fd) && !q.goodbye && q.rank >= 0) fds.push_back({fd, POLLIN, 0});
    if (fds.empty() || ::poll(fds.data(), fds.size(), 20) < 0) break;
    for (const pollfd& f : fds) {
      if (!f.revents) continue;
      Peer& q = peers_[f.fd];
      std::vector<std::string> lines;
      const bool open = read_lines(q, lines, kLineLimit) != Read::kClosed;
      for (const auto& l : lines) line(q, l);
      if (!open && !q.goodbye) {
        done.insert(f.fd);
        out.push_back(q.rank);
      }
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void Server::peer_gone(const Peer& p, const std::string& how) {
  const std::vector<int> others = also_lost(p.fd, std::chrono::milliseconds(300));
  std::string text;
  {
    std::lock_guard<std::mutex> lock(mu_);
    text = who(p.rank, where_[p.rank]) + " died: " + how + "; " + last_seen(reports_[p.rank]);
    if (!others.empty()) {
      text += "; lost at the same moment:";
      for (size_t i = 0; i < others.size(); ++i) text += (i ? ", " : " ") + who(others[i], where_[others[i]]);
    }
  }
  broadcast(text_of(nlohmann::json({{"t", "lost"}, {"text", text}})), p.fd);
  lost(text);
}

void Server::line_unguarded(Peer& p, const std::string& line) {
  if (!p.refused.empty()) return;
  if (!p.proven) {
    hello(p, line);
    return;
  }
  nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return;
  const std::string t = j.value("t", "");
  p.heard_us = mono_us();
  if (t == "report") {
    std::lock_guard<std::mutex> lock(mu_);
    reports_[p.rank] = parse_report(j.value("comms", nlohmann::json::array()));
  } else if (t == "bye") {
    p.goodbye = true;
  } else if (t == "fail") {
    p.goodbye = true;
    std::string text;
    {
      std::lock_guard<std::mutex> lock(mu_);
      text = who(p.rank, where_[p.rank]) + " failed: " + j.value("message", "");
      note_failure_locked(text);
    }
    broadcast(text_of(nlohmann::json({{"t", "failed"}, {"text", text}})), p.fd);
  } else if (t == "query") {
    const std::string id = j.value("identity", "");
    nlohmann::json members = nlohmann::json::array();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [rank, report] : reports_)
        if (rank != p.rank)
          for (const MemberProgress& m : report)
            if (m.group && m.group->identity == id) members.push_back(to_json(m));
    }
    for (const MemberProgress& m : local_progress())
      if (m.group && m.group->identity == id) members.push_back(to_json(m));
    send_line(p.fd, text_of(nlohmann::json({{"t", "state"}, {"id", j.value("id", int64_t{0})}, {"members", members}})));
  }
}

// A line the monitor cannot use (a value of the wrong type) is dropped; before the proof,
// it refuses the connection. It never stops the monitor.
void Server::line(Peer& p, const std::string& line) {
  try {
    line_unguarded(p, line);
  } catch (const std::exception&) {
    if (!p.proven) p.refused = "its hello is malformed";
  }
}

// A new connection: refused at once beyond the cap of those waiting to prove the key,
// else sent its challenge.
void Server::accept_one() {
  sockaddr_in from{};
  socklen_t len = sizeof(from);
  const int fd = ::accept(listen_fd_, reinterpret_cast<sockaddr*>(&from), &len);
  if (fd < 0) return;
  char ip[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &from.sin_addr, ip, sizeof(ip));
  const std::string address = std::string(ip) + ":" + std::to_string(ntohs(from.sin_port));
  size_t waiting = 0, proven = 0;
  for (const auto& [other, q] : peers_) (q.proven ? proven : waiting) += 1;
  const size_t missing = static_cast<size_t>(size_ - 1) > proven ? static_cast<size_t>(size_ - 1) - proven : 0;
  if (waiting >= missing + kWaitingSlack) {
    ::close(fd);
    name_refusal(address, "too many connections at once that have not proved the job's secret");
    return;
  }
  Peer p;
  p.fd = fd;
  p.address = address;
  p.heard_us = mono_us();
  p.nonce = fresh_nonce();
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (!send_line(fd, challenge_line(p.nonce))) {
    ::close(fd);
    name_refusal(address, "it closed before its challenge was sent");
    return;
  }
  peers_[fd] = std::move(p);
}

// A connection that has not proved the key and will not: never a rank, closed at once,
// named, and no death.
void Server::drop_unproven(Peer& p, std::string why) {
  const int fd = p.fd;
  const std::string address = p.address;
  ::close(fd);
  peers_.erase(fd);
  name_refusal(address, why);
}

// What arrived on a connection that poll() named.
void Server::read_from(int fd) {
  Peer& p = peers_[fd];
  std::vector<std::string> lines;
  const Read read = read_lines(p, lines, p.proven ? kLineLimit : kHandshakeLine);
  for (const auto& l : lines) line(p, l);
  const bool open = read != Read::kClosed;
  if (read == Read::kTooLong) {
    if (!p.proven)
      p.refused = "a line of more than " + line_limit_text(kHandshakeLine) + " before it proved the job's secret";
    else
      std::fprintf(stderr, "tetra: rank 0: the monitor dropped a line of more than %s from rank %d\n",
                   line_limit_text(kLineLimit).c_str(), p.rank);
  }
  if (!p.proven && (!p.refused.empty() || !open)) {
    drop_unproven(p, p.refused.empty() ? "it closed before it proved the job's secret" : p.refused);
    return;
  }
  if (!open) {
    ::close(p.fd);
    const Peer gone = p;
    peers_.erase(gone.fd);
    if (!gone.goodbye && gone.rank >= 0 && !stop_.load()) {
      Peer copy = gone;
      copy.fd = -1;
      peer_gone(copy, "its connection closed without a goodbye (killed, out of memory, or crashed)");
    }
  }
}

void Server::drop_slow_provers(int64_t now) {
  for (auto it = peers_.begin(); it != peers_.end();) {
    if (!it->second.proven && now - it->second.heard_us > kProveWithin_us) {
      ::close(it->first);
      const std::string address = it->second.address;
      it = peers_.erase(it);
      name_refusal(address, "it did not prove the job's secret within " + seconds_text(kProveWithin_us));
    } else {
      ++it;
    }
  }
}

// Note [Silence]: a rank not heard from for silent_us_ is lost.
void Server::check_silence(int64_t now) {
  for (auto& [fd, p] : peers_)
    if (!p.goodbye && p.rank >= 0 && now - p.heard_us > silent_us_) {
      Peer copy = p;
      peer_gone(copy, "no word from it for " + seconds_text(silent_us_) + " (its host stopped, or the network to it)");
    }
}

void Server::loop() {
  std::string last_report;
  int64_t last_sent = 0, last_turn = mono_us();
  for (;;) {
    std::vector<std::string> out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      out.swap(outbox_);
    }
    for (const auto& l : out) broadcast(l);
    if (stop_.load()) {
      flush_refusals(mono_us(), true);
      return;
    }
    std::vector<pollfd> fds;
    fds.push_back({wake_.read_fd(), POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    for (auto& [fd, p] : peers_) fds.push_back({fd, POLLIN, 0});
    ::poll(fds.data(), fds.size(), 250);
    if (stalled(last_turn, mono_us()))
      for (auto& [fd, p] : peers_) p.heard_us = mono_us();
    if (fds[0].revents) wake_.drain();
    if (fds[1].revents & POLLIN) accept_one();
    for (size_t i = 2; i < fds.size(); ++i)
      if (fds[i].revents) read_from(fds[i].fd);
    const int64_t now = mono_us();
    drop_slow_provers(now);
    flush_refusals(now);
    // Rank 0's own progress and heartbeat, so the others can name it if it dies.
    if (now - last_sent >= report_every_us()) {
      std::string r = report_json();
      if (r != last_report || now - last_sent >= heartbeat_us_) {
        broadcast(r);
        last_report = std::move(r);
        last_sent = now;
      }
    }
    check_silence(now);
    end_when_failure_due(now);
  }
}

}  // namespace tetra::collectives::monitor
