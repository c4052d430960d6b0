// `qkv bench`: times the standard workloads (defined in bench/workloads.hpp) on this machine.
//
// Per workload and backend (Auto, the fast path; Reference, the textbook kernel):
//   first call    qkv::release_workspaces(), then a call returning a fresh result: what a program
//                 pays once (page faults on fresh workspaces and outputs included)
//   steady state  one warm-up, then the median of --runs calls, each writing into the same result
//                 through scaled_dot_product_attention_into (nothing allocated, no fresh pages)
// W1, W2 and W6 are also timed backward (rows "W1-bwd", "W2-bwd", "W6-bwd" (Auto only):
// scaled_dot_product_attention_backward, Auto = Flash and Reference: the first call allocates its
// gradients, the steady state writes into the same ones through _backward_into; FLOPs = 2.5 x
// forward). W1-softcap, W1-alibi and W1-sinks are W1 with one
// score modifier each (forward; the target: within 15% of W1's time); W1-relpos is W1 with a
// score function as text (issue 42: within 1.5 x W1's time; also timed backward, "W1-relpos-bwd"),
// W1-bias W1 with a (1, H, N, N) additive bias, forward and backward (W1-bias-bwd, which returns
// dbias too; the target: within 1.3 x W1-bwd's time), and W2-docs W2's shape with a mask function
// of 4 documents (<= 0.35 x W2-full's time). W7 is causal linear attention
// (linear_attention) and W7-flash softmax attention on its shape (no Reference row); W7 also times
// N = 4096 and 65536 for its scaling slope.
// It reports rates: GFLOP/s from the forward (or backward) FLOPs formula, GB/s of K and V read for the decode
// workload W4, calls/s for the module workload W5. Every rate is also given as a ratio to ceilings
// measured in the same run, so a loaded or slower machine shifts both sides alike:
//   FMA peak  independent FMA chains on the widest vector, on every thread used (fma_peak.cpp)
//   sgemm     the best of the libraries qkv can call (src/gemm/gemm.hpp: OpenBLAS's cblas_sgemm and,
//             when built in, oneDNN's dnnl_sgemm), 2048^3, median of 5
//   memcpy    256 MiB into a pre-touched buffer, bytes read + written per second, median of 5
//   read      256 MiB read by every thread at once, each its share, bytes read per second, the best
//             of 5 with and without a software prefetch (read_peak.cpp): decode's bound
// each measured before and after the workloads; ratios divide by the higher of the two.
// Also timed: qkv's GEMM paths on the shape classes the library meets (Linear, the reference
// kernel), each against the others, which is what choose_gemm_path's rule rests on; and the
// environment variables that handicap a library are named (OPENBLAS_CORETYPE, thread counts).
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
#include <thread>
#include <fmt/core.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "gemm/amx.hpp"
#include "bounds.hpp"
#include "commands.hpp"
#include "fma_peak.hpp"
#include "read_peak.hpp"
#include "core/huge_pages.hpp"
#include "gemm/gemm.hpp"
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
  bool no_gemm = false;                // skip the table of GEMM paths per shape class
  std::string precision = "highest";  // of the attention workloads' products (MatmulPrecision)
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

using detail::GemmPath;

// The GEMM paths of src/gemm/gemm.hpp that can compute a general product in this build, OpenBLAS last.
std::vector<GemmPath> sgemm_libraries() {
  std::vector<GemmPath> out;
  for (GemmPath path : {GemmPath::OneDnn, GemmPath::OpenBlas})
    if (detail::gemm_path_can_take(path, false, false)) out.push_back(path);
  return out;
}

// OpenBLAS's own threads spin for about 2^28 cycles (0.1 s) after its last call before they
// sleep: an OpenMP kernel timed in that window shares the cores with them (oneDNN on 512 x 64 x
// 512 right after OpenBLAS: 1.2-6.6 GFLOP/s, against 140 once they sleep). Every timing that
// follows an OpenBLAS one waits this long first.
void let_openblas_threads_sleep() { std::this_thread::sleep_for(std::chrono::milliseconds(250)); }

struct Baselines {
  double openblas_gflops = 0;
  double onednn_gflops = 0;  // 0: oneDNN not built in
  double memcpy_gbs = 0;     // bytes read + written per second
  ReadPeak read;             // bytes read per second by every thread (read_peak.hpp)
  double sgemm_gflops() const { return std::max(openblas_gflops, onednn_gflops); }
};

