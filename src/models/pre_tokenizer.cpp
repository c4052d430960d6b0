// tokenizer.json pre-tokenizers: ByteLevel, Split (string patterns, and the regexes
// split_pattern.hpp knows), Digits, Metaspace, BertPreTokenizer, WhitespaceSplit, Punctuation
// and Sequence of them.
#include <memory>

#include "models/byte_level.hpp"
#include "models/split_pattern.hpp"
#include "models/json_parse.hpp"
#include "models/tokenizer_parts.hpp"
#include "models/unicode.hpp"
#include "qkv/error.hpp"

namespace qkv::models::detail {
namespace {

// A piece's bytes [begin, end) and whether a pattern matched them.
struct Span {
  size_t begin, end;
  bool match;
};

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior behavior_of(const Json& spec, const std::string& where, Behavior fallback) {
  const std::string name = string_or(spec, "behavior", "", where);
  if (name.empty()) return fallback;
  if (name == "Removed") return Behavior::Removed;
  if (name == "Isolated") return Behavior::Isolated;
  if (name == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::MergedWithNext;
  if (name == "Contiguous") return Behavior::Contiguous;
  bad_field(where + ".behavior", "unknown split behavior '" + name + "'");
}

// The spans of `text`: the matches and the text between them.
std::vector<Span> spans_of(std::string_view text, const std::vector<std::pair<size_t, size_t>>& matches, bool invert) {
  std::vector<Span> spans;
  size_t at = 0;
  for (const auto& [begin, end] : matches) {
    if (begin > at) spans.push_back({at, begin, invert});
    spans.push_back({begin, end, !invert});
    at = end;
  }
  if (at < text.size()) spans.push_back({at, text.size(), invert});
  return spans;
}

// The pieces `spans` make under `behavior`, appended to `out`, as the `tokenizers` library
// makes them: a match merges with the span before (MergedWithPrevious) or after
// (MergedWithNext) only when that span is not a match itself; Contiguous joins runs of matches.
void split_spans(std::string_view text, const std::vector<Span>& spans, Behavior behavior, std::vector<std::string>& out) {
  const auto bytes = [&](const Span& span) { return std::string(text.substr(span.begin, span.end - span.begin)); };
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& span = spans[i];
    const bool previous_match = i > 0 && spans[i - 1].match;
    if (!span.match) {
      const bool after_merging_match = behavior == Behavior::MergedWithNext && previous_match;
      if (after_merging_match) out.back() += bytes(span); else out.push_back(bytes(span));
      continue;
    }
    switch (behavior) {
      case Behavior::Removed: break;
      case Behavior::Isolated: out.push_back(bytes(span)); break;
      case Behavior::MergedWithPrevious:
        if (i > 0 && !previous_match) out.back() += bytes(span); else out.push_back(bytes(span));
        break;
      case Behavior::MergedWithNext: out.push_back(bytes(span)); break;  // the next non-match joins it
      case Behavior::Contiguous:
        if (previous_match) out.back() += bytes(span); else out.push_back(bytes(span));
        break;
    }
  }
}

using Matches = std::function<std::vector<std::pair<size_t, size_t>>(std::string_view)>;

PreTokenizer splitter(Matches matches, Behavior behavior, bool invert) {
  return [matches = std::move(matches), behavior, invert](std::vector<std::string>& pieces, bool) {
    std::vector<std::string> out;
    for (const std::string& piece : pieces) split_spans(piece, spans_of(piece, matches(piece), invert), behavior, out);
    pieces = std::move(out);
  };
}

// Matches of the units for which `in_class` holds: each alone, or in runs.
template <typename Class>
Matches class_matches(Class in_class, bool runs) {
  return [in_class, runs](std::string_view text) {
    std::vector<std::pair<size_t, size_t>> found;
    bool extending = false;
    for (const Utf8Unit& unit : utf8_units(text)) {
      if (!in_class(unit)) {
        extending = false;
        continue;
      }
      if (extending) found.back().second = unit.begin + unit.length;
      else found.emplace_back(unit.begin, unit.begin + unit.length);
      extending = runs;
    }
    return found;
  };
}

Matches string_matches(std::string pattern) {
  return [pattern = std::move(pattern)](std::string_view text) {
    std::vector<std::pair<size_t, size_t>> found;
    if (pattern.empty()) return found;
    for (size_t at = text.find(pattern); at != std::string_view::npos; at = text.find(pattern, at + pattern.size()))
      found.emplace_back(at, at + pattern.size());
    return found;
  };
}

// BERT's punctuation: ASCII punctuation (symbols such as $ + < included) and Unicode's P*.
bool is_bert_punctuation(const Utf8Unit& unit) {
  const char32_t c = unit.value;
  const bool ascii = (c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) || (c >= 123 && c <= 126);
  return unit.valid && (ascii || is_punctuation(unit));
}

PreTokenizer byte_level(const Json& spec, const std::string& where) {
  const bool prefix_space = bool_or(spec, "add_prefix_space", true, where);
  const bool use_regex = bool_or(spec, "use_regex", true, where);
  return [prefix_space, use_regex](std::vector<std::string>& pieces, bool) {
    std::vector<std::string> out;
    for (std::string& piece : pieces) {
      if (prefix_space && !piece.starts_with(' ')) piece.insert(piece.begin(), ' ');
      if (!use_regex) {
        out.push_back(to_byte_level(piece));
        continue;
      }
      std::vector<std::string> split;
      split_spans(piece, spans_of(piece, SplitPattern::gpt2().matches(piece), false), Behavior::Isolated, split);
      for (const std::string& part : split) out.push_back(to_byte_level(part));
    }
    pieces = std::move(out);
  };
}

PreTokenizer metaspace(const Json& spec, const std::string& where) {
  const std::string replacement = string_or(spec, "replacement", "\u2581", where);
  // prepend_scheme: "always", "first" or "never"; older files say add_prefix_space instead.
  std::string scheme = string_or(spec, "prepend_scheme", "", where);
  if (scheme.empty()) scheme = bool_or(spec, "add_prefix_space", true, where) ? "always" : "never";
  if (scheme != "always" && scheme != "first" && scheme != "never")
    bad_field(where + ".prepend_scheme", "expected always, first or never, found '" + scheme + "'");
  const bool split = bool_or(spec, "split", true, where);
  const Matches at_replacement = string_matches(replacement);
  return [=](std::vector<std::string>& pieces, bool first_segment) {
    std::vector<std::string> out;
    for (size_t i = 0; i < pieces.size(); ++i) {
      std::string text;
      for (const char c : pieces[i]) {
        if (c == ' ') text += replacement; else text += c;
      }
      const bool prepend = scheme == "always" || (scheme == "first" && first_segment && i == 0);
      if (prepend && !text.starts_with(replacement)) text = replacement + text;
      if (split) split_spans(text, spans_of(text, at_replacement(text), false), Behavior::MergedWithNext, out);
      else out.push_back(std::move(text));
    }
    pieces = std::move(out);
  };
}

PreTokenizer split(const Json& spec, const std::string& where) {
  const Json& pattern = required(spec, "pattern", where);
  const Behavior behavior = behavior_of(spec, where, Behavior::Isolated);
  const bool invert = bool_or(spec, "invert", false, where);
  if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string())
    return splitter(string_matches(pattern["String"].get<std::string>()), behavior, invert);
  if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
    std::shared_ptr<SplitPattern> compiled;
    try {
      compiled = std::make_shared<SplitPattern>(pattern["Regex"].get<std::string>());
    } catch (const Error& e) {
      bad_field(where + ".pattern", e.what());
    }
    return splitter([compiled](std::string_view text) { return compiled->matches(text); }, behavior, invert);
  }
  bad_field(where + ".pattern", "expected {\"String\": ...} or {\"Regex\": ...}, found " + brief(pattern));
}

}  // namespace

