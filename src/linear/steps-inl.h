// The per-target building blocks both passes of linear attention share (query_pass.cpp,
// key_pass.cpp), compiled once per Highway target: each pass's foreach_target includes this
// header inside its own per-target code, as Highway's -inl.h convention asks.
//
//   MatMul                          C (+)= A B for any n, on gemm/micro_kernel-inl.h's micro-GEMM
//   Phi, PhiRow(s), PhiColumns      the feature map, on a vector, a row, rows, rows transposed
//   PhiSlope, TimesPhiSlope         its derivative, and the chain rule through it
//   Transpose, Scratch              a copy transposed; one worker's view of its ScratchLayout

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_LINEAR_STEPS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_LINEAR_STEPS_INL_H_
#undef QKV_LINEAR_STEPS_INL_H_
#else
#define QKV_LINEAR_STEPS_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "gemm/micro_kernel-inl.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "linear/problem.hpp"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail::linear {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace tile_gemm = qkv::detail::HWY_NAMESPACE::tile_gemm;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

inline size_t RoundUpToLanes(size_t n) {
  const size_t lanes = hn::Lanes(DF());
  return std::min((n + lanes - 1) / lanes * lanes, kChunk);
}

// C[m x n] (+)= A[m x depth] B[depth x n] for any n: the micro-GEMM on whole vectors of columns,
// a scalar loop on the rest. A(r, k) = a[r * a_row + k * a_depth]; B row k at b + k * ldb.
inline void MatMul(size_t m, size_t n, size_t depth, const float* a, size_t a_row, size_t a_depth, const float* b,
                   size_t ldb, float* c, size_t ldc, bool accumulate) {
  if (m == 0 || n == 0) return;
  const size_t lanes = hn::Lanes(DF());
  const size_t vector_cols = n / lanes * lanes;
  if (vector_cols > 0) tile_gemm::Gemm(m, vector_cols, depth, a, a_row, a_depth, b, ldb, c, ldc, accumulate);
  for (size_t r = 0; r < m; ++r)
    for (size_t col = vector_cols; col < n; ++col) {
      float sum = accumulate ? c[r * ldc + col] : 0.0f;
      for (size_t k = 0; k < depth; ++k) sum += a[r * a_row + k * a_depth] * b[k * ldb + col];
      c[r * ldc + col] = sum;
    }
}

// phi on one vector, and its scalar twin for the tails.
HWY_INLINE VF Phi(FeatureMap map, VF x) {
  const DF df;
  if (map == FeatureMap::Relu) return hn::Max(x, hn::Zero(df));
  return hn::IfThenElse(hn::Gt(x, hn::Zero(df)), hn::Add(x, hn::Set(df, 1.0f)), hn::Exp(df, x));
}
HWY_INLINE float PhiScalar(FeatureMap map, float x) {
  if (map == FeatureMap::Relu) return x > 0.0f ? x : 0.0f;
  return x > 0.0f ? x + 1.0f : std::exp(x);
}
// phi'(x), for the backward: 1 above 0; below, exp(x) (elu + 1) or 0 (relu).
HWY_INLINE VF PhiSlope(FeatureMap map, VF x) {
  const DF df;
  const auto positive = hn::Gt(x, hn::Zero(df));
  if (map == FeatureMap::Relu) return hn::IfThenElseZero(positive, hn::Set(df, 1.0f));
  return hn::IfThenElse(positive, hn::Set(df, 1.0f), hn::Exp(df, x));
}
HWY_INLINE float PhiSlopeScalar(FeatureMap map, float x) {
  if (map == FeatureMap::Relu) return x > 0.0f ? 1.0f : 0.0f;
  return x > 0.0f ? 1.0f : std::exp(x);
}

// out[f] = phi(x[f]) for f < d.
inline void PhiRow(FeatureMap map, const float* HWY_RESTRICT x, size_t d, float* HWY_RESTRICT out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  size_t f = 0;
  for (; f + lanes <= d; f += lanes) hn::StoreU(Phi(map, hn::LoadU(df, x + f)), df, out + f);
  for (; f < d; ++f) out[f] = PhiScalar(map, x[f]);
}

// out[f] *= phi'(x[f]) for f < d (the chain rule through phi).
inline void TimesPhiSlope(FeatureMap map, const float* HWY_RESTRICT x, size_t d, float* HWY_RESTRICT out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  size_t f = 0;
  for (; f + lanes <= d; f += lanes)
    hn::StoreU(hn::Mul(hn::LoadU(df, out + f), PhiSlope(map, hn::LoadU(df, x + f))), df, out + f);
  for (; f < d; ++f) out[f] *= PhiSlopeScalar(map, x[f]);
}

// phi of `rows` rows (row r at x + r * stride), row-major into out (rows, d).
inline void PhiRows(FeatureMap map, const float* x, int64_t stride, size_t rows, size_t d, float* out) {
  for (size_t r = 0; r < rows; ++r) PhiRow(map, x + static_cast<int64_t>(r) * stride, d, out + r * d);
}

// phi of `rows` rows, transposed into out (d, kChunk): column r is row r's features; the columns
// from `rows` up to the next whole vector are zeros. `row` is (d) of scratch.
inline void PhiColumns(FeatureMap map, const float* x, int64_t stride, size_t rows, size_t d,
                       float* HWY_RESTRICT row, float* HWY_RESTRICT out) {
  for (size_t r = 0; r < rows; ++r) {
    PhiRow(map, x + static_cast<int64_t>(r) * stride, d, row);
    for (size_t f = 0; f < d; ++f) out[f * kChunk + r] = row[f];
  }
  const size_t padded = RoundUpToLanes(rows);
  for (size_t f = 0; f < d; ++f) std::fill(out + f * kChunk + rows, out + f * kChunk + padded, 0.0f);
}

// dst (cols, rows) = src (rows, cols)^T; src row r at src + r * ld_src, dst row c at dst + c * ld_dst.
inline void Transpose(const float* HWY_RESTRICT src, size_t rows, size_t cols, size_t ld_src,
                      float* HWY_RESTRICT dst, size_t ld_dst) {
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
}

inline size_t Stride(const Rows<const float>& rows) { return static_cast<size_t>(rows.row_stride); }

// One worker's view of its scratch (ScratchLayout).
struct Scratch {
  float *state, *z, *qf, *kft, *kf, *scores, *out, *den, *row, *vt, *st, *dqf, *dv_rows;
  Scratch(float* base, const ScratchLayout& l)
      : state(base + l.state), z(base + l.z), qf(base + l.qf), kft(base + l.kft), kf(base + l.kf),
        scores(base + l.scores), out(base + l.out), den(base + l.den), row(base + l.row), vt(base + l.vt),
        st(base + l.st), dqf(base + l.dqf), dv_rows(base + l.dv_rows) {}
};

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail::linear
HWY_AFTER_NAMESPACE();

#endif  // QKV_LINEAR_STEPS_INL_H_
