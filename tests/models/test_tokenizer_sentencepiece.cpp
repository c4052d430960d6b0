// tokenizer.model through libsentencepiece: a tiny model trained here, at test time, by the
// library's own trainer (nothing committed), loaded from a folder; ids, special tokens and
// round trips. Without libsentencepiece, loading one is an error that says so.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "model_test_support.hpp"
#include "qkv/models/tokenizer.hpp"

#ifdef QKV_HAVE_SENTENCEPIECE
#include <sentencepiece_trainer.h>
#endif

namespace qkv::models {
namespace {

using ::testing::HasSubstr;
using testing::error_of;
using testing::ScratchFolder;
using testing::write_file;

#ifdef QKV_HAVE_SENTENCEPIECE

// Trains a BPE model with byte fallback and no normalization on a few lines, as tokenizer.model.
void train_tiny_model(const ScratchFolder& folder) {
  std::string corpus;
  for (int i = 0; i < 20; ++i)
    corpus += "the cat sat on the mat\nthe dog ate the hat\nhello world, hello there\nattention is all you need\n";
  write_file(folder / "corpus.txt", corpus);
  const std::string args = "--input=" + (folder / "corpus.txt").string() + " --model_prefix=" +
                           (folder / "tokenizer").string() +
                           " --model_type=bpe --vocab_size=300 --byte_fallback=true --character_coverage=1.0"
                           " --normalization_rule_name=identity --hard_vocab_limit=false --minloglevel=2";
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  ASSERT_TRUE(status.ok()) << status.ToString();
}

TEST(SentencePiece, TrainedModelRoundTrips) {
  ScratchFolder folder;
  train_tiny_model(folder);
  const std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(folder.path());
  const SpecialTokens& special = tokenizer->special_tokens();
  EXPECT_EQ(special.unk, 0);
  EXPECT_EQ(special.bos, 1);
  EXPECT_EQ(special.eos, 2);
  EXPECT_EQ(tokenizer->id_to_token(1), "<s>");
  EXPECT_EQ(tokenizer->token_to_id("</s>"), 2);
  EXPECT_EQ(tokenizer->token_to_id("not a piece"), std::nullopt);
  EXPECT_TRUE(tokenizer->is_special(1));
  EXPECT_FALSE(tokenizer->is_special(tokenizer->vocab_size()));
  EXPECT_GE(tokenizer->vocab_size(), 259);  // the specials and 256 byte pieces at least

  const std::string text = "the cat sat on the hat";
  const std::vector<int64_t> ids = tokenizer->encode(text);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), 1);  // <s>
  EXPECT_LT(ids.size(), text.size());  // the trained merges join letters
  EXPECT_EQ(tokenizer->decode(ids, true), text);
  EXPECT_EQ(tokenizer->encode(text, false), std::vector<int64_t>(ids.begin() + 1, ids.end()));
  // Characters the corpus never had come back through the byte pieces.
  for (const std::string unseen : {"日本語 🙂", "Zebra: QUIZ!"})
    EXPECT_EQ(tokenizer->decode(tokenizer->encode(unseen, false)), unseen);
  const std::vector<int64_t> bad = {1, tokenizer->vocab_size()};
  EXPECT_THAT(error_of([&] { tokenizer->decode(bad); }), HasSubstr("outside the vocabulary"));
}

#endif

TEST(SentencePiece, NotAModel) {
  ScratchFolder folder;
  write_file(folder / "tokenizer.model", "this is not a protobuf");
  const std::string message = error_of([&] { load_tokenizer(folder.path()); });
  EXPECT_THAT(message, HasSubstr("tokenizer.model"));
  if (has_sentencepiece())
    EXPECT_THAT(message, HasSubstr("not a SentencePiece model"));
  else
    EXPECT_THAT(message, HasSubstr("built without libsentencepiece"));
}

}  // namespace
}  // namespace qkv::models
