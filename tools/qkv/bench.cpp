// `qkv bench`: times the standard workloads (defined in bench/workloads.hpp) on this machine.
//
// Per workload and backend (Auto, the fast path; Reference, the textbook kernel):
//   first call    qkv::release_workspaces(), then a call returning a fresh result: what a program
//                 pays once (page faults on fresh workspaces and outputs included)
//   steady state  one warm-up, then the median of --runs calls, each writing into the same result
//                 through scaled_dot_product_attention_into (nothing allocated, no fresh pages)
// W1 and W2 are also timed backward (rows "W1-bwd", "W2-bwd": scaled_dot_product_attention_backward,
// Auto = Flash and Reference, each call allocating its gradients, so first call and steady state
// time the same call; FLOPs = 2.5 x forward). W1-softcap, W1-alibi and W1-sinks are W1 with one
// score modifier each (forward; the target: within 15% of W1's time).
// and the rates: GFLOP/s from the forward (or backward) FLOPs formula, GB/s of K and V read for the decode
// workload W4, calls/s for the module workload W5. Every rate is also given as a ratio to rates
// measured in the same run, so a loaded or slower machine shifts both sides alike:
//   sgemm   cblas_sgemm 2048^3 through OpenBLAS (the library qkv links), median of 5
//   memcpy  256 MiB into a pre-touched buffer, bytes read + written per second, median of 5
// each measured before and after the workloads; ratios divide by the higher of the two.
// The program measures; it asserts nothing. The targets are printed as met / not met.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <cblas.h>
#include <omp.h>
#include <fmt/core.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "qkv/qkv.hpp"
#include "workloads.hpp"

