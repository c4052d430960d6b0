// libFuzzer target: the JSON API of `qkv serve` (tools/qkv/serve_api.hpp), through the very
// functions the HTTP handlers of serve.cpp call, without a socket. Input byte 0 picks the route,
// the rest is what a client controls there:
//   0-5  POST /api/attention, the rest as its body (ExplorerApi::attention)
//   6    GET /api/models (ExplorerApi::models; the rest unused)
//   7    the rest as a Host header (HostAllowList::allows, which must let through exactly the
//        listed names, and is_loopback_host) and as the path of an unknown route, which the
//        server's error handler quotes escaped in its JSON answer (escaped_text, error_json)
// The server has one model file loaded ("fuzz.qkv", a 2-layer model written at start-up), so
// "model" requests run a trained model's forward pass too.
//
// Every answer must be well formed: status 200 or 400 (500 is an exception the API did not
// expect), a body that parses as JSON; a 400 is {"error": "<message>"}; a 200 has the shapes
// serve_api.hpp documents (heads x n x n weights, one entropy per head, n tokens) with every
// weight a finite number in [0, 1] and every row summing to 1 or, when the mask hides all its
// keys, 0. Nothing may throw out of the API, crash, or trip ASan/UBSan.
//
// Bounded work: the API runs with limits smaller than `qkv serve`'s defaults (at most 16 tokens,
// 4 heads, embed 64, a 4 KiB body), so no input can ask for a large attention and each
// execution stays in milliseconds; the limit checks are the same code either way.
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "qkv/qkv.hpp"
#include "qkv/train.hpp"
#include "serve_api.hpp"
#include "serve_hosts.hpp"

