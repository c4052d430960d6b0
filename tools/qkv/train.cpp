// `qkv train`: trains the small causal attention model of qkv/train.hpp on a synthetic task that
// only attention can solve, with a progress bar (loss, tokens/s) on stderr, the held-out accuracy
// at the end and each trained head's weights on one example drawn as text, and with --plot as
// heatmaps (plot.hpp: PNG, SVG or PDF by the file's extension).
#include <cblas.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "bounds.hpp"
#include "commands.hpp"
#include "model_file.hpp"
#include "plot.hpp"
#include "qkv/train.hpp"

namespace qkv::cli {

namespace {

struct TrainCommandOptions {
  std::string task = "recall";
  int64_t steps = 3000;
  uint64_t seed = 0;
  std::string save;
  std::string plot;  // heatmaps of the trained heads: .png, .svg or .pdf
  int64_t batch = 64;
  float lr = 3e-3f;
  int64_t warmup = 100;
  int64_t symbols = 16, pairs = 8, length = 8;
  int64_t d_model = 64, heads = 4, layers = 2;
  std::string attention = "softmax";  // "sparse": softmax under --mask; "linear"
  std::string mask;                   // sparse: the pattern, and-ed with causal (default kSparseMask)
  std::string positions = "sinusoidal";
  int64_t eval_sequences = 2000;
  int64_t eval_every = 0;  // 0: ten times over the run
  // One thread: at this model's size (B=64, H=4, N=17, head dim 16) the kernels' thread fork/join
  // costs more than it saves; measured here, 2 threads were ~4x slower per step than 1.
  int threads = 1;
  // Checkpoints (model + AdamW state + step, AttentionModel::save's atomic write).
  std::string checkpoint = "qkv-train.ckpt";
  int64_t checkpoint_every = 0;  // 0: only on Ctrl-C
  bool resume = false;
};

// --attention sparse without --mask: a local window of 3 and every 4th key before it. Every
// task's sequences (16-17 tokens by default) reach any earlier token in two layers, and copy's
// answer, L tokens back, lies on the stride when L is a multiple of 4 (the default 8 is).
constexpr const char* kSparseMask = "window(3) | strided(4)";

// Set by SIGINT (Ctrl-C): the loop saves a checkpoint after the current step and stops. The
// handler then restores the default, so a second Ctrl-C ends the process at once (the atomic
// save leaves either the old checkpoint or the new one, never a torn file).
volatile std::sig_atomic_t interrupted = 0;
void on_sigint(int) {
  interrupted = 1;
  std::signal(SIGINT, SIG_DFL);
}

// Progress on stderr: a bar rewritten in place on a terminal; elsewhere one line per report.
class ProgressBar {
 public:
  explicit ProgressBar(int64_t total) : total_(total), terminal_(isatty(fileno(stderr)) != 0) {}

  void update(const train::TrainStep& s, float smoothed_loss, bool report) {
    if (!terminal_ && !report) return;
    constexpr int kWidth = 30;
    const auto filled = static_cast<int>(kWidth * s.step / std::max<int64_t>(total_, 1));
    const std::string bar = std::string(static_cast<size_t>(filled), '#') + std::string(static_cast<size_t>(kWidth - filled), '.');
    const double rate = s.seconds > 0 ? static_cast<double>(s.tokens) / s.seconds : 0;
    const std::string line = fmt::format("[{}] step {}/{}  loss {:.4f}  lr {:.2e}  {:.0f} tok/s  {:.1f} s", bar, s.step,
                                         total_, smoothed_loss, s.lr, rate, s.seconds);
    if (terminal_) {
      fmt::print(stderr, "\r{}", line);
      if (report) fmt::print(stderr, "\n");
    } else {
      fmt::print(stderr, "{}\n", line);
    }
    std::fflush(stderr);
  }
  void note(const std::string& text) const {
    fmt::print(stderr, "{}{}\n", terminal_ ? "\r\033[K" : "", text);
    std::fflush(stderr);
  }

