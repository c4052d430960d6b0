// The SIMD building blocks the fused kernels share (flash/forward.cpp, flash/backward.cpp, decode/tiles-inl.h),
// compiled once per Highway target: each kernel's foreach_target pass includes this header
// inside its own per-target code, as Highway's -inl.h convention asks.
//
//   MicroTile / PanelGemm / Gemm   C (+)= A B, "broadcast an element of A, load a row of B", in a
//                                  register tile of PanelRows<V>() x V vectors (the tile and its
//                                  steps: gemm/register_tile-inl.h, shared with small.cpp, rows.cpp)
//   AllFinite                      no NaN and no +-Inf among some floats

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_TILE_GEMM_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_TILE_GEMM_INL_H_
#undef QKV_ATTENTION_TILE_GEMM_INL_H_
#else
#define QKV_ATTENTION_TILE_GEMM_INL_H_
#endif

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "gemm/layout.hpp"
#include "gemm/register_tile-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace tile_gemm {

// Register tile of the micro-GEMM: kTileRows x kTileVectors accumulators plus kTileVectors
// loaded B vectors must fit the register file without spilling, and the FMA:load ratio must
// keep both FMA pipes busy. AVX-512 has 32 vector registers: 8 x 3 = 24 accumulators + 3 B
// loads + 1 broadcast = 28. The 16-register targets use 4 x 3 = 12 + 3 + 1.
constexpr size_t kTileRows = kWideRegisterFile ? 8 : 4;
constexpr size_t kTileVectors = 3;
// The 32-register targets also run 4-vector panels (PanelRows).
constexpr bool kFourVectorPanels = kTileRows >= 8;

// MicroTile's software prefetch (kPrefetchA): floats per 64-byte line, and how many depth steps
// ahead an A whose depth steps are rows apart (V^T) is fetched.
constexpr size_t kLineFloats = 64 / sizeof(float);
constexpr size_t kPrefetchAhead = 16;
// The line `floats` after p into L1. Past a tile's last panel that is the next tile's rows, or
// past the end of the tensor or scratch, which a prefetch may touch: the address is computed as
// an integer.
HWY_INLINE void PrefetchFloatsAhead(const float* p, size_t floats) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + floats * sizeof(float)), 0, 3);
}

// MicroTile's prefetch of step k (kPrefetchA below), a_col = A's step k.
template <size_t R>
HWY_INLINE void PrefetchA(const float* a_col, size_t a_row, size_t a_depth, size_t k) {
  if (a_depth == 1) {
    if (k % kLineFloats == 0) {
      HWY_UNROLL(16)
      for (size_t r = 0; r < R; ++r) PrefetchFloatsAhead(a_col, (R + r) * a_row);
    }
  } else {
    PrefetchFloatsAhead(a_col, kPrefetchAhead * a_depth);
  }
}

// acc[r][v] *= c_scale's vector v: column by column.
template <size_t R, size_t V>
HWY_INLINE void ScaleColumns(VF (&acc)[R][V], const float* HWY_RESTRICT c_scale) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  HWY_UNROLL(16)
  for (size_t n = 0; n < V; ++n) {
    const VF factor = hn::LoadU(df, c_scale + n * lanes);
    HWY_UNROLL(16)
    for (size_t r = 0; r < R; ++r) acc[r][n] = hn::Mul(acc[r][n], factor);
  }
}

// C[R x V*L] (+)= A[R x depth] B[depth x V*L], L = lanes; C is overwritten when !accumulate.
// A(r, k) = a[r * a_row + k * a_depth]; B row k starts at b + k * ldb, C row r at c + r * ldc.
// With c_scale, what C held is first multiplied column by column by c_scale[0 .. V*L) (flash's
// rescale of Ot to a grown running max, folded into the load of the accumulators: a separate
// pass over Ot cost a load, a multiply and a store per element). Unaligned loads: on aligned
// data they cost the same, and callers need not align.
// kPrefetchA: A is streamed from L2 or beyond (flash's K and V tiles, read in place), so the tile
// fetches into L1 the A lines it or the next panel will read while it computes. When A's rows
// are contiguous (a_depth 1: K), the next panel's rows, one line of each every kLineFloats depth
// steps (an unaligned row's last line is left to the hardware); when its depth steps are rows
// apart (a_row 1: V^T, a step is a V row), the row kPrefetchAhead steps ahead (a line that an
// earlier panel already fetched costs a load slot). The hardware prefetchers do not keep up
// when K and V come from L3 (W3's, together 4 MB a KV head). 16-bit K/V are widened into L1
// scratch first, where the prefetches find their lines already in place.
template <size_t R, size_t V, bool kPrefetchA = false>
HWY_INLINE void MicroTile(size_t depth, const float* HWY_RESTRICT a, size_t a_row, size_t a_depth,
                          const float* HWY_RESTRICT b, size_t ldb, float* HWY_RESTRICT c, size_t ldc,
                          bool accumulate, const float* HWY_RESTRICT c_scale = nullptr) {
  VF acc[R][V];
  LoadTileOrZero(acc, accumulate, c, ldc);
  if (accumulate && c_scale) ScaleColumns(acc, c_scale);
  const auto load_b = [&](size_t k, VF(&b_vec)[V]) {
    if constexpr (kPrefetchA) PrefetchA<R>(a + k * a_depth, a_row, a_depth, k);
    LoadConsecutive(b + k * ldb, b_vec);
  };
  BroadcastSteps(depth, a, a_row, a_depth, load_b, acc);
  StoreTile(acc, c, ldc);
}

