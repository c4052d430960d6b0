// rows_gemm (gemm/rows.hpp): y = x W^T for few rows of x, W read in its stored dtype and widened
// in registers. Two kernels, one per layout of W:
//   (n, k)  each output a dot product of an x row with a W row: a tile of R rows x O outputs of
//           vector accumulators over k, summed across lanes once at the end;
//   (k, n)  each W row scaled by x[r, i] and added into R x O vectors of outputs: a tile of
//           O x lanes consecutive outputs, W rows streamed once down k.
// Tiles per target: with 32 vector registers (AVX-512) one row takes 8 W vectors at a time
// (8 accumulators hide the FMA latency; decode is one row), 2 rows 6, 3-4 rows 4; with 16
// registers 6, 4, 3 and 3, so accumulators + W vectors + x fit without spills.
//
// Highway's foreach_target re-includes this file once per SIMD target; the threading and the
// exported entry point live in the HWY_ONCE part below.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "gemm/rows.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "gemm/register_tile-inl.h"
#include "hwy/highway.h"
#include "simd/kv_load-inl.h"

#ifndef QKV_GEMM_ROWS_ONCE
#define QKV_GEMM_ROWS_ONCE
#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gemm/layout.hpp"
#include "gemm/rows.hpp"
#include "qkv/error.hpp"
#include "simd/item_shares.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace rows {
namespace hn = hwy::HWY_NAMESPACE;
using kv::ToFloat;
using tile_gemm::BroadcastSteps;
using tile_gemm::DF;
using tile_gemm::DotStep;
using tile_gemm::LoadConsecutive;
using tile_gemm::VF;
using tile_gemm::ZeroTile;

// W vectors a tile of R rows takes at a time.
template <size_t R>
constexpr size_t Outputs() {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  return R == 1 ? 8 : R == 2 ? 6 : 4;
#else
  return R == 1 ? 6 : R == 2 ? 4 : 3;
#endif
}

size_t Lanes() { return hn::Lanes(DF()); }

// ---- W as (n, k): outputs are dot products of rows ----

// y[r * ldy + o] = sum_i x[r * k + i] w[o * k + i] for r < R, o < O.
template <class T, size_t R, size_t O>
HWY_NOINLINE void DotTile(const float* HWY_RESTRICT x, size_t k, const T* HWY_RESTRICT w, float* HWY_RESTRICT y,
                          size_t ldy) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF acc[R][O];
  ZeroTile(acc);
  size_t i = 0;
  for (; i + lanes <= k; i += lanes) DotStep(x + i, k, w + i, k, acc);
  for (size_t r = 0; r < R; ++r) {
    for (size_t o = 0; o < O; ++o) {
      float sum = hn::GetLane(hn::SumOfLanes(df, acc[r][o]));
      for (size_t t = i; t < k; ++t) sum += x[r * k + t] * ToFloat(w[o * k + t]);  // k % lanes terms
      y[r * ldy + o] = sum;
    }
  }
}

#if HWY_TARGET != HWY_SCALAR
// bfloat16 W two elements at a time: a u32 lane holds elements 2m (low half) and 2m + 1 (high
// half), which become floats by a shift and a mask; no shuffle (PromoteTo's vpmovzxwd), which
// bounded the widening at one vector a cycle. x comes split the same way (SplitPairs): per step
// of 2 x lanes elements, the even ones, then the odd ones.
using DU = hn::RebindToUnsigned<DF>;

HWY_INLINE void Pairs(const hwy::bfloat16_t* HWY_RESTRICT p, VF& even, VF& odd) {
  const DU du;
  const auto bits = hn::LoadU(du, reinterpret_cast<const uint32_t*>(p));
  even = hn::BitCast(DF(), hn::ShiftLeft<16>(bits));
  odd = hn::BitCast(DF(), hn::And(bits, hn::Set(du, 0xffff0000u)));
}