namespace {

using nlohmann::json;
using qkv::cli::ApiResponse;

std::unique_ptr<qkv::cli::ExplorerApi> g_api;

[[noreturn]] void fail(const std::string& input, const std::string& what) {
  std::fprintf(stderr, "fuzz_explorer_api: %s\ninput: %s\n", what.c_str(), input.c_str());
  std::abort();
}

json parsed(const std::string& input, const ApiResponse& response) {
  try {
    return json::parse(response.body);
  } catch (const json::exception& e) {
    fail(input, "the answer is not JSON (" + std::string(e.what()) + "): " + response.body);
  }
}

// Each row of an (n, n) matrix of weights: finite numbers in [0, 1] summing to 1 or 0.
void check_rows(const std::string& input, const json& rows, size_t n) {
  if (!rows.is_array() || rows.size() != n) fail(input, "a head's weights are not n rows");
  for (const json& row : rows) {
    if (!row.is_array() || row.size() != n) fail(input, "a row of weights is not n numbers");
    double sum = 0;
    for (const json& w : row) {
      if (!w.is_number() || !std::isfinite(w.get<double>()) || w.get<double>() < 0 || w.get<double>() > 1) {
        fail(input, "a weight that is not a number in [0, 1]: " + w.dump());
      }
      sum += w.get<double>();
    }
    // Weights travel rounded to 4 significant digits: a row sums to 1 within 1e-3.
    if (std::abs(sum - 1) > 1e-3 && sum != 0) fail(input, "a row summing to " + std::to_string(sum));
  }
}

// One layer's weights (heads x n x n) and entropies (one finite number per head).
void check_heads(const std::string& input, const json& weights, const json& entropy, size_t n) {
  if (!weights.is_array() || weights.empty()) fail(input, "no heads");
  for (const json& head : weights) check_rows(input, head, n);
  if (!entropy.is_array() || entropy.size() != weights.size()) fail(input, "not one entropy per head");
  for (const json& e : entropy) {
    if (!e.is_number() || !std::isfinite(e.get<double>()) || e.get<double>() < -1e-6) {
      fail(input, "an entropy that is not a finite number >= 0: " + e.dump());
    }
  }
}

void check_attention(const std::string& body) {
  const ApiResponse response = g_api->attention(body);  // documented never to throw
  const json answer = parsed(body, response);
  if (response.status == 400) {
    if (!answer.is_object() || answer.size() != 1 || !answer.contains("error") || !answer["error"].is_string() ||
        answer["error"].get<std::string>().empty()) {
      fail(body, "a 400 that is not {\"error\": message}: " + response.body);
    }
    return;
  }
  if (response.status != 200) fail(body, "status " + std::to_string(response.status) + ": " + response.body);
  if (!answer.is_object() || !answer.contains("tokens") || !answer["tokens"].is_array()) fail(body, "no tokens");
  const size_t n = answer["tokens"].size();
  const auto& limits = g_api->limits();
  if (n < 1 || n > static_cast<size_t>(limits.max_tokens)) fail(body, "token count outside the limits");
  if (answer.contains("layers")) {  // a model's answer
    if (!answer["layers"].is_array() || answer["layers"].empty()) fail(body, "no layers");
    for (const json& layer : answer["layers"]) check_heads(body, layer.value("weights", json()), layer.value("entropy", json()), n);
  } else {
    check_heads(body, answer.value("weights", json()), answer.value("entropy", json()), n);
    if (answer["weights"].size() != answer.value("heads", json()).get<size_t>()) fail(body, "not \"heads\" heads");
    check_rows(body, answer.value("average", json()), n);
  }
  // "visible": n strings of n '0'/'1'; no weight where the mask hides the pair.
  const json visible = answer.value("visible", json());
  if (!visible.is_array() || visible.size() != n) fail(body, "\"visible\" is not n rows");
  for (const json& row : visible) {
    if (!row.is_string() || row.get<std::string>().size() != n ||
        row.get<std::string>().find_first_not_of("01") != std::string::npos) {
      fail(body, "a row of \"visible\" is not n '0'/'1': " + row.dump());
    }
  }
  const json& heads = answer.contains("layers") ? answer["layers"][0]["weights"] : answer["weights"];
  for (const json& head : heads)
    for (size_t i = 0; i < n; ++i)
      for (size_t j = 0; j < n; ++j)
        if (visible[i].get<std::string>()[j] == '0' && head[i][j].get<double>() != 0) fail(body, "a weight on a hidden pair");
}

// The Host allow-list of a server on 127.0.0.1:8080 lets through exactly its six spellings (any
// case), whatever the bytes; is_loopback_host must simply return.
void check_host(const std::string& host) {
  static const qkv::cli::HostAllowList hosts("127.0.0.1", 8080, {});
  std::string lower = host;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const bool listed = lower == "127.0.0.1" || lower == "127.0.0.1:8080" || lower == "localhost" ||
                      lower == "localhost:8080" || lower == "[::1]" || lower == "[::1]:8080";
  if (hosts.allows(host) != listed) fail(host, listed ? "a listed Host refused" : "an unlisted Host allowed");
  (void)qkv::cli::is_loopback_host(host);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  qkv::set_memory_limit(int64_t{256} << 20);
  // A copy-task model of length 3 over 4 symbols (as tests/serve/test_serve_api.cpp), named
  // fuzz.qkv in a folder of its own; it is read once here and the file removed.
  const std::filesystem::path folder =
      std::filesystem::temp_directory_path() / ("qkv_fuzz_explorer_api_" + std::to_string(::getpid()));
  std::filesystem::create_directories(folder);
  const std::string path = (folder / "fuzz.qkv").string();
  qkv::train::AttentionModel({.vocab_size = 5, .max_len = 6, .d_model = 16, .num_heads = 2, .num_layers = 2}, 1).save(path);
  qkv::cli::ServeLimits limits;
  limits.max_body_bytes = 4096;
  limits.max_text_bytes = 256;
  limits.max_tokens = 16;
  limits.max_heads = 4;
  limits.max_embed = 64;
  g_api = std::make_unique<qkv::cli::ExplorerApi>(std::vector<std::string>{path}, limits);
  std::filesystem::remove_all(folder);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const int route = data[0] % 8;
  if (route <= 5) {
    check_attention(rest);
  } else if (route == 6) {
    const ApiResponse response = g_api->models();
    if (response.status != 200 || parsed(rest, response)["models"].size() != 1) fail(rest, "GET /api/models: " + response.body);
  } else {
    check_host(rest);
    const ApiResponse response{404, qkv::cli::error_json("no such page or API: GET " + qkv::cli::escaped_text(rest))};
    const json answer = parsed(rest, response);
    if (!answer.is_object() || !answer.contains("error") || !answer["error"].is_string()) {
      fail(rest, "error_json did not give {\"error\": text}");
    }
    for (const char c : answer["error"].get<std::string>()) {
      if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) fail(rest, "a control character in an error message");
    }
  }
  return 0;
}