namespace qkv::cli {
namespace {

using bench::Workload;

struct BenchOptions {
  bool json = false;
  int threads = 0;                     // 0: leave OpenMP and OpenBLAS as they are
  std::vector<std::string> workloads;  // empty: all
  int runs = 10;                       // steady-state runs of the fast path
  int reference_runs = 0;              // 0: 5, or 3 when the reference's first call took > 1 s
  bool no_reference = false;
};

// Sizes of the same-run baselines. 2048^3 is large enough for OpenBLAS to reach its peak rate;
// 256 MiB is far larger than any last-level cache, so memcpy runs at memory speed.
constexpr int kSgemmSize = 2048;
constexpr size_t kMemcpyBytes = size_t{256} << 20;
constexpr int kBaselineRuns = 5;
// The reference is slow on the big causal shapes (W3: seconds per call): fewer runs there.
constexpr int kReferenceRuns = 5;
constexpr int kSlowReferenceRuns = 3;
constexpr double kSlowCallMs = 1000;

// ---------------------------------------------------------------------------------------------
// Timing

using Clock = std::chrono::steady_clock;

double elapsed_ms(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double time_ms(const std::function<void()>& call) {
  const Clock::time_point start = Clock::now();
  call();
  return elapsed_ms(start);
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// ---------------------------------------------------------------------------------------------
// Progress on stderr: one line rewritten in place with \r on a terminal; elsewhere (a log, ctest)
// one line per phase, so the log stays short.

class Progress {
 public:
  Progress() : terminal_(isatty(fileno(stderr)) != 0) {}

  void show(std::string_view workload, std::string_view backend, std::string_view stage, int run = 0,
            int runs = 0) {
    if (terminal_) {
      std::string line = fmt::format("qkv bench: {} {} {}", workload, backend, stage);
      if (runs > 0) line += fmt::format(" {}/{}", run, runs);
      fmt::print(stderr, "\r{:<{}}", line, width_);
      width_ = std::max(width_, line.size());
      std::fflush(stderr);
      return;
    }
    if (run > 1) return;  // the phase's first line says how many runs follow
    std::string line = fmt::format("qkv bench: {} {} {}", workload, backend, stage);
    if (runs > 0) line += fmt::format(" ({} run{})", runs, runs == 1 ? "" : "s");
    fmt::print(stderr, "{}\n", line);
  }

  void clear() {
    if (terminal_ && width_ > 0) fmt::print(stderr, "\r{:<{}}\r", "", width_);
    width_ = 0;
  }

 private:
  bool terminal_;
  size_t width_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Same-run baselines

struct Baselines {
  double sgemm_gflops = 0;
  double memcpy_gbs = 0;  // bytes read + written per second
};

// C = A B for square n x n matrices through OpenBLAS: GFLOP/s, the median of kBaselineRuns after
// a warm-up.
double measure_sgemm(int n, Progress& progress) {
  const Tensor a = Tensor::randn({n, n}, /*seed=*/11), b = Tensor::randn({n, n}, /*seed=*/12);
  const Tensor c = Tensor::zeros({n, n});
  const auto call = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                c.data(), n);
  };
  progress.show("baseline", "sgemm", "warm-up");
  call();
  std::vector<double> times;
  for (int run = 1; run <= kBaselineRuns; ++run) {
    progress.show("baseline", "sgemm", "run", run, kBaselineRuns);
    times.push_back(time_ms(call));
  }
  const double flops = 2.0 * n * static_cast<double>(n) * n;
  return flops / (median(times) * 1e-3) * 1e-9;
}

// memcpy of `bytes` between two buffers touched beforehand (no page faults in the timing):
// bytes read + written per second, in GB/s (1e9), the median of kBaselineRuns after a warm-up.
double measure_memcpy(size_t bytes, Progress& progress) {
  std::vector<char> source(bytes, 1), destination(bytes, 0);  // both written: pages mapped
  const auto call = [&] { std::memcpy(destination.data(), source.data(), bytes); };
  progress.show("baseline", "memcpy", "warm-up");
  call();
  std::vector<double> times;
  for (int run = 1; run <= kBaselineRuns; ++run) {
    progress.show("baseline", "memcpy", "run", run, kBaselineRuns);
    times.push_back(time_ms(call));
  }
  if (destination[bytes / 2] != 1) fmt::print(stderr, "qkv bench: memcpy baseline copied wrong bytes\n");
  return 2.0 * static_cast<double>(bytes) / (median(times) * 1e-3) * 1e-9;
}

// ---------------------------------------------------------------------------------------------
// Which kernel Auto runs. The public API does not say, so we tell it from the outputs: kernels
// sum in different orders, so Auto's output matches, bit for bit, the output of the kernel it
// ran. Backend::Decode throws until it is wired into the dispatch; until then Auto's documented
// rule (attention.hpp) is Flash whenever the weights are not wanted.

struct DecodeProbe {
  bool built = false;
  std::string message;  // why not, when not built
};

DecodeProbe probe_decode() {
  AttentionOptions options;
  options.backend = Backend::Decode;
  try {
    (void)scaled_dot_product_attention(Tensor::randn({1, 1, 1, 8}, 1), Tensor::randn({1, 1, 16, 8}, 2),
                                       Tensor::randn({1, 1, 16, 8}, 3), options);
    return {true, ""};
  } catch (const Error& e) {
    return {false, e.what()};
  }
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.data(), b.data(), static_cast<size_t>(a.numel()) * sizeof(float)) == 0;
}

// "Flash", "Decode", or a hedged answer when the outputs cannot tell.
std::string auto_kernel(const Workload& w, const bench::AttentionInputs& in, const DecodeProbe& decode) {
  if (!decode.built) return "Flash";
  const auto output_of = [&](Backend backend) -> std::optional<Tensor> {
    try {
      return scaled_dot_product_attention(in.q, in.k, in.v, bench::make_attention_options(w, backend)).output;
    } catch (const Error&) {
      return std::nullopt;  // this kernel does not take this shape, so Auto did not run it
    }
  };
  const Tensor automatic = *output_of(Backend::Auto);
  const std::optional<Tensor> flash = output_of(Backend::Flash);
  if (flash && same_bits(automatic, *flash)) return "Flash";
  const std::optional<Tensor> decoded = output_of(Backend::Decode);
  if (decoded && same_bits(automatic, *decoded)) return "Decode";
  return "Flash or Decode";
}

// ---------------------------------------------------------------------------------------------
// Measurements

struct Row {
  const Workload* workload;
  bool backward = false;  // a scaled_dot_product_attention_backward row ("W1-bwd")
  std::string backend;  // "Auto" or "Reference"
  std::string kernel;   // what Auto ran ("Flash", "Decode", "module"), or "Reference"
  int runs = 0;
  double first_ms = 0;
  double median_ms = 0;
  double min_ms = 0;
  double peak_extra_mib = 0;  // qkv's own memory at its peak during the first call, above before
  std::optional<double> vs_reference;  // reference median / this median (the speed-up)
};

double row_flops(const Row& row) {
  return row.backward ? bench::backward_flops(*row.workload) : bench::forward_flops(*row.workload);
}
double gflops(const Row& row) { return row_flops(row) / (row.median_ms * 1e-3) * 1e-9; }
// "W1", or "W1-bwd" for a backward row.
std::string row_id(const Row& row) { return std::string(row.workload->id) + (row.backward ? "-bwd" : ""); }
double kv_gbs(const Row& row) { return bench::kv_bytes(*row.workload) / (row.median_ms * 1e-3) * 1e-9; }

// The first call and the steady state of `call_fresh` / `call_into`.
struct Timings {
  double first_ms, median_ms, min_ms, peak_extra_mib;
  int runs;
};

Timings measure(const std::function<void()>& call_fresh, const std::function<void()>& call_into, int runs,
                const std::function<int(double first_ms)>& runs_after_first, std::string_view id,
                std::string_view backend, Progress& progress) {
  progress.show(id, backend, "first call");
  release_workspaces();
  const int64_t before = memory_stats().current_bytes;
  reset_peak_memory();
  const double first_ms = time_ms(call_fresh);
  const double peak_extra_mib = static_cast<double>(memory_stats().peak_bytes - before) / (1 << 20);
  if (runs_after_first) runs = runs_after_first(first_ms);

  progress.show(id, backend, "warm-up");
  call_into();
  std::vector<double> times;
  for (int run = 1; run <= runs; ++run) {
    progress.show(id, backend, "run", run, runs);
    times.push_back(time_ms(call_into));
  }
  return {first_ms, median(times), *std::min_element(times.begin(), times.end()), peak_extra_mib, runs};
}

Row measure_attention(const Workload& w, const bench::AttentionInputs& in, Backend backend, int runs,
                      const std::function<int(double)>& runs_after_first, std::string kernel, Progress& progress) {
  const AttentionOptions options = bench::make_attention_options(w, backend);
  AttentionResult reused;  // the steady state writes here every run
  const std::string name(to_string(backend));
  const Timings t = measure(
      [&] { (void)scaled_dot_product_attention(in.q, in.k, in.v, options); },
      [&] { scaled_dot_product_attention_into(in.q, in.k, in.v, reused, options); }, runs, runs_after_first, w.id,
      name, progress);
  return {&w, false, name, std::move(kernel), t.runs, t.first_ms, t.median_ms, t.min_ms, t.peak_extra_mib,
          std::nullopt};
}

// The backward allocates its gradients on every call (no _into form): both phases make the same
// call. The forward result it needs is computed once, outside the timing, with the same options.
Row measure_backward(const Workload& w, const bench::AttentionInputs& in, Backend backend, int runs,
                     const std::function<int(double)>& runs_after_first, Progress& progress) {
  const AttentionOptions options = bench::make_attention_options(w, backend);
  const std::string name(to_string(backend));
  const std::string id = std::string(w.id) + "-bwd";
  progress.show(id, name, "forward");
  const bench::BackwardInputs bwd = bench::make_backward_inputs(w, in, options);
  const auto call = [&] {
    (void)scaled_dot_product_attention_backward(bwd.grad_output, in.q, in.k, in.v, bwd.forward, options);
  };
  const Timings t = measure(call, call, runs, runs_after_first, id, name, progress);
  // Backward has no Decode: Auto runs Flash (attention.hpp).
  return {&w, true, name, backend == Backend::Reference ? "Reference" : "Flash", t.runs, t.first_ms, t.median_ms,
          t.min_ms, t.peak_extra_mib, std::nullopt};
}

// The module allocates its outputs on every forward: both phases call the same forward.
Row measure_module(const Workload& w, int runs, Progress& progress) {
  const bench::ModuleInputs in = bench::make_module_inputs(w);
  const auto forward = [&] { (void)in.layer.forward(in.x); };
  const Timings t = measure(forward, forward, runs, nullptr, w.id, "Auto", progress);
  return {&w, false, "Auto", "module", t.runs, t.first_ms, t.median_ms, t.min_ms, t.peak_extra_mib, std::nullopt};
}

// ---------------------------------------------------------------------------------------------
// Reporting

struct Environment {
  int omp_threads;
  int openblas_threads;
  std::string coretype;  // OPENBLAS_CORETYPE, empty when unset
  std::string openblas_core;
  std::string openblas_config;
  DecodeProbe decode;
  Baselines start, end;  // the baselines before and after the workloads
  // What the ratios divide by: the higher of the two, so a load that slowed one measurement makes
  // a ratio smaller, never larger.
  Baselines best() const {
    return {std::max(start.sgemm_gflops, end.sgemm_gflops), std::max(start.memcpy_gbs, end.memcpy_gbs)};
  }
};

// The targets, computed from the rows when they were measured.
struct Target {
  std::string name;
  std::string measure;  // what is compared
  double value;
  double limit;
  bool at_least;  // value >= limit is met; otherwise value <= limit
  bool met() const { return at_least ? value >= limit : value <= limit; }
};

const Row* find_row(const std::vector<Row>& rows, std::string_view id, std::string_view backend,
                    bool backward = false) {
  for (const Row& row : rows)
    if (row.workload->id == id && row.backend == backend && row.backward == backward) return &row;
  return nullptr;
}

std::vector<Target> targets(const std::vector<Row>& rows, const Environment& env) {
  std::vector<Target> out;
  for (std::string_view id : {"W1", "W2", "W3"}) {
    if (const Row* row = find_row(rows, id, "Auto"))
      out.push_back({fmt::format("{} fast path vs sgemm", id), "GFLOP/s / sgemm GFLOP/s",
                     gflops(*row) / env.best().sgemm_gflops, 0.55, true});
  }
  for (std::string_view id : {"W1", "W2"}) {
    if (const Row* row = find_row(rows, id, "Auto", /*backward=*/true))
      out.push_back({fmt::format("{} flash backward vs sgemm", id), "GFLOP/s / sgemm GFLOP/s",
                     gflops(*row) / env.best().sgemm_gflops, 0.35, true});
  }
  if (const Row* row = find_row(rows, "W4", "Auto"))
    out.push_back({"W4 decode vs memcpy", "K,V GB/s / memcpy GB/s", kv_gbs(*row) / env.best().memcpy_gbs, 0.8, true});
  if (const Row* w4 = find_row(rows, "W4", "Auto")) {
    for (std::string_view id : {"W4-bf16", "W4-f16"})  // 16-bit K/V: half the bytes, so about half the time
      if (const Row* row = find_row(rows, id, "Auto"))
        out.push_back({fmt::format("{} vs W4", id), fmt::format("{} ms / W4 ms", id), row->median_ms / w4->median_ms,
                       0.55, false});
  }
  if (const Row* plain = find_row(rows, "W1", "Auto")) {
    for (std::string_view id : {"W1-softcap", "W1-alibi", "W1-sinks"})
      if (const Row* row = find_row(rows, id, "Auto"))
        out.push_back({fmt::format("{} vs W1", id), fmt::format("{} ms / W1 ms", id), row->median_ms / plain->median_ms,
                       1.15, false});
  }
  const Row* causal = find_row(rows, "W2", "Auto");
  const Row* full = find_row(rows, "W2-full", "Auto");
  if (causal && full)
    out.push_back({"W2 causal vs unmasked", "W2 ms / W2-full ms", causal->median_ms / full->median_ms, 0.6, false});
  return out;
}

// A JSON string literal.
std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string number(std::optional<double> value) {
  return value && std::isfinite(*value) ? fmt::format("{:.6g}", *value) : "null";
}

// JSON Lines: one object per line, each with "kind": "environment", then one "workload" per row,
// then one "target" per target measured.
void print_json(const std::vector<Row>& rows, const Environment& env) {
  fmt::print(
      "{{\"kind\": \"environment\", \"qkv_version\": {}, \"omp_threads\": {}, \"openblas_threads\": {}, "
      "\"openblas_coretype\": {}, \"openblas_core\": {}, \"openblas_config\": {}, \"decode_built\": {}, "
      "\"sgemm_size\": {}, \"sgemm_gflops\": {}, \"memcpy_bytes\": {}, \"memcpy_gbs\": {}, "
      "\"sgemm_gflops_start\": {}, \"sgemm_gflops_end\": {}, \"memcpy_gbs_start\": {}, \"memcpy_gbs_end\": {}}}\n",
      json_string(version()), env.omp_threads, env.openblas_threads,
      env.coretype.empty() ? "null" : json_string(env.coretype), json_string(env.openblas_core), json_string(env.openblas_config),
      env.decode.built ? "true" : "false", kSgemmSize, number(env.best().sgemm_gflops), kMemcpyBytes,
      number(env.best().memcpy_gbs), number(env.start.sgemm_gflops), number(env.end.sgemm_gflops),
      number(env.start.memcpy_gbs), number(env.end.memcpy_gbs));
  for (const Row& row : rows) {
    const Workload& w = *row.workload;
    const bool decode = w.decode;
    fmt::print(
        "{{\"kind\": \"workload\", \"workload\": {}, \"pass\": {}, \"description\": {}, \"backend\": {}, "
        "\"kernel\": {}, "
        "\"shape\": {}, \"mask\": {}, \"batch\": {}, \"q_heads\": {}, \"kv_heads\": {}, \"q_len\": {}, "
        "\"kv_len\": {}, \"head_dim\": {}, \"flops\": {}, \"kv_bytes\": {}, \"runs\": {}, \"first_ms\": {}, "
        "\"median_ms\": {}, \"min_ms\": {}, \"calls_per_s\": {}, \"gflops\": {}, \"gbs\": {}, "
        "\"vs_reference\": {}, \"vs_sgemm\": {}, \"vs_memcpy\": {}, \"peak_extra_mib\": {}}}\n",
        json_string(row_id(row)), json_string(row.backward ? "backward" : "forward"), json_string(w.description), json_string(row.backend), json_string(row.kernel), json_string(bench::shape_string(w)),
        json_string(w.causal ? "causal" : "none"), w.batch, w.q_heads, w.kv_heads, w.q_len, w.kv_len, w.head_dim,
        number(row_flops(row)), number(bench::kv_bytes(w)), row.runs, number(row.first_ms),
        number(row.median_ms), number(row.min_ms), number(1e3 / row.median_ms), number(gflops(row)),
        decode ? number(kv_gbs(row)) : "null", number(row.vs_reference),
        number(gflops(row) / env.best().sgemm_gflops),
        decode ? number(kv_gbs(row) / env.best().memcpy_gbs) : "null", number(row.peak_extra_mib));
  }
  for (const Target& target : targets(rows, env)) {
    fmt::print("{{\"kind\": \"target\", \"target\": {}, \"measure\": {}, \"value\": {}, \"limit\": {}, "
               "\"comparison\": {}, \"met\": {}}}\n",
               json_string(target.name), json_string(target.measure), number(target.value), number(target.limit),
               json_string(target.at_least ? ">=" : "<="), target.met() ? "true" : "false");
  }
}

std::string fixed(double value, int decimals) {
  if (!std::isfinite(value)) return "-";
  return fmt::format("{:.{}f}", value, decimals);
}

// 3 significant-ish digits: 0.0123, 1.23, 12.3, 123, 1234.
std::string short_number(double value) {
  if (!std::isfinite(value)) return "-";
  const double magnitude = std::abs(value);
  const int decimals = magnitude >= 100 ? 0 : magnitude >= 10 ? 1 : magnitude >= 1 ? 2 : magnitude >= 0.1 ? 3 : 4;
  return fixed(value, decimals);
}

void print_table(const std::vector<Row>& rows, const Environment& env) {
  fmt::print("workload    backend    kernel     runs  first ms  median ms   calls/s  GFLOP/s  x sgemm    GB/s  "
             "x memcpy   x ref  peak MiB  shape\n");
  for (const Row& row : rows) {
    const Workload& w = *row.workload;
    const std::string gbs = w.decode ? short_number(kv_gbs(row)) : "";
    const std::string vs_memcpy = w.decode ? fixed(kv_gbs(row) / env.best().memcpy_gbs, 2) : "";
    const std::string vs_reference = row.vs_reference ? fixed(*row.vs_reference, 1) : "";
    fmt::print("{:<10}  {:<9}  {:<9}  {:>4}  {:>8}  {:>9}  {:>8}  {:>7}  {:>7}  {:>6}  {:>8}  {:>6}  {:>8}  {}{}\n",
               row_id(row), row.backend, row.kernel, row.runs, short_number(row.first_ms), short_number(row.median_ms),
               short_number(1e3 / row.median_ms), short_number(gflops(row)),
               fixed(gflops(row) / env.best().sgemm_gflops, 2), gbs, vs_memcpy, vs_reference,
               fixed(row.peak_extra_mib, 1), bench::shape_string(w), w.causal ? " causal" : "");
  }
}

void print_text(const std::vector<Row>& rows, const Environment& env) {
  fmt::print("qkv {} bench: {} OpenMP threads, {} OpenBLAS threads; OPENBLAS_CORETYPE={}; OpenBLAS core: {}\n",
             version(), env.omp_threads, env.openblas_threads, env.coretype.empty() ? "(unset)" : env.coretype,
             env.openblas_core);
  fmt::print("sgemm {}^3 (cblas_sgemm, OpenBLAS): {:.1f} GFLOP/s   memcpy {} MiB: {:.1f} GB/s (read + written)\n",
             kSgemmSize, env.best().sgemm_gflops, kMemcpyBytes >> 20, env.best().memcpy_gbs);
  fmt::print("  measured before and after the workloads: sgemm {:.1f} / {:.1f} GFLOP/s, memcpy {:.1f} / {:.1f} GB/s;\n"
             "  the ratios divide by the higher (a wide spread means a loaded machine)\n",
             env.start.sgemm_gflops, env.end.sgemm_gflops, env.start.memcpy_gbs, env.end.memcpy_gbs);
  if (env.decode.built) {
    fmt::print("Auto's kernel: told from its output, which matches the kernel it ran bit for bit\n");
  } else {
    fmt::print("Auto's kernel: Flash everywhere (Backend::Decode not built yet: \"{}\")\n", env.decode.message);
  }
  fmt::print("first = release_workspaces() + a fresh result; median = steady state, same result reused (_into)\n");
  fmt::print("x ref = Reference ms / this ms; x sgemm = GFLOP/s / sgemm; GB/s and x memcpy: K and V bytes read\n");
  fmt::print("-bwd = scaled_dot_product_attention_backward (gradients allocated each call), FLOPs = 2.5 x forward\n\n");
  print_table(rows, env);

  const std::vector<Target> measured = targets(rows, env);
  if (!measured.empty()) {
    fmt::print("\nTargets (issues 3, 4 and 9), from this run:\n");
    for (const Target& target : measured) {
      fmt::print("  {:<30} {:<26} {:>5}  (target {} {:.2f})  {}\n", target.name, target.measure,
                 fixed(target.value, 2), target.at_least ? ">=" : "<=", target.limit,
                 target.met() ? "met" : "NOT met");
    }
  }
}

// ---------------------------------------------------------------------------------------------

std::vector<const Workload*> selected_workloads(const std::vector<std::string>& ids) {
  std::vector<const Workload*> selected;
  for (const Workload& w : bench::kWorkloads) {
    bool wanted = ids.empty();
    for (const std::string& id : ids) {
      const Workload* named = bench::find_workload(id);
      // W2 brings W2-full along, W1 its modifier rows, W4 its 16-bit rows: the targets compare
      // them. "decode-sweep" names every sweep row.
      wanted = wanted || named == &w || (named && named->id == "W2" && w.id == "W2-full") ||
               (named && named->id == "W1" && w.modifier != bench::Modifier::None) ||
               (named && named->id == "W4" && w.id.substr(0, 3) == "W4-") || (id == "decode-sweep" && w.sweep);
    }
    if (ids.empty() && w.sweep) wanted = false;  // the sweep's 1 GB of K/V only when asked for
    if (wanted) selected.push_back(&w);
  }
  return selected;
}

void run_bench(const BenchOptions& options) {
  if (options.threads > 0) {
    omp_set_num_threads(options.threads);
    openblas_set_num_threads(options.threads);
  }
  Progress progress;
  Environment env;
  env.omp_threads = omp_get_max_threads();
  env.openblas_threads = openblas_get_num_threads();
  if (const char* coretype = std::getenv("OPENBLAS_CORETYPE")) env.coretype = coretype;
  env.openblas_core = openblas_get_corename();
  env.openblas_config = openblas_get_config();
  env.decode = probe_decode();
  env.start = {measure_sgemm(kSgemmSize, progress), measure_memcpy(kMemcpyBytes, progress)};

  std::vector<Row> rows;
  const auto reference_runs = [&](double first_ms) {
    if (options.reference_runs > 0) return options.reference_runs;
    return first_ms > kSlowCallMs ? kSlowReferenceRuns : kReferenceRuns;
  };
  // The fast row with its speed-up over Reference, then the Reference row (unless --no-reference).
  const auto add_pair = [&](Row fast, const std::function<Row()>& measure_reference) {
    if (options.no_reference) {
      rows.push_back(std::move(fast));
      return;
    }
    Row reference = measure_reference();
    reference.vs_reference = 1.0;
    fast.vs_reference = reference.median_ms / fast.median_ms;
    rows.push_back(std::move(fast));
    rows.push_back(std::move(reference));
  };
  for (const Workload* w : selected_workloads(options.workloads)) {
    if (w->is_module()) {
      rows.push_back(measure_module(*w, options.runs, progress));
      continue;
    }
    const bench::AttentionInputs inputs = bench::make_attention_inputs(*w);
    progress.show(w->id, "Auto", "which kernel");
    const std::string kernel = auto_kernel(*w, inputs, env.decode);
    if (w->sweep) {  // the sweep reports GB/s of the fast path only
      rows.push_back(measure_attention(*w, inputs, Backend::Auto, options.runs, nullptr, kernel, progress));
      continue;
    }
    add_pair(measure_attention(*w, inputs, Backend::Auto, options.runs, nullptr, kernel, progress), [&] {
      return measure_attention(*w, inputs, Backend::Reference, 0, reference_runs, "Reference", progress);
    });
    if (!w->backward) continue;
    add_pair(measure_backward(*w, inputs, Backend::Auto, options.runs, nullptr, progress),
             [&] { return measure_backward(*w, inputs, Backend::Reference, 0, reference_runs, progress); });
  }
  env.end = {measure_sgemm(kSgemmSize, progress), measure_memcpy(kMemcpyBytes, progress)};
  progress.clear();

  if (options.json) {
    print_json(rows, env);
  } else {
    print_text(rows, env);
  }
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto options = std::make_shared<BenchOptions>();
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Time the standard workloads W0-W5 (and W1, W2 backward): ms, GFLOP/s, ratios to Reference, sgemm and memcpy");
  bench->add_flag("--json", options->json, "Print JSON Lines (one object per row) instead of the table");
  bench->add_option("--threads", options->threads, "Threads for OpenMP and OpenBLAS (default: as set up)")
      ->check(CLI::PositiveNumber);
  std::vector<std::string> ids;
  for (const Workload& w : bench::kWorkloads) ids.emplace_back(w.id);
  ids.emplace_back("decode-sweep");
  bench->add_option("--workload", options->workloads,
                    "Workloads to run, repeatable or a comma list (default: all but the decode sweep; "
                    "decode-sweep: 1 query vs 1k-32k keys, f32 and bf16 K/V, in GB/s)")
      ->delimiter(',')
      ->check(CLI::IsMember(ids, CLI::ignore_case));
  bench->add_option("--runs", options->runs, "Steady-state runs of the fast path (the median is reported)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  bench->add_option("--reference-runs", options->reference_runs,
                    "Steady-state runs of Reference (default: 5, or 3 when its first call took over 1 s)")
      ->check(CLI::PositiveNumber);
  bench->add_flag("--no-reference", options->no_reference, "Skip the Reference backend");
  bench->callback([options] { run_bench(*options); });
}

}  // namespace qkv::cli
