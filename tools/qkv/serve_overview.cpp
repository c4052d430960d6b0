// POST /api/overview (serve_overview.hpp): a model folder's layer over a long document, as
// attention summaries (qkv::AttentionOptions::summary_top_k) turned into JSON.
#include "serve_overview.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pretrained.hpp"
#include "qkv/attention.hpp"
#include "qkv/error.hpp"

namespace qkv::cli {
namespace {

using nlohmann::json;

struct BadOverview : std::exception {
  std::string message;
  explicit BadOverview(std::string m) : message(std::move(m)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

const std::set<std::string> kOverviewFields = {"model", "ids", "text", "layer", "top_k", "links", "collectors"};

std::string shown(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  return text.size() > 40 ? text.substr(0, 37) + "..." : text;
}

int64_t whole_field(const json& request, const char* name, int64_t fallback, int64_t low, int64_t high) {
  if (!request.contains(name) || request[name].is_null()) return fallback;
  const json& value = request[name];
  // JSON's non-negative integers parse as unsigned: compared as such first (2^64 - 1 is no -1).
  const bool in_range = value.is_number_integer() &&
                        (!value.is_number_unsigned() || value.get<uint64_t>() <= static_cast<uint64_t>(high)) &&
                        value.get<int64_t>() >= low && value.get<int64_t>() <= high;
  if (!in_range) throw BadOverview(fmt::format("\"{}\" must be a whole number from {} to {}, got {}", name, low, high, shown(value)));
  return value.get<int64_t>();
}

json parse_overview(const std::string& body) {
  if (body.size() > kMaxOverviewBodyBytes)
    throw BadOverview(fmt::format("request body has {} bytes; the limit is {}", body.size(), kMaxOverviewBodyBytes));
  json request;
  try {
    request = json::parse(body);
  } catch (const json::exception& e) {
    throw BadOverview(std::string("malformed JSON: ") + e.what());
  }
  if (!request.is_object()) throw BadOverview(fmt::format("the body must be a JSON object, got {}", shown(request)));
  for (const auto& [key, value] : request.items())
    if (!kOverviewFields.contains(key))
      throw BadOverview(fmt::format("unknown field \"{}\"; the fields are model, ids or text, layer, top_k, links, "
                                    "collectors", escaped_text(key)));
  if (!request.contains("model") || !request["model"].is_string())
    throw BadOverview("\"model\" must name a model folder the server was started with (--model DIR)");
  return request;
}

const LoadedPretrained& overview_model(const ExplorerApi& api, const std::string& name) {
  std::string names;
  for (const LoadedPretrained& loaded : api.loaded_pretrained()) {
    if (loaded.name == name) return loaded;
    names += (names.empty() ? "" : ", ") + loaded.name;
  }
  throw BadOverview(fmt::format("unknown model folder \"{}\"; the overview reads model folders, and the server has {}",
                                escaped_text(name), names.empty() ? "none" : names));
}

// The document's ids: "ids" as given or "text" through the tokenizer, 1 to the limit.
std::vector<int64_t> overview_ids(const json& request, const models::Pretrained& p, const std::string& name) {
  const int64_t most = std::min(kMaxOverviewTokens, p.config.max_positions);
  std::vector<int64_t> ids;
  if (request.contains("ids") == request.contains("text")) throw BadOverview("give \"ids\" or \"text\", one of them");
  if (request.contains("text")) {
    if (!request["text"].is_string()) throw BadOverview(fmt::format("\"text\" must be a string, got {}", shown(request["text"])));
    ids = encode_text(p, request["text"].get<std::string>());
  } else {
    const json& list = request["ids"];
    if (!list.is_array()) throw BadOverview(fmt::format("\"ids\" must be a list of token ids, got {}", shown(list)));
    for (const json& id : list) {
      const bool known = id.is_number_integer() && !(id.is_number_unsigned() && id.get<uint64_t>() > INT64_MAX) &&
                         id.get<int64_t>() >= 0 && id.get<int64_t>() < p.config.vocab_size;
      if (!known)
        throw BadOverview(fmt::format("\"ids\": {} is not a token id of model \"{}\", whose vocabulary is [0, {})",
                                      shown(id), name, p.config.vocab_size));
      ids.push_back(id.get<int64_t>());
    }
  }
  if (ids.empty()) throw BadOverview("the document has no tokens");
  if (static_cast<int64_t>(ids.size()) > most)
    throw BadOverview(fmt::format("the document has {} tokens; the overview of model \"{}\" takes at most {}", ids.size(),
                                  name, most));
  return ids;
}

double rounded(double x, double step) { return std::round(x / step) * step; }
double significant(double x) {
  if (x == 0 || !std::isfinite(x)) return 0;
  const double step = std::pow(10.0, std::floor(std::log10(std::abs(x))) - 3);
  return rounded(x, step);
}

// Head h's strongest `count` links among its rows' top keys: [[query, key, weight]], by weight.
json head_links(const AttentionResult& r, int64_t h, int64_t n, int64_t k, int64_t count) {
  const float* weights = r.top_weights.data() + h * n * k;
  const int64_t* keys = r.top_keys.data() + h * n * k;
  std::vector<int64_t> order(static_cast<size_t>(n * k));
  std::iota(order.begin(), order.end(), 0);
  const size_t kept = std::min(order.size(), static_cast<size_t>(count));
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kept), order.end(),
                    [&](int64_t a, int64_t b) { return weights[a] > weights[b] || (weights[a] == weights[b] && a < b); });
  json links = json::array();
  for (size_t x = 0; x < kept; ++x) {
    const int64_t e = order[x];
    if (keys[e] < 0) break;
    links.push_back({e / k, keys[e], rounded(weights[e], 1e-4)});
  }
  return links;
}

json overview_json(const json& request, const LoadedPretrained& loaded) {
  const models::Pretrained& p = *loaded.model;
  const models::ModelConfig& c = p.config;
  const int64_t layer = whole_field(request, "layer", 0, 0, c.num_layers - 1);
  const int64_t top_k = whole_field(request, "top_k", 8, 1, 32);
  const int64_t link_count = whole_field(request, "links", 200, 1, 4096);
  const int64_t collector_count = whole_field(request, "collectors", 16, 1, 256);
  const std::vector<int64_t> ids = overview_ids(request, p, loaded.name);
  const int64_t n = static_cast<int64_t>(ids.size());

  const models::QueryKeys qk = p.model.query_keys(ids, layer);
  AttentionOptions options;
  const int64_t window = c.is_causal() ? c.window_of_layer(layer) : 0;
  if (c.is_causal()) options.mask = window > 0 ? Mask::window(window - 1, 0) : Mask::causal();
  options.scale = static_cast<float>(qk.scale);
  options.summary_top_k = top_k;
  const Tensor q = qk.queries.unsqueeze(0), k = qk.keys.unsqueeze(0);
  const Tensor v = Tensor::zeros(Shape{1, k.size(1), n, 1});  // the output is not wanted: one zero column
  const AttentionResult r = scaled_dot_product_attention(q, k, v, options);

  const int64_t heads = q.size(1);
  json entropy = json::array(), received = json::array(), links = json::array(), collectors = json::array();
  for (int64_t h = 0; h < heads; ++h) {
    const float* e = r.entropy.data() + h * n;
    const float* mass = r.received.data() + h * n;
    json e_row = json::array(), m_row = json::array();
    for (int64_t i = 0; i < n; ++i) {
      e_row.push_back(rounded(e[i], 1e-3));
      m_row.push_back(significant(mass[i]));
    }
    entropy.push_back(std::move(e_row));
    received.push_back(std::move(m_row));
    links.push_back(head_links(r, h, n, top_k, link_count));
    std::vector<int64_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    const size_t kept = std::min(order.size(), static_cast<size_t>(collector_count));
    std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(kept), order.end(),
                      [&](int64_t a, int64_t b) { return mass[a] > mass[b] || (mass[a] == mass[b] && a < b); });
    json top = json::array();
    for (size_t x = 0; x < kept; ++x) top.push_back({order[x], significant(mass[order[x]])});
    collectors.push_back(std::move(top));
  }
  json uniform = json::array();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t seen = !c.is_causal() ? n : window > 0 ? std::min(i + 1, window) : i + 1;
    uniform.push_back(rounded(std::log(static_cast<double>(seen)), 1e-3));
  }
  return {{"model", loaded.name}, {"layer", layer}, {"layers", c.num_layers}, {"n", n}, {"heads", heads},
          {"kv_heads", k.size(1)}, {"top_k", top_k}, {"mask", c.is_causal() ? "causal" : "none"},
          {"entropy", std::move(entropy)}, {"uniform", std::move(uniform)}, {"received", std::move(received)},
          {"links", std::move(links)}, {"collectors", std::move(collectors)}};
}

}  // namespace

ApiResponse attention_overview(const ExplorerApi& api, const std::string& request_body) {
  try {
    const json request = parse_overview(request_body);
    const LoadedPretrained& loaded = overview_model(api, request["model"].get<std::string>());
    return {200, overview_json(request, loaded).dump(-1, ' ', false, json::error_handler_t::replace)};
  } catch (const BadOverview& e) {
    return {400, error_json(e.message)};
  } catch (const Error& e) {
    return {400, error_json(e.what())};
  } catch (const std::exception& e) {
    return {500, error_json(fmt::format("internal error: {}", e.what()))};
  }
}

}  // namespace qkv::cli
