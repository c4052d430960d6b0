// `qkv scaling`: the O(n^2) wall, measured, and the course's two answers to it. For N = 256, 512,
// ... (doubling) it times the chosen kernels on random (1, heads, N, head_dim) inputs, measures the
// scratch memory each allocates beyond its inputs and output (qkv counts its own tensors and
// workspaces: qkv::memory_stats), fits log-log slopes, finds the N where sparse and linear
// attention overtake flash, prints tables and writes a plot.
//
//   qkv scaling                                   # reference and flash, N up to 4096
//   qkv scaling --kernels reference,flash,sparse,linear --causal --max-seq 16384 -o scaling.png
//
// Kernels: reference and flash (softmax attention, unmasked or --causal); sparse, the flash
// kernel under a fixed symbolic mask, by default causal & (window(W - 1) | strided(W)) (the
// Sparse Transformer's strided head; --sparse-window W, or any --sparse-mask expression); linear,
// qkv::linear_attention (elu+1; causal with --causal).
// Expected: time slope ~2 for reference and flash (N^2 work either way), ~1 for linear (O(N d^2))
// and, for sparse, the slope of its visible (query, key) pairs, which the table counts: ~1 while
// the window's N W pairs dominate, rising as the strided N^2 / 2W take over. Scratch slope 2 for
// the reference (it materialises an N x N score matrix), ~0 for the others, beside the output
// all must write, H x N x d: slope 1.
// Before each new N it predicts that size's memory from the last ones and stops, rather than
// swap, when the prediction passes --max-mem.
#include <omp.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "bounds.hpp"
#include "numbers.hpp"
#include "commands.hpp"
#include "plot.hpp"
#include "qkv/qkv.hpp"

namespace qkv::cli {
namespace {

enum class Kernel { Reference, Flash, Sparse, Linear };
constexpr std::array<Kernel, 4> kAllKernels{Kernel::Reference, Kernel::Flash, Kernel::Sparse, Kernel::Linear};

std::string_view kernel_name(Kernel kernel) {
  switch (kernel) {
    case Kernel::Reference: return "reference";
    case Kernel::Flash: return "flash";
    case Kernel::Sparse: return "sparse";
    case Kernel::Linear: return "linear";
  }
  return "?";
}

plot::Rgb kernel_colour(Kernel kernel) {
  switch (kernel) {
    case Kernel::Reference: return plot::kReferenceColour;
    case Kernel::Flash: return plot::kFlashColour;
    case Kernel::Sparse: return {0.55, 0.25, 0.65};
    case Kernel::Linear: return {0.20, 0.60, 0.30};
  }
  return {0, 0, 0};
}

struct ScalingOptions {
  int64_t min_seq = 256;
  int64_t max_seq = 4096;
  int64_t heads = 8;
  int64_t head_dim = 64;
  int repeats = 5;
  std::string max_mem;  // empty: half the machine's RAM
  std::string output = "scaling.png";
  std::string kernels = "reference,flash";
  bool linear = false;          // the older spelling of adding linear to --kernels
  bool causal = false;          // reference, flash and linear causal (sparse has its own mask)
  int64_t sparse_window = 128;  // W of the default sparse mask
  std::string sparse_mask;      // empty: causal & (window(W - 1) | strided(W))
  std::string clock = "wall";   // or "cpu": the process's CPU time, every thread summed
};

// The options resolved: the kernels in a fixed order (reference, flash, sparse, linear) and the
// sparse kernel's mask.
struct Setup {
  std::vector<Kernel> kernels;
  Mask sparse_mask;
  bool has(Kernel kernel) const { return std::find(kernels.begin(), kernels.end(), kernel) != kernels.end(); }
  // The position of `kernel` in `kernels` (which must hold it).
  size_t index(Kernel kernel) const {
    return static_cast<size_t>(std::find(kernels.begin(), kernels.end(), kernel) - kernels.begin());
  }
};

// "reference,flash,sparse,linear" (any order, any subset, repeats ignored) -> the kernels in the
// fixed order; `linear` (--linear) adds linear.
std::vector<Kernel> parse_kernels(const std::string& list, bool linear) {
  std::vector<bool> chosen(kAllKernels.size(), false);
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, comma - start);
    const auto it = std::find_if(kAllKernels.begin(), kAllKernels.end(),
                                 [&](Kernel k) { return kernel_name(k) == name; });
    if (it == kAllKernels.end())
      throw Error(fmt::format("unknown kernel '{}' in --kernels '{}': choose from reference, flash, sparse, linear, "
                              "separated by commas", name, list));
    chosen[static_cast<size_t>(it - kAllKernels.begin())] = true;
    start = comma + 1;
  }
  if (linear) chosen[static_cast<size_t>(Kernel::Linear)] = true;
  std::vector<Kernel> kernels;
  for (size_t i = 0; i < kAllKernels.size(); ++i)
    if (chosen[i]) kernels.push_back(kAllKernels[i]);
  return kernels;
}

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
  int64_t output_bytes = 0;         // the output and log-sum-exp the softmax kernels write
  double sparse_pairs = 0;          // the (query, key) pairs the sparse mask lets through, per head
  std::vector<Measurement> kernels;  // one per Setup::kernels, in that order
  const Measurement& of(const Setup& s, Kernel kernel) const { return kernels[s.index(kernel)]; }
};

