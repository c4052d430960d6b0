// Where a flash forward's time goes: each step of the pipeline (src/attention/pipeline-inl.h,
// tile_gemm-inl.h) timed in isolation on one work item's tile, on one thread, beside the same
// run's one-thread FMA peak; then the steps composed as FlashKeyTile composes them, and whole
// flash calls divided into the tiles they visit. This VM exposes no hardware counters, so the
// breakdown is timed, not sampled; docs/performance.md ("Where the time goes") reads its table.
//
//   OMP_NUM_THREADS=1 qkv_step_benchmark
//
// The tile is W0's and W1's (d = 64): Br queries (the micro-tile width: 48 on AVX-512) x Bc = 64
// keys, head 0 of W0's problem (B1 H8 N256, causal) built by the library's own builder, so every
// step reads the same strides and mask it reads in a call. Rows:
//   Step/PackQ        Qt = scale Q^T for one query tile             (once per work item)
//   Step/Scores       S^T = K Qt, the micro-GEMM                    (2 Bc Br d FLOPs)
//   Step/MaskCausal   the band on a diagonal tile, line by line     (causal tiles only)
//   Step/Softmax      online softmax update: max, exp, sum          (every tile)
//   Step/Rescale      Ot times the correction                       (tiles where a max grew)
//   Step/Accumulate   Ot += V^T P^T, the micro-GEMM                 (2 Bc Br d FLOPs)
//   Step/Finish       1/l, lse, row stats and O = Ot^T / l written  (once per work item)
//   Tile/Full         Scores + Softmax + Accumulate, a fully visible tile
//   Tile/Diagonal     Scores + MaskCausal + Softmax + Rescale + Accumulate
//   Call/W0, Call/W1  the whole scaled_dot_product_attention (Backend::Flash); counters give
//                     the call's time per visited tile and the tile and item counts
// Counters: GFLOP/s and x_peak (over the one-thread FMA peak measured before the benchmarks;
// Call rows: over the peak times the threads they ran on). Both are rate counters, which Google
// Benchmark prints with "/s": x_peak=0.83/s reads 0.83 of the peak.
// Softmax and Rescale run on the same buffer every iteration: Highway's Exp, Max and Mul cost the
// same whatever the values, so the timing does not depend on them.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "step_benchmark.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/pipeline-inl.h"
#include "hwy/highway.h"

#ifndef QKV_STEP_BENCHMARK_ONCE
#define QKV_STEP_BENCHMARK_ONCE
#include <cstddef>
#include <cstdint>

#include "attention/problem.hpp"

namespace qkv::bench {

// One worker's scratch for one work item, as flash.cpp lays it out, and where in W0 it sits.
struct StepTile {
  const detail::AttentionProblem* problem;  // W0's, causal
  size_t br, d, bc;
  int64_t i0, j0;  // the query tile and key tile (i0 < j0 + bc: on the diagonal)
  float *q_t, *scores, *out_t, *running_max, *row_sum, *correction, *nan_seen, *inverse, *lse;
};

}  // namespace qkv::bench
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace step = detail::HWY_NAMESPACE::pipeline;
using detail::HWY_NAMESPACE::tile_gemm::kTileVectors;
using detail::HWY_NAMESPACE::tile_gemm::PanelGemm;

size_t TileRows() { return kTileVectors * hn::Lanes(hn::ScalableTag<float>()); }

void PackQ(const StepTile& t) {
  const detail::AttentionProblem& p = *t.problem;
  step::PackTransposed(p.q, 0, 0, t.i0, t.br, t.d, t.br, p.scale, t.q_t);
}

void Scores(const StepTile& t) {
  const detail::AttentionProblem& p = *t.problem;
  PanelGemm<kTileVectors>(t.bc, t.d, p.k.row(0, 0, t.j0), static_cast<size_t>(p.k.row_stride), 1, t.q_t, t.br,
                          t.scores, t.br, false);
}

void MaskCausal(const StepTile& t) {
  for (size_t j = 0; j < t.bc; ++j)
    step::ScoresToLogits(*t.problem, {0, 0, t.i0, t.j0 + static_cast<int64_t>(j), 1, 0}, t.scores + j * t.br, t.br,
                         t.br, true);
}

bool Softmax(const StepTile& t) {
  return step::SoftmaxColumnsUpdate(t.scores, t.bc, t.br, t.running_max, t.row_sum, t.correction, t.nan_seen);
}

void Rescale(const StepTile& t) { step::RescaleColumns(t.out_t, t.d, t.br, t.correction); }

void Accumulate(const StepTile& t) {
  const detail::AttentionProblem& p = *t.problem;
  PanelGemm<kTileVectors>(t.d, t.bc, p.v.row(0, 0, t.j0), 1, static_cast<size_t>(p.v.row_stride), t.scores, t.br,
                          t.out_t, t.br, true);
}