// x's R rows (k apart) split for the pair kernels into out (rows `steps` x 2 x lanes apart).
inline void SplitPairs(const float* x, size_t rows, size_t k, size_t steps, float* out) {
  const size_t lanes = hn::Lanes(DF());
  for (size_t r = 0; r < rows; ++r)
    for (size_t s = 0; s < steps; ++s)
      for (size_t m = 0; m < lanes; ++m) {
        out[(r * steps + s) * 2 * lanes + m] = x[r * k + s * 2 * lanes + 2 * m];
        out[(r * steps + s) * 2 * lanes + lanes + m] = x[r * k + s * 2 * lanes + 2 * m + 1];
      }
}

// DotTile on bfloat16 W by pairs: xs is x split (SplitPairs, `steps` steps a row); the k - steps x
// 2 x lanes last terms come from x itself.
template <size_t R, size_t O>
HWY_NOINLINE void DotTilePairs(const float* HWY_RESTRICT xs, size_t steps, const float* HWY_RESTRICT x, size_t k,
                               const hwy::bfloat16_t* HWY_RESTRICT w, float* HWY_RESTRICT y, size_t ldy) {
  const DF df;
  const size_t lanes = hn::Lanes(df), step = 2 * lanes;
  VF acc[R][O];
  ZeroTile(acc);
  for (size_t s = 0; s < steps; ++s) {
    VF we[O], wo[O];
    HWY_UNROLL(16)
    for (size_t o = 0; o < O; ++o) Pairs(w + o * k + s * step, we[o], wo[o]);
    HWY_UNROLL(16)
    for (size_t r = 0; r < R; ++r) {
      const VF xe = hn::LoadU(df, xs + (r * steps + s) * step), xo = hn::LoadU(df, xs + (r * steps + s) * step + lanes);
      HWY_UNROLL(16)
      for (size_t o = 0; o < O; ++o) acc[r][o] = hn::MulAdd(xo, wo[o], hn::MulAdd(xe, we[o], acc[r][o]));
    }
  }
  for (size_t r = 0; r < R; ++r) {
    for (size_t o = 0; o < O; ++o) {
      float sum = hn::GetLane(hn::SumOfLanes(df, acc[r][o]));
      for (size_t t = steps * step; t < k; ++t) sum += x[r * k + t] * ToFloat(w[o * k + t]);
      y[r * ldy + o] = sum;
    }
  }
}

// AxpyTile on bfloat16 W by pairs: O loads of 2 x lanes columns, each two vectors (even and odd
// columns) of accumulators, put back in column order once at the end.
template <size_t R, size_t O>
HWY_NOINLINE void AxpyTilePairs(const float* HWY_RESTRICT x, size_t k, const hwy::bfloat16_t* HWY_RESTRICT w,
                                size_t ldw, float* HWY_RESTRICT y, size_t ldy) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF acc[R][2 * O];  // acc[r][2 o]: the even columns of load o, acc[r][2 o + 1] the odd ones
  ZeroTile(acc);
  const auto load_pairs = [&](size_t i, VF(&b)[2 * O]) {
    HWY_UNROLL(16)
    for (size_t o = 0; o < O; ++o) Pairs(w + i * ldw + o * 2 * lanes, b[2 * o], b[2 * o + 1]);
  };
  BroadcastSteps(k, x, k, 1, load_pairs, acc);
  HWY_ALIGN float e[hn::MaxLanes(DF())], od[hn::MaxLanes(DF())];
  for (size_t r = 0; r < R; ++r)
    for (size_t o = 0; o < O; ++o) {
      hn::Store(acc[r][2 * o], df, e);
      hn::Store(acc[r][2 * o + 1], df, od);
      float* out = y + r * ldy + o * 2 * lanes;
      for (size_t m = 0; m < lanes; ++m) out[2 * m] = e[m], out[2 * m + 1] = od[m];
    }
}

template <size_t R>
constexpr size_t PairOutputs() {
  return Outputs<R>() / 2 > 0 ? Outputs<R>() / 2 : 1;
}
#endif  // HWY_TARGET != HWY_SCALAR

// Outputs [o, o + count) (count < O) as one tile of `count` W rows.
template <class T, size_t R, size_t O>
void DotTail(const float* x, size_t k, const T* w, float* y, size_t ldy, size_t o, size_t count) {
  if constexpr (O > 1) {
    if (count == O - 1) return DotTile<T, R, O - 1>(x, k, w + o * k, y + o, ldy);
    DotTail<T, R, O - 1>(x, k, w, y, ldy, o, count);
  }
}

