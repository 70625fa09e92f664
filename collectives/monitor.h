// The monitor: an out-of-band channel between the processes of a job, beside the data
// path, so that a rank learns that another died or failed, and where the others are when
// an op stalls, even while its own collectives are stuck.
//
// Note [Monitor]
// Rank 0 listens on a TCP port (TETRA_MONITOR_PORT, else any free one) and tells the
// others its addresses through the world's first broadcast: its hostname and the IPv4
// address of each of its interfaces, tried in that order, so that a host where the name
// does not resolve still connects (TETRA_MONITOR_ADDR replaces the list). It listens only
// where it is reached (Note [Monitor listens], monitor_transport.cpp: loopback for a job
// on one host) and believes a connection only once it proved the job's secret (Note [Job
// secret], collectives/auth.h; Note [Monitor handshake], monitor_handshake.h).
// Over the connection each process sends, about once a second when something changed,
// the progress of its communicators (Note [Stall warnings]); rank 0 keeps the latest of
// every rank and answers queries for a group.
//
// A process that dies closes its connection without saying goodbye: the kernel does it
// for a kill -9, an out-of-memory kill or a crash. Rank 0 sees it at once and tells every
// other rank, which prints which rank died, on which host, and the op it was last in
// (with every rank whose connection closed within 300 ms of it: a host that dies takes
// all its ranks, and they are named together),
// dumps its flight recorder and exits with kExitPeerLost (3) — whatever it was doing, a
// collective or a long compute, and whatever the launcher does. When rank 0 dies, the
// others see their connection close and do the same. A rank that fails with an error says
// so (report_failure); the others end the same way a few seconds later unless they end on
// their own first. A clean end says goodbye, so nobody mistakes it for a death.
//
// Note [Silence]
// A host that stops (powered off, its network cut) closes nothing: its ranks fall silent.
// Every process sends at least a heartbeat every min(2 s, silence/4); a rank rank 0 has
// not heard from for `silence` (collectives.peer_silence_s, 20 s) is lost as above, and so
// is rank 0 to a rank that has not heard from it. Silence is measured on the steady clock,
// and only while the measuring process itself runs: when its monitor thread comes round
// more than min(5 s, silence/4) late (never under 1 s), this process, or the whole
// machine, was stopped or starved (a paused VM, SIGSTOP, a debugger), so the silence it
// saw is its own; it restarts every peer's clock and says so on stderr. A rank stopped
// alone is still lost after `silence`: the others ran and did not hear from it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "collectives/communicator.h"

namespace tetra::collectives {

struct MonitorOptions {
  Duration timeout = std::chrono::seconds(60);  // to set up (connect, first broadcast)
  // How long the others wait after a rank reported a failure before they end (they may
  // be about to fail with the same error and say it themselves).
  Duration failure_grace = std::chrono::seconds(5);
  // A peer not heard from for this long is lost (Note [Silence]); at least 1 s.
  Duration silence = std::chrono::seconds(20);
};

namespace monitor {
class Session;
}

// The monitor of this process, owned by whoever starts it (tetra::run): its thread, its
// connections and what it learned live in this object, and end with it. While it runs
// it is the watchdog's source of the other processes' progress (Note [Remote progress],
// watchdog.h), which also keeps a process to one running monitor.
//
// Files: monitor_transport (lines over TCP), monitor_handshake (the setup over the world
// and Note [Monitor handshake]), monitor_session (what both roles share), monitor_server
// (rank 0), monitor_client (the other ranks).
class Monitor {
 public:
  // Collective over `world` (a process world: one rank per process): rank 0 listens and
  // broadcasts its address, the others connect. A world of one starts nothing, and so
  // does a process where a monitor runs already (running() is false for this one).
  explicit Monitor(Communicator& world, const MonitorOptions& options = {});
  // Without stop() or report_failure() first: ends the thread and closes the connections
  // without a goodbye, so the others see this process lost, as when it exits.
  ~Monitor();
  Monitor(const Monitor&) = delete;
  Monitor& operator=(const Monitor&) = delete;

  // Says goodbye and stops (a clean end). Safe to call when not started.
  void stop();
  // This rank failed (its message): tells the others before it exits.
  void report_failure(const std::string& message);
  bool running() const;
  // The other processes' latest reports of the members of `identity` (not this one's).
  std::vector<MemberProgress> remote_members(const std::string& identity) const;
  // This process is ending on its own: a lost peer no longer makes it exit (it is
  // already on its way with its own message and status).
  void ending();
  // Gives the monitor up to `wait` to learn that a peer was lost (then it ends the process,
  // exit status 3). For a rank whose op just failed: the failure may be that death's echo.
  void settle(Duration wait) const;

 private:
  void detach();  // from the watchdog (Note [Remote progress])

  std::shared_ptr<monitor::Session> session_;  // null: it started nothing
};

}  // namespace tetra::collectives