void Finish(const StepTile& t) {
  const detail::AttentionProblem& p = *t.problem;
  step::FinishColumns(t.running_max, t.row_sum, t.nan_seen, t.br, t.inverse, t.lse);
  step::UnpackTransposed(t.out_t, t.br, t.br, t.d, t.inverse, p.output, 0, 0, t.i0);
  std::copy_n(t.lse, t.br, p.lse + t.i0);
  std::copy_n(t.running_max, t.br, p.row_max + t.i0);
  std::copy_n(t.row_sum, t.br, p.row_sum + t.i0);
}

// A fully visible tile as FlashKeyTile runs it: no mask, the rescale only when a max grew.
void FullTile(const StepTile& t) {
  Scores(t);
  if (Softmax(t)) Rescale(t);
  Accumulate(t);
}

// A diagonal tile of a causal call: the band masked line by line, and (as a new tile's max
// usually grows there) the rescale every time.
void DiagonalTile(const StepTile& t) {
  Scores(t);
  MaskCausal(t);
  Softmax(t);
  Rescale(t);
  Accumulate(t);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#include "fma_peak.hpp"
#include "hwy/aligned_allocator.h"
#include "qkv/qkv.hpp"
#include "workloads.hpp"

namespace qkv::bench {

HWY_EXPORT(TileRows);
HWY_EXPORT(PackQ);
HWY_EXPORT(Scores);
HWY_EXPORT(MaskCausal);
HWY_EXPORT(Softmax);
HWY_EXPORT(Rescale);
HWY_EXPORT(Accumulate);
HWY_EXPORT(Finish);
HWY_EXPORT(FullTile);
HWY_EXPORT(DiagonalTile);

namespace {

constexpr size_t kKeyTile = 64;  // flash.cpp's Bc
double g_peak_gflops = 0;        // one thread's FMA peak, measured in main before the benchmarks

// W0's problem, built and bound by the library's builder, and one worker's scratch.
struct StepFixture {
  AttentionInputs inputs;
  detail::BuiltProblem built;
  AttentionResult result;
  hwy::AlignedFreeUniquePtr<float[]> scratch;
  StepTile tile{};

  StepFixture() : inputs(make_attention_inputs(*find_workload("W0"))) {
    const Workload& w0 = *find_workload("W0");
    built = detail::build_problem("step_benchmark", inputs.q, inputs.k, inputs.v,
                                  make_attention_options(w0, Backend::Flash));
    detail::bind_forward_outputs(built, result, false, inputs.q, inputs.k, inputs.v);
    const size_t br = HWY_DYNAMIC_DISPATCH(TileRows)(), d = static_cast<size_t>(w0.head_dim);
    const size_t sizes[] = {d * br, kKeyTile * br, d * br, br, br, br, br, br, br};
    size_t total = 0;
    for (const size_t s : sizes) total += s;
    scratch = hwy::AllocateAligned<float>(total);
    std::fill_n(scratch.get(), total, 0.0f);
    float* at = scratch.get();
    float** parts[] = {&tile.q_t,       &tile.scores,   &tile.out_t,   &tile.running_max, &tile.row_sum,
                       &tile.correction, &tile.nan_seen, &tile.inverse, &tile.lse};
    for (size_t i = 0; i < std::size(parts); ++i) {
      *parts[i] = at;
      at += sizes[i];
    }
    std::fill_n(tile.running_max, br, -std::numeric_limits<float>::infinity());
    // W0's last br queries against its last key tile: on the diagonal, as MaskCausal needs.
    tile.problem = &built.problem;
    tile.br = br;
    tile.d = d;
    tile.bc = kKeyTile;
    tile.i0 = w0.q_len - static_cast<int64_t>(br);
    tile.j0 = (w0.q_len - 1) / static_cast<int64_t>(kKeyTile) * static_cast<int64_t>(kKeyTile);
    HWY_DYNAMIC_DISPATCH(PackQ)(tile);
    HWY_DYNAMIC_DISPATCH(Scores)(tile);
  }
};

StepFixture& fixture() {
  static StepFixture f;
  return f;
}

// FLOPs per iteration as a rate, and as a fraction of `threads` x the one-thread peak.
void set_flops(benchmark::State& state, double flops, int threads = 1) {
  state.counters["GFLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["x_peak"] =
      benchmark::Counter(flops / (g_peak_gflops * 1e9 * threads), benchmark::Counter::kIsIterationInvariantRate);
}

template <class Step>
void BM_Step(benchmark::State& state, Step step, int gemms) {
  const StepTile& t = fixture().tile;
  for (auto _ : state) {
    step(t);
    benchmark::ClobberMemory();
  }
  if (gemms > 0) set_flops(state, 2.0 * gemms * static_cast<double>(t.bc * t.br * t.d));
}

// The tiles and items a flash call over `w` visits (flash.cpp's loops, band only): per head,
// query tiles of br rows, each over the key tiles of 64 up to its last row's last visible key.
struct CallTiles {
  double items = 0, full = 0, diagonal = 0;
};
CallTiles count_tiles(const Workload& w, size_t br) {
  CallTiles c;
  const int64_t tile_rows = static_cast<int64_t>(br), bc = static_cast<int64_t>(kKeyTile);
  for (int64_t i0 = 0; i0 < w.q_len; i0 += tile_rows) {
    const int64_t i_last = std::min(i0 + tile_rows, w.q_len) - 1;
    const int64_t kv_end = w.causal ? i_last + 1 : w.kv_len;
    for (int64_t j0 = 0; j0 < kv_end; j0 += bc) {
      const bool full = !w.causal || std::min(j0 + bc, kv_end) - 1 <= i0;
      (full ? c.full : c.diagonal) += 1;
    }
    c.items += 1;
  }
  const double heads = static_cast<double>(w.batch * w.q_heads);
  return {c.items * heads, c.full * heads, c.diagonal * heads};
}

void BM_Call(benchmark::State& state, const Workload* w) {
  const int threads = static_cast<int>(state.range(0));
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  const AttentionInputs in = make_attention_inputs(*w);
  const AttentionOptions options = make_attention_options(*w, Backend::Flash);
  AttentionResult result;
  scaled_dot_product_attention_into(in.q, in.k, in.v, result, options);
  for (auto _ : state) {
    scaled_dot_product_attention_into(in.q, in.k, in.v, result, options);
    benchmark::ClobberMemory();
  }
  omp_set_num_threads(saved);
  const CallTiles tiles = count_tiles(*w, HWY_DYNAMIC_DISPATCH(TileRows)());
  set_flops(state, forward_flops(*w), threads);
  // Seconds per visited tile (shown with SI prefixes: 3.1u = 3.1 us), and the counts.
  state.counters["time/tile"] = benchmark::Counter(tiles.full + tiles.diagonal,
                                                   benchmark::Counter::kIsIterationInvariantRate |
                                                       benchmark::Counter::kInvert);
  state.counters["full_tiles"] = tiles.full;
  state.counters["diagonal_tiles"] = tiles.diagonal;
  state.counters["items"] = tiles.items;
}

void register_benchmarks() {
  const auto step = [](const char* name, auto function, int gemms) {
    benchmark::RegisterBenchmark(name, [function, gemms](benchmark::State& s) { BM_Step(s, function, gemms); })
        ->Unit(benchmark::kNanosecond);
  };
  step("Step/PackQ", [](const StepTile& t) { HWY_DYNAMIC_DISPATCH(PackQ)(t); }, 0);
  step("Step/Scores", [](const StepTile& t) { HWY_DYNAMIC_DISPATCH(Scores)(t); }, 1);
  step("Step/MaskCausal", [](const StepTile& t) { HWY_DYNAMIC_DISPATCH(MaskCausal)(t); }, 0);
  step("Step/Softmax", [](const StepTile& t) { HWY_DYNAMIC_DISPATCH(Softmax)(t); }, 0);
  step("Step/Rescale", [](const StepTile& t) { HWY_DYNAMIC_DISPATCH(Rescale)(t); }, 0);
  step("Step/Accumulate", [](const StepTile& t) { HWY_DYNAMIC_DISPATCH(Accumulate)(t); }, 1);
  step("Step/Finish", [](const StepTile& t) { HWY_DYNAMIC_DISPATCH(Finish)(t); }, 0);
  step("Tile/Full", [](const StepTile& t) { HWY_DYNAMIC_DISPATCH(FullTile)(t); }, 2);
  step("Tile/Diagonal", [](const StepTile& t) { HWY_DYNAMIC_DISPATCH(DiagonalTile)(t); }, 2);
  for (const char* id : {"W0", "W1"})
    benchmark::RegisterBenchmark((std::string("Call/") + id).c_str(), BM_Call, find_workload(id))
        ->Arg(1)
        ->Arg(2)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
}

}  // namespace
}  // namespace qkv::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const qkv::cli::FmaPeak peak = qkv::cli::measure_fma_peak(5);
  omp_set_num_threads(saved);
  qkv::bench::g_peak_gflops = peak.gflops;
  benchmark::AddCustomContext("fma_peak_1_thread_gflops", std::to_string(peak.gflops));
  benchmark::AddCustomContext("simd_target", peak.target);
  benchmark::AddCustomContext("query_tile_rows", std::to_string(HWY_DYNAMIC_DISPATCH(qkv::bench::TileRows)()));
  qkv::bench::register_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
#endif  // HWY_ONCE
