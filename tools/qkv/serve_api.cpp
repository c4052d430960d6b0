// The JSON API of `qkv serve`; see serve_api.hpp for the requests and answers.
#include "serve_api.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "pretrained.hpp"
#include "qkv/analysis.hpp"
#include "qkv/error.hpp"
#include "qkv/models/head_roles.hpp"

namespace qkv::cli {
namespace {

using nlohmann::json;

// A 400 answer: what the request got wrong.
class BadRequest : public std::exception {
 public:
  explicit BadRequest(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }
  const std::string& message() const { return message_; }  // whole, even past a NUL byte

 private:
  std::string message_;
};

const std::set<std::string> kFields = {"text", "heads", "embed", "seed", "temperature", "mask", "chars", "model", "ids",
                                       "neuron"};

// JSON text; a byte that is not UTF-8 becomes U+FFFD instead of an exception.
std::string dump(const json& value) { return value.dump(-1, ' ', false, json::error_handler_t::replace); }

// A JSON value shown in a message, cut short when long.
std::string shown(const json& value) {
  std::string text = dump(value);
  return text.size() > 40 ? text.substr(0, 37) + "..." : text;
}

// An optional integer field within [low, high]; fallback when absent or null.
int64_t integer_field(const json& request, const std::string& name, int64_t fallback, int64_t low, int64_t high) {
  if (!request.contains(name) || request[name].is_null()) return fallback;
  const json& value = request[name];
  if (!value.is_number_integer()) throw BadRequest(fmt::format("\"{}\" must be a whole number, got {}", name, shown(value)));
  if (value.is_number_unsigned() && value.get<uint64_t>() > static_cast<uint64_t>(high)) {
    throw BadRequest(fmt::format("\"{}\" must be between {} and {}, got {}", name, low, high, shown(value)));
  }
  const auto n = value.get<int64_t>();
  if (n < low || n > high) throw BadRequest(fmt::format("\"{}\" must be between {} and {}, got {}", name, low, high, n));
  return n;
}

// An optional string field; empty when absent or null.
std::string string_field(const json& request, const std::string& name) {
  if (!request.contains(name) || request[name].is_null()) return {};
  if (!request[name].is_string()) throw BadRequest(fmt::format("\"{}\" must be a string, got {}", name, shown(request[name])));
  return request[name].get<std::string>();
}

// A weight rounded to 4 significant digits, as the double nearest that decimal, so it prints
// short ("0.01563", not "0.015625012"): a 64-token, 16-head answer is a third smaller. Each
// weight is then within 0.05% of the library's; a row sums to 1 within 1e-3.
double wire_weight(float weight) {
  char text[32];
  const auto [end, error] = std::to_chars(text, text + sizeof text, static_cast<double>(weight), std::chars_format::general, 4);
  double rounded = 0;
  if (error != std::errc() || std::from_chars(text, end, rounded).ec != std::errc()) return weight;
  return rounded;
}

// (n, n) weights flattened row-major as rows of JSON numbers, rounded by wire_weight.
json rows_json(const std::vector<float>& weights, int64_t n) {
  json rows = json::array();
  for (int64_t i = 0; i < n; ++i) {
    json row = json::array();
    for (int64_t j = 0; j < n; ++j) row.push_back(wire_weight(weights[static_cast<size_t>(i * n + j)]));
    rows.push_back(std::move(row));
  }
  return rows;
}

// Which keys each query may see under `mask`: n strings of n characters, '1' visible and '0'
// masked, so a page can draw a masked pair unlike a weight that is merely near 0.
json visible_json(const Mask& mask, int64_t n) {
  const std::vector<uint8_t> visible = visible_pairs(mask, n);
  json rows = json::array();
  for (int64_t i = 0; i < n; ++i) {
    std::string row(static_cast<size_t>(n), '0');
    for (int64_t j = 0; j < n; ++j) row[static_cast<size_t>(j)] = visible[static_cast<size_t>(i * n + j)] ? '1' : '0';
    rows.push_back(std::move(row));
  }
  return rows;
}

// Each head's mean row entropy (nats), by qkv::analysis::head_entropy.
std::vector<double> entropies(const std::vector<std::vector<float>>& heads, int64_t n) {
  std::vector<float> all;
  for (const auto& head : heads) all.insert(all.end(), head.begin(), head.end());
  const Tensor entropy = analysis::head_entropy(Tensor::from(all, {static_cast<int64_t>(heads.size()), n, n}));
  std::vector<double> out;
  for (float e : entropy.to_vector()) out.push_back(e);
  return out;
}

// Deepest nesting a request may have; a request needs 1. Deeper bodies are refused before
// parsing: nlohmann's dump and destructor recurse once per level, and a 16 KiB body of "["
// would overflow a worker thread's stack.
constexpr int kMaxJsonDepth = 32;

// The deepest [ / { nesting of JSON text, strings skipped (an estimate for malformed text,
// which the parser then refuses anyway).
int json_depth(const std::string& body) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

// The request's JSON object, or a 400 that says what is wrong with the body.
json parse_request(const std::string& body, const ServeLimits& limits) {
  if (body.size() > limits.max_body_bytes) {
    throw BadRequest(fmt::format("request body has {} bytes; the limit is {}", body.size(), limits.max_body_bytes));
  }
  if (body.find_first_not_of(" \t\r\n") == std::string::npos) {
    throw BadRequest("the body is empty: send a JSON object such as {\"text\": \"The cat sat on the mat\"}");
  }
  if (const int depth = json_depth(body); depth > kMaxJsonDepth) {
    throw BadRequest(fmt::format("the body nests {} levels deep; a request is one JSON object of plain fields (at "
                                 "most {} levels)",
                                 depth, kMaxJsonDepth));
  }
  json request;
  try {
    request = json::parse(body);
  } catch (const json::exception& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 2: ..." without the tag;
    // also out_of_range.406, "number overflow parsing '1e400'".
    std::string what = e.what();
    const size_t tag_end = what.find("] ");
    if (tag_end != std::string::npos) what = what.substr(tag_end + 2);
    throw BadRequest("malformed JSON: " + what);
  }
  if (!request.is_object()) throw BadRequest(fmt::format("the body must be a JSON object, got {}", shown(request)));
  for (const auto& [key, value] : request.items()) {
    if (!kFields.contains(key)) {
      throw BadRequest(fmt::format("unknown field \"{}\"; the fields are text, heads, embed, seed, temperature, mask, "
                                   "chars, model, and for a model folder ids and neuron",
                                   escaped_text(key)));
    }
  }
  if (!request.contains("text") && request.contains("ids")) return request;  // a model folder's ids (checked there)
  if (!request.contains("text")) throw BadRequest("\"text\" is missing: give the sentence to attend over");
  if (!request["text"].is_string()) throw BadRequest(fmt::format("\"text\" must be a string, got {}", shown(request["text"])));
  return request;
}

// The request's tokens, checked against the limits.
std::vector<std::string> request_tokens(const json& request, const ServeLimits& limits) {
  const std::string text = request["text"].get<std::string>();
  if (text.size() > limits.max_text_bytes) {
    throw BadRequest(fmt::format("\"text\" has {} bytes; the limit is {}", text.size(), limits.max_text_bytes));
  }
  bool chars = false;
  if (request.contains("chars") && !request["chars"].is_null()) {
    if (!request["chars"].is_boolean()) throw BadRequest(fmt::format("\"chars\" must be true or false, got {}", shown(request["chars"])));
    chars = request["chars"].get<bool>();
  }
  std::vector<std::string> tokens = tokenize(text, chars);
  if (tokens.empty()) throw BadRequest("\"text\" has no tokens: type a sentence, e.g. \"The cat sat on the mat\"");
  if (static_cast<int64_t>(tokens.size()) > limits.max_tokens) {
    throw BadRequest(fmt::format("\"text\" has {} tokens; the explorer shows at most {}", tokens.size(), limits.max_tokens));
  }
  return tokens;
}

double temperature_field(const json& request, const ServeLimits& limits) {
  if (!request.contains("temperature") || request["temperature"].is_null()) return 1.0;
  const json& value = request["temperature"];
  if (!value.is_number()) throw BadRequest(fmt::format("\"temperature\" must be a number, got {}", shown(value)));
  const double t = value.get<double>();
  if (!(t > 0) || !(t <= limits.max_temperature)) {
    throw BadRequest(fmt::format("\"temperature\" must be above 0 and at most {}, got {}", limits.max_temperature, t));
  }
  return t;
}

// The request's mask for n tokens: its expression parsed by the library (qkv::Mask::parse, whose
// errors quote the expression and point at the bad token), padding no longer than the text.
Mask mask_field(const json& request, int64_t n, const ServeLimits& limits) {
  const std::string expression = string_field(request, "mask");
  if (expression.size() > limits.max_mask_chars) {
    throw BadRequest(fmt::format("mask expression has {} characters; the limit is {}", expression.size(),
                                 limits.max_mask_chars));
  }
  // A control character is no part of a mask (whitespace aside); refused here so the message
  // can show it escaped, where the library's would quote it raw and a NUL would end it.
  const auto control = std::find_if(expression.begin(), expression.end(), [](char c) {
    const auto byte = static_cast<unsigned char>(c);
    return (byte < 0x20 || byte == 0x7f) && !std::isspace(byte);
  });
  if (control != expression.end()) {
    throw BadRequest(fmt::format("mask '{}': column {}, found '{}': a control character, not part of a mask",
                                 escaped_text(expression), control - expression.begin() + 1,
                                 escaped_text(std::string(1, *control))));
  }
  Mask mask;
  try {
    mask = Mask::parse(expression);
  } catch (const MaskParseError& e) {
    throw BadRequest(e.what());
  }
  if (mask.has_key_lengths() && mask.lengths().front() > n) {
    throw BadRequest(fmt::format("mask '{}': padding({}) keeps more keys than the {} tokens there are", expression,
                                 mask.lengths().front(), n));
  }
  return mask;
}

// "ids" and "neuron" belong to model folders only.
void refuse_folder_fields(const json& request, const std::string& who) {
  for (const char* field : {"ids", "neuron"}) {
    if (request.contains(field)) {
      throw BadRequest(fmt::format("\"{}\" is for a Hugging Face model folder; {} has none", field, who));
    }
  }
  if (!request.contains("text")) throw BadRequest("\"text\" is missing: give the sentence to attend over");
}

// An untrained layer of `heads` x `embed` on the text's tokens.
json untrained_attention(const json& request, const ServeLimits& limits) {
  refuse_folder_fields(request, "the untrained layer");
  const std::vector<std::string> tokens = request_tokens(request, limits);
  const int64_t heads = integer_field(request, "heads", 8, 1, limits.max_heads);
  const int64_t embed = integer_field(request, "embed", 64, 1, limits.max_embed);
  const auto seed = static_cast<uint64_t>(integer_field(request, "seed", 42, 0, int64_t{1} << 53));
  const double temperature = temperature_field(request, limits);
  const auto n = static_cast<int64_t>(tokens.size());
  const Mask mask = mask_field(request, n, limits);
  if (embed % heads != 0) {
    throw BadRequest(fmt::format("\"embed\" ({}) must be divisible by \"heads\" ({}): each head gets embed / heads dims",
                                 embed, heads));
  }
  const std::vector<std::vector<float>> weights =
      head_weights(make_layer(embed, heads, seed), embed_tokens(tokens, embed, seed), mask, temperature);
  std::vector<float> average(weights.front().size(), 0.0f);
  json heads_json = json::array();
  for (const auto& head : weights) {
    heads_json.push_back(rows_json(head, n));
    for (size_t e = 0; e < average.size(); ++e) average[e] += head[e] / static_cast<float>(heads);
  }
  return {{"tokens", tokens},
          {"weights", std::move(heads_json)},
          {"entropy", entropies(weights, n)},
          {"average", rows_json(average, n)},
          {"average_entropy", mean_entropy(average, n)},
          {"uniform_entropy", std::log(static_cast<double>(n))},
          {"heads", heads},
          {"embed", embed},
          {"seed", seed},
          {"temperature", temperature},
          {"mask", mask.is_none() ? std::string("none") : mask.str()},
          {"visible", visible_json(mask, n)}};
}

// What a model's layers apply: causal, its own mask (train::AttentionModel::forward) and the request's.
Mask model_mask(const LoadedModel& loaded, const Mask& requested) {
  const std::string& own = loaded.model.config().mask;
  Mask mask = Mask::causal() & requested;
  if (!own.empty()) mask &= Mask::parse(own);
  return mask;
}

// A trained model's every layer on the text's tokens when they are in its vocabulary, else on
// one example of its task.
json model_attention(const json& request, const LoadedModel& loaded, const ServeLimits& limits) {
  refuse_folder_fields(request, fmt::format("model \"{}\" (a .qkv file)", loaded.name));
  for (const char* field : {"heads", "embed"}) {
    if (request.contains(field) && !request[field].is_null()) {
      throw BadRequest(fmt::format("\"{}\" describes the untrained layer; model \"{}\" brings its own", field, loaded.name));
    }
  }
  if (temperature_field(request, limits) != 1.0) {
    throw BadRequest(fmt::format("\"temperature\" applies to the untrained layer; model \"{}\" runs as trained (T = 1)",
                                 loaded.name));
  }
  const std::vector<std::string> tokens = request_tokens(request, limits);
  const auto seed = static_cast<uint64_t>(integer_field(request, "seed", 42, 0, int64_t{1} << 53));
  const train::ModelConfig& c = loaded.model.config();
  std::string why_not;
  std::vector<int64_t> ids = text_ids(tokens, loaded.task, c.max_len, why_not);
  std::string note = "on your text: every token is in the model's vocabulary";
  if (ids.empty() && c.max_len > limits.max_tokens) {
    throw BadRequest(fmt::format("model \"{}\" cannot run this text ({}), and its task's examples have {} tokens, more "
                                 "than the {} the explorer shows: type a text of its vocabulary",
                                 loaded.name, escaped_text(why_not), c.max_len, limits.max_tokens));
  }
  if (ids.empty()) {
    ids = train::make_batch(loaded.task.options, 1, train::held_out_seed(seed)).ids;
    note = fmt::format("on one {} example, not your text: {}", loaded.task.name, why_not);
  }
  const auto n = static_cast<int64_t>(ids.size());
  const Mask mask = mask_field(request, n, limits);
  std::vector<Tensor> weights;  // per layer (1, H, n, n)
  {
    const std::lock_guard<std::mutex> lock(*loaded.busy);
    (void)loaded.model.forward(ids, 1, n, mask, &weights);
  }
  json layers = json::array();
  for (const Tensor& layer : weights) {
    const std::vector<std::vector<float>> heads = split_weights_by_head(layer, c.num_heads);
    json heads_json = json::array();
    for (const auto& head : heads) heads_json.push_back(rows_json(head, n));
    layers.push_back({{"weights", std::move(heads_json)}, {"entropy", entropies(heads, n)}});
  }
  std::vector<std::string> labels;
  for (int64_t id : ids) labels.push_back(train::token_text(loaded.task.options, id));
  return {{"model", loaded.name},
          {"task", loaded.task.name},
          {"note", note},
          {"tokens", labels},
          {"layers", std::move(layers)},
          {"uniform_entropy", std::log(static_cast<double>(n))},
          {"seed", seed},
          {"mask", mask.is_none() ? std::string("causal") : (Mask::causal() & mask).str()},
          {"visible", visible_json(model_mask(loaded, mask), n)}};
}

// The task of a model named at start-up, with bounded work. A model whose sequences fit the
// explorer (max_tokens) has its copy-or-reverse question settled by model_task, which runs it on
// 400 examples: at most 400 x max_tokens tokens. A longer one is never run at start-up (a 3 KB
// file may say 65536 tokens, and 400 such examples take minutes): recall is known from the odd
// length alone, and copy or reverse stays undecided; both read the same vocabulary, so the
// text still runs, and the examples model_attention falls back on are too long to show anyway.
ModelTask explorer_task(const train::AttentionModel& model, const ServeLimits& limits) {
  const int64_t n = model.config().max_len;
  if (n <= limits.max_tokens || n % 2 == 1) return model_task(model, "", 0);
  ModelTask task = model_task(model, "copy", 0);  // checks the vocabulary and the length only
  task.name = "copy or reverse";
  task.how = fmt::format("not evaluated: its sequences of {} tokens are longer than the {} the explorer shows", n,
                         limits.max_tokens);
  return task;
}

// ---- Hugging Face model folders

// The request's ids for a folder: "text" through its tokenizer (special tokens added, as the
// model expects), or "ids" as given; within the explorer's tokens and the model's positions.
std::vector<int64_t> folder_ids(const json& request, const LoadedPretrained& loaded, const ServeLimits& limits) {
  const models::Pretrained& p = *loaded.model;
  const int64_t most = std::min<int64_t>(limits.max_tokens, p.config.max_positions);
  std::vector<int64_t> ids;
  if (request.contains("ids")) {
    if (request.contains("text")) throw BadRequest("give \"text\" or \"ids\", not both");
    const json& list = request["ids"];
    if (!list.is_array()) throw BadRequest(fmt::format("\"ids\" must be a list of token ids, got {}", shown(list)));
    if (static_cast<int64_t>(list.size()) > most) {
      throw BadRequest(fmt::format("\"ids\" has {} tokens; the explorer shows at most {} for model \"{}\"", list.size(),
                                   most, loaded.name));
    }
    const int64_t vocab = p.config.vocab_size;
    for (const json& id : list) {
      const bool known = id.is_number_integer() && (id.is_number_unsigned()
                                                        ? id.get<uint64_t>() < static_cast<uint64_t>(vocab)
                                                        : id.get<int64_t>() >= 0 && id.get<int64_t>() < vocab);
      if (!known) {
        throw BadRequest(fmt::format("\"ids\": {} is not a token id of model \"{}\", whose vocabulary is [0, {})",
                                     shown(id), loaded.name, p.config.vocab_size));
      }
      ids.push_back(id.get<int64_t>());
    }
    if (ids.empty()) throw BadRequest("\"ids\" is empty: give at least one token id");
    return ids;
  }
  const std::string text = request["text"].get<std::string>();
  if (text.size() > limits.max_text_bytes) {
    throw BadRequest(fmt::format("\"text\" has {} bytes; the limit is {}", text.size(), limits.max_text_bytes));
  }
  if (!is_utf8(text)) throw BadRequest("\"text\" is not UTF-8 text");
  ids = encode_text(p, text);  // qkv::Error (a 400) when the tokenizer and the model disagree
  if (static_cast<int64_t>(ids.size()) > most) {
    throw BadRequest(fmt::format("\"text\" has {} tokens for model \"{}\"; the explorer shows at most {}{}", ids.size(),
                                 loaded.name, most,
                                 most < limits.max_tokens ? " (the model's positions)" : ""));
  }
  return ids;
}

// Which keys each query of a folder's model sees: causal (layer 0's sliding window, if any) or all.
Mask folder_mask(const models::ModelConfig& c) {
  if (!c.is_causal()) return Mask();
  const int64_t window = c.window_of_layer(0);
  return window > 0 ? Mask::window(window - 1, 0) : Mask::causal();
}

// The `count` most likely of `logits` (vocab) under softmax: [{"id", "token", "p"}].
json top_tokens(const float* logits, int64_t vocab, const models::Tokenizer& tokenizer, int count) {
  const float top = *std::max_element(logits, logits + vocab);
  double sum = 0;
  for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(logits[v]) - top);
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  for (int64_t v = 0; v < vocab; ++v) order[static_cast<size_t>(v)] = v;
  const auto k = std::min<int64_t>(count, vocab);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  json list = json::array();
  for (int64_t r = 0; r < k; ++r) {
    const int64_t id = order[static_cast<size_t>(r)];
    const bool known = id < tokenizer.vocab_size();
    list.push_back({{"id", id},
                    {"token", known ? token_labels(tokenizer, {id}).front() : fmt::format("#{}", id)},
                    {"p", std::exp(static_cast<double>(logits[id]) - top) / sum}});
  }
  return list;
}

// The model's prediction: the next token's top 5 (causal LM), each [MASK]'s top 5 fills (BERT
// MLM), or null (a BertModel has no head).
json folder_prediction(const models::Pretrained& p, const models::ModelOutput& out, const std::vector<int64_t>& ids) {
  const models::ModelConfig& c = p.config;
  if (!c.has_lm_head()) return nullptr;
  const auto n = static_cast<int64_t>(ids.size());
  const Tensor logits = out.logits.contiguous();  // (1, n, V)
  const float* row0 = logits.data();
  if (c.is_causal()) {
    return {{"kind", "next"}, {"top", top_tokens(row0 + (n - 1) * c.vocab_size, c.vocab_size, *p.tokenizer, 5)}};
  }
  json masks = json::array();
  const std::optional<int64_t> mask = p.tokenizer->special_tokens().mask;
  for (int64_t i = 0; i < n && mask; ++i) {
    if (ids[static_cast<size_t>(i)] != *mask) continue;
    masks.push_back({{"position", i}, {"top", top_tokens(row0 + i * c.vocab_size, c.vocab_size, *p.tokenizer, 5)}});
  }
  return {{"kind", "fill"},
          {"mask_token", mask ? p.tokenizer->id_to_token(*mask) : std::string()},
          {"masks", std::move(masks)}};
}

json role_scores_json(const models::HeadRoleScores& r) {
  return {{"role", std::string(models::to_string(r.role))},
          {"scores",
           {{"previous-token", r.previous_token},
            {"first-token", r.first_token},
            {"self", r.self},
            {"induction", r.induction},
            {"broad", r.broad}}}};
}

// Every layer's heads on the request's tokens, their roles, the prediction and the layer to show first.
json folder_attention(const json& request, const LoadedPretrained& loaded, const ServeLimits& limits) {
  const models::Pretrained& p = *loaded.model;
  const models::ModelConfig& c = p.config;
  const std::vector<int64_t> ids = folder_ids(request, loaded, limits);
  const auto n = static_cast<int64_t>(ids.size());
  const models::ModelOutput out = p.model.forward(ids, /*need_attention=*/true);
  std::vector<models::HeadRoleScores> roles;
  if (n >= 2) roles = loaded.cache->roles(p, ids, out.attention);  // measure_roles', its repeated half cached
  std::vector<int64_t> named(static_cast<size_t>(c.num_layers), 0);
  for (const auto& r : roles)
    if (r.role != models::HeadRole::None && r.role != models::HeadRole::Broad) ++named[static_cast<size_t>(r.layer)];
  const auto first = std::max_element(named.begin(), named.end()) - named.begin();
  json layers = json::array();
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const Tensor weights = out.attention[static_cast<size_t>(l)].contiguous();  // (1, H, n, n)
    std::vector<std::vector<float>> heads;
    json heads_json = json::array(), roles_json = json::array();
    for (int64_t h = 0; h < c.num_heads; ++h) {
      heads.emplace_back(weights.data() + h * n * n, weights.data() + (h + 1) * n * n);
      heads_json.push_back(rows_json(heads.back(), n));
    }
    for (const auto& r : roles)
      if (r.layer == l) roles_json.push_back(role_scores_json(r));
    layers.push_back(
        {{"weights", std::move(heads_json)}, {"entropy", entropies(heads, n)}, {"roles", std::move(roles_json)}});
  }
  const Mask mask = folder_mask(c);
  return {{"model", loaded.name},
          {"kind", "pretrained"},
          {"architecture", std::string(models::to_string(c.architecture))},
          {"task", c.is_causal() ? "next token" : c.has_lm_head() ? "fill [MASK]" : "encoder"},
          {"note", fmt::format("{}: {} layers x {} heads on your text's {} tokens", models::to_string(c.architecture),
                               c.num_layers, c.num_heads, n)},
          {"tokens", token_labels(*p.tokenizer, ids)},
          {"ids", ids},
          {"layers", std::move(layers)},
          {"first_layer", first},
          {"first_layer_why",
           roles.empty() ? std::string("one token: no roles measured")
                         : fmt::format("layer {} has the most heads with a named role (broad aside): {} of {}", first,
                                       named[static_cast<size_t>(first)], c.num_heads)},
          {"prediction", folder_prediction(p, out, ids)},
          {"uniform_entropy", std::log(static_cast<double>(n))},
          {"mask", mask.is_none() ? std::string("none") : mask.str()},
          {"visible", visible_json(mask, n)}};
}

