// BERT's WordPiece from tokenizer.json: BertNormalizer (lower case, accents, CJK, controls),
// BertPreTokenizer, ## continuations, [UNK] for unknown and over-long words, [CLS] ... [SEP],
// and the WordPiece decoder's joins; encodings worked by hand on a tiny vocabulary.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "model_test_support.hpp"
#include "qkv/models/tokenizer.hpp"

namespace qkv::models {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::ordered_json;
using testing::error_of;

const std::vector<std::string> kVocab = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "un",
                                         "##aff", "##able", ",", "!", "cafe", "中", "国", "'", "s", "do",
                                         "##n", "t", "$", "##s"};

Json special(int64_t id, const std::string& content) {
  return {{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", false}, {"special", true}};
}

Json bert_json(uint64_t max_chars = 100, Json post_processor = nullptr) {
  Json vocab = Json::object();
  for (size_t i = 0; i < kVocab.size(); ++i) vocab[kVocab[i]] = i;
  if (post_processor.is_null())
    post_processor = {{"type", "TemplateProcessing"},
                      {"single", {{{"SpecialToken", {{"id", "[CLS]"}, {"type_id", 0}}}},
                                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                  {{"SpecialToken", {{"id", "[SEP]"}, {"type_id", 0}}}}}},
                      {"special_tokens", {{"[CLS]", {{"id", "[CLS]"}, {"ids", {2}}, {"tokens", {"[CLS]"}}}},
                                          {"[SEP]", {{"id", "[SEP]"}, {"ids", {3}}, {"tokens", {"[SEP]"}}}}}}};
  return {{"added_tokens", {special(0, "[PAD]"), special(1, "[UNK]"), special(2, "[CLS]"), special(3, "[SEP]"),
                            special(4, "[MASK]")}},
          {"normalizer", {{"type", "BertNormalizer"}, {"clean_text", true}, {"handle_chinese_chars", true},
                          {"strip_accents", nullptr}, {"lowercase", true}}},
          {"pre_tokenizer", {{"type", "BertPreTokenizer"}}},
          {"post_processor", post_processor},
          {"decoder", {{"type", "WordPiece"}, {"prefix", "##"}, {"cleanup", true}}},
          {"model", {{"type", "WordPiece"}, {"unk_token", "[UNK]"}, {"continuing_subword_prefix", "##"},
                     {"max_input_chars_per_word", max_chars}, {"vocab", vocab}}}};
}

std::vector<std::string> tokens(const Tokenizer& tokenizer, std::string_view text, bool specials = true) {
  std::vector<std::string> out;
  for (const int64_t id : tokenizer.encode(text, specials)) out.push_back(tokenizer.id_to_token(id));
  return out;
}

TEST(WordPiece, NormalizesSplitsAndContinues) {
  const auto bert = tokenizer_from_json(bert_json().dump(), "bert/tokenizer.json");
  // Lower-cased, accents stripped (É, é), the control character dropped, CJK one per word,
  // punctuation apart, ## continuations, [UNK] for a word with no way through.
  EXPECT_THAT(tokens(*bert, "Hello, WORLD! Unaffable CAFÉ 中国 xyz\x01"),
              ElementsAre("[CLS]", "hello", ",", "world", "!", "un", "##aff", "##able", "cafe", "中", "国", "[UNK]",
                          "[SEP]"));
  // ASCII symbols are punctuation to BERT; an apostrophe splits a contraction.
  EXPECT_THAT(tokens(*bert, "$s don't", false), ElementsAre("$", "s", "do", "##n", "'", "t"));
}

TEST(WordPiece, UnknownAndSpecial) {
  const auto bert = tokenizer_from_json(bert_json().dump(), "bert/tokenizer.json");
  // A word with a piece missing is [UNK] as a whole, not in part.
  EXPECT_THAT(tokens(*bert, "unx", false), ElementsAre("[UNK]"));
  // Special tokens written in the text are themselves, before lower-casing.
  EXPECT_THAT(tokens(*bert, "hello [MASK] world", false), ElementsAre("hello", "[MASK]", "world"));
  EXPECT_EQ(bert->special_tokens().cls, 2);
  EXPECT_EQ(bert->special_tokens().sep, 3);
  EXPECT_EQ(bert->special_tokens().mask, 4);
  EXPECT_EQ(bert->special_tokens().pad, 0);
  EXPECT_EQ(bert->special_tokens().unk, 1);
  EXPECT_EQ(bert->special_tokens().bos, std::nullopt);
}

TEST(WordPiece, OverlongWordIsUnknown) {
  const auto bert = tokenizer_from_json(bert_json(8).dump(), "bert/tokenizer.json");
  EXPECT_THAT(tokens(*bert, "unaffable hello", false), ElementsAre("[UNK]", "hello"));
  EXPECT_THAT(error_of([] { tokenizer_from_json(bert_json(1u << 20).dump(), "bert/tokenizer.json"); }),
              HasSubstr("max_input_chars_per_word"));
}

TEST(WordPiece, BertProcessingAddsClsAndSep) {
  const Json processor = {{"type", "BertProcessing"}, {"sep", {"[SEP]", 3}}, {"cls", {"[CLS]", 2}}};
  const auto bert = tokenizer_from_json(bert_json(100, processor).dump(), "bert/tokenizer.json");
  EXPECT_THAT(tokens(*bert, "hello"), ElementsAre("[CLS]", "hello", "[SEP]"));
  const Json wrong = {{"type", "BertProcessing"}, {"sep", {"[SEP]", 7}}, {"cls", {"[CLS]", 2}}};
  EXPECT_THAT(error_of([&] { tokenizer_from_json(bert_json(100, wrong).dump(), "bert/tokenizer.json"); }),
              HasSubstr("'[SEP]' is not token 7"));
}

TEST(WordPiece, DecodeJoinsPieces) {
  const auto bert = tokenizer_from_json(bert_json().dump(), "bert/tokenizer.json");
  const std::vector<int64_t> ids = bert->encode("Hello, world! Unaffable cafe 中国 xyz");
  EXPECT_EQ(bert->decode(ids), "[CLS] hello, world! unaffable cafe 中 国 [UNK] [SEP]");
  EXPECT_EQ(bert->decode(ids, true), "hello, world! unaffable cafe 中 国");
}

TEST(WordPiece, BadModel) {
  Json j = bert_json();
  j["model"]["unk_token"] = "<unk>";
  EXPECT_THAT(error_of([&] { tokenizer_from_json(j.dump(), "bert/tokenizer.json"); }),
              HasSubstr("model.unk_token: '<unk>' is not in the vocabulary"));
  j = bert_json();
  j["model"]["vocab"]["hello"] = "five";
  EXPECT_THAT(error_of([&] { tokenizer_from_json(j.dump(), "bert/tokenizer.json"); }),
              HasSubstr("token 'hello': the id must be an integer"));
}

}  // namespace
}  // namespace qkv::models
