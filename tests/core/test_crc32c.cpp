// CRC-32C: tetra's own table (Crc32cPortable) against RFC 3720's vectors and, where the
// build has Boost's headers, against Boost's crc_optimal, the checksum of every checkpoint
// written so far (Note [Two CRC-32Cs] in core/crc32c.h): the two must agree on every input.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/crc32c.h"

using tetra::core::Crc32c;
using tetra::core::Crc32cPortable;

namespace {

template <typename Crc>
uint32_t crc_of(const std::string& bytes) {
  Crc c;
  c.process_bytes(bytes.data(), bytes.size());
  return c.checksum();
}

// The same bytes fed in pieces of the given sizes (the last takes the rest).
template <typename Crc>
uint32_t crc_in_pieces(const std::string& bytes, const std::vector<size_t>& pieces) {
  Crc c;
  size_t at = 0;
  for (size_t n : pieces) {
    n = std::min(n, bytes.size() - at);
    c.process_bytes(bytes.data() + at, n);
    at += n;
  }
  c.process_bytes(bytes.data() + at, bytes.size() - at);
  return c.checksum();
}

struct Vector {
  const char* name;
  std::string bytes;
  uint32_t crc;
};

// RFC 3720 (iSCSI), appendix B.4, and the check value of the catalogue of CRCs; a
// checkpoint's meta.json is checksummed the same way (Note [Checkpoint checksums]), so
// one such document, with the CRC the writer stores for it, is here too.
std::vector<Vector> known_vectors() {
  std::string inc(32, '\0'), dec(32, '\0');
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<char>(i);
    dec[i] = static_cast<char>(31 - i);
  }
  return {
      {"empty", "", 0x00000000u},
      {"123456789", "123456789", 0xE3069283u},
      {"32 zeros", std::string(32, '\0'), 0x8A9136AAu},
      {"32 x 0xff", std::string(32, '\xff'), 0x62A8AB43u},
      {"0..31", inc, 0x46DD794Eu},
      {"31..0", dec, 0x113FDB5Cu},
  };
}

std::string random_bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(gen() & 0xFF);
  return s;
}

}  // namespace

TEST(Crc32c, PortableMeetsTheKnownVectors) {
  for (const Vector& v : known_vectors()) EXPECT_EQ(crc_of<Crc32cPortable>(v.bytes), v.crc) << v.name;
}

TEST(Crc32c, TheBuildsCrcMeetsTheKnownVectors) {
  for (const Vector& v : known_vectors()) {
    EXPECT_EQ(crc_of<Crc32c>(v.bytes), v.crc) << v.name;
    EXPECT_EQ(tetra::core::crc32c(v.bytes.data(), v.bytes.size()), v.crc) << v.name;
  }
}

TEST(Crc32c, PiecesGiveTheWholesCrc) {
  // Pieces across the eight-byte rounds and the tail, at every alignment.
  const std::string bytes = random_bytes(1000, 7);
  const uint32_t whole = crc_of<Crc32cPortable>(bytes);
  for (size_t first = 0; first < 17; ++first)
    EXPECT_EQ(crc_in_pieces<Crc32cPortable>(bytes, {first, 1, 7, 8, 9, 63, 3}), whole) << first;
  Crc32cPortable c;
  c.process_bytes("1234", 4);
  c.reset();
  c.process_bytes("123456789", 9);
  EXPECT_EQ(c.checksum(), 0xE3069283u);
}

TEST(Crc32c, PortableAgreesWithBoost) {
#if TETRA_CRC32C_BOOST
  for (const Vector& v : known_vectors()) EXPECT_EQ(crc_of<Crc32cPortable>(v.bytes), crc_of<tetra::core::Crc32cBoost>(v.bytes)) << v.name;
  // A meta.json as the checkpoint writer leaves it, and random data of every length
  // around the eight-byte rounds and of a few MB (a shard's worth of rounds).
  const std::string meta =
      R"({"checksums":{"rank-00000.safetensors":{"bytes":4096,"crc32c":"0x1a2b3c4d"}},"format":2,"step":7})";
  EXPECT_EQ(crc_of<Crc32cPortable>(meta), crc_of<tetra::core::Crc32cBoost>(meta));
  for (size_t n = 0; n < 70; ++n) {
    const std::string b = random_bytes(n, static_cast<uint32_t>(n));
    EXPECT_EQ(crc_of<Crc32cPortable>(b), crc_of<tetra::core::Crc32cBoost>(b)) << n << " bytes";
  }
  const std::string big = random_bytes(size_t{3} << 20, 11);
  EXPECT_EQ(crc_of<Crc32cPortable>(big), crc_of<tetra::core::Crc32cBoost>(big));
  EXPECT_EQ(crc_in_pieces<Crc32cPortable>(big, {12345, 1, 65536, 7}), crc_of<tetra::core::Crc32cBoost>(big));
#else
  GTEST_SKIP() << "built without Boost's headers (TETRA_CRC32C_BOOST=0): tetra's own CRC-32C alone, "
                  "held to the known vectors above";
#endif
}
