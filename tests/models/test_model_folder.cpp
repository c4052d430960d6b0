// open_model_folder: config.json, weights and tokenizer found and checked; each missing or bad
// part a qkv::Error naming the folder and what was looked for.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "model_test_support.hpp"
#include "qkv/models/model_folder.hpp"

namespace qkv::models {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::error_of;
using testing::ScratchFolder;
using testing::write_file;

// The smallest tokenizer.json: WordPiece over three tokens.
const char* kTokenizer = R"({"model": {"type": "WordPiece", "unk_token": "[UNK]",
  "vocab": {"[UNK]": 0, "hi": 1, "[CLS]": 2}}, "pre_tokenizer": {"type": "WhitespaceSplit"}})";

class ModelFolderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    write_file(folder_ / "config.json", R"({"model_type": "bert", "hidden_size": 2})");
    const std::vector<uint8_t> bytes(8, 0);
    write_safetensors(folder_ / "model.safetensors", std::vector<SafetensorsTensor>{{"w", "F32", {2}, bytes}});
    write_file(folder_ / "tokenizer.json", kTokenizer);
  }
  std::string open_error(const ModelFolderOptions& options = {}) {
    return error_of([&] { open_model_folder(folder_.path(), options); });
  }
  ScratchFolder folder_;
};

TEST_F(ModelFolderTest, OpensEveryPart) {
  const ModelFolder model = open_model_folder(folder_.path());
  EXPECT_EQ(nlohmann::json::parse(model.config_json)["hidden_size"], 2);
  ASSERT_NE(model.weights.find("w"), nullptr);
  ASSERT_NE(model.tokenizer, nullptr);
  EXPECT_EQ(model.tokenizer->encode("hi hi", false), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(model.tokenizer->special_tokens().cls, 2);
}

TEST_F(ModelFolderTest, TokenizerConfigNamesRoles) {
  write_file(folder_ / "tokenizer_config.json", R"({"bos_token": {"content": "hi"}, "eos_token": "[CLS]"})");
  const ModelFolder model = open_model_folder(folder_.path());
  EXPECT_EQ(model.tokenizer->special_tokens().bos, 1);
  EXPECT_EQ(model.tokenizer->special_tokens().eos, 2);
}

TEST_F(ModelFolderTest, MissingParts) {
  EXPECT_THAT(error_of([&] { open_model_folder(folder_ / "nowhere"); }), HasSubstr("nowhere': not a model folder"));
  std::filesystem::remove(folder_ / "tokenizer.json");
  EXPECT_THAT(open_error(), AllOf(HasSubstr(folder_.path().string()), HasSubstr("looked for tokenizer.json and tokenizer.model")));
  EXPECT_NO_THROW(open_model_folder(folder_.path(), {.tokenizer = false}));
  std::filesystem::remove(folder_ / "model.safetensors");
  EXPECT_THAT(open_error({.tokenizer = false}), AllOf(HasSubstr("no weights"), HasSubstr("model.safetensors")));
  std::filesystem::remove(folder_ / "config.json");
  EXPECT_THAT(open_error(), AllOf(HasSubstr(folder_.path().string()), HasSubstr("no config.json")));
}

TEST_F(ModelFolderTest, BadConfig) {
  write_file(folder_ / "config.json", "[1, 2]");
  EXPECT_THAT(open_error(), AllOf(HasSubstr("config.json"), HasSubstr("expected a JSON object")));
  write_file(folder_ / "config.json", "{\"a\": ");
  EXPECT_THAT(open_error(), AllOf(HasSubstr("config.json"), HasSubstr("not valid JSON")));
  std::filesystem::remove(folder_ / "config.json");
  std::filesystem::create_directory(folder_ / "config.json");
  EXPECT_THAT(open_error(), HasSubstr("is a folder"));
}

TEST_F(ModelFolderTest, BadTokenizerNamesItsFile) {
  write_file(folder_ / "tokenizer.json", R"({"model": {"type": "WordPiece", "vocab": {"hi": 0}}})");
  EXPECT_THAT(open_error(), AllOf(HasSubstr("tokenizer.json"), HasSubstr("'[UNK]' is not in the vocabulary")));
}

}  // namespace
}  // namespace qkv::models