 private:
  int64_t total_;
  bool terminal_;
};

// One character per weight, darker for more.
std::string shade(float w) {
  static const char* const kRamp[] = {" ", "·", "░", "▒", "▓", "█"};
  if (!std::isfinite(w)) return "?";  // not a weight (NaN, inf): never an index into the ramp
  const int level = w <= 0.02f ? 0 : std::min(5, 1 + static_cast<int>(w * 5.0f));
  return kRamp[level];
}

// Mean over the rows of one (n x n) weight matrix of each row's entropy, in nats.
double mean_entropy(const std::vector<float>& w, int64_t n) {
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double p = w[static_cast<size_t>(i * n + j)];
      if (p > 0) total -= p * std::log(p);
    }
  }
  return n > 0 ? total / static_cast<double>(n) : 0;
}

// The heads of every layer as heatmap panels (one section per layer, one panel per head), token
// labels on both axes, one colour scale for all.
// What the weights of a model's heads are, for the figures' notes (empty for plain softmax).
std::string attention_note(const train::ModelConfig& c) {
  if (c.attention == nn::AttentionKind::Linear)
    return "linear attention: weight = phi(q_i).phi(k_j) / sum over j' <= i of phi(q_i).phi(k_j'), phi = elu + 1";
  if (!c.mask.empty()) return fmt::format("sparse: every layer's mask is causal & ({}); hidden keys weigh 0", c.mask);
  return "";
}

void plot_heads(const std::vector<Tensor>& weights, const train::Batch& example, const train::TaskOptions& task,
                const std::string& task_name, const std::string& path, const train::ModelConfig& config) {
  const int64_t n = example.length;
  plot::HeatmapFigure figure;
  for (int64_t i = 0; i < n; ++i)
    figure.row_labels.push_back(train::token_text(task, example.ids[static_cast<size_t>(i)]));
  figure.col_labels = figure.row_labels;
  figure.title = fmt::format("Trained attention heads, task {}, on one held-out example", task_name);
  figure.notes.push_back("rows: queries (each row sums to 1), columns: keys; causal, so above the diagonal is empty");
  if (!attention_note(config).empty()) figure.notes.push_back(attention_note(config));
  figure.notes.push_back(fmt::format("entropy: mean over rows (uniform over all {} keys = {:.2f} nats)", n,
                                     std::log(static_cast<double>(n))));
  int64_t heads = 1;
  for (size_t layer = 0; layer < weights.size(); ++layer) {
    const Tensor& w = weights[layer];  // (1, H, n, n)
    heads = std::max(heads, w.size(1));
    plot::HeatmapSection section;
    section.heading = fmt::format("layer {}", layer);
    for (int64_t h = 0; h < w.size(1); ++h) {
      plot::HeatmapPanel panel;
      panel.title = fmt::format("head {}", h);
      panel.rows = panel.cols = n;
      panel.values.resize(static_cast<size_t>(n * n));
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) panel.values[static_cast<size_t>(i * n + j)] = w.at({0, h, i, j});
      panel.subtitle = fmt::format("entropy {:.2f} nats", mean_entropy(panel.values, n));
      section.panels.push_back(std::move(panel));
    }
    figure.sections.push_back(std::move(section));
  }
  figure.columns = static_cast<int>(std::min<int64_t>(heads, 4));
  figure.value_max = 1;  // weights are probabilities: a fixed scale makes figures comparable
  const plot::HeatmapLayout layout = plot::draw_heatmaps(figure, path);
  fmt::print("\nWrote the heads' weights to {} ({} x {}): {} layer{} of {} head{}, {} tokens\n", path, layout.width,
             layout.height, weights.size(), weights.size() == 1 ? "" : "s", heads, heads == 1 ? "" : "s", n);
}

