// Linear attention (include/qkv/linear_attention.hpp): out_i = phi(q_i)^T S_i / (phi(q_i).z_i +
// eps), where S_i = sum_{j < n(i)} phi(k_j) v_j^T (Dk x Dv) and z_i = sum_{j < n(i)} phi(k_j) over
// the n(i) keys query i sees (all Nk, or clamp(i + offset + 1, 0, Nk) when causal).
//
// n(i) never decreases and grows by at most 1 per query, which gives one loop for every case.
// Per work item (batch b, query head h), queries in chunks of C = kChunk, a running state (S, z)
// covering the keys [0, lo):
//
//   before the first chunk   (S, z) += the keys every query sees, [0, n(0)), C keys at a time
//   per chunk [i0, i0 + C)   inter:  O = phi(Q) S,  den = phi(Q) z          (the state's keys)
//                            intra:  A = phi(Q) phi(K[lo, n(i_last)))^T, A_xj = 0 unless
//                                    lo + j < n(i0 + x); O += A V, den += rowsum(A)
//                            state:  (S, z) += the keys [lo, n(next chunk's first query))
//                            out = O / (den + eps)
//
// Non-causal: the whole state before the first chunk, no intra block. Causal: each key enters
// the state once (Dk Dv flops) and each query pays Dk Dv (inter) + C (Dk + Dv) (intra): O(N d Dv)
// time and O(d Dv + C (d + Dv + C)) scratch per worker, never an N-sized buffer. The products are
// the flash kernel's register-tiled micro-GEMM (gemm/micro_kernel-inl.h); phi is Highway SIMD; work items
// run on OpenMP threads.
//
// The backward (same file, below the forward) is derived in docs/linear.md.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "linear/linear_attention.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "gemm/micro_kernel-inl.h"
#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

#ifndef QKV_ATTENTION_LINEAR_ONCE
#define QKV_ATTENTION_LINEAR_ONCE
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention/kernels.hpp"
#include "attention/problem.hpp"
#include "qkv/linear_attention.hpp"

namespace qkv::detail::linear {

// Queries (and keys) per chunk: the intra block is C x C, so C trades the intra work per query
// (C (Dk + Dv)) against the per-chunk overheads; a multiple of every target's lane count.
constexpr size_t kChunk = 64;

// The checked, normalised problem (built from scaled_dot_product_attention's AttentionProblem,
// whose checks and operand views it reuses) plus what the backward reads and writes.
struct Problem {
  int64_t batch, q_heads, kv_heads, q_len, kv_len, head_dim, value_dim;
  Rows<const float> q, k, v;
  FeatureMap feature_map;
  bool causal;
  int64_t offset;
  float eps;
  Rows<float> output;             // forward: (B, Hq, Nq, Dv)
  Rows<const float> grad_output;  // backward: (B, Hq, Nq, Dv)
  Rows<float> grad_q, grad_k, grad_v;
  float* g_ext;                   // backward: (B, Hq, Nq, Dv + 1), [dO_i / den_i, -dO_i.out_i / den_i]