// Outputs [begin, end) of R rows.
template <class T, size_t R>
void DotRange(const float* x, size_t k, const T* w, float* y, size_t n, size_t begin, size_t end) {
  constexpr size_t O = Outputs<R>();
  size_t o = begin;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (std::is_same_v<T, hwy::bfloat16_t>) {
    const size_t lanes = Lanes(), steps = k / (2 * lanes);
    thread_local std::vector<float> split;
    split.resize(R * steps * 2 * lanes);
    SplitPairs(x, R, k, steps, split.data());
    for (; o + O <= end; o += O) DotTilePairs<R, O>(split.data(), steps, x, k, w + o * k, y + o, n);
  }
#endif
  for (; o + O <= end; o += O) DotTile<T, R, O>(x, k, w + o * k, y + o, n);
  if (o < end) DotTail<T, R, O>(x, k, w, y, n, o, end - o);
}

// ---- W as (k, n): outputs are sums of scaled W rows ----

// y[r * ldy + j] = sum_i x[r * k + i] w[i * ldw + j] for r < R, j < O lanes.
template <class T, size_t R, size_t O>
HWY_NOINLINE void AxpyTile(const float* HWY_RESTRICT x, size_t k, const T* HWY_RESTRICT w, size_t ldw,
                           float* HWY_RESTRICT y, size_t ldy) {
  VF acc[R][O];
  ZeroTile(acc);
  BroadcastSteps(k, x, k, 1, [&](size_t i, VF(&wv)[O]) { LoadConsecutive(w + i * ldw, wv); }, acc);
  tile_gemm::StoreTile(acc, y, ldy);
}

// Whole vectors of outputs [j, j + count * lanes) (count < O) as one tile.
template <class T, size_t R, size_t O>
void AxpyTail(const float* x, size_t k, const T* w, float* y, size_t n, size_t j, size_t count) {
  if constexpr (O > 1) {
    if (count == O - 1) return AxpyTile<T, R, O - 1>(x, k, w + j, n, y + j, n);
    AxpyTail<T, R, O - 1>(x, k, w, y, n, j, count);
  }
}

// Outputs [begin, end) of R rows: tiles of O vectors, then whole vectors, then the last
// n % lanes outputs one by one (down the strided column of W).
template <class T, size_t R>
void AxpyRange(const float* x, size_t k, const T* w, float* y, size_t n, size_t begin, size_t end) {
  constexpr size_t O = Outputs<R>();
  const size_t lanes = Lanes(), width = O * lanes;
  size_t j = begin;
#if HWY_TARGET != HWY_SCALAR
  if constexpr (std::is_same_v<T, hwy::bfloat16_t>) {
    constexpr size_t P = PairOutputs<R>();
    for (; j + P * 2 * lanes <= end; j += P * 2 * lanes) AxpyTilePairs<R, P>(x, k, w + j, n, y + j, n);
  }
#endif
  for (; j + width <= end; j += width) AxpyTile<T, R, O>(x, k, w + j, n, y + j, n);
  if (const size_t vectors = (end - j) / lanes; vectors > 0) {
    AxpyTail<T, R, O>(x, k, w, y, n, j, vectors);
    j += vectors * lanes;
  }
  for (; j < end; ++j) {
    for (size_t r = 0; r < R; ++r) {
      float sum = 0;
      for (size_t i = 0; i < k; ++i) sum += x[r * k + i] * ToFloat(w[i * n + j]);
      y[r * n + j] = sum;
    }
  }
}

// ---- entry ----

template <class T, size_t R>
void RangeOf(const float* x, size_t k, const void* w, bool in_out, float* y, size_t n, size_t begin, size_t end) {
  const T* wt = static_cast<const T*>(w);
  if (in_out) {
    AxpyRange<T, R>(x, k, wt, y, n, begin, end);
  } else {
    DotRange<T, R>(x, k, wt, y, n, begin, end);
  }
}

