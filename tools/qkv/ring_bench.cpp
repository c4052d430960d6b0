// `qkv ring-bench`: times ring attention over MPI (include/qkv/dist.hpp). Run under mpirun:
//   mpirun -np 4 --oversubscribe qkv ring-bench --n 8192 --causal
// Every rank builds the same random q, k, v (one seed) and takes its contiguous shard. Per pass
// (forward; backward with --backward) rank 0 prints the median time of --runs calls, the useful
// GFLOP/s per rank (visible (query, key) pairs only: 2 (Dk + Dv) FLOPs each forward, 2.5x that
// backward), the share of the call spent blocked in MPI waits (mean and max over ranks), then,
// unless --no-check, the single-process kernel on the whole sequence, timed on rank 0 alone in the
// same run (the speedup is the ratio of the two), and the largest |difference| between the
// gathered ring result and it. The machine is shared: compare ratios within one run.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "qkv/dist.hpp"
#include "qkv/qkv.hpp"

namespace qkv::cli {
namespace {

struct RingBenchOptions {
  int64_t n = 4096;         // global sequence length
  int64_t per_rank = 0;     // > 0: N = per_rank * P (weak scaling)
  int64_t batch = 1, heads = 8, kv_heads = 0, dim = 128;
  bool causal = false, backward = false, check = true;
  bool modifiers = false;  // softcap 30, ALiBi slopes 2^(-8 (h + 1) / H), sinks 0
  int runs = 5, threads = 1;
};

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Rows [start, start + len) of dim 2 of a contiguous (B, H, N, D) tensor.
Tensor take_rows(const Tensor& t, int64_t start, int64_t len) {
  const int64_t outer = t.size(0) * t.size(1), n = t.size(2), d = t.size(3);
  Tensor out = Tensor::empty(Shape{t.size(0), t.size(1), len, d});
  for (int64_t o = 0; o < outer; ++o)
    std::copy_n(t.data() + (o * n + start) * d, len * d, out.data() + o * len * d);
  return out;
}

// The largest |a - b| between this rank's ring rows and rank 0's single-process tensor `whole`
// (defined on rank 0 only), gathered to rank 0. Rows are dim 2 of (B, H, rows, D) (lse: D = 1).
double max_diff_on_root(const Tensor& mine, const Tensor& whole, MPI_Comm comm) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  std::vector<float> all(rank == 0 ? static_cast<size_t>(mine.numel() * size) : 0);
  MPI_Gather(mine.data(), static_cast<int>(mine.numel()), MPI_FLOAT, all.data(), static_cast<int>(mine.numel()),
             MPI_FLOAT, 0, comm);
  if (rank != 0) return 0;
  const int64_t n = mine.size(2);
  double worst = 0;
  for (int r = 0; r < size; ++r) {
    const Tensor want = take_rows(whole, r * n, n);
    const float* w = want.data();
    const float* g = all.data() + static_cast<size_t>(r) * static_cast<size_t>(mine.numel());
    for (int64_t i = 0; i < want.numel(); ++i) {
      const double d = (std::isinf(w[i]) && w[i] == g[i]) ? 0.0 : std::abs(double{g[i]} - double{w[i]});
      worst = std::max(worst, std::isnan(d) ? INFINITY : d);
    }
  }
  return worst;
}

// Visible (query, key) pairs of one head: N^2, or N (N + 1) / 2 when causal.
double visible_pairs(int64_t n, bool causal) {
  return causal ? 0.5 * static_cast<double>(n) * static_cast<double>(n + 1) : static_cast<double>(n) * static_cast<double>(n);
}

// A barrier whose waiting ranks sleep instead of spinning (Open MPI's MPI_Barrier polls), so
// rank 0's single-process timing has the machine's other cores to itself.
void quiet_barrier(MPI_Comm comm) {
  MPI_Request request;
  MPI_Ibarrier(comm, &request);
  int done = 0;
  while (!done) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

struct PassResult {
  double seconds = 0, wait_mean = 0, wait_max = 0;
  double compute = 0;  // seconds inside the kernels and merges, median run, max over ranks
};

// Median time of `runs` calls of `call` (after one warm-up) and the wait shares of the median run.
template <typename Call>
PassResult time_pass(int runs, MPI_Comm comm, Call call) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  dist::RingStats stats;
  call(stats);  // warm-up
  std::vector<double> times, shares, computes;
  for (int i = 0; i < runs; ++i) {
    MPI_Barrier(comm);
    const auto start = Clock::now();
    call(stats);
    double t = std::chrono::duration<double>(Clock::now() - start).count();
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, comm);  // the slowest rank's time
    times.push_back(t);
    shares.push_back(stats.wait_seconds / stats.total_seconds);
    computes.push_back(stats.compute_seconds);
  }
  PassResult result;
  result.seconds = median(times);
  double share = median(shares), compute = median(computes);
  MPI_Allreduce(&compute, &result.compute, 1, MPI_DOUBLE, MPI_MAX, comm);
  MPI_Allreduce(&share, &result.wait_max, 1, MPI_DOUBLE, MPI_MAX, comm);
  MPI_Allreduce(&share, &result.wait_mean, 1, MPI_DOUBLE, MPI_SUM, comm);
  result.wait_mean /= size;
  return result;
}

