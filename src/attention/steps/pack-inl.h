// Steps "load a tile" and "finish" with queries in the lanes: an operand's rows packed into a
// transposed, scaled tile (PackTransposed) and a transposed tile written back as rows
// (UnpackTransposed), by register transposes of 4 x 4 and, on AVX-512, 16 x 16 blocks.
//
// Included inside a Highway foreach_target pass (the -inl.h convention), through pipeline-inl.h or
// on its own.

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_STEPS_PACK_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_STEPS_PACK_INL_H_
#undef QKV_ATTENTION_STEPS_PACK_INL_H_
#else
#define QKV_ATTENTION_STEPS_PACK_INL_H_
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "attention/problem.hpp"
#include "attention/steps/lines-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

// Transposes of 4 x 4 blocks in 128-bit vectors (every x86 target's, whatever its width; none
// on HWY_SCALAR, whose callers below run their scalar loops): `from` rows r0..r3 (4 floats each)
// become columns. Two rounds of interleaves, as SSE's _MM_TRANSPOSE4_PS.
#if HWY_TARGET != HWY_SCALAR
using D4 = hn::Full128<float>;
using V4 = hn::Vec<D4>;
HWY_INLINE void Transpose4(V4& r0, V4& r1, V4& r2, V4& r3) {
  const D4 d4;
  const V4 t0 = hn::InterleaveLower(d4, r0, r1), t1 = hn::InterleaveUpper(d4, r0, r1);  // r0[0] r1[0] r0[1] r1[1]; [2], [3]
  const V4 t2 = hn::InterleaveLower(d4, r2, r3), t3 = hn::InterleaveUpper(d4, r2, r3);
  r0 = hn::ConcatLowerLower(d4, t2, t0);  // r0[0] r1[0] r2[0] r3[0]
  r1 = hn::ConcatUpperUpper(d4, t2, t0);
  r2 = hn::ConcatLowerLower(d4, t3, t1);
  r3 = hn::ConcatUpperUpper(d4, t3, t1);
}
#endif

// col[x] = column x of the 16 x 16 block whose row y starts at src + y * stride (every AVX-512
// target). Each vector is loaded with the 128-bit pieces of rows y, y + 4, y + 8 and y + 12 in its
// four blocks (broadcast loads and blends, no shuffle), so that a 4 x 4 transpose within the
// blocks (Transpose4's two rounds of interleaves, floats then pairs) leaves whole columns: 32
// shuffles for 256 floats, where 4 x 4 blocks in 128-bit vectors take 128 (the shuffle port is
// what bounds a transpose; measured: docs/performance-log.md).
#undef QKV_PIPELINE_TRANSPOSE16  // once per target
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
#define QKV_PIPELINE_TRANSPOSE16 1
HWY_INLINE void LoadTransposed16(const float* HWY_RESTRICT src, int64_t stride, VF (&col)[16]) {
  const DF df;
  const hn::Repartition<double, DF> dd;
  const auto pairs = [&](VF a, VF b, bool upper) {  // 64-bit interleave within blocks
    return hn::BitCast(df, upper ? hn::InterleaveUpper(dd, hn::BitCast(dd, a), hn::BitCast(dd, b))
                                 : hn::InterleaveLower(dd, hn::BitCast(dd, a), hn::BitCast(dd, b)));
  };
  HWY_UNROLL(4)
  for (size_t k = 0; k < 4; ++k) {  // columns 4k .. 4k + 3
    VF v[4];  // v[a], block g: row 4g + a, columns 4k .. 4k + 3
    HWY_UNROLL(4)
    for (size_t a = 0; a < 4; ++a) {
      const float* HWY_RESTRICT p = src + static_cast<int64_t>(a) * stride + static_cast<int64_t>(4 * k);
      const VF r0 = hn::LoadDup128(df, p), r4 = hn::LoadDup128(df, p + 4 * stride);
      const VF r8 = hn::LoadDup128(df, p + 8 * stride), r12 = hn::LoadDup128(df, p + 12 * stride);
      v[a] = hn::ConcatUpperLower(df, hn::OddEvenBlocks(r12, r8), hn::OddEvenBlocks(r4, r0));
    }
    const VF lo01 = hn::InterleaveLower(df, v[0], v[1]), hi01 = hn::InterleaveUpper(df, v[0], v[1]);
    const VF lo23 = hn::InterleaveLower(df, v[2], v[3]), hi23 = hn::InterleaveUpper(df, v[2], v[3]);
    col[4 * k + 0] = pairs(lo01, lo23, false);
    col[4 * k + 1] = pairs(lo01, lo23, true);
    col[4 * k + 2] = pairs(hi01, hi23, false);
    col[4 * k + 3] = pairs(hi01, hi23, true);
  }
}
#else
#define QKV_PIPELINE_TRANSPOSE16 0
#endif

