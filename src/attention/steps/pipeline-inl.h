// The attention pipeline: the named per-target steps every fused kernel is composed of
// (flash/forward.cpp, flash/backward.cpp, decode/decode.cpp). A kernel differs from another only in its loop
// order and in what it accumulates; each step below exists once.
//
//   step                 forward (flash, decode)            backward (flash_backward)
//   load a K/V tile      read in place through row strides  the same
//   scores               S = K Qt (flash) / Qs K^T (decode)  S^T = K Qt
//   modifiers            Softcap (a whole tile), then Alibi  the same, keeping softcap's slope
//                        (per line)
//   classify a tile      ClassifyMaskTile: hidden, partial,  the same
//                        fully visible (band and rule)
//   mask                 MaskBand, MaskRuleStep, MaskTerms   the same
//                        (flash: TileLogits, a tile's band
//                        at once with MaskBandLines)
//   diagonal trim        DiagonalTrim: the lines each query  not used (measured within noise
//                        vector of a diagonal tile needs     on W2-bwd)
//                        (flash's two products)
//   softmax              online: *SoftmaxUpdate*             RecomputeWeights from row stats
//   dropout              Dropout on P                        Dropout on P and on dP
//   accumulate           O += P V (GEMM, or skipping zeros   dV, dS, dK, dQ
//                        when V is not finite)
//   finish               finish_row (kernels.hpp): O / l, lse, row stats
//
// Scores travel in "lines": n consecutive floats of a tile, s[x] for query i0 + x * query_step
// and key j0 + x * key_step. Flash keeps queries in the SIMD lanes, so its lines are one key over
// the queries (query_step 1, key_step 0); decode keeps keys in the lanes, so its lines are one
// query over the keys (0, 1). Every step that depends on positions (ALiBi, the band, tensor
// terms, dropout) works from those coordinates and serves both layouts.
//
// Included by each kernel inside its Highway foreach_target pass (the -inl.h convention).

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_PIPELINE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_PIPELINE_INL_H_
#undef QKV_ATTENTION_PIPELINE_INL_H_
#else
#define QKV_ATTENTION_PIPELINE_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include "attention/kernels.hpp"
#include "attention/problem.hpp"
#include "gemm/micro_kernel-inl.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Where a line of scores sits in the problem (see the header comment).
struct Line {
  int64_t b, h;                   // batch, query head
  int64_t i0, j0;                 // the query and key of s[0]
  int64_t query_step, key_step;   // (1, 0): one key over queries; (0, 1): one query over keys
  int64_t query(size_t x) const { return i0 + static_cast<int64_t>(x) * query_step; }
  int64_t key(size_t x) const { return j0 + static_cast<int64_t>(x) * key_step; }
};

// A band edge clamped into int32 (|j - i| < 2^31 for every real pair, so clamping changes nothing).
HWY_INLINE int32_t ClampEdge(int64_t edge) {
  return static_cast<int32_t>(std::clamp<int64_t>(edge, -(int64_t{1} << 31) + 1, (int64_t{1} << 31) - 1));
}

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
// what bounds a transpose). W0's step benchmark: PackQ 0.81, Finish 0.64 of the time they took
// by 4 x 4 blocks (Sapphire Rapids-class Xeon, one thread, alternated).
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
// vectors (scalar, 1.2 cycles a float: a tenth of W0's time on AVX2), on AVX-512 by 16 x 16
// blocks first, the rows and columns left over one by one.
HWY_INLINE void PackTransposed(const Rows<const float>& a, int64_t b, int64_t h, int64_t i0, size_t rows, size_t d,
                               size_t br, float factor, float* HWY_RESTRICT a_t) {
  const float* HWY_RESTRICT first = a.row(b, h, i0);
  const int64_t stride = a.row_stride;
  auto at = [&](size_t i, size_t c) { return first[static_cast<int64_t>(i) * stride + static_cast<int64_t>(c)]; };
  size_t blocked_rows = 0, blocked_cols = 0;
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
#endif
  for (size_t c = 0; c < d; ++c) {
    float* HWY_RESTRICT column = a_t + c * br;
    for (size_t i = c < blocked_cols ? blocked_rows : 0; i < rows; ++i) column[i] = factor * at(i, c);
    std::fill(column + rows, column + br, 0.0f);
  }
}

// ---- Step "finish", the way back: row i (< rows) of head (b, h) of `out`, from row i0, gets
// column i of At (d, br), times factor[i] when factor is given. By blocks as PackTransposed.
HWY_INLINE void UnpackTransposed(const float* HWY_RESTRICT a_t, size_t br, size_t rows, size_t d,
                                 const float* HWY_RESTRICT factor, const Rows<float>& out, int64_t b, int64_t h,
                                 int64_t i0) {
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
          hn::StoreU(row, df, first + static_cast<int64_t>(i + x) * stride + static_cast<int64_t>(c));
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
    for (size_t c = i < blocked_rows ? blocked_cols : 0; c < d; ++c) row[c] = factor ? a_t[c * br + i] * f : a_t[c * br + i];
  }
}

// How the band and key lengths treat a tile of queries [i0, i_last] x keys [j0, j_end): both
// ends of a query's visible range grow with the query, so the first and last rows decide.
enum class TileClass { Hidden, Partial, Full };
HWY_INLINE TileClass ClassifyTile(const AttentionProblem& p, int64_t b, int64_t i0, int64_t i_last, int64_t j0,
                                  int64_t j_end) {
  if (p.last_visible_key(b, i_last) <= j0 || p.first_visible_key(i0) >= j_end) return TileClass::Hidden;
  if (p.first_visible_key(i_last) <= j0 && p.last_visible_key(b, i0) >= j_end) return TileClass::Full;
  return TileClass::Partial;
}