// The (query, key) pairs per head a softmax kernel computes: N^2, N (N + 1) / 2 causal, or the
// sparse mask's count. Linear attention has none (its FLOPs are 4 N d^2 per head, not per pair).
double pairs(const ScalingOptions& o, const Row& row, Kernel kernel) {
  const double n = static_cast<double>(row.n);
  if (kernel == Kernel::Sparse) return row.sparse_pairs;
  return o.causal ? n * (n + 1) / 2 : n * n;
}

// GFLOP/s of a softmax kernel: 4 d FLOPs (Q K^T and P V, a multiply-add counted as 2) per pair.
double gflops_per_second(const ScalingOptions& o, const Setup& s, const Row& row, Kernel kernel) {
  const double flops = 4.0 * static_cast<double>(o.heads) * static_cast<double>(o.head_dim) * pairs(o, row, kernel);
  return flops / 1e9 / (row.of(s, kernel).median_ms / 1e3);
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

// Milliseconds on the chosen clock: "wall" (steady), or "cpu", the CPU time of every thread of
// the process summed. On one thread (OMP_NUM_THREADS=1) CPU time is the call's own work,
// unaffected by other jobs taking the core; on several it also counts threads spinning at joins.
double now_ms(const std::string& clock) {
  if (clock == "cpu") {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// `call` writes into an output it keeps (allocated by its first call).
Measurement measure_calls(const std::function<void()>& call, int repeats, const std::string& clock,
                          const std::string& label) {
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
    const double start = now_ms(clock);
    call();
    times_ms.push_back(now_ms(clock) - start);
    // A slow size gets 3 runs, enough for a median, instead of minutes more.
    if (r + 1 >= 3 && times_ms.front() > 2000) break;
  }
  std::sort(times_ms.begin(), times_ms.end());
  m.median_ms = times_ms[times_ms.size() / 2];
  release_workspaces();
  return m;
}

struct Inputs {
  Tensor q, k, v;
  AttentionResult result;  // the softmax kernels' output, allocated by the first call
  Tensor linear_output;
};

// One kernel's call into its kept output, measured.
Measurement measure_kernel(Kernel kernel, const ScalingOptions& o, const Setup& s, Inputs& in, int64_t n) {
  const std::string label = fmt::format("N = {}: {}", n, kernel_name(kernel));
  if (kernel == Kernel::Linear) {
    LinearAttentionOptions options;
    options.causal = o.causal;
    return measure_calls([&] { linear_attention_into(in.q, in.k, in.v, in.linear_output, options); }, o.repeats,
                         o.clock, label);
  }
  AttentionOptions options;
  options.backend = kernel == Kernel::Reference ? Backend::Reference : Backend::Flash;
  if (kernel == Kernel::Sparse) options.mask = s.sparse_mask;
  else if (o.causal) options.mask = Mask::causal();
  return measure_calls([&] { scaled_dot_product_attention_into(in.q, in.k, in.v, in.result, options); }, o.repeats,
                       o.clock, label);
}

// The (query, key) pairs `mask` lets through for N queries over N keys, one head, counted by the
// library's own kernel: with q = k = 0 every score is 0, so each row's softmax sum is its number
// of visible keys (exact in float below 2^24).
double visible_pairs(const Mask& mask, int64_t n) {
  const Tensor zeros = Tensor::zeros({1, 1, n, 1});
  AttentionOptions options;
  options.mask = mask;
  options.backend = Backend::Flash;
  const AttentionResult r = scaled_dot_product_attention(zeros, zeros, zeros, options);
  double total = 0;
  const float* sums = r.row_sum.contiguous().data();
  for (int64_t i = 0; i < n; ++i) total += static_cast<double>(sums[i]);
  return total;
}

Setup check_options(const ScalingOptions& o) {
  if (o.min_seq <= 0) throw Error(fmt::format("--min-seq must be positive, got {}", o.min_seq));
  if (o.max_seq < o.min_seq) throw Error(fmt::format("--max-seq ({}) must be at least --min-seq ({})", o.max_seq, o.min_seq));
  if (o.heads <= 0) throw Error(fmt::format("--heads must be positive, got {}", o.heads));
  if (o.head_dim <= 0) throw Error(fmt::format("--head-dim must be positive, got {}", o.head_dim));
  if (o.repeats <= 0) throw Error(fmt::format("--repeats must be positive, got {}", o.repeats));
  if (o.sparse_window < 1) throw Error(fmt::format("--sparse-window must be at least 1, got {}", o.sparse_window));
  check_range("--max-seq", o.max_seq, 1, int64_t{1} << 20);
  check_range("--heads", o.heads, 1, 1024);
  check_range("--head-dim", o.head_dim, 1, 4096);
  check_range("--repeats", o.repeats, 1, 1000);
  check_range("--sparse-window", o.sparse_window, 1, int64_t{1} << 20);
  plot::format_from_path(o.output);
  Setup s;
  s.kernels = parse_kernels(o.kernels, o.linear);
  s.sparse_mask = o.sparse_mask.empty()
                      ? Mask::causal() & (Mask::window(o.sparse_window - 1) | Mask::strided(o.sparse_window))
                      : Mask::parse(o.sparse_mask);
  return s;
}

// The predicted qkv memory of one size: inputs and output, plus the largest of the kernels'
// scratch grown from the last measured size by its exponent fitted over the sizes so far
// (2, the worst case, before there are two sizes; clamped to [0, 2]).
int64_t predict_bytes(const ScalingOptions& o, const Setup& s, const std::vector<Row>& rows, int64_t n) {
  const double io = 4.0 * 4.0 * static_cast<double>(o.heads) * static_cast<double>(n) * static_cast<double>(o.head_dim);
  if (rows.empty())
    return static_cast<int64_t>(io + (s.has(Kernel::Reference) ? 4.0 * static_cast<double>(n) * static_cast<double>(n) : 0.0));
  const double growth = static_cast<double>(n) / static_cast<double>(rows.back().n);
  double extra = 0;
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    std::vector<double> ns, bytes;
    for (const Row& r : rows) {
      ns.push_back(static_cast<double>(r.n));
      bytes.push_back(static_cast<double>(r.kernels[k].extra_bytes));
    }
    const double slope = fit_power_law(ns, bytes).slope;
    const double exponent = std::isfinite(slope) ? std::clamp(slope, 0.0, 2.0) : 2.0;
    extra = std::max(extra, bytes.back() * std::pow(growth, exponent));
  }
  return static_cast<int64_t>(io + extra);
}

// "1.98"; a slope that rounds to zero prints as 0.00, not -0.00.
std::string slope_text(double slope) {
  if (!std::isfinite(slope)) return "n/a";
  return fmt::format("{:.2f}", std::abs(slope) < 0.005 ? 0.0 : slope);
}

// The measured curves, as the tables, fits and plot read them.
struct Curves {
  std::vector<double> ns, output_mib, sparse_pairs;
  std::vector<std::vector<double>> ms, mib;  // [kernel][size]
  std::vector<PowerLawFit> time_fit, memory_fit;
};

Curves curves_of(const Setup& s, const std::vector<Row>& rows) {
  Curves c;
  c.ms.resize(s.kernels.size());
  c.mib.resize(s.kernels.size());
  for (const Row& r : rows) {
    c.ns.push_back(static_cast<double>(r.n));
    c.output_mib.push_back(static_cast<double>(r.output_bytes) / (1024.0 * 1024.0));
    c.sparse_pairs.push_back(r.sparse_pairs);
    for (size_t k = 0; k < s.kernels.size(); ++k) {
      c.ms[k].push_back(r.kernels[k].median_ms);
      c.mib[k].push_back(static_cast<double>(r.kernels[k].extra_bytes) / (1024.0 * 1024.0));
    }
  }
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    c.time_fit.push_back(fit_power_law(c.ns, c.ms[k]));
    c.memory_fit.push_back(fit_power_law(c.ns, c.mib[k]));
  }
  return c;
}

