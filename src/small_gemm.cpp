// small_rows_gemm (small_gemm.hpp): y = alpha x W^T + beta y as dot products of x rows with W rows, a
// register tile of kRows x kOutputs accumulators at a time (each a vector of partial sums over k,
// reduced once at the end), so W streams through once per kRows rows and is never packed.
//
// Highway's foreach_target re-includes this file once per SIMD target; the threading and the
// exported entry point live in the HWY_ONCE part below.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "small_gemm.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"

#ifndef QKV_NN_SMALL_GEMM_ONCE
#define QKV_NN_SMALL_GEMM_ONCE
#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "small_gemm.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// The tile: kRows x kOutputs accumulators + kOutputs W vectors + 1 x vector must fit the
// register file: 5 x 4 + 5 = 25 of AVX-512's 32; 4 x 3 + 4 = 16 of the 16-register targets
// (W5's 20 rows are 5 tiles of 4; 3 x 3 left 2 rows to 1 x 3 tiles, 3 accumulators that wait on
// the FMA latency: W5 on AVX2 took 0.87-0.89 x the time with 4 x 3, in-process A/B).
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3_ZEN4
constexpr size_t kRows = 5, kOutputs = 4;
constexpr bool kWideTile = true;
#else
constexpr size_t kRows = 4, kOutputs = 3;
constexpr bool kWideTile = false;
#endif

bool WideTile() { return kWideTile; }

// y[r, o] = alpha sum_i x[r, i] w[o, i] + beta y[r, o] for r < R, o < O (y not read when beta is
// 0): x rows ldx apart, w rows ldw apart, k terms.
template <size_t R, size_t O>
HWY_INLINE void Tile(const float* HWY_RESTRICT x, size_t ldx, const float* HWY_RESTRICT w, size_t ldw, size_t k,
                     float alpha, float beta, float* HWY_RESTRICT y, size_t ldy) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF acc[R][O];
  HWY_UNROLL(16)
  for (size_t r = 0; r < R; ++r) {
    HWY_UNROLL(16)
    for (size_t o = 0; o < O; ++o) acc[r][o] = hn::Zero(df);
  }
  size_t i = 0;
  for (; i + lanes <= k; i += lanes) {
    VF wv[O];
    HWY_UNROLL(16)
    for (size_t o = 0; o < O; ++o) wv[o] = hn::LoadU(df, w + o * ldw + i);
    HWY_UNROLL(16)
    for (size_t r = 0; r < R; ++r) {
      const VF xv = hn::LoadU(df, x + r * ldx + i);
      HWY_UNROLL(16)
      for (size_t o = 0; o < O; ++o) acc[r][o] = hn::MulAdd(xv, wv[o], acc[r][o]);
    }
  }
  for (size_t r = 0; r < R; ++r) {
    for (size_t o = 0; o < O; ++o) {
      float sum = hn::GetLane(hn::SumOfLanes(df, acc[r][o]));
      for (size_t j = i; j < k; ++j) sum += x[r * ldx + j] * w[o * ldw + j];  // the last k % lanes
      float& out = y[r * ldy + o];
      out = beta == 0.0f ? alpha * sum : alpha * sum + beta * out;
    }
  }
}

// Outputs [o_begin, o_end) of every row: full tiles, then the rows and outputs left over.
void OutputBlock(const float* HWY_RESTRICT x, size_t ldx, size_t rows, size_t k, const float* HWY_RESTRICT w,
                 size_t ldw, float alpha, float beta, float* HWY_RESTRICT y, size_t ldy, size_t o_begin,
                 size_t o_end) {
  size_t o = o_begin;
  for (; o + kOutputs <= o_end; o += kOutputs) {
    const float* w_o = w + o * ldw;
    size_t r = 0;
    for (; r + kRows <= rows; r += kRows)
      Tile<kRows, kOutputs>(x + r * ldx, ldx, w_o, ldw, k, alpha, beta, y + r * ldy + o, ldy);
    for (; r < rows; ++r) Tile<1, kOutputs>(x + r * ldx, ldx, w_o, ldw, k, alpha, beta, y + r * ldy + o, ldy);
  }
  for (; o < o_end; ++o) {
    const float* w_o = w + o * ldw;
    size_t r = 0;
    for (; r + kRows <= rows; r += kRows)
      Tile<kRows, 1>(x + r * ldx, ldx, w_o, ldw, k, alpha, beta, y + r * ldy + o, ldy);
    for (; r < rows; ++r) Tile<1, 1>(x + r * ldx, ldx, w_o, ldw, k, alpha, beta, y + r * ldy + o, ldy);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::detail {

HWY_EXPORT(OutputBlock);
HWY_EXPORT(WideTile);

bool small_rows_gemm_has_wide_tile() { return HWY_DYNAMIC_DISPATCH(WideTile)(); }

void small_rows_gemm(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* w, int64_t ldw, int64_t n,
                     float alpha, float beta, float* y, int64_t ldy) {
  // Threads take blocks of outputs as they free up (dynamic: one slow thread on a busy machine
  // does not hold the others back); below about a million multiply-adds one thread is faster.
  constexpr int64_t kBlock = 48, kMinWorkForThreads = int64_t{1} << 20;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const bool threaded = rows * n * k >= kMinWorkForThreads && blocks > 1 && omp_get_max_threads() > 1;
#pragma omp parallel for schedule(dynamic, 1) if (threaded)
  for (int64_t block = 0; block < blocks; ++block) {
    HWY_DYNAMIC_DISPATCH(OutputBlock)(x, static_cast<size_t>(ldx), static_cast<size_t>(rows), static_cast<size_t>(k),
                                      w, static_cast<size_t>(ldw), alpha, beta, y, static_cast<size_t>(ldy),
                                      static_cast<size_t>(block * kBlock),
                                      static_cast<size_t>(std::min(n, (block + 1) * kBlock)));
  }
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