// Each layer's heads side by side: rows are queries (the token read), columns keys.
void draw_heads(const train::AttentionModel& model, const train::TaskOptions& task, uint64_t seed,
                const std::string& task_name, const std::string& plot_path) {
  const train::Batch example = train::make_batch(task, 1, seed);
  std::vector<Tensor> weights;
  const Tensor logits = model.forward(example.ids, 1, example.length, {}, &weights);
  const int64_t n = example.length, vocab = model.config().vocab_size;
  std::string sequence, predicted, expected;
  for (int64_t i = 0; i < n; ++i) {
    sequence += train::token_text(task, example.ids[static_cast<size_t>(i)]) + " ";
    if (example.targets[static_cast<size_t>(i)] < 0) continue;
    const float* row = logits.data() + i * vocab;
    predicted += train::token_text(task, std::max_element(row, row + vocab) - row) + " ";
    expected += train::token_text(task, example.targets[static_cast<size_t>(i)]) + " ";
  }
  fmt::print("\nOne held-out example: {}\n  answer    {}\n  predicted {}\n", sequence, expected, predicted);
  fmt::print("\nAttention weights of the trained heads on it (rows: queries, columns: keys;"
             " blank < 0.02 < · < ░ < ▒ < ▓ < █):\n");
  for (size_t layer = 0; layer < weights.size(); ++layer) {
    const Tensor& w = weights[layer];  // (1, H, n, n)
    const int64_t heads = w.size(1);
    std::string header = "      ";
    for (int64_t h = 0; h < heads; ++h) header += fmt::format("{:<{}}", fmt::format("head {}", h), n + 3);
    fmt::print("\nlayer {}\n{}\n", layer, header);
    std::string keys = "      ";
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t j = 0; j < n; ++j) keys += train::token_text(task, example.ids[static_cast<size_t>(j)]);
      keys += "   ";
    }
    fmt::print("{}\n", keys);
    for (int64_t i = 0; i < n; ++i) {
      std::string line = fmt::format("{:>3} {} ", i, train::token_text(task, example.ids[static_cast<size_t>(i)]));
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t j = 0; j < n; ++j) line += shade(w.at({0, h, i, j}));
        line += "   ";
      }
      fmt::print("{}\n", line);
    }
  }
  if (!plot_path.empty()) plot_heads(weights, example, task, task_name, plot_path, model.config());
}

// Every number of the command line in its range, before any work (bounds.hpp).
void check_options(const TrainCommandOptions& o) {
  constexpr int64_t kMaxSteps = 1'000'000'000;  // far beyond any run (a step takes milliseconds)
  check_range("--steps", o.steps, 0, kMaxSteps);
  check_range("--batch", o.batch, 1, 4096);
  check_real_range("--lr", static_cast<double>(o.lr), 1e-9, 10.0);
  check_range("--warmup", o.warmup, 0, kMaxSteps);
  check_range("--symbols", o.symbols, 2, 26);
  check_range("--pairs", o.pairs, 1, 26);
  check_range("--length", o.length, 1, 1024);
  check_range("--d-model", o.d_model, 1, 4096);
  check_range("--heads", o.heads, 1, 256);
  check_range("--layers", o.layers, 1, 64);
  check_range("--eval", o.eval_sequences, 1, 1'000'000);
  if (o.eval_every != 0) check_range("--eval-every", o.eval_every, 1, kMaxSteps);
  check_range("--threads", o.threads, 1, kMaxThreads);
  check_range("--checkpoint-every", o.checkpoint_every, 0, kMaxSteps);
}

