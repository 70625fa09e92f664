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

#include "collectives/auth.h"
#include "collectives/watchdog.h"
#include "hardware/host.h"

namespace tetra::collectives {

namespace {

// The monitor's own clock (steady: a step of the system clock is no silence).
int64_t mono_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
}

// Note [Monitor handshake]
// Rank 0's port is reachable by anyone on its network, so nothing that arrives there is
// believed before it proves that it holds the job's secret (Note [Job secret]):
//
//   rank 0 -> {"t":"challenge","nonce":Ns}                   on accept, 16 fresh random bytes
//   rank r -> {"t":"hello","rank":r,"where":W,"nonce":Nc,"mac":HMAC(key, "hello" Ns Nc r W)}
//   rank 0 -> {"t":"welcome","mac":HMAC(key, "welcome" Nc Ns r)}   rank 0 proves it too
//
// The connection is then bound to rank r for its life: its later lines are rank r's (a
// forger would have to inject into an established TCP stream), and a second connection
// that proves rank r while the first is open is refused. A connection that does not
// prove the key within kProveWithin, whose first line is anything else, is longer than
// kHandshakeLine before it has, or is one more than the cap of connections waiting to
// prove it, is closed at once: never counted as a rank, never a death, and named in one
// line on rank 0's stderr (at most one line per address per kRefusalQuiet, with the
// count since). A rank refused by mistake (the cap, while a crowd of strangers waits)
// connects again until its deadline. Lines are bounded after the handshake too
// (kLineLimit: a longer one is dropped, named once), and reading is linear in the bytes
// received: each read scans only the bytes it added.
constexpr size_t kHandshakeLine = 4096;
constexpr size_t kLineLimit = size_t{16} << 20;
constexpr int64_t kProveWithin_us = 5'000'000;
constexpr int64_t kRefusalQuiet_us = 10'000'000;
constexpr size_t kWaitingSlack = 16;  // connections waiting to prove the key, beyond the ranks still missing

struct Peer {
  int fd = -1;
  std::string in;
  size_t scanned = 0;     // bytes of `in` already searched for a newline
  bool skipping = false;  // dropping the rest of a line over the limit
  int rank = -1;          // set once it proved the key
  std::string where;
  std::string address;    // where it connected from ("10.0.0.2:41234")
  std::string nonce;      // the challenge it was sent (hex)
  bool proven = false;
  std::string refused;    // why it is being closed before it proved the key
  bool goodbye = false;  // said bye or fail: its closing is not a death
  int64_t heard_us = 0;  // mono_us()
};

// Refusals named per address (Note [Monitor handshake]).
struct Refusals {
  int64_t printed_us = 0;
  std::map<std::string, int64_t> since;  // refused and not named since printed_us, by reason
  std::string last;                      // the latest one's address
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
  std::string key;  // the job's secret (Note [Job secret])
  // server: the clients and their latest reports; lines other threads want broadcast
  int listen_fd = -1;
  std::map<std::string, Refusals> refusals;  // by the address's host part
  int64_t refused_total = 0;
  std::vector<std::string> outbox;  // guarded by mu
  std::map<int, Peer> peers;  // by fd
  std::map<int, std::vector<MemberProgress>> reports;  // by rank
  std::map<int, std::string> where;                    // by rank
  // client: the connection to rank 0
  Peer up;
  std::vector<std::string> early;  // lines that came with rank 0's welcome
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

enum class Read { kOpen, kClosed, kTooLong };

// Reads what is there (at most 64 KiB): kClosed on EOF or error. Complete lines go to
// `lines`; a line longer than `limit` is dropped up to its end and says kTooLong once.
// Only the bytes this read added are searched (Note [Monitor handshake]).
Read read_lines(Peer& p, std::vector<std::string>& lines, size_t limit) {
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

std::string line_limit_text(size_t limit) {
  return limit >= (size_t{1} << 20) ? std::to_string(limit >> 20) + " MiB" : std::to_string(limit) + " bytes";
}

// A string field of a line from the other end; "" when it has none (or not a string).
std::string string_field(const nlohmann::json& j, const char* key) {
  if (!j.is_object()) return "";
  const auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// A challenge's or a hello's nonce: 16 fresh random bytes, in hex.
std::string fresh_nonce() {
  const std::string r = random_bytes(16);
  return to_hex(reinterpret_cast<const uint8_t*>(r.data()), r.size());
}

// The proofs of Note [Monitor handshake] (hex HMACs).
std::string hello_mac(const std::string& server_nonce, const std::string& client_nonce, int rank,
                      const std::string& where) {
  return to_hex(hmac_sha256(st().key, "tetra monitor 1\nhello\n" + server_nonce + "\n" + client_nonce + "\n" +
                                          std::to_string(rank) + "\n" + where));
}
std::string welcome_mac(const std::string& server_nonce, const std::string& client_nonce, int rank) {
  return to_hex(hmac_sha256(st().key, "tetra monitor 1\nwelcome\n" + client_nonce + "\n" + server_nonce + "\n" +
                                          std::to_string(rank)));
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
    if (fd != except_fd && p.proven) send_line(fd, line);
}

// Names a refused connection on stderr: at once for the first from an address, then at
// most once per kRefusalQuiet with the count since (flush: the counts due now).
void print_refusals(const std::string& host, Refusals& r, int64_t now) {
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
void name_refusal(const std::string& address, const std::string& why) {
  State& s = st();
  ++s.refused_total;
  const int64_t now = mono_us();
  const std::string host = address.substr(0, address.rfind(':'));
  if (s.refusals.size() > 4096 && !s.refusals.count(host)) s.refusals.clear();  // a crowd of addresses: bounded
  Refusals& r = s.refusals[host];
  ++r.since[why];
  r.last = address;
  if (r.printed_us == 0 || now - r.printed_us >= kRefusalQuiet_us) print_refusals(host, r, now);
}

// `all`: every count not named yet (the monitor is stopping), else those due.
void flush_refusals(int64_t now, bool all = false) {
  for (auto& [host, r] : st().refusals)
    if (!r.since.empty() && (all || now - r.printed_us >= kRefusalQuiet_us)) print_refusals(host, r, now);
}

// The first line of a connection that has not proved the key: it must be a hello with the
// right proof for a rank of the world that is not connected already.
void server_hello(Peer& p, const std::string& line) {
  State& s = st();
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (string_field(j, "t") != "hello") {
    p.refused = "its first line is not a hello";
    return;
  }
  const auto it = j.find("rank");
  const int64_t rank = it != j.end() && it->is_number_integer() ? it->get<int64_t>() : -1;
  const std::string where = string_field(j, "where"), nonce = string_field(j, "nonce"), mac = string_field(j, "mac");
  if (rank < 1 || rank >= s.size) {
    p.refused = "its hello claims no rank of this world of " + std::to_string(s.size);
    return;
  }
  if (nonce.size() != 32 || !equal_in_constant_time(mac, hello_mac(p.nonce, nonce, static_cast<int>(rank), where))) {
    p.refused = "its hello did not prove that it holds the job's secret (a wrong HMAC: not this job, or "
                "TETRA_JOB_SECRET differs)";
    return;
  }
  for (const auto& [fd, q] : s.peers)
    if (fd != p.fd && q.proven && q.rank == rank) {
      p.refused = "rank " + std::to_string(rank) + " is connected already";
      return;
    }
  p.proven = true;
  p.rank = static_cast<int>(rank);
  p.heard_us = mono_us();
  send_line(p.fd, text_of(nlohmann::json(
                      {{"t", "welcome"}, {"mac", welcome_mac(p.nonce, nonce, static_cast<int>(rank))}})));
  // Rank 0's own report at once: a rank that joins knows where rank 0 runs (its host and
  // pid) before the next periodic report, should rank 0 die first.
  send_line(p.fd, report_json());
  std::lock_guard<std::mutex> lock(s.mu);
  s.where[p.rank] = where;
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
      const bool open = read_lines(q, lines, kLineLimit) != Read::kClosed;
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

void server_line_unguarded(Peer& p, const std::string& line) {
  State& s = st();
  if (!p.refused.empty()) return;
  if (!p.proven) {
    server_hello(p, line);
    return;
  }
  nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return;
  const std::string t = j.value("t", "");
  p.heard_us = mono_us();
  if (t == "report") {
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

// A line the monitor cannot use (a value of the wrong type) is dropped; before the proof,
// it refuses the connection. It never stops the monitor.
void server_line(Peer& p, const std::string& line) {
  try {
    server_line_unguarded(p, line);
  } catch (const std::exception&) {
    if (!p.proven) p.refused = "its hello is malformed";
  }
}

// A new connection: refused at once beyond the cap of those waiting to prove the key,
// else sent its challenge.
void server_accept() {
  State& s = st();
  sockaddr_in from{};
  socklen_t len = sizeof(from);
  const int fd = ::accept(s.listen_fd, reinterpret_cast<sockaddr*>(&from), &len);
  if (fd < 0) return;
  char ip[INET_ADDRSTRLEN] = "?";
  ::inet_ntop(AF_INET, &from.sin_addr, ip, sizeof(ip));
  const std::string address = std::string(ip) + ":" + std::to_string(ntohs(from.sin_port));
  size_t waiting = 0, proven = 0;
  for (const auto& [other, q] : s.peers) (q.proven ? proven : waiting) += 1;
  const size_t missing = static_cast<size_t>(s.size - 1) > proven ? static_cast<size_t>(s.size - 1) - proven : 0;
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
  if (!send_line(fd, text_of(nlohmann::json({{"t", "challenge"}, {"nonce", p.nonce}})))) {
    ::close(fd);
    name_refusal(address, "it closed before its challenge was sent");
    return;
  }
  s.peers[fd] = std::move(p);
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
    if (s.stop.load()) {
      flush_refusals(mono_us(), true);
      return;
    }
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
    if (fds[1].revents & POLLIN) server_accept();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      Peer& p = s.peers[fds[i].fd];
      std::vector<std::string> lines;
      const Read read = read_lines(p, lines, p.proven ? kLineLimit : kHandshakeLine);
      for (const auto& l : lines) server_line(p, l);
      const bool open = read != Read::kClosed;
      if (read == Read::kTooLong) {
        if (!p.proven)
          p.refused = "a line of more than " + line_limit_text(kHandshakeLine) + " before it proved the job's secret";
        else
          std::fprintf(stderr, "tetra: rank 0: the monitor dropped a line of more than %s from rank %d\n",
                       line_limit_text(kLineLimit).c_str(), p.rank);
      }
      if (!p.proven && (!p.refused.empty() || !open)) {
        // Never a rank: closed at once, named, and no death.
        ::close(p.fd);
        const std::string address = p.address;
        const std::string why = p.refused.empty() ? "it closed before it proved the job's secret" : p.refused;
        s.peers.erase(fds[i].fd);
        name_refusal(address, why);
        continue;
      }
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
    for (auto it = s.peers.begin(); it != s.peers.end();) {
      if (!it->second.proven && now - it->second.heard_us > kProveWithin_us) {
        ::close(it->first);
        const std::string address = it->second.address;
        it = s.peers.erase(it);
        name_refusal(address, "it did not prove the job's secret within " + seconds_text(kProveWithin_us));
      } else {
        ++it;
      }
    }
    flush_refusals(now);
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

void client_line_unguarded(const std::string& line) {
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

// A line the monitor cannot use is dropped; it never stops the monitor.
void client_line(const std::string& line) {
  try {
    client_line_unguarded(line);
  } catch (const std::exception&) {
  }
}

void client_loop_body() {
  State& s = st();
  std::string last_report;
  int64_t last_sent = 0, last_turn = mono_us();
  for (const std::string& l : s.early) client_line(l);
  s.early.clear();
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
      const Read read = read_lines(s.up, lines, kLineLimit);
      for (const auto& l : lines) client_line(l);
      if (read == Read::kTooLong)
        std::fprintf(stderr, "tetra: rank %d: the monitor dropped a line of more than %s from rank 0\n", s.rank,
                     line_limit_text(kLineLimit).c_str());
      const bool open = read != Read::kClosed;
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

// The job's secret from the environment (Note [Job secret]); empty when unset.
std::string secret_from_environment() {
  const char* v = std::getenv("TETRA_JOB_SECRET");
  return v ? std::string(v) : std::string();
}

// Rank 0's address and the job's secret to every rank, over the world: 256 bytes of
// address, a byte that says where the secret comes from (0: these 32 random bytes; 1:
// every rank's TETRA_JOB_SECRET, which does not travel), 32 bytes of secret.
std::string share_setup(Communicator& world, const std::string& mine, Duration timeout) {
  State& s = st();
  constexpr int64_t kAddress = 256, kKey = 32;
  at::Tensor bytes = at::zeros({kAddress + 1 + kKey}, at::kByte);
  auto* b = static_cast<uint8_t*>(bytes.data_ptr());
  const std::string env = secret_from_environment();
  if (world.rank() == 0) {
    std::memcpy(b, mine.data(), std::min<size_t>(mine.size(), kAddress - 1));
    b[kAddress] = env.empty() ? 0 : 1;
    if (env.empty()) {
      s.key = random_bytes(kKey);
      std::memcpy(b + kAddress + 1, s.key.data(), kKey);
    }
  }
  BroadcastOptions o;
  o.timeout = timeout;
  world.broadcast(bytes, o)->wait();
  const bool from_env = b[kAddress] == 1;
  if (from_env != !env.empty())
    throw CommError(std::string("monitor: TETRA_JOB_SECRET is set ") + (from_env ? "on rank 0 but not on rank " : "on rank ") +
                    std::to_string(world.rank()) + (from_env ? "" : " but not on rank 0") +
                    ": every process of a job takes the secret from the environment, or none does (the launcher "
                    "passes it: mpirun -x TETRA_JOB_SECRET, or export it before srun or torchrun)");
  if (world.rank() != 0) s.key = from_env ? env : std::string(reinterpret_cast<const char*>(b + kAddress + 1), kKey);
  else if (from_env) s.key = env;
  std::memset(b + kAddress + 1, 0, kKey);
  return std::string(reinterpret_cast<const char*>(b));
}

// Whether every process of `world` shares this one's kernel and network namespace (then
// rank 0's monitor listens on loopback only): one allreduce of a hash of the namespace.
bool world_shares_one_network(Communicator& world, Duration timeout) {
  const Digest d = sha256(hardware::network_namespace_id());
  int64_t v = 0;
  for (int i = 0; i < 7; ++i) v = v << 8 | d[static_cast<size_t>(i)];  // 56 bits: -v cannot overflow
  at::Tensor t = at::tensor({v, -v}, at::kLong);
  AllreduceOptions o;
  o.op = ReduceOp::kMax;
  o.timeout = timeout;
  world.allreduce(t, o)->wait();
  return t[0].item<int64_t>() == -t[1].item<int64_t>();
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
    names.push_back(hardware::network_name());
    for (const std::string& a : hardware::ipv4_addresses()) names.push_back(a);
  }
  const std::string tail = ":" + std::to_string(port);
  std::string out;
  for (const std::string& n : names)
    if (out.size() + n.size() + 1 + tail.size() <= 255) out += (out.empty() ? "" : ",") + n;
  return out + tail;
}

// The next line from `p` within `until`, from `queue` first; false when the connection
// closed, broke the handshake's line limit or stayed silent.
bool next_line(Peer& p, std::vector<std::string>& queue, Deadline until, std::string& line) {
  while (queue.empty()) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    if (left <= 0) return false;
    pollfd f{p.fd, POLLIN, 0};
    if (::poll(&f, 1, static_cast<int>(std::min<int64_t>(left, 1000))) < 0 && errno != EINTR) return false;
    if (f.revents && read_lines(p, queue, kHandshakeLine) != Read::kOpen) return false;
  }
  line = queue.front();
  queue.erase(queue.begin());
  return true;
}

int connect_to(const std::string& address, Deadline deadline);

// Connects to rank 0 and proves the job's secret, both ways (Note [Monitor handshake]).
// A connection closed before its challenge (rank 0 was refusing a crowd) is tried again
// until `deadline`; an answer without the secret is an error at once.
void connect_and_prove(const std::string& address, Deadline deadline) {
  State& s = st();
  const std::string where = process_description();
  std::string problem = "no attempt";
  while (Clock::now() < deadline) {
    Peer p;
    p.fd = connect_to(address, deadline);
    std::vector<std::string> queue;
    std::string line;
    const Deadline handshake = std::min<Deadline>(deadline, Clock::now() + std::chrono::seconds(10));
    if (!next_line(p, queue, handshake, line)) {
      ::close(p.fd);
      problem = "rank 0 closed the connection, or sent nothing, before its challenge";
      std::this_thread::sleep_for(std::chrono::milliseconds(100 + 100 * (s.rank % 4)));
      continue;
    }
    const nlohmann::json challenge = nlohmann::json::parse(line, nullptr, false);
    const std::string server_nonce = string_field(challenge, "nonce");
    if (string_field(challenge, "t") != "challenge" || server_nonce.size() != 32) {
      ::close(p.fd);
      throw CommError("monitor: what answers at " + address +
                      " is not rank 0's monitor (its first line is no challenge): another program on that port? "
                      "TETRA_MONITOR_PORT picks another");
    }
    const std::string client_nonce = fresh_nonce();
    send_line(p.fd, text_of(nlohmann::json({{"t", "hello"},
                                            {"rank", s.rank},
                                            {"where", where},
                                            {"nonce", client_nonce},
                                            {"mac", hello_mac(server_nonce, client_nonce, s.rank, where)}})));
    if (!next_line(p, queue, handshake, line)) {
      ::close(p.fd);
      throw CommError("monitor: rank 0 (" + address +
                      ") refused this rank's proof of the job's secret (rank 0's output says why): do all ranks of "
                      "the job have the same TETRA_JOB_SECRET, or none?");
    }
    const nlohmann::json welcome = nlohmann::json::parse(line, nullptr, false);
    if (string_field(welcome, "t") != "welcome" ||
        !equal_in_constant_time(string_field(welcome, "mac"), welcome_mac(server_nonce, client_nonce, s.rank))) {
      ::close(p.fd);
      throw CommError("monitor: the process at " + address +
                      " answered without the job's secret: it is not this job's rank 0");
    }
    p.heard_us = mono_us();
    s.early = std::move(queue);
    s.up = std::move(p);
    return;
  }
  throw CommError("monitor: rank 0 at " + address + " did not admit this rank in time: " + problem);
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
  // Note [Monitor listens]: only where the ranks are told to connect. TETRA_MONITOR_ADDR
  // given as an IPv4 address of this host: that address alone. A world on one network
  // namespace of one kernel (one host, no test hosts): loopback alone, unreachable from
  // any other machine. Otherwise every interface, since the ranks are told each of them.
  const bool one_network = world_shares_one_network(world, options.timeout);
  if (s.server) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) throw CommError(std::string("monitor: socket: ") + std::strerror(errno));
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    const char* host_env = std::getenv("TETRA_MONITOR_ADDR");
    in_addr given{};
    const bool numeric = host_env && ::inet_pton(AF_INET, host_env, &given) == 1;
    addr.sin_addr.s_addr = numeric ? given.s_addr : htonl(one_network ? INADDR_LOOPBACK : INADDR_ANY);
    const char* port_env = std::getenv("TETRA_MONITOR_PORT");
    addr.sin_port = htons(static_cast<uint16_t>(port_env ? std::atoi(port_env) : 0));
    int bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    if (bound != 0 && numeric && errno == EADDRNOTAVAIL) {  // an address others reach this host at (NAT)
      addr.sin_addr.s_addr = htonl(INADDR_ANY);
      bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    }
    if (bound != 0 || ::listen(fd, 1024) != 0) {
      const std::string e = std::strerror(errno);
      ::close(fd);
      throw CommError("monitor: cannot listen on port " + std::string(port_env ? port_env : "(any)") + ": " + e +
                      " (TETRA_MONITOR_PORT picks another)");
    }
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    s.listen_fd = fd;
    address = one_network && !host_env ? "127.0.0.1:" + std::to_string(ntohs(addr.sin_port))
                                       : advertised_address(ntohs(addr.sin_port));
  }
  address = share_setup(world, address, options.timeout);
  if (::pipe(s.wake) != 0) throw CommError(std::string("monitor: pipe: ") + std::strerror(errno));
  ::fcntl(s.wake[0], F_SETFL, O_NONBLOCK);
  if (!s.server) {
    s.up = Peer{};
    // Rank 0 listened before it shared its addresses: a rank that reaches none of them
    // within 20 s will not (a name that does not resolve here, a network between).
    connect_and_prove(address, Clock::now() + std::min<Duration>(options.timeout, std::chrono::seconds(20)));
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