// ---- Step "load a tile", queries in the lanes: At (d, br) = factor * A^T for the `rows` rows
// i0.. of head (b, h) of an operand (q or dO), lanes past `rows` zero. By 4 x 4 blocks in
// vectors (a scalar transpose took a large share of a forward: docs/performance-log.md), on
// AVX-512 by 16 x 16 blocks first; the last 1-3 rows by a 4 x 4 block too where the tile's
// padding lanes hold the rest of it, the columns left over one by one.
HWY_INLINE void PackTransposed(const Rows<const float>& a, int64_t b, int64_t h, int64_t i0, size_t rows, size_t d,
                               size_t br, float factor, float* HWY_RESTRICT a_t) {
  const float* HWY_RESTRICT first = a.row(b, h, i0);
  const int64_t stride = a.row_stride;
  auto at = [&](size_t i, size_t c) { return first[static_cast<int64_t>(i) * stride + static_cast<int64_t>(c)]; };
  size_t blocked_rows = 0, blocked_cols = 0;
  // The lanes past `rows`, when they lie in each column's last vector (a tile of whole vectors,
  // its last one partly or wholly padding): zeroed first, one store a column, and the rows
  // written over them below. A fill per column called memset, a vzeroupper before each call
  // (docs/performance-log.md, "W5: the bias in the Small kernel's stores, and Auto's decode
  // crossover").
  bool padding_zeroed = false;
#if HWY_TARGET != HWY_SCALAR
  {
    const DF df;
    const size_t lanes = hn::Lanes(df);
    if (rows < br && br % lanes == 0 && br - rows <= lanes) {
      for (size_t c = 0; c < d; ++c) hn::StoreU(hn::Zero(df), df, a_t + c * br + br - lanes);
      padding_zeroed = true;
    }
  }
#endif
#if HWY_TARGET != HWY_SCALAR
  size_t rows16 = 0, cols16 = 0;  // 16 x 16 blocks (AVX-512), then 4 x 4 ones where they leave off
#if QKV_PIPELINE_TRANSPOSE16
  {
    const DF df;
    const VF scale = hn::Set(df, factor);
    rows16 = rows / 16 * 16;
    cols16 = d / 16 * 16;
    for (size_t i = 0; i < rows16; i += 16)
      for (size_t c = 0; c < cols16; c += 16) {
        VF r[16];
        LoadTransposed16(first + static_cast<int64_t>(i) * stride + static_cast<int64_t>(c), stride, r);
        HWY_UNROLL(16)
        for (size_t x = 0; x < 16; ++x) hn::StoreU(hn::Mul(r[x], scale), df, a_t + (c + x) * br + i);
      }
  }
#endif
  const D4 d4;
  const V4 scale = hn::Set(d4, factor);
  blocked_rows = rows / 4 * 4;
  blocked_cols = d / 4 * 4;
  for (size_t i = 0; i < blocked_rows; i += 4)
    for (size_t c = i < rows16 ? cols16 : 0; c < blocked_cols; c += 4) {
      const float* HWY_RESTRICT from = first + static_cast<int64_t>(i) * stride + static_cast<int64_t>(c);
      V4 r0 = hn::LoadU(d4, from), r1 = hn::LoadU(d4, from + stride), r2 = hn::LoadU(d4, from + 2 * stride),
         r3 = hn::LoadU(d4, from + 3 * stride);
      Transpose4(r0, r1, r2, r3);
      float* HWY_RESTRICT to = a_t + c * br + i;
      hn::StoreU(hn::Mul(r0, scale), d4, to);
      hn::StoreU(hn::Mul(r1, scale), d4, to + br);
      hn::StoreU(hn::Mul(r2, scale), d4, to + 2 * br);
      hn::StoreU(hn::Mul(r3, scale), d4, to + 3 * br);
    }
  // The last 1-3 rows the same way, zero vectors (+0, scaled before the transpose) for the rows
  // past `rows`, when the tile has those lanes (padding, zeros either way): not one scalar store
  // per element.
  if (blocked_rows < rows && blocked_rows + 4 <= br) {
    const size_t i = blocked_rows, left = rows - i;
    for (size_t c = 0; c < blocked_cols; c += 4) {
      const float* HWY_RESTRICT from = first + static_cast<int64_t>(i) * stride + static_cast<int64_t>(c);
      V4 r0 = hn::Mul(hn::LoadU(d4, from), scale);
      V4 r1 = left > 1 ? hn::Mul(hn::LoadU(d4, from + stride), scale) : hn::Zero(d4);
      V4 r2 = left > 2 ? hn::Mul(hn::LoadU(d4, from + 2 * stride), scale) : hn::Zero(d4);
      V4 r3 = hn::Zero(d4);
      Transpose4(r0, r1, r2, r3);
      float* HWY_RESTRICT to = a_t + c * br + i;
      hn::StoreU(r0, d4, to);
      hn::StoreU(r1, d4, to + br);
      hn::StoreU(r2, d4, to + 2 * br);
      hn::StoreU(r3, d4, to + 3 * br);
    }
    blocked_rows = rows;
  }
#endif
  for (size_t c = 0; c < d; ++c) {
    float* HWY_RESTRICT column = a_t + c * br;
    for (size_t i = c < blocked_cols ? blocked_rows : 0; i < rows; ++i) column[i] = factor * at(i, c);
    if (!padding_zeroed) std::fill(column + rows, column + br, 0.0f);
  }
}

