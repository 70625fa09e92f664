#include "collectives/watchdog.h"

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>


namespace tetra::collectives {

namespace {

struct Watchdog {
  std::mutex mu;  // comms
  std::map<Communicator*, Duration> comms;  // each with its stall warning
  std::once_flag started;
  std::mutex remote_mu;  // remote (never held while a source answers: it may wait for rank 0)
  std::weak_ptr<RemoteProgress> remote;  // Note [Remote progress]
};

Watchdog& dog() {
  static Watchdog* w = new Watchdog;  // leaked: communicators may outlive static destruction
  return *w;
}

std::atomic<bool> dump_requested{false};

// Where a member is: its running op, else its last one.
std::string whereabouts(const MemberProgress& m, int64_t now) {
  if (m.running) return "in " + m.current.describe_at(now);
  if (m.has_last) return "idle since " + m.last.describe_at(now);
  return "has run no op on it";
}

void watch_loop();

}  // namespace

void watch(Communicator* comm, Duration stall_warning) {
  Watchdog& w = dog();
  std::call_once(w.started, [] { std::thread(watch_loop).detach(); });
  std::lock_guard<std::mutex> lock(w.mu);
  w.comms[comm] = stall_warning;
}

void unwatch(Communicator* comm) {
  Watchdog& w = dog();
  std::lock_guard<std::mutex> lock(w.mu);
  w.comms.erase(comm);
}

std::vector<MemberProgress> local_progress() {
  Watchdog& w = dog();
  std::lock_guard<std::mutex> lock(w.mu);
  std::vector<MemberProgress> out;
  out.reserve(w.comms.size());
  for (const auto& [c, stall] : w.comms) out.push_back(c->progress());
  return out;
}

bool set_remote_progress(std::weak_ptr<RemoteProgress> source) {
  Watchdog& w = dog();
  std::lock_guard<std::mutex> lock(w.remote_mu);
  if (!w.remote.expired()) return false;
  w.remote = std::move(source);
  return true;
}

void clear_remote_progress(const RemoteProgress* source) {
  Watchdog& w = dog();
  std::lock_guard<std::mutex> lock(w.remote_mu);
  if (w.remote.lock().get() == source) w.remote.reset();
}

bool has_remote_progress() {
  Watchdog& w = dog();
  std::lock_guard<std::mutex> lock(w.remote_mu);
  return !w.remote.expired();
}

namespace {

std::shared_ptr<RemoteProgress> remote_progress() {
  Watchdog& w = dog();
  std::lock_guard<std::mutex> lock(w.remote_mu);
  return w.remote.lock();
}

}  // namespace

std::vector<MemberProgress> group_members(const GroupInfo& group) {
  std::vector<MemberProgress> out;
  for (MemberProgress& m : local_progress())
    if (m.group && m.group->identity == group.identity) out.push_back(std::move(m));
  if (group.agreed && static_cast<int>(out.size()) < group.size)
    if (const std::shared_ptr<RemoteProgress> remote = remote_progress())
      for (MemberProgress& m : remote->remote_members(group.identity)) out.push_back(std::move(m));
  return out;
}

std::string diagnose(const OpRecord& op, const std::vector<MemberProgress>& members) {
  const int64_t now = wall_us();
  const int size = op.group ? op.group->size : 0;
  std::map<int, const MemberProgress*> by_rank;
  for (const MemberProgress& m : members)
    if (m.group) by_rank.emplace(m.group->rank, &m);
  std::vector<std::string> joined, missing;
  if (op.p2p) {
    // A receive waits for its sender; a send for its receiver (a rendezvous or a full buffer).
    const bool recv = op.op.rfind("recv", 0) == 0;
    auto it = by_rank.find(op.peer);
    if (it == by_rank.end())
      return "the peer, rank " + std::to_string(op.peer) + ", is in another process; its progress needs the monitor, which tetra::run starts";
    const MemberProgress& p = *it->second;
    const int me = op.group ? op.group->rank : 0;
    auto count = [](const std::vector<int64_t>& v, int k) { return k < static_cast<int>(v.size()) ? v[static_cast<size_t>(k)] : 0; };
    const int64_t reached = count(recv ? p.sends_started : p.recvs_started, me);
    // This rank's own count of the same direction (its progress is among the members).
    auto self = by_rank.find(me);
    const int64_t mine = self == by_rank.end() ? op.seq : count(recv ? self->second->recvs_started : self->second->sends_started, op.peer);
    if (reached >= mine)
      return "the peer, rank " + std::to_string(op.peer) + " (" + p.owner + ", " + p.where + "), has entered the matching " +
             (recv ? "send" : "recv") + "; the transfer itself is slow or stuck";
    return "the peer, rank " + std::to_string(op.peer) + " (" + p.owner + ", " + p.where + "), has " +
           (recv ? "sent " : "received ") + std::to_string(reached) + " to this rank so far; it is " + whereabouts(p, now);
  }
  for (int k = 0; k < size; ++k) {
    auto it = by_rank.find(k);
    if (it == by_rank.end()) {
      missing.push_back("rank " + std::to_string(k) + " (in another process; its progress needs the monitor, which tetra::run starts)");
      continue;
    }
    const MemberProgress& m = *it->second;
    if (m.collectives_started >= op.seq) {
      joined.push_back(std::to_string(k));
    } else {
      missing.push_back("rank " + std::to_string(k) + " (" + m.owner + ", " + m.where + ") is at #" +
                        std::to_string(m.collectives_started) + " on this group, " + whereabouts(m, now));
    }
  }
  if (missing.empty())
    return "every rank of the group has entered it; the op itself is slow or stuck in the transport";
  std::string s = joined.empty() ? "no rank has entered it yet" : (joined.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < joined.size(); ++i) s += (i ? ", " : "") + joined[i];
  if (!joined.empty()) s += " of " + std::to_string(size) + " entered it";
  s += "; not yet: ";
  for (size_t i = 0; i < missing.size(); ++i) s += (i ? "; " : "") + missing[i];
  return s;
}

nlohmann::json to_json(const MemberProgress& m) {
  nlohmann::json j = {{"owner", m.owner},
                      {"where", m.where},
                      {"collectives_started", m.collectives_started},
                      {"sends_started", m.sends_started},
                      {"recvs_started", m.recvs_started}};
  if (m.running) j["current"] = to_json(m.current);
  if (m.has_last) j["last"] = to_json(m.last);
  if (m.group) j["group"] = to_json(*m.group);
  return j;
}

MemberProgress member_progress_from_json(const nlohmann::json& j) {
  MemberProgress m;
  if (j.contains("group")) m.group = group_from_json(j["group"]);
  m.owner = j.value("owner", "");
  m.where = j.value("where", "");
  m.collectives_started = j.value("collectives_started", int64_t{0});
  m.sends_started = j.value("sends_started", std::vector<int64_t>{});
  m.recvs_started = j.value("recvs_started", std::vector<int64_t>{});
  if (j.contains("current")) m.running = true, m.current = op_record_from_json(j["current"]);
  if (j.contains("last")) m.has_last = true, m.last = op_record_from_json(j["last"]);
  return m;
}

namespace {

// Per running op: when to warn next.
struct Stall {
  uint64_t op = 0;
  int64_t next_us = 0;
  int64_t interval_us = 0;
};

void watch_loop() {
  std::map<const void*, Stall> stalls;
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    if (dump_requested.exchange(false)) {
      const std::string path = FlightRecorder::dump("SIGUSR1");
      std::fprintf(stderr, "tetra: SIGUSR1: flight recorder %s\n",
                   path.empty() ? "not written (no dump folder: set log.dir or TETRA_FLIGHT_RECORDER_DIR)" : path.c_str());
    }
    struct Seen {
      const void* comm;
      MemberProgress progress;
      Duration stall;
    };
    std::vector<Seen> seen;
    {
      Watchdog& w = dog();
      std::lock_guard<std::mutex> lock(w.mu);
      for (const auto& [c, stall] : w.comms)
        if (stall.count() > 0) seen.push_back({c, c->progress(), stall});
    }
    const int64_t now = wall_us();
    std::map<const void*, Stall> next;
    for (Seen& s : seen) {
      if (!s.progress.running) continue;
      const OpRecord& op = s.progress.current;
      Stall st = stalls.count(s.comm) && stalls[s.comm].op == op.id ? stalls[s.comm] : Stall{};
      if (st.op != op.id) {
        st.op = op.id;
        st.interval_us = std::chrono::duration_cast<std::chrono::microseconds>(s.stall).count();
        st.next_us = op.started_us + st.interval_us;
      }
      if (now >= st.next_us) {
        const std::string why = diagnose(op, group_members(*op.group));
        const std::string path = FlightRecorder::dump("stall: " + op.describe());
        std::fprintf(stderr, "tetra: stall: %s (%s) has waited %s in %s: %s%s%s\n", s.progress.owner.c_str(),
                     process_description().c_str(), seconds_text(now - op.started_us).c_str(), op.describe().c_str(),
                     why.c_str(), path.empty() ? "" : "; flight recorder: ", path.c_str());
        std::fflush(stderr);
        st.interval_us *= 2;  // 60 s, 120 s, 240 s, ... until the op's timeout
        st.next_us = now + st.interval_us;
      }
      next[s.comm] = st;
    }
    stalls = std::move(next);
  }
}

void on_usr1(int) { dump_requested.store(true); }

struct sigaction previous[32];

void on_fatal(int sig) {
  // Best effort: a dump may need a lock or memory the crashing thread holds; SIGALRM
  // ends the process if it does not finish in time.
  alarm(10);
  const std::string path = FlightRecorder::dump("fatal signal " + std::to_string(sig));
  if (!path.empty()) {
    const std::string line = "tetra: fatal signal " + std::to_string(sig) + ": flight recorder " + path + "\n";
    ssize_t ignored = ::write(2, line.data(), line.size());
    (void)ignored;
  }
  alarm(0);
  sigaction(sig, &previous[sig], nullptr);
  raise(sig);
}

}  // namespace

void install_flight_recorder_signals() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_handler = on_usr1;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, nullptr);
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) {
      struct sigaction fatal {};
      fatal.sa_handler = on_fatal;
      sigemptyset(&fatal.sa_mask);
      fatal.sa_flags = SA_RESETHAND | SA_NODEFER;
      sigaction(sig, &fatal, &previous[sig]);
    }
  });
}

}  // namespace tetra::collectives
