// The monitor's transport (Note [Monitor], monitor.h): newline-ended JSON lines over TCP,
// the sockets that carry them, and the monitor's own clock. It knows nothing of ranks,
// the job's secret or what a line says; monitor_handshake.h and the server and client
// (monitor_server.h, monitor_client.h) do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "collectives/communicator.h"

namespace tetra::collectives::monitor {

// The monitor's own clock (steady: a step of the system clock is no silence).
int64_t mono_us();

// A line to send. Never throws: a name with bytes that are not UTF-8 is written with
// U+FFFD instead.
std::string text_of(const nlohmann::json& j);

// A string field of a line from the other end; "" when it has none (or not a string).
std::string string_field(const nlohmann::json& j, const char* key);

// "16 MiB", "4096 bytes": a line limit as the messages name it.
std::string line_limit_text(size_t limit);

// One end of a connection and what has arrived on it that is not a whole line yet.
struct Connection {
  int fd = -1;
  std::string in;
  size_t scanned = 0;     // bytes of `in` already searched for a newline
  bool skipping = false;  // dropping the rest of a line over the limit
};

// Sends `line` and its newline, all of it (the caller serialises senders on one fd).
// false when the connection is closed or broken.
bool send_all(int fd, const std::string& line);

enum class Read { kOpen, kClosed, kTooLong };

// Reads what is there (at most 64 KiB): kClosed on EOF or error. Complete lines go to
// `lines`; a line longer than `limit` is dropped up to its end and says kTooLong once.
// Only the bytes this read added are searched (Note [Monitor handshake]).
Read read_lines(Connection& c, std::vector<std::string>& lines, size_t limit);

// The next line from `c` within `until`, from `queue` first; false when the connection
// closed, sent a line longer than `limit` or stayed silent.
bool next_line(Connection& c, std::vector<std::string>& queue, Deadline until, size_t limit, std::string& line);

// Connects to one of the hosts of `address` ("name,10.0.0.1:port"), each tried in turn
// until `deadline`; throws CommError naming every host and why it failed.
int connect_to(const std::string& address, Deadline deadline);

// Rank 0's listening socket (Note [Monitor listens]) and the address it tells the
// others to connect to.
struct Listener {
  int fd = -1;
  std::string address;
};
// `one_network`: every process of the world shares this one's network namespace.
// Throws CommError when it cannot listen.
Listener listen_for_ranks(bool one_network);

// A pipe that wakes a thread blocked in poll() (its read end is one of the fds polled).
class WakePipe {
 public:
  void open();   // throws CommError
  void close();  // both ends; safe when not open
  void wake();
  void drain();  // what wake() wrote
  int read_fd() const { return fds_[0]; }

 private:
  int fds_[2] = {-1, -1};
};

}  // namespace tetra::collectives::monitor
