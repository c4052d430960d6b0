// `qkv generate`: greedy generation with a trained model (`qkv train --save`), from its KV cache
// (one prefill, then one token per step) or recomputing the whole prefix at every step, with
// tokens/s; --plot (or --sweep) also times generation far past the trained length and draws the
// time per token against the position with and without the cache.
//
//   qkv generate --model copy.qkv                         # one example prompt of the model's task
//   qkv generate --model copy.qkv --prompt "a b c d |" --kv-dtype bf16
//   qkv generate --model copy.qkv --plot generation.png   # cached vs recomputed, to position 2048
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "bounds.hpp"
#include "commands.hpp"
#include "model_file.hpp"
#include "numbers.hpp"
#include "plot.hpp"
#include "pretrained.hpp"
#include "qkv/qkv.hpp"
#include "qkv/train.hpp"
#include "text_attention.hpp"

namespace qkv::cli {
namespace {

// The farthest position --sweep times (its recomputed steps grow as the square of the position).
constexpr int64_t kMaxSweep = 16384;

struct GenerateCommandOptions {
  std::string model;
  // A .qkv model: one, ids ("3 1 4") or the task's letters ("a b c |"); none: one example. A
  // model folder: texts, several generated together.
  std::vector<std::string> prompts;
  int64_t tokens = -1;  // -1: the task's answer length
  std::string kv_dtype;  // empty: f32 for a .qkv model, bf16 for a model folder
  // A Hugging Face model folder's sampling (pretrained.hpp); the prompt is text.
  float temperature = 0;
  int64_t top_k = 0;
  float top_p = 1;
  bool ignore_eos = false;
  bool no_cache = false;
  std::string plot;
  int64_t sweep = 0;    // generate to this position, cached and recomputed (--plot: default 2048)
  int64_t repeats = 3;  // recomputed steps timed per sampled position (the median counts)
  uint64_t seed = 0;
  int threads = 1;
};

DType parse_dtype(const std::string& name) {
  if (name == "f32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  if (name == "f16") return DType::F16;
  throw Error("--kv-dtype " + name + " goes with a model folder: a .qkv model caches f32, bf16 or f16");
}

// The prompt's ids: whitespace-separated integers, or tokens of the task's text (letters, '|').
std::vector<int64_t> prompt_ids(const std::string& prompt, const train::TaskOptions& task, int64_t vocab) {
  std::istringstream words(prompt);
  std::vector<int64_t> ids;
  for (std::string word; words >> word;) {
    const bool number = std::all_of(word.begin(), word.end(), [](char c) { return c >= '0' && c <= '9'; });
    int64_t id = -1;
    if (number && word.size() < 10) {
      id = std::stoll(word);
    } else {
      for (int64_t t = 0; t < vocab; ++t)
        if (train::token_text(task, t) == word) id = t;
    }
    if (id < 0 || id >= vocab)
      throw Error(fmt::format("--prompt: '{}' is not a token of this model: give ids 0 to {} or its letters a to {} "
                              "and '|', separated by spaces",
                              word, vocab - 1, train::token_text(task, vocab - 2)));
    ids.push_back(id);
  }
  if (ids.empty()) throw Error("--prompt is empty: give at least one token");
  return ids;
}

std::string text_of(const std::vector<int64_t>& ids, const train::TaskOptions& task) {
  std::string text;
  for (int64_t id : ids) text += (text.empty() ? "" : " ") + train::token_text(task, id);
  return text;
}

double median(std::vector<double> v) {
  if (v.empty()) return NAN;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The timing sweep: one cached generation from the prompt to position `last`, and recomputed
// steps (a whole-prefix forward) at sampled positions, on the model's weights with a positional
// range stretched to `last` + 1 (the tokens past the trained length are noise; the time is not).
struct Sweep {
  std::vector<double> positions;                          // sampled positions
  std::vector<double> cached_attention, cached_total;     // medians of the cached steps around each
  std::vector<double> recomputed_attention, recomputed_total;
};

Sweep run_sweep(const train::AttentionModel& trained, const std::vector<int64_t>& prompt, int64_t last,
                DType dtype, int64_t repeats) {
  const train::AttentionModel model = trained.with_max_len(last + 1);
  const auto prompt_length = static_cast<int64_t>(prompt.size());
  if (last < 2 * prompt_length || last < 32)
    throw Error(fmt::format("--sweep {}: sweep to a position of at least 32 and twice the prompt ({} tokens)", last,
                            prompt_length));
  const train::Generation cached =
      train::generate(model, prompt, {.tokens = last - prompt_length + 2, .use_cache = true, .kv_dtype = dtype});
  // Sampled positions: 16 per octave's start, 1.5x between, from 16 up to `last`.
  std::vector<int64_t> sampled;
  for (int64_t p = 16; p <= last; p *= 2) {
    sampled.push_back(p);
    if (p * 3 / 2 <= last) sampled.push_back(p * 3 / 2);
  }
  if (sampled.back() != last) sampled.push_back(last);
  Sweep sweep;
  std::vector<int64_t> sequence = prompt;
  sequence.insert(sequence.end(), cached.ids.begin(), cached.ids.end());
  for (int64_t p : sampled) {
    if (p < prompt_length) continue;
    // Cached: the decode steps (one token read) at positions p - 15 .. p.
    std::vector<double> attention, total;
    for (const auto& step : cached.steps)
      if (step.read == 1 && step.position <= p && step.position > p - 16) {
        attention.push_back(step.attention_seconds);
        total.push_back(step.total_seconds);
      }
    // Recomputed: the forward over the p + 1 tokens 0 .. p, as generation without a cache runs it.
    std::vector<double> re_attention, re_total;
    const std::vector<int64_t> prefix(sequence.begin(), sequence.begin() + p + 1);
    for (int64_t r = 0; r < repeats; ++r) {
      const train::Generation one = train::generate(model, prefix, {.tokens = 1, .use_cache = false});
      re_attention.push_back(one.steps[0].attention_seconds);
      re_total.push_back(one.steps[0].total_seconds);
    }
    sweep.positions.push_back(static_cast<double>(p));
    sweep.cached_attention.push_back(median(attention));
    sweep.cached_total.push_back(median(total));
    sweep.recomputed_attention.push_back(median(re_attention));
    sweep.recomputed_total.push_back(median(re_total));
  }
  return sweep;
}

// The sweep's figures: slopes of log time against log position from position 128 on, and the
// speedup of the cache at the last position.
void report_sweep(const Sweep& s, const train::AttentionModel& model, const std::string& dtype_name,
                  const std::string& plot_path) {
  std::vector<double> x, cached, recomputed;
  const size_t end = s.positions.size() - 1;
  const auto last = static_cast<int64_t>(s.positions[end]);
  const int64_t from = std::min<int64_t>(128, last / 4);  // below, fixed per-call costs dominate
  for (size_t i = 0; i < s.positions.size(); ++i)
    if (s.positions[i] >= static_cast<double>(from)) {
      x.push_back(s.positions[i]);
      cached.push_back(s.cached_attention[i]);
      recomputed.push_back(s.recomputed_attention[i]);
    }
  const PowerLawFit cached_fit = fit_power_law(x, cached), recomputed_fit = fit_power_law(x, recomputed);
  fmt::print("\nTime per token against position (ms; cached: median of the 16 decode steps up to the position, "
             "recomputed: median whole-prefix forward):\n");
  fmt::print("{:>9} {:>17} {:>17} {:>19} {:>19} {:>9}\n", "position", "cached attention", "cached total",
             "recomputed attention", "recomputed total", "speedup");
  for (size_t i = 0; i < s.positions.size(); ++i)
    fmt::print("{:>9} {:>17.4f} {:>17.4f} {:>19.4f} {:>19.4f} {:>8.1f}x\n", static_cast<int64_t>(s.positions[i]),
               1e3 * s.cached_attention[i], 1e3 * s.cached_total[i], 1e3 * s.recomputed_attention[i],
               1e3 * s.recomputed_total[i], s.recomputed_attention[i] / s.cached_attention[i]);
  fmt::print("log-log slope of the attention time per token from position {} to {}: cached {:.2f}, recomputed {:.2f}\n",
             from, last, cached_fit.slope, recomputed_fit.slope);
  for (size_t i = 0; i < s.positions.size(); ++i) {
    if (i != end && s.positions[i] != 2048) continue;  // the reference position, and the last
    fmt::print("at position {}: the cache makes the attention layers {:.1f}x faster per token ({:.4f} ms against "
               "{:.4f} ms), and the whole step {:.1f}x\n",
               static_cast<int64_t>(s.positions[i]), s.recomputed_attention[i] / s.cached_attention[i],
               1e3 * s.cached_attention[i], 1e3 * s.recomputed_attention[i], s.recomputed_total[i] / s.cached_total[i]);
  }
  if (plot_path.empty()) return;
  plot::LineFigure figure;
  const train::ModelConfig& c = model.config();
  figure.title = "Generation: time per token against position, with and without the KV cache";
  figure.notes.push_back(fmt::format("model: d_model {}, {} heads, {} layers, {} positions; K/V cache in {}; "
                                     "positions past the trained length {} are timed, not meaningful",
                                     c.d_model, c.num_heads, c.num_layers, train::to_string(c.positions), dtype_name,
                                     c.max_len));
  figure.notes.push_back(fmt::format("slopes from {} to {}: cached attention {:.2f} (each old token read once: linear), "
                                     "recomputed {:.2f} (the whole prefix again: quadratic)",
                                     from, last, cached_fit.slope, recomputed_fit.slope));
  plot::LinePlot attention, total;
  attention.title = "attention layers";
  total.title = "whole step";
  for (plot::LinePlot* p : {&attention, &total}) {
    p->x_label = "position";
    p->y_label = "seconds per token";
  }
  attention.series.push_back({fmt::format("KV cache (slope {:.2f})", cached_fit.slope), plot::kFlashColour, s.positions,
                              s.cached_attention});
  attention.series.push_back({fmt::format("recompute (slope {:.2f})", recomputed_fit.slope), plot::kReferenceColour,
                              s.positions, s.recomputed_attention});
  total.series.push_back({"KV cache", plot::kFlashColour, s.positions, s.cached_total});
  total.series.push_back({"recompute", plot::kReferenceColour, s.positions, s.recomputed_total});
  figure.plots = {attention, total};
  const plot::LineLayout layout = plot::draw_line_plots(figure, plot_path);
  fmt::print("wrote {} ({} x {})\n", plot_path, layout.width, layout.height);
}

// A Hugging Face model folder generates text (pretrained.cpp); the .qkv models' options that do
// not apply to it are refused rather than ignored.
void run_folder_generate(const GenerateCommandOptions& o) {
  if (o.no_cache || !o.plot.empty() || o.sweep > 0)
    throw Error("--no-cache, --plot and --sweep go with a .qkv model; a model folder always generates from its cache");
  run_pretrained_generate({.folder = o.model,
                           .prompts = o.prompts,
                           .max_tokens = o.tokens >= 0 ? o.tokens : 32,
                           .kv_dtype = o.kv_dtype.empty() ? "bf16" : o.kv_dtype,
                           .temperature = o.temperature,
                           .top_k = o.top_k,
                           .top_p = o.top_p,
                           .seed = o.seed,
                           .ignore_eos = o.ignore_eos});
}

void run_generate(const GenerateCommandOptions& o) {
  check_range("--threads", o.threads, 1, kMaxThreads);
  omp_set_num_threads(o.threads);
  openblas_set_num_threads(o.threads);
  if (models::is_model_folder(o.model)) {
    run_folder_generate(o);
    return;
  }
  if (o.temperature != 0 || o.top_k != 0 || o.top_p != 1 || o.ignore_eos)
    throw Error("--temperature, --top-k, --top-p and --ignore-eos go with a model folder (config.json, "
                "model.safetensors); a .qkv model generates greedily");
  if (o.prompts.size() > 1)
    throw Error("several prompts go with a model folder (generated together); a .qkv model takes one");
  if (!o.plot.empty()) plot::format_from_path(o.plot);  // a bad extension fails before the work
  check_range("--repeats", o.repeats, 1, 1000);
  if (o.tokens >= 0) check_range("--tokens", o.tokens, 0, train::kMaxLen);
  if (o.sweep != 0) check_range("--sweep", o.sweep, 32, kMaxSweep);
  const DType dtype = parse_dtype(o.kv_dtype.empty() ? "f32" : o.kv_dtype);
  const train::AttentionModel model = load_model(o.model);
  const train::ModelConfig& c = model.config();
  const ModelTask task = model_task(model, "", o.seed);
  // The prompt: --prompt, or one example of the model's task up to where its answer starts.
  std::vector<int64_t> prompt, expected;
  if (!o.prompts.empty()) {
    prompt = prompt_ids(o.prompts[0], task.options, c.vocab_size);
  } else {
    const train::Batch example = train::make_batch(task.options, 1, train::held_out_seed(o.seed));
    std::vector<int64_t> tokens = example.ids;
    int64_t first = 0;  // the first scored position: its target is the answer's first token
    while (example.targets[static_cast<size_t>(first)] < 0) ++first;
    prompt.assign(tokens.begin(), tokens.begin() + first + 1);
    for (int64_t i = first; i < example.length; ++i) expected.push_back(example.targets[static_cast<size_t>(i)]);
  }
  const auto prompt_length = static_cast<int64_t>(prompt.size());
  const int64_t tokens = o.tokens >= 0 ? o.tokens
                         : !expected.empty() ? static_cast<int64_t>(expected.size())
                                             : std::max<int64_t>(1, c.max_len + 1 - prompt_length);
  const bool cache = !o.no_cache && c.attention == nn::AttentionKind::Softmax;
  const std::string why = !o.no_cache && !cache ? " (a linear model's state is not cached: recomputing)" : "";
  const train::Generation g =
      train::generate(model, prompt, {.tokens = tokens, .use_cache = cache, .kv_dtype = dtype});
  double seconds = 0, attention = 0;
  for (const auto& step : g.steps) {
    seconds += step.total_seconds;
    attention += step.attention_seconds;
  }
  fmt::print("model {}: task {}, {} attention, {} positions{}, {} layers x {} heads, max_len {}\n", o.model, task.name,
             train::to_string(c.attention), train::to_string(c.positions), c.mask.empty() ? "" : ", mask " + c.mask,
             c.num_layers, c.num_heads, c.max_len);
  fmt::print("prompt:    {}\n", text_of(prompt, task.options));
  fmt::print("generated: {}\n", text_of(g.ids, task.options));
  if (!expected.empty()) {
    expected.resize(std::min(expected.size(), g.ids.size()));
    size_t right = 0;
    for (size_t i = 0; i < expected.size(); ++i) right += expected[i] == g.ids[i];
    fmt::print("expected:  {}  ({} of {} right)\n", text_of(expected, task.options), right, expected.size());
  }
  std::string ids;
  for (int64_t id : g.ids) ids += (ids.empty() ? "" : " ") + std::to_string(id);
  fmt::print("ids:       {}\n", ids);
  fmt::print("{} tokens in {:.3f} ms: {:.0f} tokens/s ({}{}; {:.0f}% of the time in attention layers)\n", tokens,
             1e3 * seconds, seconds > 0 ? static_cast<double>(tokens) / seconds : 0,
             cache ? "KV cache in " + std::string(to_string(dtype))
                   : std::string("no cache: the prefix recomputed at every step"),
             why,
             seconds > 0 ? 100 * attention / seconds : 0);
  const int64_t sweep = o.sweep > 0 ? o.sweep : (o.plot.empty() ? 0 : 2048);
  if (sweep > 0) {
    if (c.attention != nn::AttentionKind::Softmax)
      throw Error("--sweep / --plot compare the KV cache with recomputing: they need a softmax (or sparse) model");
    report_sweep(run_sweep(model, prompt, sweep, dtype, o.repeats), model, std::string(to_string(dtype)), o.plot);
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto options = std::make_shared<GenerateCommandOptions>();
  CLI::App* cmd = app.add_subcommand(
      "generate", "Generate text with a Hugging Face model folder, or tokens with a trained .qkv model");
  cmd->add_option("--model", options->model,
                  "A Hugging Face model folder (config.json, model.safetensors, tokenizer.json) or a .qkv file "
                  "(qkv train --save)")
      ->required();
  cmd->add_option("prompt,--prompt", options->prompts,
                  "A model folder: the text to continue; several are generated together, without padding. A .qkv "
                  "model: token ids (\"3 1 4\") or the task's letters (\"a b c |\"); default: one example of the "
                  "model's task");
  cmd->add_option("--tokens", options->tokens, "New tokens at most (default: 32, a .qkv model's task: its answer)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--kv-dtype", options->kv_dtype,
                  "The cache's keys and values: f32, bf16 or f16, or for a model folder int8 or int4 (default: bf16 "
                  "for a model folder, f32 for .qkv)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "int8", "int4"}));
  cmd->add_option("--temperature", options->temperature, "A model folder: sampling temperature, 0 for greedy")
      ->capture_default_str();
  cmd->add_option("--top-k", options->top_k, "A model folder: sample among the k most likely tokens (0: all)")
      ->capture_default_str();
  cmd->add_option("--top-p", options->top_p, "A model folder: sample among the most likely tokens up to this mass")
      ->capture_default_str();
  cmd->add_flag("--ignore-eos", options->ignore_eos, "A model folder: do not stop at the end-of-sequence token");
  cmd->add_flag("--no-cache", options->no_cache, "Recompute the whole prefix at every step");
  cmd->add_option("--plot", options->plot,
                  "Draw the time per token against the position, cached and recomputed (.png, .svg or .pdf); "
                  "sweeps to --sweep (default 2048)");
  cmd->add_option("--sweep", options->sweep,
                  "Time generation to this position with and without the cache, print slopes and the speedup")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--repeats", options->repeats, "Recomputed steps timed per sampled position")->capture_default_str();
  cmd->add_option("--seed", options->seed, "Seed of the example prompt")->capture_default_str();
  cmd->add_option("--threads", options->threads, "Threads for OpenMP")->check(CLI::PositiveNumber)->capture_default_str();
  cmd->callback([options] { run_generate(*options); });
}

}  // namespace qkv::cli
