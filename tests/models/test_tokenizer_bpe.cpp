// Byte-level BPE from tokenizer.json (GPT-2, Llama 3, Qwen2, SmolLM): tiny vocabularies the
// tests make, encodings worked by hand, byte-exact round trips of any bytes, and clear errors
// for bad files.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>

#include "model_test_support.hpp"
#include "models/byte_level.hpp"
#include "models/unicode.hpp"
#include "qkv/models/tokenizer.hpp"

namespace qkv::models {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::ordered_json;
using testing::error_of;

const char* kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// A byte-level BPE tokenizer.json: byte b is token id b (spelt in GPT-2's alphabet), each
// merge's result the next id, then `extra` tokens, then the added tokens.
struct ByteLevelSpec {
  std::vector<std::pair<std::string, std::string>> merges;  // in the alphabet: "Ġ" for a space
  bool merges_as_lists = false;
  bool ignore_merges = false;
  std::vector<std::string> extra;
  std::vector<std::string> specials = {"<|endoftext|>"};
  Json pre_tokenizer = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  Json post_processor = nullptr;
};

std::string alphabet_char(int byte) { return detail::to_byte_level(std::string(1, static_cast<char>(byte))); }

Json byte_level_json(const ByteLevelSpec& spec) {
  Json vocab = Json::object();
  int64_t next = 0;
  for (int b = 0; b < 256; ++b) vocab[alphabet_char(b)] = next++;
  Json merges = Json::array();
  for (const auto& [a, b] : spec.merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = next++;
    merges.push_back(spec.merges_as_lists ? Json::array({a, b}) : Json(a + " " + b));
  }
  for (const std::string& token : spec.extra) vocab[token] = next++;
  Json added = Json::array();
  for (const std::string& special : spec.specials)
    added.push_back({{"id", next++}, {"content", special}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", spec.pre_tokenizer},
          {"post_processor", spec.post_processor},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
            {"ignore_merges", spec.ignore_merges}, {"vocab", vocab}, {"merges", merges}}}};
}

std::unique_ptr<Tokenizer> make(const ByteLevelSpec& spec) {
  return tokenizer_from_json(byte_level_json(spec).dump(), "test tokenizer.json");
}

std::vector<std::string> tokens(const Tokenizer& tokenizer, std::string_view text, bool specials = false) {
  std::vector<std::string> out;
  for (const int64_t id : tokenizer.encode(text, specials)) out.push_back(tokenizer.id_to_token(id));
  return out;
}