// Time per kernel, each softmax kernel's GFLOP/s on the pairs it computes, each kernel's speed-up
// over flash; then scratch per kernel beside the output.
void print_tables(const ScalingOptions& o, const Setup& s, const std::vector<Row>& rows) {
  const bool flash = s.has(Kernel::Flash);
  std::string head = fmt::format("{:>6} ", "N");
  for (Kernel k : s.kernels) head += fmt::format(" {:>12}", fmt::format("{} ms", kernel_name(k)));
  for (Kernel k : s.kernels)
    if (k != Kernel::Linear) head += fmt::format(" {:>15}", fmt::format("{} GF/s", kernel_name(k)));
  for (Kernel k : s.kernels)
    if (flash && k != Kernel::Flash) head += fmt::format(" {:>16}", fmt::format("flash/{}", kernel_name(k)));
  if (s.has(Kernel::Sparse)) head += fmt::format(" {:>17}", "sparse keys/query");
  fmt::print("\nGF/s: 4 d FLOPs per (query, key) pair a softmax kernel computes (sparse: its visible pairs)");
  if (flash) fmt::print("; flash/X: flash's time over X's (above 1: X is faster)");
  fmt::print("\n{}\n", head);
  for (const Row& r : rows) {
    std::string line = fmt::format("{:>6} ", r.n);
    for (const Measurement& m : r.kernels) line += fmt::format(" {:>12.2f}", m.median_ms);
    for (Kernel k : s.kernels)
      if (k != Kernel::Linear) line += fmt::format(" {:>15.1f}", gflops_per_second(o, s, r, k));
    for (Kernel k : s.kernels)
      if (flash && k != Kernel::Flash)
        line += fmt::format(" {:>15.2f}x", r.of(s, Kernel::Flash).median_ms / r.of(s, k).median_ms);
    if (s.has(Kernel::Sparse)) line += fmt::format(" {:>17.1f}", r.sparse_pairs / static_cast<double>(r.n));
    fmt::print("{}\n", line);
  }
  head = fmt::format("\n{:>6} ", "N");
  for (Kernel k : s.kernels) head += fmt::format(" {:>16}", fmt::format("{} scratch", kernel_name(k)));
  fmt::print("{} {:>10}\n", head, "output");
  for (const Row& r : rows) {
    std::string line = fmt::format("{:>6} ", r.n);
    for (const Measurement& m : r.kernels) line += fmt::format(" {:>16}", human_bytes(static_cast<double>(m.extra_bytes)));
    fmt::print("{} {:>10}\n", line, human_bytes(static_cast<double>(r.output_bytes)));
  }
}