// The same for the whole mask, the symbolic rule (mask/rule.hpp) of query head h included: a tile
// the band or the rule hides is skipped; one both fully show needs no per-element mask work.
HWY_INLINE TileClass ClassifyMaskTile(const AttentionProblem& p, int64_t b, int64_t h, int64_t i0, int64_t i_last,
                                      int64_t j0, int64_t j_end) {
  const TileClass band = ClassifyTile(p, b, i0, i_last, j0, j_end);
  if (band == TileClass::Hidden || p.rule.empty()) return band;
  const TileVisibility rule = p.rule.classify(b, h, i0, i_last, j0, j_end - 1);
  if (rule == TileVisibility::Hidden) return TileClass::Hidden;
  return band == TileClass::Full && rule == TileVisibility::Full ? TileClass::Full : TileClass::Partial;
}

// scale * tanh(x) for softcap's hot loop: x P(x^2) / Q(x^2) on [-9, 9] (past 9, tanh is 1 to
// within 3e-8), P of degree 4 and Q of degree 4 in x^2, fitted by iterated least squares on the
// relative error (max 6e-8 in float64, 3.4e-7 absolute when evaluated in float32). Eight FMAs and
// a refined reciprocal: about half the cost of an Exp-based tanh, which made softcap cost a third
// of W1's time. `scale` multiplies P's coefficients (once per call, not per vector). NaN stays
// NaN.
HWY_INLINE VF ScaledTanh(VF x, float scale) {
  const DF df;
  const VF limit = hn::Set(df, 9.0f), minus_limit = hn::Set(df, -9.0f);
#if HWY_ARCH_X86 && HWY_TARGET != HWY_EMU128 && HWY_TARGET != HWY_SCALAR
  // x86's min and max return their second operand when either is NaN: a NaN x passes the clamp
  // and the rational function, with no test of its own.
  const VF clamped = hn::Min(limit, hn::Max(minus_limit, x));
#else
  const VF clamped = hn::IfThenElse(hn::IsNaN(x), x, hn::Min(hn::Max(x, minus_limit), limit));
#endif
  const VF z = hn::Mul(clamped, clamped);
  VF numerator = hn::Set(df, 1.3663458392487726e-08f * scale);
  numerator = hn::MulAdd(numerator, z, hn::Set(df, 2.0831980707288183e-05f * scale));
  numerator = hn::MulAdd(numerator, z, hn::Set(df, 3.5091362204917125e-03f * scale));
  numerator = hn::MulAdd(numerator, z, hn::Set(df, 1.3392434315878096e-01f * scale));
  numerator = hn::MulAdd(numerator, z, hn::Set(df, 9.9999998321745998e-01f * scale));
  VF denominator = hn::Set(df, 7.902955801997180e-07f);
  denominator = hn::MulAdd(denominator, z, hn::Set(df, 3.307789092288514e-04f));
  denominator = hn::MulAdd(denominator, z, hn::Set(df, 2.592852808456218e-02f));
  denominator = hn::MulAdd(denominator, z, hn::Set(df, 4.672575296450575e-01f));
  denominator = hn::MulAdd(denominator, z, hn::Set(df, 1.0f));
  VF reciprocal = hn::ApproximateReciprocal(denominator);  // Q >= 1: no overflow, no zero
  reciprocal = hn::Mul(reciprocal, hn::NegMulAdd(denominator, reciprocal, hn::Set(df, 2.0f)));  // Newton
  return hn::Mul(hn::Mul(clamped, numerator), reciprocal);
}

// ---- Step "softcap": s <- softcap * tanh(s / softcap) over n floats (a whole number of
// vectors): a whole tile at once, since softcap does not depend on positions. When
// softcap_slope is given, it receives d(capped)/d(raw) = 1 - tanh^2 per score, for the backward.
// The cap is folded into ScaledTanh's numerator for caps in [1e-30, 1e30]; past them the folded
// coefficients would overflow (x P(x^2) reaches about 418 cap at the clamp) or go subnormal, and
// 1 / cap may be infinite, so extreme caps divide, take tanh, multiply and keep |s| <= cap.
HWY_INLINE void Softcap(const AttentionProblem& p, float* HWY_RESTRICT s, size_t n,
                        float* HWY_RESTRICT softcap_slope = nullptr) {
  if (!(p.softcap > 0)) return;
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const float cap = p.softcap;  // a local: the stores to s would make p.softcap a load per vector
  const VF one = hn::Set(df, 1.0f);
  if (cap >= 1e-30f && cap <= 1e30f) {
    const VF inverse_cap = hn::Set(df, 1.0f / cap);
    for (size_t x = 0; x < n; x += lanes) {
      const VF capped = ScaledTanh(hn::Mul(hn::Load(df, s + x), inverse_cap), cap);
      hn::Store(capped, df, s + x);
      if (softcap_slope) {  // the backward's logits are the forward's, bit for bit
        const VF t = hn::Mul(capped, inverse_cap);
        hn::Store(hn::NegMulAdd(t, t, one), df, softcap_slope + x);
      }
    }
    return;
  }
  const VF cap_vec = hn::Set(df, cap);
  for (size_t x = 0; x < n; x += lanes) {
    const VF t = ScaledTanh(hn::Div(hn::Load(df, s + x), cap_vec), 1.0f);
    const VF capped = hn::Mul(t, cap_vec);  // NaN stays NaN: the comparison below is false for it
    const VF kept = hn::IfThenElse(hn::Gt(hn::Abs(capped), cap_vec), hn::CopySign(cap_vec, capped), capped);
    hn::Store(kept, df, s + x);
    if (softcap_slope) hn::Store(hn::NegMulAdd(t, t, one), df, softcap_slope + x);
  }
}

