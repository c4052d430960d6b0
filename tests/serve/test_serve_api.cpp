// qkv serve's mask expressions (the library's qkv::Mask::parse, src/mask/parse.cpp) and JSON API as plain functions
// (tools/qkv/serve_api.cpp), without a socket. The HTTP side is tests/serve/test_api.py.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <string>

#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "qkv/mask.hpp"
#include "qkv/train.hpp"
#include "serve_api.hpp"

namespace qkv::cli {
namespace {

using nlohmann::json;

// ---- Mask expressions

TEST(MaskExpression, EachTermIsTheLibrarysMask) {
  EXPECT_TRUE(Mask::parse("").is_none());
  EXPECT_TRUE(Mask::parse("none").is_none());
  EXPECT_TRUE(Mask::parse("  none & none ").is_none());

  const Mask causal = Mask::parse("causal");
  EXPECT_EQ(causal.band_hi(), 0);
  EXPECT_EQ(causal.band_lo(), -Mask::kUnbounded);

  const Mask window = Mask::parse("window(3)");
  EXPECT_EQ(window.band_lo(), -3);
  EXPECT_EQ(window.band_hi(), 0);

  const Mask both_sides = Mask::parse("window( 3 ,1 )");
  EXPECT_EQ(both_sides.band_lo(), -3);
  EXPECT_EQ(both_sides.band_hi(), 1);

  const Mask combined = Mask::parse("causal & window(4, 2)");  // & takes the tighter edges
  EXPECT_EQ(combined.band_lo(), -4);
  EXPECT_EQ(combined.band_hi(), 0);

  const Mask padding = Mask::parse("padding(4)");
  ASSERT_TRUE(padding.has_key_lengths());
  EXPECT_EQ(padding.lengths(), std::vector<int64_t>{4});
  EXPECT_FALSE(padding.has_band());
}

// The message quotes the expression, the column and the bad token; column() is that column.
void expect_error(const std::string& expression, size_t column, const std::string& message) {
  try {
    Mask::parse(expression);
    ADD_FAILURE() << "'" << expression << "' parsed";
  } catch (const MaskParseError& e) {
    EXPECT_EQ(e.column(), column) << e.what();
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

TEST(MaskExpression, ErrorsPointAtTheBadToken) {
  expect_error("windw(3)", 1, "mask 'windw(3)': column 1, found 'windw': unknown mask; expected none, causal, window(left)");
  expect_error("causal & windw(3)", 10, "column 10, found 'windw': unknown mask");
  expect_error("window(3", 9, "column 9, found the end: expected ')' to close window(");
  expect_error("window(-1)", 8, "column 8, found '-': not part of a mask");
  expect_error("window(2.5)", 9, "column 9, found '.': not part of a mask");
  expect_error("window 3", 8, "column 8, found '3': expected '(' after window, as in window(3)");
  expect_error("window()", 8, "column 8, found ')': expected window's left (a whole number >= 0)");
  expect_error("window(1,)", 10, "expected window's right");
  expect_error("causal &", 9, "column 9, found the end: expected a mask");
  expect_error("& causal", 1, "column 1, found '&': expected a mask");
  expect_error("causal causal", 8, "column 8, found 'causal': expected &, | or the end");
  expect_error("Causal", 1, "found 'Causal': unknown mask");
  expect_error("padding(0)", 9, "padding's length must be at least 1");
  expect_error("window(99999999999)", 8, "window's left is at most 1000000000");
  expect_error("causal \xe2\x88\xa7 window(2)", 8, "found '\xe2\x88\xa7': not part of a mask");
}

// ---- The JSON API

// The answer's status and parsed body.
std::pair<int, json> ask(const ExplorerApi& api, const json& request) {
  const ApiResponse response = api.attention(request.dump());
  return {response.status, json::parse(response.body)};
}

TEST(ExplorerApi, WeightsAreSoftmaxRowsWithTheirEntropy) {
  const ExplorerApi api({}, ServeLimits{});
  const auto [status, answer] = ask(api, {{"text", "the cat sat on the mat"}, {"heads", 4}, {"embed", 16}});
  ASSERT_EQ(status, 200) << answer.dump();
  ASSERT_EQ(answer["weights"].size(), 4u);
  for (size_t h = 0; h < 4; ++h) {
    double entropy = 0;
    for (const auto& row : answer["weights"][h]) {
      ASSERT_EQ(row.size(), 6u);
      double sum = 0;
      for (double w : row) {
        sum += w;
        if (w > 0) entropy -= w * std::log(w);
      }
      EXPECT_NEAR(sum, 1.0, 1e-3);  // weights travel rounded to 4 significant digits
    }
    EXPECT_NEAR(answer["entropy"][h].get<double>(), entropy / 6, 2e-3);  // computed before rounding
  }
  // The same request, the same answer: the seed fixes the layer.
  EXPECT_EQ(ask(api, {{"text", "the cat sat on the mat"}, {"heads", 4}, {"embed", 16}}).second, answer);
}

TEST(ExplorerApi, CausalEmptiesTheUpperTriangle) {
  const ExplorerApi api({}, ServeLimits{});
  const auto [status, answer] = ask(api, {{"text", "a b c d e"}, {"mask", "causal"}});
  ASSERT_EQ(status, 200) << answer.dump();
  for (const auto& head : answer["weights"]) {
    for (size_t i = 0; i < 5; ++i) {
      for (size_t j = 0; j < 5; ++j) {
        if (j > i) EXPECT_EQ(head[i][j].get<double>(), 0.0) << i << "," << j;
        else EXPECT_GT(head[i][j].get<double>(), 0.0) << i << "," << j;
      }
    }
  }
  EXPECT_EQ(answer["weights"][0][0][0].get<double>(), 1.0);  // the first token sees only itself
}

TEST(ExplorerApi, BadInputIsA400NamingTheProblem) {
  ServeLimits limits;
  limits.max_tokens = 4;
  const ExplorerApi api({}, limits);
  const auto error_of = [&](const std::string& body) {
    const ApiResponse response = api.attention(body);
    EXPECT_EQ(response.status, 400) << body;
    return json::parse(response.body)["error"].get<std::string>();
  };
  EXPECT_EQ(error_of(R"({"text": "a b c d e"})"), "\"text\" has 5 tokens; the explorer shows at most 4");
  EXPECT_EQ(error_of(R"({"text": "a", "temperature": 0})"), "\"temperature\" must be above 0 and at most 100, got 0");
  EXPECT_EQ(error_of(R"({"text": "a", "model": "m.qkv"})"),
            "unknown model \"m.qkv\"; the server was started with no --model");
  EXPECT_EQ(error_of("\"just a string\""), "the body must be a JSON object, got \"just a string\"");
  EXPECT_EQ(error_of(" \n"), "the body is empty: send a JSON object such as {\"text\": \"The cat sat on the mat\"}");
  EXPECT_EQ(error_of("{\"text\": \"a\",}"),
            "malformed JSON: parse error at line 1, column 14: syntax error while parsing object key - unexpected '}'; "
            "expected string literal");
  // Deep nesting is refused before parsing (nlohmann's dump and destructor recurse per level).
  EXPECT_EQ(error_of(std::string(8000, '[') + std::string(8000, ']')),
            "the body nests 8000 levels deep; a request is one JSON object of plain fields (at most 32 levels)");
  EXPECT_EQ(error_of(R"({"text": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[", "heads": [1]})"), "\"heads\" must be a whole number, got [1]");
  // A mask expression longer than the limit is refused before it is parsed.
  const json long_mask = {{"text", "a"}, {"mask", std::string(201, ' ')}};
  EXPECT_EQ(error_of(long_mask.dump()),
            "mask expression has 201 characters; the limit is 200");
  EXPECT_EQ(error_of(R"x({"text": "a b", "mask": "causal & (window(1) | strided(0))"})x"),
            "mask 'causal & (window(1) | strided(0))': column 31, found '0': strided's stride must be at least 1");
  // Not UTF-8: nlohmann refuses it, and the error is still valid JSON.
  EXPECT_NE(error_of("{\"text\": \"\xff\"}").find("malformed JSON"), std::string::npos);
}

// A mask may hide every key of a row (window(0) & padding(1): token i sees only itself and only
// the first token). That row is zeros and its entropy 0, never NaN, which JSON would carry as
// null; fuzz/fuzz_explorer_api checks this on every answer, this pins the case.
TEST(ExplorerApi, ARowThatSeesNoKeyIsZerosNotNaN) {
  const ExplorerApi api({}, ServeLimits{});
  const auto [status, answer] = ask(api, {{"text", "a b c d"}, {"heads", 2}, {"embed", 8}, {"mask", "window(0) & padding(1)"}});
  ASSERT_EQ(status, 200) << answer.dump();
  for (const auto& rows : {answer["weights"][0], answer["weights"][1], answer["average"]}) {
    EXPECT_EQ(rows[0], json({1.0, 0.0, 0.0, 0.0}));
    for (size_t i = 1; i < 4; ++i) EXPECT_EQ(rows[i], json({0.0, 0.0, 0.0, 0.0})) << i;
  }
  for (const auto& e : answer["entropy"]) EXPECT_EQ(e, json(0.0));
  EXPECT_EQ(answer["average_entropy"], json(0.0));
}

// The library's sparse patterns reach the explorer: a union hides exactly what it says.
TEST(ExplorerApi, SparseMasksHideWhatTheySay) {
  const ExplorerApi api({}, ServeLimits{});
  const auto [status, answer] = ask(api, {{"text", "a b c d e f g"}, {"mask", "causal & (window(1) | strided(3)) | global(1)"}});
  ASSERT_EQ(status, 200) << answer.dump();
  EXPECT_EQ(answer["mask"], "causal & (window(1) | strided(3)) | global(1)");
  for (const auto& head : answer["weights"])
    for (int i = 0; i < 7; ++i)
      for (int j = 0; j < 7; ++j) {
        const bool visible = (j <= i && (i - j <= 1 || (i - j) % 3 == 0)) || i < 1 || j < 1;
        EXPECT_EQ(head[i][j].get<double>() > 0.0, visible) << i << "," << j;
      }
}

// Each weight has at most 4 significant digits on the wire, and "visible" says which pairs the
// mask hides (a page draws those unlike a weight that is merely near 0).
TEST(ExplorerApi, CompactWeightsAndTheVisiblePairs) {
  const ExplorerApi api({}, ServeLimits{});
  const auto [status, answer] = ask(api, {{"text", "a b c d e"}, {"heads", 2}, {"embed", 8}, {"mask", "causal & window(1) | global(1)"}});
  ASSERT_EQ(status, 200) << answer.dump();
  ASSERT_EQ(answer["visible"].size(), 5u);
  for (int i = 0; i < 5; ++i) {
    std::string expected;
    for (int j = 0; j < 5; ++j) expected += ((j <= i && i - j <= 1) || i < 1 || j < 1) ? '1' : '0';
    EXPECT_EQ(answer["visible"][i], expected) << i;
  }
  for (const auto& head : answer["weights"])
    for (const auto& row : head)
      for (const auto& w : row) {
        const std::string text = w.dump();
        size_t digits = 0;
        for (char c : text.substr(0, text.find('e'))) digits += std::isdigit(static_cast<unsigned char>(c)) != 0;
        const size_t zeros = text.starts_with("0.") ? text.find_first_not_of('0', 2) - 1 : 0;  // leading, not significant
        EXPECT_LE(digits - std::min(digits, zeros), 4u) << text;
      }
  // No mask: every pair visible.
  const auto [status2, unmasked] = ask(api, {{"text", "a b c"}});
  ASSERT_EQ(status2, 200);
  EXPECT_EQ(unmasked["visible"], json({"111", "111", "111"}));
}

TEST(ExplorerApi, LoopbackHosts) {
  for (const char* host : {"127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"}) EXPECT_TRUE(is_loopback_host(host)) << host;
  for (const char* host : {"0.0.0.0", "192.168.1.10", "example.com", "::", "", "localhost.example.com"}) {
    EXPECT_FALSE(is_loopback_host(host)) << host;
  }
}

class ExplorerModel : public ::testing::Test {
 protected:
  void SetUp() override {
    // One file per test and process: ctest -j runs the tests of this fixture side by side.
    path_ = (std::filesystem::temp_directory_path() /
             ("qkv_serve_test_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
              std::to_string(::getpid()) + ".qkv"))
                .string();
    // A copy task of length 3 over 4 symbols: sequences of 6, vocabulary a-d and '|'.
    train::AttentionModel model({.vocab_size = 5, .max_len = 6, .d_model = 16, .num_heads = 2, .num_layers = 2}, 1);
    model.save(path_);
  }
  void TearDown() override { std::filesystem::remove(path_); }
  std::string path_;
};

TEST_F(ExplorerModel, ListedAndRunLayerByLayerUnderItsCausalMask) {
  const ExplorerApi api({path_}, ServeLimits{});
  const json models = json::parse(api.models().body)["models"];
  ASSERT_EQ(models.size(), 1u);
  const std::string name = std::filesystem::path(path_).filename().string();
  EXPECT_EQ(models[0]["name"], name);
  EXPECT_EQ(models[0]["layers"], 2);
  EXPECT_EQ(models[0]["heads"], 2);

  auto [status, answer] = ask(api, {{"text", "a b | a"}, {"model", name}});
  ASSERT_EQ(status, 200) << answer.dump();
  EXPECT_EQ(answer["tokens"], json({"a", "b", "|", "a"}));
  ASSERT_EQ(answer["layers"].size(), 2u);
  for (const auto& layer : answer["layers"]) {
    ASSERT_EQ(layer["weights"].size(), 2u);
    for (const auto& head : layer["weights"]) {
      for (size_t i = 0; i < 4; ++i) {
        for (size_t j = i + 1; j < 4; ++j) EXPECT_EQ(head[i][j].get<double>(), 0.0);
      }
    }
  }
  // A mask is and-ed into the model's own causal one.
  std::tie(status, answer) = ask(api, {{"text", "a b c d"}, {"model", name}, {"mask", "window(0)"}});
  ASSERT_EQ(status, 200) << answer.dump();
  EXPECT_EQ(answer["layers"][1]["weights"][0][3], json({0.0, 0.0, 0.0, 1.0}));
  EXPECT_EQ(answer["visible"], json({"1000", "0100", "0010", "0001"}));  // causal & window(0)

  // Too long for the model (6 tokens at most): one example of its task instead, said so.
  std::tie(status, answer) = ask(api, {{"text", "a b c d a b c"}, {"model", name}});
  ASSERT_EQ(status, 200) << answer.dump();
  EXPECT_NE(answer["note"].get<std::string>().find("the model reads at most 6"), std::string::npos) << answer["note"];
  EXPECT_EQ(answer["tokens"].size(), 6u);
}

TEST_F(ExplorerModel, RepeatedNamesAndMissingFilesRefuseToStart) {
  EXPECT_THROW(ExplorerApi({path_, path_}, ServeLimits{}), Error);
  EXPECT_THROW(ExplorerApi({path_ + ".missing"}, ServeLimits{}), Error);
}

}  // namespace
}  // namespace qkv::cli