// The fitted slopes, what to expect of each kernel, and where sparse and linear overtake flash.
void print_fits(const ScalingOptions& o, const Setup& s, const Curves& c) {
  std::string time, memory;
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    const std::string_view sep = k == 0 ? "" : ", ";
    time += fmt::format("{}{} {}", sep, kernel_name(s.kernels[k]), slope_text(c.time_fit[k].slope));
    memory += fmt::format("{}{} {}", sep, kernel_name(s.kernels[k]), slope_text(c.memory_fit[k].slope));
  }
  fmt::print("\nlog-log slopes (cost ~ N^slope): time {}; scratch {}\n", time, memory);
  const double pairs_slope = fit_power_law(c.ns, c.sparse_pairs).slope;
  if (s.has(Kernel::Sparse)) {
    std::string counts;
    for (size_t i = 0; i < c.ns.size(); ++i)
      counts += fmt::format("{}{:.0f} at N = {:.0f}", i == 0 ? "" : ", ", c.sparse_pairs[i], c.ns[i]);
    fmt::print("sparse mask's visible (query, key) pairs per head: {}; slope {}\n", counts, slope_text(pairs_slope));
  }
  fmt::print("expected:\n");
  if (s.has(Kernel::Reference) || s.has(Kernel::Flash))
    fmt::print("  time ~2 for reference and flash (N^2 work either way); scratch 2 for reference (an N x N score\n"
               "  matrix), ~0 for flash (fixed-size tiles)\n");
  if (s.has(Kernel::Sparse))
    fmt::print("  sparse: time ~ its visible pairs' slope ({}): ~1 while the window's N W pairs dominate, rising\n"
               "  towards 2 as the strided keys' N^2 / 2W take over; scratch ~0\n", slope_text(pairs_slope));
  if (s.has(Kernel::Linear)) fmt::print("  linear: time ~1 (O(N d^2) work), scratch ~0\n");
  fmt::print("  the output every kernel writes grows as N (slope 1)\n");
  // No key after its query: the band's upper end at or below the diagonal.
  const bool sparse_causal = s.sparse_mask.band_hi() <= 0;
  if (s.has(Kernel::Sparse) && s.kernels.size() > 1 && sparse_causal != o.causal)
    fmt::print("note: sparse's mask is {}causal but the other kernels run {}: {} --causal to compare like with like\n",
               sparse_causal ? "" : "not ", o.causal ? "causal" : "unmasked", o.causal ? "drop" : "add");
  if (!s.has(Kernel::Flash)) return;
  const std::vector<double>& flash_ms = c.ms[s.index(Kernel::Flash)];
  for (Kernel k : {Kernel::Sparse, Kernel::Linear}) {
    if (!s.has(k)) continue;
    const std::vector<double>& ms = c.ms[s.index(k)];
    const Crossover x = find_crossover(c.ns, flash_ms, ms);
    if (std::isnan(x.first_x))
      fmt::print("{} does not overtake flash in this range (flash / {} at N = {}: {:.2f}x)\n", kernel_name(k),
                 kernel_name(k), c.ns.back(), flash_ms.back() / ms.back());
    else if (std::isnan(x.interpolated_x))
      fmt::print("crossover: {} is faster than flash at every measured N (from N = {})\n", kernel_name(k), x.first_x);
    else
      fmt::print("crossover: {} overtakes flash at N = {:.0f} (interpolated; faster from the measured N = {})\n",
                 kernel_name(k), x.interpolated_x, x.first_x);
  }
}