// One query row of one head, step by step: q, every key's k, the scores, the softmax.
json folder_neuron(const json& request, const LoadedPretrained& loaded, const ServeLimits& limits) {
  const models::Pretrained& p = *loaded.model;
  const models::ModelConfig& c = p.config;
  const std::vector<int64_t> ids = folder_ids(request, loaded, limits);
  const auto n = static_cast<int64_t>(ids.size());
  const json& spec = request["neuron"];
  if (!spec.is_object()) {
    throw BadRequest(fmt::format("\"neuron\" must be {{\"layer\", \"head\", \"query\"}}, got {}", shown(spec)));
  }
  for (const auto& [key, value] : spec.items()) {
    if (key != "layer" && key != "head" && key != "query") {
      throw BadRequest(
          fmt::format("unknown field \"neuron.{}\"; its fields are layer, head and query", escaped_text(key)));
    }
  }
  for (const char* key : {"layer", "head", "query"})
    if (!spec.contains(key)) throw BadRequest(fmt::format("\"neuron.{}\" is missing", key));
  const int64_t layer = integer_field(spec, "layer", 0, 0, c.num_layers - 1);
  const int64_t head = integer_field(spec, "head", 0, 0, c.num_heads - 1);
  const int64_t query = integer_field(spec, "query", 0, 0, n - 1);
  const std::shared_ptr<const models::QueryKeys> cached = loaded.cache->query_keys(p, ids, layer);
  const models::QueryKeys& qk = *cached;
  const int64_t d = c.head_dim, kv_head = head / (c.num_heads / c.num_kv_heads);
  const Tensor q_all = qk.queries.contiguous(), k_all = qk.keys.contiguous();
  const float* q = q_all.data() + (head * n + query) * d;
  const std::vector<uint8_t> visible = visible_pairs(folder_mask(c), n);
  json k_rows = json::array(), scores = json::array(), visible_json_row = json::array();
  std::vector<double> score(static_cast<size_t>(n));
  double top = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* k = k_all.data() + (kv_head * n + j) * d;
    k_rows.push_back(std::vector<float>(k, k + d));
    double dot = 0;
    for (int64_t e = 0; e < d; ++e) dot += static_cast<double>(q[e]) * k[e];
    score[static_cast<size_t>(j)] = dot * qk.scale;
    const bool seen = visible[static_cast<size_t>(query * n + j)] != 0;
    visible_json_row.push_back(seen);
    scores.push_back(seen ? json(score[static_cast<size_t>(j)]) : json(nullptr));
    if (seen) top = std::max(top, score[static_cast<size_t>(j)]);
  }
  json exps = json::array(), weights = json::array();
  double sum = 0;
  std::vector<double> e(static_cast<size_t>(n), 0.0);
  for (int64_t j = 0; j < n; ++j)
    if (visible[static_cast<size_t>(query * n + j)]) sum += e[static_cast<size_t>(j)] = std::exp(score[static_cast<size_t>(j)] - top);
  for (int64_t j = 0; j < n; ++j) {
    exps.push_back(e[static_cast<size_t>(j)]);
    weights.push_back(e[static_cast<size_t>(j)] / sum);
  }
  return {{"model", loaded.name},
          {"tokens", token_labels(*p.tokenizer, ids)},
          {"neuron",
           {{"layer", layer},
            {"head", head},
            {"kv_head", kv_head},
            {"query", query},
            {"head_dim", d},
            {"scale", qk.scale},
            {"q", std::vector<float>(q, q + d)},
            {"k", std::move(k_rows)},
            {"visible", std::move(visible_json_row)},
            {"scores", std::move(scores)},
            {"max", top},
            {"exp", std::move(exps)},
            {"sum", sum},
            {"weights", std::move(weights)}}}};
}

