// tokenizer.json decoders: ByteLevel, WordPiece, Metaspace, Replace (a string pattern),
// ByteFallback, Fuse, Strip, BPEDecoder and Sequence of them. Unlike the `tokenizers` library,
// bytes that are not valid UTF-8 are kept, not replaced by U+FFFD: decoding is byte-exact.
#include <cstring>

#include "models/byte_level.hpp"
#include "models/json_parse.hpp"
#include "models/tokenizer_parts.hpp"
#include "models/unicode.hpp"

namespace qkv::models::detail {
namespace {

std::string replace_all(const std::string& text, const std::string& pattern, const std::string& content) {
  if (pattern.empty()) return text;
  std::string out;
  size_t at = 0;
  for (size_t found; (found = text.find(pattern, at)) != std::string::npos; at = found + pattern.size()) {
    out.append(text, at, found - at);
    out += content;
  }
  out.append(text, at);
  return out;
}

// BERT's clean-up of the spaces WordPiece's join puts before punctuation and contractions.
std::string cleanup(std::string text) {
  static const std::pair<const char*, const char*> rules[] = {
      {" .", "."},     {" ?", "?"},     {" !", "!"},           {" ,", ","},      {" ' ", "'"},     {" n't", "n't"},
      {" 'm", "'m"}, {" do not", " don't"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : rules) text = replace_all(text, from, to);
  return text;
}

// The byte of a "<0xXX>" token.
std::optional<uint8_t> fallback_byte(const std::string& token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return std::nullopt;
  unsigned value = 0;
  for (int k = 3; k < 5; ++k) {
    const char c = token[static_cast<size_t>(k)];
    const int digit = (c >= '0' && c <= '9') ? c - '0' : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : -1;
    if (digit < 0) return std::nullopt;
    value = value * 16 + static_cast<unsigned>(digit);
  }
  return static_cast<uint8_t>(value);
}

using Tokens = std::vector<DecodedToken>;

Decoder per_token(std::function<void(DecodedToken&, size_t index)> rewrite) {
  return [rewrite = std::move(rewrite)](Tokens& tokens) {
    for (size_t i = 0; i < tokens.size(); ++i)
      if (!tokens[i].verbatim) rewrite(tokens[i], i);
  };
}

Decoder word_piece(const Json& spec, const std::string& where) {
  const std::string prefix = string_or(spec, "prefix", "##", where);
  const bool clean = bool_or(spec, "cleanup", true, where);
  return [prefix, clean](Tokens& tokens) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      DecodedToken& token = tokens[i];
      if (i > 0) {
        if (!token.verbatim && token.text.starts_with(prefix)) token.text.erase(0, prefix.size());
        else token.text = std::string(" ").append(token.text);
      }
      if (clean) token.text = cleanup(token.text);
    }
  };
}

Decoder metaspace(const Json& spec, const std::string& where) {
  const std::string replacement = string_or(spec, "replacement", "\u2581", where);
  std::string scheme = string_or(spec, "prepend_scheme", "", where);
  if (scheme.empty()) scheme = bool_or(spec, "add_prefix_space", true, where) ? "always" : "never";
  const bool strip_first = scheme != "never";
  return per_token([replacement, strip_first](DecodedToken& token, size_t i) {
    token.text = replace_all(token.text, replacement, " ");
    if (strip_first && i == 0 && token.text.starts_with(' ')) token.text.erase(0, 1);
  });
}

Decoder byte_fallback() {
  return [](Tokens& tokens) {
    Tokens out;
    bool in_bytes = false;
    for (DecodedToken& token : tokens) {
      const std::optional<uint8_t> byte = token.verbatim ? std::nullopt : fallback_byte(token.text);
      if (byte && in_bytes) {
        out.back().text += static_cast<char>(*byte);
      } else if (byte) {
        out.push_back({std::string(1, static_cast<char>(*byte)), false});
      } else {
        out.push_back(std::move(token));
      }
      in_bytes = byte.has_value();
    }
    tokens = std::move(out);
  };
}

Decoder strip(const Json& spec, const std::string& where) {
  const std::string content = string_or(spec, "content", " ", where);
  const auto count = [&](const char* key) {
    const auto it = spec.find(key);
    if (it == spec.end()) return uint64_t{0};
    if (!it->is_number_unsigned()) bad_field(where + "." + key, "expected a count, found " + brief(*it));
    return it->get<uint64_t>();
  };
  const uint64_t start = count("start"), stop = count("stop");
  return per_token([content, start, stop](DecodedToken& token, size_t) {
    if (content.empty()) return;
    for (uint64_t k = 0; k < start && token.text.starts_with(content); ++k) token.text.erase(0, content.size());
    for (uint64_t k = 0; k < stop && token.text.ends_with(content); ++k)
      token.text.erase(token.text.size() - content.size());
  });
}

}  // namespace

Decoder make_decoder(const Json& spec, const std::string& where) {
  if (spec.is_null()) {
    // The library's default: tokens joined by spaces.
    return [](Tokens& tokens) {
      for (size_t i = 1; i < tokens.size(); ++i) tokens[i].text = std::string(" ").append(tokens[i].text);
    };
  }
  const std::string type = string_or(spec, "type", "", where);
  if (type == "ByteLevel")
    return per_token([](DecodedToken& token, size_t) {
      if (std::optional<std::string> bytes = from_byte_level(token.text)) token.text = std::move(*bytes);
    });
  if (type == "WordPiece") return word_piece(spec, where);
  if (type == "Metaspace") return metaspace(spec, where);
  if (type == "ByteFallback") return byte_fallback();
  if (type == "Strip") return strip(spec, where);
  if (type == "Fuse")
    return [](Tokens& tokens) {
      DecodedToken fused;
      for (const DecodedToken& token : tokens) fused.text += token.text;
      tokens.assign(1, std::move(fused));
    };
  if (type == "Replace") {
    const Json& pattern = required(spec, "pattern", where);
    if (!pattern.is_object() || !pattern.contains("String") || !pattern["String"].is_string())
      bad_field(where + ".pattern", "qkv replaces string patterns only, found " + brief(pattern));
    const std::string from = pattern["String"].get<std::string>(), to = string_or(spec, "content", "", where);
    return per_token([from, to](DecodedToken& token, size_t) { token.text = replace_all(token.text, from, to); });
  }
  if (type == "BPEDecoder") {
    const std::string suffix = string_or(spec, "suffix", "</w>", where);
    return [suffix](Tokens& tokens) {
      for (size_t i = 0; i < tokens.size(); ++i)
        if (!tokens[i].verbatim)
          tokens[i].text = replace_all(tokens[i].text, suffix, i + 1 == tokens.size() ? "" : " ");
    };
  }
  if (type == "Sequence") {
    const Json& list = required(spec, "decoders", where);
    if (!list.is_array()) bad_field(where + ".decoders", "expected a list");
    std::vector<Decoder> steps;
    for (size_t i = 0; i < list.size(); ++i)
      steps.push_back(make_decoder(list[i], where + ".decoders[" + std::to_string(i) + "]"));
    return [steps](Tokens& tokens) {
      for (const Decoder& step : steps) step(tokens);
    };
  }
  bad_field(where, "qkv does not support the decoder type '" + type + "'");
}

}  // namespace qkv::models::detail
