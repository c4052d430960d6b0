#include "models/byte_level.hpp"

#include <array>

#include "models/unicode.hpp"

namespace qkv::models::detail {
namespace {

bool printable(int byte) { return (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE); }

// The 68 non-printable bytes take U+0100 .. U+0143.
constexpr char32_t kLastChar = 0x143;

struct Alphabet {
  std::array<char32_t, 256> chars{};
  std::array<int16_t, kLastChar + 1> bytes{};  // -1: no byte
  Alphabet() {
    bytes.fill(-1);
    char32_t next = 0x100;
    for (int byte = 0; byte < 256; ++byte) {
      chars[byte] = printable(byte) ? static_cast<char32_t>(byte) : next++;
      bytes[chars[byte]] = static_cast<int16_t>(byte);
    }
  }
};

const Alphabet& alphabet() {
  static const Alphabet table;
  return table;
}

}  // namespace

char32_t byte_to_char(uint8_t byte) { return alphabet().chars[byte]; }

std::optional<uint8_t> char_to_byte(char32_t c) {
  if (c > kLastChar || alphabet().bytes[c] < 0) return std::nullopt;
  return static_cast<uint8_t>(alphabet().bytes[c]);
}

std::string to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const char b : bytes) append_utf8(out, byte_to_char(static_cast<uint8_t>(b)));
  return out;
}

std::optional<std::string> from_byte_level(std::string_view token) {
  std::string out;
  for (size_t at = 0; at < token.size();) {
    const Utf8Unit unit = utf8_unit_at(token, at);
    at += unit.length;
    if (!unit.valid) return std::nullopt;
    const std::optional<uint8_t> byte = char_to_byte(unit.value);
    if (!byte) return std::nullopt;
    out += static_cast<char>(*byte);
  }
  return out;
}

}  // namespace qkv::models::detail