  int64_t kv_head_of(int64_t h) const { return h / (q_heads / kv_heads); }
  // n(i): query i sees keys [0, n(i)).
  int64_t visible_keys(int64_t i) const {
    if (!causal) return kv_len;
    return std::clamp<int64_t>(i + offset + 1, 0, kv_len);
  }
  // The first query that sees key j (q_len when none does).
  int64_t first_query(int64_t j) const {
    if (!causal) return 0;
    return std::clamp<int64_t>(j - offset, 0, q_len);
  }
};

// One worker's scratch, in floats, every part on its own cache line. C = kChunk.
struct ScratchLayout {
  size_t state, z, qf, kft, kf, scores, out, den, row, vt, st, dqf, dv_rows, total;
  ScratchLayout(size_t dk, size_t dv) {
    size_t at = 0;
    auto take = [&](size_t floats) {
      const size_t start = at;
      at += round_to_cache_line(floats);
      return start;
    };
    state = take(dk * (dv + 1));     // S (Dk, Dv); backward keys: T' (Dv + 1, Dk)
    z = take(dk);                    // z (Dk)
    qf = take(kChunk * dk);          // phi(Q chunk) (C, Dk)
    kft = take(dk * kChunk);         // phi(K chunk)^T (Dk, C); backward keys: phi(Q)^T
    kf = take(kChunk * dk);          // backward: phi(K chunk) (C, Dk)
    scores = take(kChunk * kChunk);  // A (C, C), then the backward's dA
    out = take(kChunk * std::max(dv, dk));  // O (C, Dv); backward keys: dphi(K) (C, Dk)
    den = take(kChunk);              // den (C); backward: c (C)
    row = take(std::max(dk, dv));    // one row of phi
    vt = take((dv + 1) * kChunk);    // backward: V^T (Dv, C); keys: G'^T (Dv + 1, C)
    st = take(dv * dk);              // backward: S^T (Dv, Dk); keys: T (Dk, Dv)
    dqf = take(kChunk * dk);         // backward: dphi(Q) (C, Dk)
    dv_rows = take(kChunk * dv);     // backward keys: dV (C, Dv)
    total = at;
  }
};

}  // namespace qkv::detail::linear
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
namespace {

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using linear::kChunk;
using linear::Problem;

size_t RoundUpToLanes(size_t n) {
  const size_t lanes = hn::Lanes(DF());
  return std::min((n + lanes - 1) / lanes * lanes, kChunk);
}

// C[m x n] (+)= A[m x depth] B[depth x n] for any n: the micro-GEMM on whole vectors of columns,
// a scalar loop on the rest. A(r, k) = a[r * a_row + k * a_depth]; B row k at b + k * ldb.
void MatMul(size_t m, size_t n, size_t depth, const float* a, size_t a_row, size_t a_depth, const float* b,
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
void PhiRow(FeatureMap map, const float* HWY_RESTRICT x, size_t d, float* HWY_RESTRICT out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  size_t f = 0;
  for (; f + lanes <= d; f += lanes) hn::StoreU(Phi(map, hn::LoadU(df, x + f)), df, out + f);
  for (; f < d; ++f) out[f] = PhiScalar(map, x[f]);
}

// out[f] *= phi'(x[f]) for f < d (the chain rule through phi).
void TimesPhiSlope(FeatureMap map, const float* HWY_RESTRICT x, size_t d, float* HWY_RESTRICT out) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  size_t f = 0;
  for (; f + lanes <= d; f += lanes)
    hn::StoreU(hn::Mul(hn::LoadU(df, out + f), PhiSlope(map, hn::LoadU(df, x + f))), df, out + f);
  for (; f < d; ++f) out[f] *= PhiSlopeScalar(map, x[f]);
}

// phi of `rows` rows (row r at x + r * stride), row-major into out (rows, d).
void PhiRows(FeatureMap map, const float* x, int64_t stride, size_t rows, size_t d, float* out) {
  for (size_t r = 0; r < rows; ++r) PhiRow(map, x + static_cast<int64_t>(r) * stride, d, out + r * d);
}

// phi of `rows` rows, transposed into out (d, kChunk): column r is row r's features; the columns
// from `rows` up to the next whole vector are zeros. `row` is (d) of scratch.
void PhiColumns(FeatureMap map, const float* x, int64_t stride, size_t rows, size_t d, float* HWY_RESTRICT row,
                float* HWY_RESTRICT out) {
  for (size_t r = 0; r < rows; ++r) {
    PhiRow(map, x + static_cast<int64_t>(r) * stride, d, row);
    for (size_t f = 0; f < d; ++f) out[f * kChunk + r] = row[f];
  }
  const size_t padded = RoundUpToLanes(rows);
  for (size_t f = 0; f < d; ++f) std::fill(out + f * kChunk + rows, out + f * kChunk + padded, 0.0f);
}

float Dot(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, size_t n) {
  float sum = 0.0f;
  for (size_t x = 0; x < n; ++x) sum += a[x] * b[x];
  return sum;
}

// One worker's view of its scratch (linear::ScratchLayout).
struct Scratch {
  float *state, *z, *qf, *kft, *kf, *scores, *out, *den, *row, *vt, *st, *dqf, *dv_rows;
  Scratch(float* base, const linear::ScratchLayout& l)
      : state(base + l.state), z(base + l.z), qf(base + l.qf), kft(base + l.kft), kf(base + l.kf),
        scores(base + l.scores), out(base + l.out), den(base + l.den), row(base + l.row), vt(base + l.vt),
        st(base + l.st), dqf(base + l.dqf), dv_rows(base + l.dv_rows) {}
};

// dst (cols, rows) = src (rows, cols)^T; src row r at src + r * ld_src, dst row c at dst + c * ld_dst.
void Transpose(const float* HWY_RESTRICT src, size_t rows, size_t cols, size_t ld_src, float* HWY_RESTRICT dst,
               size_t ld_dst) {
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
}

size_t Stride(const Rows<const float>& rows) { return static_cast<size_t>(rows.row_stride); }

// (S, z) += the `count` keys from `from` of kv head g, whose phi(K)^T is in w.kft's first columns.
void AddToState(const Problem& p, int64_t b, int64_t g, int64_t from, size_t count, const Scratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  MatMul(dk, dv, count, w.kft, kChunk, 1, p.v.row(b, g, from), Stride(p.v), w.state, dv, true);
  for (size_t f = 0; f < dk; ++f)
    for (size_t x = 0; x < count; ++x) w.z[f] += w.kft[f * kChunk + x];
}

// (S, z) += keys [from, to) of kv head g, kChunk at a time.
void AddKeysToState(const Problem& p, int64_t b, int64_t g, int64_t from, int64_t to, const Scratch& w) {
  for (int64_t j = from; j < to; j += static_cast<int64_t>(kChunk)) {
    const size_t count = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kChunk), to - j));
    PhiColumns(p.feature_map, p.k.row(b, g, j), p.k.row_stride, count, static_cast<size_t>(p.head_dim), w.row, w.kft);
    AddToState(p, b, g, j, count, w);
  }
}

