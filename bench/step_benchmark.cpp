// Where a flash forward's time goes: each step of the pipeline (src/attention/steps/pipeline-inl.h,
// gemm/micro_kernel-inl.h) timed in isolation on one work item's tile, on one thread, beside the same
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
//   Step/MaskCausal   the band on a diagonal tile (TileLogits)      (causal tiles only)
//   Step/Softmax      online softmax update: max, exp, sum          (every tile)
//   Step/Rescale      Ot times the correction                       (tiles where a max grew)
//   Step/Accumulate   Ot += V^T P^T, the micro-GEMM                 (2 Bc Br d FLOPs)
//   Step/Finish       1/l, lse, row stats and O = Ot^T / l written  (once per work item)
//   Tile/Full         Scores + Softmax + Accumulate, a fully visible tile
//   Tile/Diagonal     Scores + MaskCausal + Softmax + Rescale + Accumulate
//   Call/W0, Call/W1  the whole scaled_dot_product_attention (Backend::Flash); counters give
//                     the call's time per visited tile and the tile and item counts
// The backward's steps (flash/backward.cpp's BackwardPair), on one W1 pair: Br queries (96) x
// Bc = 64 keys, d = 64, head 0 of W1's problem; each product is 2 Bc Br d FLOPs:
//   Bwd/ScoresT       S^T = K Qt, the micro-GEMM (Bc x Br, depth d)
//   Bwd/Weights       P = exp(S - shift) * scale from the row stats
//   Bwd/GradV         dV += P^T dO (Bc x d, depth Br)
//   Bwd/GradPT        dP^T = V dOt (Bc x Br, depth d)
//   Bwd/SoftmaxGrad   dS = P (dP - D)
//   Bwd/GradK         dK += dS^T Q (Bc x d, depth Br)
//   Bwd/GradQ         dQ += dS K (Br x d, depth Bc: A read transposed, K in place)
//   Bwd/Pair          the seven composed as BackwardPair runs a fully visible pair
//   Call/W1-bwd       the whole scaled_dot_product_attention_backward_into (Backend::Flash),
//                     FLOPs 2.5 x the forward's, as qkv bench counts them; time per pair
// And, registered first, a probe of the core: Ceiling/FmaWith/X, 24 FMAs and X other vector ops
// per round (the softmax's kinds), x_peak beside if_shared = 24 / (24 + X): the share of the X = 0
// row's rate the FMAs keep if the other ops take their pipes' slots.
// Counters: GFLOP/s and x_peak (over the one-thread FMA peak measured before the benchmarks;
// Call rows: over the peak times the threads they ran on). Both are rate counters, which Google
// Benchmark prints with "/s": x_peak=0.83/s reads 0.83 of the peak.
// Softmax and Rescale run on the same buffer every iteration: Highway's Exp, Max and Mul cost the
// same whatever the values, so the timing does not depend on them.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "step_benchmark.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/steps/pipeline-inl.h"
#include "hwy/highway.h"

#ifndef QKV_STEP_BENCHMARK_ONCE
#define QKV_STEP_BENCHMARK_ONCE
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attention/problem.hpp"

