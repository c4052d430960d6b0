// `qkv viz`: attention weights drawn as heatmaps, one panel per head plus their average, with
// the tokens on both axes (rows: queries, columns: keys) and one shared colour scale.
//
//   qkv viz --text "The cat sat on the mat" --heads 8 --embed 64 -o heads.png
//   qkv viz --causal -o causal.png                      # no peeking: the upper triangle is masked
//   qkv viz --temperature 0.5,1,2 -o temperature.png    # sharper and softer softmax, side by side
//   qkv viz --compare-heads 1,8 -o compare.png          # one head of 64 dims beside eight of 8
//   qkv viz --model model.qkv -o trained.png            # a trained model's heads, every layer
//   qkv viz --chars --text "$(printf 'x%.0s' {1..64})" --mask "causal & (window(3) | strided(8))" -o sparse.png
//                                                       # the pattern (which keys each query sees),
//                                                       # then the heads under it
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

#include "numbers.hpp"
#include "bounds.hpp"
#include "commands.hpp"
#include "model_file.hpp"
#include "plot.hpp"
#include "pretrained.hpp"
#include "qkv/qkv.hpp"
#include "qkv/train.hpp"
#include "text_attention.hpp"

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
  std::string mask;                  // a Mask::parse expression, ANDed with --causal
  std::vector<double> temperatures;  // empty: 1, all heads
  int64_t head = 0;                  // the head the temperature panels show
  std::vector<int64_t> compare_heads;
  std::string model;
  int64_t layer = -1;  // a model folder's layer to draw; -1: chosen by its heads' roles
  std::string task;  // --model: the model's task; empty: inferred from the file
  uint64_t seed = 42;
  // Which options the command line gave (--model takes its layers from the file, not from these).
  bool text_given = false;
  std::vector<std::string> layer_options_given;
  std::string output = "attention.png";
};

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

