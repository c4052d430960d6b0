// SentencePiece-style BPE in tokenizer.json, as Llama 2, TinyLlama and Mistral ship it: spaces
// become "▁" (by a Prepend + Replace normalizer, or the newer Metaspace pre-tokenizer), characters
// outside the vocabulary fall back to <0xXX> byte tokens, and <s> starts a sequence.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>

#include "model_test_support.hpp"
#include "models/unicode.hpp"
#include "qkv/models/tokenizer.hpp"

namespace qkv::models {
namespace {

using ::testing::ElementsAre;
using Json = nlohmann::ordered_json;

// <unk> 0, <s> 1, </s> 2, <0x00>..<0xFF> 3..258, then the letters and the merges' results.
Json llama_json(bool metaspace_pre_tokenizer) {
  Json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  int64_t next = 259;
  for (const char* token : {"▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "el", "▁hel", "lo"}) vocab[token] = next++;
  const Json merges = {"▁ h", "e l", "▁h el", "l o"};
  Json added = Json::array();
  for (const auto& [id, content] : {std::pair{0, "<unk>"}, {1, "<s>"}, {2, "</s>"}})
    added.push_back({{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  Json json = {
      {"added_tokens", added},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"model", {{"type", "BPE"}, {"unk_token", "<unk>"}, {"fuse_unk", true}, {"byte_fallback", true},
                 {"vocab", vocab}, {"merges", merges}}}};
  if (metaspace_pre_tokenizer) {
    json["normalizer"] = nullptr;
    json["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "first"}, {"split", false}};
    json["decoder"] = {{"type", "Sequence"},
                       {"decoders", {{{"type", "Metaspace"}, {"replacement", "▁"}, {"prepend_scheme", "first"}, {"split", false}},
                                     {{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}};
  } else {
    json["normalizer"] = {{"type", "Sequence"},
                          {"normalizers", {{{"type", "Prepend"}, {"prepend", "▁"}},
                                           {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}};
    json["pre_tokenizer"] = nullptr;
    json["decoder"] = {{"type", "Sequence"},
                       {"decoders", {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
                                     {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                     {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  }
  return json;
}

std::vector<std::string> tokens(const Tokenizer& tokenizer, std::string_view text, bool specials = true) {
  std::vector<std::string> out;
  for (const int64_t id : tokenizer.encode(text, specials)) out.push_back(tokenizer.id_to_token(id));
  return out;
}

class Metaspace : public ::testing::TestWithParam<bool> {
 protected:
  std::unique_ptr<Tokenizer> tokenizer_ = tokenizer_from_json(llama_json(GetParam()).dump(), "llama/tokenizer.json");
};

TEST_P(Metaspace, MergesAndByteFallback) {
  // "▁hello": ▁+h, e+l, ▁h+el, then l+o; "é" is not a token, so its two bytes are.
  EXPECT_THAT(tokens(*tokenizer_, "hello"), ElementsAre("<s>", "▁hel", "lo"));
  EXPECT_THAT(tokens(*tokenizer_, "hé world", false),
              ElementsAre("▁h", "<0xC3>", "<0xA9>", "▁", "w", "o", "r", "l", "d"));
  EXPECT_EQ(tokenizer_->special_tokens().bos, 1);
  EXPECT_EQ(tokenizer_->special_tokens().eos, 2);
  EXPECT_EQ(tokenizer_->special_tokens().unk, 0);
}

TEST_P(Metaspace, DecodesBack) {
  EXPECT_EQ(tokenizer_->decode(tokenizer_->encode("hello world")), "<s> hello world");
  EXPECT_EQ(tokenizer_->decode(tokenizer_->encode("hello world"), true), "hello world");
  std::mt19937 rng(99);
  for (int i = 0; i < 300; ++i) {
    // Not starting with a space: Metaspace's decoder drops the first token's leading space, as
    // the `tokenizers` library does, so " x" decodes to "x" there.
    std::string text = "h";
    const int length = static_cast<int>(rng() % 16);
    for (int k = 0; k < length; ++k) {
      if (rng() % 3 == 0) text += static_cast<char>(rng() % 256);  // invalid UTF-8 too
      else detail::append_utf8(text, U"helo wrd é日🙂\n"[rng() % 13]);
    }
    EXPECT_EQ(tokenizer_->decode(tokenizer_->encode(text, false)), text);
  }
}

INSTANTIATE_TEST_SUITE_P(NormalizerOrPreTokenizer, Metaspace, ::testing::Bool());

}  // namespace
}  // namespace qkv::models
