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
// the flash kernel's register-tiled micro-GEMM (tile_gemm-inl.h); phi is Highway SIMD; work items
// run on OpenMP threads.
//
// The backward (same file, below the forward) is derived in docs/linear.md.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/linear_attention.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/tile_gemm-inl.h"
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

// One worker's scratch, in floats, every part on its own cache line.
struct ScratchLayout {
  size_t state, z, qf, kft, scores, out, den, grad, total;
  ScratchLayout(size_t dk, size_t dv) {
    size_t at = 0;
    auto take = [&](size_t floats) {
      const size_t start = at;
      at += round_to_cache_line(floats);
      return start;
    };
    state = take(dk * (dv + 1));     // S (Dk, Dv); backward: T^T (Dv + 1, Dk)
    z = take(dk + 1);                // z (Dk)
    qf = take(kChunk * dk);          // phi(Q chunk) (C, Dk)
    kft = take(dk * kChunk);         // phi(K chunk)^T (Dk, C)
    scores = take(kChunk * kChunk);  // A (C, C)
    out = take(kChunk * std::max(dv + 1, dk));  // O (C, Dv); backward: dphi (C, Dk) and more
    den = take(kChunk);              // den (C)
    grad = take(kChunk * std::max(dv + 1, dk) + dk * (dv + 1));  // backward only
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
  float *state, *z, *qf, *kft, *scores, *out, *den, *grad;
  Scratch(float* base, const linear::ScratchLayout& l)
      : state(base + l.state), z(base + l.z), qf(base + l.qf), kft(base + l.kft), scores(base + l.scores),
        out(base + l.out), den(base + l.den), grad(base + l.grad) {}
};

// (S, z) += keys [from, to) of kv head g, kChunk at a time (phi(K) lands in w.kft, w.out is a row).
void AddKeysToState(const Problem& p, int64_t b, int64_t g, int64_t from, int64_t to, const Scratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  for (int64_t j = from; j < to; j += static_cast<int64_t>(kChunk)) {
    const size_t count = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kChunk), to - j));
    PhiColumns(p.feature_map, p.k.row(b, g, j), p.k.row_stride, count, dk, w.out, w.kft);
    MatMul(dk, dv, count, w.kft, kChunk, 1, p.v.row(b, g, j), static_cast<size_t>(p.v.row_stride), w.state, dv, true);
    for (size_t f = 0; f < dk; ++f)
      for (size_t x = 0; x < count; ++x) w.z[f] += w.kft[f * kChunk + x];
  }
}

// The intra block of query chunk [i0, i0 + rows) over keys [lo, lo + width) (phi(K)^T in w.kft):
// A = phi(Q) phi(K)^T with the keys a query does not see zeroed, O += A V, den += rowsum(A).
void IntraBlock(const Problem& p, int64_t b, int64_t g, int64_t i0, size_t rows, int64_t lo, size_t width,
                const Scratch& w) {
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  MatMul(rows, RoundUpToLanes(width), dk, w.qf, dk, 1, w.kft, kChunk, w.scores, kChunk, false);
  for (size_t x = 0; x < rows; ++x) {
    float* a = w.scores + x * kChunk;
    const size_t seen = static_cast<size_t>(std::clamp<int64_t>(p.visible_keys(i0 + static_cast<int64_t>(x)) - lo, 0,
                                                                static_cast<int64_t>(width)));
    std::fill(a + seen, a + width, 0.0f);
    float sum = 0.0f;
    for (size_t j = 0; j < seen; ++j) sum += a[j];
    w.den[x] += sum;
  }
  MatMul(rows, dv, width, w.scores, kChunk, 1, p.v.row(b, g, lo), static_cast<size_t>(p.v.row_stride), w.out, dv,
         true);
}

