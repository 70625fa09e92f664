// What a call throws: the message of the std::exception `f` ends with, or "" when it
// returns. For tests that assert on an error's words whatever its type; a test that
// asserts the type too catches that type itself.
#pragma once

#include <exception>
#include <functional>
#include <string>

namespace tetra::testing_errors {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace tetra::testing_errors