// ---- Step "finish", the way back: row i (< rows) of head (b, h) of `out`, from row i0, gets
// column i of At (d, br), times factor[i] when factor is given; with `add`, the row adds it (the
// row's element + the column's, one rounding). By blocks as PackTransposed.
HWY_INLINE void UnpackTransposed(const float* HWY_RESTRICT a_t, size_t br, size_t rows, size_t d,
                                 const float* HWY_RESTRICT factor, const Rows<float>& out, int64_t b, int64_t h,
                                 int64_t i0, bool add = false) {
  float* HWY_RESTRICT first = out.row(b, h, i0);
  const int64_t stride = out.row_stride;
  size_t blocked_rows = 0, blocked_cols = 0;
#if HWY_TARGET != HWY_SCALAR
  size_t rows16 = 0, cols16 = 0;  // 16 x 16 blocks (AVX-512), then 4 x 4 ones where they leave off
#if QKV_PIPELINE_TRANSPOSE16
  {
    const DF df;
    rows16 = rows / 16 * 16;
    cols16 = d / 16 * 16;
    for (size_t i = 0; i < rows16; i += 16)
      for (size_t c = 0; c < cols16; c += 16) {
        VF r[16];  // r[x]: row i + x, columns c .. c + 15
        LoadTransposed16(a_t + c * br + i, static_cast<int64_t>(br), r);
        HWY_UNROLL(16)
        for (size_t x = 0; x < 16; ++x) {
          const VF row = factor ? hn::Mul(r[x], hn::Set(df, factor[i + x])) : r[x];
          float* HWY_RESTRICT to = first + static_cast<int64_t>(i + x) * stride + static_cast<int64_t>(c);
          hn::StoreU(add ? hn::Add(hn::LoadU(df, to), row) : row, df, to);
        }
      }
  }
#endif
  const D4 d4;
  blocked_rows = rows / 4 * 4;
  blocked_cols = d / 4 * 4;
  for (size_t i = 0; i < blocked_rows; i += 4) {
    float* HWY_RESTRICT to = first + static_cast<int64_t>(i) * stride;
    for (size_t c = i < rows16 ? cols16 : 0; c < blocked_cols; c += 4) {
      const float* HWY_RESTRICT from = a_t + c * br + i;
      V4 r0 = hn::LoadU(d4, from), r1 = hn::LoadU(d4, from + br), r2 = hn::LoadU(d4, from + 2 * br),
         r3 = hn::LoadU(d4, from + 3 * br);
      Transpose4(r0, r1, r2, r3);  // r0: row i, columns c..c+3
      if (factor) {
        r0 = hn::Mul(r0, hn::Set(d4, factor[i]));
        r1 = hn::Mul(r1, hn::Set(d4, factor[i + 1]));
        r2 = hn::Mul(r2, hn::Set(d4, factor[i + 2]));
        r3 = hn::Mul(r3, hn::Set(d4, factor[i + 3]));
      }
      if (add) {
        r0 = hn::Add(hn::LoadU(d4, to + c), r0);
        r1 = hn::Add(hn::LoadU(d4, to + stride + c), r1);
        r2 = hn::Add(hn::LoadU(d4, to + 2 * stride + c), r2);
        r3 = hn::Add(hn::LoadU(d4, to + 3 * stride + c), r3);
      }
      hn::StoreU(r0, d4, to + c);
      hn::StoreU(r1, d4, to + stride + c);
      hn::StoreU(r2, d4, to + 2 * stride + c);
      hn::StoreU(r3, d4, to + 3 * stride + c);
    }
  }
#endif
  for (size_t i = 0; i < rows; ++i) {
    float* HWY_RESTRICT row = first + static_cast<int64_t>(i) * stride;
    const float f = factor ? factor[i] : 1.0f;
    for (size_t c = i < blocked_rows ? blocked_cols : 0; c < d; ++c) {
      const float value = factor ? a_t[c * br + i] * f : a_t[c * br + i];
      row[c] = add ? row[c] + value : value;
    }
  }
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
