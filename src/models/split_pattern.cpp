#include "models/split_pattern.hpp"

#include <unicode/uchar.h>

#include <map>

#include "qkv/error.hpp"

namespace qkv::models::detail {
namespace {

using Units = std::vector<Utf8Unit>;

bool is_space_char(const Utf8Unit& u) { return u.valid && u.value == U' '; }
bool is_newline(const Utf8Unit& u) { return u.valid && (u.value == U'\r' || u.value == U'\n'); }
// [^\s\p{L}\p{N}]: anything else, invalid bytes included.
bool is_other(const Utf8Unit& u) { return !is_whitespace(u) && !is_letter(u) && !is_number(u); }

template <typename Class>
size_t run(const Units& u, size_t at, Class in_class, size_t most = SIZE_MAX) {
  size_t n = 0;
  while (at + n < u.size() && n < most && in_class(u[at + n])) ++n;
  return n;
}

// ` ?X+`: an optional space, then one or more of class X.
template <typename Class>
size_t optional_space_then_run(const Units& u, size_t at, Class in_class) {
  if (at < u.size() && is_space_char(u[at])) {
    if (const size_t n = run(u, at + 1, in_class)) return 1 + n;
  }
  return run(u, at, in_class);
}

// `\s+(?!\S)`: whitespace not followed by a non-space; backtracking leaves the run's last unit
// to the next match when something other than whitespace follows.
size_t spaces_not_before_text(const Units& u, size_t at) {
  const size_t n = run(u, at, is_whitespace);
  if (n == 0 || at + n == u.size()) return n;
  return n - 1;  // u[at + n] is not whitespace: give it one unit (0 when the run is one)
}

// `[^\r\n\p{L}\p{N}]?\p{L}+`
size_t letters_after_one_other(const Units& u, size_t at) {
  if (at < u.size() && !is_newline(u[at]) && !is_letter(u[at]) && !is_number(u[at])) {
    if (const size_t n = run(u, at + 1, is_letter)) return 1 + n;
  }
  return run(u, at, is_letter);
}

// ` ?[^\s\p{L}\p{N}]+[\r\n]*`
size_t others_then_newlines(const Units& u, size_t at) {
  const size_t n = optional_space_then_run(u, at, is_other);
  if (n == 0) return 0;
  return n + run(u, at + n, is_newline);
}

// `\s*[\r\n]+`: the whitespace run up to and including its last \r or \n.
size_t spaces_through_last_newline(const Units& u, size_t at) {
  const size_t n = run(u, at, is_whitespace);
  for (size_t k = n; k > 0; --k)
    if (is_newline(u[at + k - 1])) return k;
  return 0;
}

size_t literal(const Units& u, size_t at, const std::u32string& text, bool ignore_case) {
  if (at + text.size() > u.size()) return 0;
  for (size_t k = 0; k < text.size(); ++k) {
    const Utf8Unit& unit = u[at + k];
    if (!unit.valid) return 0;
    const bool same = ignore_case ? u_foldCase(static_cast<UChar32>(unit.value), U_FOLD_CASE_DEFAULT) ==
                                        u_foldCase(static_cast<UChar32>(text[k]), U_FOLD_CASE_DEFAULT)
                                  : unit.value == text[k];
    if (!same) return 0;
  }
  return text.size();
}

// The top-level alternatives of `regex` ('|' outside parentheses and brackets).
std::vector<std::string> alternatives(std::string_view regex) {
  std::vector<std::string> parts(1);
  int depth = 0;
  bool in_brackets = false;
  for (size_t i = 0; i < regex.size(); ++i) {
    const char c = regex[i];
    if (c == '\\' && i + 1 < regex.size()) {
      parts.back() += regex.substr(i, 2);
      ++i;
      continue;
    }
    if (in_brackets) {
      in_brackets = c != ']';
    } else if (c == '[') {
      in_brackets = true;
    } else if (c == '(') {
      ++depth;
    } else if (c == ')') {
      --depth;
    } else if (c == '|' && depth == 0) {
      parts.emplace_back();
      continue;
    }
    parts.back() += c;
  }
  return parts;
}

// A literal alternative: no regex syntax at all ("'s"); its code points, or empty.
std::u32string plain_literal(std::string_view text) {
  if (text.empty() || text.find_first_of("\\[](){}|?*+.^$") != std::string_view::npos) return {};
  std::u32string out;
  for (const Utf8Unit& unit : utf8_units(text)) {
    if (!unit.valid) return {};
    out += unit.value;
  }
  return out;
}

}  // namespace

SplitPattern::SplitPattern(std::string_view regex) {
  static const std::map<std::string, Matcher, std::less<>> known = {
      {R"( ?\p{L}+)", [](const Units& u, size_t at) { return optional_space_then_run(u, at, is_letter); }},
      {R"( ?\p{N}+)", [](const Units& u, size_t at) { return optional_space_then_run(u, at, is_number); }},
      {R"( ?[^\s\p{L}\p{N}]+)", [](const Units& u, size_t at) { return optional_space_then_run(u, at, is_other); }},
      {R"(\s+(?!\S))", spaces_not_before_text},
      {R"(\s+)", [](const Units& u, size_t at) { return run(u, at, is_whitespace); }},
      {R"([^\r\n\p{L}\p{N}]?\p{L}+)", letters_after_one_other},
      {R"(\p{N}{1,3})", [](const Units& u, size_t at) { return run(u, at, is_number, 3); }},
      {R"(\p{N})", [](const Units& u, size_t at) { return run(u, at, is_number, 1); }},
      {R"(\p{N}+)", [](const Units& u, size_t at) { return run(u, at, is_number); }},
      {R"( ?[^\s\p{L}\p{N}]+[\r\n]*)", others_then_newlines},
      {R"(\s*[\r\n]+)", spaces_through_last_newline},
  };
  for (const std::string& alternative : alternatives(regex)) {
    if (const auto it = known.find(alternative); it != known.end()) {
      alternatives_.push_back(it->second);
      continue;
    }
    if (const std::u32string text = plain_literal(alternative); !text.empty()) {
      alternatives_.push_back([text](const Units& u, size_t at) { return literal(u, at, text, false); });
      continue;
    }
    // (?i:'s|'t|...): literals matched without regard to case.
    constexpr std::string_view kCaseless = "(?i:";
    if (alternative.starts_with(kCaseless) && alternative.ends_with(")")) {
      const std::string inner = alternative.substr(kCaseless.size(), alternative.size() - kCaseless.size() - 1);
      std::vector<std::u32string> texts;
      for (const std::string& part : alternatives(inner)) {
        texts.push_back(plain_literal(part));
        if (texts.back().empty()) texts.clear();
        if (texts.empty()) break;
      }
      if (!texts.empty()) {
        for (std::u32string& text : texts)
          alternatives_.push_back([text](const Units& u, size_t at) { return literal(u, at, text, true); });
        continue;
      }
    }
    throw Error("pre-tokenizer pattern '" + std::string(regex) + "': qkv does not know the alternative '" +
                alternative + "'");
  }
}

std::vector<std::pair<size_t, size_t>> SplitPattern::matches(std::string_view text) const {
  const Units units = utf8_units(text);
  std::vector<std::pair<size_t, size_t>> found;
  const auto byte_at = [&](size_t unit) { return unit < units.size() ? units[unit].begin : text.size(); };
  for (size_t at = 0; at < units.size();) {
    size_t n = 0;
    for (const Matcher& alternative : alternatives_) {
      if ((n = alternative(units, at)) > 0) break;
    }
    if (n == 0) {
      ++at;
      continue;
    }
    found.emplace_back(byte_at(at), byte_at(at + n));
    at += n;
  }
  return found;
}

const SplitPattern& SplitPattern::gpt2() {
  static const SplitPattern pattern(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)");
  return pattern;
}

}  // namespace qkv::models::detail
