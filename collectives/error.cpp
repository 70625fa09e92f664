#include "collectives/error.h"

namespace tetra::detail {

void throw_check_failure(const char* file, int line, const char* cond, const std::string& msg) {
  std::ostringstream os;
  os << msg << " (check `" << cond << "` failed at " << file << ":" << line << ")";
  throw Error(os.str());
}

}  // namespace tetra::detail
