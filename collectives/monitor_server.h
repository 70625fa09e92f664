// Rank 0's side of the monitor (Note [Monitor], monitor.h): it accepts the other ranks'
// connections and checks their proofs (Note [Monitor handshake]), keeps the latest report
// of every rank, answers queries for a group, and tells every rank when one was lost or
// failed.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "collectives/monitor_handshake.h"
#include "collectives/monitor_session.h"

namespace tetra::collectives::monitor {

class Server final : public Session {
 public:
  // Takes `listen_fd` (listen_for_ranks) and closes it when it ends.
  Server(const MonitorOptions& options, int size, std::string key, int listen_fd);
  ~Server() override;

  std::vector<MemberProgress> remote_members(const std::string& identity) override;

 private:
  // Refusals named per address (Note [Monitor handshake]).
  struct Refusals {
    int64_t printed_us = 0;
    std::map<std::string, int64_t> since;  // refused and not named since printed_us, by reason
    std::string last;                      // the latest one's address
  };

  const char* role() const override { return "server"; }
  void loop() override;
  void say(const std::string& last) override;
  void close_connections() override;

  void broadcast(const std::string& line, int except_fd = -1);
  void accept_one();
  void hello(Peer& p, const std::string& line);
  void line(Peer& p, const std::string& line);
  void line_unguarded(Peer& p, const std::string& line);
  void read_from(int fd);
  void drop_unproven(Peer& p, std::string why);  // `why` by value: it may be p's own
  void drop_slow_provers(int64_t now);
  void check_silence(int64_t now);
  std::vector<int> also_lost(int first_fd, std::chrono::milliseconds window);
  void peer_gone(const Peer& p, const std::string& how);
  static void print_refusals(const std::string& host, Refusals& r, int64_t now);
  void name_refusal(const std::string& address, const std::string& why);
  void flush_refusals(int64_t now, bool all = false);

  int listen_fd_ = -1;
  std::map<int, Peer> peers_;                  // by fd; the server's thread alone
  std::map<std::string, Refusals> refusals_;   // by the address's host part
  int64_t refused_total_ = 0;
  std::vector<std::string> outbox_;  // lines other threads want broadcast; guarded by mu_
};

}  // namespace tetra::collectives::monitor