PreTokenizer make_pre_tokenizer(const Json& spec, const std::string& where) {
  if (spec.is_null()) return [](std::vector<std::string>&, bool) {};
  const std::string type = string_or(spec, "type", "", where);
  if (type == "ByteLevel") return byte_level(spec, where);
  if (type == "Metaspace") return metaspace(spec, where);
  if (type == "Split") return split(spec, where);
  if (type == "Digits") {
    const bool individual = bool_or(spec, "individual_digits", false, where);
    return splitter(class_matches(is_number, !individual), Behavior::Isolated, false);
  }
  if (type == "BertPreTokenizer") {
    const PreTokenizer on_spaces = splitter(class_matches(is_whitespace, true), Behavior::Removed, false);
    const PreTokenizer on_punctuation = splitter(class_matches(is_bert_punctuation, false), Behavior::Isolated, false);
    return [=](std::vector<std::string>& pieces, bool first) {
      on_spaces(pieces, first);
      on_punctuation(pieces, first);
    };
  }
  if (type == "WhitespaceSplit") return splitter(class_matches(is_whitespace, true), Behavior::Removed, false);
  if (type == "Punctuation")
    return splitter(class_matches(is_bert_punctuation, false), behavior_of(spec, where, Behavior::Isolated), false);
  if (type == "Sequence") {
    const Json& list = required(spec, "pretokenizers", where);
    if (!list.is_array()) bad_field(where + ".pretokenizers", "expected a list");
    std::vector<PreTokenizer> steps;
    for (size_t i = 0; i < list.size(); ++i)
      steps.push_back(make_pre_tokenizer(list[i], where + ".pretokenizers[" + std::to_string(i) + "]"));
    return [steps](std::vector<std::string>& pieces, bool first) {
      for (const PreTokenizer& step : steps) step(pieces, first);
    };
  }
  bad_field(where, "qkv does not support the pre-tokenizer type '" + type + "'");
}

}  // namespace qkv::models::detail
