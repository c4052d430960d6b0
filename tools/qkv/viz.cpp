// `qkv viz`: attention weights drawn as heatmaps, one panel per head plus their average, with
// the tokens on both axes (rows: queries, columns: keys) and one shared colour scale.
//
//   qkv viz --text "The cat sat on the mat" --heads 8 --embed 64 -o heads.png
//   qkv viz --causal -o causal.png                      # no peeking: the upper triangle is 0
//   qkv viz --temperature 0.5,1,2 -o temperature.png    # sharper and softer softmax, side by side
//   qkv viz --compare-heads 1,8 -o compare.png          # one head of 64 dims beside eight of 8
//   qkv viz --model model.qkv -o trained.png            # a trained model's heads, every layer
//
// The text becomes vectors as in `qkv demo`: a word (or character) embedding plus the
// sinusoidal position code, fed to one untrained nn::MultiHeadAttention layer. Its weights
// come from qkv::scaled_dot_product_attention on the layer's own Q, K and V projections, so a
// temperature can scale the scores: weights = softmax(Q K^T / (sqrt(d_head) * T)).
//
// With --model, the layers are a trained train::AttentionModel's (the .qkv file `qkv train
// --save` writes), run on a sequence of its own task: the --text tokens when every one is in the
// model's vocabulary (letters and '|'), else one example sequence of the task.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "analysis.hpp"
#include "commands.hpp"
#include "plot.hpp"
#include "qkv/qkv.hpp"
#include "qkv/train.hpp"