// The plot: measured curves, and dashed guides (N^2 through the slowest kernel's largest size,
// where fixed per-call costs matter least; N through linear's or sparse's).
void draw(const ScalingOptions& o, const Setup& s, const Curves& c) {
  const auto guide = [&](const std::vector<double>& ys, double exponent, plot::Rgb colour, const std::string& label) {
    plot::Series g{label, colour, {}, {}, true};
    for (double n : c.ns) {
      g.x.push_back(n);
      g.y.push_back(ys.back() * std::pow(n / c.ns.back(), exponent));
    }
    return g;
  };
  const plot::Rgb grey{0.55, 0.55, 0.55};
  std::string names;
  for (Kernel k : s.kernels) names += fmt::format("{}{}", names.empty() ? "" : ", ", kernel_name(k));
  plot::LineFigure figure;
  figure.title = fmt::format("The O(N\u00b2) wall, measured: {}", names);
  figure.notes.push_back(fmt::format("batch 1, {} heads, head dim {}, {}; time: median of up to {} calls ({}, {} thread(s))",
                                     o.heads, o.head_dim, o.causal ? "causal" : "no mask", o.repeats,
                                     o.clock == "cpu" ? "CPU time" : "wall clock", omp_get_max_threads()));
  if (s.has(Kernel::Sparse)) figure.notes.push_back(fmt::format("sparse: flash under {}", s.sparse_mask.str()));
  figure.notes.push_back("scratch: the peak memory a kernel allocates beyond its inputs and output (qkv::memory_stats)");
  plot::LinePlot time_plot{"Time per call", "sequence length N", "milliseconds", {}, true};
  plot::LinePlot memory_plot{"Scratch memory per call", "sequence length N", "MiB", {}, true};
  size_t slowest = 0;
  for (size_t k = 0; k < s.kernels.size(); ++k) {
    const std::string name(kernel_name(s.kernels[k]));
    time_plot.series.push_back({fmt::format("{} (slope {})", name, slope_text(c.time_fit[k].slope)),
                                kernel_colour(s.kernels[k]), c.ns, c.ms[k]});
    memory_plot.series.push_back({fmt::format("{} scratch (slope {})", name, slope_text(c.memory_fit[k].slope)),
                                  kernel_colour(s.kernels[k]), c.ns, c.mib[k]});
    if (c.ms[k].back() > c.ms[slowest].back()) slowest = k;
  }
  time_plot.series.push_back(guide(c.ms[slowest], 2, grey, "\u221d N\u00b2 (slope 2)"));
  for (Kernel k : {Kernel::Linear, Kernel::Sparse})
    if (s.has(k)) {
      time_plot.series.push_back(guide(c.ms[s.index(k)], 1, {0.75, 0.75, 0.75}, "\u221d N (slope 1)"));
      break;
    }
  memory_plot.series.push_back(
      {fmt::format("output (slope {})", slope_text(fit_power_law(c.ns, c.output_mib).slope)), grey, c.ns, c.output_mib});
  if (s.has(Kernel::Reference))
    memory_plot.series.push_back(guide(c.mib[s.index(Kernel::Reference)], 2, {0.7, 0.7, 0.7}, "\u221d N\u00b2 (slope 2)"));
  figure.plots = {time_plot, memory_plot};
  const plot::LineLayout layout = plot::draw_line_plots(figure, o.output);
  fmt::print("wrote {} ({} x {})\n", o.output, layout.width, layout.height);
}

