// Errors thrown at tetra's API boundaries, by every layer from collectives up (hence here,
// at the lowest layer that throws).
//
// A small hierarchy, so callers can tell a user's mistake (ConfigError: exit 2, no
// trace) from a runtime failure (Error: exit 1) from a communication problem that later
// layers raise (CommError, TimeoutError). TETRA_CHECK records the file and line of the
// check that failed; the message says what the user should fix.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace tetra {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The job, its files or the command line are wrong. The message is complete and meant
// for the user as it is (it already carries file:line:col where there is one).
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A data file is missing, truncated or of the wrong format.
class DataError : public Error {
 public:
  using Error::Error;
};

class CommError : public Error {
 public:
  using Error::Error;
};

class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

// Another rank of the job died or failed: this rank ends because of it. The message names
// that rank, its host and the op it was last in.
class PeerLostError : public CommError {
 public:
  using CommError::CommError;
};

// The job was asked to stop (SIGTERM, SIGINT): every rank finished its step and wrote the
// checkpoint all agreed on; running the job again resumes it exactly.
class PreemptedError : public Error {
 public:
  PreemptedError(const std::string& what, std::string checkpoint)
      : Error(what), checkpoint_(std::move(checkpoint)) {}
  const std::string& checkpoint() const { return checkpoint_; }  // "" when none was written

 private:
  std::string checkpoint_;
};

// Exit statuses of `train` and of programs that end through tetra::exit_status (README
// "Exit status"): a launcher or a job script can tell what to do next from them alone.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;      // the run failed on this rank (its message says why)
inline constexpr int kExitUserError = 2;   // the job, its files or the command line are wrong
inline constexpr int kExitPeerLost = 3;    // another rank died or failed; the message names it
inline constexpr int kExitPreempted = 4;   // stopped by a signal after an agreed checkpoint: run again

namespace detail {
[[noreturn]] void throw_check_failure(const char* file, int line, const char* cond,
                                      const std::string& msg);
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace tetra

// TETRA_CHECK(cond, "message ", parts...): throws tetra::Error naming file:line.
#define TETRA_CHECK(cond, ...)                                                         \
  do {                                                                                 \
    if (!(cond))                                                                       \
      ::tetra::detail::throw_check_failure(__FILE__, __LINE__, #cond,                  \
                                           ::tetra::detail::concat(__VA_ARGS__));      \
  } while (0)