namespace qkv::cli {
namespace {

// Beyond this a heatmap's cells are a few pixels and its labels unreadable.
constexpr size_t kMaxTokens = 128;

struct VizOptions {
  std::string text = "The cat sat on the mat";
  bool chars = false;
  int64_t heads = 8;
  int64_t embed = 64;
  bool causal = false;
  std::vector<double> temperatures;  // empty: 1, all heads
  int64_t head = 0;                  // the head the temperature panels show
  std::vector<int64_t> compare_heads;
  std::string model;
  std::string task;  // --model: the model's task; empty: inferred from the file
  uint64_t seed = 42;
  // Which options the command line gave (--model takes its layers from the file, not from these).
  bool text_given = false;
  std::vector<std::string> layer_options_given;
  std::string output = "attention.png";
};

// ---------------------------------------------------------------------------------------------
// Text to tokens to vectors

// Whitespace-separated words, or (chars) every UTF-8 character with spaces shown as "␣".
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

// (1, N, embed): each token's word vector (case-folded, so "The" and "the" share one) plus its
// position's sinusoidal code.
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

// ---------------------------------------------------------------------------------------------
// Weights

// (N, embed) -> (1, H, N, embed / H): a projection split into heads.
Tensor split_heads(const Tensor& projected, int64_t heads) {
  const int64_t n = projected.size(1), width = projected.size(2);
  return projected.reshape({1, n, heads, width / heads}).transpose(1, 2).contiguous();
}

// Every head's weights, (H, N, N) flattened per head: softmax(Q K^T / (sqrt(d) * T)) masked.
std::vector<std::vector<float>> head_weights(const nn::MultiHeadAttention& layer, const Tensor& x, bool causal,
                                             double temperature) {
  const int64_t heads = layer.num_heads();
  AttentionOptions options;
  options.mask = causal ? Mask::causal() : Mask();
  options.scale = static_cast<float>(1.0 / (std::sqrt(static_cast<double>(layer.head_dim())) * temperature));
  options.need_weights = true;
  options.backend = Backend::Reference;
  const AttentionResult result =
      scaled_dot_product_attention(split_heads(layer.q_proj.forward(x), heads), split_heads(layer.k_proj.forward(x), heads),
                                   split_heads(layer.v_proj.forward(x), heads), options);
  const std::vector<float> all = result.weights.to_vector();  // (1, H, N, N)
  const size_t per_head = all.size() / static_cast<size_t>(heads);
  std::vector<std::vector<float>> out;
  for (int64_t h = 0; h < heads; ++h) {
    out.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(h * per_head),
                     all.begin() + static_cast<std::ptrdiff_t>((h + 1) * per_head));
  }
  return out;
}

nn::MultiHeadAttention make_layer(int64_t embed, int64_t heads, uint64_t seed) {
  // The same seed gives the same projection matrices whatever the head count, so panels with
  // different head counts split the very same Q and K differently.
  nn::MultiHeadAttention layer(embed, heads, {.seed = seed});
  layer.eval();
  return layer;
}

// The panel's mean row entropy: one head's (n, n) weights seen as a single head.
double mean_entropy(const std::vector<float>& weights, int64_t n) {
  return analysis::head_entropy(Tensor::from(weights, {1, n, n})).at({0});
}

plot::HeatmapPanel make_panel(std::string title, std::vector<float> weights, int64_t n) {
  plot::HeatmapPanel panel;
  panel.subtitle = fmt::format("entropy {:.2f} nats", mean_entropy(weights, n));
  panel.title = std::move(title);
  panel.rows = panel.cols = n;
  panel.values = std::move(weights);
  return panel;
}

// The panels of one layer: every head, then (with more than one head) their average.
std::vector<plot::HeatmapPanel> head_panels(const std::vector<std::vector<float>>& weights, int64_t n,
                                            const std::string& head_note) {
  std::vector<plot::HeatmapPanel> panels;
  std::vector<float> average(weights.front().size(), 0.0f);
  for (size_t h = 0; h < weights.size(); ++h) {
    panels.push_back(make_panel(fmt::format("head {}{}", h, head_note), weights[h], n));
    for (size_t e = 0; e < average.size(); ++e) average[e] += weights[h][e] / static_cast<float>(weights.size());
  }
  if (weights.size() > 1) panels.push_back(make_panel(fmt::format("average of {} heads", weights.size()), average, n));
  return panels;
}

int grid_columns(size_t panels) {
  return static_cast<int>(std::ceil(std::sqrt(static_cast<double>(panels))));
}

// ---------------------------------------------------------------------------------------------

void check_options(const VizOptions& o, const std::vector<std::string>& tokens) {
  if (!o.task.empty()) throw Error("--task goes with --model: it names the trained model's task");
  if (tokens.empty()) throw Error("--text is empty: give at least one word, e.g. --text \"The cat sat on the mat\"");
  if (tokens.size() > kMaxTokens) {
    throw Error(fmt::format("--text has {} tokens; a heatmap stays readable up to {}", tokens.size(), kMaxTokens));
  }
  if (o.heads <= 0) throw Error(fmt::format("--heads must be positive, got {}", o.heads));
  if (o.embed <= 0) throw Error(fmt::format("--embed must be positive, got {}", o.embed));
  for (double t : o.temperatures) {
    if (!(t > 0) || !std::isfinite(t)) throw Error(fmt::format("--temperature values must be positive, got {}", t));
  }
  for (int64_t h : o.compare_heads) {
    if (h <= 0) throw Error(fmt::format("--compare-heads values must be positive, got {}", h));
    if (o.embed % h != 0) {
      throw Error(fmt::format("--compare-heads {}: embed_dim ({}) must be divisible by num_heads ({})", h, o.embed, h));
    }
  }
  if (!o.temperatures.empty() && !o.compare_heads.empty()) {
    throw Error("--temperature and --compare-heads each make their own figure: give one of them");
  }
  if (o.head < 0 || o.head >= o.heads) {
    throw Error(fmt::format("--head {} is not one of the {} heads (0 to {})", o.head, o.heads, o.heads - 1));
  }
  plot::format_from_path(o.output);
}

// ---------------------------------------------------------------------------------------------
// A trained model (--model)

// The task a model file was trained on. The file holds the vocabulary (symbols + 1) and the
// sequence length (recall 2P + 1: odd; copy and reverse 2L: even), not the task's name: an odd
// length is recall; an even one is copy or reverse, whichever the model gets more right.
struct ModelTask {
  train::TaskOptions options;
  std::string name;
  std::string how;  // how the task was chosen, for the figure
};

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
  if (n % 2 == 1) {
    return {task_for(train::Task::Recall), "recall",
            fmt::format("recall by the file's odd sequence length {} = 2 x {} pairs + 1", n, (n - 1) / 2)};
  }
  const train::TaskOptions copy = task_for(train::Task::Copy), reverse = task_for(train::Task::Reverse);
  constexpr int64_t kSequences = 200;
  const double copy_accuracy = train::evaluate(model, copy, kSequences, seed).accuracy;
  const double reverse_accuracy = train::evaluate(model, reverse, kSequences, seed).accuracy;
  const bool is_copy = copy_accuracy >= reverse_accuracy;
  return {is_copy ? copy : reverse, is_copy ? "copy" : "reverse",
          fmt::format("{} (even length {}: copy or reverse; the model gets {:.0f}% of copy and {:.0f}% of reverse "
                      "right; --task sets it)",
                      is_copy ? "copy" : "reverse", n, 100 * copy_accuracy, 100 * reverse_accuracy)};
}

