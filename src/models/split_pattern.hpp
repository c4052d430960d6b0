// The pre-tokenizer regexes of byte-level BPE tokenizers, matched by hand. A pattern is read as
// its top-level alternatives, tried in order at each position (the first that matches wins, as
// in the regex engines the `tokenizers` library uses); each alternative must be one this file
// knows, such as GPT-2's
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// or those Llama 3 and Qwen2 add: (?i:'s|'t|...), [^\r\n\p{L}\p{N}]?\p{L}+, \p{N}{1,3}, \p{N},
// ?[^\s\p{L}\p{N}]+[\r\n]*, \s*[\r\n]+. Literal alternatives ('s) are matched as written.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "models/unicode.hpp"

namespace qkv::models::detail {

class SplitPattern {
 public:
  // Throws qkv::Error naming the first alternative it does not know.
  explicit SplitPattern(std::string_view regex);

  // The byte ranges [begin, end) of the matches in `text`, in order, non-overlapping. Text no
  // alternative matches lies between them.
  std::vector<std::pair<size_t, size_t>> matches(std::string_view text) const;

  // GPT-2's pattern, the one the ByteLevel pre-tokenizer applies with use_regex.
  static const SplitPattern& gpt2();

 private:
  // Units matched at units[at], 0 for none.
  using Matcher = std::function<size_t(const std::vector<Utf8Unit>& units, size_t at)>;
  std::vector<Matcher> alternatives_;
};

}  // namespace qkv::models::detail
