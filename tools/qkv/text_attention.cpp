// Text to attention weights, shared by `qkv viz` and `qkv serve`; see text_attention.hpp.
#include "text_attention.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>

#include <fmt/core.h>

namespace qkv::cli {
namespace {

// (N, embed) -> (1, H, N, embed / H): a projection split into heads.
Tensor split_heads(const Tensor& projected, int64_t heads) {
  const int64_t n = projected.size(1), width = projected.size(2);
  return projected.reshape({1, n, heads, width / heads}).transpose(1, 2).contiguous();
}

}  // namespace

std::vector<std::string> tokenize(const std::string& text, bool chars) {
  std::vector<std::string> tokens;
  if (chars) {
    for (size_t i = 0; i < text.size();) {
      size_t length = 1;  // a UTF-8 lead byte says how many bytes its character has
      const auto lead = static_cast<unsigned char>(text[i]);
      if (lead >= 0xF0) length = 4;
      else if (lead >= 0xE0) length = 3;
      else if (lead >= 0xC0) length = 2;
      std::string token = text.substr(i, length);
      if (token == " ") token = "\u2423";
      else if (token == "\t" || token == "\n") token = "\u21b5";
      tokens.push_back(token);
      i += length;
    }
    return tokens;
  }
  std::string word;
  for (char c : text) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      if (!word.empty()) tokens.push_back(word);
      word.clear();
    } else {
      word += c;
    }
  }
  if (!word.empty()) tokens.push_back(word);
  return tokens;
}

Tensor embed_tokens(const std::vector<std::string>& tokens, int64_t embed, uint64_t seed) {
  std::map<std::string, int64_t> vocabulary;
  std::vector<int64_t> ids;
  for (const std::string& token : tokens) {
    std::string key = token;
    for (char& c : key) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const auto [it, inserted] = vocabulary.emplace(key, static_cast<int64_t>(vocabulary.size()));
    ids.push_back(it->second);
  }
  const auto n = static_cast<int64_t>(tokens.size());
  const nn::Embedding embedding(static_cast<int64_t>(vocabulary.size()), embed, seed + 1);
  const nn::SinusoidalPositionalEncoding positions(n, embed);
  return positions.forward(embedding.forward(ids, {1, n}));
}

std::vector<std::vector<float>> head_weights(const nn::MultiHeadAttention& layer, const Tensor& x, const Mask& mask,
                                             double temperature) {
  const int64_t heads = layer.num_heads();
  AttentionOptions options;
  options.mask = mask;
  options.scale = static_cast<float>(1.0 / (std::sqrt(static_cast<double>(layer.head_dim())) * temperature));
  options.need_weights = true;
  options.backend = Backend::Reference;
  const AttentionResult result =
      scaled_dot_product_attention(split_heads(layer.q_proj.forward(x), heads), split_heads(layer.k_proj.forward(x), heads),
                                   split_heads(layer.v_proj.forward(x), heads), options);
  return split_weights_by_head(result.weights, heads);  // (1, H, N, N)
}

nn::MultiHeadAttention make_layer(int64_t embed, int64_t heads, uint64_t seed) {
  nn::MultiHeadAttention layer(embed, heads, {.seed = seed});
  layer.eval();
  return layer;
}

std::vector<uint8_t> visible_pairs(const Mask& mask, int64_t n) {
  AttentionOptions options;
  options.mask = mask;
  options.need_weights = true;
  options.backend = Backend::Reference;
  const Tensor zeros = Tensor::zeros({1, 1, n, 1});
  const std::vector<float> weights = scaled_dot_product_attention(zeros, zeros, zeros, options).weights.to_vector();
  std::vector<uint8_t> visible(weights.size());
  for (size_t e = 0; e < weights.size(); ++e) visible[e] = weights[e] > 0.0f ? 1 : 0;
  return visible;
}

double mean_entropy(const std::vector<float>& weights, int64_t n) {
  return analysis::head_entropy(Tensor::from(weights, {1, n, n})).at({0});
}

std::vector<std::vector<float>> split_weights_by_head(const Tensor& weights, int64_t heads) {
  const std::vector<float> all = weights.to_vector();
  const size_t per_head = all.size() / static_cast<size_t>(heads);
  std::vector<std::vector<float>> out;
  for (int64_t h = 0; h < heads; ++h) {
    out.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(h * per_head),
                     all.begin() + static_cast<std::ptrdiff_t>((h + 1) * per_head));
  }
  return out;
}