// The --text tokens as the model's ids, or why they cannot be (empty ids).
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
      why_not = fmt::format("--text token '{}' is not in the model's vocabulary ({})", token, letters);
      return {};
    }
    ids.push_back(it->second);
  }
  if (ids.empty()) why_not = "--text has no tokens";
  else if (static_cast<int64_t>(ids.size()) > max_len) {
    why_not = fmt::format("--text has {} tokens; the model reads at most {}", ids.size(), max_len);
    ids.clear();
  }
  return ids;
}

void run_model_viz(const VizOptions& o) {
  if (!o.layer_options_given.empty()) {
    throw Error(fmt::format("{} describes the untrained layer; with --model the layers come from the file",
                            o.layer_options_given.front()));
  }
  plot::format_from_path(o.output);  // a bad extension fails before the work
  const train::AttentionModel model = train::AttentionModel::load(o.model);
  const train::ModelConfig& c = model.config();
  const ModelTask task = model_task(model, o.task, o.seed);

  // The sequence: the --text tokens if they are the model's, else one example of its task.
  std::vector<int64_t> ids, targets;
  std::string source;
  if (o.text_given) {
    std::string why_not;
    ids = text_ids(tokenize(o.text, o.chars), task, c.max_len, why_not);
    if (ids.empty()) {
      fmt::print(stderr, "qkv viz: {}: drawing one {} example instead\n", why_not, task.name);
      source = fmt::format("on one {} example, not --text: {}", task.name, why_not);
    } else {
      source = "on the --text tokens (every one is in the model's vocabulary)";
    }
  } else {
    source = fmt::format("on one {} example (give --text \"a b c ...\" in the model's letters for your own)", task.name);
  }
  if (ids.empty()) {
    const train::Batch example = train::make_batch(task.options, 1, train::held_out_seed(o.seed));
    ids = example.ids;
    targets = example.targets;
  }
  const auto n = static_cast<int64_t>(ids.size());

  std::vector<Tensor> weights;  // per layer (1, H, n, n)
  const Tensor logits = model.forward(ids, 1, n, {}, &weights);
  std::vector<std::string> labels;
  std::string predicted, expected;
  for (int64_t i = 0; i < n; ++i) {
    labels.push_back(train::token_text(task.options, ids[static_cast<size_t>(i)]));
    const bool answer = targets.empty() ? true : targets[static_cast<size_t>(i)] >= 0;
    if (!answer) continue;
    const float* row = logits.data() + i * c.vocab_size;
    predicted += train::token_text(task.options, std::max_element(row, row + c.vocab_size) - row) + " ";
    if (!targets.empty()) expected += train::token_text(task.options, targets[static_cast<size_t>(i)]) + " ";
  }

  plot::HeatmapFigure figure;
  figure.row_labels = figure.col_labels = labels;
  figure.title = fmt::format("Trained heads of {}: task {}, {} layer{} x {} head{}", o.model, task.name, c.num_layers,
                             c.num_layers == 1 ? "" : "s", c.num_heads, c.num_heads == 1 ? "" : "s");
  figure.notes.push_back(source);
  figure.notes.push_back(fmt::format("task {}", task.how));
  if (targets.empty()) {
    figure.notes.push_back(fmt::format("the model's next-token prediction at each position: {}", predicted));
  } else {
    figure.notes.push_back(fmt::format("{}: {}  the model predicts: {}",
                                       task.name == "recall" ? "the answer (the value of the last key)"
                                                             : "the answer (the tokens after '|')",
                                       expected, predicted));
  }
  figure.notes.push_back(fmt::format("d_model {}, {} dims per head; causal (token i sees tokens 0..i), so above the "
                                     "diagonal is 0",
                                     c.d_model, c.d_model / c.num_heads));
  figure.notes.push_back(fmt::format("rows: queries (each row sums to 1), columns: keys; entropy: mean over rows, "
                                     "uniform over all {} keys = {:.2f} nats",
                                     n, std::log(static_cast<double>(n))));
  size_t widest = 1, panels = 0;
  for (size_t layer = 0; layer < weights.size(); ++layer) {
    const std::vector<float> all = weights[layer].to_vector();
    const size_t per_head = all.size() / static_cast<size_t>(c.num_heads);
    std::vector<std::vector<float>> heads;
    for (int64_t h = 0; h < c.num_heads; ++h) {
      heads.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(h * per_head),
                         all.begin() + static_cast<std::ptrdiff_t>((h + 1) * per_head));
    }
    plot::HeatmapSection section;
    section.heading = fmt::format("layer {}", layer);
    section.panels = head_panels(heads, n, "");
    widest = std::max(widest, section.panels.size());
    panels += section.panels.size();
    figure.sections.push_back(std::move(section));
  }
  figure.columns = static_cast<int>(std::min<size_t>(widest, 5));
  figure.value_max = 1;  // probabilities: the same scale in every figure of a trained model
  const plot::HeatmapLayout layout = plot::draw_heatmaps(figure, o.output);
  fmt::print("wrote {} ({} x {}): {} panels, {} layer{} of {} head{}, {} tokens, task {}\n", o.output, layout.width,
             layout.height, panels, c.num_layers, c.num_layers == 1 ? "" : "s", c.num_heads,
             c.num_heads == 1 ? "" : "s", n, task.name);
}

