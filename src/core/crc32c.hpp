// CRC-32C (Castagnoli polynomial, reflected 0x82F63B78, as iSCSI, ext4 and SSE4.2's crc32
// instruction): the checksum of the .qkv model file (src/train/model_file.cpp). Bytewise table version,
// ~0.5 GB/s: a model file's save or load is bound by the disk, not by this.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace qkv::detail {

// The 256-entry table, built at compile time.
constexpr std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}

// Continues a running CRC-32C over `n` more bytes: start from crc32c_update(0, ...), feed the
// result back for the next chunk. crc32c_update(0, "123456789", 9) == 0xE3069283.
inline uint32_t crc32c_update(uint32_t crc, const void* data, size_t n) {
  static constexpr std::array<uint32_t, 256> kTable = crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = kTable[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

}  // namespace qkv::detail