// The keys of a query chunk ending at i_end, beyond the state's [0, lo): some query of the chunk
// sees [lo, seen_end); the next chunk's first query sees [0, next).
struct ChunkKeys {
  int64_t lo, seen_end, next;
};
ChunkKeys KeysOfChunk(const Problem& p, int64_t lo, int64_t i_end) {
  const int64_t seen_end = p.visible_keys(i_end - 1);
  return {lo, seen_end, i_end < p.q_len ? p.visible_keys(i_end) : seen_end};
}

// 1 / (den + eps), or 0 when that is 0: a row whose weights are all 0 (it sees no key, or ReLU
// zeroes every product) with eps = 0 gets output 0 and gives zero gradients, as softmax
// attention's empty rows do, never 0 / 0.
float InverseDenominator(float den, float eps) {
  const float total = den + eps;
  return total == 0.0f ? 0.0f : 1.0f / total;
}

// Zeroes what query i0 + x does not see among keys [lo, lo + width) in row x of `a` (stride
// kChunk), after adding `add[x]` (when given) to what it sees; den[x] (when given) += the row's sum.
void MaskQueryRows(const Problem& p, int64_t i0, size_t rows, int64_t lo, size_t width, float* a, const float* add,
                   float* den) {
  for (size_t x = 0; x < rows; ++x) {
    float* row = a + x * kChunk;
    const int64_t seen = std::clamp<int64_t>(p.visible_keys(i0 + static_cast<int64_t>(x)) - lo, 0,
                                             static_cast<int64_t>(width));
    float sum = 0.0f;
    for (int64_t j = 0; j < seen; ++j) {
      if (add) row[j] += add[x];
      sum += row[j];
    }
    std::fill(row + seen, row + width, 0.0f);
    if (den) den[x] += sum;
  }
}

