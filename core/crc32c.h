// CRC-32C (Castagnoli), as checkpoint files (Note [Checkpoint checksums]) and TensorBoard's
// record framing (Note [Event files]) use it: the Castagnoli polynomial, reflected, initial
// value and final XOR all ones.
//
// Note [Two CRC-32Cs]
// Boost's crc_optimal is the project's CRC wherever Boost's headers are found; where they
// are not (a machine that has LibTorch but not Boost, as the GPU check's, which then need
// not carry 9.5 MB of Boost headers), Crc32cPortable below, a slicing-by-8 table of its
// own, takes its place. CMake decides once, for the target (core/CMakeLists.txt:
// TETRA_CRC32C_BOOST, 1 or 0, a compile definition of tetra_core that its users inherit),
// so every translation unit of one build agrees on what Crc32c is. Both give the same
// checksum for the same bytes (tests/core/test_crc32c.cpp holds them to RFC 3720's
// vectors and to each other), so checkpoints written by one build verify in the other.
#pragma once

#ifndef TETRA_CRC32C_BOOST
#error "TETRA_CRC32C_BOOST is defined by tetra_core's CMake target (core/CMakeLists.txt): link tetra::core"
#endif

#if TETRA_CRC32C_BOOST
#include <boost/crc.hpp>
#endif

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace tetra::core {

// CRC-32C without Boost: eight tables of 256 entries (8 KiB), eight bytes a round.
// The interface is the part of Boost's crc_optimal that tetra uses.
class Crc32cPortable {
 public:
  void process_bytes(const void* data, size_t size) {
    const auto* p = static_cast<const unsigned char*>(data);
    const auto& t = tables();
    uint32_t c = crc_;
    for (; size >= 8; p += 8, size -= 8) {
      uint32_t lo;
      uint32_t hi;
      std::memcpy(&lo, p, 4);
      std::memcpy(&hi, p + 4, 4);
      if (!little_endian()) {
        lo = swap(lo);
        hi = swap(hi);
      }
      lo ^= c;
      c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
          t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    }
    for (; size > 0; ++p, --size) c = t[0][(c ^ *p) & 0xFF] ^ (c >> 8);
    crc_ = c;
  }
  uint32_t checksum() const { return crc_ ^ 0xFFFFFFFFu; }
  void reset() { crc_ = 0xFFFFFFFFu; }

 private:
  using Tables = std::array<std::array<uint32_t, 256>, 8>;
  static const Tables& tables() {
    static const Tables t = [] {
      Tables r{};
      constexpr uint32_t kReflected = 0x82F63B78u;  // 0x1EDC6F41 bit-reversed
      for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kReflected : c >> 1;
        r[0][i] = c;
      }
      for (uint32_t i = 0; i < 256; ++i)
        for (size_t k = 1; k < 8; ++k) r[k][i] = (r[k - 1][i] >> 8) ^ r[0][r[k - 1][i] & 0xFF];
      return r;
    }();
    return t;
  }
  static bool little_endian() {
    const uint16_t one = 1;
    unsigned char b;
    std::memcpy(&b, &one, 1);
    return b == 1;
  }
  static uint32_t swap(uint32_t v) {
    return (v >> 24) | ((v >> 8) & 0xFF00u) | ((v << 8) & 0xFF0000u) | (v << 24);
  }
  uint32_t crc_ = 0xFFFFFFFFu;
};

#if TETRA_CRC32C_BOOST
using Crc32cBoost = boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true>;
using Crc32c = Crc32cBoost;
#else
using Crc32c = Crc32cPortable;
#endif

inline uint32_t crc32c(const void* data, size_t size) {
  Crc32c crc;
  crc.process_bytes(data, size);
  return crc.checksum();
}

}  // namespace tetra::core
