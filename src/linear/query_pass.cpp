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
// the flash kernel's register-tiled micro-GEMM (gemm/micro_kernel-inl.h, through steps-inl.h);
// phi is Highway SIMD; linear_attention.cpp launches the work items.
//
// This file is the query pass: the forward, and the backward's first pass, which recomputes the
// forward chunk by chunk and writes G' and dq; the second pass is key_pass.cpp. The backward is
// derived in docs/linear.md.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "linear/query_pass.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "linear/steps-inl.h"

#ifndef QKV_LINEAR_QUERY_PASS_ONCE
#define QKV_LINEAR_QUERY_PASS_ONCE
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "linear/problem.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail::linear {
namespace HWY_NAMESPACE {
namespace {

float Dot(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b, size_t n) {
  float sum = 0.0f;
  for (size_t x = 0; x < n; ++x) sum += a[x] * b[x];
  return sum;
}

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
  const Scratch w(scratch, ScratchLayout(dk, dv));
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
void ForwardHead(const Problem& p, int64_t b, int64_t h, float* HWY_RESTRICT scratch) {
  QueryPass(p, b, h, scratch, false);
}
void QueryGradsHead(const Problem& p, int64_t b, int64_t h, float* HWY_RESTRICT scratch) {
  QueryPass(p, b, h, scratch, true);
}

}  // namespace
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail::linear
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::detail::linear {

HWY_EXPORT(ForwardHead);
HWY_EXPORT(QueryGradsHead);

// The dispatches, from the namespace of the exports: HWY_DYNAMIC_DISPATCH of a qualified name does
// not compile when a single SIMD target is built (-march=native: Highway then dispatches statically).
void forward_head(const Problem& p, int64_t b, int64_t h, float* scratch) {
  HWY_DYNAMIC_DISPATCH(ForwardHead)(p, b, h, scratch);
}
void query_grads_head(const Problem& p, int64_t b, int64_t h, float* scratch) {
  HWY_DYNAMIC_DISPATCH(QueryGradsHead)(p, b, h, scratch);
}

}  // namespace qkv::detail::linear
#endif  // HWY_ONCE