// ---- Step "ALiBi": s <- s - slope[h] |i + Nk - Nq - j| over a line's n floats (whole vectors),
// after softcap.
HWY_INLINE void Alibi(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t n) {
  if (!p.alibi_slopes) return;
  const DF df;
  const size_t lanes = hn::Lanes(df);
  // distance(x) = |i + offset - j| = |base + x * step|, step = query_step - key_step = +-1
  const float slope = p.alibi_slopes[line.h];
  const float base = static_cast<float>(line.i0 + p.alibi_offset() - line.j0);
  const float step = static_cast<float>(line.query_step - line.key_step);
  const VF steps = hn::Mul(hn::Iota(df, 0.0f), hn::Set(df, step));
  const VF slope_vec = hn::Set(df, slope);
  for (size_t x = 0; x < n; x += lanes) {
    const VF distance = hn::Abs(hn::Add(steps, hn::Set(df, base + step * static_cast<float>(x))));
    hn::Store(hn::NegMulAdd(slope_vec, distance, hn::Load(df, s + x)), df, s + x);
  }
}

// ---- Step "mask", structured part: -inf where the band (band_lo <= j - i <= band_hi) or the
// key length (j < key_lengths[b]) hides the key; only hidden elements are written.
//
// A tile of key lines (flash's, its backward's, their strided residues'): line l the key
// j0 + l key_step over queries i0 + x q (q > 0, x < br, whole vectors), lines br floats apart.
// Each line sees its key in one run of lanes, x in [ceil((j - i0 - band_hi) / q),
// floor((j - i0 - band_lo) / q)] (empty past the key length): the vectors outside the run are
// stored -inf whole, the one or two it cuts by a masked store, those inside are not touched. A
// causal diagonal tile (64 key lines of 48 queries) took 246-248 ns, against 423-429 when each
// line was its own call testing both edges and the key length lane by lane (Sapphire
// Rapids-class core, qkv_step_benchmark's Step/MaskCausal, alternated).
HWY_INLINE int64_t FloorDiv(int64_t a, int64_t q) { return a >= 0 ? a / q : -((-a + q - 1) / q); }

// Band edges within +-2^61 (Mask's unbounded is 2^60), so that j - i0 - edge cannot overflow.
constexpr int64_t kBandEdgeFar = int64_t{1} << 61;

HWY_INLINE void MaskBandLines(const AttentionProblem& p, int64_t b, int64_t i0, int64_t q, int64_t j0,
                              int64_t key_step, float* HWY_RESTRICT s, size_t br, size_t lines) {
  const DF df;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(df)), count = static_cast<int64_t>(br);
  const VF minus_inf = hn::Set(df, kMinusInf);
  const int64_t key_length = p.key_lengths[static_cast<size_t>(b)];
  constexpr int64_t kFar = kBandEdgeFar;
  const int64_t hi = std::clamp(p.band_hi, -kFar, kFar), lo = std::clamp(p.band_lo, -kFar, kFar);
  for (size_t l = 0; l < lines; ++l) {
    const int64_t key = j0 + static_cast<int64_t>(l) * key_step, from_i0 = key - i0;
    int64_t first = 0, end = 0;  // the visible run of lanes
    // ceil((j - i0 - hi) / q) and floor((j - i0 - lo) / q) + 1, without a division when q = 1
    if (key < key_length) {
      first = std::clamp<int64_t>(q == 1 ? from_i0 - hi : -FloorDiv(hi - from_i0, q), 0, count);
      end = std::clamp<int64_t>((q == 1 ? from_i0 - lo : FloorDiv(from_i0 - lo, q)) + 1, first, count);
    }
    float* HWY_RESTRICT line = s + l * br;
    for (int64_t x = 0; x < count; x += lanes) {
      if (x >= first && x + lanes <= end) continue;  // all visible
      if (x + lanes <= first || x >= end) {          // all hidden
        hn::Store(minus_inf, df, line + x);
        continue;
      }
      const auto seen = hn::AndNot(hn::FirstN(df, static_cast<size_t>(std::max<int64_t>(first - x, 0))),
                                   hn::FirstN(df, static_cast<size_t>(std::min(end - x, lanes))));
      hn::BlendedStore(minus_inf, hn::Not(seen), df, line + x);
    }
  }
}

// The first line of a tile of consecutive keys (from j0) and queries (from i0, in lanes) from
// which the band hides every lane of query vector v, as MaskBandLines decides (a vector whose
// lanes all lie before the first visible one: key j >= i0 + band_hi + (v + 1) lanes), clamped to
// [0, lines). On the causal diagonal the products may skip vector v's lines from there on: the
// mask stores -inf in them whatever the scores held, and their weights are 0.
HWY_INLINE size_t BandHidesVectorFrom(const AttentionProblem& p, int64_t i0, int64_t j0, size_t v, size_t lines) {
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(DF()));
  const int64_t hi = std::clamp(p.band_hi, -kBandEdgeFar, kBandEdgeFar);
  return static_cast<size_t>(
      std::clamp<int64_t>(i0 + hi + static_cast<int64_t>(v + 1) * lanes - j0, 0, static_cast<int64_t>(lines)));
}

// One line of n floats (whole vectors): a line of one key over queries as above, any other
// (decode's one query over keys) lane by lane.
HWY_INLINE void MaskBand(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t n) {
  if (line.key_step == 0 && line.query_step > 0)
    return MaskBandLines(p, line.b, line.i0, line.query_step, line.j0, 0, s, n, 1);
  const DF df;
  const DI di;
  const size_t lanes = hn::Lanes(df);
  const int32_t diagonal_step = static_cast<int32_t>(line.key_step - line.query_step);  // of j - i
  const int32_t key_step = static_cast<int32_t>(line.key_step);
  const auto lanes_index = hn::Iota(di, 0);
  const auto lo = hn::Set(di, ClampEdge(p.band_lo)), hi = hn::Set(di, ClampEdge(p.band_hi));
  const auto key_len = hn::Set(di, ClampEdge(p.key_lengths[static_cast<size_t>(line.b)]));
  const VF minus_inf = hn::Set(df, kMinusInf);
  for (size_t x = 0; x < n; x += lanes) {
    const auto diagonal = hn::Add(hn::Mul(lanes_index, hn::Set(di, diagonal_step)),
                                  hn::Set(di, ClampEdge(line.key(x) - line.query(x))));
    const auto key = hn::Add(hn::Mul(lanes_index, hn::Set(di, key_step)), hn::Set(di, ClampEdge(line.key(x))));
    const auto visible = hn::And(hn::And(hn::Not(hn::Lt(diagonal, lo)), hn::Not(hn::Gt(diagonal, hi))),
                                 hn::Lt(key, key_len));
    hn::BlendedStore(minus_inf, hn::RebindMask(df, hn::Not(visible)), df, s + x);
  }
}