void run_train(const TrainCommandOptions& o) {
  check_options(o);
  if (!o.plot.empty()) plot::format_from_path(o.plot);  // a bad extension fails before training, not after
  omp_set_num_threads(o.threads);
  openblas_set_num_threads(o.threads);
  train::TrainOptions options;
  options.task = {.task = train::parse_task(o.task), .symbols = o.symbols, .pairs = o.pairs, .length = o.length};
  options.steps = o.steps;
  options.batch = o.batch;
  options.seed = o.seed;
  options.adamw.lr = o.lr;
  options.warmup_steps = o.warmup;
  const bool linear = o.attention == "linear";
  if (linear && !o.mask.empty())
    throw Error("--attention linear: --mask needs softmax or sparse attention (linear attention is causal only)");
  // A mask makes softmax attention sparse; sparse without one takes the default pattern.
  const std::string mask = o.attention == "sparse" && o.mask.empty() ? std::string(kSparseMask) : o.mask;
  const std::string attention_name = linear ? "linear" : mask.empty() ? "softmax" : "sparse";

  const train::ModelConfig config{.vocab_size = train::vocab_size(options.task),
                                  .max_len = train::sequence_length(options.task),
                                  .d_model = o.d_model,
                                  .num_heads = o.heads,
                                  .num_layers = o.layers,
                                  .attention = linear ? nn::AttentionKind::Linear : nn::AttentionKind::Softmax,
                                  .positions = train::parse_positions(o.positions),
                                  .mask = mask};
  train::Checkpoint resumed;
  train::AttentionModel model = o.resume ? load_model(o.checkpoint, &resumed)
                                         : train::AttentionModel(config, o.seed);
  if (o.resume) {
    const train::ModelConfig& c = model.config();
    if (c.vocab_size != config.vocab_size || c.max_len != config.max_len || c.d_model != config.d_model ||
        c.num_heads != config.num_heads || c.num_layers != config.num_layers || c.attention != config.attention ||
        c.positions != config.positions || c.mask != config.mask)
      throw Error(fmt::format("--resume: {} holds a model of vocabulary {}, length {}, d_model {}, {} heads, {} layers, "
                              "{} attention, {} positions, mask '{}' but this command line asks for {}, {}, {}, {}, {}, "
                              "{}, {}, '{}': resume with the same options",
                              o.checkpoint, c.vocab_size, c.max_len, c.d_model, c.num_heads, c.num_layers,
                              train::to_string(c.attention), train::to_string(c.positions), c.mask, config.vocab_size,
                              config.max_len, config.d_model, config.num_heads, config.num_layers,
                              train::to_string(config.attention), train::to_string(config.positions), config.mask));
    fmt::print("Resumed from {} at step {} of {}\n", o.checkpoint, resumed.step, o.steps);
    options.resume = &resumed;
  }
  options.checkpoint_path = o.checkpoint;
  options.checkpoint_every = o.checkpoint_every;
  interrupted = 0;
  options.stop_requested = [] { return interrupted != 0; };
  std::signal(SIGINT, on_sigint);
  const int64_t eval_every = o.eval_every > 0 ? o.eval_every : std::max<int64_t>(1, o.steps / 10);
  constexpr int64_t kCurveSequences = 500;  // held-out sequences at each report (the final one uses --eval)
  fmt::print("qkv train: task {}, {} steps of batch {}, seed {}; model d_model {}, {} {} heads, {} layers, {} positions, "
             "{} parameters; sequence length {}, vocabulary {}\n",
             o.task, o.steps, o.batch, o.seed, o.d_model, o.heads, attention_name, o.layers, o.positions,
             model.parameter_count(), train::sequence_length(options.task), config.vocab_size);
  if (!mask.empty()) fmt::print("Every layer's mask: causal & ({})\n", Mask::parse(mask).str());
  fmt::print("{:>8} {:>10} {:>10} {:>14} {:>9}\n", "step", "loss", "held-out", "accuracy", "seconds");
  std::fflush(stdout);  // Ctrl-C is handled from here on: say so at once, even into a pipe

  ProgressBar bar(o.steps);
  float smoothed = 0;
  const uint64_t held_out = train::held_out_seed(o.seed);
  double last_seconds = 0;
  const int64_t first_step = resumed.step + 1;
  const train::TrainResult trained = train::train(model, options, [&](const train::TrainStep& s) {
    smoothed = s.step == first_step ? s.loss : 0.95f * smoothed + 0.05f * s.loss;
    const bool report = s.step % eval_every == 0 || s.step == o.steps;
    bar.update(s, smoothed, report);
    last_seconds = s.seconds;
    if (report) {
      // Evaluation time is not training time: it does not count in the bar's tokens/s... but it
      // does pass on the clock, so report the training clock as seen at this step.
      const train::Evaluation e = train::evaluate(model, options.task, kCurveSequences, held_out + 1);
      fmt::print("{:>8} {:>10.4f} {:>10.4f} {:>13.1f}% {:>9.1f}\n", s.step, smoothed, e.loss, 100 * e.accuracy,
                 s.seconds);
      std::fflush(stdout);
    }
  });
  std::signal(SIGINT, SIG_DFL);
  if (trained.interrupted) {
    bar.note(fmt::format("Interrupted: saved a checkpoint at step {} to {}; continue with the same options and --resume",
                         trained.step, o.checkpoint));
    std::exit(130);  // 128 + SIGINT, as a shell reports a process Ctrl-C ended
  }
  const train::Evaluation final_eval = train::evaluate(model, options.task, o.eval_sequences, held_out);
  fmt::print("\nHeld-out accuracy over {} fresh sequences: {:.2f}% of answer tokens, {:.2f}% of sequences all right "
             "(loss {:.4f}; chance {:.2f}%). Trained in {:.1f} s.\n",
             o.eval_sequences, 100 * final_eval.accuracy, 100 * final_eval.sequence_accuracy, final_eval.loss,
             100.0 / static_cast<double>(o.symbols), last_seconds);
  draw_heads(model, options.task, held_out + 2, o.task, o.plot);
  if (!o.save.empty()) {
    model.save(o.save);
    fmt::print("\nSaved the model to {}\n", o.save);
  }
}

}  // namespace