void print_header(const ScalingOptions& o, const Setup& s, int64_t budget) {
  std::string names;
  for (Kernel k : s.kernels) names += fmt::format("{}{}", names.empty() ? "" : ", ", kernel_name(k));
  fmt::print("qkv scaling: batch 1, {} heads, head dim {}, {}; kernels {}; median of up to {} calls per point\n",
             o.heads, o.head_dim, o.causal ? "causal" : "no mask", names, o.repeats);
  if (s.has(Kernel::Sparse)) {
    if (o.sparse_mask.empty())
      fmt::print("sparse: the flash kernel under the mask {} (window + stride W = {})\n", s.sparse_mask.str(),
                 o.sparse_window);
    else
      fmt::print("sparse: the flash kernel under the mask {} (--sparse-mask)\n", s.sparse_mask.str());
  }
  if (s.has(Kernel::Linear))
    fmt::print("linear: qkv::linear_attention, feature map elu+1, {}\n", o.causal ? "causal" : "no mask");
  fmt::print("time: {} on {} OpenMP thread(s){}\n", o.clock == "cpu" ? "the process's CPU time" : "wall clock",
             omp_get_max_threads(),
             o.clock == "cpu" && omp_get_max_threads() > 1 ? " (summed over threads, spinning at joins included: "
                                                              "OMP_NUM_THREADS=1 measures one thread's work)" : "");
  fmt::print("memory budget {} ({}); scratch = what a kernel allocates beyond its inputs and output\n",
             human_bytes(static_cast<double>(budget)), o.max_mem.empty() ? "half of this machine's RAM" : "--max-mem");
}

