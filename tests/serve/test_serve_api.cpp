// qkv serve's mask expressions (the library's qkv::Mask::parse, src/mask/parse.cpp) and JSON API as plain functions
// (tools/qkv/serve_api.cpp), without a socket. The HTTP side is tests/serve/test_api.py.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "pretrained.hpp"
#include "qkv/mask.hpp"
#include "qkv/models/pretrained.hpp"
#include "qkv/train.hpp"
#include "serve_api.hpp"
#include "serve_hosts.hpp"
#include "serve_slots.hpp"

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

// The error message of a request body that must be a 400.
std::string error_of(const ExplorerApi& api, const std::string& body) {
  const ApiResponse response = api.attention(body);
  EXPECT_EQ(response.status, 400) << body;
  return json::parse(response.body).value("error", "");
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
  for (const char* host : {"127.0.0.1", "127.1.2.3", "localhost", "LocalHost", "::1", "[::1]", "::ffff:127.0.0.1"}) {
    EXPECT_TRUE(is_loopback_host(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "192.168.1.10", "example.com", "::", "", "localhost.example.com", "127.attacker.example",
                           "127.0.0.1.evil", "127.1", "[::1]evil", "[::1", "::1]", "127.0.0.1:80@evil"}) {
    EXPECT_FALSE(is_loopback_host(host)) << host;
  }
}

// The Host header must be exactly a name on the list, alone or with the server's port.
TEST(HostAllowList, OnlyTheNamesOfThisServer) {
  const HostAllowList hosts("127.0.0.1", 8080, {"my-laptop.local", "fe80::1"});
  for (const char* host : {"127.0.0.1", "127.0.0.1:8080", "localhost", "localhost:8080", "LOCALHOST:8080", "[::1]",
                           "[::1]:8080", "my-laptop.local", "My-Laptop.Local:8080", "[fe80::1]:8080"}) {
    EXPECT_TRUE(hosts.allows(host)) << host;
  }
  for (const char* host : {"127.attacker.example", "127.0.0.1.evil", "[::1]evil", "127.0.0.1:80@evil", "127.0.0.1:8081",
                           "127.0.0.2", "localhost.", "localhost:", "localhost:08080", " localhost", "::1", "",
                           "evil.my-laptop.local",
                           "attacker.example:8080", "127.0.0.1:8080\r\nX: y"}) {
    EXPECT_FALSE(hosts.allows(host)) << host;
  }
  EXPECT_FALSE(hosts.allows(std::string("localhost\0:8080", 15)));
  EXPECT_EQ(hosts.shown(), "127.0.0.1, localhost, [::1], my-laptop.local, [fe80::1]");
  // The bound address, IPv6 in brackets, with its own port.
  const HostAllowList v6("::1", 0, {});
  EXPECT_TRUE(v6.allows("[::1]:0"));
  EXPECT_FALSE(v6.allows("::1"));
}

TEST(HostAllowList, RefusesAnEmptyHostAndMalformedNames) {
  auto message = [](const std::string& host, const std::vector<std::string>& extra) {
    try {
      HostAllowList(host, 8080, extra);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message("", {}), "--host is empty: give the address to listen on, e.g. 127.0.0.1 (the default) or ::1");
  EXPECT_NE(message("127.0.0.1:8080", {}).find("--host '127.0.0.1:8080' is not a host name or an address"), std::string::npos);
  for (const char* name : {"", "evil.example:80", "a b", "user@host", "http://host", "[::1]:80", "[evil]"}) {
    const std::string expected = std::string("--allow-host '") + name + "' is not a host name";
    EXPECT_NE(message("127.0.0.1", {name}).find(expected), std::string::npos) << name;
  }
}

// A NUL byte (or any control character) is shown escaped, the whole message kept.
TEST(ExplorerApi, ControlCharactersInErrorsAreEscaped) {
  const ExplorerApi api({}, ServeLimits{});
  const std::string body = std::string(R"({"text": "a b", "mask": "causal)") + "\\u0000" + R"x( & window(1)"})x";
  EXPECT_EQ(error_of(api, body),
            "mask 'causal\\u0000 & window(1)': column 7, found '\\u0000': a control character, not part of a mask");
  EXPECT_EQ(error_of(api, R"({"text": "a", "ab\u0000cd": 1})"),
            "unknown field \"ab\\u0000cd\"; the fields are text, heads, embed, seed, temperature, mask, chars, model, and for a model folder ids and neuron");
  EXPECT_NE(error_of(api, R"({"text": "a", "model": "x\u0001y"})").find("unknown model \"x\\u0001y\""), std::string::npos);
  // Whitespace is the parser's own: a tab still separates.
  EXPECT_EQ(ask(api, {{"text", "a b"}, {"mask", "causal\t&\nwindow(1)"}}).first, 200);
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

// A small file may name a long sequence (max_len 65536): start-up must not run the model on its
// task's examples (400 of them took minutes), and a request that would fall back on one of them
// (65536 tokens, more than the page shows) is a 400 instead.
TEST(ExplorerLongModel, StartsAtOnceAndRunsOnlyShortTexts) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("qkv_serve_test_long_" + std::to_string(::getpid()) + ".qkv")).string();
  train::AttentionModel({.vocab_size = 5, .max_len = 65536, .d_model = 8, .num_heads = 2, .num_layers = 1}, 1).save(path);
  const auto start = std::chrono::steady_clock::now();
  const ExplorerApi api({path}, ServeLimits{});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::filesystem::remove(path);
  // ~ milliseconds; the evaluation it no longer runs took minutes, which the looser bound of the
  // sanitizer build (run beside other tests, several times slower) still catches.
#if defined(__SANITIZE_ADDRESS__)
  EXPECT_LT(seconds, 30.0);
#else
  EXPECT_LT(seconds, 5.0);
#endif
  const json model = json::parse(api.models().body)["models"][0];
  EXPECT_EQ(model["task"], "copy or reverse");
  EXPECT_NE(model["task_how"].get<std::string>().find("not evaluated: its sequences of 65536 tokens"), std::string::npos);
  const std::string name = std::filesystem::path(path).filename().string();
  const auto [status, answer] = ask(api, {{"text", "a b | b a"}, {"model", name}});
  EXPECT_EQ(status, 200) << answer.dump();
  EXPECT_EQ(answer["tokens"], json({"a", "b", "|", "b", "a"}));
  EXPECT_EQ(error_of(api, json({{"text", "The cat"}, {"model", name}}).dump()),
            "model \"" + name + "\" cannot run this text (token 'The' is not in the model's vocabulary (a-d and |)), and "
            "its task's examples have 65536 tokens, more than the 64 the explorer shows: type a text of its vocabulary");
}

TEST_F(ExplorerModel, RepeatedNamesAndMissingFilesRefuseToStart) {
  EXPECT_THROW(ExplorerApi({path_, path_}, ServeLimits{}), Error);
  EXPECT_THROW(ExplorerApi({path_ + ".missing"}, ServeLimits{}), Error);
}

// ---- Computation slots

// Waiters take a freed slot in the order they arrived, and one whose wait runs out leaves the
// line without holding up those behind it. Waiter 1 gives up after `give_up` of real time; the
// round proves something only if waiters 2 and 3 joined the line before that, so a line-up that
// took longer than half of it (a loaded machine, a sanitizer build) is undone and the round run
// again with 10 times the wait. The last round's assertions run whatever its timing.
TEST(FairSlots, FirstComeFirstServedAndTimeoutsLeaveTheLine) {
  using namespace std::chrono_literals;
  using Clock = std::chrono::steady_clock;
  FairSlots slots(1);
  ASSERT_TRUE(slots.acquire_for(0s));
  EXPECT_FALSE(slots.acquire_for(10ms));  // none free: the wait runs out
  const std::vector<double> give_ups = {0.1, 1, 10};
  for (const double give_up : give_ups) {
    const bool last_round = give_up == give_ups.back();
    std::mutex mutex;
    std::vector<int> order;
    std::vector<std::thread> waiters;
    const Clock::time_point start = Clock::now(), half_wait = start + std::chrono::duration_cast<Clock::duration>(
                                                                           std::chrono::duration<double>(give_up / 2));
    for (int i = 0; i < 4; ++i) {
      const auto wait = std::chrono::duration<double>(i == 1 ? give_up : 60);
      waiters.emplace_back([&, i, wait] {
        if (!slots.acquire_for(wait)) return;  // waiter 1 gives up while the slot is still held
        {
          const std::lock_guard<std::mutex> lock(mutex);
          order.push_back(i);
        }
        std::this_thread::sleep_for(1ms);
        slots.release();
      });
      // In line one after another (bounded: a waiter joins within seconds even on a busy machine).
      while (slots.waiting() < static_cast<size_t>(i + 1) && Clock::now() < half_wait) std::this_thread::sleep_for(1ms);
    }
    const bool in_time = slots.waiting() == 4 && Clock::now() < half_wait;
    if (!in_time && !last_round) {  // undo the round: let every waiter through, hold the slot again
      std::cout << "line-up took more than " << give_up / 2 << " s; again with a " << give_up * 10 << " s wait\n";
      slots.release();
      for (std::thread& waiter : waiters) waiter.join();
      ASSERT_TRUE(slots.acquire_for(0s));
      continue;
    }
    EXPECT_TRUE(in_time) << "4 waiters took more than " << give_up / 2 << " s to line up";
    while (slots.waiting() == 4 && Clock::now() < start + std::chrono::duration<double>(give_up + 10)) std::this_thread::sleep_for(1ms);
    EXPECT_EQ(slots.waiting(), 3u);  // waiter 1's wait ran out
    slots.release();
    for (std::thread& waiter : waiters) waiter.join();
    EXPECT_EQ(order, std::vector<int>({0, 2, 3}));
    break;
  }
  EXPECT_TRUE(slots.acquire_for(0s));  // every slot given back
}

// ---- Hugging Face model folders (qkv_make_tiny_model's gpt2, llama, bert; QKV_TINY names their parent)

class ExplorerFolders : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* tiny = std::getenv("QKV_TINY");
    if (tiny == nullptr) return;
    root_ = tiny;
    api_ = std::make_unique<ExplorerApi>(
        std::vector<std::string>{root_ + "/gpt2", root_ + "/llama/", root_ + "/bert"}, ServeLimits{});
  }
  static void TearDownTestSuite() { api_.reset(); }
  void SetUp() override {
    if (!api_) GTEST_SKIP() << "QKV_TINY is not set (ctest sets it to qkv_make_tiny_model's folders)";
  }
  static json ask(const json& request, int status = 200) {
    const ApiResponse answer = api_->attention(request.dump());
    EXPECT_EQ(answer.status, status) << request.dump() << " -> " << answer.body;
    return json::parse(answer.body);
  }
  static std::string root_;
  static std::unique_ptr<ExplorerApi> api_;
};
std::string ExplorerFolders::root_;
std::unique_ptr<ExplorerApi> ExplorerFolders::api_;

