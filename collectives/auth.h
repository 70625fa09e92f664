// What the job's own channels use to admit only the job's processes: SHA-256 (FIPS 180-4),
// HMAC-SHA256 (RFC 2104) over it, a comparison that takes the same time whatever bytes
// differ, and random bytes from the operating system's generator.
//
// Note [Job secret]
// Every process of a job holds one secret key. Rank 0 draws 32 bytes from getrandom(2) and
// gives them to the others in the world's first broadcast, over the channel the launcher
// set up (Open MPI's, or gloo's), before the monitor listens; or every process takes it
// from TETRA_JOB_SECRET (any text; torchrun's and Slurm's users can pass one), and then
// it never travels. A monitor connection proves that both ends hold the key by a challenge
// and response (Note [Monitor handshake], collectives/monitor_handshake.h); nothing else in
// tetra's own channels is believed before that. The construction is the standard one:
// no home-made cryptography beyond HMAC-SHA256, whose test vectors are FIPS's and
// RFC 4231's (tests/collectives/test_auth.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tetra::collectives {

using Digest = std::array<uint8_t, 32>;

Digest sha256(std::string_view data);
Digest hmac_sha256(std::string_view key, std::string_view message);

// Lowercase hex of bytes, and back (false on anything but 2n hex digits).
std::string to_hex(const uint8_t* data, size_t n);
inline std::string to_hex(const Digest& d) { return to_hex(d.data(), d.size()); }
bool from_hex(std::string_view hex, std::string& out);

// a == b in time that depends on their lengths only (a tag compared byte by byte with an
// early exit tells an attacker how many leading bytes it guessed).
bool equal_in_constant_time(std::string_view a, std::string_view b);

// n bytes from getrandom(2); a CommError when the kernel has none to give.
std::string random_bytes(size_t n);

}  // namespace tetra::collectives