json pretrained_request(const json& request, const LoadedPretrained& loaded, const ServeLimits& limits) {
  for (const char* field : {"heads", "embed", "temperature", "mask", "chars", "seed"}) {
    if (request.contains(field) && !request[field].is_null()) {
      throw BadRequest(fmt::format("\"{}\" does not apply to model \"{}\", a {} run as trained: give text (or ids)",
                                   field, loaded.name, models::to_string(loaded.model->config.architecture)));
    }
  }
  if (!loaded.model->tokenizer && !request.contains("ids")) {
    throw BadRequest(fmt::format("model \"{}\" has no tokenizer: give \"ids\"", loaded.name));
  }
  if (request.contains("neuron")) return folder_neuron(request, loaded, limits);
  return folder_attention(request, loaded, limits);
}

}  // namespace

std::string escaped_text(const std::string& text) {
  std::string out;
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    out += byte < 0x20 || byte == 0x7f ? fmt::format("\\u{:04x}", byte) : std::string(1, c);
  }
  return out;
}

std::string error_json(const std::string& message) {
  return dump(json{{"error", message}});
}

ExplorerApi::ExplorerApi(const std::vector<std::string>& model_paths, ServeLimits limits) : limits_(limits) {
  for (const std::string& path : model_paths) {
    std::filesystem::path where(path);
    if (!where.has_filename()) where = where.parent_path();  // "dir/" names "dir"
    const std::string name = where.filename().string();
    const auto clash = [&](const std::string& other_name, const std::string& other_path) {
      if (other_name == name) {
        throw Error(fmt::format("--model: '{}' and '{}' are both named '{}'; requests name models by file or folder "
                                "name, so rename one",
                                other_path, path, name));
      }
    };
    for (const LoadedModel& other : models_) clash(other.name, other.path);
    for (const LoadedPretrained& other : pretrained_) clash(other.name, other.path);
    if (models::is_model_folder(path)) {
      pretrained_.push_back({name, path, std::make_unique<models::Pretrained>(models::load_pretrained(path))});
      continue;
    }
    train::AttentionModel model = train::AttentionModel::load(path);
    ModelTask task = explorer_task(model, limits_);
    models_.push_back({name, path, std::move(model), std::move(task)});
  }
}