// ---- Step "mask", tensor terms, in the reference's order (after the band), over the `count`
// real elements of a line: a keep 0 hides, an additive term adds (-inf hides even a NaN score).
HWY_INLINE void MaskTerms(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t count) {
  for (const MaskTermView& term : p.terms) {
    const float* values = term.data + line.b * term.stride_b + line.h * term.stride_h + line.i0 * term.stride_q +
                          line.j0 * term.stride_k;
    const int64_t step = line.query_step * term.stride_q + line.key_step * term.stride_k;
    for (size_t x = 0; x < count; ++x) {
      const float value = values[static_cast<int64_t>(x) * step];
      if (term.additive) {
        s[x] = value == kMinusInf ? kMinusInf : s[x] + value;
      } else if (value == 0.0f) {
        s[x] = kMinusInf;
      }
    }
  }
}

// ---- Step "mask", the symbolic rule (mask/rule.hpp): visible[x] = 1 where node `node` lets
// element x of the line through, else 0, over n floats (whole vectors, at most kRuleLine). Band,
// key lengths, global and strided rules run in SIMD from the line's coordinates; block layouts
// and keep tensors are read for the `count` real elements only (the rest get 0).
constexpr size_t kRuleLine = 256;
inline void RuleLine(const MaskRule& rule, int node, const Line& line, size_t n, size_t count,
                     float* HWY_RESTRICT visible) {
  using Kind = Mask::Rule::Kind;
  const DF df;
  const DI di;
  const size_t lanes = hn::Lanes(df);
  const RuleNode& r = rule.nodes[static_cast<size_t>(node)];
  const auto iota = hn::Iota(di, 0);
  const VF one = hn::Set(df, 1.0f);
  auto store = [&](size_t x, auto mask) HWY_ATTR { hn::Store(hn::IfThenElseZero(hn::RebindMask(df, mask), one), df, visible + x); };
  // Along a line, i - j moves by query_step - key_step per element, j by key_step, i by query_step.
  const int32_t diff_step = static_cast<int32_t>(line.query_step - line.key_step);
  auto lane_values = [&](int64_t base, int32_t step) HWY_ATTR { return hn::Add(hn::Set(di, ClampEdge(base)), hn::Mul(iota, hn::Set(di, step))); };
  switch (r.kind) {
    case Kind::And:
    case Kind::Or: {
      alignas(64) float right[kRuleLine];
      RuleLine(rule, r.left, line, n, count, visible);
      RuleLine(rule, r.right, line, n, count, right);
      for (size_t x = 0; x < n; x += lanes) {
        const VF a = hn::Load(df, visible + x), c = hn::Load(df, right + x);
        hn::Store(r.kind == Kind::And ? hn::Min(a, c) : hn::Max(a, c), df, visible + x);
      }
      return;
    }
    case Kind::Band:
      for (size_t x = 0; x < n; x += lanes) {
        const auto d = lane_values(line.key(x) - line.query(x), -diff_step);  // j - i
        store(x, hn::And(hn::Not(hn::Lt(d, hn::Set(di, ClampEdge(r.lo)))), hn::Not(hn::Gt(d, hn::Set(di, ClampEdge(r.hi))))));
      }
      return;
    case Kind::KeyLengths: {
      const auto length = hn::Set(di, ClampEdge(r.lengths[static_cast<size_t>(line.b)]));
      for (size_t x = 0; x < n; x += lanes)
        store(x, hn::Lt(lane_values(line.key(x), static_cast<int32_t>(line.key_step)), length));
      return;
    }
    case Kind::Global: {
      const auto global = hn::Set(di, ClampEdge(r.count));
      for (size_t x = 0; x < n; x += lanes)
        store(x, hn::Or(hn::Lt(lane_values(line.key(x), static_cast<int32_t>(line.key_step)), global),
                        hn::Lt(lane_values(line.query(x), static_cast<int32_t>(line.query_step)), global)));
      return;
    }
    case Kind::Strided:
      if (r.stride >= 2 * static_cast<int64_t>(lanes) * std::max<int64_t>(std::abs(diff_step), 1)) {
        // e = (offset + i - j) mod stride moved into (-stride/2, stride/2]: within a vector it
        // moves by less than stride/2 (lanes |diff_step| <= stride / 2), so a lane is visible
        // exactly when it reaches 0. Lines of larger steps (the strided residues) go scalar.
        for (size_t x = 0; x < n; x += lanes) {
          int64_t e = floor_mod(r.offset + line.query(x) - line.key(x), r.stride);
          if (e > r.stride / 2) e -= r.stride;
          store(x, hn::Eq(lane_values(e, diff_step), hn::Zero(di)));
        }
        return;
      }
      for (size_t x = 0; x < n; ++x)
        visible[x] = floor_mod(r.offset + line.query(x) - line.key(x), r.stride) == 0 ? 1.0f : 0.0f;
      return;
    case Kind::BlockSparse:
    case Kind::Keep:
      for (size_t x = 0; x < n; ++x)
        visible[x] = x < count && rule.visible(line.b, line.h, line.query(x), line.key(x), node) ? 1.0f : 0.0f;
      return;
  }
}

