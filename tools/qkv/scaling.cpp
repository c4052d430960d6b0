// `qkv scaling`: the O(n^2) wall, measured. For N = 256, 512, ... (doubling) it times the
// reference and flash kernels on random (1, heads, N, head_dim) inputs, measures the scratch
// memory each kernel allocates beyond its inputs and output (qkv counts its own tensors and
// workspaces: qkv::memory_stats), fits log-log slopes, prints a table and writes a plot.
//
//   qkv scaling                                   # N up to 4096, about a minute on a laptop core
//   qkv scaling --max-seq 16384 -o scaling.png    # the long run
//
// Expected: time slope ~2 for both (attention does N^2 work either way); scratch slope 2 for
// the reference (it materialises an N x N score matrix) and ~0 for flash (fixed-size tiles),
// beside the output both must write, H x N x d: slope 1.
// Before each new N it predicts that size's memory from the last one and stops, rather than
// swap, when the prediction passes --max-mem.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "numbers.hpp"
#include "commands.hpp"
#include "plot.hpp"
#include "qkv/qkv.hpp"

namespace qkv::cli {
namespace {

struct ScalingOptions {
  int64_t min_seq = 256;
  int64_t max_seq = 4096;
  int64_t heads = 8;
  int64_t head_dim = 64;
  int repeats = 5;
  std::string max_mem;  // empty: half the machine's RAM
  std::string output = "scaling.png";
  bool linear = false;  // also linear attention (qkv::linear_attention, elu+1, no mask)
};

// ---------------------------------------------------------------------------------------------
// Memory budget

// MemTotal from /proc/meminfo, in bytes; 0 when it cannot be read.
int64_t machine_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t value = 0;
  while (meminfo >> key >> value >> unit) {
    if (key == "MemTotal:") return value * 1024;  // the kernel reports kB (KiB)
  }
  return 0;
}

// "8G", "512M", "1.5GiB", "1000000" (bytes) -> bytes.
int64_t parse_bytes(const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit.ends_with("IB")) unit.erase(unit.size() - 2);
  else if (unit.ends_with("B")) unit.pop_back();
  double scale = 0;
  if (unit.empty()) scale = 1;
  else if (unit == "K") scale = 1024.0;
  else if (unit == "M") scale = 1024.0 * 1024;
  else if (unit == "G") scale = 1024.0 * 1024 * 1024;
  else if (unit == "T") scale = 1024.0 * 1024 * 1024 * 1024;
  if (used == 0 || scale == 0 || !(value > 0)) {
    throw Error(fmt::format("--max-mem '{}' is not a positive size: write e.g. 8G, 512M or 1000000 (bytes)", text));
  }
  return static_cast<int64_t>(value * scale);
}

// ---------------------------------------------------------------------------------------------
// Measuring

struct Measurement {
  double median_ms = 0;
  int64_t extra_bytes = 0;  // scratch: qkv's peak during a call into a ready output, minus before it
};

struct Row {
  int64_t n = 0;
  int64_t output_bytes = 0;  // the output and log-sum-exp both kernels write
  Measurement reference, flash;
  Measurement linear;  // with --linear
};

double flops(const ScalingOptions& o, int64_t n) {
  // QK^T and PV: 2 * N * N * d each, per head.
  return 4.0 * static_cast<double>(o.heads) * static_cast<double>(n) * static_cast<double>(n) *
         static_cast<double>(o.head_dim);
}

// Progress on stderr: one line rewritten in place on a terminal, a line per step otherwise.
bool stderr_is_terminal() {
  static const bool terminal = isatty(fileno(stderr)) != 0;
  return terminal;
}
void progress(const std::string& text, bool step) {
  if (stderr_is_terminal()) fmt::print(stderr, "\r\033[K{}", text);
  else if (step) fmt::print(stderr, "{}\n", text);
  std::fflush(stderr);
}
void end_progress() {
  if (stderr_is_terminal()) fmt::print(stderr, "\r\033[K");
}