// One work item: query head h of batch b, every query. `scratch` is this worker's block.
void LinearForwardHead(const Problem& p, int64_t b, int64_t h, float* HWY_RESTRICT scratch) {
  const size_t dk = static_cast<size_t>(p.head_dim), dv = static_cast<size_t>(p.value_dim);
  const Scratch w(scratch, linear::ScratchLayout(dk, dv));
  const int64_t g = p.kv_head_of(h);
  std::fill_n(w.state, dk * dv, 0.0f);
  std::fill_n(w.z, dk, 0.0f);
  int64_t lo = p.q_len > 0 ? p.visible_keys(0) : 0;
  AddKeysToState(p, b, g, 0, lo, w);
  for (int64_t i0 = 0; i0 < p.q_len; i0 += static_cast<int64_t>(kChunk)) {
    const size_t rows = static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(kChunk), p.q_len - i0));
    const int64_t i_end = i0 + static_cast<int64_t>(rows);
    PhiRows(p.feature_map, p.q.row(b, h, i0), p.q.row_stride, rows, dk, w.qf);
    // Inter: the state's keys, seen by every query of the chunk.
    MatMul(rows, dv, dk, w.qf, dk, 1, w.state, dv, w.out, dv, false);
    for (size_t x = 0; x < rows; ++x) w.den[x] = Dot(w.qf + x * dk, w.z, dk);
    // Intra: the keys some query of the chunk sees and the state does not hold yet, then those
    // the next chunk's first query sees into the state.
    const int64_t seen_last = p.visible_keys(i_end - 1);
    const int64_t next = i_end < p.q_len ? p.visible_keys(i_end) : seen_last;
    const int64_t width = std::max(seen_last, next) - lo;  // <= kChunk: n(i) grows by <= 1 per query
    if (width > 0) {
      PhiColumns(p.feature_map, p.k.row(b, g, lo), p.k.row_stride, static_cast<size_t>(width), dk, w.grad, w.kft);
      if (seen_last > lo) IntraBlock(p, b, g, i0, rows, lo, static_cast<size_t>(seen_last - lo), w);
      const size_t added = static_cast<size_t>(next - lo);
      MatMul(dk, dv, added, w.kft, kChunk, 1, p.v.row(b, g, lo), static_cast<size_t>(p.v.row_stride), w.state, dv,
             true);
      for (size_t f = 0; f < dk; ++f)
        for (size_t x = 0; x < added; ++x) w.z[f] += w.kft[f * kChunk + x];
      lo = next;
    }
    for (size_t x = 0; x < rows; ++x) {
      float* out = p.output.row(b, h, i0 + static_cast<int64_t>(x));
      const float inverse = 1.0f / (w.den[x] + p.eps);
      for (size_t c = 0; c < dv; ++c) out[c] = w.out[x * dv + c] * inverse;
    }
  }
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

#include "memory.hpp"
#include "qkv/error.hpp"

namespace qkv {
namespace detail {

HWY_EXPORT(LinearForwardHead);

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
  built.problem = linear::Problem{
      .batch = a.batch, .q_heads = a.q_heads, .kv_heads = a.kv_heads, .q_len = a.q_len, .kv_len = a.kv_len,
      .head_dim = a.head_dim, .value_dim = a.value_dim, .q = a.q, .k = a.k, .v = a.v,
      .feature_map = options.feature_map, .causal = options.causal, .offset = options.causal_offset,
      .eps = options.eps, .output = {}, .grad_output = {}, .grad_q = {}, .grad_k = {}, .grad_v = {}, .g_ext = nullptr,
  };
  return built;
}

// A result tensor: allocated when undefined, else checked (shape, contiguous, not an input's storage).
void prepare(const char* who, Tensor& t, const char* name, const Shape& shape,
             std::initializer_list<const Tensor*> inputs) {
  if (!t.defined()) {
    t = Tensor::empty(shape);
    return;
  }
  if (t.shape() != shape)
    throw Error(std::string(who) + name + " is " + t.shape().str() + " but should be " + shape.str());
  if (!t.is_contiguous()) throw Error(std::string(who) + name + " " + t.shape().str() + " is not contiguous");
  for (const Tensor* input : inputs)
    if (input->defined() && t.shares_storage_with(*input))
      throw Error(std::string(who) + name + " shares storage with an input");
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
  detail::prepare(who, output, "output", built.attention.output_shape, {&q, &k, &v});
  detail::linear::Problem& p = built.problem;
  p.output = detail::rows_of<float>(output);
  detail::run_items(p, p.batch * p.q_heads, detail::head_flops(p), [&](int64_t item, float* scratch) {
    HWY_DYNAMIC_DISPATCH(detail::LinearForwardHead)(p, item / p.q_heads, item % p.q_heads, scratch);
  });
}

}  // namespace qkv
#endif  // HWY_ONCE
