// `qkv demo`: a guided tour of attention in five short parts, printed to stdout.
//
//   1. attention from scratch on three tokens: scores, weights, output
//   2. multi-head attention on "The cat sat on the mat"
//   3. causal masking: the grid and what it does to the weights
//   4. cross-attention: 4 queries over 9 keys
//   5. a query that sees no key: qkv's zeros next to the textbook -1e9 trick
//
// Every number comes from fixed seeds, so the tour prints the same text on every run. Read it
// top to bottom like a tutorial: one function per part, each saying what it shows.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "qkv/qkv.hpp"

namespace qkv::cli {
namespace {

constexpr int kParts = 5;

// ---------------------------------------------------------------------------------------------
// Printing helpers

void print_part(int number, std::string_view title) {
  fmt::print("\n[{}/{}] {}\n", number, kParts, title);
}

// One or two lines of explanation under a part's title.
void say(std::string_view text) { fmt::print("  {}\n", text); }

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

std::string trim_right(std::string text) {
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return text;
}

// A label, then the tensor's numpy-like text indented beneath it.
void print_tensor(std::string_view label, const Tensor& tensor, int precision = 4) {
  fmt::print("  {}\n", label);
  for (const std::string& line : split_lines(tensor.str(precision))) fmt::print("    {}\n", line);
}

// Tensors printed next to each other under their labels, e.g. Q, K and V of part 1.
void print_side_by_side(const std::vector<std::pair<std::string, Tensor>>& labelled,
                        int precision = 4) {
  std::vector<std::vector<std::string>> blocks;
  std::vector<size_t> widths;
  size_t height = 0;
  for (const auto& [label, tensor] : labelled) {
    std::vector<std::string> lines = split_lines(tensor.str(precision));
    size_t width = label.size();
    for (const std::string& line : lines) width = std::max(width, line.size());
    height = std::max(height, lines.size());
    blocks.push_back(std::move(lines));
    widths.push_back(width);
  }
  std::string header = " ";
  for (size_t b = 0; b < labelled.size(); ++b) {
    header += fmt::format("   {:<{}}", labelled[b].first, widths[b]);
  }
  fmt::print("{}\n", trim_right(header));
  for (size_t row = 0; row < height; ++row) {
    std::string line = " ";
    for (size_t b = 0; b < blocks.size(); ++b) {
      line += fmt::format("   {:<{}}", row < blocks[b].size() ? blocks[b][row] : std::string(),
                          widths[b]);
    }
    fmt::print("{}\n", trim_right(line));
  }
}

// Row i of a 2-D tensor.
std::vector<float> row_of(const Tensor& matrix, int64_t i) {
  std::vector<float> row;
  for (int64_t j = 0; j < matrix.size(1); ++j) row.push_back(matrix.at({i, j}));
  return row;
}

// "0.1234 0.5678 ..." with a sign column, so rows of mixed signs line up.
std::string format_values(const std::vector<float>& values, int precision = 4) {
  std::string text;
  for (float value : values) {
    if (!text.empty()) text += ' ';
    text += fmt::format("{:{}.{}f}", value, precision + 3, precision);
  }
  return text;
}

// Labels right-aligned over the columns of format_values.
std::string format_labels(const std::vector<std::string>& labels, int precision = 4) {
  std::string text;
  for (const std::string& label : labels) {
    if (!text.empty()) text += ' ';
    text += fmt::format("{:>{}}", label, precision + 3);
  }
  return text;
}

float sum_of(const std::vector<float>& values) {
  float sum = 0;
  for (float value : values) sum += value;
  return sum;
}

// A bar as long as the weight: 1.0 fills kBarWidth cells.
std::string weight_bar(float weight) {
  constexpr float kBarWidth = 40;
  std::string bar;
  for (long cell = 0; cell < std::lround(weight * kBarWidth); ++cell) bar += "█";
  return bar;
}

// 1050624 -> "1,050,624"
std::string group_thousands(int64_t n) {
  std::string digits = std::to_string(n);
  for (int pos = static_cast<int>(digits.size()) - 3; pos > 0; pos -= 3) digits.insert(pos, ",");
  return digits;
}

// ---------------------------------------------------------------------------------------------
// Part 1: attention from scratch. Three tokens, each with a query, a key and a value of 4
// numbers. The scores are worked out by hand (a 3 x 3 product); the weights and the output come
// from qkv::scaled_dot_product_attention, the call every part of qkv goes through.

struct ThreeTokens {
  Tensor q, k, v;  // each (3, 4): (tokens, features)
};

ThreeTokens make_three_tokens() {
  return {Tensor::randn({3, 4}, /*seed=*/1), Tensor::randn({3, 4}, /*seed=*/2),
          Tensor::randn({3, 4}, /*seed=*/3)};
}

// scores[i, j] = q_i . k_j / sqrt(d_k): how well query i matches key j.  q (Nq, D), k (Nk, D).
Tensor scaled_scores(const Tensor& q, const Tensor& k) {
  const int64_t num_queries = q.size(0), num_keys = k.size(0), head_dim = q.size(1);
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  Tensor scores = Tensor::zeros({num_queries, num_keys});
  for (int64_t i = 0; i < num_queries; ++i) {
    for (int64_t j = 0; j < num_keys; ++j) {
      float dot = 0;
      for (int64_t d = 0; d < head_dim; ++d) dot += q.at({i, d}) * k.at({j, d});
      scores.at({i, j}) = dot * scale;
    }
  }
  return scores;
}

void part_from_scratch() {
  print_part(1, "Attention from scratch: 3 tokens, d_k = 4");
  say("Each token has a query (what it looks for), a key (what it offers) and a value");
  say("(what it passes on): one row per token, tokens 0, 1, 2. Random, from fixed seeds.");
  const auto [q, k, v] = make_three_tokens();
  print_side_by_side({{"Q " + q.shape().str(), q}, {"K " + k.shape().str(), k}});

  // The weights and the output come from qkv's one attention call.
  AttentionOptions options;
  options.need_weights = true;
  const AttentionResult result = scaled_dot_product_attention(q, k, v, options);
  std::vector<float> row_sums;
  for (int64_t i = 0; i < result.weights.size(0); ++i) {
    row_sums.push_back(sum_of(row_of(result.weights, i)));
  }

  say("Score (i, j) says how well query i matches key j; a softmax over each row turns the");
  say("scores into weights, the share of query i's attention that goes to key j.");
  print_side_by_side(
      {{"scores = Q K^T / sqrt(4)", scaled_scores(q, k)},
       {"weights = softmax(row)", result.weights},
       {"row sums", Tensor::from(row_sums, {static_cast<int64_t>(row_sums.size()), 1})}});

  say("Each token's output is the average of V's rows, weighted by its row of weights.");
  print_side_by_side({{"V " + v.shape().str(), v},
                      {"output = weights V " + result.output.shape().str(), result.output}});
  say("(weights and output: qkv::scaled_dot_product_attention(Q, K, V) with need_weights)");
}

// ---------------------------------------------------------------------------------------------
// The running example of parts 2 and 3: a six-token sentence turned into vectors, and one
// multi-head attention layer (512 features, 8 heads of 64), as in "Attention Is All You Need".

constexpr int64_t kEmbedDim = 512;
constexpr int64_t kNumHeads = 8;

struct Sentence {
  std::vector<std::string> tokens;  // "The", "cat", ...
  Tensor x;                         // (1, tokens, kEmbedDim): word vectors + positions
};

Sentence make_sentence() {
  const std::vector<std::string> tokens = {"The", "cat", "sat", "on", "the", "mat"};
  const std::vector<std::string> vocabulary = {"the", "cat", "sat", "on", "mat"};
  std::vector<int64_t> ids;
  for (const std::string& token : tokens) {
    std::string word = token;
    word[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(word[0])));
    for (size_t id = 0; id < vocabulary.size(); ++id) {
      if (vocabulary[id] == word) ids.push_back(static_cast<int64_t>(id));
    }
  }
  const nn::Embedding embedding(static_cast<int64_t>(vocabulary.size()), kEmbedDim, /*seed=*/7);
  const nn::SinusoidalPositionalEncoding positions(/*max_len=*/64, kEmbedDim);
  const Tensor words = embedding.forward(ids, {1, static_cast<int64_t>(ids.size())});
  return {tokens, positions.forward(words)};
}

nn::MultiHeadAttention make_attention_layer() {
  nn::MultiHeadAttention layer(kEmbedDim, kNumHeads, {.seed = 42});
  layer.eval();  // inference: no dropout
  return layer;
}

// Head `head`'s weights for query `query` as one line of numbers.  weights (1, H, Nq, Nk).
std::vector<float> head_row(const Tensor& weights, int64_t head, int64_t query) {
  std::vector<float> row;
  for (int64_t key = 0; key < weights.size(3); ++key) {
    row.push_back(weights.at({0, head, query, key}));
  }
  return row;
}

// ---------------------------------------------------------------------------------------------
// Part 2: multi-head attention. The layer projects the input to Q, K and V, splits them into
// 8 heads, runs attention in each, joins the heads and projects back. PerHead weights let us
// look inside one head.

void part_multi_head(const Sentence& sentence, const nn::MultiHeadAttention& layer) {
  print_part(2, "Multi-head attention on \"The cat sat on the mat\"");
  say("Each token becomes a word vector plus a sinusoidal code for its position");
  say("(so \"The\" and \"the\" share a word vector but not a position).");
  const auto [output, weights] = layer.forward(sentence.x, {}, nn::Weights::PerHead);
  fmt::print("  input   {:<14} (batch, tokens, features)\n", sentence.x.shape().str());
  say(fmt::format(
      "The layer projects the input to Q, K and V, splits them into {} heads, attends in",
      layer.num_heads()));
  say("each head on its own, then joins the heads and projects back.");
  fmt::print("  output  {:<14} the same shape: one new vector per token\n", output.shape().str());
  fmt::print("  weights {:<14} (batch, heads, queries, keys): {} heads of {} features\n",
             weights.shape().str(), layer.num_heads(), layer.head_dim());

  constexpr int64_t kHead = 0, kCat = 1;
  fmt::print("  Head {}: where does \"{}\" look?\n", kHead, sentence.tokens[kCat]);
  const std::vector<float> cat_row = head_row(weights, kHead, kCat);
  for (size_t key = 0; key < cat_row.size(); ++key) {
    fmt::print("    {:<4} {:.4f} {}\n", sentence.tokens[key], cat_row[key],
               weight_bar(cat_row[key]));
  }
  fmt::print("    sum  {:.4f}\n", sum_of(cat_row));
  say("The layer is untrained, so this pattern is arbitrary: training is what would");
  say("teach \"cat\" to look at \"sat\", the verb it is the subject of.");
  const int64_t width = layer.embed_dim();
  fmt::print("  parameters: {} = 4 projections x ({} x {} weights + {} biases)\n",
             group_thousands(layer.parameter_count()), width, width, width);
}

// ---------------------------------------------------------------------------------------------
// Part 3: causal attention. A language model predicts each next token, so token i may look
// at tokens 0..i only. Mask::causal() says so without building a matrix; create_causal_mask
// gives the matrix itself, which we draw.

void part_causal(const Sentence& sentence, const nn::MultiHeadAttention& layer) {
  print_part(3, "Causal attention: no peeking at later tokens");
  say("A language model predicts the next token, so token i may only look at tokens 0..i.");
  say("Mask::causal() states that rule; create_causal_mask(6) spells it out as a matrix");
  say("(rows: queries, columns: keys; █ attend, · masked):");
  const int64_t n = static_cast<int64_t>(sentence.tokens.size());
  const Tensor grid = create_causal_mask(n);
  std::string header = "          ";
  for (const std::string& token : sentence.tokens) header += fmt::format("{:<4}", token);
  fmt::print("{}\n", trim_right(header));
  for (int64_t i = 0; i < n; ++i) {
    std::string line = fmt::format("    {:<6}", sentence.tokens[i]);
    for (int64_t j = 0; j < n; ++j) line += grid.at({i, j}) != 0 ? "█   " : "·   ";
    fmt::print("{}\n", trim_right(line));
  }

  const auto unmasked = layer.forward(sentence.x, {}, nn::Weights::PerHead);
  const auto causal = layer.forward(sentence.x, Mask::causal(), nn::Weights::PerHead);
  constexpr int64_t kHead = 0, kThe = 0, kSat = 2;
  fmt::print("  Head {}'s weights for two queries, without and with the mask:\n", kHead);
  const auto print_row = [](std::string_view label, std::string_view values,
                            std::string_view note) {
    fmt::print("{}\n", trim_right(fmt::format("    {:<14}{}  {}", label, values, note)));
  };
  print_row("", format_labels(sentence.tokens), "");
  print_row("The, no mask", format_values(head_row(unmasked.weights, kHead, kThe)), "");
  print_row("The, causal", format_values(head_row(causal.weights, kHead, kThe)),
            "<- sees only itself");
  print_row("sat, causal", format_values(head_row(causal.weights, kHead, kSat)),
            "<- sees The, cat, sat");
}

// ---------------------------------------------------------------------------------------------
// Part 4: cross-attention. Queries come from one sequence, keys and values from another, as
// when a translator writing its output looks back at the source sentence. Nq and Nk differ,
// so the weights are a rectangle.

void part_cross() {
  print_part(4, "Cross-attention: 4 queries over 9 keys");
  say("Queries from one sequence, keys and values from another: a decoder writing 4 words");
  say("looks back over the 9 words of its source sentence.");
  constexpr int64_t kFeatures = 64, kHeads = 4;
  nn::MultiHeadAttention layer(kFeatures, kHeads, {.seed = 3});
  layer.eval();
  const Tensor query = Tensor::randn({1, 4, kFeatures}, /*seed=*/11);   // the 4 words written
  const Tensor memory = Tensor::randn({1, 9, kFeatures}, /*seed=*/12);  // the 9 source words
  const auto [output, weights] = layer.forward(query, memory, memory, {}, nn::Weights::Averaged);
  fmt::print("  query {}  key = value {}  ->  output {}\n", query.shape().str(),
             memory.shape().str(), output.shape().str());
  print_tensor(
      fmt::format("weights {}, the mean over {} heads (Weights::Averaged), a row per query",
                  weights.shape().str(), kHeads),
      weights.squeeze(0), 3);
}

// ---------------------------------------------------------------------------------------------
// Part 5: a query that may see no key at all (say a padding position, once every key is
// masked). The textbook adds -1e9 to masked scores; when a whole row is masked, softmax then
// spreads the weight evenly over keys the query was told to ignore. qkv returns zeros instead.

void part_empty_row() {
  print_part(5, "A query that may see nothing");
  say("Take the 3 tokens of part 1 and hide every key from token 2 (as happens to a");
  say("left-padding token under causal + padding masks). qkv gets Mask::keep with that");
  say("row all 0; the textbook adds -1e9 to the same scores (Mask::additive):");
  const auto [q, k, v] = make_three_tokens();
  constexpr int64_t kBlind = 2;

  // qkv's way: a keep-mask (1 = attend, 0 = masked) with token 2's row all zero.
  Tensor keep = Tensor::full({3, 3}, 1.0f);
  // The textbook way: add -1e9 to the same scores.
  Tensor minus_1e9 = Tensor::zeros({3, 3});
  for (int64_t j = 0; j < 3; ++j) {
    keep.at({kBlind, j}) = 0.0f;
    minus_1e9.at({kBlind, j}) = -1e9f;
  }
  AttentionOptions qkv_way;
  qkv_way.mask = Mask::keep(keep);
  qkv_way.need_weights = true;
  AttentionOptions textbook_way;
  textbook_way.mask = Mask::additive(minus_1e9);
  textbook_way.need_weights = true;
  const AttentionResult ours = scaled_dot_product_attention(q, k, v, qkv_way);
  const AttentionResult trick = scaled_dot_product_attention(q, k, v, textbook_way);

  // What the trick's output should be: the plain mean of V's rows.
  std::vector<float> mean_of_v(static_cast<size_t>(v.size(1)), 0.0f);
  const float num_keys = static_cast<float>(v.size(0));
  for (int64_t j = 0; j < v.size(0); ++j) {
    for (int64_t d = 0; d < v.size(1); ++d) {
      mean_of_v[static_cast<size_t>(d)] += v.at({j, d}) / num_keys;
    }
  }

  const auto print_row = [](std::string_view label, std::string_view weights,
                            std::string_view output, std::string_view note) {
    fmt::print("{}\n",
               trim_right(fmt::format("    {:<12}{:<25}{:<33}{}", label, weights, output, note)));
  };
  print_row("token 2", " weights", " output", "");
  print_row("qkv", format_values(row_of(ours.weights, kBlind)),
            format_values(row_of(ours.output, kBlind)),
            fmt::format("lse {}", ours.lse.at({kBlind})));
  print_row("-1e9 trick", format_values(row_of(trick.weights, kBlind)),
            format_values(row_of(trick.output, kBlind)), "");
  print_row("mean of V", "", format_values(mean_of_v), "");
  say("The -1e9 trick quietly averages values the query was told to ignore, and with -inf");
  say("a plain softmax gives 0/0 = NaN. qkv returns zeros and lse = -inf instead: nothing");
  say("leaks in, nothing turns into NaN, and the empty row is easy to spot.");
}

void run_demo() {
  fmt::print("qkv {}: a tour of attention\n", version());
  say("Attention lets each token gather information from the tokens it finds relevant:");
  say("    output = softmax(Q K^T / sqrt(d_k)) V");

  part_from_scratch();
  const Sentence sentence = make_sentence();
  const nn::MultiHeadAttention layer = make_attention_layer();
  part_multi_head(sentence, layer);
  part_causal(sentence, layer);
  part_cross();
  part_empty_row();

  fmt::print("\nThat's the tour. `qkv --help` lists every command.\n");
}

}  // namespace

void add_demo_command(CLI::App& app) {
  CLI::App* demo = app.add_subcommand(
      "demo", "A guided tour of attention: scores, weights, heads, masks, cross-attention");
  demo->callback(run_demo);
}

}  // namespace qkv::cli
