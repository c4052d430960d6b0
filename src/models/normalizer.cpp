// tokenizer.json normalizers: NFC/NFD/NFKC/NFKD, Lowercase, StripAccents, Prepend, Replace (a
// string pattern), Strip, BertNormalizer and Sequence of them.
#include "models/json_parse.hpp"
#include "models/tokenizer_parts.hpp"
#include "models/unicode.hpp"

namespace qkv::models::detail {
namespace {

std::string lowercased(std::string_view text) {
  std::string out;
  for (const Utf8Unit& unit : utf8_units(text)) {
    if (unit.valid)
      out += lowercase(unit.value);
    else
      out += text[unit.begin];
  }
  return out;
}

// NFD, then without its non-spacing marks (the accents NFD separated from their letters).
std::string strip_accents(std::string_view text) {
  const std::string decomposed = normalize(text, NormalForm::NFD);
  std::string out;
  for (const Utf8Unit& unit : utf8_units(decomposed)) {
    if (unit.valid && is_nonspacing_mark(unit.value)) continue;
    out.append(decomposed, unit.begin, unit.length);
  }
  return out;
}

std::string replace_all(std::string_view text, const std::string& pattern, const std::string& content) {
  if (pattern.empty()) return std::string(text);
  std::string out;
  size_t at = 0;
  for (size_t found; (found = text.find(pattern, at)) != std::string_view::npos; at = found + pattern.size()) {
    out.append(text.substr(at, found - at));
    out += content;
  }
  out.append(text.substr(at));
  return out;
}

// BERT's: control characters dropped and whitespace made spaces (clean_text), CJK ideographs
// spaced apart, accents stripped, lower-cased.
Normalizer bert_normalizer(const Json& spec, const std::string& where) {
  const bool clean_text = bool_or(spec, "clean_text", true, where);
  const bool chinese = bool_or(spec, "handle_chinese_chars", true, where);
  const bool lower = bool_or(spec, "lowercase", true, where);
  // strip_accents null follows lowercase, as in BERT's original tokenizer.
  const bool strip = bool_or(spec, "strip_accents", lower, where);
  return [=](std::string_view text) {
    std::string out;
    for (const Utf8Unit& unit : utf8_units(text)) {
      const char32_t c = unit.value;
      if (!unit.valid) {
        if (!clean_text) out += text[unit.begin];  // clean_text drops what is not a character
        continue;
      }
      if (clean_text) {
        if (c == 0 || c == 0xFFFD || (c != U'\t' && c != U'\n' && c != U'\r' && is_control(c))) continue;
        if (c == U'\t' || c == U'\n' || c == U'\r' || is_whitespace(unit)) {
          out += ' ';
          continue;
        }
      }
      if (chinese && is_cjk_ideograph(c)) {
        out += ' ';
        append_utf8(out, c);
        out += ' ';
        continue;
      }
      append_utf8(out, c);
    }
    if (strip) out = strip_accents(out);
    if (lower) out = lowercased(out);
    return out;
  };
}

}  // namespace

Normalizer make_normalizer(const Json& spec, const std::string& where) {
  if (spec.is_null()) return [](std::string_view text) { return std::string(text); };
  const std::string type = string_or(spec, "type", "", where);
  if (type == "NFC") return [](std::string_view t) { return normalize(t, NormalForm::NFC); };
  if (type == "NFD") return [](std::string_view t) { return normalize(t, NormalForm::NFD); };
  if (type == "NFKC") return [](std::string_view t) { return normalize(t, NormalForm::NFKC); };
  if (type == "NFKD") return [](std::string_view t) { return normalize(t, NormalForm::NFKD); };
  if (type == "Lowercase") return [](std::string_view t) { return lowercased(t); };
  if (type == "StripAccents") return [](std::string_view t) { return strip_accents(t); };
  if (type == "BertNormalizer") return bert_normalizer(spec, where);
  if (type == "Prepend") {
    const std::string prefix = string_or(spec, "prepend", "", where);
    return [prefix](std::string_view t) { return t.empty() ? std::string() : prefix + std::string(t); };
  }
  if (type == "Replace") {
    const Json& pattern = required(spec, "pattern", where);
    if (!pattern.is_object() || !pattern.contains("String") || !pattern["String"].is_string())
      bad_field(where + ".pattern", "qkv replaces string patterns only, found " + brief(pattern));
    const std::string from = pattern["String"].get<std::string>();
    const std::string to = string_or(spec, "content", "", where);
    return [from, to](std::string_view t) { return replace_all(t, from, to); };
  }
  if (type == "Strip") {
    const bool left = bool_or(spec, "strip_left", true, where), right = bool_or(spec, "strip_right", true, where);
    return [left, right](std::string_view t) {
      const std::vector<Utf8Unit> units = utf8_units(t);
      size_t first = 0, last = units.size();
      while (left && first < last && is_whitespace(units[first])) ++first;
      while (right && last > first && is_whitespace(units[last - 1])) --last;
      if (first == last) return std::string();
      return std::string(t.substr(units[first].begin, units[last - 1].begin + units[last - 1].length - units[first].begin));
    };
  }
  if (type == "Sequence") {
    const Json& list = required(spec, "normalizers", where);
    if (!list.is_array()) bad_field(where + ".normalizers", "expected a list");
    std::vector<Normalizer> steps;
    for (size_t i = 0; i < list.size(); ++i)
      steps.push_back(make_normalizer(list[i], where + ".normalizers[" + std::to_string(i) + "]"));
    return [steps](std::string_view t) {
      std::string text(t);
      for (const Normalizer& step : steps) text = step(text);
      return text;
    };
  }
  bad_field(where, "qkv does not support the normalizer type '" + type + "'");
}

}  // namespace qkv::models::detail