// Forward of query chunk [i0, i0 + rows) of head h: w.qf = phi(Q), w.out = O (not yet divided),
// w.den = den (without eps), w.kft = phi(K[lo, max(seen_end, next)))^T, w.scores = the intra A.
void ChunkForward(const Problem& p, int64_t b, int64_t h, int64_t i0, size_t rows, const ChunkKeys& keys,
                  const Scratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const int64_t g = p.kv_head_of(h);
  PhiRows(p.feature_map, p.q.row(b, h, i0), p.q.row_stride, rows, dk, w.qf);
  // Inter: the state's keys, seen by every query of the chunk.
  MatMul(rows, dv, dk, w.qf, dk, 1, w.state, dv, w.out, dv, false);
  for (size_t x = 0; x < rows; ++x) w.den[x] = Dot(w.qf + x * dk, w.z, dk);
  // Intra: A = phi(Q) phi(K)^T, masked; O += A V. Width <= kChunk: n(i) grows by <= 1 per query.
  const int64_t width = std::max(keys.seen_end, keys.next) - keys.lo;
  if (width <= 0) return;
  PhiColumns(p.feature_map, p.k.row(b, g, keys.lo), p.k.row_stride, static_cast<size_t>(width), dk, w.row, w.kft);
  if (keys.seen_end <= keys.lo) return;
  const size_t seen = static_cast<size_t>(keys.seen_end - keys.lo);
  MatMul(rows, RoundUpToLanes(seen), dk, w.qf, dk, 1, w.kft, kChunk, w.scores, kChunk, false);
  MaskQueryRows(p, i0, rows, keys.lo, seen, w.scores, nullptr, w.den);
  MatMul(rows, dv, seen, w.scores, kChunk, 1, p.v.row(b, g, keys.lo), Stride(p.v), w.out, dv, true);
}

// Backward of a query chunk after ChunkForward (state not yet advanced): G' = [dO / den,
// -dO.out / den] into p.g_ext; dphi(Q) = G S^T + c z^T + dA phi(K) with dA = G V^T + c masked
// (c = G's last column); dq = dphi(Q) phi'(q).
void ChunkQueryGrads(const Problem& p, int64_t b, int64_t h, int64_t i0, size_t rows, const ChunkKeys& keys,
                     const Scratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim), ldg = dv + 1;
  const int64_t g = p.kv_head_of(h);
  float* gext = p.g_ext + ((b * p.q_heads + h) * p.q_len + i0) * static_cast<int64_t>(ldg);
  for (size_t x = 0; x < rows; ++x) {
    const float* d_out = p.grad_output.row(b, h, i0 + static_cast<int64_t>(x));
    const float inverse = InverseDenominator(w.den[x], p.eps);
    float dot = 0.0f;
    for (size_t c = 0; c < dv; ++c) {
      dot += d_out[c] * w.out[x * dv + c] * inverse;
      gext[x * ldg + c] = d_out[c] * inverse;
    }
    gext[x * ldg + dv] = -dot * inverse;
    w.den[x] = gext[x * ldg + dv];  // c, for the intra block
  }
  Transpose(w.state, dk, dv, dv, w.st, dk);
  MatMul(rows, dk, dv, gext, ldg, 1, w.st, dk, w.dqf, dk, false);
  for (size_t x = 0; x < rows; ++x)
    for (size_t f = 0; f < dk; ++f) w.dqf[x * dk + f] += w.den[x] * w.z[f];
  if (keys.seen_end > keys.lo) {
    const size_t seen = static_cast<size_t>(keys.seen_end - keys.lo);
    Transpose(p.v.row(b, g, keys.lo), seen, dv, Stride(p.v), w.vt, kChunk);
    MatMul(rows, RoundUpToLanes(seen), dv, gext, ldg, 1, w.vt, kChunk, w.scores, kChunk, false);
    MaskQueryRows(p, i0, rows, keys.lo, seen, w.scores, w.den, nullptr);
    Transpose(w.kft, dk, seen, kChunk, w.kf, dk);
    MatMul(rows, dk, seen, w.scores, kChunk, 1, w.kf, dk, w.dqf, dk, true);
  }
  for (size_t x = 0; x < rows; ++x) {
    const int64_t i = i0 + static_cast<int64_t>(x);
    TimesPhiSlope(p.feature_map, p.q.row(b, h, i), dk, w.dqf + x * dk);
    std::copy_n(w.dqf + x * dk, dk, p.grad_q.row(b, h, i));
  }
}