void run_ring_bench(const RingBenchOptions& o) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  }
  // Finalises MPI when the command ends, normally or by a qkv::Error (which every rank throws).
  struct Finalize { ~Finalize() { MPI_Finalize(); } } finalize;
  MPI_Comm comm = MPI_COMM_WORLD;
  int rank = 0, p = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &p);
  if (o.threads > 0) omp_set_num_threads(o.threads);

  const int64_t total = o.per_rank > 0 ? o.per_rank * p : o.n;
  if (total % p != 0)
    throw Error(fmt::format("ring-bench: N = {} is not divisible by the {} ranks", total, p));
  const int64_t n = total / p, kv_heads = o.kv_heads > 0 ? o.kv_heads : o.heads;
  AttentionOptions options;
  if (o.causal) options.mask = Mask::causal();
  if (o.modifiers) {
    std::vector<float> slopes;
    for (int64_t h = 0; h < o.heads; ++h)
      slopes.push_back(std::exp2(-8.0f * static_cast<float>(h + 1) / static_cast<float>(o.heads)));
    options.softcap = 30.0f;
    options.alibi_slopes = Tensor::from(std::move(slopes), Shape{o.heads});
    options.sinks = Tensor::zeros(Shape{o.heads});
  }

  // The same data on every rank (one seed); each keeps its rows.
  const Tensor q = Tensor::randn(Shape{o.batch, o.heads, total, o.dim}, 1);
  const Tensor k = Tensor::randn(Shape{o.batch, kv_heads, total, o.dim}, 2);
  const Tensor v = Tensor::randn(Shape{o.batch, kv_heads, total, o.dim}, 3);
  const Tensor grad = Tensor::randn(Shape{o.batch, o.heads, total, o.dim}, 4);
  const Tensor qs = take_rows(q, rank * n, n), ks = take_rows(k, rank * n, n), vs = take_rows(v, rank * n, n),
               gs = take_rows(grad, rank * n, n);

  if (rank == 0)
    fmt::print("qkv ring-bench: P = {} ranks x {} OpenMP thread(s), B = {}, Hq = {}, Hkv = {}, D = {}, N = {} "
               "({} per rank), {}{}\n",
               p, omp_get_max_threads(), o.batch, o.heads, kv_heads, o.dim, total, n, o.causal ? "causal" : "full",
               o.modifiers ? ", softcap + ALiBi + sinks" : "");
  const double forward_flops = visible_pairs(total, o.causal) * 2.0 * (2 * o.dim) * static_cast<double>(o.batch * o.heads);

  AttentionResult ring;
  const PassResult fwd = time_pass(o.runs, comm, [&](dist::RingStats& s) {
    ring = dist::ring_attention(qs, ks, vs, comm, options, &s);
  });
  AttentionGrads ring_grads;
  PassResult bwd;
  if (o.backward)
    bwd = time_pass(o.runs, comm, [&](dist::RingStats& s) {
      ring_grads = dist::ring_attention_backward(gs, qs, ks, vs, ring, comm, options, &s);
    });

  // The single-process kernel on the whole sequence, on rank 0 while the others wait.
  double single_fwd = NAN, single_bwd = NAN, diff_out = NAN, diff_lse = NAN, diff_grad = NAN;
  if (o.check) {
    AttentionResult whole;
    AttentionGrads whole_grads;
    if (rank == 0) {
      std::vector<double> times;
      for (int i = 0; i < std::max(1, o.runs / 2); ++i) {
        const auto start = Clock::now();
        whole = scaled_dot_product_attention(q, k, v, options);
        times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      }
      single_fwd = median(times);
      if (o.backward) {
        times.clear();
        for (int i = 0; i < std::max(1, o.runs / 2); ++i) {
          const auto start = Clock::now();
          whole_grads = scaled_dot_product_attention_backward(grad, q, k, v, whole, options);
          times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
        }
        single_bwd = median(times);
      }
    }
    quiet_barrier(comm);
    const auto lse4 = [](const Tensor& t) { return t.defined() ? t.unsqueeze(3) : t; };
    diff_out = max_diff_on_root(ring.output, whole.output, comm);
    diff_lse = max_diff_on_root(lse4(ring.lse), lse4(whole.lse), comm);
    if (o.backward) {
      diff_grad = std::max({max_diff_on_root(ring_grads.dq, whole_grads.dq, comm),
                            max_diff_on_root(ring_grads.dk, whole_grads.dk, comm),
                            max_diff_on_root(ring_grads.dv, whole_grads.dv, comm)});
    }
  }

  if (rank != 0) return;
  fmt::print("{:<9} {:>10} {:>11} {:>13} {:>16} {:>17} {:>8} {:>11}\n", "pass", "time ms", "compute ms", "GFLOP/s/rank",
             "wait % mean/max", "single-proc ms", "speedup", "max |diff|");
  const auto row = [&](const char* name, const PassResult& r, double flops, double single, double diff) {
    fmt::print("{:<9} {:>10.2f} {:>11.2f} {:>13.2f} {:>16} {:>17} {:>8} {:>11}\n", name, r.seconds * 1e3, r.compute * 1e3,
               flops / p / r.seconds / 1e9, fmt::format("{:.1f} / {:.1f}", 100 * r.wait_mean, 100 * r.wait_max),
               std::isnan(single) ? std::string("-") : fmt::format("{:.2f}", single * 1e3),
               std::isnan(single) ? std::string("-") : fmt::format("{:.2f}x", single / r.seconds),
               std::isnan(diff) ? std::string("-") : fmt::format("{:.2e}", diff));
  };
  row("forward", fwd, forward_flops, single_fwd, o.check ? std::max(diff_out, diff_lse) : NAN);
  if (o.backward) row("backward", bwd, 2.5 * forward_flops, single_bwd, diff_grad);
}

}  // namespace