// ---------------------------------------------------------------------------------------------

void run_viz(const VizOptions& o) {
  if (!o.model.empty()) {
    run_model_viz(o);
    return;
  }
  const std::vector<std::string> tokens = tokenize(o.text, o.chars);
  check_options(o, tokens);
  const auto n = static_cast<int64_t>(tokens.size());
  const Tensor x = embed_tokens(tokens, o.embed, o.seed);

  plot::HeatmapFigure figure;
  figure.row_labels = figure.col_labels = tokens;
  const std::string shown_text = o.text.size() > 60 ? o.text.substr(0, 57) + "..." : o.text;
  figure.title = fmt::format("Attention weights on \"{}\"", shown_text);
  const std::string mask_note = o.causal ? "causal (token i sees tokens 0..i)" : "bidirectional (every token sees all)";
  std::string entropy_note = fmt::format("uniform over all {} keys = {:.2f} nats", n, std::log(static_cast<double>(n)));

  if (!o.temperatures.empty()) {
    // The course's temperature exercise: one head, softmax(scores / T) for each T.
    const nn::MultiHeadAttention layer = make_layer(o.embed, o.heads, o.seed);
    plot::HeatmapSection section;
    for (double t : o.temperatures) {
      auto panel = make_panel(fmt::format("T = {}", t), head_weights(layer, x, o.causal, t)[static_cast<size_t>(o.head)], n);
      section.panels.push_back(std::move(panel));
    }
    figure.sections.push_back(std::move(section));
    figure.columns = static_cast<int>(o.temperatures.size());
    figure.notes.push_back(fmt::format("head {} of {} x {} dims, {}; weights = softmax(Q K^T / (sqrt({}) T))", o.head,
                                       o.heads, o.embed / o.heads, mask_note, o.embed / o.heads));
    figure.notes.push_back("low T: sharp, nearly one key per row; high T: soft, nearly uniform");
  } else if (!o.compare_heads.empty()) {
    // The same projections split into h heads of embed / h dims, one section per h.
    size_t widest = 1;
    for (int64_t h : o.compare_heads) {
      const nn::MultiHeadAttention layer = make_layer(o.embed, h, o.seed);
      plot::HeatmapSection section;
      section.heading = fmt::format("{} head{} x {} dims", h, h == 1 ? "" : "s", o.embed / h);
      section.panels = head_panels(head_weights(layer, x, o.causal, 1.0), n, "");
      widest = std::max(widest, section.panels.size());
      figure.sections.push_back(std::move(section));
    }
    figure.columns = static_cast<int>(std::min<size_t>(widest, 5));
    figure.notes.push_back(fmt::format("embed {}, {}; the same Q, K projections split into different head counts",
                                       o.embed, mask_note));
  } else {
    const nn::MultiHeadAttention layer = make_layer(o.embed, o.heads, o.seed);
    plot::HeatmapSection section;
    section.panels = head_panels(head_weights(layer, x, o.causal, 1.0), n, "");
    figure.columns = grid_columns(section.panels.size());
    figure.sections.push_back(std::move(section));
    figure.notes.push_back(fmt::format("{} heads x {} dims (embed {}), {}", o.heads, o.embed / o.heads, o.embed, mask_note));
  }
  figure.notes.push_back(fmt::format("rows: queries (each row sums to 1), columns: keys; entropy: mean over rows, {}",
                                     entropy_note));
  figure.notes.push_back(fmt::format("untrained layer (seed {}): the patterns are random, not learned", o.seed));

  const plot::HeatmapLayout layout = plot::draw_heatmaps(figure, o.output);
  size_t panels = 0;
  for (const auto& section : figure.sections) panels += section.panels.size();
  fmt::print("wrote {} ({} x {}): {} panel{}, {} tokens, colour scale 0 to {}\n", o.output, layout.width, layout.height,
             panels, panels == 1 ? "" : "s", n, layout.value_max);
}

}  // namespace