// Every query chunk of head h of batch b in order, the state carried across: the forward
// (writes the output), or the backward's query pass (writes g_ext and dq).
void QueryPass(const Problem& p, int64_t b, int64_t h, float* HWY_RESTRICT scratch, bool backward) {
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const Scratch w(scratch, linear::ScratchLayout(dk, dv));
  const int64_t g = p.kv_head_of(h);
  std::fill_n(w.state, dk * dv, 0.0f);
  std::fill_n(w.z, dk, 0.0f);
  int64_t lo = p.q_len > 0 ? p.visible_keys(0) : 0;
  AddKeysToState(p, b, g, 0, lo, w);  // the keys every query sees (all of them when not causal)
  for (int64_t i0 = 0; i0 < p.q_len; i0 += static_cast<int64_t>(kChunk)) {
    const size_t rows = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kChunk), p.q_len - i0));
    const ChunkKeys keys = KeysOfChunk(p, lo, i0 + static_cast<int64_t>(rows));
    ChunkForward(p, b, h, i0, rows, keys, w);
    if (backward) {
      ChunkQueryGrads(p, b, h, i0, rows, keys, w);
    } else {
      for (size_t x = 0; x < rows; ++x) {
        float* out = p.output.row(b, h, i0 + static_cast<int64_t>(x));
        const float inverse = InverseDenominator(w.den[x], p.eps);
        for (size_t c = 0; c < dv; ++c) out[c] = w.out[x * dv + c] * inverse;
      }
    }
    AddToState(p, b, g, lo, static_cast<size_t>(keys.next - lo), w);
    lo = keys.next;
  }
}

void LinearForwardHead(const Problem& p, int64_t b, int64_t h, float* HWY_RESTRICT scratch) {
  QueryPass(p, b, h, scratch, false);
}
void LinearQueryGradsHead(const Problem& p, int64_t b, int64_t h, float* HWY_RESTRICT scratch) {
  QueryPass(p, b, h, scratch, true);
}

// ---- The backward's key pass: key chunks from the last, a state T' = sum_i G'_i phi(q_i)^T
// ((Dv + 1) x Dk) over the queries that see the whole chunk, carried backwards.

// T' += G'^T phi(Q) for `count` queries of head h from `from`, phi(Q) rows at qf.
void AddQueriesToState(const Problem& p, int64_t b, int64_t h, int64_t from, size_t count, const float* qf,
                       const Scratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim), ldg = static_cast<size_t>(p.value_dim) + 1;
  const float* gext = p.g_ext + ((b * p.q_heads + h) * p.q_len + from) * static_cast<int64_t>(ldg);
  MatMul(ldg, dk, count, gext, 1, ldg, qf, dk, w.state, dk, true);
}

// Zeroes, in row j of `a` (keys j0 + j, stride kChunk), the queries from + x that do not see the
// key, after adding add[x] (when given) to those that do.
void MaskKeyRows(const Problem& p, int64_t j0, size_t width, int64_t from, size_t count, float* a, const float* add) {
  for (size_t j = 0; j < width; ++j)
    for (size_t x = 0; x < count; ++x) {
      float& value = a[j * kChunk + x];
      const bool seen = j0 + static_cast<int64_t>(j) < p.visible_keys(from + static_cast<int64_t>(x));
      value = seen ? value + (add ? add[x] : 0.0f) : 0.0f;
    }
}

