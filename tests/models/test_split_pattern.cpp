// The byte-level pre-tokenizers' patterns, matched by hand: hand-worked splits of tricky text
// (contractions, digits, runs of spaces, newlines, letters of other scripts, invalid bytes).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model_test_support.hpp"
#include "models/split_pattern.hpp"

namespace qkv::models::detail {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const char* kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<std::string> pieces(const SplitPattern& pattern, std::string_view text) {
  std::vector<std::string> out;
  size_t at = 0;
  for (const auto& [begin, end] : pattern.matches(text)) {
    EXPECT_GE(begin, at) << "matches overlap or go backwards";
    if (begin > at) out.push_back("<gap:" + std::string(text.substr(at, begin - at)) + ">");
    out.emplace_back(text.substr(begin, end - begin));
    at = end;
  }
  if (at < text.size()) out.push_back("<gap:" + std::string(text.substr(at)) + ">");
  return out;
}

TEST(SplitPattern, Gpt2) {
  const SplitPattern& gpt2 = SplitPattern::gpt2();
  EXPECT_THAT(pieces(gpt2, "Hello world's 123  test\n\n"),
              ElementsAre("Hello", " world", "'s", " 123", " ", " test", "\n\n"));
  // Contractions are case-sensitive in GPT-2's pattern: 'S is punctuation then a letter.
  EXPECT_THAT(pieces(gpt2, "I'M he'll 'S"), ElementsAre("I", "'", "M", " he", "'ll", " '", "S"));
  // A run of spaces leaves its last one to the word after it, but only ' ' joins a word.
  EXPECT_THAT(pieces(gpt2, "a  \tb"), ElementsAre("a", "  ", "\t", "b"));
}

TEST(SplitPattern, Gpt2OtherScriptsAndBytes) {
  const SplitPattern& gpt2 = SplitPattern::gpt2();
  // CJK and accented letters are \p{L}; the emoji and the invalid bytes are neither L, N nor \s.
  EXPECT_THAT(pieces(gpt2, "日本語 café 🙂🙂 x\xff\xfe y"),
              ElementsAre("日本語", " café", " 🙂🙂", " x", "\xff\xfe", " y"));
  // Other numbers (superscripts, Roman numerals) are \p{N}.
  EXPECT_THAT(pieces(gpt2, "x² Ⅻ"), ElementsAre("x", "²", " Ⅻ"));
  // Unicode's spaces (U+3000) are \s, but never a word's leading space.
  EXPECT_THAT(pieces(gpt2, "a\u3000\u3000b"), ElementsAre("a", "\u3000", "\u3000", "b"));
}

TEST(SplitPattern, Llama3) {
  const SplitPattern llama3(kLlama3);
  EXPECT_THAT(pieces(llama3, "Hello WORLD'S 12345 x\r\n\r\n  y!!\n"),
              ElementsAre("Hello", " WORLD", "'S", " ", "123", "45", " x", "\r\n\r\n", " ", " y", "!!\n"));
  // One character that is not a letter, digit or newline may lead a word ("(hi", "$x"), but
  // then no space may come before it: " $x" is " $" and "x".
  EXPECT_THAT(pieces(llama3, "(hi) $x\n\nz"), ElementsAre("(hi", ")", " $", "x", "\n\n", "z"));
  EXPECT_THAT(pieces(llama3, "$x"), ElementsAre("$x"));
}

TEST(SplitPattern, Qwen2DigitsOneByOne) {
  const SplitPattern qwen2(kQwen2);
  EXPECT_THAT(pieces(qwen2, "in 2024!"), ElementsAre("in", " ", "2", "0", "2", "4", "!"));
}

TEST(SplitPattern, UnknownAlternativeIsNamed) {
  const std::string message = testing::error_of([] { SplitPattern(R"('s|\w+|\s+)"); });
  EXPECT_THAT(message, HasSubstr("the alternative '\\w+'"));
  EXPECT_THAT(testing::error_of([] { SplitPattern("(?i:'s|\\d)"); }), HasSubstr("(?i:'s|\\d)"));
}

}  // namespace
}  // namespace qkv::models::detail