// `call` writes into an output it keeps (allocated by its first call).
Measurement measure_calls(const std::function<void()>& call, int repeats, const std::string& label) {
  using Clock = std::chrono::steady_clock;
  Measurement m;
  progress(fmt::format("{} ...", label), true);

  // Scratch: a call into a ready output from fresh workspaces allocates only what the kernel
  // needs beyond its inputs and output. (The first call, allocating the output, warms up.)
  call();
  release_workspaces();
  const int64_t before = memory_stats().current_bytes;
  reset_peak_memory();
  call();
  m.extra_bytes = memory_stats().peak_bytes - before;

  // Time: repeated calls into the same output, the median.
  std::vector<double> times_ms;
  for (int r = 0; r < repeats; ++r) {
    progress(fmt::format("{} run {}/{}", label, r + 1, repeats), false);
    const auto start = Clock::now();
    call();
    times_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    // A slow size gets 3 runs, enough for a median, instead of minutes more.
    if (r + 1 >= 3 && times_ms.front() > 2000) break;
  }
  std::sort(times_ms.begin(), times_ms.end());
  m.median_ms = times_ms[times_ms.size() / 2];
  release_workspaces();
  return m;
}

Measurement measure(const Tensor& q, const Tensor& k, const Tensor& v, Backend backend, int repeats,
                    const std::string& label, AttentionResult& result) {
  AttentionOptions options;
  options.backend = backend;
  return measure_calls([&] { scaled_dot_product_attention_into(q, k, v, result, options); }, repeats, label);
}

void check_options(const ScalingOptions& o) {
  if (o.min_seq <= 0) throw Error(fmt::format("--min-seq must be positive, got {}", o.min_seq));
  if (o.max_seq < o.min_seq) throw Error(fmt::format("--max-seq ({}) must be at least --min-seq ({})", o.max_seq, o.min_seq));
  if (o.heads <= 0) throw Error(fmt::format("--heads must be positive, got {}", o.heads));
  if (o.head_dim <= 0) throw Error(fmt::format("--head-dim must be positive, got {}", o.head_dim));
  if (o.repeats <= 0) throw Error(fmt::format("--repeats must be positive, got {}", o.repeats));
  plot::format_from_path(o.output);
}

// The predicted qkv memory of one size: inputs and output, plus each kernel's extra grown from
// the last measured size by its fitted exponent (2 before there are two sizes to fit).
int64_t predict_bytes(const ScalingOptions& o, const std::vector<Row>& rows, int64_t n) {
  const double io = 4.0 * 4.0 * static_cast<double>(o.heads) * static_cast<double>(n) * static_cast<double>(o.head_dim);
  if (rows.empty()) return static_cast<int64_t>(io + 4.0 * static_cast<double>(n) * static_cast<double>(n));
  const Row& last = rows.back();
  const double growth = static_cast<double>(n) / static_cast<double>(last.n);
  const double extra = std::max(static_cast<double>(last.reference.extra_bytes), static_cast<double>(last.flash.extra_bytes));
  return static_cast<int64_t>(io + extra * growth * growth);
}

std::string slope_text(double slope) { return std::isfinite(slope) ? fmt::format("{:.2f}", slope) : "n/a"; }

