#include "models/unicode.hpp"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/ustring.h>

#include <cstdint>

#include "qkv/error.hpp"

namespace qkv::models::detail {
namespace {

// The length of the valid UTF-8 sequence at text[i], or 0 (overlong forms, surrogates and code
// points past U+10FFFF are invalid, as the standard says).
uint32_t valid_sequence(std::string_view text, size_t i, char32_t& out) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(text[k]); };
  const uint8_t lead = byte(i);
  uint32_t length;
  char32_t value;
  if (lead < 0x80) {
    out = lead;
    return 1;
  } else if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2, value = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3, value = lead & 0x0F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4, value = lead & 0x07;
  } else {
    return 0;
  }
  if (i + length > text.size()) return 0;
  for (uint32_t k = 1; k < length; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    value = (value << 6) | (byte(i + k) & 0x3F);
  }
  const bool overlong = (length == 3 && value < 0x800) || (length == 4 && value < 0x10000);
  if (overlong || (value >= 0xD800 && value <= 0xDFFF) || value > 0x10FFFF) return 0;
  out = value;
  return length;
}

int8_t category(const Utf8Unit& unit) { return unit.valid ? u_charType(static_cast<UChar32>(unit.value)) : -1; }

const icu::Normalizer2& normalizer(NormalForm form) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  switch (form) {
    case NormalForm::NFC: n = icu::Normalizer2::getNFCInstance(status); break;
    case NormalForm::NFD: n = icu::Normalizer2::getNFDInstance(status); break;
    case NormalForm::NFKC: n = icu::Normalizer2::getNFKCInstance(status); break;
    case NormalForm::NFKD: n = icu::Normalizer2::getNFKDInstance(status); break;
  }
  if (U_FAILURE(status) || n == nullptr) throw Error(std::string("ICU normalizer unavailable: ") + u_errorName(status));
  return *n;
}

std::string normalize_valid(std::string_view run, const icu::Normalizer2& n) {
  UErrorCode status = U_ZERO_ERROR;
  const icu::UnicodeString source =
      icu::UnicodeString::fromUTF8(icu::StringPiece(run.data(), static_cast<int32_t>(run.size())));
  const icu::UnicodeString result = n.normalize(source, status);
  if (U_FAILURE(status)) throw Error(std::string("Unicode normalization failed: ") + u_errorName(status));
  std::string out;
  result.toUTF8String(out);
  return out;
}

}  // namespace

Utf8Unit utf8_unit_at(std::string_view text, size_t at) {
  char32_t value = 0;
  const uint32_t length = valid_sequence(text, at, value);
  if (length == 0) return {static_cast<uint8_t>(text[at]), static_cast<uint32_t>(at), 1, false};
  return {value, static_cast<uint32_t>(at), length, true};
}

std::vector<Utf8Unit> utf8_units(std::string_view text) {
  if (text.size() > UINT32_MAX) throw Error("qkv tokenizes at most 4 GiB of text at once");
  std::vector<Utf8Unit> units;
  units.reserve(text.size());
  for (size_t i = 0; i < text.size(); i += units.back().length) units.push_back(utf8_unit_at(text, i));
  return units;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

bool is_letter(const Utf8Unit& unit) {
  switch (category(unit)) {
    case U_UPPERCASE_LETTER: case U_LOWERCASE_LETTER: case U_TITLECASE_LETTER: case U_MODIFIER_LETTER:
    case U_OTHER_LETTER: return true;
    default: return false;
  }
}

bool is_number(const Utf8Unit& unit) {
  switch (category(unit)) {
    case U_DECIMAL_DIGIT_NUMBER: case U_LETTER_NUMBER: case U_OTHER_NUMBER: return true;
    default: return false;
  }
}

bool is_whitespace(const Utf8Unit& unit) { return unit.valid && u_isUWhiteSpace(static_cast<UChar32>(unit.value)); }

bool is_punctuation(const Utf8Unit& unit) {
  switch (category(unit)) {
    case U_CONNECTOR_PUNCTUATION: case U_DASH_PUNCTUATION: case U_START_PUNCTUATION: case U_END_PUNCTUATION:
    case U_INITIAL_PUNCTUATION: case U_FINAL_PUNCTUATION: case U_OTHER_PUNCTUATION: return true;
    default: return false;
  }
}

bool is_control(char32_t c) {
  switch (u_charType(static_cast<UChar32>(c))) {
    case U_CONTROL_CHAR: case U_FORMAT_CHAR: case U_SURROGATE: case U_PRIVATE_USE_CHAR: case U_UNASSIGNED: return true;
    default: return false;
  }
}

bool is_nonspacing_mark(char32_t c) { return u_charType(static_cast<UChar32>(c)) == U_NON_SPACING_MARK; }

bool is_cjk_ideograph(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B820 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

std::string normalize(std::string_view text, NormalForm form) {
  const icu::Normalizer2& n = normalizer(form);
  std::string out;
  size_t run_begin = 0, i = 0;
  for (const Utf8Unit& unit : utf8_units(text)) {
    i = unit.begin;
    if (!unit.valid) {
      out += normalize_valid(text.substr(run_begin, i - run_begin), n);
      out += text[i];
      run_begin = i + 1;
    }
  }
  out += normalize_valid(text.substr(run_begin), n);
  return out;
}

std::string lowercase(char32_t c) {
  UChar source[2];
  int32_t length = 0;
  U16_APPEND_UNSAFE(source, length, static_cast<UChar32>(c));
  UChar lowered[16];
  UErrorCode status = U_ZERO_ERROR;
  const int32_t n = u_strToLower(lowered, 16, source, length, "", &status);
  std::string out;
  if (U_FAILURE(status)) {
    append_utf8(out, c);
    return out;
  }
  icu::UnicodeString(lowered, n).toUTF8String(out);
  return out;
}

}  // namespace qkv::models::detail