// Rows of a V-vector panel's register tile: kTileRows, but 6 for a 4-vector panel on AVX-512
// (6 x 4 = 24 accumulators + 4 B loads + 1 broadcast = 29 of 32 registers), which does 24 FMAs
// per 6 broadcasts and 4 loads where the 2 + 2 panels it replaces did 16 per 8 and 2.
template <size_t V>
constexpr size_t PanelRows() {
  static_assert(V <= kTileVectors || (V == 4 && kFourVectorPanels), "no register tile for this panel width");
  return V == 4 ? 6 : kTileRows;
}

// The remainder of an A panel: `rows` < PanelRows<V>(), each row count its own unrolled tile.
template <size_t V, bool kPrefetchA, size_t R = 1>
HWY_INLINE void MicroTileTail(size_t rows, size_t depth, const float* a, size_t a_row, size_t a_depth,
                              const float* b, size_t ldb, float* c, size_t ldc, bool accumulate,
                              const float* c_scale) {
  if constexpr (R < PanelRows<V>()) {
    if (rows == R)
      return MicroTile<R, V, kPrefetchA>(depth, a, a_row, a_depth, b, ldb, c, ldc, accumulate, c_scale);
    MicroTileTail<V, kPrefetchA, R + 1>(rows, depth, a, a_row, a_depth, b, ldb, c, ldc, accumulate, c_scale);
  }
}

// C[m x V*L] (+)= A[m x depth] B: panels of PanelRows<V>() rows, then the tail. c_scale and
// kPrefetchA as MicroTile's.
template <size_t V, bool kPrefetchA = false>
HWY_INLINE void PanelGemm(size_t m, size_t depth, const float* a, size_t a_row, size_t a_depth, const float* b,
                          size_t ldb, float* c, size_t ldc, bool accumulate, const float* c_scale = nullptr) {
  constexpr size_t kRows = PanelRows<V>();
  size_t r = 0;
  for (; r + kRows <= m; r += kRows)
    MicroTile<kRows, V, kPrefetchA>(depth, a + r * a_row, a_row, a_depth, b, ldb, c + r * ldc, ldc, accumulate,
                                    c_scale);
  if (r < m)
    MicroTileTail<V, kPrefetchA>(m - r, depth, a + r * a_row, a_row, a_depth, b, ldb, c + r * ldc, ldc, accumulate,
                                 c_scale);
}

// The panels a product n columns wide runs as (n rounded up to whole vectors), left to right:
// f(col, vectors) for each. Blocks of kTileVectors vectors, then a block of the 1 or 2 left; but
// 3 k + 1 vectors end in one 4-vector panel on AVX-512 and in 2 + 2 on the 16-register targets,
// not 3 + 1 (d = 64 on AVX-512 is 4 vectors: three of the flash backward's five products): a
// one-vector panel does kTileRows FMAs per kTileRows broadcasts and 1 load, and waits on loads.
template <class F>
HWY_INLINE void ForEachPanel(size_t n, const F& f) {
  const size_t lanes = hn::Lanes(DF());
  const size_t vectors = layout::ceil_div(n, lanes);
  size_t blocks = vectors / kTileVectors, left = vectors % kTileVectors, col = 0;
  if (left == 1 && blocks > 0) --blocks, left += kTileVectors;
  for (size_t block = 0; block < blocks; ++block, col += kTileVectors * lanes) f(col, kTileVectors);
  if (kFourVectorPanels && left == 4) return f(col, size_t{4});
  for (; left >= 2; left -= 2, col += 2 * lanes) f(col, size_t{2});
  if (left == 1) f(col, size_t{1});
}

// PanelGemm on a panel of `vectors` vectors (one that ForEachPanel gives).
HWY_INLINE void PanelGemmOf(size_t vectors, size_t m, size_t depth, const float* a, size_t a_row, size_t a_depth,
                            const float* b, size_t ldb, float* c, size_t ldc, bool accumulate) {
  switch (vectors) {
    case 1: return PanelGemm<1>(m, depth, a, a_row, a_depth, b, ldb, c, ldc, accumulate);
    case 2: return PanelGemm<2>(m, depth, a, a_row, a_depth, b, ldb, c, ldc, accumulate);
    case 3: return PanelGemm<3>(m, depth, a, a_row, a_depth, b, ldb, c, ldc, accumulate);
    default:
      if constexpr (kFourVectorPanels) PanelGemm<4>(m, depth, a, a_row, a_depth, b, ldb, c, ldc, accumulate);
  }
}

// C[m x n] (+)= A[m x depth] B[depth x n], n a whole number of vectors, panel by panel.
HWY_INLINE void Gemm(size_t m, size_t n, size_t depth, const float* a, size_t a_row, size_t a_depth, const float* b,
                     size_t ldb, float* c, size_t ldc, bool accumulate) {
  ForEachPanel(n, [&](size_t col, size_t vectors) {
    PanelGemmOf(vectors, m, depth, a, a_row, a_depth, b + col, ldb, c + col, ldc, accumulate);
  });
}

// True when none of the `count` values is NaN or +-Inf (|x| < inf is false for exactly those).
HWY_INLINE bool AllFinite(const float* HWY_RESTRICT values, size_t count) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const VF inf = hn::Set(df, std::numeric_limits<float>::infinity());
  size_t n = 0;
  for (; n + lanes <= count; n += lanes)
    if (!hn::AllTrue(df, hn::Lt(hn::Abs(hn::LoadU(df, values + n)), inf))) return false;
  for (; n < count; ++n)
    if (!(std::abs(values[n]) < std::numeric_limits<float>::infinity())) return false;
  return true;
}

}  // namespace tile_gemm
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
