// What the monitor's two roles share (Note [Monitor], monitor.h): rank 0's server
// (monitor_server.h) and the other ranks' client (monitor_client.h) are each a Session,
// one per started Monitor, owned by it: the thread, the latest reports, a failure another
// rank reported, Note [Silence]'s clocks, and how a process that lost a peer ends.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/monitor.h"
#include "collectives/monitor_transport.h"
#include "collectives/watchdog.h"

namespace tetra::collectives::monitor {

// The other end of a connection as the monitor sees it.
struct Peer : Connection {
  int rank = -1;          // set once it proved the key
  std::string where;
  std::string address;    // where it connected from ("10.0.0.2:41234")
  std::string nonce;      // the challenge it was sent (hex)
  bool proven = false;
  std::string refused;    // why it is being closed before it proved the key
  bool goodbye = false;   // said bye or fail: its closing is not a death
  int64_t heard_us = 0;   // mono_us()
};

// This process's report: its agreed communicators' progress (Note [Stall warnings]).
std::string report_json();
std::vector<MemberProgress> parse_report(const nlohmann::json& comms);
// "rank 3 (host h, pid p)".
std::string who(int rank, const std::string& where);
// The op a rank was last in, from its latest report.
std::string last_seen(const std::vector<MemberProgress>& report);

class Session : public RemoteProgress {
 public:
  // Opens the wake pipe; the thread starts with start().
  Session(const MonitorOptions& options, int rank, int size, std::string key);
  ~Session() override;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Runs the role's loop on the monitor's thread.
  void start();
  // Ends the thread after the goodbye (or failure) line `last` went out ("": none, the
  // others see this process lost, as when it exits), and closes everything: a process
  // that is ending must not leave the thread running into its exit (static destruction).
  // Safe to call when stopped.
  void halt(const std::string& last);
  bool running() const;
  // This process is ending on its own: a lost peer no longer makes it exit.
  void set_ending() { ending_ = true; }
  bool ending() const { return ending_.load(); }
  bool server() const { return rank_ == 0; }

 protected:
  virtual const char* role() const = 0;  // "server", "client"
  virtual void loop() = 0;               // the thread, until stop_
  virtual void say(const std::string& last) = 0;  // halt's last line to the other end(s)
  virtual void close_connections() = 0;           // after the thread ended

  // One line on `fd`, whole (lines from several threads never interleave).
  bool send_line(int fd, const std::string& line);
  // Reports when something changed: often enough that a death names a recent op, rarely
  // enough that rank 0 is not flooded (a quarter second, 5 ms per rank beyond 50 ranks).
  int64_t report_every_us() const { return std::max<int64_t>(250'000, int64_t{5'000} * size_); }
  // Note [Silence]: whether this process itself did not run (its loop came round late).
  bool stalled(int64_t& last_turn_us, int64_t now) const;
  // A peer was lost: ends the process with kExitPeerLost unless it is ending already.
  void lost(const std::string& text) const;
  // A failure another rank reported, ended on after the grace period (mu_ held).
  void note_failure_locked(const std::string& text);
  // Ends the process when a reported failure's grace period is over.
  void end_when_failure_due(int64_t now);

  const MonitorOptions options_;
  const int rank_, size_;
  const std::string key_;  // the job's secret (Note [Job secret])
  // Note [Silence]: from options_.silence
  int64_t silent_us_ = 20'000'000, heartbeat_us_ = 2'000'000, stalled_us_ = 5'000'000;
  std::atomic<bool> stop_{false};
  WakePipe wake_;

  mutable std::mutex mu_;  // guards what follows
  bool running_ = false;
  std::map<int, std::vector<MemberProgress>> reports_;  // by rank
  std::map<int, std::string> where_;                    // by rank
  std::string failure_;  // a failure another rank reported: end after the grace period
  int64_t failure_deadline_us_ = 0;  // mono_us

 private:
  void run_guarded();

  std::atomic<bool> ending_{false};
  std::mutex send_mu_;
  std::thread thread_;
};

}  // namespace tetra::collectives::monitor
