// The flight recorder: what every communicator of a rank was asked to do, and how far each
// op got, kept in a ring buffer so that a hang or a crash can be explained afterwards.
//
// Note [Flight recorder]
// Every op issued on a communicator is recorded when it is queued (communicator, op,
// sequence number, dtype, shape, bytes, peer) and updated when the progress thread starts
// it and when it finishes or fails (wall-clock times, so that dumps of different ranks of
// one host line up). Communicators split from one another share their root's recorder, so
// a rank's recorder holds every axis it talks on, in issue order; the oldest entries give
// way when the ring is full (TETRA_FLIGHT_RECORDER_ENTRIES, default 4096). Recording is a
// short lock and a few stores per op state.
//
// Sequence numbers are what make the dumps of different ranks comparable: collectives
// (allreduce, reduce_scatter, allgather, broadcast, barrier, split) count per communicator,
// #1, #2, ... in issue order, the same on every member; sends count per (destination, tag)
// and receives per (source, tag), so send #k from a to b with tag t pairs with b's
// receive #k from a with tag t (the order MPI matches them in).
//
// A dump is one JSON file per process, flight-<host>-<pid>.json, holding each recorder of
// the process (its rank, or each thread-rank's) and the group identity of each
// communicator. It is written on a timeout, at a stall warning, on SIGUSR1 and (best
// effort) on a fatal signal, into the folder set_dump_dir() names (tetra::run: log.dir's
// flight/). analyze() reads the dumps of all ranks and says what happened (the `flight`
// tool prints it).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace tetra::collectives {

// Who a communicator is, for records and reports. `identity` is the same on every member
// of the group (the root's agreed name, then the path of splits) when `agreed`; `rank` is
// this member's rank in it.
struct GroupInfo {
  std::string name;      // "data (of mesh pipeline=2 x data=2)"
  std::string identity;  // "mpi:<job>/3.1": equal on every member of the group
  bool agreed = true;    // false: identity is this process's own (in-process groups only)
  std::string backend;
  int rank = 0, size = 1;
};

enum class OpState { kQueued, kStarted, kFinished, kFailed };
const char* to_string(OpState s);

struct OpRecord {
  uint64_t id = 0;  // this recorder's running count
  std::shared_ptr<const GroupInfo> group;
  std::string op;        // "allreduce sum", "send", "recv", "barrier", ...
  int64_t seq = 0;       // collectives: #n on the communicator; send/recv: #n to/from (peer, tag)
  bool p2p = false;      // send or recv: seq counts per peer
  int peer = -1;         // send: destination, recv: source, broadcast: root (group ranks)
  int tag = 0;           // send/recv
  std::string dtype;     // "Float"
  std::vector<int64_t> shape;
  int64_t bytes = 0;
  OpState state = OpState::kQueued;
  int64_t queued_us = 0, started_us = 0, ended_us = 0;  // wall clock, microseconds since the epoch
  std::string error;
  // "allreduce sum #12 on data (of mesh ...) Float[1024]", "send to 1 tag 0 #77 on pipeline
  // Float[1024]" (a send's or receive's op names its peer and tag).
  std::string describe() const;
  // describe() and how the op stood at `now_us`: "... (running for 62 s)", "... (finished)".
  std::string describe_at(int64_t now_us) const;
};

int64_t wall_us();  // microseconds since the epoch (system clock)
std::string seconds_text(int64_t us);  // "0.3 s", "62 s"
// "host h, pid p" for this process: where a member is, in reports and dumps.
std::string process_description();

class FlightRecorder : public std::enable_shared_from_this<FlightRecorder> {
 public:
  // `owner` names the rank it records for ("rank 3", "rank 1 replica 0").
  explicit FlightRecorder(std::string owner, size_t capacity = default_capacity());
  ~FlightRecorder();
  static size_t default_capacity();

  std::string owner() const;
  void set_owner(std::string owner);

  // Adds a queued op and returns its id (the handle for the updates below).
  uint64_t record(OpRecord r);
  // The op began running; copies its record into *out when it is still in the ring.
  bool started(uint64_t id, OpRecord* out = nullptr);
  void ended(uint64_t id, const std::string& error = "");
  // A copy of one record, when it is still in the ring.
  bool snapshot_of(uint64_t id, OpRecord& out) const;

  std::vector<OpRecord> snapshot() const;
  // Like snapshot() but gives up (returns false) when the lock is busy: for signal handlers.
  bool try_snapshot(std::vector<OpRecord>& out) const;

  // Every recorder of this process that is still alive.
  static std::vector<std::shared_ptr<FlightRecorder>> all();

  // Where dumps go ("" = nowhere: dump() then does nothing). Process-wide.
  static void set_dump_dir(const std::string& dir);
  static std::string dump_dir();
  // Writes this process's dump (every live recorder) and returns its path ("" when no dump
  // folder is set or it could not be written; never throws). `reason` goes into the file.
  static std::string dump(const std::string& reason);
  // The dump as JSON (what dump() writes).
  static nlohmann::json dump_json(const std::string& reason);

 private:
  std::string owner_;
  mutable std::mutex mu_;
  std::vector<OpRecord> ring_;
  size_t capacity_;
  uint64_t next_ = 1;
  OpRecord* find_locked(uint64_t id);
};

nlohmann::json to_json(const OpRecord& r);
nlohmann::json to_json(const GroupInfo& g);
OpRecord op_record_from_json(const nlohmann::json& j);
std::shared_ptr<const GroupInfo> group_from_json(const nlohmann::json& j);

// Reads the dumps of all ranks (each what dump_json wrote) and says what happened: for
// each group, the op its members disagree on or wait in, who never entered it, and what
// those ranks were doing instead. One finding per line, the most telling first.
std::string analyze(const std::vector<nlohmann::json>& dumps);

}  // namespace tetra::collectives