void run_scaling(const ScalingOptions& o) {
  check_options(o);
  const int64_t ram = machine_memory_bytes();
  const int64_t budget = o.max_mem.empty() ? (ram > 0 ? ram / 2 : int64_t{4} << 30) : parse_bytes(o.max_mem);

  fmt::print("qkv scaling: batch 1, {} heads, head dim {}, no mask; median of up to {} calls per point\n", o.heads,
             o.head_dim, o.repeats);
  fmt::print("memory budget {} ({}); scratch = what a kernel allocates beyond its inputs and output\n",
             human_bytes(static_cast<double>(budget)),
             o.max_mem.empty() ? "half of this machine's RAM" : "--max-mem");

  std::vector<Row> rows;
  std::string stopped;
  for (int64_t n = o.min_seq; n <= o.max_seq; n *= 2) {
    const int64_t predicted = predict_bytes(o, rows, n);
    if (predicted > budget) {
      stopped = fmt::format("stopped before N = {}: it would need about {}, over the {} budget (--max-mem)", n,
                            human_bytes(static_cast<double>(predicted)), human_bytes(static_cast<double>(budget)));
      break;
    }
    const Tensor q = Tensor::randn({1, o.heads, n, o.head_dim}, 1);
    const Tensor k = Tensor::randn({1, o.heads, n, o.head_dim}, 2);
    const Tensor v = Tensor::randn({1, o.heads, n, o.head_dim}, 3);
    Row row;
    row.n = n;
    AttentionResult result;
    row.reference = measure(q, k, v, Backend::Reference, o.repeats, fmt::format("N = {}: reference", n), result);
    row.flash = measure(q, k, v, Backend::Flash, o.repeats, fmt::format("N = {}: flash", n), result);
    row.output_bytes = static_cast<int64_t>(sizeof(float)) * (result.output.numel() + result.lse.numel());
    Tensor linear_output;
    if (o.linear)
      row.linear = measure_calls([&] { linear_attention_into(q, k, v, linear_output); }, o.repeats,
                                 fmt::format("N = {}: linear", n));
    rows.push_back(row);
    if (n > o.max_seq / 2) break;  // the next doubling would pass --max-seq (and could overflow)
  }
  end_progress();
  if (rows.empty()) throw Error(stopped.empty() ? "nothing was measured" : stopped);

  fmt::print("\n{:>6}  {:>12} {:>10} {:>8}  {:>9} {:>10}  {:>13} {:>13} {:>10}\n", "N", "reference ms", "flash ms",
             "speedup", "ref GF/s", "flash GF/s", "ref scratch", "flash scratch", "output");
  std::vector<double> ns, ref_ms, flash_ms, ref_mib, flash_mib, output_mib;
  for (const Row& r : rows) {
    const double gflop = flops(o, r.n) / 1e9;
    fmt::print("{:>6}  {:>12.2f} {:>10.2f} {:>7.1f}x  {:>9.1f} {:>10.1f}  {:>13} {:>13} {:>10}\n", r.n,
               r.reference.median_ms, r.flash.median_ms, r.reference.median_ms / r.flash.median_ms,
               gflop / (r.reference.median_ms / 1e3), gflop / (r.flash.median_ms / 1e3),
               human_bytes(static_cast<double>(r.reference.extra_bytes)),
               human_bytes(static_cast<double>(r.flash.extra_bytes)), human_bytes(static_cast<double>(r.output_bytes)));
    ns.push_back(static_cast<double>(r.n));
    ref_ms.push_back(r.reference.median_ms);
    flash_ms.push_back(r.flash.median_ms);
    ref_mib.push_back(static_cast<double>(r.reference.extra_bytes) / (1024.0 * 1024.0));
    flash_mib.push_back(static_cast<double>(r.flash.extra_bytes) / (1024.0 * 1024.0));
    output_mib.push_back(static_cast<double>(r.output_bytes) / (1024.0 * 1024.0));
  }
  const PowerLawFit ref_time = fit_power_law(ns, ref_ms), flash_time = fit_power_law(ns, flash_ms);
  const PowerLawFit ref_mem = fit_power_law(ns, ref_mib), flash_mem = fit_power_law(ns, flash_mib);
  fmt::print("\nlog-log slopes (cost ~ N^slope): time reference {}, flash {}; scratch reference {}, flash {}\n",
             slope_text(ref_time.slope), slope_text(flash_time.slope), slope_text(ref_mem.slope),
             slope_text(flash_mem.slope));
  fmt::print("expected: time ~2 for both (N^2 work either way); scratch 2 for reference (an N x N score\n"
             "matrix), ~0 for flash (fixed-size tiles); the output both write grows as N (slope 1)\n");
  std::vector<double> linear_ms, linear_mib;
  for (const Row& r : rows) {
    linear_ms.push_back(r.linear.median_ms);
    linear_mib.push_back(static_cast<double>(r.linear.extra_bytes) / (1024.0 * 1024.0));
  }
  const PowerLawFit linear_time = fit_power_law(ns, linear_ms);
  if (o.linear) {
    fmt::print("\nlinear attention (qkv::linear_attention, elu+1, no mask):\n{:>6}  {:>10} {:>17} {:>15}\n", "N",
               "linear ms", "flash / linear", "linear scratch");
    for (const Row& r : rows)
      fmt::print("{:>6}  {:>10.2f} {:>16.1f}x {:>15}\n", r.n, r.linear.median_ms, r.flash.median_ms / r.linear.median_ms,
                 human_bytes(static_cast<double>(r.linear.extra_bytes)));
    const Row* crossover = nullptr;
    for (const Row& r : rows)
      if (!crossover && r.linear.median_ms < r.flash.median_ms) crossover = &r;
    fmt::print("log-log time slope: linear {} (expected ~1: O(N d^2)); linear is faster than flash from N = {}\n",
               slope_text(linear_time.slope), crossover ? std::to_string(crossover->n) : "(not in this range)");
  }
  if (rows.size() < 3) fmt::print("(fewer than 3 sizes: the slopes are rough; raise --max-seq)\n");
  if (!stopped.empty()) fmt::print("{}\n", stopped);

  // The plot: measured curves, and a dashed N^2 guide through the reference's largest size,
  // where fixed per-call costs matter least.
  const auto guide = [&](const std::vector<double>& ys, double exponent, plot::Rgb colour, const std::string& label) {
    plot::Series s{label, colour, {}, {}, true};
    for (double n : ns) {
      s.x.push_back(n);
      s.y.push_back(ys.back() * std::pow(n / ns.back(), exponent));
    }
    return s;
  };
  const plot::Rgb grey{0.55, 0.55, 0.55};
  plot::LineFigure figure;
  figure.title = "The O(N\u00b2) wall: reference vs flash attention";
  figure.notes.push_back(fmt::format("batch 1, {} heads, head dim {}, no mask; time: median of up to {} calls", o.heads,
                                     o.head_dim, o.repeats));
  figure.notes.push_back("scratch: the peak memory a kernel allocates beyond its inputs and output (qkv::memory_stats)");
  plot::LinePlot time_plot{"Time per call", "sequence length N", "milliseconds", {}, true};
  time_plot.series.push_back({fmt::format("reference (slope {})", slope_text(ref_time.slope)), plot::kReferenceColour, ns, ref_ms});
  time_plot.series.push_back({fmt::format("flash (slope {})", slope_text(flash_time.slope)), plot::kFlashColour, ns, flash_ms});
  if (o.linear)
    time_plot.series.push_back({fmt::format("linear (slope {})", slope_text(linear_time.slope)), {0.2, 0.6, 0.3}, ns,
                                linear_ms});
  time_plot.series.push_back(guide(ref_ms, 2, grey, "\u221d N\u00b2 (slope 2)"));
  plot::LinePlot memory_plot{"Scratch memory per call", "sequence length N", "MiB", {}, true};
  memory_plot.series.push_back({fmt::format("reference scratch (slope {})", slope_text(ref_mem.slope)), plot::kReferenceColour, ns, ref_mib});
  memory_plot.series.push_back({fmt::format("flash scratch (slope {})", slope_text(flash_mem.slope)), plot::kFlashColour, ns, flash_mib});
  memory_plot.series.push_back({fmt::format("output, both (slope {})", slope_text(fit_power_law(ns, output_mib).slope)), grey, ns, output_mib});
  memory_plot.series.push_back(guide(ref_mib, 2, {0.7, 0.7, 0.7}, "\u221d N\u00b2 (slope 2)"));
  figure.plots = {time_plot, memory_plot};
  const plot::LineLayout layout = plot::draw_line_plots(figure, o.output);
  fmt::print("wrote {} ({} x {})\n", o.output, layout.width, layout.height);
}

}  // namespace

void add_scaling_command(CLI::App& app) {
  auto options = std::make_shared<ScalingOptions>();
  CLI::App* scaling = app.add_subcommand(
      "scaling", "Measure time and memory of the reference and flash kernels as N doubles, fit slopes, plot them");
  scaling->add_option("--min-seq", options->min_seq, "First sequence length")->capture_default_str();
  scaling->add_option("--max-seq", options->max_seq, "Last sequence length (16384 takes minutes)")->capture_default_str();
  scaling->add_option("--heads", options->heads, "Attention heads")->capture_default_str();
  scaling->add_option("--head-dim", options->head_dim, "Features per head")->capture_default_str();
  scaling->add_option("--repeats", options->repeats, "Timed calls per point (the median is reported)")->capture_default_str();
  scaling->add_option("--max-mem", options->max_mem, "Memory budget, e.g. 8G or 512M (default: half the RAM)");
  scaling->add_flag("--linear", options->linear,
                    "Also time linear attention (qkv::linear_attention, O(N)): its slope and where it overtakes flash");
  scaling->add_option("-o,--output", options->output, "The plot to write: .png, .svg or .pdf")->capture_default_str();
  scaling->callback([options] { run_scaling(*options); });
}

}  // namespace qkv::cli
