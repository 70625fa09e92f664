// CRC-32C (Castagnoli), as checkpoint files (Note [Checkpoint checksums]) and TensorBoard's
// record framing (Note [Event files]) use it: Boost's crc_optimal with the Castagnoli
// polynomial, reflected, initial value and final XOR all ones.
#pragma once

#include <boost/crc.hpp>

#include <cstddef>
#include <cstdint>

namespace tetra::core {

using Crc32c = boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true>;

inline uint32_t crc32c(const void* data, size_t size) {
  Crc32c crc;
  crc.process_bytes(data, size);
  return crc.checksum();
}

}  // namespace tetra::core