template <class T>
void RowsOf(const float* x, size_t rows, size_t k, const void* w, bool in_out, float* y, size_t n, size_t begin,
            size_t end) {
  for (size_t r = 0; r < rows; r += 4) {
    const float* xr = x + r * k;
    float* yr = y + r * n;
    switch (std::min<size_t>(4, rows - r)) {
      case 1: RangeOf<T, 1>(xr, k, w, in_out, yr, n, begin, end); break;
      case 2: RangeOf<T, 2>(xr, k, w, in_out, yr, n, begin, end); break;
      case 3: RangeOf<T, 3>(xr, k, w, in_out, yr, n, begin, end); break;
      default: RangeOf<T, 4>(xr, k, w, in_out, yr, n, begin, end); break;
    }
  }
}

}  // namespace rows

// Outputs [begin, end) of every row; type 0 float32, 1 bfloat16, 2 float16.
void RowsBlock(const float* x, size_t rows, size_t k, const void* w, int type, bool in_out, float* y, size_t n,
               size_t begin, size_t end) {
  switch (type) {
    case 0: return rows::RowsOf<float>(x, rows, k, w, in_out, y, n, begin, end);
    case 1: return rows::RowsOf<hwy::bfloat16_t>(x, rows, k, w, in_out, y, n, begin, end);
    default: return rows::RowsOf<hwy::float16_t>(x, rows, k, w, in_out, y, n, begin, end);
  }
}

// The outputs one tile of a row covers: a block of work is a multiple of it.
size_t RowsTileOutputs(bool in_out) { return in_out ? rows::Outputs<1>() * rows::Lanes() : rows::Outputs<1>(); }

}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::detail {

HWY_EXPORT(RowsBlock);
HWY_EXPORT(RowsTileOutputs);

bool rows_gemm_threads(int64_t rows, int64_t n, int64_t k) {
  // Multiply-adds. Decode is bound by reading W, which one thread does not saturate: on an idle
  // machine every product of a decode step from 2^16 up (SmolLM2-135M's 192 x 576 K/V
  // projections and larger, 128 KiB of bf16 W) reads faster on two threads, the region's start
  // and join included (docs/models.md, "Speed"). Below that the join costs what the second
  // thread saves. On an oversubscribed machine every region waits for a descheduled thread, and
  // no threshold helps.
  constexpr int64_t kMinWorkForThreads = int64_t{1} << 16;
  return std::max<int64_t>(rows, 1) * n * k >= kMinWorkForThreads && omp_get_max_threads() > 1;
}

void rows_gemm(const float* x, int64_t rows, int64_t k, const void* w, DType w_type, bool in_out, int64_t n,
               float* y) {
  if (rows < 0 || k < 0 || n < 0) throw Error("rows_gemm: negative size");
  if (rows == 0 || n == 0) return;
  if (k == 0) {
    std::fill_n(y, rows * n, 0.0f);
    return;
  }
  const int type = w_type == DType::F32 ? 0 : w_type == DType::BF16 ? 1 : w_type == DType::F16 ? 2 : -1;
  if (type < 0) throw Error("rows_gemm: W must be f32, bf16 or f16");
  // Blocks of whole tiles, about 8 per thread: each thread starts on its own contiguous share of
  // W (the same from call to call) and the others help a slow one (ItemShares).
  const bool threaded = rows_gemm_threads(rows, n, k);
  const int workers = threaded ? omp_get_max_threads() : 1;
  const auto tile = static_cast<int64_t>(HWY_DYNAMIC_DISPATCH(RowsTileOutputs)(in_out));
  int64_t block = n;
  if (threaded) {
    block = std::max<int64_t>(tile, layout::tile_block_size(n, int64_t{8} * workers, tile));
  }
  const int64_t blocks = layout::ceil_div(n, block);
  const auto run = HWY_DYNAMIC_DISPATCH(RowsBlock);
  for_each_item(workers, blocks, [&](int64_t b) {
    run(x, static_cast<size_t>(rows), static_cast<size_t>(k), w, type, in_out, y, static_cast<size_t>(n),
        static_cast<size_t>(b * block), static_cast<size_t>(std::min(n, (b + 1) * block)));
  });
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