// C = A B for square n x n matrices on one GEMM path: GFLOP/s, the median of kBaselineRuns after
// a warm-up.
double measure_sgemm(GemmPath path, int n, Progress& progress) {
  const Tensor a = Tensor::randn({n, n}, /*seed=*/11), b = Tensor::randn({n, n}, /*seed=*/12);
  const Tensor c = Tensor::zeros({n, n});
  const auto call = [&] {
    detail::sgemm_on(path, false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  };
  const std::string name = fmt::format("sgemm {}", detail::to_string(path));
  progress.show("baseline", name, "warm-up");
  call();
  std::vector<double> times;
  for (int run = 1; run <= kBaselineRuns; ++run) {
    progress.show("baseline", name, "run", run, kBaselineRuns);
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
// qkv's GEMM paths on the shape classes the library meets: the measurement behind
// choose_gemm_path (src/gemm/gemm.cpp). C = op(A) op(B) with packed operands.

struct GemmClass {
  std::string_view name;
  bool trans_a, trans_b;
  int64_t m, n, k;
};

constexpr GemmClass kGemmClasses[] = {
    {"W5 in-proj (Linear, 20 rows)", false, true, 20, 1536, 512},
    {"W5 out-proj (Linear, 20 rows)", false, true, 20, 512, 512},
    {"Linear 32 rows", false, true, 32, 512, 512},
    {"Linear 64 rows", false, true, 64, 512, 512},
    {"Linear 2048 rows", false, true, 2048, 512, 512},
    {"Linear dx, 2048 rows", false, false, 2048, 512, 512},
    {"Linear dW, 2048 rows", true, false, 512, 512, 2048},
    {"Reference W0 S=QK^T", false, true, 256, 256, 64},
    {"Reference W1 S=QK^T", false, true, 512, 512, 64},
    {"Reference W1 O=PV", false, false, 512, 64, 512},
    {"Reference W2 S=QK^T", false, true, 2048, 2048, 64},
    {"Reference W2 O=PV", false, false, 2048, 64, 2048},
    {"Reference W1 bwd dK", true, false, 512, 64, 512},
};

struct GemmRow {
  const GemmClass* shape;
  std::vector<std::pair<GemmPath, double>> gflops;  // every path that can take it
  GemmPath chosen;
  double chosen_gflops() const {
    for (const auto& [path, rate] : gflops)
      if (path == chosen) return rate;
    return 0;
  }
  double best_gflops() const {
    double best = 0;
    for (const auto& entry : gflops) best = std::max(best, entry.second);
    return best;
  }
};

// Each path's GFLOP/s on one shape: the best of 3 batches of calls, each batch at least ~20 ms.
// The OpenMP paths (oneDNN, Small, Tiled, TiledT) take turns batch by batch, so that a busy moment of a
// shared machine falls on all of them rather than on one; OpenBLAS, whose threads would spin
// beside theirs, runs its batches last, then is let sleep.
constexpr int kGemmBatches = 3;
std::vector<std::pair<GemmPath, double>> time_gemm_paths(const GemmClass& g, const Tensor& a, const Tensor& b,
                                                         const Tensor& c, Progress& progress) {
  const int64_t lda = g.trans_a ? g.m : g.k, ldb = g.trans_b ? g.k : g.n;
  const double flops = 2.0 * static_cast<double>(g.m) * static_cast<double>(g.n) * static_cast<double>(g.k);
  std::vector<std::pair<GemmPath, double>> out;
  for (GemmPath path : {GemmPath::OneDnn, GemmPath::Small, GemmPath::Tiled, GemmPath::TiledT, GemmPath::OpenBlas})
    if (detail::gemm_path_can_take(path, g.trans_a, g.trans_b)) out.emplace_back(path, 0.0);
  const auto call = [&](GemmPath path) {
    detail::sgemm_on(path, g.trans_a, g.trans_b, g.m, g.n, g.k, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(),
                     g.n);
  };
  const auto batch = [&](GemmPath path) {
    int calls = 0;
    const Clock::time_point start = Clock::now();
    double ms = 0;
    while (ms < 20) {
      call(path);
      ++calls;
      ms = elapsed_ms(start);
    }
    return flops * calls / (ms * 1e-3) * 1e-9;
  };
  const auto run = [&](bool openblas) {
    for (int turn = -1; turn < kGemmBatches; ++turn)  // turn -1: one call each, the warm-up
      for (auto& [path, best] : out) {
        if ((path == GemmPath::OpenBlas) != openblas) continue;
        const std::string name = fmt::format("{} {}", g.name, detail::to_string(path));
        if (turn < 0) {
          progress.show("gemm", name, "warm-up");
          call(path);
        } else {
          progress.show("gemm", name, "run", turn + 1, kGemmBatches);
          best = std::max(best, batch(path));
        }
      }
  };
  run(false);
  run(true);
  let_openblas_threads_sleep();
  return out;
}

std::vector<GemmRow> measure_gemm_classes(Progress& progress) {
  std::vector<GemmRow> rows;
  for (const GemmClass& g : kGemmClasses) {
    const Tensor a = Tensor::randn({g.m * g.k}, /*seed=*/21), b = Tensor::randn({g.k * g.n}, /*seed=*/22);
    const Tensor c = Tensor::zeros({g.m * g.n});
    rows.push_back({&g, time_gemm_paths(g, a, b, c, progress),
                    detail::choose_gemm_path(g.trans_a, g.trans_b, g.m, g.n, g.k)});
  }
  return rows;
}

// ---------------------------------------------------------------------------------------------
// Environment variables that handicap a library, and the warning for each one that is set.

std::vector<std::string> environment_warnings(int omp_threads, int openblas_threads, const Baselines& ceilings) {
  std::vector<std::string> out;
  const int cores = omp_get_num_procs();
  if (const char* coretype = std::getenv("OPENBLAS_CORETYPE")) {
    std::string line = fmt::format("OPENBLAS_CORETYPE={} forces OpenBLAS's kernels for that core, whatever this CPU offers",
                                   coretype);
    if (ceilings.onednn_gflops > 0)
      line += fmt::format(" (OpenBLAS sgemm {:.0f} GFLOP/s here vs oneDNN's {:.0f}; qkv's GEMMs use oneDNN)",
                          ceilings.openblas_gflops, ceilings.onednn_gflops);
    out.push_back(line);
  }
  for (const char* name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_THREAD_LIMIT"}) {
    const char* value = std::getenv(name);
    if (value == nullptr) continue;
    const int threads = std::atoi(value);
    if (threads > 0 && threads < cores)
      out.push_back(fmt::format("{}={} is lower than the {} cores OpenMP sees", name, value, cores));
  }
  if (openblas_threads != omp_threads)
    out.push_back(fmt::format("OpenBLAS runs {} threads and OpenMP {}: the ceilings and the kernels use different "
                              "thread counts",
                              openblas_threads, omp_threads));
  for (const char* name : {"DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA"})
    if (const char* value = std::getenv(name))
      out.push_back(fmt::format("{}={} caps oneDNN's instruction set", name, value));
  return out;
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
std::string auto_kernel(const Workload& w, const bench::AttentionInputs& in, const DecodeProbe& decode,
                        MatmulPrecision precision) {
  if (!decode.built) return "Flash";
  const auto output_of = [&](Backend backend) -> std::optional<Tensor> {
    try {
      return scaled_dot_product_attention(in.q, in.k, in.v, bench::make_attention_options(w, in, backend, precision))
          .output;
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
                      const std::function<int(double)>& runs_after_first, std::string kernel, Progress& progress,
                      MatmulPrecision precision) {
  const AttentionOptions options = bench::make_attention_options(w, in, backend, precision);
  AttentionResult reused;  // the steady state writes here every run
  const std::string name(to_string(backend));
  const Timings t = measure(
      [&] { (void)scaled_dot_product_attention(in.q, in.k, in.v, options); },
      [&] { scaled_dot_product_attention_into(in.q, in.k, in.v, reused, options); }, runs, runs_after_first, w.id,
      name, progress);
  return {&w, false, name, std::move(kernel), t.runs, t.first_ms, t.median_ms, t.min_ms, t.peak_extra_mib,
          std::nullopt};
}

// The backward as the forward: the first call allocates its gradients, the steady state writes
// into the same ones (scaled_dot_product_attention_backward_into), as a training loop that keeps
// its gradient buffers does. The forward result it needs is computed once, outside the timing,
// with the same options.
Row measure_backward(const Workload& w, const bench::AttentionInputs& in, Backend backend, int runs,
                     const std::function<int(double)>& runs_after_first, Progress& progress,
                     MatmulPrecision precision) {
  const AttentionOptions options = bench::make_attention_options(w, backend, precision);
  const std::string name(to_string(backend));
  const std::string id = std::string(w.id) + "-bwd";
  progress.show(id, name, "forward");
  const bench::BackwardInputs bwd = bench::make_backward_inputs(w, in, options);
  AttentionGrads reused;  // the steady state writes here every run
  const Timings t = measure(
      [&] { (void)scaled_dot_product_attention_backward(bwd.grad_output, in.q, in.k, in.v, bwd.forward, options); },
      [&] {
        scaled_dot_product_attention_backward_into(bwd.grad_output, in.q, in.k, in.v, bwd.forward, reused, options);
      },
      runs, runs_after_first, id, name, progress);
  // Backward has no Decode: Auto runs Flash (attention.hpp).
  return {&w, true, name, backend == Backend::Reference ? "Reference" : "Flash", t.runs, t.first_ms, t.median_ms,
          t.min_ms, t.peak_extra_mib, std::nullopt};
}

// linear_attention: a fresh output on the first call, then into the same output.
Row measure_linear(const Workload& w, const bench::AttentionInputs& in, int runs, Progress& progress) {
  const LinearAttentionOptions options = bench::make_linear_options(w);
  Tensor reused;
  const Timings t = measure([&] { (void)linear_attention(in.q, in.k, in.v, options); },
                            [&] { linear_attention_into(in.q, in.k, in.v, reused, options); }, runs, nullptr, w.id,
                            "Auto", progress);
  return {&w, false, "Auto", "Linear", t.runs, t.first_ms, t.median_ms, t.min_ms, t.peak_extra_mib, std::nullopt};
}

// The log-log slope of a linear workload's time from N = 4096 to 65536 (its shape otherwise),
// each the median of a few calls after a warm-up.
double linear_slope(const Workload& w, Progress& progress) {
  double ms[2];
  const int64_t lengths[2] = {4096, 65536};
  for (int n = 0; n < 2; ++n) {
    Workload sized = w;
    sized.q_len = sized.kv_len = lengths[n];
    const bench::AttentionInputs in = bench::make_attention_inputs(sized);
    const LinearAttentionOptions options = bench::make_linear_options(sized);
    Tensor out;
    linear_attention_into(in.q, in.k, in.v, out, options);
    std::vector<double> times;
    for (int run = 1; run <= 5; ++run) {
      progress.show(w.id, fmt::format("N={}", lengths[n]), "run", run, 5);
      times.push_back(time_ms([&] { linear_attention_into(in.q, in.k, in.v, out, options); }));
    }
    ms[n] = median(times);
  }
  return std::log(ms[1] / ms[0]) / std::log(static_cast<double>(lengths[1]) / static_cast<double>(lengths[0]));
}

// cascade_attention: a fresh result on the first call, then into the same output and lse.
Row measure_cascade(const Workload& w, int runs, Progress& progress, MatmulPrecision precision) {
  const bench::CascadeInputs in = bench::make_cascade_inputs(w);
  AttentionOptions options;
  options.precision = precision;
  AttentionResult reused;
  const Timings t = measure(
      [&] { (void)cascade_attention(in.q, in.prefix_k, in.prefix_v, in.suffix_k, in.suffix_v, options); },
      [&] { cascade_attention_into(in.q, in.prefix_k, in.prefix_v, in.suffix_k, in.suffix_v, reused, options); }, runs,
      nullptr, w.id, "Auto", progress);
  return {&w, false, "Auto", "cascade", t.runs, t.first_ms, t.median_ms, t.min_ms, t.peak_extra_mib, std::nullopt};
}

// The module allocates its outputs on every forward: both phases call the same forward.
Row measure_module(const Workload& w, int runs, Progress& progress, MatmulPrecision precision) {
  const bench::ModuleInputs in = bench::make_module_inputs(w, precision);
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
  FmaPeak fma;
  std::optional<double> linear_slope;  // W7's time slope, N = 4096 .. 65536, when W7 ran
  Baselines start, end;  // the baselines before and after the workloads
  std::vector<GemmRow> gemm;
  std::vector<std::string> warnings;
  MatmulPrecision precision = MatmulPrecision::Highest;  // of the attention workloads
  // What the ratios divide by: the higher of the two, so a load that slowed one measurement makes
  // a ratio smaller, never larger.
  Baselines best() const {
    return {std::max(start.openblas_gflops, end.openblas_gflops), std::max(start.onednn_gflops, end.onednn_gflops),
            std::max(start.memcpy_gbs, end.memcpy_gbs), start.read.gbs >= end.read.gbs ? start.read : end.read};
  }
  double sgemm() const { return best().sgemm_gflops(); }
  std::string sgemm_library() const {
    return best().onednn_gflops > best().openblas_gflops ? "oneDNN" : "OpenBLAS";
  }
  double peak() const { return fma.gflops; }
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
                     gflops(*row) / env.sgemm(), 0.55, true});
  }
  for (std::string_view id : {"W1", "W2"}) {
    if (const Row* row = find_row(rows, id, "Auto", /*backward=*/true))
      out.push_back({fmt::format("{} flash backward vs sgemm", id), "GFLOP/s / sgemm GFLOP/s",
                     gflops(*row) / env.sgemm(), 0.35, true});
  }
  // Issue 15: fractions of the same-run FMA peak.
  for (const auto& [id, limit] : {std::pair<std::string_view, double>{"W0", 0.60}, {"W1", 0.75}, {"W2", 0.75},
                                  {"W3", 0.80}})
    if (const Row* row = find_row(rows, id, "Auto"))
      out.push_back({fmt::format("{} fast path vs FMA peak", id), "GFLOP/s / FMA peak", gflops(*row) / env.peak(),
                     limit, true});
  for (std::string_view id : {"W1", "W2"})
    if (const Row* row = find_row(rows, id, "Auto", /*backward=*/true))
      out.push_back({fmt::format("{} flash backward vs FMA peak", id), "GFLOP/s / FMA peak",
                     gflops(*row) / env.peak(), 0.70, true});
  for (const GemmRow& g : env.gemm)
    out.push_back({fmt::format("GEMM {}", g.shape->name), "chosen GFLOP/s / sgemm", g.chosen_gflops() / env.sgemm(),
                   0.85, true});
  if (const Row* row = find_row(rows, "W4", "Auto"))
    out.push_back({"W4 decode vs memcpy", "K,V GB/s / memcpy GB/s", kv_gbs(*row) / env.best().memcpy_gbs, 0.8, true});
  // Issue 44: decode at the memory bound, K and V read at 0.85 x what the same threads read alone.
  if (const Row* row = find_row(rows, "W4", "Auto"))
    out.push_back({"W4 decode vs read", "K,V GB/s / read GB/s", kv_gbs(*row) / env.best().read.gbs, 0.85, true});
  if (const Row* w4 = find_row(rows, "W4", "Auto")) {
    // 16-bit K/V: half the bytes, so about half the time; int8 a quarter, int4 an eighth (plus
    // scales); paged K/V the same bytes through a block table, within 10%
    for (auto [id, target] : {std::pair{"W4-bf16", 0.55}, {"W4-f16", 0.55}, {"W4-int8", 0.32}, {"W4-int4", 0.22},
                              {"W4-paged", 1.10}})
      if (const Row* row = find_row(rows, id, "Auto"))
        out.push_back({fmt::format("{} vs W4", id), fmt::format("{} ms / W4 ms", id), row->median_ms / w4->median_ms,
                       target, false});
  }
  if (const Row* int8 = find_row(rows, "W4-int8", "Auto"))  // int8 pages against the contiguous int8 cache
    if (const Row* row = find_row(rows, "W4-paged-int8", "Auto"))
      out.push_back({"W4-paged-int8 vs W4-int8", "W4-paged-int8 ms / W4-int8 ms", row->median_ms / int8->median_ms,
                     1.10, false});
  if (const Row* plain = find_row(rows, "W1", "Auto")) {
    for (std::string_view id : {"W1-softcap", "W1-alibi", "W1-sinks"})
      if (const Row* row = find_row(rows, id, "Auto"))
        out.push_back({fmt::format("{} vs W1", id), fmt::format("{} ms / W1 ms", id), row->median_ms / plain->median_ms,
                       1.15, false});
    if (const Row* row = find_row(rows, "W1-relpos", "Auto"))  // issue 42: a score function as text
      out.push_back({"W1-relpos (score_mod text) vs W1", "W1-relpos ms / W1 ms", row->median_ms / plain->median_ms,
                     1.5, false});
    if (const Row* row = find_row(rows, "W1-relpos-cpp", "Auto"))  // and as a C++ callable
      out.push_back({"W1-relpos-cpp (C++ callable) vs W1", "W1-relpos-cpp ms / W1 ms",
                     row->median_ms / plain->median_ms, 1.2, false});
  }
  // Issue 42: the backward with a (1, H, N, N) bias, which also returns its gradient dbias.
  const Row* plain_bwd = find_row(rows, "W1", "Auto", /*backward=*/true);
  if (const Row* bias_bwd = find_row(rows, "W1-bias", "Auto", /*backward=*/true); plain_bwd && bias_bwd)
    out.push_back({"W1-bias-bwd (dbias) vs W1-bwd", "W1-bias-bwd ms / W1-bwd ms",
                   bias_bwd->median_ms / plain_bwd->median_ms, 1.3, false});
  const Row* linear = find_row(rows, "W7", "Auto");
  const Row* softmax = find_row(rows, "W7-flash", "Auto");
  if (linear && softmax)
    out.push_back({"W7 linear vs causal flash", "W7-flash ms / W7 ms", softmax->median_ms / linear->median_ms, 20,
                   true});
  if (env.linear_slope)
    out.push_back({"W7 linear scaling, N = 4096..65536", "log-log time slope", *env.linear_slope, 1.1, false});
  const Row* causal = find_row(rows, "W2", "Auto");
  if (const Row* sparse = find_row(rows, "W6", "Auto"); sparse && causal)
    out.push_back({"W6 sparse vs W2 dense causal", "W6 GFLOP/s (visible pairs) / W2 GFLOP/s", gflops(*sparse) / gflops(*causal),
                   0.5, true});
  const Row* full = find_row(rows, "W2-full", "Auto");
  if (causal && full)
    out.push_back({"W2 causal vs unmasked", "W2 ms / W2-full ms", causal->median_ms / full->median_ms, 0.6, false});
  if (const Row* summary = find_row(rows, "W2-summary", "Auto"); causal && summary)
    out.push_back({"W2 with summaries vs without", "W2-summary ms / W2 ms", summary->median_ms / causal->median_ms,
                   1.3, false});
  for (bool backward : {false, true}) {  // issue 41: a packed batch against the same sequences padded
    const Row* packed = find_row(rows, "V1", "Auto", backward);
    if (const Row* padded = find_row(rows, "V1-padded", "Auto", backward); packed && padded)
      out.push_back({backward ? "V1-bwd packed vs padded" : "V1 packed vs padded",
                     backward ? "V1-padded-bwd ms / V1-bwd ms" : "V1-padded ms / V1 ms",
                     padded->median_ms / packed->median_ms, 1.8, true});
  }
  // Issue 41: 16 sequences' decode step with their shared prefix read once, against without sharing.
  if (const Row* cascade = find_row(rows, "C1", "Auto"); cascade)
    if (const Row* separate = find_row(rows, "C1-separate", "Auto"))
      out.push_back({"C1 cascade vs separate decodes", "C1-separate ms / C1 ms", separate->median_ms / cascade->median_ms,
                     4, true});
  if (const Row* docs = find_row(rows, "W2-docs", "Auto"); docs && full)  // issue 42: hidden tiles skipped
    out.push_back({"W2-docs (mask_mod, 4 documents) vs unmasked", "W2-docs ms / W2-full ms",
                   docs->median_ms / full->median_ms, 0.35, false});
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

std::string json_strings(const std::vector<std::string>& texts) {
  std::string out = "[";
  for (const std::string& text : texts) out += (out.size() > 1 ? ", " : "") + json_string(text);
  return out + "]";
}

std::optional<double> if_built(double gflops) { return gflops > 0 ? std::optional<double>(gflops) : std::nullopt; }

// JSON Lines: one object per line, each with "kind": "environment", then one "gemm" per shape
// class, one "workload" per row, then one "target" per target measured.
void print_json(const std::vector<Row>& rows, const Environment& env) {
  fmt::print(
      "{{\"kind\": \"environment\", \"qkv_version\": {}, \"omp_threads\": {}, \"openblas_threads\": {}, "
      "\"openblas_coretype\": {}, \"openblas_core\": {}, \"openblas_config\": {}, \"decode_built\": {}, "
      "\"fma_peak_gflops\": {}, \"fma_threads\": {}, \"fma_lanes\": {}, \"simd_target\": {}, "
      "\"sgemm_size\": {}, \"sgemm_gflops\": {}, \"sgemm_library\": {}, \"sgemm_openblas_gflops\": {}, "
      "\"sgemm_onednn_gflops\": {}, \"memcpy_bytes\": {}, \"memcpy_gbs\": {}, \"read_gbs\": {}, "
      "\"read_plain_gbs\": {}, \"read_prefetch_gbs\": {}, \"read_threads\": {}, "
      "\"sgemm_gflops_start\": {}, \"sgemm_gflops_end\": {}, \"memcpy_gbs_start\": {}, \"memcpy_gbs_end\": {}, "
      "\"read_gbs_start\": {}, \"read_gbs_end\": {}, "
      "\"warnings\": {}, \"matmul_precision\": {}}}\n",
      json_string(version()), env.omp_threads, env.openblas_threads,
      env.coretype.empty() ? "null" : json_string(env.coretype), json_string(env.openblas_core), json_string(env.openblas_config),
      env.decode.built ? "true" : "false", number(env.peak()), env.fma.threads, env.fma.lanes,
      json_string(env.fma.target), kSgemmSize, number(env.sgemm()), json_string(env.sgemm_library()),
      number(env.best().openblas_gflops), number(if_built(env.best().onednn_gflops)), kMemcpyBytes,
      number(env.best().memcpy_gbs), number(env.best().read.gbs), number(env.best().read.plain_gbs),
      number(env.best().read.prefetch_gbs), env.best().read.threads, number(env.start.sgemm_gflops()), number(env.end.sgemm_gflops()),
      number(env.start.memcpy_gbs), number(env.end.memcpy_gbs), number(env.start.read.gbs), number(env.end.read.gbs),
      json_strings(env.warnings),
      json_string(std::string(to_string(env.precision))));
  for (const GemmRow& g : env.gemm) {
    std::string rates;
    for (const auto& [path, rate] : g.gflops)
      rates += fmt::format("{}{}: {}", rates.empty() ? "" : ", ", json_string(detail::to_string(path)), number(rate));
    fmt::print("{{\"kind\": \"gemm\", \"class\": {}, \"trans_a\": {}, \"trans_b\": {}, \"m\": {}, \"n\": {}, "
               "\"k\": {}, \"gflops\": {{{}}}, \"chosen\": {}, \"chosen_gflops\": {}, \"vs_best_path\": {}, "
               "\"vs_sgemm\": {}, \"vs_peak\": {}}}\n",
               json_string(g.shape->name), g.shape->trans_a ? "true" : "false", g.shape->trans_b ? "true" : "false",
               g.shape->m, g.shape->n, g.shape->k, rates, json_string(detail::to_string(g.chosen)),
               number(g.chosen_gflops()), number(g.chosen_gflops() / g.best_gflops()),
               number(g.chosen_gflops() / env.sgemm()), number(g.chosen_gflops() / env.peak()));
  }
  for (const Row& row : rows) {
    const Workload& w = *row.workload;
    const bool decode = w.decode;
    fmt::print(
        "{{\"kind\": \"workload\", \"workload\": {}, \"pass\": {}, \"description\": {}, \"backend\": {}, "
        "\"kernel\": {}, "
        "\"shape\": {}, \"mask\": {}, \"batch\": {}, \"q_heads\": {}, \"kv_heads\": {}, \"q_len\": {}, "
        "\"kv_len\": {}, \"head_dim\": {}, \"flops\": {}, \"kv_bytes\": {}, \"runs\": {}, \"first_ms\": {}, "
        "\"median_ms\": {}, \"min_ms\": {}, \"calls_per_s\": {}, \"gflops\": {}, \"gbs\": {}, "
        "\"vs_reference\": {}, \"vs_sgemm\": {}, \"vs_peak\": {}, \"vs_memcpy\": {}, \"vs_read\": {}, "
        "\"peak_extra_mib\": {}}}\n",
        json_string(row_id(row)), json_string(row.backward ? "backward" : "forward"), json_string(w.description), json_string(row.backend), json_string(row.kernel), json_string(bench::shape_string(w)),
        json_string(w.mask_expression()), w.batch, w.q_heads, w.kv_heads, w.q_len, w.kv_len, w.head_dim,
        number(row_flops(row)), number(bench::kv_bytes(w)), row.runs, number(row.first_ms),
        number(row.median_ms), number(row.min_ms), number(1e3 / row.median_ms), number(gflops(row)),
        decode ? number(kv_gbs(row)) : "null", number(row.vs_reference),
        number(gflops(row) / env.sgemm()), number(gflops(row) / env.peak()),
        decode ? number(kv_gbs(row) / env.best().memcpy_gbs) : "null",
        decode ? number(kv_gbs(row) / env.best().read.gbs) : "null", number(row.peak_extra_mib));
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
  fmt::print("workload    backend    kernel     runs  first ms  median ms   calls/s  GFLOP/s  x sgemm  x peak    GB/s  "
             "x memcpy  x read   x ref  peak MiB  shape\n");
  for (const Row& row : rows) {
    const Workload& w = *row.workload;
    const std::string gbs = w.decode ? short_number(kv_gbs(row)) : "";
    const std::string vs_memcpy = w.decode ? fixed(kv_gbs(row) / env.best().memcpy_gbs, 2) : "";
    const std::string vs_read = w.decode ? fixed(kv_gbs(row) / env.best().read.gbs, 2) : "";
    const std::string vs_reference = row.vs_reference ? fixed(*row.vs_reference, 1) : "";
    fmt::print("{:<10}  {:<9}  {:<9}  {:>4}  {:>8}  {:>9}  {:>8}  {:>7}  {:>7}  {:>6}  {:>6}  {:>8}  {:>6}  {:>6}  {:>8}  {}{}\n",
               row_id(row), row.backend, row.kernel, row.runs, short_number(row.first_ms), short_number(row.median_ms),
               short_number(1e3 / row.median_ms), short_number(gflops(row)),
               fixed(gflops(row) / env.sgemm(), 2), fixed(gflops(row) / env.peak(), 2), gbs, vs_memcpy, vs_read, vs_reference,
               fixed(row.peak_extra_mib, 1), bench::shape_string(w), w.is_sparse() ? " " + w.mask_expression() : (w.causal ? " causal" : ""));
  }
}

void print_text(const std::vector<Row>& rows, const Environment& env) {
  fmt::print("qkv {} bench: {} OpenMP threads, {} OpenBLAS threads; OPENBLAS_CORETYPE={}; OpenBLAS core: {}\n",
             version(), env.omp_threads, env.openblas_threads, env.coretype.empty() ? "(unset)" : env.coretype,
             env.openblas_core);
  fmt::print("Ceilings, measured in this run:\n");
  fmt::print("  FMA peak: {:.1f} GFLOP/s ({} threads x {} float lanes, Highway target {}, independent FMA chains)\n",
             env.peak(), env.fma.threads, env.fma.lanes, env.fma.target);
  const std::string onednn =
      env.best().onednn_gflops > 0 ? fmt::format("{:.1f}", env.best().onednn_gflops) : std::string("not built in");
  fmt::print("  sgemm {}^3: {:.1f} GFLOP/s from {} (OpenBLAS {:.1f}, oneDNN {}) = {:.2f} x the FMA peak\n",
             kSgemmSize, env.sgemm(), env.sgemm_library(), env.best().openblas_gflops, onednn, env.sgemm() / env.peak());
  fmt::print("  memcpy {} MiB: {:.1f} GB/s (read + written)\n", kMemcpyBytes >> 20, env.best().memcpy_gbs);
  fmt::print("  read {} MiB: {:.1f} GB/s ({} threads, each its share; loads alone {:.1f}, with a prefetch {:.1f})\n",
             kMemcpyBytes >> 20, env.best().read.gbs, env.best().read.threads, env.best().read.plain_gbs,
             env.best().read.prefetch_gbs);
  fmt::print("  measured before and after the workloads: sgemm {:.1f} / {:.1f} GFLOP/s, memcpy {:.1f} / {:.1f} GB/s, "
             "read {:.1f} / {:.1f} GB/s;\n"
             "  the ratios divide by the higher (a wide spread means a loaded machine)\n",
             env.start.sgemm_gflops(), env.end.sgemm_gflops(), env.start.memcpy_gbs, env.end.memcpy_gbs,
             env.start.read.gbs, env.end.read.gbs);
  for (const std::string& warning : env.warnings) fmt::print("WARNING: {}\n", warning);
  if (env.precision != MatmulPrecision::Highest)
    fmt::print("Matmul precision of the attention workloads: {} ({}); Decode, Reference and the modules' "
               "projections compute in float32\n",
               to_string(env.precision),
               detail::amx::available() ? "the Flash forward's and backward's products on AMX tiles, the modules' too"
                                        : "no AMX here: float32 too");
  if (!env.gemm.empty()) {
    fmt::print("\nqkv's GEMM paths (src/gemm/gemm.hpp) per shape class, GFLOP/s; chosen = what qkv::detail::sgemm takes:\n");
    fmt::print("{:<32} {:<2} {:>5} {:>5} {:>5}  {:>8} {:>7} {:>6} {:>6} {:>6}  {:<8} {:>9} {:>7}\n", "class", "op", "m",
               "n", "k", "OpenBLAS", "oneDNN", "Small", "Tiled", "TiledT", "chosen", "x best", "x sgemm");
    for (const GemmRow& g : env.gemm) {
      const auto rate = [&](GemmPath path) -> std::string {
        for (const auto& [p, r] : g.gflops)
          if (p == path) return short_number(r);
        return "-";
      };
      fmt::print("{:<32} {}{} {:>5} {:>5} {:>5}  {:>8} {:>7} {:>6} {:>6} {:>6}  {:<8} {:>9} {:>7}\n", g.shape->name,
                 g.shape->trans_a ? "T" : "N", g.shape->trans_b ? "T" : "N", g.shape->m, g.shape->n, g.shape->k,
                 rate(GemmPath::OpenBlas), rate(GemmPath::OneDnn), rate(GemmPath::Small), rate(GemmPath::Tiled),
                 rate(GemmPath::TiledT), detail::to_string(g.chosen), fixed(g.chosen_gflops() / g.best_gflops(), 2),
                 fixed(g.chosen_gflops() / env.sgemm(), 2));
    }
    fmt::print("\n");
  }
  if (env.decode.built) {
    fmt::print("Auto's kernel: told from its output, which matches the kernel it ran bit for bit\n");
  } else {
    fmt::print("Auto's kernel: Flash everywhere (Backend::Decode not built yet: \"{}\")\n", env.decode.message);
  }
  fmt::print("first = release_workspaces() + a fresh result; median = steady state, same result reused (_into)\n");
  fmt::print("x ref = Reference ms / this ms; x sgemm = GFLOP/s / best sgemm; x peak = GFLOP/s / FMA peak;\n"
             "GB/s, x memcpy and x read: K and V bytes read\n");
  fmt::print("-bwd = scaled_dot_product_attention_backward (steady state: into the same gradients), FLOPs = 2.5 x forward\n\n");
  print_table(rows, env);

  const std::vector<Target> measured = targets(rows, env);
  if (!measured.empty()) {
    fmt::print("\nTargets (issues 3, 4, 9, 10, 11, 15 and 44), from this run{}:\n",
               env.precision == MatmulPrecision::Highest
                   ? ""
                   : fmt::format(" at matmul precision {} (the issues set them at highest)", to_string(env.precision)));
    for (const Target& target : measured) {
      fmt::print("  {:<42} {:<26} {:>5}  (target {} {:.2f})  {}\n", target.name, target.measure,
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
      // W2 brings W2-full and W2-docs along, W1 its modifier rows, W4 its 16-bit rows, W6 and W2-summary
      // W2, W7 W7-flash: the targets compare them. "decode-sweep" names every sweep row.
      wanted = wanted || named == &w || (named && named->id == "W2" && (w.id == "W2-full" || w.id == "W2-docs")) ||
               (named && named->id == "W1" && w.id.substr(0, 3) == "W1-") ||
               (named && named->id == "W6" && w.id == "W2") ||
               (named && named->id == "W2-summary" && w.id == "W2") ||
               (named && named->id == "W7" && w.id == "W7-flash") ||
               (named && named->id == "V1" && w.id == "V1-padded") ||
               (named && named->id == "C1" && w.id == "C1-separate") ||
               (named && named->id == "W4" && w.id.substr(0, 3) == "W4-") || (id == "decode-sweep" && w.sweep);
    }
    if (ids.empty() && w.sweep) wanted = false;  // the sweep's 1 GB of K/V only when asked for
    if (wanted) selected.push_back(&w);
  }
  return selected;
}

void run_bench(const BenchOptions& options) {
  if (options.threads != 0) check_range("--threads", options.threads, 1, kMaxThreads);
  check_range("--runs", options.runs, 1, 1000);
  if (options.reference_runs != 0) check_range("--reference-runs", options.reference_runs, 1, 1000);
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
  env.precision = matmul_precision_from_string(options.precision);
  const auto baselines = [&] {
    Baselines out;
    for (GemmPath path : sgemm_libraries()) {
      const double rate = measure_sgemm(path, kSgemmSize, progress);
      (path == GemmPath::OneDnn ? out.onednn_gflops : out.openblas_gflops) = rate;
      if (path == GemmPath::OpenBlas) let_openblas_threads_sleep();
    }
    out.memcpy_gbs = measure_memcpy(kMemcpyBytes, progress);
    progress.show("baseline", "read", "runs");
    // On huge pages, as W4's K and V are (bench::on_huge_pages), and holding ones: a huge page of
    // zeros may be split and its pages mapped to the shared zero page, read from cache.
    Tensor buffer = detail::zeros_on_huge_pages({static_cast<int64_t>(kMemcpyBytes / sizeof(float))}, DType::F32);
    std::fill_n(buffer.data(), buffer.numel(), 1.0f);
    out.read = measure_read_peak(buffer.data(), static_cast<size_t>(buffer.numel()), kBaselineRuns);
    return out;
  };
  progress.show("baseline", "FMA peak", "runs");
  env.fma = measure_fma_peak(5);
  env.start = baselines();
  if (!options.no_gemm) env.gemm = measure_gemm_classes(progress);

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
      rows.push_back(measure_module(*w, options.runs, progress, env.precision));
      continue;
    }
    if (w->is_cascade()) {
      rows.push_back(measure_cascade(*w, options.runs, progress, env.precision));
      continue;
    }
    const bench::AttentionInputs inputs = bench::make_attention_inputs(*w);
    if (w->is_linear()) {
      rows.push_back(measure_linear(*w, inputs, options.runs, progress));
      env.linear_slope = linear_slope(*w, progress);
      continue;
    }
    progress.show(w->id, "Auto", "which kernel");
    const std::string kernel = auto_kernel(*w, inputs, env.decode, env.precision);
    if (!w->has_reference) {  // the sweep (GB/s of the fast path) and shapes whose scores would not fit
      rows.push_back(
          measure_attention(*w, inputs, Backend::Auto, options.runs, nullptr, kernel, progress, env.precision));
      if (w->backward)
        rows.push_back(measure_backward(*w, inputs, Backend::Auto, options.runs, nullptr, progress, env.precision));
      continue;
    }
    add_pair(measure_attention(*w, inputs, Backend::Auto, options.runs, nullptr, kernel, progress, env.precision), [&] {
      return measure_attention(*w, inputs, Backend::Reference, 0, reference_runs, "Reference", progress,
                               env.precision);
    });
    if (!w->backward) continue;
    add_pair(measure_backward(*w, inputs, Backend::Auto, options.runs, nullptr, progress, env.precision), [&] {
      return measure_backward(*w, inputs, Backend::Reference, 0, reference_runs, progress, env.precision);
    });
  }
  env.end = baselines();
  progress.show("baseline", "FMA peak", "runs");
  if (const FmaPeak end = measure_fma_peak(5); end.gflops > env.fma.gflops) env.fma = end;  // the higher, as above
  env.warnings = environment_warnings(env.omp_threads, env.openblas_threads, env.best());
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
      "Time the standard workloads W0-W7 (and W1, W2, W6 backward): ms, GFLOP/s, ratios to Reference, sgemm and memcpy");
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
  bench->add_flag("--no-gemm", options->no_gemm, "Skip the table of qkv's GEMM paths per shape class");
  bench->add_option("--precision", options->precision,
                    "Matmul precision of the attention workloads (AttentionOptions::precision): highest "
                    "(float32, the default), high or medium (bfloat16 parts on AMX tiles where the CPU has them)")
      ->check(CLI::IsMember({"highest", "high", "medium"}));
  bench->callback([options] { run_bench(*options); });
}

}  // namespace qkv::cli