// Marks the pairs `mask` hides in every panel of the figure, so they are drawn hatched grey
// rather than as weights of 0 (nothing to mark when the mask hides nothing).
void mark_masked(plot::HeatmapFigure& figure, const Mask& mask, int64_t n) {
  if (mask.is_none()) return;
  std::vector<uint8_t> hidden = visible_pairs(mask, n);
  for (uint8_t& flag : hidden) flag = flag ? 0 : 1;
  for (auto& section : figure.sections)
    for (auto& panel : section.panels) panel.masked = hidden;
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
  check_range("--heads", o.heads, 1, 256);
  check_range("--embed", o.embed, 1, 4096);
  check_range("--temperature's count", static_cast<int64_t>(o.temperatures.size()), 0, 16);
  check_range("--compare-heads' count", static_cast<int64_t>(o.compare_heads.size()), 0, 8);
  for (double t : o.temperatures) {
    if (!(t > 0) || !std::isfinite(t)) throw Error(fmt::format("--temperature values must be positive, got {}", t));
    check_real_range("--temperature", t, 1e-6, 1e6);
  }
  for (int64_t h : o.compare_heads) {
    if (h <= 0) throw Error(fmt::format("--compare-heads values must be positive, got {}", h));
    check_range("--compare-heads", h, 1, 256);
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

void run_model_viz(const VizOptions& o) {
  if (!o.layer_options_given.empty()) {
    throw Error(fmt::format("{} describes the untrained layer; with --model the layers come from the file",
                            o.layer_options_given.front()));
  }
  plot::format_from_path(o.output);  // a bad extension fails before the work
  const train::AttentionModel model = load_model(o.model);
  const train::ModelConfig& c = model.config();
  const ModelTask task = model_task(model, o.task, o.seed);

  // The sequence: the --text tokens if they are the model's, else one example of its task.
  std::vector<int64_t> ids, targets;
  std::string source;
  if (o.text_given) {
    std::string why_not;
    ids = text_ids(tokenize(o.text, o.chars), task, c.max_len, why_not);
      why_not = "--text: " + why_not;
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
  figure.notes.push_back(fmt::format("d_model {}, {} dims per head, {} positions; causal (token i sees tokens 0..i), "
                                     "so above the diagonal is masked (hatched grey)",
                                     c.d_model, c.d_model / c.num_heads, train::to_string(c.positions)));
  if (c.attention == nn::AttentionKind::Linear)
    figure.notes.push_back("linear attention: weight = phi(q_i).phi(k_j) / sum over j' <= i of phi(q_i).phi(k_j'), "
                           "phi = elu + 1 (what it multiplies the values by; no softmax)");
  else if (!c.mask.empty())
    figure.notes.push_back(fmt::format("sparse: every layer's mask is causal & ({}); the keys it hides weigh 0", c.mask));
  figure.notes.push_back(fmt::format("rows: queries (each row sums to 1), columns: keys; entropy: mean over rows, "
                                     "uniform over all {} keys = {:.2f} nats",
                                     n, std::log(static_cast<double>(n))));
  size_t widest = 1, panels = 0;
  for (size_t layer = 0; layer < weights.size(); ++layer) {
    const std::vector<std::vector<float>> heads = split_weights_by_head(weights[layer], c.num_heads);
    plot::HeatmapSection section;
    section.heading = fmt::format("layer {}", layer);
    section.panels = head_panels(heads, n, "");
    widest = std::max(widest, section.panels.size());
    panels += section.panels.size();
    figure.sections.push_back(std::move(section));
  }
  figure.columns = static_cast<int>(std::min<size_t>(widest, 5));
  figure.value_max = 1;  // probabilities: the same scale in every figure of a trained model
  // Every layer is causal, and-ed with the model's own mask (train::AttentionModel::forward).
  mark_masked(figure, c.mask.empty() ? Mask::causal() : Mask::causal() & Mask::parse(c.mask), n);
  const plot::HeatmapLayout layout = plot::draw_heatmaps(figure, o.output);
  fmt::print("wrote {} ({} x {}): {} panels, {} layer{} of {} head{}, {} tokens, task {}, {} attention{}\n", o.output,
             layout.width, layout.height, panels, c.num_layers, c.num_layers == 1 ? "" : "s", c.num_heads,
             c.num_heads == 1 ? "" : "s", n, task.name, train::to_string(c.attention),
             c.mask.empty() ? std::string() : ", mask causal & (" + c.mask + ")");
}

// The pattern of `mask` over n tokens: 1 where a query sees a key, else 0 (visible_pairs).
plot::HeatmapPanel mask_panel(const Mask& mask, int64_t n) {
  const std::vector<uint8_t> seen = visible_pairs(mask, n);
  std::vector<float> pattern(seen.begin(), seen.end());
  const auto visible = static_cast<int64_t>(std::count(seen.begin(), seen.end(), uint8_t{1}));
  plot::HeatmapPanel panel;
  panel.title = mask.str();
  panel.subtitle = fmt::format("{} of {} pairs visible ({:.0f}%)", visible, n * n, 100.0 * visible / (n * n));
  panel.rows = panel.cols = n;
  panel.values = std::move(pattern);
  return panel;
}

// ---------------------------------------------------------------------------------------------

void run_viz(const VizOptions& o) {
  if (models::is_model_folder(o.model)) {
    run_pretrained_viz({.folder = o.model, .text = o.text, .layer = o.layer, .output = o.output});
    return;
  }
  if (o.layer >= 0) throw Error("--layer goes with --model DIR, a Hugging Face model folder");
  if (!o.model.empty()) {
    run_model_viz(o);
    return;
  }
  const std::vector<std::string> tokens = tokenize(o.text, o.chars);
  check_options(o, tokens);
  const auto n = static_cast<int64_t>(tokens.size());
  const Tensor x = embed_tokens(tokens, o.embed, o.seed);
  Mask mask = o.causal ? Mask::causal() : Mask();
  if (!o.mask.empty()) mask &= Mask::parse(o.mask);

  plot::HeatmapFigure figure;
  figure.row_labels = figure.col_labels = tokens;
  const std::string shown_text = o.text.size() > 60 ? o.text.substr(0, 57) + "..." : o.text;
  figure.title = fmt::format("Attention weights on \"{}\"", shown_text);
  const std::string mask_note = !o.mask.empty() ? "mask " + mask.str()
                                : o.causal     ? "causal (token i sees tokens 0..i)"
                                               : "bidirectional (every token sees all)";
  if (!o.mask.empty()) {
    plot::HeatmapSection section;
    section.heading = "the mask: 1 where query i (row) sees key j (column), hatched where it is hidden";
    section.panels.push_back(mask_panel(mask, n));
    figure.sections.push_back(std::move(section));
  }
  std::string entropy_note = fmt::format("uniform over all {} keys = {:.2f} nats", n, std::log(static_cast<double>(n)));

  if (!o.temperatures.empty()) {
    // The course's temperature exercise: one head, softmax(scores / T) for each T.
    const nn::MultiHeadAttention layer = make_layer(o.embed, o.heads, o.seed);
    plot::HeatmapSection section;
    for (double t : o.temperatures) {
      auto panel = make_panel(fmt::format("T = {}", t), head_weights(layer, x, mask, t)[static_cast<size_t>(o.head)], n);
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
      section.panels = head_panels(head_weights(layer, x, mask, 1.0), n, "");
      widest = std::max(widest, section.panels.size());
      figure.sections.push_back(std::move(section));
    }
    figure.columns = static_cast<int>(std::min<size_t>(widest, 5));
    figure.notes.push_back(fmt::format("embed {}, {}; the same Q, K projections split into different head counts",
                                       o.embed, mask_note));
  } else {
    const nn::MultiHeadAttention layer = make_layer(o.embed, o.heads, o.seed);
    plot::HeatmapSection section;
    section.panels = head_panels(head_weights(layer, x, mask, 1.0), n, "");
    figure.columns = grid_columns(section.panels.size());
    figure.sections.push_back(std::move(section));
    figure.notes.push_back(fmt::format("{} heads x {} dims (embed {}), {}", o.heads, o.embed / o.heads, o.embed, mask_note));
  }
  figure.notes.push_back(fmt::format("rows: queries (each row sums to 1), columns: keys; entropy: mean over rows, {}",
                                     entropy_note));
  figure.notes.push_back(fmt::format("untrained layer (seed {}): the patterns are random, not learned", o.seed));

  mark_masked(figure, mask, n);
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
  viz->add_option("text,--text", options->text,
                  "The text to attend over (whitespace-separated tokens; a model folder tokenizes it)")
      ->capture_default_str();
  viz->add_option("--layer", options->layer, "With --model DIR: the layer to draw (default: the one whose heads "
                                             "have the most roles, qkv heads)");
  viz->add_flag("--chars", options->chars, "One token per character instead of per word");
  viz->add_option("--heads", options->heads, "Attention heads")->capture_default_str();
  viz->add_option("--embed", options->embed, "Model width (embed_dim), split evenly across the heads")
      ->capture_default_str();
  viz->add_flag("--causal", options->causal, "Causal mask: each token sees only itself and earlier tokens");
  viz->add_option("--mask", options->mask,
                  "A mask expression, drawn as a pattern and applied to the heads, e.g. "
                  "\"causal & (window(3) | strided(8)) | global(1)\" (see docs/sparse.md)");
  viz->add_option("--temperature", options->temperatures,
                  "Softmax temperatures drawn side by side for one head, e.g. 0.5,1,2")
      ->delimiter(',');
  viz->add_option("--head", options->head, "The head the --temperature panels show")->capture_default_str();
  viz->add_option("--compare-heads", options->compare_heads,
                  "Head counts drawn one above the other with the same projections, e.g. 1,8")
      ->delimiter(',');
  viz->add_option("--model", options->model,
                  "A Hugging Face model folder (its heads of one layer on the text) or a trained model's file "
                  "(`qkv train --save`: its heads, every layer, on --text or an example)");
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
    for (const char* name : {"--heads", "--embed", "--temperature", "--head", "--compare-heads", "--mask"}) {
      if (viz->count(name) > 0) options->layer_options_given.emplace_back(name);
    }
    run_viz(*options);
  });
}

}  // namespace qkv::cli
