// tiled_gemm (gemm/tiled.hpp): C = alpha op(A) op(B) + beta C on gemm/micro_kernel-inl.h's micro-GEMM.
//
// alpha op(B) is packed into the panels tile_gemm::ForEachPanel gives (those Gemm runs), left to
// right; a panel holds k rows of its width, contiguous, zero past column n. Each thread packs its
// own copy of small panels; larger ones the threads pack together, each a range of depth steps.
// Then the threads take blocks of A's rows; a block runs every panel over a block of depth at a
// time (kDepthBlock: a panel's slice and the rows' slice of A stay in L1). Whole panels write C in
// place; a last panel with a partial vector runs into scratch and is copied. tiled_gemm_transposed
// (TiledT) runs the transposed product: each panel into that scratch over all of its depth, then
// copied out transposed, so the rows' slice of A (W) is read again for each panel (one panel up to
// 64 rows of x, the most TiledT's rule gives it; three at 128).
//
// Highway's foreach_target re-includes this file once per SIMD target; the exported entry point
// lives in the HWY_ONCE part below.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "gemm/tiled.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "gemm/micro_kernel-inl.h"
#include "hwy/highway.h"

#ifndef QKV_TILED_GEMM_ONCE
#define QKV_TILED_GEMM_ONCE
#include <omp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "simd/item_shares.hpp"
#include "core/allocator.hpp"
#include "gemm/layout.hpp"
#include "gemm/tiled.hpp"

namespace qkv::detail::tiled {
// Below this many multiply-adds one thread is faster than waking a second.
constexpr double kMinWorkForThreads = double{1 << 20};
inline bool threaded(size_t m, size_t n, size_t k, int threads) {
  return threads > 1 &&
         static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) >= kMinWorkForThreads;
}
}  // namespace qkv::detail::tiled
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using tile_gemm::DF;
using tile_gemm::kFourVectorPanels;

// Depth per pass over a row block: a 3-vector panel's slice is 128 x 48 floats (24 KiB) on
// AVX-512, within L1.
constexpr size_t kDepthBlock = 128;
// Rows per block of work: about kRowBlock, starting at multiples of kRowQuantum (the 8-row
// register tile; a 4-vector panel's 6-row tile leaves 2 or 4 rows of a 40- or 56-row block to a
// smaller tile, which costs nothing measurable), at most
// kMaxBlockRows (the longest a block gets is 51 rows).
constexpr size_t kRowQuantum = 8, kRowBlock = 48, kMaxBlockRows = kRowBlock + kRowQuantum;
// Threads share one packed copy of alpha op(B) larger than this (512 KiB); at most this, each
// thread packs its own (when it has a row block's worth of rows: kRowBlock per thread). A shared
// copy is written by every thread and then read by all: each call moves the other threads' parts
// from core to core. The duplicated packing costs threads / m of the products; up to 512 KiB of
// panels own copies were faster, beyond it the two were alike.
constexpr size_t kMaxOwnPanelFloats = size_t{1} << 17;