void add_train_command(CLI::App& app) {
  auto options = std::make_shared<TrainCommandOptions>();
  CLI::App* cmd = app.add_subcommand(
      "train", "Train a small causal attention model on a task only attention can solve (copy, recall, reverse)");
  cmd->add_option("--task", options->task, "copy: a b c | a b c; reverse: a b c | c b a; recall: k1 v1 ... kP vP k -> v")
      ->check(CLI::IsMember({"copy", "recall", "reverse"}))
      ->capture_default_str();
  cmd->add_option("--attention", options->attention,
                  std::string("softmax; sparse: softmax under a sparse --mask (default \"") + kSparseMask +
                      "\"); or linear: linear attention (elu+1 features, causal), O(N) per layer")
      ->check(CLI::IsMember({"softmax", "sparse", "linear"}))
      ->capture_default_str();
  cmd->add_option("--mask", options->mask,
                  "A mask expression every layer ands with causal (qkv viz --mask's syntax), saved in the model, "
                  "e.g. \"window(3) | strided(4)\"");
  cmd->add_option("--positions", options->positions,
                  "sinusoidal: a fixed table added to the embedding; rotary: RoPE on q and k in every layer; t5: a "
                  "learned relative-position bias per head in every layer (T5's causal buckets)")
      ->check(CLI::IsMember({"sinusoidal", "rotary", "t5"}))
      ->capture_default_str();
  cmd->add_option("--steps", options->steps, "Optimizer steps")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--seed", options->seed, "Seed of the weights and of every batch")->capture_default_str();
  cmd->add_option("--save", options->save, "Write the trained model to this .qkv file");
  cmd->add_option("--plot", options->plot,
                  "Also draw the trained heads' weights on the example as heatmaps (.png, .svg or .pdf)");
  cmd->add_option("--batch", options->batch, "Sequences per step")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--lr", options->lr, "Peak learning rate of AdamW (warm-up, then cosine to a tenth)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--warmup", options->warmup, "Warm-up steps")->check(CLI::NonNegativeNumber)->capture_default_str();
  cmd->add_option("--symbols", options->symbols, "Symbols of the task's vocabulary (2-26)")->capture_default_str();
  cmd->add_option("--pairs", options->pairs, "recall: key-value pairs per sequence")->capture_default_str();
  cmd->add_option("--length", options->length, "copy, reverse: symbols per sequence")->capture_default_str();
  cmd->add_option("--d-model", options->d_model, "Model width")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--heads", options->heads, "Attention heads per layer")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--layers", options->layers, "Attention layers")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->add_option("--eval", options->eval_sequences, "Held-out sequences for the final accuracy")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--eval-every", options->eval_every, "Steps between curve lines (default: a tenth of the run)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--threads", options->threads, "Threads for OpenMP and OpenBLAS (1 is fastest for the default model)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  cmd->add_option("--checkpoint", options->checkpoint,
                  "Checkpoint file (model + optimizer state + step): written every --checkpoint-every steps and on "
                  "Ctrl-C, read by --resume")
      ->capture_default_str();
  cmd->add_option("--checkpoint-every", options->checkpoint_every, "Steps between checkpoints (0: only on Ctrl-C)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  cmd->add_flag("--resume", options->resume,
                "Continue from --checkpoint (same options as the run that wrote it: the result equals an "
                "uninterrupted run)");
  cmd->callback([options] { run_train(*options); });
}

}  // namespace qkv::cli
