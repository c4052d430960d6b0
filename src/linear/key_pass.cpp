// Linear attention's backward, second pass (the first is query_pass.cpp, which wrote
// G'_i = [dO_i / den_i, -dO_i.out_i / den_i] per query into Problem::g_ext, and dq): per work item
// (batch b, kv head g), each query head of the group in turn, so a GQA group's dk and dv are summed
// without atomics. Key chunks from the last one back, a state T' = sum_i G'_i phi(q_i)^T
// ((Dv + 1) x Dk) over the queries that see the whole chunk, carried backwards:
//
//   dphi(K) = [V, 1] T' + dA^T phi(Q),  dV = phi(K) T^T + A^T G      (T = T' without its last row)
//
// where A and dA = G V^T + c are the intra blocks over the queries that see part of the chunk.
// dk = dphi(K) phi'(k). Derived in docs/linear.md.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "linear/key_pass.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/highway.h"
#include "linear/steps-inl.h"

#ifndef QKV_LINEAR_KEY_PASS_ONCE
#define QKV_LINEAR_KEY_PASS_ONCE
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "linear/problem.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail::linear {
namespace HWY_NAMESPACE {
namespace {


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
void KeyGradsGroup(const Problem& p, int64_t b, int64_t g, float* HWY_RESTRICT scratch) {
  const Scratch w(scratch, ScratchLayout(static_cast<size_t>(p.head_dim), static_cast<size_t>(p.value_dim)));
  const int64_t group = p.q_heads / p.kv_heads;
  for (int64_t h = g * group; h < (g + 1) * group; ++h) KeyPass(p, b, h, h == g * group, w);
}

}  // namespace
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail::linear
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::detail::linear {

HWY_EXPORT(KeyGradsGroup);

// The dispatch, from the namespace of the export: HWY_DYNAMIC_DISPATCH of a qualified name does
// not compile when a single SIMD target is built (-march=native: Highway then dispatches statically).
void key_grads_group(const Problem& p, int64_t b, int64_t g, float* scratch) {
  HWY_DYNAMIC_DISPATCH(KeyGradsGroup)(p, b, g, scratch);
}

}  // namespace qkv::detail::linear
#endif  // HWY_ONCE