// Depth steps [x_begin, x_end) of the panels of alpha op(B): the panel at column col is k rows of
// `width` floats from packed + col * k, zero past column n. Threads pack depth ranges of every
// panel side by side. A transposed B (n x k, a Linear's W or the reference's K) is read a vector
// of panel columns at a time, one gather per depth step from `lanes` rows of B, into a whole
// vector store.
void TiledPackB(bool trans_b, size_t n, size_t k, float alpha, const float* HWY_RESTRICT b, size_t ldb,
                float* HWY_RESTRICT packed, size_t x_begin, size_t x_end) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const size_t lanes = hn::Lanes(df);
  const auto scale = hn::Set(df, alpha);
  // Gathers index B's rows with int32 offsets: a vector of rows must span fewer than 2^31 floats.
  const bool gather = trans_b && (lanes - 1) * ldb <= size_t{INT32_MAX};
  tile_gemm::ForEachPanel(n, [&](size_t col, size_t vectors) {
    const size_t width = vectors * lanes, real = std::min(width, n - col);
    float* HWY_RESTRICT panel = packed + col * k;
    if (gather) {
      for (size_t v = 0; v < width; v += lanes) {
        // Rows past B's last are read at its last and zeroed.
        const auto live = hn::FirstN(df, real > v ? real - v : 0);
        const auto rows = hn::Min(hn::Iota(di, 0), hn::Set(di, static_cast<int32_t>(real > v ? real - v - 1 : 0)));
        const auto offsets = hn::Mul(rows, hn::Set(di, static_cast<int32_t>(ldb)));
        const float* HWY_RESTRICT first = b + (col + std::min(v, real - 1)) * ldb;
        for (size_t x = x_begin; x < x_end; ++x)
          hn::Store(hn::IfThenElseZero(live, hn::Mul(scale, hn::GatherIndex(df, first + x, offsets))), df,
                    panel + x * width + v);
      }
      return;
    }
    if (trans_b) {  // B is n x k: panel column j is B's row col + j
      for (size_t j = 0; j < real; ++j) {
        const float* HWY_RESTRICT row = b + (col + j) * ldb;
        for (size_t x = x_begin; x < x_end; ++x) panel[x * width + j] = alpha * row[x];
      }
      for (size_t x = x_begin; x < x_end; ++x) std::fill(panel + x * width + real, panel + (x + 1) * width, 0.0f);
      return;
    }
    for (size_t x = x_begin; x < x_end; ++x) {  // B is k x n: panel row x is a slice of B's row x
      const float* HWY_RESTRICT row = b + x * ldb + col;
      float* HWY_RESTRICT out = panel + x * width;
      size_t j = 0;
      for (; j + lanes <= real; j += lanes) hn::StoreU(hn::Mul(scale, hn::LoadU(df, row + j)), df, out + j);
      for (; j < real; ++j) out[j] = alpha * row[j];
      for (; j < width; ++j) out[j] = 0.0f;
    }
  });
}

// A transposed (TN: the reference backward's dK = dS^T Q), its depth steps are rows lda apart.
// With one panel (n at most 4 vectors on AVX-512, the path's target; 3 elsewhere) no second
// panel reads a slice again, so a copy buys no reuse, and the CPU's stride prefetcher follows
// the tiles' broadcasts down depth steps at most 2 KiB apart (the limit of Intel's L1 IP
// prefetcher), so in place is faster than the copy below. Steps further apart, or several
// panels reading the slice again, take the copy.
constexpr size_t kMaxInPlaceStrideBytes = 2048;
inline bool TransposedAInPlace(size_t panels, size_t lda) {
  return panels == 1 && lda * sizeof(float) <= kMaxInPlaceStrideBytes;
}

// A's slice for rows [r0, r0 + rows) and depth steps [x0, x0 + depth), for PanelGemm's a, a_row and
// a_depth: in place when A is not transposed (a_depth 1: broadcasts walk kTileRows rows), or when
// it is and `in_place` (TransposedAInPlace: a_row 1, a_depth lda); else a transposed A's depth
// steps are copied first to rows kMaxBlockRows floats apart.
struct ASlice {
  const float* a;
  size_t row, depth;
};
ASlice SliceOfA(bool trans_a, bool in_place, const float* a, size_t lda, size_t r0, size_t rows, size_t x0,
                size_t depth, float* HWY_RESTRICT a_pack) {
  if (!trans_a) return {a + r0 * lda + x0, lda, 1};
  if (in_place) return {a + x0 * lda + r0, 1, lda};
  for (size_t x = 0; x < depth; ++x) std::copy_n(a + (x0 + x) * lda + r0, rows, a_pack + x * kMaxBlockRows);
  return {a_pack, 1, kMaxBlockRows};
}