// Keys [j0, j0 + width) of head h's kv head: dphi(K) = [V, 1] T' + dA^T phi(Q), dV = phi(K) T^T +
// A^T G over the state's queries and the partial ones, [from, from + count) (phi(Q) at qf).
// Written (first head of the group) or added to dk and dv.
void KeyChunkGrads(const Problem& p, int64_t b, int64_t h, int64_t j0, size_t width, int64_t from, size_t count,
                   const float* qf, bool first_head, const Scratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim), ldg = dv + 1;
  const int64_t g = p.kv_head_of(h);
  const float* v_rows = p.v.row(b, g, j0);
  PhiRows(p.feature_map, p.k.row(b, g, j0), p.k.row_stride, width, dk, w.kf);
  MatMul(width, dk, dv, v_rows, Stride(p.v), 1, w.state, dk, w.out, dk, false);
  for (size_t j = 0; j < width; ++j)
    for (size_t f = 0; f < dk; ++f) w.out[j * dk + f] += w.state[dv * dk + f];
  Transpose(w.state, dv, dk, dk, w.st, dv);
  MatMul(width, dv, dk, w.kf, dk, 1, w.st, dv, w.dv_rows, dv, false);
  if (count > 0) {
    const float* gext = p.g_ext + ((b * p.q_heads + h) * p.q_len + from) * static_cast<int64_t>(ldg);
    Transpose(qf, count, dk, dk, w.kft, kChunk);
    MatMul(width, RoundUpToLanes(count), dk, w.kf, dk, 1, w.kft, kChunk, w.scores, kChunk, false);
    MaskKeyRows(p, j0, width, from, count, w.scores, nullptr);
    MatMul(width, dv, count, w.scores, kChunk, 1, gext, ldg, w.dv_rows, dv, true);
    Transpose(gext, count, ldg, ldg, w.vt, kChunk);
    MatMul(width, RoundUpToLanes(count), dv, v_rows, Stride(p.v), 1, w.vt, kChunk, w.scores, kChunk, false);
    MaskKeyRows(p, j0, width, from, count, w.scores, w.vt + dv * kChunk);
    MatMul(width, dk, count, w.scores, kChunk, 1, qf, dk, w.out, dk, true);
  }
  for (size_t j = 0; j < width; ++j) {
    const int64_t key = j0 + static_cast<int64_t>(j);
    TimesPhiSlope(p.feature_map, p.k.row(b, g, key), dk, w.out + j * dk);
    float* grad_k = p.grad_k.row(b, g, key);
    float* grad_v = p.grad_v.row(b, g, key);
    for (size_t f = 0; f < dk; ++f) grad_k[f] = (first_head ? 0.0f : grad_k[f]) + w.out[j * dk + f];
    for (size_t c = 0; c < dv; ++c) grad_v[c] = (first_head ? 0.0f : grad_v[c]) + w.dv_rows[j * dv + c];
  }
}

// The key pass of query head h (after every head's query pass wrote g_ext).
void KeyPass(const Problem& p, int64_t b, int64_t h, bool first_head, const Scratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const int64_t chunk = static_cast<int64_t>(kChunk);
  std::fill_n(w.state, (dv + 1) * dk, 0.0f);
  if (p.kv_len == 0) return;
  int64_t state_from = p.first_query(p.kv_len - 1);  // the queries that see the last key
  for (int64_t i = state_from; i < p.q_len; i += chunk) {
    const size_t count = static_cast<size_t>(std::min(chunk, p.q_len - i));
    PhiRows(p.feature_map, p.q.row(b, h, i), p.q.row_stride, count, dk, w.qf);
    AddQueriesToState(p, b, h, i, count, w.qf, w);
  }
  for (int64_t j0 = (p.kv_len - 1) / chunk * chunk; j0 >= 0; j0 -= chunk) {
    const size_t width = static_cast<size_t>(std::min(chunk, p.kv_len - j0));
    // Queries [first, state_from) see some keys of the chunk; [before, state_from) (a superset,
    // <= kChunk of them) join the state for the previous chunk.
    const int64_t first = p.first_query(j0);
    const int64_t before = j0 > 0 ? p.first_query(j0 - 1) : first;
    PhiRows(p.feature_map, p.q.row(b, h, before), p.q.row_stride, static_cast<size_t>(state_from - before), dk, w.qf);
    const float* qf_first = w.qf + static_cast<size_t>(first - before) * dk;
    KeyChunkGrads(p, b, h, j0, width, first, static_cast<size_t>(state_from - first), qf_first, first_head, w);
    if (j0 > 0) AddQueriesToState(p, b, h, before, static_cast<size_t>(state_from - before), w.qf, w);
    state_from = before;
  }
}

// The key pass of every query head of kv head g: dk and dv of that kv head.
void LinearKeyGradsGroup(const Problem& p, int64_t b, int64_t g, float* HWY_RESTRICT scratch) {
  const Scratch w(scratch, linear::ScratchLayout(static_cast<size_t>(p.head_dim), static_cast<size_t>(p.value_dim)));
  const int64_t group = p.q_heads / p.kv_heads;
  for (int64_t h = g * group; h < (g + 1) * group; ++h) KeyPass(p, b, h, h == g * group, w);
}

}  // namespace
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <omp.h>