std::vector<double> softmax_of(const float* logits, int64_t vocab) {
  const float top = *std::max_element(logits, logits + vocab);
  std::vector<double> p(static_cast<size_t>(vocab));
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) sum += p[static_cast<size_t>(v)] = std::exp(double(logits[v]) - top);
  for (double& x : p) x /= sum;
  return p;
}

TEST_F(ExplorerFolders, ListedWithTheirArchitecture) {
  const json models = json::parse(api_->models().body)["models"];
  ASSERT_EQ(models.size(), 3u);
  const std::vector<std::string> names = {"gpt2", "llama", "bert"};
  for (size_t i = 0; i < 3; ++i) {
    const json& m = models[i];
    EXPECT_EQ(m["name"], names[i]);  // "llama/" named by its folder
    EXPECT_EQ(m["kind"], "pretrained");
    const models::Pretrained p = models::load_pretrained(root_ + "/" + names[i]);
    EXPECT_EQ(m["architecture"], std::string(models::to_string(p.config.architecture)));
    EXPECT_EQ(m["layers"], p.config.num_layers);
    EXPECT_EQ(m["heads"], p.config.num_heads);
    EXPECT_EQ(m["vocab_size"], p.config.vocab_size);
    EXPECT_EQ(m["causal"], names[i] != "bert");
  }
}