// Rows [r0, r0 + rows) of C' = op(A) op(B) from the packed panels, written transposed: C'(i, j)
// goes to c[j * ldc + i] (tiled_gemm_transposed). Panel by panel, each over every depth block
// into `tail` (rows x 4 vectors), then copied out: a column of tail is a stretch of one row of c.
void TiledRowBlockTransposed(bool trans_a, bool a_in_place, size_t n, size_t k, const float* a, size_t lda,
                             const float* packed, float beta, float* c, size_t ldc, size_t r0, size_t rows,
                             float* HWY_RESTRICT tail, float* HWY_RESTRICT a_pack) {
  const size_t lanes = hn::Lanes(DF());
  tile_gemm::ForEachPanel(n, [&](size_t col, size_t vectors) {
    const size_t width = vectors * lanes;
    for (size_t x0 = 0; x0 < k; x0 += kDepthBlock) {
      const size_t depth = std::min(kDepthBlock, k - x0);
      const ASlice slice = SliceOfA(trans_a, a_in_place, a, lda, r0, rows, x0, depth, a_pack);
      tile_gemm::PanelGemmOf(vectors, rows, depth, slice.a, slice.row, slice.depth, packed + col * k + x0 * width,
                             width, tail, width, x0 > 0);
    }
    // A column of tail is gathered a vector of rows at a time (the rows left one by one).
    const DF df;
    const hn::RebindToSigned<DF> di;
    const auto offsets = hn::Mul(hn::Iota(di, 0), hn::Set(di, static_cast<int32_t>(width)));
    for (size_t j = col; j < std::min(n, col + width); ++j) {
      float* HWY_RESTRICT out = c + j * ldc + r0;
      const float* HWY_RESTRICT products = tail + (j - col);
      size_t r = 0;
      for (; r + lanes <= rows; r += lanes) {
        const auto column = hn::GatherIndex(df, products + r * width, offsets);
        hn::StoreU(beta == 0.0f ? column : hn::MulAdd(hn::Set(df, beta), hn::LoadU(df, out + r), column), df, out + r);
      }
      for (; r < rows; ++r) out[r] = beta == 0.0f ? products[r * width] : products[r * width] + beta * out[r];
    }
  });
}

// Rows [r0, r0 + rows) of C from the packed panels. `tail` holds rows x 4 vectors (a last
// panel with a partial vector runs there).
// `whole`: the columns C takes in place, those of the panels with no partial vector.
void TiledRowBlock(bool trans_a, bool a_in_place, size_t n, size_t whole, size_t k, const float* a, size_t lda,
                   const float* packed, float beta, float* c, size_t ldc, size_t r0, size_t rows,
                   float* HWY_RESTRICT tail, float* HWY_RESTRICT a_pack) {
  const size_t lanes = hn::Lanes(DF());
  float* c_rows = c + r0 * ldc;
  if (beta != 0.0f && beta != 1.0f)
    for (size_t r = 0; r < rows; ++r)
      for (size_t j = 0; j < whole; ++j) c_rows[r * ldc + j] *= beta;
  size_t tail_col = n, tail_width = 0;
  for (size_t x0 = 0; x0 < k; x0 += kDepthBlock) {
    const size_t depth = std::min(kDepthBlock, k - x0);
    const ASlice slice = SliceOfA(trans_a, a_in_place, a, lda, r0, rows, x0, depth, a_pack);
    const float* a_slice = slice.a;
    const size_t a_row = slice.row, a_depth = slice.depth;
    tile_gemm::ForEachPanel(n, [&](size_t col, size_t vectors) {
      const size_t width = vectors * lanes;
      const float* panel = packed + col * k + x0 * width;
      if (col + width <= whole) {
        tile_gemm::PanelGemmOf(vectors, rows, depth, a_slice, a_row, a_depth, panel, width, c_rows + col, ldc,
                               x0 > 0 || beta != 0.0f);
      } else {
        tail_col = col, tail_width = width;
        tile_gemm::PanelGemmOf(vectors, rows, depth, a_slice, a_row, a_depth, panel, width, tail, width, x0 > 0);
      }
    });
  }
  for (size_t r = 0; r < rows; ++r)
    for (size_t j = tail_col; j < n; ++j) {
      const float product = tail[r * tail_width + (j - tail_col)];
      c_rows[r * ldc + j] = beta == 0.0f ? product : product + beta * c_rows[r * ldc + j];
    }
}

bool WidePanels() { return kFourVectorPanels; }

