// JSON and names read from files that may come from someone else: a safetensors header
// (an exported model, a checkpoint's rank file) and a checkpoint's meta.json.
//
// nlohmann's parser keeps its own stack, but dump(), comparisons and every walk over a
// value recurse, so a document nested a million levels deep would overflow the stack
// long after it parsed. parse_json_input refuses nesting deeper than kMaxJsonDepth while
// parsing (neither format nests past 4 levels; a user's meta a few more). Its exceptions
// derive from std::exception; callers wrap them in a tetra::Error naming the file.
//
// shown() is how such a name or value appears in an error message: control bytes and
// bytes that are not UTF-8 as \xNN, and no more than `max` bytes (cut at a character),
// so a message stays one readable, valid UTF-8 line whatever the file held.
// json_uint / json_int take an integer only when the document holds one that fits:
// nlohmann's get<int64_t>() of 1e300 or get<int>() of 2^40 converts out of range
// (undefined behaviour for a double, a silent wrap for an integer).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

namespace tetra::core {

inline constexpr int kMaxJsonDepth = 64;

inline nlohmann::json parse_json_input(const char* first, const char* last) {
  return nlohmann::json::parse(
      first, last, [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        if (depth > kMaxJsonDepth)
          throw std::runtime_error("JSON nested deeper than " + std::to_string(kMaxJsonDepth) +
                                   " levels");
        return true;
      });
}
inline nlohmann::json parse_json_input(const std::string& text) {
  return parse_json_input(text.data(), text.data() + text.size());
}

namespace detail {
// Bytes in the UTF-8 sequence at s[i] (1 to 4), or 0 when it is not well-formed (RFC 3629:
// no overlong forms, no surrogates, nothing past U+10FFFF).
inline size_t utf8_length(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xbf;  // the allowed range of the second byte
  if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c >= 0xe0 && c <= 0xef) n = 3, lo = c == 0xe0 ? 0xa0 : 0x80, hi = c == 0xed ? 0x9f : 0xbf;
  else if (c >= 0xf0 && c <= 0xf4) n = 4, lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
  else return 0;
  if (i + n > s.size() || b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (b(i + k) < 0x80 || b(i + k) > 0xbf) return 0;
  return n;
}
}  // namespace detail

inline std::string shown(const std::string& s, size_t max = 200) {
  std::string out;
  for (size_t i = 0; i < s.size();) {
    if (out.size() >= max) return out + "...";
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = detail::utf8_length(s, i);
    if (n == 0 || c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
      ++i;
    } else {
      out.append(s, i, n);
      i += n;
    }
  }
  return out;
}
inline std::string shown(const char* s, size_t max = 200) { return shown(std::string(s), max); }
// A JSON value, compact and cut as shown() cuts (a value in an error message).
inline std::string shown(const nlohmann::json& v, size_t max = 200) {
  return shown(v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), max);
}

inline bool json_uint(const nlohmann::json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0) {
    *out = static_cast<uint64_t>(v.get<int64_t>());
    return true;
  }
  return false;
}
inline bool json_int(const nlohmann::json& v, int64_t* out) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(v.get<uint64_t>());
    return true;
  }
  if (!v.is_number_integer()) return false;
  *out = v.get<int64_t>();
  return true;
}

}  // namespace tetra::core