TEST_F(ExplorerFolders, EveryLayersHeadsRolesAndTheFirstLayer) {
  for (const std::string name : {"gpt2", "llama", "bert"}) {
    SCOPED_TRACE(name);
    const models::Pretrained p = models::load_pretrained(root_ + "/" + name);
    const json a = ask({{"model", name}, {"text", "the cat sat on the mat"}});
    const auto n = a["tokens"].size();
    EXPECT_EQ(a["ids"].get<std::vector<int64_t>>(), encode_text(p, "the cat sat on the mat"));
    ASSERT_EQ(a["layers"].size(), static_cast<size_t>(p.config.num_layers));
    int64_t most = -1, first = -1;
    for (size_t l = 0; l < a["layers"].size(); ++l) {
      const json& layer = a["layers"][l];
      ASSERT_EQ(layer["weights"].size(), static_cast<size_t>(p.config.num_heads));
      ASSERT_EQ(layer["roles"].size(), static_cast<size_t>(p.config.num_heads));
      int64_t named = 0;
      for (const json& role : layer["roles"]) {
        EXPECT_TRUE(role["scores"].contains("induction"));
        if (role["role"] != "-" && role["role"] != "broad") ++named;
      }
      if (named > most) most = named, first = static_cast<int64_t>(l);
      for (const json& head : layer["weights"]) {
        ASSERT_EQ(head.size(), n);
        for (size_t i = 0; i < n; ++i) {
          ASSERT_EQ(head[i].size(), n);
          double sum = 0;
          for (size_t j = 0; j < n; ++j) {
            sum += head[i][j].get<double>();
            if (a["visible"][i].get<std::string>()[j] == '0') EXPECT_EQ(head[i][j].get<double>(), 0.0);
          }
          EXPECT_NEAR(sum, 1.0, 1e-3);
        }
      }
    }
    EXPECT_EQ(a["first_layer"], first);
    EXPECT_EQ(a["mask"], name == "bert" ? "none" : "causal");
    EXPECT_EQ(a["visible"][0].get<std::string>()[n - 1], name == "bert" ? '1' : '0');
  }
}