void add_viz_command(CLI::App& app) {
  auto options = std::make_shared<VizOptions>();
  CLI::App* viz = app.add_subcommand(
      "viz", "Draw attention weights as heatmaps: one panel per head and their average (PNG, SVG or PDF)");
  viz->add_option("--text", options->text, "The text to attend over (whitespace-separated tokens)")
      ->capture_default_str();
  viz->add_flag("--chars", options->chars, "One token per character instead of per word");
  viz->add_option("--heads", options->heads, "Attention heads")->capture_default_str();
  viz->add_option("--embed", options->embed, "Model width (embed_dim), split evenly across the heads")
      ->capture_default_str();
  viz->add_flag("--causal", options->causal, "Causal mask: each token sees only itself and earlier tokens");
  viz->add_option("--temperature", options->temperatures,
                  "Softmax temperatures drawn side by side for one head, e.g. 0.5,1,2")
      ->delimiter(',');
  viz->add_option("--head", options->head, "The head the --temperature panels show")->capture_default_str();
  viz->add_option("--compare-heads", options->compare_heads,
                  "Head counts drawn one above the other with the same projections, e.g. 1,8")
      ->delimiter(',');
  viz->add_option("--model", options->model,
                  "A trained model's file (`qkv train --save`): its heads, every layer, on --text or an example");
  viz->add_option("--task", options->task,
                  "With --model: the model's task (copy, recall, reverse); default: inferred from the file")
      ->check(CLI::IsMember({"copy", "recall", "reverse"}));
  viz->add_option("--seed", options->seed,
                  "Seed of the embedding and the layer's weights (with --model: of the example)")
      ->capture_default_str();
  viz->add_option("-o,--output", options->output, "The image to write: .png, .svg or .pdf")->capture_default_str();
  viz->callback([options, viz] {
    options->text_given = viz->count("--text") > 0;
    options->layer_options_given.clear();
    for (const char* name : {"--heads", "--embed", "--temperature", "--head", "--compare-heads"}) {
      if (viz->count(name) > 0) options->layer_options_given.emplace_back(name);
    }
    run_viz(*options);
  });
}

}  // namespace qkv::cli
