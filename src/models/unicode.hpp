// What the tokenizers need of Unicode: UTF-8 decoded leniently (a byte that starts no valid
// sequence is a unit of its own, so any bytes survive a round trip), the general categories
// and White_Space property the pre-tokenizers' patterns test, and normalization. Backed by ICU.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::models::detail {

// One unit of a UTF-8 string: a code point, or one byte that is not part of a valid sequence
// (then `valid` is false and `value` is the byte).
struct Utf8Unit {
  char32_t value = 0;
  uint32_t begin = 0;   // byte offset in the string
  uint32_t length = 0;  // bytes
  bool valid = true;
};

std::vector<Utf8Unit> utf8_units(std::string_view text);
// The unit that starts at text[at] (at < text.size()), without building the whole list.
Utf8Unit utf8_unit_at(std::string_view text, size_t at);
void append_utf8(std::string& out, char32_t code_point);

// Character classes; an invalid byte is in none of them (it is "other").
bool is_letter(const Utf8Unit& unit);       // \p{L}
bool is_number(const Utf8Unit& unit);       // \p{N}
bool is_whitespace(const Utf8Unit& unit);   // \s: the White_Space property
bool is_punctuation(const Utf8Unit& unit);  // \p{P}
bool is_control(char32_t c);                // \p{C}: Cc, Cf, Cs, Co, Cn
bool is_nonspacing_mark(char32_t c);        // Mn
bool is_cjk_ideograph(char32_t c);          // the CJK blocks BERT splits one character per word

// Unicode normalization forms of the valid runs of `text`; invalid bytes are kept as they are.
enum class NormalForm { NFC, NFD, NFKC, NFKD };
std::string normalize(std::string_view text, NormalForm form);
// The full lower-case mapping of one code point (it can be longer: U+0130 -> "i\u0307").
std::string lowercase(char32_t c);

}  // namespace qkv::models::detail