TEST_F(ExplorerFolders, PredictionsAreTheSoftmaxOfTheModelsLogits) {
  {
    const models::Pretrained p = models::load_pretrained(root_ + "/gpt2");
    const json a = ask({{"model", "gpt2"}, {"text", "the cat sat"}});
    const std::vector<int64_t> ids = a["ids"];
    const models::ModelOutput out = p.model.forward(ids);
    const Tensor logits = out.logits.contiguous();
    const std::vector<double> probs =
        softmax_of(logits.data() + (std::ssize(ids) - 1) * p.config.vocab_size, p.config.vocab_size);
    ASSERT_EQ(a["prediction"]["kind"], "next");
    const json& top = a["prediction"]["top"];
    ASSERT_EQ(top.size(), 5u);
    const double best = *std::max_element(probs.begin(), probs.end());
    EXPECT_NEAR(top[0]["p"].get<double>(), best, 1e-6);
    for (size_t r = 0; r < 5; ++r) {
      EXPECT_NEAR(top[r]["p"].get<double>(), probs[top[r]["id"].get<size_t>()], 1e-6);
      if (r > 0) EXPECT_LE(top[r]["p"].get<double>(), top[r - 1]["p"].get<double>());
    }
  }
  {
    const models::Pretrained p = models::load_pretrained(root_ + "/bert");
    const json a = ask({{"model", "bert"}, {"text", "the cat [MASK] on the mat"}});
    ASSERT_EQ(a["prediction"]["kind"], "fill");
    ASSERT_EQ(a["prediction"]["masks"].size(), 1u);
    const json& fill = a["prediction"]["masks"][0];
    const std::vector<int64_t> ids = a["ids"];
    const auto position = fill["position"].get<int64_t>();
    EXPECT_EQ(ids[static_cast<size_t>(position)], *p.tokenizer->special_tokens().mask);
    const Tensor logits = p.model.forward(ids).logits.contiguous();
    const std::vector<double> probs = softmax_of(logits.data() + position * p.config.vocab_size, p.config.vocab_size);
    for (const json& t : fill["top"]) EXPECT_NEAR(t["p"].get<double>(), probs[t["id"].get<size_t>()], 1e-6);
  }
}