ApiResponse ExplorerApi::attention(const std::string& request_body) const {
  try {
    const json request = parse_request(request_body, limits_);
    const std::string model_name = string_field(request, "model");
    if (model_name.empty()) return {200, dump(untrained_attention(request, limits_))};
    for (const LoadedModel& loaded : models_) {
      if (loaded.name == model_name) return {200, dump(model_attention(request, loaded, limits_))};
    }
    for (const LoadedPretrained& loaded : pretrained_) {
      if (loaded.name == model_name) return {200, dump(pretrained_request(request, loaded, limits_))};
    }
    std::string names;
    for (const LoadedModel& loaded : models_) names += (names.empty() ? "" : ", ") + loaded.name;
    for (const LoadedPretrained& loaded : pretrained_) names += (names.empty() ? "" : ", ") + loaded.name;
    throw BadRequest(fmt::format("unknown model \"{}\"; the server was started with {}", escaped_text(model_name),
                                 names.empty() ? "no --model" : "--model " + names));
  } catch (const BadRequest& e) {
    return {400, error_json(e.message())};
  } catch (const Error& e) {
    return {400, error_json(e.what())};  // the library refused the request's sizes or mask
  } catch (const std::exception& e) {
    return {500, error_json(fmt::format("internal error: {}", e.what()))};
  }
}