#include <initializer_list>
#include <string>

#include "core/allocator.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace detail {

HWY_EXPORT(LinearForwardHead);
HWY_EXPORT(LinearQueryGradsHead);
HWY_EXPORT(LinearKeyGradsGroup);

// The dispatches, from this namespace: HWY_DYNAMIC_DISPATCH of a qualified name does not compile
// when a single SIMD target is built (-march=native: Highway then dispatches statically).
namespace {
void linear_forward_head(const linear::Problem& p, int64_t b, int64_t h, float* scratch) {
  HWY_DYNAMIC_DISPATCH(LinearForwardHead)(p, b, h, scratch);
}
void linear_query_grads_head(const linear::Problem& p, int64_t b, int64_t h, float* scratch) {
  HWY_DYNAMIC_DISPATCH(LinearQueryGradsHead)(p, b, h, scratch);
}
void linear_key_grads_group(const linear::Problem& p, int64_t b, int64_t g, float* scratch) {
  HWY_DYNAMIC_DISPATCH(LinearKeyGradsGroup)(p, b, g, scratch);
}
}  // namespace

namespace {

void check_options(const char* who, const LinearAttentionOptions& options) {
  if (!(std::isfinite(options.eps) && options.eps >= 0))
    throw Error(std::string(who) + "eps must be finite and >= 0, got " + std::to_string(options.eps));
  if (options.feature_map != FeatureMap::EluPlusOne && options.feature_map != FeatureMap::Relu)
    throw Error(std::string(who) + "unknown feature map " + std::to_string(static_cast<int>(options.feature_map)));
  if (options.causal_offset <= -Mask::kUnbounded || options.causal_offset >= Mask::kUnbounded)
    throw Error(std::string(who) + "causal_offset " + std::to_string(options.causal_offset) +
                " is outside (-2^60, 2^60)");
}

// scaled_dot_product_attention's checks and operand views (problem.cpp), then the options.
struct Built {
  BuiltProblem attention;
  linear::Problem problem;
};
Built build(const char* who, const Tensor& q, const Tensor& k, const Tensor& v, const LinearAttentionOptions& options) {
  check_options(who, options);
  Built built{build_problem(who, q, k, v, AttentionOptions{}), {}};
  const AttentionProblem& a = built.attention.problem;
  if (a.kv_dtype != DType::F32)
    throw Error(std::string(who) + "k and v are " + std::string(to_string(a.kv_dtype)) +
                ": linear attention reads f32 K/V only (16-bit K/V are for softmax attention's caches)");
  built.problem = linear::Problem{
      .batch = a.batch, .q_heads = a.q_heads, .kv_heads = a.kv_heads, .q_len = a.q_len, .kv_len = a.kv_len,
      .head_dim = a.head_dim, .value_dim = a.value_dim, .q = a.q, .k = a.k, .v = a.v,
      .feature_map = options.feature_map, .causal = options.causal, .offset = options.causal_offset,
      .eps = options.eps, .output = {}, .grad_output = {}, .grad_q = {}, .grad_k = {}, .grad_v = {}, .g_ext = nullptr,
  };
  return built;
}

// Arithmetic of one (batch, head) pass, for the threading threshold.
double head_flops(const linear::Problem& p) {
  const double d = static_cast<double>(p.head_dim), dv = static_cast<double>(p.value_dim);
  const double intra = p.causal ? static_cast<double>(linear::kChunk) * (d + dv) : 0.0;
  return 2.0 * (static_cast<double>(p.q_len) * (d * dv + intra) + static_cast<double>(p.kv_len) * d * dv);
}

// Runs `item(index, scratch)` for index in [0, items) on the threads the work pays for, each
// worker with its own scratch block.
template <class Item>
void run_items(const linear::Problem& p, int64_t items, double flops_per_item, Item item) {
  if (items <= 0) return;
  const int threads = threads_for(flops_per_item * static_cast<double>(items));
  const int workers = static_cast<int>(std::min<int64_t>(threads, items));
  const size_t block =
      linear::ScratchLayout(static_cast<size_t>(p.head_dim), static_cast<size_t>(p.value_dim)).total;
  float* scratch = thread_workspace(WorkspaceSlot::LinearScratch).floats(static_cast<size_t>(workers) * block);
#pragma omp parallel for schedule(dynamic) num_threads(workers)
  for (int64_t index = 0; index < items; ++index)
    item(index, scratch + static_cast<size_t>(omp_get_thread_num()) * block);
}

}  // namespace
}  // namespace detail