// -inf where the rule hides the key, over n floats (whole vectors), `count` of them real.
HWY_INLINE void MaskRuleStep(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t n,
                             size_t count) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const VF minus_inf = hn::Set(df, kMinusInf), zero = hn::Zero(df);
  alignas(64) float visible[kRuleLine];
  for (size_t x0 = 0; x0 < n; x0 += kRuleLine) {
    const size_t m = std::min(kRuleLine, n - x0);
    const int64_t at = static_cast<int64_t>(x0);
    const Line part{line.b, line.h, line.i0 + at * line.query_step, line.j0 + at * line.key_step, line.query_step,
                    line.key_step};
    RuleLine(p.rule, p.rule.root(), part, m, count > x0 ? count - x0 : 0, visible);
    for (size_t x = 0; x < m; x += lanes) {
      const VF shown = hn::Load(df, visible + x);
      hn::Store(hn::IfThenElse(hn::Eq(shown, zero), minus_inf, hn::Load(df, s + x0 + x)), df, s + x0 + x);
    }
  }
}

// The complement: -inf where node `node` of the rule shows the key, over the `count` real
// elements of a line (at most kRuleLine). A kernel that visits some pairs apart (the strided
// residues) hides there what its tiles already visit.
HWY_INLINE void MaskWhereRuleShows(const MaskRule& rule, int node, const Line& line, float* HWY_RESTRICT s,
                                   size_t count) {
  const size_t lanes = hn::Lanes(DF());
  alignas(64) float visible[kRuleLine];
  RuleLine(rule, node, line, (count + lanes - 1) / lanes * lanes, count, visible);
  for (size_t x = 0; x < count; ++x)
    if (visible[x] != 0.0f) s[x] = kMinusInf;
}

// ---- The strided residues (flash, flash backward): a root `rest | strided(S, O)` rule's strided
// keys run apart as dense tiles of queries i0, i0 + S, ... against keys j0, j0 + S, ....
// Their query tile: kResidueVectors vectors, so that the micro-GEMM still runs 8 accumulator
// chains (kTileRows x vectors) while a residue's few queries waste few lanes (W6: 64 queries a
// residue, each seeing the residue's earlier keys).
constexpr size_t kResidueVectors = tile_gemm::kTileRows >= 8 ? 1 : 2;
HWY_INLINE size_t ResidueTileRows() { return kResidueVectors * hn::Lanes(DF()); }

// Where a kernel's tile of queries and keys sits: query x (a lane) is i0 + x * query_step, key c
// of the key tile is j0 + c * key_step. The tiles walk steps 1; a strided residue walks steps S.
struct Walk {
  int64_t query_step = 1, key_step = 1;
  bool residue = false;
};

// How a tile is masked per element: `band` the band and key lengths (and in the tiles, the
// rule); in a residue, `hide` >= 0 the rule node whose pairs the tiles visit instead.
struct TileMask {
  bool band = false;
  int hide = -1;
};

// Rows first, first + step, ... of an operand, as rows 0, 1, ... of a view (a residue's queries or keys).
template <class T>
HWY_INLINE Rows<T> EveryStepRows(const Rows<T>& rows, int64_t first, int64_t step) {
  return {rows.data + first * rows.row_stride, rows.batch_stride, rows.head_stride, rows.row_stride * step};
}

// Prefetches rows first, first + step, ... (`count` of them, `floats` each) of head (b, h) into
// L2 (locality hint 2: prefetcht1 on x86), for writing when `write`, so that a kernel fetches the
// rows it reads next while it computes: rows a stride apart (a residue's) defeat the hardware
// prefetchers, and contiguous ones read in bursts (a query tile's) outrun them.
template <class T>
HWY_INLINE void PrefetchRows(const Rows<T>& rows, int64_t b, int64_t h, int64_t first, int64_t step, int64_t count,
                             int64_t floats, bool write = false) {
  for (int64_t x = 0; x < count; ++x) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(rows.row(b, h, first + x * step));
    const uintptr_t end = begin + static_cast<uintptr_t>(floats) * sizeof(T);
    for (uintptr_t line = begin & ~uintptr_t{63}; line < end; line += 64) {
      if (write) {
        __builtin_prefetch(reinterpret_cast<const void*>(line), 1, 2);
      } else {
        __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
      }
    }
  }
}

// ALiBi and mask on a whole line (softcap ran on the whole tile before): n floats computed
// (whole vectors), `count` of them real. `band` false skips the structured mask and the rule (a
// tile every query of it fully sees). `hide` >= 0 (decode's gathered strided keys, as
// TileLogits' residues): -inf where node `hide` of the rule shows the key, in place of the rule
// (the strided rule holds by construction; the tiles visit what `hide` shows).
HWY_INLINE void ScoresToLogits(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t n,
                               size_t count, bool band, int hide = -1) {
  Alibi(p, line, s, n);
  if (band) MaskBand(p, line, s, n);
  if (hide >= 0) {
    MaskWhereRuleShows(p.rule, hide, line, s, count);
  } else if (band && !p.rule.empty()) {
    MaskRuleStep(p, line, s, n, count);
  }
  MaskTerms(p, line, s, count);
}