std::vector<int64_t> bytes_of(std::string_view text) {
  std::vector<int64_t> ids;
  for (const char c : text) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

const std::vector<std::pair<std::string, std::string>> kTheHello = {
    {"Ġ", "t"}, {"h", "e"}, {"Ġt", "he"}, {"l", "l"}, {"he", "ll"}};

TEST(ByteLevelBpe, MergesByRank) {
  const auto tokenizer = make({.merges = kTheHello});
  // " hello": h+e (rank 1) before l+l (rank 3), then he+ll (rank 4); nothing joins Ġ or o.
  EXPECT_THAT(tokens(*tokenizer, " the hello"), ElementsAre("Ġthe", "Ġ", "hell", "o"));
  EXPECT_THAT(tokens(*tokenizer, "Hello"), ElementsAre("H", "e", "ll", "o"));
}

TEST(ByteLevelBpe, LowestRankFirstThenLeftmost) {
  // b+c has the lower rank, so "abc" is a, bc although a+b comes first in the text.
  const auto ranks = make({.merges = {{"b", "c"}, {"a", "b"}}});
  EXPECT_THAT(tokens(*ranks, "abc"), ElementsAre("a", "bc"));
  const auto ties = make({.merges = {{"a", "a"}}});
  EXPECT_THAT(tokens(*ties, "aaa"), ElementsAre("aa", "a"));
  EXPECT_THAT(tokens(*ties, "aaaaa"), ElementsAre("aa", "aa", "a"));
}

TEST(ByteLevelBpe, MergesAsListsAsStrings) {
  const auto strings = make({.merges = kTheHello});
  const auto lists = make({.merges = kTheHello, .merges_as_lists = true});
  for (const char* text : {" the hello", "hello there", "the"})
    EXPECT_EQ(strings->encode(text), lists->encode(text)) << text;
}

TEST(ByteLevelBpe, AnyBytesAreTheirByteTokens) {
  const auto tokenizer = make({});
  EXPECT_EQ(tokenizer->encode("🙂", false), bytes_of("\xF0\x9F\x99\x82"));
  EXPECT_EQ(tokenizer->encode("日本", false), bytes_of("\xE6\x97\xA5\xE6\x9C\xAC"));
  EXPECT_EQ(tokenizer->encode("\xff a\xc3", false), bytes_of("\xff a\xc3"));
  EXPECT_EQ(tokenizer->vocab_size(), 257);
  EXPECT_EQ(tokenizer->id_to_token(' '), "Ġ");
  EXPECT_EQ(tokenizer->id_to_token('\n'), "Ċ");
  EXPECT_EQ(tokenizer->token_to_id("Ġ"), ' ');
  EXPECT_EQ(tokenizer->token_to_id("nope"), std::nullopt);
}

TEST(ByteLevelBpe, SpecialTokensSplitOutFirst) {
  const auto tokenizer = make({.merges = kTheHello});
  const std::string text = "hi<|endoftext|> there";
  EXPECT_THAT(tokens(*tokenizer, text), ElementsAre("h", "i", "<|endoftext|>", "Ġthe", "r", "e"));
  const std::vector<int64_t> ids = tokenizer->encode(text);
  EXPECT_EQ(tokenizer->decode(ids), text);
  EXPECT_EQ(tokenizer->decode(ids, true), "hi there");
  const int64_t eot = *tokenizer->token_to_id("<|endoftext|>");
  EXPECT_TRUE(tokenizer->is_special(eot));
  EXPECT_FALSE(tokenizer->is_special(0));
  EXPECT_FALSE(tokenizer->is_special(-1));
  EXPECT_FALSE(tokenizer->is_special(tokenizer->vocab_size()));
  EXPECT_EQ(tokenizer->special_tokens().eos, eot);
  EXPECT_EQ(tokenizer->special_tokens().bos, eot);
  EXPECT_EQ(tokenizer->special_tokens().cls, std::nullopt);
  // Without a post-processor, nothing is added.
  EXPECT_EQ(tokenizer->encode("hi", true), tokenizer->encode("hi", false));
}

TEST(ByteLevelBpe, PrefixSpace) {
  ByteLevelSpec spec{.merges = {{"Ġ", "h"}}};
  spec.pre_tokenizer["add_prefix_space"] = true;
  EXPECT_THAT(tokens(*make(spec), "hi"), ElementsAre("Ġh", "i"));
}

// Llama 3's pipeline: its Split pattern, then ByteLevel without a regex; <|begin_of_text|> first.
ByteLevelSpec llama3_spec(std::vector<std::string> extra = {}) {
  const int64_t begin_of_text = 256 + 2 + static_cast<int64_t>(extra.size());
  ByteLevelSpec spec{.merges = {{"3", "4"}, {"Ġ", "x"}}, .extra = std::move(extra),
                     .specials = {"<|begin_of_text|>", "<|end_of_text|>"}};
  spec.pre_tokenizer = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"}, {"pattern", {{"Regex", kLlama3}}}, {"behavior", "Isolated"}, {"invert", false}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}};
  spec.post_processor = {
      {"type", "TemplateProcessing"},
      {"single", {{{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
      {"pair", Json::array()},
      {"special_tokens", {{"<|begin_of_text|>", {{"id", "<|begin_of_text|>"}, {"ids", {begin_of_text}}, {"tokens", {"<|begin_of_text|>"}}}}}}};
  return spec;
}

TEST(ByteLevelBpe, Llama3SplitAndTemplate) {
  const auto tokenizer = make(llama3_spec({"Ġxyz"}));
  ASSERT_EQ(tokenizer->token_to_id("<|begin_of_text|>"), 259);
  // Digits come in threes, and no merge crosses a piece: "1234" is "123" + "4", so 3+4 never meets.
  EXPECT_THAT(tokens(*tokenizer, "1234", true), ElementsAre("<|begin_of_text|>", "1", "2", "3", "4"));
  EXPECT_THAT(tokens(*tokenizer, " 34"), ElementsAre("Ġ", "34"));
  EXPECT_THAT(tokens(*tokenizer, " xyz"), ElementsAre("Ġx", "y", "z"));
  EXPECT_EQ(tokenizer->special_tokens().bos, 259);
  EXPECT_EQ(tokenizer->special_tokens().eos, 260);
}

TEST(ByteLevelBpe, IgnoreMergesTakesWholeWords) {
  ByteLevelSpec spec = llama3_spec({"Ġxyz"});
  spec.ignore_merges = true;
  const auto tokenizer = make(spec);
  EXPECT_THAT(tokens(*tokenizer, " xyz"), ElementsAre("Ġxyz"));
  EXPECT_THAT(tokens(*tokenizer, " xy"), ElementsAre("Ġx", "y"));
}

TEST(ByteLevelBpe, DigitsThenByteLevel) {
  ByteLevelSpec spec{.merges = {{"1", "2"}}};
  EXPECT_THAT(tokens(*make(spec), "a12"), ElementsAre("a", "12"));
  spec.pre_tokenizer = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Digits"}, {"individual_digits", true}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}}}};
  EXPECT_THAT(tokens(*make(spec), "a12"), ElementsAre("a", "1", "2"));
}

TEST(Bpe, ContinuingSubwordPrefix) {
  // Characters after a word's first are looked up with the prefix; "a" + "##b" merges to "ab".
  const Json json = {{"pre_tokenizer", {{"type", "WhitespaceSplit"}}},
                     {"model", {{"type", "BPE"}, {"continuing_subword_prefix", "##"}, {"unk_token", "?"},
                                {"vocab", {{"?", 0}, {"a", 1}, {"##b", 2}, {"ab", 3}, {"b", 4}, {"##a", 5}}},
                                {"merges", {"a ##b"}}}}};
  const auto tokenizer = tokenizer_from_json(json.dump(), "prefix/tokenizer.json");
  EXPECT_THAT(tokens(*tokenizer, "ab ba abc"), ElementsAre("ab", "b", "##a", "ab", "?"));
}

TEST(ByteLevelBpe, AddedTokenStripsSpaces) {
  // RoBERTa's <mask> takes the spaces before it (lstrip); rstrip takes those after.
  Json json = byte_level_json({.specials = {"<mask>", "<sep>"}});
  json["added_tokens"][0]["lstrip"] = true;
  json["added_tokens"][1]["rstrip"] = true;
  const auto tokenizer = tokenizer_from_json(json.dump(), "test tokenizer.json");
  EXPECT_THAT(tokens(*tokenizer, "a  <mask> b<sep>  c"), ElementsAre("a", "<mask>", "Ġ", "b", "<sep>", "c"));
}

TEST(ByteLevelBpe, NfcNormalizerComposes) {
  // Qwen2 normalizes to NFC first: e + U+0301 is é, two bytes, before the byte-level split.
  Json json = byte_level_json({});
  json["normalizer"] = {{"type", "NFC"}};
  const auto tokenizer = tokenizer_from_json(json.dump(), "test tokenizer.json");
  EXPECT_EQ(tokenizer->encode("e\u0301", false), bytes_of("\xC3\xA9"));
  EXPECT_EQ(tokenizer->decode(tokenizer->encode("e\u0301")), "\u00e9");
}

// Random text: code points of every width, invalid bytes, special tokens, spaces and newlines.
std::string random_text(std::mt19937& rng) {
  static const char32_t samples[] = {U'a', U'Z', U' ', U'\n', U'\t', U'\'', U'1', U'é', U'ß', U'Ω', U'日', U'🙂',
                                     U'\u3000', U'\u00a0', U'\u200b', U'!', U'\r'};
  std::string text;
  const int length = static_cast<int>(rng() % 24);
  for (int i = 0; i < length; ++i) {
    switch (rng() % 6) {
      case 0: text += static_cast<char>(rng() % 256); break;  // any byte, often invalid UTF-8
      case 1: detail::append_utf8(text, static_cast<char32_t>(rng() % 0x30000)); break;
      case 2: text += "<|endoftext|>"; break;
      default: detail::append_utf8(text, samples[rng() % std::size(samples)]); break;
    }
  }
  return text;
}

TEST(ByteLevelBpe, RoundTripsAnyBytes) {
  std::vector<std::pair<std::string, std::string>> merges = kTheHello;
  merges.insert(merges.end(), {{"Ġ", "Ġ"}, {"Ċ", "Ċ"}, {"Ã", "©"}, {"a", "a"}});
  const auto gpt2 = make({.merges = merges});
  const auto llama3 = [&] {
    ByteLevelSpec spec = llama3_spec();
    spec.specials.push_back("<|endoftext|>");
    return make(spec);
  }();
  std::mt19937 rng(1234);
  for (int i = 0; i < 400; ++i) {
    const std::string text = random_text(rng);
    EXPECT_EQ(gpt2->decode(gpt2->encode(text, false)), text);
    EXPECT_EQ(llama3->decode(llama3->encode(text, false)), text);
  }
}

TEST(ByteLevelBpe, IdsOutsideTheVocabulary) {
  const auto tokenizer = make({});
  const std::vector<int64_t> negative = {5, -1}, past = {257};
  EXPECT_THAT(error_of([&] { tokenizer->decode(negative); }), HasSubstr("token id -1 is outside the vocabulary [0, 257)"));
  EXPECT_THAT(error_of([&] { tokenizer->decode(past); }), HasSubstr("token id 257"));
  EXPECT_THAT(error_of([&] { tokenizer->id_to_token(1000); }), HasSubstr("1000"));
}

std::string load_error(const Json& json) {
  return error_of([&] { tokenizer_from_json(json.dump(), "bad/tokenizer.json"); });
}

TEST(ByteLevelBpe, BadFiles) {
  const Json good = byte_level_json({.merges = kTheHello});
  EXPECT_THAT(error_of([] { tokenizer_from_json("{\"model\": ", "bad/tokenizer.json"); }),
              AllOf(HasSubstr("bad/tokenizer.json"), HasSubstr("not valid JSON")));
  Json j = good;
  j.erase("model");
  EXPECT_THAT(load_error(j), HasSubstr("no 'model'"));
  j = good;
  j["model"]["type"] = "Unigram";
  EXPECT_THAT(load_error(j), AllOf(HasSubstr("bad/tokenizer.json"), HasSubstr("model type 'Unigram'")));
  j = good;
  j["model"]["merges"].push_back("Ġ zz");
  EXPECT_THAT(load_error(j), AllOf(HasSubstr("merges[5]"), HasSubstr("'zz', which is not in the vocabulary")));
  j = good;
  j["model"]["merges"].push_back("a b c");
  EXPECT_THAT(load_error(j), HasSubstr("expected \"left right\""));
  j = good;
  j["model"]["vocab"].erase("Ċ");
  EXPECT_THAT(load_error(j), AllOf(HasSubstr("model.vocab"), HasSubstr("byte 10 ('Ċ') has none")));
  j = good;
  j["model"]["vocab"]["dup"] = 3;
  EXPECT_THAT(load_error(j), HasSubstr("id 3 is both"));
  j = good;
  j["model"]["vocab"]["far"] = int64_t{1} << 40;
  EXPECT_THAT(load_error(j), AllOf(HasSubstr("'far'"), HasSubstr("outside")));
  j = good;
  j["model"]["vocab"]["far"] = 5000000;
  EXPECT_THAT(load_error(j), HasSubstr("ids must be dense"));
  j = good;
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "\\w+|\\s+"}}}, {"behavior", "Isolated"}};
  EXPECT_THAT(load_error(j), AllOf(HasSubstr("pre_tokenizer"), HasSubstr("'\\w+'")));
  j = good;
  j["pre_tokenizer"] = {{"type", "UnicodeScripts"}};
  EXPECT_THAT(load_error(j), HasSubstr("pre-tokenizer type 'UnicodeScripts'"));
  j = good;
  j["added_tokens"][0]["content"] = "";
  EXPECT_THAT(load_error(j), HasSubstr("added_tokens[0]"));
  j = good;
  j["post_processor"] = {{"type", "TemplateProcessing"}, {"single", {{{"SpecialToken", {{"id", "<s>"}}}}, {{"Sequence", {{"id", "A"}}}}}}};
  EXPECT_THAT(load_error(j), HasSubstr("'<s>' is not in the vocabulary"));
  j = good;
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", Json::array()}};
  for (int depth = 0; depth < 80; ++depth) j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {j["normalizer"]}}};
  EXPECT_THAT(load_error(j), HasSubstr("nests deeper"));
}

}  // namespace
}  // namespace qkv::models