namespace qkv::bench {

// One worker's scratch for one work item, as flash/forward.cpp lays it out, and where in W0 it sits.
struct StepTile {
  const detail::AttentionProblem* problem;  // W0's, causal
  size_t br, d, bc;
  int64_t i0, j0;  // the query tile and key tile (i0 < j0 + bc: on the diagonal)
  float *q_t, *scores, *out_t, *running_max, *row_sum, *correction, *inverse, *lse;
};

// One backward worker's scratch for one (query tile, key tile) pair, as flash/backward.cpp lays
// it out (d_pad = d for d = 64), and W1's K and V read in place. The kernel reads a whole query
// tile's Q and dO rows in place too: q_rows and grad_out_rows stand for them (rows d apart, as
// W1's are).
struct BackwardTile {
  const detail::AttentionProblem* problem;  // W1's
  size_t br, d, bc;
  float *q_t, *grad_out_t, *q_rows, *grad_out_rows, *weights_t, *grad_t, *grad_k, *grad_v, *grad_q, *shift, *scale,
      *row_dot;
};

// Ceiling/FmaWith's register chains (FmaWithOthersOf, below).
constexpr int kFmaChains = 24, kOtherChains = 5;

}  // namespace qkv::bench
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::bench {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace step = detail::HWY_NAMESPACE::pipeline;
using detail::HWY_NAMESPACE::tile_gemm::Gemm;
using detail::HWY_NAMESPACE::tile_gemm::kTileVectors;
using detail::HWY_NAMESPACE::tile_gemm::PanelGemm;

size_t TileRows() { return kTileVectors * hn::Lanes(hn::ScalableTag<float>()); }
// flash/backward.cpp's Br (BackwardQueryTileRows): about 96, whole micro-tile widths.
size_t BackwardTileRows() { return std::max<size_t>(1, 96 / TileRows()) * TileRows(); }

void PackQ(const StepTile& t) {
  const detail::AttentionProblem& p = *t.problem;
  step::PackTransposed(p.q, 0, 0, t.i0, t.br, t.d, t.br, p.scale, t.q_t);
}

void Scores(const StepTile& t) {
  const detail::AttentionProblem& p = *t.problem;
  PanelGemm<kTileVectors, true>(t.bc, t.d, p.k.row(0, 0, t.j0), static_cast<size_t>(p.k.row_stride), 1, t.q_t,
                                t.br, t.scores, t.br, false);
}

void MaskCausal(const StepTile& t) {
  step::TileLogits(*t.problem, {1, 1, false}, {true, -1}, 0, 0, t.i0, t.br, t.j0, t.bc, t.br, t.scores);
}

bool Softmax(const StepTile& t) {
  return step::SoftmaxColumnsUpdate<kTileVectors>(t.scores, t.bc, t.running_max, t.row_sum, t.correction);
}

void Rescale(const StepTile& t) { step::RescaleColumns(t.out_t, t.d, t.br, t.correction); }

void Accumulate(const StepTile& t) {
  const detail::AttentionProblem& p = *t.problem;
  PanelGemm<kTileVectors, true>(t.d, t.bc, p.v.row(0, 0, t.j0), 1, static_cast<size_t>(p.v.row_stride), t.scores,
                                t.br, t.out_t, t.br, true);
}

void Finish(const StepTile& t) {
  const detail::AttentionProblem& p = *t.problem;
  step::FinishColumns(t.running_max, t.row_sum, t.br, t.inverse, t.lse);
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

// A diagonal tile of a causal call: the band masked (TileLogits), and (as a new tile's max
// usually grows there) the rescale every time.
void DiagonalTile(const StepTile& t) {
  Scores(t);
  MaskCausal(t);
  Softmax(t);
  Rescale(t);
  Accumulate(t);
}

// The backward's steps, each as BackwardPair calls it on a fully visible pair.
void BackwardScoresT(const BackwardTile& t) {
  const detail::AttentionProblem& p = *t.problem;
  Gemm(t.bc, t.br, t.d, p.k.row(0, 0, 0), static_cast<size_t>(p.k.row_stride), 1, t.q_t, t.br, t.weights_t, t.br,
       false);
}
void BackwardWeights(const BackwardTile& t) { step::RecomputeWeights(t.weights_t, t.bc, t.br, t.shift, t.scale); }
void BackwardGradV(const BackwardTile& t) {
  Gemm(t.bc, t.d, t.br, t.weights_t, t.br, 1, t.grad_out_rows, t.d, t.grad_v, t.d, true);
}
void BackwardGradPT(const BackwardTile& t) {
  const detail::AttentionProblem& p = *t.problem;
  Gemm(t.bc, t.br, t.d, p.v.row(0, 0, 0), static_cast<size_t>(p.v.row_stride), 1, t.grad_out_t, t.br, t.grad_t, t.br,
       false);
}
void BackwardSoftmaxGrad(const BackwardTile& t) {
  step::SoftmaxGradient(t.weights_t, t.grad_t, t.bc, t.br, t.row_dot, nullptr);
}
void BackwardGradK(const BackwardTile& t) {
  Gemm(t.bc, t.d, t.br, t.grad_t, t.br, 1, t.q_rows, t.d, t.grad_k, t.d, true);
}
void BackwardGradQ(const BackwardTile& t) {
  const detail::AttentionProblem& p = *t.problem;
  Gemm(t.br, t.d, t.bc, t.grad_t, 1, t.br, p.k.row(0, 0, 0), static_cast<size_t>(p.k.row_stride), t.grad_q, t.d,
       true);
}
void BackwardPair(const BackwardTile& t) {
  BackwardScoresT(t);
  BackwardWeights(t);
  BackwardGradV(t);
  BackwardGradPT(t);
  BackwardSoftmaxGrad(t);
  BackwardGradK(t);
  BackwardGradQ(t);
}

// Ceiling/FmaWith: whether the pipeline's other vector ops take the FMA pipes' slots. Each round
// runs kFmaChains independent FMA chains and `kOthers` single-op instructions of the softmax's
// kinds (Max, Sub, Add, in turn) on kOtherChains chains of their own, all in registers (24 + 5
// chains + 2 constants = 31 of AVX-512's 32; the 16-register targets spill and read low). Where
// those ops issue to the FMA pipes (512-bit arithmetic on Intel's server cores: two ports), the
// FMAs' rate falls to kFmaChains / (kFmaChains + kOthers) of the rate alone (X = 0); where other
// pipes take them, it stays near it. `seed` comes from the caller at run time, so that the
// compiler cannot fold a chain whose values it could work out (x + 1e-7 is x for x >= 2).
template <int kOthers>
float FmaWithOthersOf(int64_t rounds, float seed) {
  const hn::ScalableTag<float> df;
  using V = hn::Vec<decltype(df)>;
  const V m = hn::Set(df, 0.999999f), a = hn::Set(df, 1e-7f);
  V fma[kFmaChains], other[kOtherChains];
  for (int c = 0; c < kFmaChains; ++c) fma[c] = hn::Set(df, seed * static_cast<float>(c));
  for (int c = 0; c < kOtherChains; ++c) other[c] = hn::Set(df, seed + static_cast<float>(c));
  for (int64_t i = 0; i < rounds; ++i) {
    HWY_UNROLL(24)
    for (int c = 0; c < kFmaChains; ++c) fma[c] = hn::MulAdd(fma[c], m, a);
    HWY_UNROLL(6)
    for (int x = 0; x < kOthers; ++x) {
      V& o = other[x % kOtherChains];
      o = x % 3 == 0 ? hn::Max(o, a) : x % 3 == 1 ? hn::Sub(o, a) : hn::Add(o, a);
    }
  }
  for (int c = 1; c < kFmaChains; ++c) fma[0] = hn::Add(fma[0], fma[c]);
  for (int c = 0; c < kOtherChains; ++c) fma[0] = hn::Add(fma[0], other[c]);
  return hn::GetLane(hn::SumOfLanes(df, fma[0]));
}
float FmaWithOthers(int64_t rounds, int others, float seed) {
  switch (others) {
    case 0: return FmaWithOthersOf<0>(rounds, seed);
    case 3: return FmaWithOthersOf<3>(rounds, seed);
    case 6: return FmaWithOthersOf<6>(rounds, seed);
    default: HWY_ABORT("FmaWithOthers: %d other ops per round; 0, 3 or 6 are built", others);
  }
}
size_t FloatLanes() { return hn::Lanes(hn::ScalableTag<float>()); }

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::bench
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>

#include "attention/flash/layout.hpp"
#include "fma_peak.hpp"
#include "hwy/aligned_allocator.h"
#include "qkv/qkv.hpp"
#include "workloads.hpp"

namespace qkv::bench {

HWY_EXPORT(TileRows);
// From this namespace: HWY_DYNAMIC_DISPATCH of a qualified name does not compile when a single
// SIMD target is built (-march=native: Highway then dispatches statically).
size_t tile_rows() { return HWY_DYNAMIC_DISPATCH(TileRows)(); }
HWY_EXPORT(PackQ);
HWY_EXPORT(Scores);
HWY_EXPORT(MaskCausal);
HWY_EXPORT(Softmax);
HWY_EXPORT(Rescale);
HWY_EXPORT(Accumulate);
HWY_EXPORT(Finish);
HWY_EXPORT(FullTile);
HWY_EXPORT(DiagonalTile);
HWY_EXPORT(BackwardTileRows);
HWY_EXPORT(BackwardScoresT);
HWY_EXPORT(BackwardWeights);
HWY_EXPORT(BackwardGradV);
HWY_EXPORT(BackwardGradPT);
HWY_EXPORT(BackwardSoftmaxGrad);
HWY_EXPORT(BackwardGradK);
HWY_EXPORT(BackwardGradQ);
HWY_EXPORT(BackwardPair);
HWY_EXPORT(FmaWithOthers);
HWY_EXPORT(FloatLanes);

namespace {

using qkv::detail::flash::kKeyTile;  // the flash kernels' Bc
double g_peak_gflops = 0;        // one thread's FMA peak, measured in main before the benchmarks

// A workload's problem, built and bound by the library's builder as a Flash call binds it.
struct BoundWorkload {
  AttentionInputs inputs;
  detail::BuiltProblem built;
  AttentionResult result;

  explicit BoundWorkload(const Workload& w) : inputs(make_attention_inputs(w)) {
    built = detail::build_problem("step_benchmark", inputs.q, inputs.k, inputs.v,
                                  make_attention_options(w, Backend::Flash));
    detail::bind_forward_outputs(built, result, false, inputs.q, inputs.k, inputs.v);
  }
};

// One aligned block cut into parts[i] of sizes[i] floats, one after the other; its total size.
template <size_t N>
std::pair<hwy::AlignedFreeUniquePtr<float[]>, size_t> carve_scratch(float** const (&parts)[N],
                                                                    const size_t (&sizes)[N]) {
  size_t total = 0;
  for (const size_t s : sizes) total += s;
  auto block = hwy::AllocateAligned<float>(total);
  float* at = block.get();
  for (size_t i = 0; i < N; ++i) {
    *parts[i] = at;
    at += sizes[i];
  }
  return {std::move(block), total};
}

// W0's problem and one worker's scratch.
struct StepFixture {
  const Workload& w0 = *find_workload("W0");
  BoundWorkload bound{w0};
  hwy::AlignedFreeUniquePtr<float[]> scratch;
  StepTile tile{};

  StepFixture() {
    const size_t br = HWY_DYNAMIC_DISPATCH(TileRows)(), d = static_cast<size_t>(w0.head_dim);
    auto [block, total] = carve_scratch({&tile.q_t, &tile.scores, &tile.out_t, &tile.running_max, &tile.row_sum,
                                         &tile.correction, &tile.inverse, &tile.lse},
                                        {d * br, kKeyTile * br, d * br, br, br, br, br, br});
    scratch = std::move(block);
    std::fill_n(scratch.get(), total, 0.0f);
    std::fill_n(tile.running_max, br, -std::numeric_limits<float>::infinity());
    // W0's last br queries against its last key tile: on the diagonal, as MaskCausal needs.
    tile.problem = &bound.built.problem;
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

// W1's problem and one backward worker's scratch for a pair, its inputs filled with values of
// the sizes a call sees (|x| <= 1), the row stats chosen so that P = exp(S - 2) / 2 stays small
// when the weights step runs again on its own output, and D = 0.5 so that dS = P (dP - D)
// iterated on its own output settles at a normal float, not a subnormal.
struct BackwardFixture {
  const Workload& w1 = *find_workload("W1");
  BoundWorkload bound{w1};
  hwy::AlignedFreeUniquePtr<float[]> scratch;
  BackwardTile tile{};

  BackwardFixture() {
    const size_t br = HWY_DYNAMIC_DISPATCH(BackwardTileRows)(), d = static_cast<size_t>(w1.head_dim);
    auto [block, total] = carve_scratch(
        {&tile.q_t, &tile.grad_out_t, &tile.q_rows, &tile.grad_out_rows, &tile.weights_t, &tile.grad_t, &tile.grad_k,
         &tile.grad_v, &tile.grad_q, &tile.shift, &tile.scale, &tile.row_dot},
        {d * br, d * br, br * d, br * d, kKeyTile * br, kKeyTile * br, kKeyTile * d, kKeyTile * d, br * d, br, br, br});
    scratch = std::move(block);
    for (size_t i = 0; i < total; ++i) scratch[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
    std::fill_n(tile.shift, br, 2.0f);
    std::fill_n(tile.scale, br, 0.5f);
    std::fill_n(tile.row_dot, br, 0.5f);
    tile.problem = &bound.built.problem;
    tile.br = br;
    tile.d = d;
    tile.bc = kKeyTile;
    HWY_DYNAMIC_DISPATCH(BackwardPair)(tile);
  }
};

BackwardFixture& backward_fixture() {
  static BackwardFixture f;
  return f;
}

// FLOPs per iteration as a rate, and as a fraction of `threads` x the one-thread peak.
void set_flops(benchmark::State& state, double flops, int threads = 1) {
  state.counters["GFLOP/s"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["x_peak"] =
      benchmark::Counter(flops / (g_peak_gflops * 1e9 * threads), benchmark::Counter::kIsIterationInvariantRate);
}

// One step, or a composition of steps, on a fixture's tile (StepTile or BackwardTile); `gemms`
// micro-GEMMs of 2 Bc Br d FLOPs each.
template <class Tile, class Step>
void BM_Step(benchmark::State& state, const Tile& t, Step step, int gemms) {
  for (auto _ : state) {
    step(t);
    benchmark::ClobberMemory();
  }
  if (gemms > 0) set_flops(state, 2.0 * gemms * static_cast<double>(t.bc * t.br * t.d));
}

// The tiles and items a flash call over `w` visits (flash/forward.cpp's loops, band only): per head,
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

// The whole flash backward of `w`, steady state (into the same gradients), as qkv bench times it.
void BM_BackwardCall(benchmark::State& state, const Workload* w) {
  const int threads = static_cast<int>(state.range(0));
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  const AttentionInputs in = make_attention_inputs(*w);
  const AttentionOptions options = make_attention_options(*w, Backend::Flash);
  const BackwardInputs bwd = make_backward_inputs(*w, in, options);
  AttentionGrads grads;
  scaled_dot_product_attention_backward_into(bwd.grad_output, in.q, in.k, in.v, bwd.forward, grads, options);
  for (auto _ : state) {
    scaled_dot_product_attention_backward_into(bwd.grad_output, in.q, in.k, in.v, bwd.forward, grads, options);
    benchmark::ClobberMemory();
  }
  omp_set_num_threads(saved);
  // Pairs of (query tile, key tile) a non-causal call runs: every query tile against every key tile.
  const double br = static_cast<double>(HWY_DYNAMIC_DISPATCH(BackwardTileRows)());
  const double pairs = static_cast<double>(w->batch * w->q_heads) * std::ceil(static_cast<double>(w->q_len) / br) *
                       std::ceil(static_cast<double>(w->kv_len) / kKeyTile);
  set_flops(state, backward_flops(*w), threads);
  state.counters["time/pair"] =
      benchmark::Counter(pairs, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["pairs"] = pairs;
}

// kFmaChains FMAs and `others` other vector ops per round (Arg: 0, 3 or 6), on one thread.
void BM_FmaWith(benchmark::State& state) {
  constexpr int64_t kRounds = 10000;
  const int others = static_cast<int>(state.range(0));
  const float seed = 0.5f + static_cast<float>(others) * 1e-3f;  // known only at run time
  for (auto _ : state) {
    float sum = HWY_DYNAMIC_DISPATCH(FmaWithOthers)(kRounds, others, seed);
    benchmark::DoNotOptimize(sum);
  }
  set_flops(state, 2.0 * kFmaChains * static_cast<double>(HWY_DYNAMIC_DISPATCH(FloatLanes)()) * kRounds);
  state.counters["if_shared"] = static_cast<double>(kFmaChains) / (kFmaChains + others);
}

void register_benchmarks() {
  benchmark::RegisterBenchmark("Ceiling/FmaWith", BM_FmaWith)->Arg(0)->Arg(3)->Arg(6)->Unit(benchmark::kMicrosecond);
  const auto step = [](const char* name, auto function, int gemms) {
    benchmark::RegisterBenchmark(name, [function, gemms](benchmark::State& s) {
      BM_Step(s, fixture().tile, function, gemms);
    })->Unit(benchmark::kNanosecond);
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
  const auto backward = [](const char* name, auto function, int gemms) {
    benchmark::RegisterBenchmark(name, [function, gemms](benchmark::State& s) {
      BM_Step(s, backward_fixture().tile, function, gemms);
    })->Unit(benchmark::kNanosecond);
  };
  backward("Bwd/ScoresT", [](const BackwardTile& t) { HWY_DYNAMIC_DISPATCH(BackwardScoresT)(t); }, 1);
  backward("Bwd/Weights", [](const BackwardTile& t) { HWY_DYNAMIC_DISPATCH(BackwardWeights)(t); }, 0);
  backward("Bwd/GradV", [](const BackwardTile& t) { HWY_DYNAMIC_DISPATCH(BackwardGradV)(t); }, 1);
  backward("Bwd/GradPT", [](const BackwardTile& t) { HWY_DYNAMIC_DISPATCH(BackwardGradPT)(t); }, 1);
  backward("Bwd/SoftmaxGrad", [](const BackwardTile& t) { HWY_DYNAMIC_DISPATCH(BackwardSoftmaxGrad)(t); }, 0);
  backward("Bwd/GradK", [](const BackwardTile& t) { HWY_DYNAMIC_DISPATCH(BackwardGradK)(t); }, 1);
  backward("Bwd/GradQ", [](const BackwardTile& t) { HWY_DYNAMIC_DISPATCH(BackwardGradQ)(t); }, 1);
  backward("Bwd/Pair", [](const BackwardTile& t) { HWY_DYNAMIC_DISPATCH(BackwardPair)(t); }, 5);
  benchmark::RegisterBenchmark("Call/W1-bwd", BM_BackwardCall, find_workload("W1"))
      ->Arg(1)
      ->Arg(2)
      ->Unit(benchmark::kMillisecond)
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
  benchmark::AddCustomContext("query_tile_rows", std::to_string(qkv::bench::tile_rows()));
  qkv::bench::register_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
#endif  // HWY_ONCE