// Step "diagonal trim": the lines (keys) of a tile each query vector's products need, on the
// causal diagonal. trim[v] (v < vectors) = the line from which the band hides every query of
// vector v (BandHidesVectorFrom; trim[vectors - 1] = lines), so vectors v, ..., vectors - 1 run
// on lines [trim[v - 1], trim[v]) (trim[-1] = 0): the products that make scores need not compute
// what the mask overwrites with -inf, and those that take weights or dS need not add their zeros.
// Only for tiles of consecutive keys and queries whose mask is the band and the rule (which hide,
// never show): an additive term could make a hidden pair's weight NaN (+inf + -inf), which the
// float32 products carry on.
HWY_INLINE void DiagonalTrim(const AttentionProblem& p, const Walk& walk, const TileMask& mask, int64_t i0, int64_t j0,
                             size_t lines, size_t vectors, size_t* HWY_RESTRICT trim) {
  std::fill_n(trim, vectors, lines);
  if (!mask.band || walk.key_step != 1 || walk.query_step != 1 || walk.residue || !p.terms.empty()) return;
  for (size_t v = 0; v + 1 < vectors; ++v) trim[v] = BandHidesVectorFrom(p, i0, j0, v, lines);
}

// ALiBi and mask on a tile of key lines (flash's and its backward's; softcap ran on the whole
// tile before): line l the key j0 + l walk.key_step over br queries i0 + x walk.query_step,
// `rows` of them real, lines br floats apart. In the reference's order: ALiBi line by line (when
// the problem has slopes), the band and key lengths for all lines at once (MaskBandLines), then
// line by line the rule (a residue's: -inf where node `hide` of the rule shows the key, the pairs
// the tiles visit; the strided rule holds by construction) and the tensor terms. (ALiBi after the
// band would differ where slope x distance overflows without FMA: -inf + inf.) `mask.band` false
// skips the band and the rule (a tile every query of it fully sees).
HWY_INLINE void TileLogits(const AttentionProblem& p, const Walk& walk, const TileMask& mask, int64_t b, int64_t h,
                           int64_t i0, size_t rows, int64_t j0, size_t cols, size_t br, float* HWY_RESTRICT s) {
  const auto line = [&](size_t l) {
    return Line{b, h, i0, j0 + static_cast<int64_t>(l) * walk.key_step, walk.query_step, 0};
  };
  if (p.alibi_slopes)
    for (size_t l = 0; l < cols; ++l) Alibi(p, line(l), s + l * br, br);
  if (mask.band) MaskBandLines(p, b, i0, walk.query_step, j0, walk.key_step, s, br, cols);
  const bool rule = walk.residue ? mask.hide >= 0 : mask.band && !p.rule.empty();
  if (!rule && p.terms.empty()) return;
  for (size_t l = 0; l < cols; ++l) {
    const Line at = line(l);
    float* HWY_RESTRICT scores = s + l * br;
    if (rule && walk.residue) {
      MaskWhereRuleShows(p.rule, mask.hide, at, scores, rows);
    } else if (rule) {
      MaskRuleStep(p, at, scores, br, rows);
    }
    MaskTerms(p, at, scores, rows);
  }
}

// ---- Step "dropout": a kept weight is scaled by 1 / (1 - p), a dropped one is 0, over the
// `count` real elements of a line. Also the backward's dP = keep ? dP' / (1 - p) : 0.
HWY_INLINE void Dropout(const AttentionProblem& p, const Line& line, float* HWY_RESTRICT s, size_t count) {
  const float survivor_scale = 1.0f / (1.0f - p.dropout_p);
  for (size_t x = 0; x < count; ++x)
    s[x] = dropout_keeps(p, line.b, line.h, line.query(x), line.key(x)) ? s[x] * survivor_scale : 0.0f;
}

// ---- Step "softmax", the start of a row: the sink, if any, is a key with no value seen first:
// running max = sink, sum = exp(sink - sink) = 1; without one, max -inf and sum 0.
HWY_INLINE float InitialMax(const AttentionProblem& p, int64_t h) { return p.sink(h); }
HWY_INLINE float InitialSum(const AttentionProblem& p) { return p.sinks ? 1.0f : 0.0f; }

// ---- Step "softmax"'s exponential: e^x for x <= 88 (softmax passes s - max <= 0), within 1 ulp
// (0.85 at worst over [-87.3, 0], against a double exp, with FMA; 1.14 on targets without, which
// round each product apart: tests/attention/test_steps.cpp), in 12 vector ops on AVX-512 and 14 elsewhere,
// where Highway's general Exp takes about 25 (a W0 tile's softmax: 0.96 us of its 4.5 with
// hn::Exp, qkv_step_benchmark).
// x = n ln2 + r with n = round(x / ln2) and |r| <= ln2 / 2 (Cody-Waite: ln2 in two parts, so r is
// exact); e^r = 1 + r + r^2 q(r), q of degree 4 fitted for the least worst relative error over
// that interval (4e-9; degree-7 Taylor, one FMA more, had 1.4e-9; degree 3's 1e-7 would cost up
// to an ulp), which keeps e^0 exactly 1. 2^n is applied by AVX-512's scalef, or elsewhere put in
// the exponent bits: the rounding adds 1.5 * 2^23 + 127, which leaves n + 127 in the low mantissa
// bits, ready to shift into the exponent. Below ln(FLT_MIN) (-87.34: 2^n would not be a normal
// float) the result is 0, -inf included; NaN stays NaN.
template <class D, class V>
HWY_INLINE V ExpSoftmax(D d, V x) {
  const V shifted = hn::MulAdd(x, hn::Set(d, 1.44269504088896341f), hn::Set(d, 12582912.0f + 127.0f));
  const V n = hn::Sub(shifted, hn::Set(d, 12582912.0f + 127.0f));
  V r = hn::MulAdd(n, hn::Set(d, -0.693145751953125f), x);
  r = hn::MulAdd(n, hn::Set(d, -1.428606765330187045e-6f), r);
  V e = hn::Set(d, 1.381461275741458e-3f);
  e = hn::MulAdd(e, r, hn::Set(d, 8.368710055947304e-3f));
  e = hn::MulAdd(e, r, hn::Set(d, 4.166838899254799e-2f));
  e = hn::MulAdd(e, r, hn::Set(d, 1.666652113199234e-1f));
  e = hn::MulAdd(e, r, hn::Set(d, 4.999999403953552e-1f));
  e = hn::MulAdd(e, r, hn::Set(d, 1.0f));
  e = hn::MulAdd(e, r, hn::Set(d, 1.0f));
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3  // every AVX-512 target, later ones included
  if constexpr (hn::MaxLanes(D()) == 16) {
    // One compare (not less than the bound: true for NaN, which passes) and one zero-masked
    // scalef, where the exponent bits take a shift, a multiply, a compare and a blend.
    const __mmask16 normal = _mm512_cmp_ps_mask(x.raw, hn::Set(d, -87.33654f).raw, _CMP_NLT_UQ);
    return V{_mm512_maskz_scalef_ps(normal, e.raw, n.raw)};
  }
#endif
  const hn::RebindToSigned<D> di;
  const V two_to_n = hn::BitCast(d, hn::ShiftLeft<23>(hn::BitCast(di, shifted)));
  return hn::IfThenZeroElse(hn::Lt(x, hn::Set(d, -87.33654f)), hn::Mul(e, two_to_n));
}