// C = alpha op(A) op(B) + beta C, or with c_transposed its transpose: C^T, n x m, rows ldc apart.
void TiledGemm(bool trans_a, bool trans_b, size_t m, size_t n, size_t k, float alpha, const float* a, size_t lda,
               const float* b, size_t ldb, float beta, float* c, size_t ldc, bool c_transposed) {
  const size_t lanes = hn::Lanes(DF());
  size_t padded = 0, whole = 0, panel_count = 0;  // the panels' columns; those with no partial vector
  tile_gemm::ForEachPanel(n, [&](size_t col, size_t vectors) {
    ++panel_count;
    padded = col + vectors * lanes;
    if (padded <= n) whole = padded;
  });
  const bool a_in_place = trans_a && TransposedAInPlace(panel_count, lda);
  // Blocks of rows as many as a multiple of the threads and as even as whole register tiles
  // allow (boundaries at multiples of kRowQuantum), about kRowBlock rows each.
  const size_t threads = static_cast<size_t>(omp_get_max_threads());
  const bool threaded = tiled::threaded(m, n, k, static_cast<int>(threads));
  const size_t blocks = threaded ? layout::block_count(m, kRowBlock, threads) : layout::ceil_div(m, kRowBlock);
  const auto block_start = [&](size_t block) {
    return block == blocks ? m : std::min(m, (block * m / blocks + kRowQuantum / 2) / kRowQuantum * kRowQuantum);
  };
  const bool own_panels = threaded && padded * k <= kMaxOwnPanelFloats && m >= kRowBlock * threads;
  float* panels = thread_workspace(WorkspaceSlot::GemmPanels).floats((own_panels ? threads : 1) * padded * k);
  const size_t pack_parts = threaded ? threads : 1;
  // Blocks dealt in contiguous shares (simd/item_shares.hpp): a thread keeps its rows of A and C in its
  // caches from call to call, which OpenMP's dynamic schedule dealt to either thread.
  ItemShares shares(threaded ? static_cast<int>(threads) : 1, static_cast<int64_t>(blocks));
#pragma omp parallel if (threaded)
  {
    const float* packed = panels;
    if (own_panels) {  // each thread its copy, at its offset: no barrier before the blocks
      float* own = panels + static_cast<size_t>(omp_get_thread_num()) * padded * k;
      TiledPackB(trans_b, n, k, alpha, b, ldb, own, 0, k);
      packed = own;
    } else {
      // Every thread packs its share of the depth steps; the loop's barrier waits for all of them.
#pragma omp for schedule(static)
      for (int64_t part = 0; part < static_cast<int64_t>(pack_parts); ++part)
        TiledPackB(trans_b, n, k, alpha, b, ldb, panels, static_cast<size_t>(part) * k / pack_parts,
                   static_cast<size_t>(part + 1) * k / pack_parts);
    }
    HWY_ALIGN float tail[kMaxBlockRows * 4 * hn::MaxLanes(DF())];
    HWY_ALIGN float a_pack[kMaxBlockRows * kDepthBlock];  // a transposed A's slice
    const auto run = [&](int64_t block) {
      const size_t r0 = block_start(static_cast<size_t>(block)), r1 = block_start(static_cast<size_t>(block) + 1);
      if (r1 <= r0) return;
      if (c_transposed) {
        TiledRowBlockTransposed(trans_a, a_in_place, n, k, a, lda, packed, beta, c, ldc, r0, r1 - r0, tail, a_pack);
      } else {
        TiledRowBlock(trans_a, a_in_place, n, whole, k, a, lda, packed, beta, c, ldc, r0, r1 - r0, tail, a_pack);
      }
    };
    shares.run(omp_get_thread_num(), run);
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::detail {

HWY_EXPORT(TiledGemm);
HWY_EXPORT(WidePanels);

bool tiled_gemm_has_wide_panels() { return HWY_DYNAMIC_DISPATCH(WidePanels)(); }

bool tiled_gemm_threads(int64_t m, int64_t n, int64_t k) {
  return tiled::threaded(static_cast<size_t>(m), static_cast<size_t>(n), static_cast<size_t>(k),
                         omp_get_max_threads());
}

void tiled_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  HWY_DYNAMIC_DISPATCH(TiledGemm)(trans_a, trans_b, static_cast<size_t>(m), static_cast<size_t>(n),
                                  static_cast<size_t>(k), alpha, a, static_cast<size_t>(lda), b,
                                  static_cast<size_t>(ldb), beta, c, static_cast<size_t>(ldc), false);
}

void tiled_gemm_transposed(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                           int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  // C^T = op(B)^T op(A)^T: B in A's place (op(B)^T is B itself when trans_b), A in B's.
  HWY_DYNAMIC_DISPATCH(TiledGemm)(!trans_b, !trans_a, static_cast<size_t>(n), static_cast<size_t>(m),
                                  static_cast<size_t>(k), alpha, b, static_cast<size_t>(ldb), a,
                                  static_cast<size_t>(lda), beta, c, static_cast<size_t>(ldc), true);
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