void run_scaling(const ScalingOptions& o) {
  const Setup s = check_options(o);
  if (s.kernels.empty()) throw Error("--kernels chose no kernel");
  const int64_t ram = machine_memory_bytes();
  const int64_t budget = o.max_mem.empty() ? (ram > 0 ? ram / 2 : int64_t{4} << 30) : parse_bytes(o.max_mem);
  print_header(o, s, budget);

  std::vector<Row> rows;
  std::string stopped;
  for (int64_t n = o.min_seq; n <= o.max_seq; n *= 2) {
    const int64_t predicted = predict_bytes(o, s, rows, n);
    if (predicted > budget) {
      stopped = fmt::format("stopped before N = {}: it would need about {}, over the {} budget (--max-mem)", n,
                            human_bytes(static_cast<double>(predicted)), human_bytes(static_cast<double>(budget)));
      break;
    }
    Inputs in{Tensor::randn({1, o.heads, n, o.head_dim}, 1), Tensor::randn({1, o.heads, n, o.head_dim}, 2),
              Tensor::randn({1, o.heads, n, o.head_dim}, 3), {}, {}};
    Row row;
    row.n = n;
    for (Kernel k : s.kernels) row.kernels.push_back(measure_kernel(k, o, s, in, n));
    row.output_bytes = static_cast<int64_t>(sizeof(float)) * o.heads * n * (o.head_dim + 1);
    if (s.has(Kernel::Sparse)) row.sparse_pairs = visible_pairs(s.sparse_mask, n);
    rows.push_back(row);
    if (n > o.max_seq / 2) break;  // the next doubling would pass --max-seq (and could overflow)
  }
  end_progress();
  if (rows.empty()) throw Error(stopped.empty() ? "nothing was measured" : stopped);

  print_tables(o, s, rows);
  const Curves c = curves_of(s, rows);
  print_fits(o, s, c);
  if (rows.size() < 3) fmt::print("(fewer than 3 sizes: the slopes are rough; raise --max-seq)\n");
  if (!stopped.empty()) fmt::print("{}\n", stopped);
  draw(o, s, c);
}

}  // namespace

void add_scaling_command(CLI::App& app) {
  auto options = std::make_shared<ScalingOptions>();
  CLI::App* scaling = app.add_subcommand(
      "scaling", "Measure time and memory of attention kernels (reference, flash, sparse, linear) as N doubles, fit slopes, plot them");
  scaling->add_option("--min-seq", options->min_seq, "First sequence length")->capture_default_str();
  scaling->add_option("--max-seq", options->max_seq, "Last sequence length (16384 takes minutes)")->capture_default_str();
  scaling->add_option("--heads", options->heads, "Attention heads")->capture_default_str();
  scaling->add_option("--head-dim", options->head_dim, "Features per head")->capture_default_str();
  scaling->add_option("--repeats", options->repeats, "Timed calls per point (the median is reported)")->capture_default_str();
  scaling->add_option("--max-mem", options->max_mem, "Memory budget, e.g. 8G or 512M (default: half the RAM)");
  scaling->add_option("--kernels", options->kernels,
                      "Kernels to time, comma-separated: reference, flash, sparse (flash under --sparse-mask), "
                      "linear (qkv::linear_attention)")
      ->capture_default_str();
  scaling->add_flag("--linear", options->linear, "Add linear to --kernels (the older spelling)");
  scaling->add_flag("--causal", options->causal, "Causal reference, flash and linear attention (sparse has its own mask)");
  auto* window = scaling->add_option("--sparse-window", options->sparse_window,
                                     "W of sparse's default mask, causal & (window(W - 1) | strided(W))")
                     ->capture_default_str();
  scaling->add_option("--sparse-mask", options->sparse_mask,
                      "sparse's mask as an expression, e.g. \"causal & (window(127) | strided(128)) | global(16)\"")
      ->excludes(window);
  scaling->add_option("--clock", options->clock,
                      "wall, or cpu: the process's CPU time (with OMP_NUM_THREADS=1, steady on a loaded machine)")
      ->check(CLI::IsMember({"wall", "cpu"}))
      ->capture_default_str();
  scaling->add_option("-o,--output", options->output, "The plot to write: .png, .svg or .pdf")->capture_default_str();
  scaling->callback([options] { run_scaling(*options); });
}

}  // namespace qkv::cli
