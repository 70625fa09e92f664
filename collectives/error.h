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