TEST_F(ExplorerFolders, NeuronScoresAreScaledDotsAndTheirSoftmaxIsTheWeightsRow) {
  for (const std::string name : {"gpt2", "llama", "bert"}) {
    SCOPED_TRACE(name);
    const std::string text = "the cat sat on the mat";
    const json a = ask({{"model", name}, {"text", text}});
    const int64_t layers = std::ssize(a["layers"]), heads = std::ssize(a["layers"][0]["weights"]);
    const int64_t n = std::ssize(a["tokens"]);
    for (int64_t layer = 0; layer < layers; ++layer) {
      for (int64_t head : {int64_t{0}, heads - 1}) {
        const int64_t query = n - 2;
        const json b = ask({{"model", name}, {"text", text}, {"neuron", {{"layer", layer}, {"head", head}, {"query", query}}}});
        const json& nr = b["neuron"];
        const auto d = nr["head_dim"].get<size_t>();
        EXPECT_NEAR(nr["scale"].get<double>(), 1 / std::sqrt(double(d)), 1e-12);
        ASSERT_EQ(nr["q"].size(), d);
        ASSERT_EQ(nr["k"].size(), static_cast<size_t>(n));
        double sum = 0;
        for (int64_t j = 0; j < n; ++j) {
          const bool seen = nr["visible"][j];
          EXPECT_EQ(seen, a["visible"][query].get<std::string>()[j] == '1');
          if (!seen) {
            EXPECT_TRUE(nr["scores"][j].is_null());
            EXPECT_EQ(nr["weights"][j].get<double>(), 0.0);
            continue;
          }
          double dot = 0;
          for (size_t e = 0; e < d; ++e) dot += nr["q"][e].get<double>() * nr["k"][j][e].get<double>();
          EXPECT_NEAR(nr["scores"][j].get<double>(), dot / std::sqrt(double(d)), 1e-5);
          sum += nr["weights"][j].get<double>();
          EXPECT_NEAR(nr["weights"][j].get<double>(), a["layers"][layer]["weights"][head][query][j].get<double>(), 1e-3);
        }
        EXPECT_NEAR(sum, 1.0, 1e-9);
      }
    }
  }
}

TEST_F(ExplorerFolders, BadInputIsA400AndNamesTheProblem) {
  const auto error_of = [](const json& request) { return ask(request, 400)["error"].get<std::string>(); };
  EXPECT_NE(error_of({{"model", "gpt3"}, {"text", "the"}}).find("unknown model \"gpt3\""), std::string::npos);
  EXPECT_NE(error_of({{"model", "gpt2"}, {"text", std::string(150, 'a') + " b c d e f g h"}}).find("at most"),
            std::string::npos);
  std::string words;
  for (int i = 0; i < 70; ++i) words += "the ";
  EXPECT_NE(error_of({{"model", "bert"}, {"text", words}}).find("the explorer shows at most 64"), std::string::npos);
  EXPECT_NE(error_of({{"model", "gpt2"}, {"ids", {1, 2, 999999}}}).find("not a token id"), std::string::npos);
  EXPECT_NE(error_of({{"model", "gpt2"}, {"ids", {-1}}}).find("not a token id"), std::string::npos);
  EXPECT_NE(error_of({{"model", "gpt2"}, {"ids", {1.5}}}).find("not a token id"), std::string::npos);
  EXPECT_NE(error_of({{"model", "gpt2"}, {"ids", {uint64_t{1} << 63}}}).find("not a token id"), std::string::npos);
  EXPECT_NE(error_of({{"model", "gpt2"}, {"ids", "1 2"}}).find("must be a list"), std::string::npos);
  EXPECT_NE(error_of({{"model", "gpt2"}, {"ids", json::array()}}).find("empty"), std::string::npos);
  EXPECT_NE(error_of({{"model", "gpt2"}, {"text", "a"}, {"ids", {1}}}).find("not both"), std::string::npos);
  EXPECT_NE(error_of({{"model", "gpt2"}, {"text", "the"}, {"heads", 4}}).find("does not apply"), std::string::npos);
  EXPECT_NE(error_of({{"model", "gpt2"}, {"text", "the cat"}, {"neuron", {{"layer", 9}, {"head", 0}, {"query", 0}}}})
                .find("\"layer\" must be between 0 and"),
            std::string::npos);
  EXPECT_NE(error_of({{"model", "gpt2"}, {"text", "the cat"}, {"neuron", {{"layer", 0}, {"head", 0}}}}).find("query"),
            std::string::npos);
  EXPECT_NE(error_of({{"text", "the cat"}, {"neuron", {{"layer", 0}}}}).find("model folder"), std::string::npos);
  // Bytes that are not UTF-8: the JSON parser refuses them before the tokenizer sees them.
  const ApiResponse raw = api_->attention(std::string("{\"model\": \"gpt2\", \"text\": \"a\xff\xfe b\"}"));
  EXPECT_EQ(raw.status, 400);
  EXPECT_TRUE(json::parse(raw.body).contains("error"));
  // Token ids given directly run like text.
  const json ok = ask({{"model", "gpt2"}, {"ids", {10, 11, 12}}});
  EXPECT_EQ(ok["tokens"].size(), 3u);
}


}  // namespace
}  // namespace qkv::cli
