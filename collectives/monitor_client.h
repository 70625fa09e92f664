// The other ranks' side of the monitor (Note [Monitor], monitor.h): one connection to
// rank 0, proved both ways (Note [Monitor handshake]), over which the rank reports its
// progress, asks for a group's and learns that a rank was lost or failed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "collectives/monitor_handshake.h"
#include "collectives/monitor_session.h"

namespace tetra::collectives::monitor {

class Client final : public Session {
 public:
  Client(const MonitorOptions& options, int rank, int size, std::string key);
  ~Client() override;

  // Connects to rank 0 at `address` and proves the job's secret (before start()).
  void connect(const std::string& address, Deadline deadline);

  // Asks rank 0 (waits up to 3 s for its answer).
  std::vector<MemberProgress> remote_members(const std::string& identity) override;

 private:
  const char* role() const override { return "client"; }
  void loop() override;
  void say(const std::string& last) override { send_line(up_.fd, last); }
  void close_connections() override;

  void line(const std::string& line);
  void line_unguarded(const std::string& line);
  // What arrived from rank 0, and how the loop goes on: with this turn, with the next
  // (rank 0 failed and said so, then closed), or not at all.
  enum class Turn { kGoOn, kNext, kDone };
  Turn read_up();

  Peer up_;                         // the connection to rank 0
  std::vector<std::string> early_;  // lines that came with rank 0's welcome
  // Queries and their answers; guarded by mu_.
  int64_t next_query_ = 1;
  std::map<int64_t, std::vector<MemberProgress>> answers_;
  std::condition_variable answered_;
};

}  // namespace tetra::collectives::monitor