ApiResponse ExplorerApi::models() const {
  json list = json::array();
  for (const LoadedModel& loaded : models_) {
    const train::ModelConfig& c = loaded.model.config();
    list.push_back({{"name", loaded.name},
                    {"kind", "qkv"},
                    {"layers", c.num_layers},
                    {"heads", c.num_heads},
                    {"d_model", c.d_model},
                    {"max_len", c.max_len},
                    {"vocab_size", c.vocab_size},
                    {"task", loaded.task.name},
                    {"task_how", loaded.task.how}});
  }
  for (const LoadedPretrained& loaded : pretrained_) {
    const models::ModelConfig& c = loaded.model->config;
    list.push_back({{"name", loaded.name},
                    {"kind", "pretrained"},
                    {"architecture", std::string(models::to_string(c.architecture))},
                    {"layers", c.num_layers},
                    {"heads", c.num_heads},
                    {"kv_heads", c.num_kv_heads},
                    {"head_dim", c.head_dim},
                    {"hidden", c.hidden_size},
                    {"vocab_size", c.vocab_size},
                    {"max_positions", c.max_positions},
                    {"max_tokens", std::min<int64_t>(limits_.max_tokens, c.max_positions)},
                    {"causal", c.is_causal()},
                    {"task", c.is_causal() ? "next token" : c.has_lm_head() ? "fill [MASK]" : "encoder"}});
  }
  return {200, dump(json{{"models", std::move(list)}})};
}

}  // namespace qkv::cli
