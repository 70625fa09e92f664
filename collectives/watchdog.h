// The watchdog: one thread per process that watches every communicator's running op.
//
// Note [Stall warnings]
// An op that has run `stall_warning` (collectives.stall_warning_s, default 60 s) gets a
// warning on stderr that names the op and, for each member of its group that has not
// entered it, where that member is instead ("rank 3 (host h, pid p) is at #1841 on this
// group; its last op: send #77 on pipeline ... to rank 1, running 63 s"). The members'
// progress is read out of band, never through the data path that is stuck: directly for
// members in this process (thread-ranks), from the monitor (collectives/monitor.h) for the
// others. The warning repeats at twice the previous interval until the op's timeout ends
// it with the same diagnosis in the error. Each warning also dumps the flight recorder.
//
// SIGUSR1 dumps the flight recorder of the process (and goes on); a fatal signal
// (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) dumps it as far as it can and then dies of
// the signal as it would have.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "collectives/communicator.h"

namespace tetra::collectives {

// A HealthWrapper (collectives/health.h) registers its communicator while it lives, so the
// watchdog and the monitor can read its progress; the watchdog warns of an op running
// past `stall_warning` (0: never, but its progress is still read).
void watch(Communicator* comm, Duration stall_warning);
void unwatch(Communicator* comm);

// Note [Remote progress]
// The members in other processes come from the monitor (Note [Monitor], monitor.h),
// which whoever starts it owns (tetra::run). The watchdog is one per process and
// diagnoses any communicator's stall from its own thread, with no handle to that owner,
// so a running monitor registers here as the source of the other processes' progress.
// This registry is the one process-wide handle to the monitor, and only an observer (a
// weak reference: the owner's stop or destruction ends the monitor, registered or not).
// A process runs one monitor at a time: a second one, while one is registered, starts
// nothing.
class RemoteProgress {
 public:
  virtual ~RemoteProgress() = default;
  // The other processes' latest reports of the members of `identity` (not this one's).
  virtual std::vector<MemberProgress> remote_members(const std::string& identity) = 0;
};
// Registers `source`; false (and nothing changes) while another is registered.
bool set_remote_progress(std::weak_ptr<RemoteProgress> source);
// Unregisters `source`; nothing when another one is registered.
void clear_remote_progress(const RemoteProgress* source);
// Whether a source is registered (a monitor runs in this process).
bool has_remote_progress();

// Every member of `group` this process can see: its own communicators of that identity
// and, when the monitor runs, the latest reports of the other processes.
std::vector<MemberProgress> group_members(const GroupInfo& group);
// Every registered communicator of this process, as reports (for the monitor).
std::vector<MemberProgress> local_progress();

// Says who has not joined `op` (an op of `members`' group) and what they do instead.
std::string diagnose(const OpRecord& op, const std::vector<MemberProgress>& members);

// Installs the SIGUSR1 and fatal-signal handlers (idempotent; tetra::run calls it). Keeps
// a handler the program installed before for the fatal signals by chaining to it.
void install_flight_recorder_signals();

}  // namespace tetra::collectives