std::string_view to_string(FeatureMap feature_map) {
  switch (feature_map) {
    case FeatureMap::EluPlusOne: return "elu+1";
    case FeatureMap::Relu: return "relu";
  }
  return "unknown";
}

FeatureMap feature_map_from_string(std::string_view name) {
  if (name == "elu+1" || name == "elu") return FeatureMap::EluPlusOne;
  if (name == "relu") return FeatureMap::Relu;
  throw Error("unknown feature map \"" + std::string(name) + "\": choose elu+1 or relu");
}

Tensor linear_attention(const Tensor& q, const Tensor& k, const Tensor& v, const LinearAttentionOptions& options) {
  Tensor output;
  linear_attention_into(q, k, v, output, options);
  return output;
}

void linear_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& output,
                           const LinearAttentionOptions& options) {
  const char* who = "linear_attention: ";
  detail::Built built = detail::build(who, q, k, v, options);
  detail::prepare_result(who, output, "output", built.attention.output_shape, {&q, &k, &v}, false);
  detail::linear::Problem& p = built.problem;
  p.output = detail::rows_of<float>(output);
  detail::run_items(p, p.batch * p.q_heads, detail::head_flops(p), [&](int64_t item, float* scratch) {
    detail::linear_forward_head(p, item / p.q_heads, item % p.q_heads, scratch);
  });
}

AttentionGrads linear_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_output,
                                         const LinearAttentionOptions& options) {
  AttentionGrads grads;
  linear_attention_backward_into(q, k, v, grad_output, grads, options);
  return grads;
}

void linear_attention_backward_into(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& grad_output,
                                    AttentionGrads& grads, const LinearAttentionOptions& options) {
  const char* who = "linear_attention_backward: ";
  detail::Built built = detail::build(who, q, k, v, options);
  if (!grad_output.defined()) throw Error(std::string(who) + "grad_output is undefined");
  if (grad_output.shape() != built.attention.output_shape)
    throw Error(std::string(who) + "grad_output is " + grad_output.shape().str() + " but should be " +
                built.attention.output_shape.str() + " (the forward's output)");
  const auto inputs = {&q, &k, &v, &grad_output};
  detail::prepare_result(who, grads.dq, "grads.dq", q.shape(), inputs, false);
  detail::prepare_result(who, grads.dk, "grads.dk", k.shape(), inputs, false);
  detail::prepare_result(who, grads.dv, "grads.dv", v.shape(), inputs, false);
  grads.dsinks = Tensor();
  detail::linear::Problem& p = built.problem;
  const Tensor packed_grad_output = grad_output.contiguous();
  p.grad_output = detail::rows_of<const float>(packed_grad_output);
  p.grad_q = detail::rows_of<float>(grads.dq);
  p.grad_k = detail::rows_of<float>(grads.dk);
  p.grad_v = detail::rows_of<float>(grads.dv);
  // G' = [dO / den, -dO.out / den] per query: the query pass writes it, the key pass reads it.
  const int64_t g_ext_size = p.batch * p.q_heads * p.q_len * (p.value_dim + 1);
  const Tensor g_ext = Tensor::empty(Shape{std::max<int64_t>(g_ext_size, 1)});
  p.g_ext = g_ext.data();
  const double flops = 2 * detail::head_flops(p);
  detail::run_items(p, p.batch * p.q_heads, flops, [&](int64_t item, float* scratch) {
    detail::linear_query_grads_head(p, item / p.q_heads, item % p.q_heads, scratch);
  });
  detail::run_items(p, p.batch * p.kv_heads, flops * static_cast<double>(p.q_heads / p.kv_heads),
                    [&](int64_t item, float* scratch) {
                      detail::linear_key_grads_group(p, item / p.kv_heads, item % p.kv_heads, scratch);
                    });
}

}  // namespace qkv
#endif  // HWY_ONCE
