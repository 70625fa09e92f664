// Small text helpers shared by the job spec, data and model code.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace tetra::core {

// "a, b, c"
inline std::string join(const std::vector<std::string>& items, const std::string& sep = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    out += items[i];
  }
  return out;
}

// One number through a printf format: fmt("%.4f", loss).
inline std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// "[1, 28, 28]"
inline std::string shape_str(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

// "[3, 7)": a half-open range of elements
inline std::string range_str(int64_t begin, int64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

}  // namespace tetra::core