// ---- Step "softmax", queries in the lanes (flash): one tile of Bc key lines of V vectors of
// queries (br = V lanes). For each query: the new running max over the tile, the factor
// exp(old - new) that moves what was accumulated to it (into `correction`), P = exp(S - max) in
// place (hidden keys give exactly 0) and the running sum. Returns whether any query's max grew.
// A NaN score, whatever the max, has a NaN weight, which makes its query's running sum NaN for
// good; FinishColumns poisons the row from that, as the reference's softmax does. (A +inf score's
// weight, exp(inf - inf), is NaN too: output, lse and row_sum NaN in both kernels, row_max NaN
// here and +inf in the reference.) Noting NaN in the max pass instead took two of its three
// vector ops per vector, which on the Sapphire Rapids-class Xeon, where every 512-bit op takes
// one of the two FMA ports' slots, cost time (docs/performance.md). Both passes go key line by
// key line over all V vectors, so each step has V independent chains (the max's: 2 V, even and
// odd lines): one vector at a time, the exponentials of a 64-key tile waited on the max pass and
// on each other's latency.
template <size_t V>
HWY_INLINE bool SoftmaxColumnsUpdate(float* HWY_RESTRICT scores, size_t cols, float* HWY_RESTRICT running_max,
                                     float* HWY_RESTRICT row_sum, float* HWY_RESTRICT correction) {
  const DF df;
  const size_t lanes = hn::Lanes(df), br = V * lanes;
  const VF minus_inf = hn::Set(df, kMinusInf);
  VF tile_max[V], odd_max[V];
  HWY_UNROLL(4)
  for (size_t n = 0; n < V; ++n) tile_max[n] = odd_max[n] = minus_inf;
  size_t j = 0;
  for (; j + 2 <= cols; j += 2) {
    HWY_UNROLL(4)
    for (size_t n = 0; n < V; ++n) {
      tile_max[n] = hn::Max(tile_max[n], hn::Load(df, scores + j * br + n * lanes));
      odd_max[n] = hn::Max(odd_max[n], hn::Load(df, scores + (j + 1) * br + n * lanes));
    }
  }
  if (j < cols) {
    HWY_UNROLL(4)
    for (size_t n = 0; n < V; ++n) tile_max[n] = hn::Max(tile_max[n], hn::Load(df, scores + j * br + n * lanes));
  }
  bool max_grew = false;
  VF safe_max[V], tile_sum[V];
  HWY_UNROLL(4)
  for (size_t n = 0; n < V; ++n) {
    const size_t at = n * lanes;
    // A query that has seen no visible key yet keeps -inf and is exponentiated against 0
    // instead, so its scores (all -inf) give exp = 0, never the NaN of exp(-inf - -inf).
    const VF old_max = hn::Load(df, running_max + at);
    const VF new_max = hn::Max(old_max, hn::Max(tile_max[n], odd_max[n]));
    safe_max[n] = hn::IfThenZeroElse(hn::Eq(new_max, minus_inf), new_max);
    const VF factor = hn::Exp(df, hn::Sub(old_max, safe_max[n]));  // 1 when the max did not grow
    max_grew = max_grew || !hn::AllTrue(df, hn::Eq(old_max, new_max));
    hn::Store(new_max, df, running_max + at);
    hn::Store(factor, df, correction + at);
    tile_sum[n] = hn::Zero(df);
  }
  for (j = 0; j < cols; ++j) {
    HWY_UNROLL(4)
    for (size_t n = 0; n < V; ++n) {
      float* s = scores + j * br + n * lanes;
      const VF weight = ExpSoftmax(df, hn::Sub(hn::Load(df, s), safe_max[n]));
      hn::Store(weight, df, s);
      tile_sum[n] = hn::Add(tile_sum[n], weight);
    }
  }
  HWY_UNROLL(4)
  for (size_t n = 0; n < V; ++n) {
    const size_t at = n * lanes;
    hn::Store(hn::MulAdd(hn::Load(df, row_sum + at), hn::Load(df, correction + at), tile_sum[n]), df, row_sum + at);
  }
  return max_grew;
}

// Ot (d, br) moves to the new max: each query's column times its correction factor.
HWY_INLINE void RescaleColumns(float* HWY_RESTRICT out_t, size_t d, size_t br, const float* HWY_RESTRICT correction) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  for (size_t c = 0; c < d; ++c)
    for (size_t n = 0; n < br; n += lanes) {
      float* o = out_t + c * br + n;
      hn::Store(hn::Mul(hn::Load(df, o), hn::Load(df, correction + n)), df, o);
    }
}