void add_ring_bench_command(CLI::App& app) {
  auto options = std::make_shared<RingBenchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "ring-bench", "Ring attention over MPI: run under mpirun -np P (docs/distributed.md)");
  cmd->add_option("--n", options->n, "Global sequence length N (divisible by P)")->capture_default_str();
  cmd->add_option("--per-rank", options->per_rank, "Weak scaling: N = this x P (overrides --n)");
  cmd->add_option("--batch", options->batch, "Batch")->capture_default_str();
  cmd->add_option("--heads", options->heads, "Query heads")->capture_default_str();
  cmd->add_option("--kv-heads", options->kv_heads, "Key/value heads (default: --heads)");
  cmd->add_option("--dim", options->dim, "Head dim (Dk = Dv)")->capture_default_str();
  cmd->add_flag("--causal", options->causal, "Causal mask (zigzag load balancing)");
  cmd->add_flag("--backward", options->backward, "Also time ring_attention_backward");
  cmd->add_flag("--modifiers", options->modifiers, "Softcap 30, ALiBi slopes and sinks (0) on every head");
  cmd->add_option("--runs", options->runs, "Timed calls per pass (the median is reported)")->capture_default_str();
  cmd->add_option("--threads", options->threads, "OpenMP threads per rank (0: leave as set)")->capture_default_str();
  cmd->add_flag("!--no-check", options->check, "Skip the single-process run and the comparison");
  cmd->callback([options] { run_ring_bench(*options); });
}

}  // namespace qkv::cli
