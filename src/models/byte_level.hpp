// GPT-2's byte-level alphabet: every byte as a printable code point, so that BPE runs over any
// bytes and its tokens are printable strings ("Ġ" is the space byte, "Ċ" the newline).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace qkv::models::detail {

// The code point that stands for `byte`: itself for the printable Latin-1 bytes ('!'..'~',
// U+00A1..U+00AC, U+00AE..U+00FF), U+0100 + k for the k-th of the others, in byte order.
char32_t byte_to_char(uint8_t byte);
// The byte a code point stands for, if it is one of the 256.
std::optional<uint8_t> char_to_byte(char32_t c);
// `bytes` spelt in the alphabet (UTF-8).
std::string to_byte_level(std::string_view bytes);
// The bytes a token spells, or nothing when a character of it is outside the alphabet.
std::optional<std::string> from_byte_level(std::string_view token);

}  // namespace qkv::models::detail