// ---- Step "finish", queries in the lanes (flash): finish_row's values for br queries at once
// (a scalar log per row took 1-2% of W0): 1 / l into `inverse`, lse = max + log l into `lse`,
// and the row stats left in running_max and row_sum for the backward. A query that saw nothing
// (l = 0) gets 0 and lse -inf; one that saw a NaN score (its sum is NaN) NaN everywhere.
HWY_INLINE void FinishColumns(float* HWY_RESTRICT running_max, float* HWY_RESTRICT row_sum, size_t br,
                              float* HWY_RESTRICT inverse, float* HWY_RESTRICT lse) {
  const DF df;
  const VF one = hn::Set(df, 1.0f), nan = hn::Set(df, std::numeric_limits<float>::quiet_NaN());
  for (size_t n = 0; n < br; n += hn::Lanes(df)) {
    const VF sum = hn::Load(df, row_sum + n), max = hn::Load(df, running_max + n);
    const auto empty = hn::Eq(sum, hn::Zero(df));
    const VF safe_sum = hn::IfThenElse(empty, one, sum);
    const VF log_sum_exp = hn::Add(max, hn::Log(df, safe_sum));
    const auto poisoned = hn::IsNaN(sum);
    hn::Store(hn::IfThenElse(poisoned, nan, hn::IfThenZeroElse(empty, hn::Div(one, safe_sum))), df, inverse + n);
    hn::Store(hn::IfThenElse(poisoned, nan, hn::IfThenElse(empty, hn::Set(df, kMinusInf), log_sum_exp)), df, lse + n);
    hn::Store(hn::IfThenElse(poisoned, nan, max), df, running_max + n);
    hn::Store(hn::IfThenElse(poisoned, nan, sum), df, row_sum + n);
  }
}

// ---- Step "softmax", keys in the lanes (decode): one query's line of n scores (whole vectors).
// The same update as SoftmaxColumnsUpdate for one row, with the same exponential (ExpSoftmax,
// so decode's and flash's weights agree); a NaN score makes the running max NaN,
// which poisons the row's sum and output. Returns the factor exp(old - new) to rescale O by.
HWY_INLINE float SoftmaxRowUpdate(float* HWY_RESTRICT s, size_t n, float& running_max, float& row_sum) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  VF max_vec = hn::Set(df, kMinusInf);
  auto nan_mask = hn::IsNaN(max_vec);
  for (size_t x = 0; x < n; x += lanes) {
    const VF score = hn::Load(df, s + x);
    max_vec = hn::Max(max_vec, score);
    nan_mask = hn::Or(nan_mask, hn::IsNaN(score));
  }
  const float old_max = running_max;
  const float new_max = hn::AllFalse(df, nan_mask) ? std::max(old_max, hn::GetLane(hn::MaxOfLanes(df, max_vec)))
                                                   : std::numeric_limits<float>::quiet_NaN();
  const float safe_max = new_max == kMinusInf ? 0.0f : new_max;
  const float factor = std::exp(old_max - safe_max);
  running_max = new_max;
  const VF max_broadcast = hn::Set(df, safe_max);
  VF sum_vec = hn::Zero(df);
  for (size_t x = 0; x < n; x += lanes) {
    const VF weight = ExpSoftmax(df, hn::Sub(hn::Load(df, s + x), max_broadcast));
    hn::Store(weight, df, s + x);
    sum_vec = hn::Add(sum_vec, weight);
  }
  row_sum = row_sum * factor + hn::GetLane(hn::SumOfLanes(df, sum_vec));
  return factor;
}

// True when the `rows` rows of `cols` floats (row stride `stride`) are all finite.
HWY_INLINE bool RowsFinite(const float* HWY_RESTRICT values, size_t rows, size_t cols, int64_t stride) {
  for (size_t r = 0; r < rows; ++r)
    if (!tile_gemm::AllFinite(values + static_cast<int64_t>(r) * stride, cols)) return false;
  return true;
}

// ---- Backward step "softmax": P = exp(S - shift) * scale per query in the lanes, over a tile of
// `cols` key lines of br queries (problem.hpp: shift +inf and scale 0 give P = 0). A NaN exponent
// gives P = 0, as Highway's Exp does: a padding lane's score is NaN when a hidden key's K is
// (0 x NaN), and the backward sums P over the lanes (dV), so that NaN would reach real keys.
HWY_INLINE void RecomputeWeights(float* HWY_RESTRICT scores, size_t cols, size_t br, const float* HWY_RESTRICT shift,
                                 const float* HWY_RESTRICT scale) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  for (size_t j = 0; j < cols; ++j)
    for (size_t n = 0; n < br; n += lanes) {
      float* s = scores + j * br + n;
      const VF exponent = hn::Sub(hn::Load(df, s), hn::Load(df, shift + n));
      const VF weight = hn::IfThenZeroElse(hn::IsNaN(exponent), ExpSoftmax(df, exponent));
      hn::Store(hn::Mul(weight, hn::Load(df, scale + n)), df, s);
    }
}

// ---- Backward step "softmax": dS = P * (dP - D) in place of dP, exactly 0 where P = 0 (a hidden
// key, whose V may be NaN), then through softcap's slope when given (ALiBi and additive terms
// pass dS through unchanged).
HWY_INLINE void SoftmaxGradient(const float* HWY_RESTRICT weights, float* HWY_RESTRICT grad, size_t cols, size_t br,
                                const float* HWY_RESTRICT row_dot, const float* HWY_RESTRICT softcap_slope) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const VF zero = hn::Zero(df);
  for (size_t j = 0; j < cols; ++j)
    for (size_t n = 0; n < br; n += lanes) {
      const size_t at = j * br + n;
      const VF weight = hn::Load(df, weights + at);
      VF grad_score = hn::Mul(weight, hn::Sub(hn::Load(df, grad + at), hn::Load(df, row_dot + n)));
      if (softcap_slope) grad_score = hn::Mul(grad_score, hn::Load(df, softcap_slope + at));
      hn::Store(hn::IfThenZeroElse(hn::Eq(weight, zero), grad_score), df, grad + at);
    }
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