ModelTask model_task(const train::AttentionModel& model, const std::string& requested, uint64_t seed) {
  const train::ModelConfig& c = model.config();
  const int64_t symbols = c.vocab_size - 1, n = c.max_len;
  if (symbols < 2 || symbols > 26) {
    throw Error(fmt::format("--model: a vocabulary of {} tokens is not a `qkv train` task's (3 to 27: the letters and "
                            "'|'), so there is no example to run it on",
                            c.vocab_size));
  }
  auto task_for = [&](train::Task task) {
    train::TaskOptions t{.task = task, .symbols = symbols, .pairs = (n - 1) / 2, .length = n / 2};
    const bool fits = task == train::Task::Recall ? n % 2 == 1 : n % 2 == 0;
    if (!fits || train::sequence_length(t) != n) {
      throw Error(fmt::format("--task {}: the model reads sequences of {} tokens, which a {} sequence ({}) never has",
                              train::to_string(task), n, train::to_string(task),
                              task == train::Task::Recall ? "2 x pairs + 1, odd" : "2 x length, even"));
    }
    (void)train::make_batch(t, 1, seed);  // checks the options (pairs <= symbols, ...)
    return t;
  };
  if (!requested.empty()) {
    const train::Task task = train::parse_task(requested);
    return {task_for(task), train::to_string(task), "given by --task"};
  }
  // Telling copy from reverse runs the model on examples of its whole length: a file's max_len
  // longer than any `qkv train` sequence (2 x --length 1024) would make that minutes of work.
  constexpr int64_t kLongestTrainSequence = 2048;
  if (n > kLongestTrainSequence)
    throw Error(fmt::format("--model: the model reads sequences of {} tokens, longer than any `qkv train` task's "
                            "({}), so its task cannot be told from an example",
                            n, kLongestTrainSequence));
  if (n % 2 == 1) {
    return {task_for(train::Task::Recall), "recall",
            fmt::format("recall by the file's odd sequence length {} = 2 x {} pairs + 1", n, (n - 1) / 2)};
  }
  const train::TaskOptions copy = task_for(train::Task::Copy), reverse = task_for(train::Task::Reverse);
  // 200 examples at the default lengths; fewer for long ones, so the work stays about that of 200 x 64 tokens.
  const int64_t sequences = std::clamp<int64_t>(200 * 64 * 64 / (n * n), 8, 200);
  const double copy_accuracy = train::evaluate(model, copy, sequences, seed).accuracy;
  const double reverse_accuracy = train::evaluate(model, reverse, sequences, seed).accuracy;
  const bool is_copy = copy_accuracy >= reverse_accuracy;
  return {is_copy ? copy : reverse, is_copy ? "copy" : "reverse",
          fmt::format("{} (even length {}: copy or reverse; the model gets {:.0f}% of copy and {:.0f}% of reverse "
                      "right; --task sets it)",
                      is_copy ? "copy" : "reverse", n, 100 * copy_accuracy, 100 * reverse_accuracy)};
}

std::vector<int64_t> text_ids(const std::vector<std::string>& tokens, const ModelTask& task, int64_t max_len,
                              std::string& why_not) {
  std::map<std::string, int64_t> vocabulary;
  for (int64_t id = 0; id <= task.options.symbols; ++id) vocabulary[train::token_text(task.options, id)] = id;
  const std::string letters = fmt::format("a-{} and |", train::token_text(task.options, task.options.symbols - 1));
  std::vector<int64_t> ids;
  for (const std::string& token : tokens) {
    if (token == "\u2423" || token == "\u21b5") continue;  // --chars: spaces only separate
    std::string key = token;
    for (char& c : key) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const auto it = vocabulary.find(key);
    if (it == vocabulary.end()) {
      why_not = fmt::format("token '{}' is not in the model's vocabulary ({})", token, letters);
      return {};
    }
    ids.push_back(it->second);
  }
  if (ids.empty()) why_not = "the text has no tokens";
  else if (static_cast<int64_t>(ids.size()) > max_len) {
    why_not = fmt::format("the text has {} tokens; the model reads at most {}", ids.size(), max_len);
    ids.clear();
  }
  return ids;
}

}  // namespace qkv::cli
