// The shared test cases of the fast kernels (attention/test_flash.cpp, attention/test_decode.cpp): building an
// AttentionProblem as src/attention/dispatch.cpp does, random cases with every mask kind, the
// float64 oracle and the reference kernel's own error as the measure of a kernel's result, and
// running a kernel on every SIMD target and on 1 and 2 threads.
//
// Tolerance, flash-attention style: the reference and the kernel are measured against the
// float64 oracle and the kernel may be off by at most max(1e-4, 4 x the reference's own error)
// on the same data, or by 4 float epsilons of the largest score: with logits in the thousands a
// score is only known to about an ulp of itself in float32 in any kernel, and each weight
// inherits that error. A kernel's outputs are poisoned with NaN before each call, so an element
// left unwritten fails.
#pragma once

#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gemm/amx.hpp"
#include "attention/flash/flash.hpp"
#include "attention/kernels.hpp"
#include "attention/problem.hpp"
#include "harness/oracle.hpp"
#include "qkv/quantize.hpp"

namespace qkv_test {

using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv::detail::AttentionProblem;
using qkv::detail::MaskTermView;

inline constexpr double kToleranceFloor = 1e-4;
inline constexpr double kToleranceFactor = 4.0;
inline constexpr double kScoreEpsilons = 4.0;

// ---------------------------------------------------------------------------------------------
// Cases and their problems, built by the library's own builder (src/attention/problem.cpp).

// One test case: q (B, Hq, Nq, Dk), k (B, Hkv, Nk, Dk), v (B, Hkv, Nk, Dv), a mask and its
// float64 meaning, a scale, dropout and the score modifiers.
struct Case {
  std::string name;
  Tensor q, k, v;
  Mask mask;
  Bias bias;  // the same mask for the oracle
  float scale = 1;
  float dropout_p = 0;
  uint64_t seed = 0;
  float softcap = 0;
  Tensor alibi_slopes, sinks;  // (Hq) or undefined; alibi_slopes may also be (B, Hq)
  qkv::MatmulPrecision precision = qkv::MatmulPrecision::Highest;
  Tensor k_scales, v_scales;   // k and v int8 / int4 (qkv/quantize.hpp): their scales; else undefined

  // K and V as the oracle reads them: the values the kernels read (dequantised when quantized).
  Tensor oracle_k() const { return k_scales.defined() ? qkv::dequantize_kv({k, k_scales}) : k; }
  Tensor oracle_v() const { return v_scales.defined() ? qkv::dequantize_kv({v, v_scales}) : v; }

  // The modifiers as the oracle reads them.
  qkv_test::OracleModifiers modifiers() const {
    qkv_test::OracleModifiers m;
    m.softcap = softcap;
    if (alibi_slopes.defined()) {
      m.alibi_slopes = qkv_test::to_doubles(alibi_slopes);
      m.alibi_batch_stride = alibi_slopes.dim() == 2 ? alibi_slopes.size(1) : 0;
    }
    if (sinks.defined()) m.sinks = qkv_test::to_doubles(sinks);
    return m;
  }
};

// The options that make the library compute `c`.
inline qkv::AttentionOptions options_of(const Case& c, qkv::Backend backend = qkv::Backend::Auto) {
  qkv::AttentionOptions options;
  options.mask = c.mask;
  options.scale = c.scale;
  options.dropout_p = c.dropout_p;
  options.seed = c.seed;
  options.backend = backend;
  options.softcap = c.softcap;
  options.alibi_slopes = c.alibi_slopes;
  options.sinks = c.sinks;
  options.precision = c.precision;
  options.k_scales = c.k_scales;
  options.v_scales = c.v_scales;
  return options;
}

// Where a kernel called directly writes: output (B, Hq, Nq, Dv) and per row lse, max and sum.
struct KernelOutputs {
  std::vector<float> output, lse, row_max, row_sum;
};

// A packed (B, H, N, D) array as the kernels read it.
template <class T>
qkv::detail::Rows<T> packed_rows(T* data, int64_t heads, int64_t len, int64_t dim) {
  return {data, heads * len * dim, len * dim, dim};
}

// The kernel's problem for `c` (weights are never asked for), built by the library's builder,
// writing into `out` (resized here; filled with `fill`). The problem points into c's tensors.
inline AttentionProblem problem_of(const Case& c, KernelOutputs& out,
                                   float fill = std::numeric_limits<float>::quiet_NaN()) {
  qkv::detail::BuiltProblem built = qkv::detail::build_problem("test: ", c.q, c.k, c.v, options_of(c));
  AttentionProblem& p = built.problem;
  const size_t rows = static_cast<size_t>(p.batch * p.q_heads * p.q_len);
  out.output.assign(rows * static_cast<size_t>(p.value_dim), fill);
  for (std::vector<float>* v : {&out.lse, &out.row_max, &out.row_sum}) v->assign(rows, fill);
  p.output = packed_rows(out.output.data(), p.q_heads, p.q_len, p.value_dim);
  p.lse = out.lse.data();
  p.row_max = out.row_max.data();
  p.row_sum = out.row_sum.data();
  return p;
}

// ---------------------------------------------------------------------------------------------
// Random cases

enum class MaskKind {
  None, Causal, CausalOffset, CausalNegative, Window, WindowRight, KeyLengths, Keep2D, Keep2DRow,
  Keep3D, Keep4D, Keep4DHeads, Additive2D, Additive4D, EmptyRows, Combined, BandAndTerms,
  // The symbolic patterns (issue 10): alone, in unions and intersections with the rest.
  Strided, SparseTransformer, GlobalWindow, BlockSparse, UnionTerms, BigBird, StridedGather,
  // A mask function with inputs (issue 42): documents, a per-batch prefix, a per-head rule.
  Function,
};
inline constexpr MaskKind kAllMasks[] = {
    MaskKind::None, MaskKind::Causal, MaskKind::CausalOffset, MaskKind::CausalNegative, MaskKind::Window,
    MaskKind::WindowRight, MaskKind::KeyLengths, MaskKind::Keep2D, MaskKind::Keep2DRow, MaskKind::Keep3D,
    MaskKind::Keep4D, MaskKind::Keep4DHeads, MaskKind::Additive2D, MaskKind::Additive4D,
    MaskKind::EmptyRows, MaskKind::Combined, MaskKind::BandAndTerms,
    MaskKind::Strided, MaskKind::SparseTransformer, MaskKind::GlobalWindow, MaskKind::BlockSparse,
    MaskKind::UnionTerms, MaskKind::BigBird, MaskKind::StridedGather, MaskKind::Function,
};

inline std::string to_string(MaskKind kind) {
  switch (kind) {
    case MaskKind::None: return "none";
    case MaskKind::Causal: return "causal";
    case MaskKind::CausalOffset: return "causal_offset";
    case MaskKind::CausalNegative: return "causal_negative_offset";
    case MaskKind::Window: return "window";
    case MaskKind::WindowRight: return "window_right";
    case MaskKind::KeyLengths: return "key_lengths";
    case MaskKind::Keep2D: return "keep_2d";
    case MaskKind::Keep2DRow: return "keep_2d_row";
    case MaskKind::Keep3D: return "keep_3d";
    case MaskKind::Keep4D: return "keep_4d";
    case MaskKind::Keep4DHeads: return "keep_4d_heads";
    case MaskKind::Additive2D: return "additive_2d";
    case MaskKind::Additive4D: return "additive_4d";
    case MaskKind::EmptyRows: return "empty_rows";
    case MaskKind::Combined: return "combined";
    case MaskKind::BandAndTerms: return "band_and_terms";
    case MaskKind::Strided: return "strided";
    case MaskKind::SparseTransformer: return "causal&(window|strided)";
    case MaskKind::GlobalWindow: return "window|global";
    case MaskKind::BlockSparse: return "block_sparse";
    case MaskKind::UnionTerms: return "(strided&key_lengths)|(keep&causal),&additive";
    case MaskKind::BigBird: return "window|global|block_sparse";
    case MaskKind::StridedGather: return "causal(o)&(rest|strided(S>=64,O))&key_lengths&additive";
    case MaskKind::Function: return "mask_function(documents,prefix,head)";
  }
  return "?";
}

// A keep tensor of `shape`, each element 1 with probability `density`.
inline Tensor random_keep(Random& rng, const Shape& shape, double density) {
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  for (float& x : values) x = rng.chance(density) ? 1.0f : 0.0f;
  return Tensor::from(std::move(values), shape);
}

// An additive tensor of `shape`: normal values, -inf with probability 0.2.
inline Tensor random_additive(Random& rng, const Shape& shape) {
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  for (float& x : values) x = rng.chance(0.2) ? -std::numeric_limits<float>::infinity() : static_cast<float>(rng.normal());
  return Tensor::from(std::move(values), shape);
}

inline std::vector<int64_t> random_lengths(Random& rng, int64_t batch, int64_t nk) {
  std::vector<int64_t> lengths(static_cast<size_t>(batch));
  for (int64_t& n : lengths) n = rng.chance(0.2) ? (rng.chance(0.5) ? 0 : nk) : rng.integer(0, nk);
  return lengths;
}

// A random block layout for Nq x Nk: (QB, KB), (1, QB, KB) or (Hq, QB, KB), blocks of a random size.
inline void random_blocks(Random& rng, int64_t heads, int64_t nq, int64_t nk, Tensor& layout, int64_t& bq,
                          int64_t& bk) {
  bq = rng.chance(0.3) ? rng.integer(1, 4) : rng.integer(1, 80);
  bk = rng.chance(0.3) ? rng.integer(1, 4) : rng.integer(1, 80);
  const int64_t rows = (nq + bq - 1) / bq, cols = (nk + bk - 1) / bk;
  const int64_t pick = rng.integer(0, 2);
  const Shape shape = pick == 0 ? Shape{rows, cols} : Shape{pick == 1 ? 1 : heads, rows, cols};
  layout = random_keep(rng, shape, 0.4);
}

// The symbolic patterns: strided, global tokens, block-sparse, unions (set_mask's other kinds).
inline void set_sparse_mask(Case& c, MaskKind kind, Random& rng) {
  namespace t = qkv_test;
  const int64_t batch = c.q.size(0), heads = c.q.size(1), nq = c.q.size(2), nk = c.k.size(2);
  switch (kind) {
    case MaskKind::Strided: {  // small strides (the scalar path) and large ones (SIMD), any offset
      const int64_t stride = rng.chance(0.5) ? rng.integer(1, 9) : rng.integer(10, 90);
      const int64_t offset = rng.integer(-100, 100);
      c.mask = Mask::strided(stride, offset);
      c.bias = t::strided_bias(stride, offset);
      return;
    }
    case MaskKind::SparseTransformer: {  // causal & (window(S - 1) | strided(S)), with key lengths
      const int64_t stride = rng.integer(1, 70);
      const std::vector<int64_t> lengths = random_lengths(rng, batch, nk);
      c.mask = Mask::causal() & (Mask::window(stride - 1) | Mask::strided(stride)) & Mask::key_lengths(lengths);
      c.bias = t::all_of({t::causal_bias(), t::any_of({t::window_bias(stride - 1), t::strided_bias(stride)}),
                          t::key_lengths_bias(lengths)});
      return;
    }
    case MaskKind::GlobalWindow: {  // window(L, R) | global(G), under causal half the time
      const int64_t left = rng.integer(0, 40), right = rng.integer(0, 5), count = rng.integer(0, 20);
      const bool causal = rng.chance(0.5);
      c.mask = Mask::window(left, right) | Mask::global_tokens(count);
      c.bias = t::any_of({t::window_bias(left, right), t::global_bias(count)});
      if (causal) {
        c.mask = Mask::causal() & c.mask;
        c.bias = t::all_of({t::causal_bias(), c.bias});
      }
      return;
    }
    case MaskKind::BlockSparse: {
      Tensor layout;
      int64_t bq = 1, bk = 1;
      random_blocks(rng, heads, nq, nk, layout, bq, bk);
      c.mask = Mask::block_sparse(layout, bq, bk);
      c.bias = t::block_sparse_bias(layout, bq, bk);
      return;
    }
    case MaskKind::UnionTerms: {  // (strided & key_lengths) | (keep & causal(offset)), & additive
      const int64_t stride = rng.integer(1, 40), offset = rng.integer(-3, 3);
      const std::vector<int64_t> lengths = random_lengths(rng, batch, nk);
      const Tensor keep = random_keep(rng, Shape{batch, 1, nq, nk}, 0.3);
      const Tensor add = random_additive(rng, Shape{nq, nk});
      c.mask = ((Mask::strided(stride) & Mask::key_lengths(lengths)) | (Mask::keep(keep) & Mask::causal(offset))) &
               Mask::additive(add);
      c.bias = t::all_of({t::any_of({t::all_of({t::strided_bias(stride), t::key_lengths_bias(lengths)}),
                                      t::all_of({t::keep_bias(keep), t::causal_bias(offset)})}),
                          t::additive_bias(add)});
      return;
    }
    case MaskKind::BigBird: {  // window | global | block_sparse
      Tensor layout;
      int64_t bq = 1, bk = 1;
      random_blocks(rng, heads, nq, nk, layout, bq, bk);
      const int64_t left = rng.integer(0, 10), right = rng.integer(0, 10), count = rng.integer(0, 5);
      c.mask = Mask::window(left, right) | Mask::global_tokens(count) | Mask::block_sparse(layout, bq, bk);
      c.bias = t::any_of({t::window_bias(left, right), t::global_bias(count), t::block_sparse_bias(layout, bq, bk)});
      return;
    }
    case MaskKind::StridedGather: {  // flash gathers strides >= its key tile by residues
      const int64_t stride = rng.integer(64, 130), offset = rng.integer(-200, 200), causal = rng.integer(-3, 40);
      const std::vector<int64_t> lengths = random_lengths(rng, batch, nk);
      const Tensor add = random_additive(rng, Shape{batch, nq, nk});
      Mask rest;
      t::Bias rest_bias;
      const int64_t pick = rng.integer(0, 2);
      if (pick == 0) {
        const int64_t left = rng.integer(0, 80), right = rng.integer(0, 3);
        rest = Mask::window(left, right);
        rest_bias = t::window_bias(left, right);
      } else if (pick == 1) {
        const Tensor keep = random_keep(rng, Shape{batch, heads, nq, nk}, 0.2);
        rest = Mask::keep(keep);
        rest_bias = t::keep_bias(keep);
      } else {
        const int64_t count = rng.integer(0, 10);
        rest = Mask::global_tokens(count);
        rest_bias = t::global_bias(count);
      }
      c.mask = Mask::causal(causal) & (rest | Mask::strided(stride, offset)) & Mask::key_lengths(lengths) &
               Mask::additive(add);
      c.bias = t::all_of({t::causal_bias(causal), t::any_of({rest_bias, t::strided_bias(stride, offset)}),
                          t::key_lengths_bias(lengths), t::additive_bias(add)});
      return;
    }
    case MaskKind::Function: {  // the oracle's twin: a keep tensor built from the same rule
      const int64_t length = std::max(nq, nk);
      std::vector<float> docs(static_cast<size_t>(batch * length)), prefix(static_cast<size_t>(batch)),
          reach(static_cast<size_t>(heads));
      for (int64_t b = 0; b < batch; ++b) {
        float doc = 0;
        for (int64_t i = 0; i < length; ++i) docs[static_cast<size_t>(b * length + i)] = doc += rng.chance(0.1) ? 1 : 0;
        prefix[static_cast<size_t>(b)] = static_cast<float>(rng.integer(0, 4));
      }
      for (float& r : reach) r = static_cast<float>(rng.integer(-1, 5));
      std::vector<float> keep(static_cast<size_t>(batch * heads * nq * nk));
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t i = 0; i < nq; ++i)
            for (int64_t j = 0; j < nk; ++j) {
              const bool same = docs[static_cast<size_t>(b * length + i)] == docs[static_cast<size_t>(b * length + j)];
              const bool shown = (same || j < prefix[static_cast<size_t>(b)]) && j <= i + reach[static_cast<size_t>(h)];
              keep[static_cast<size_t>(((b * heads + h) * nq + i) * nk + j)] = shown ? 1.0f : 0.0f;
            }
      const Tensor keep_tensor = Tensor::from(std::move(keep), Shape{batch, heads, nq, nk});
      c.mask = Mask::expression("(docs(q) == docs(k) || k < prefix(b)) && k <= q + reach(h)",
                                {{"docs", Tensor::from(std::move(docs), Shape{batch, length})},
                                 {"prefix", Tensor::from(std::move(prefix), Shape{batch})},
                                 {"reach", Tensor::from(std::move(reach), Shape{heads})}});
      c.bias = t::keep_bias(keep_tensor);
      if (rng.chance(0.3)) {
        c.mask = Mask::window(8) & c.mask;
        c.bias = t::all_of({t::window_bias(8), c.bias});
      }
      return;
    }
    default:
      throw std::logic_error("set_sparse_mask: not a sparse kind");
  }
}

inline void set_mask(Case& c, MaskKind kind, Random& rng) {
  const int64_t batch = c.q.size(0), heads = c.q.size(1), nq = c.q.size(2), nk = c.k.size(2);
  switch (kind) {
    case MaskKind::None:
      c.mask = Mask();
      c.bias = {};
      return;
    case MaskKind::Causal:
      c.mask = Mask::causal();
      c.bias = qkv_test::causal_bias();
      return;
    case MaskKind::CausalOffset: {
      const int64_t offset = rng.integer(1, std::max<int64_t>(1, nk));
      c.mask = Mask::causal(offset);
      c.bias = qkv_test::causal_bias(offset);
      return;
    }
    case MaskKind::CausalNegative: {  // the first queries see no key at all
      const int64_t offset = -rng.integer(1, std::max<int64_t>(1, nq));
      c.mask = Mask::causal(offset);
      c.bias = qkv_test::causal_bias(offset);
      return;
    }
    case MaskKind::Window: {
      const int64_t left = rng.integer(0, std::max<int64_t>(0, nk / 3));
      c.mask = Mask::window(left);
      c.bias = qkv_test::window_bias(left);
      return;
    }
    case MaskKind::WindowRight: {
      const int64_t left = rng.integer(0, nk), right = rng.integer(1, nk), offset = rng.integer(-nq, nk);
      c.mask = Mask::window(left, right, offset);
      c.bias = qkv_test::window_bias(left, right, offset);
      return;
    }
    case MaskKind::KeyLengths: {
      const std::vector<int64_t> lengths = random_lengths(rng, batch, nk);
      c.mask = Mask::key_lengths(lengths);
      c.bias = qkv_test::key_lengths_bias(lengths);
      return;
    }
    case MaskKind::Keep2D: {
      const Tensor keep = random_keep(rng, Shape{nq, nk}, 0.7);
      c.mask = Mask::keep(keep);
      c.bias = qkv_test::keep_bias(keep);
      return;
    }
    case MaskKind::Keep2DRow: {
      const Tensor keep = random_keep(rng, Shape{1, nk}, 0.6);
      c.mask = Mask::keep(keep);
      c.bias = qkv_test::keep_bias(keep);
      return;
    }
    case MaskKind::Keep3D: {
      const Tensor keep = random_keep(rng, Shape{batch, nq, nk}, 0.5);
      c.mask = Mask::keep(keep);
      c.bias = qkv_test::keep_bias(keep);
      return;
    }
    case MaskKind::Keep4D: {
      const Tensor keep = random_keep(rng, Shape{batch, heads, nq, nk}, 0.8);
      c.mask = Mask::keep(keep);
      c.bias = qkv_test::keep_bias(keep);
      return;
    }
    case MaskKind::Keep4DHeads: {
      const Tensor keep = random_keep(rng, Shape{1, heads, nq, nk}, 0.3);
      c.mask = Mask::keep(keep);
      c.bias = qkv_test::keep_bias(keep);
      return;
    }
    case MaskKind::Additive2D: {
      const Tensor add = random_additive(rng, Shape{nq, nk});
      c.mask = Mask::additive(add);
      c.bias = qkv_test::additive_bias(add);
      return;
    }
    case MaskKind::Additive4D: {
      const Tensor add = random_additive(rng, Shape{1, heads, nq, nk});
      c.mask = Mask::additive(add);
      c.bias = qkv_test::additive_bias(add);
      return;
    }
    case MaskKind::EmptyRows: {  // a keep tensor with whole rows of zeros, and key length 0
      std::vector<float> values(static_cast<size_t>(nq * nk), 1.0f);
      for (int64_t i = 0; i < nq; ++i)
        if (rng.chance(0.3)) std::fill_n(values.begin() + i * nk, nk, 0.0f);
      const Tensor keep = Tensor::from(std::move(values), Shape{nq, nk});
      std::vector<int64_t> lengths = random_lengths(rng, batch, nk);
      lengths[0] = 0;
      c.mask = Mask::keep(keep) & Mask::key_lengths(lengths);
      c.bias = qkv_test::all_of({qkv_test::keep_bias(keep), qkv_test::key_lengths_bias(lengths)});
      return;
    }
    case MaskKind::Combined: {
      const int64_t offset = rng.integer(-2, 3);
      const std::vector<int64_t> lengths = random_lengths(rng, batch, nk);
      const Tensor keep = random_keep(rng, Shape{batch, 1, nq, nk}, 0.8);
      const Tensor add = random_additive(rng, Shape{nq, nk});
      c.mask = Mask::causal(offset) & Mask::key_lengths(lengths) & Mask::keep(keep) & Mask::additive(add);
      c.bias = qkv_test::all_of({qkv_test::causal_bias(offset), qkv_test::key_lengths_bias(lengths),
                                 qkv_test::keep_bias(keep), qkv_test::additive_bias(add)});
      return;
    }
    case MaskKind::BandAndTerms: {  // window & additive (B, Nq, Nk) & keep (1, Nk)
      const int64_t left = rng.integer(0, nk), right = rng.integer(0, 3);
      const Tensor add = random_additive(rng, Shape{batch, nq, nk});
      const Tensor keep = random_keep(rng, Shape{1, nk}, 0.9);
      c.mask = Mask::window(left, right) & Mask::additive(add) & Mask::keep(keep);
      c.bias = qkv_test::all_of({qkv_test::window_bias(left, right), qkv_test::additive_bias(add),
                                 qkv_test::keep_bias(keep)});
      return;
    }
    default:
      set_sparse_mask(c, kind, rng);
      return;
  }
}

struct Sizes {
  int64_t batch, q_heads, kv_heads, nq, nk, dk, dv;
};

// Random odd sizes for the K/V dtype tests (16-bit, quantized): decode's few queries over up to
// 2500 keys (several chunks), flash's odd tiles; head dims 1..130 (1..70 for flash).
inline Sizes kv_decode_sizes(Random& rng) {
  const int64_t key_lengths[] = {1, 3, 17, 113, 700, 2500};
  const int64_t kv_heads = rng.integer(1, 2);
  return {rng.integer(1, 2), kv_heads * rng.integer(1, 4), kv_heads, rng.integer(1, 3), key_lengths[rng.integer(0, 5)],
          rng.integer(1, 130), rng.integer(1, 130)};
}
inline Sizes kv_flash_sizes(Random& rng) {
  const int64_t kv_heads = rng.integer(1, 2);
  return {rng.integer(1, 2), kv_heads * rng.integer(1, 3), kv_heads, rng.integer(1, 70), rng.integer(1, 90),
          rng.integer(1, 70), rng.integer(1, 70)};
}

inline std::string describe(const Sizes& s) {
  return "B=" + std::to_string(s.batch) + " Hq=" + std::to_string(s.q_heads) + " Hkv=" +
         std::to_string(s.kv_heads) + " Nq=" + std::to_string(s.nq) + " Nk=" + std::to_string(s.nk) +
         " Dk=" + std::to_string(s.dk) + " Dv=" + std::to_string(s.dv);
}

// The score modifiers a case may carry (AttentionOptions::softcap, alibi_slopes, sinks).
enum class Modifier { None, Softcap, Alibi, Sinks, All };
inline constexpr Modifier kAllModifiers[] = {Modifier::Softcap, Modifier::Alibi, Modifier::Sinks, Modifier::All};

inline std::string to_string(Modifier m) {
  switch (m) {
    case Modifier::None: return "none";
    case Modifier::Softcap: return "softcap";
    case Modifier::Alibi: return "alibi";
    case Modifier::Sinks: return "sinks";
    case Modifier::All: return "softcap+alibi+sinks";
  }
  return "?";
}

// Random modifiers of kind `m` for a case with Hq query heads: a softcap of a few units (it
// bends the scores the test draws), ALiBi slopes in [0, 0.5] and sinks in [-3, 3]. All of them
// together take ALiBi slopes per batch element and head, (B, Hq), where the case is batched.
inline void set_modifiers(Case& c, Modifier m, Random& rng) {
  const int64_t heads = c.q.size(1), batch = c.q.size(0);
  if (m == Modifier::Softcap || m == Modifier::All) c.softcap = static_cast<float>(rng.uniform(0.5, 5.0));
  if (m == Modifier::Alibi) c.alibi_slopes = rng.uniform_tensor(Shape{heads}, 0.0, 0.5);
  if (m == Modifier::All)
    c.alibi_slopes = rng.uniform_tensor(batch > 1 ? Shape{batch, heads} : Shape{heads}, 0.0, 0.5);
  if (m == Modifier::Sinks || m == Modifier::All) c.sinks = rng.uniform_tensor(Shape{heads}, -3.0, 3.0);
  c.name += " modifiers=" + to_string(m);
}

// q, k, v standard normal times `logit_scale` for q and k (30: scores in the thousands).
inline Case make_case(Random& rng, const Sizes& s, MaskKind kind, double logit_scale, float dropout_p,
                      Modifier modifier = Modifier::None) {
  Case c;
  c.q = rng.randn(Shape{s.batch, s.q_heads, s.nq, s.dk}, logit_scale);
  c.k = rng.randn(Shape{s.batch, s.kv_heads, s.nk, s.dk}, logit_scale);
  c.v = rng.randn(Shape{s.batch, s.kv_heads, s.nk, s.dv});
  c.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.dk)));
  c.dropout_p = dropout_p;
  c.seed = rng.next_u64();
  set_mask(c, kind, rng);
  c.name = describe(s) + " mask=" + to_string(kind) + " logits x" + std::to_string(logit_scale) +
           " dropout=" + std::to_string(dropout_p);
  if (modifier != Modifier::None) set_modifiers(c, modifier, rng);
  return c;
}

// The K/V dtype tests' cases (16-bit, quantized): every mask kind, all modifiers with dropout, a
// scaled causal offset, and whole vectors (and int4's groups) on every target: the W4 head shape
// with the KV cache's mask. `store` puts each case's K and V in the dtype under test.
inline std::vector<Case> kv_storage_cases(Random& rng, const std::function<Sizes(Random&)>& sizes,
                                          const std::function<Case(Case)>& store) {
  std::vector<Case> cases;
  for (MaskKind kind : kAllMasks) cases.push_back(store(make_case(rng, sizes(rng), kind, 1.0, 0.0f)));
  cases.push_back(store(make_case(rng, sizes(rng), MaskKind::Combined, 1.0, 0.3f, Modifier::All)));
  cases.push_back(store(make_case(rng, sizes(rng), MaskKind::CausalOffset, 8.0, 0.0f)));
  Case c = make_case(rng, {1, 4, 2, 1, 1000, 128, 128}, MaskKind::None, 1.0, 0.0f);
  c.mask = qkv::Mask::causal(999);
  c.bias = causal_bias(999);
  cases.push_back(store(c));
  return cases;
}

// Long sequences for the strided residues: flash and flash backward compute the keys of a root
// `rest | strided(S, O)` with S >= 64 by residues (queries i0, i0 + S, ... against keys j0, j0 +
// S, ...), in residue tiles of 8 to 16 queries and key tiles of 16 and 64 keys, so these cases
// give a residue many queries and keys (Nq, Nk in the thousands), odd strides and offsets, and
// each kind of `rest`: 0 a band (causal Sparse Transformer, folded into the tiles' band), 1 a
// window with a right side and no causal (keys on both sides of the diagonal, 16 + 64 + more a
// residue) with an additive tensor, 2 global tokens, 3 a keep tensor, 4 a block layout, 5 a
// smaller stride (40, evaluated on the residue's lines of step S, its pairs overlapping the
// large stride's where j - i = O mod gcd(40, S)). Key lengths in every one.
inline Case strided_residue_case(Random& rng, const Sizes& s, int variant, float dropout_p,
                                 Modifier modifier = Modifier::None) {
  namespace t = qkv_test;
  Case c = make_case(rng, s, MaskKind::None, 1.0, dropout_p, modifier);
  const int64_t stride = rng.integer(64, 101), offset = rng.integer(-150, 150);
  std::vector<int64_t> lengths(static_cast<size_t>(s.batch));
  for (int64_t& n : lengths) n = rng.chance(0.15) ? 0 : rng.integer(s.nk * 3 / 4, s.nk);
  Mask rest;
  t::Bias rest_bias;
  std::string what;
  if (variant == 0 || variant == 1) {
    const int64_t left = variant == 0 ? stride - 1 : rng.integer(0, 30), right = variant == 0 ? 0 : rng.integer(1, 5);
    rest = Mask::window(left, right);
    rest_bias = t::window_bias(left, right);
    what = "window(" + std::to_string(left) + ", " + std::to_string(right) + ")";
  } else if (variant == 2) {
    const int64_t count = rng.integer(1, 70);
    rest = Mask::global_tokens(count);
    rest_bias = t::global_bias(count);
    what = "global(" + std::to_string(count) + ")";
  } else if (variant == 3) {
    const Tensor keep = random_keep(rng, Shape{s.nq, s.nk}, 0.02);
    rest = Mask::keep(keep);
    rest_bias = t::keep_bias(keep);
    what = "keep";
  } else if (variant == 4) {
    Tensor layout;
    int64_t bq = 1, bk = 1;
    random_blocks(rng, s.q_heads, s.nq, s.nk, layout, bq, bk);
    rest = Mask::block_sparse(layout, bq, bk);
    rest_bias = t::block_sparse_bias(layout, bq, bk);
    what = "block_sparse";
  } else {
    const int64_t small = 40, small_offset = ((offset % small) + small) % small;  // the two overlap
    rest = Mask::strided(small, small_offset);
    rest_bias = t::strided_bias(small, small_offset);
    what = "strided(40, " + std::to_string(small_offset) + ")";
  }
  c.mask = (rest | Mask::strided(stride, offset)) & Mask::key_lengths(lengths);
  c.bias = t::all_of({t::any_of({rest_bias, t::strided_bias(stride, offset)}), t::key_lengths_bias(lengths)});
  std::string name = "(" + what + " | strided(" + std::to_string(stride) + ", " + std::to_string(offset) + "))";
  if (variant != 1) {  // under causal, its offset putting the queries at the end of the keys or past them
    const int64_t causal = s.nk - s.nq + rng.integer(-5, 5);
    c.mask = Mask::causal(causal) & c.mask;
    c.bias = t::all_of({t::causal_bias(causal), c.bias});
    name = "causal(" + std::to_string(causal) + ") & " + name;
  } else {
    const Tensor add = random_additive(rng, Shape{s.nq, s.nk});
    c.mask = c.mask & Mask::additive(add);
    c.bias = t::all_of({c.bias, t::additive_bias(add)});
    name += " & additive";
  }
  c.name = describe(s) + " mask=" + name + " & key_lengths dropout=" + std::to_string(dropout_p) +
           (modifier == Modifier::None ? "" : " modifiers=" + to_string(modifier));
  return c;
}

// ---------------------------------------------------------------------------------------------
// Running and comparing

// A case's expected values, computed once: the float64 oracle, the reference kernel's error and
// the largest |scaled score| (masks ignored) or |row maximum| of the logits, whichever is larger:
// ALiBi or a large bias can push every visible logit of a row to -2000, where float32 holds a
// logit only to 1e-4, and the weights are as good as the logits.
struct Expected {
  qkv_test::OracleResult oracle;
  double reference_output_error = 0, reference_lse_error = 0;
  double max_abs_score = 0;
  // A kernel's documented error beyond float rounding (decode's int8 q against int4 keys),
  // added to both tolerances; 0 for the float kernels.
  double added_output_error = 0, added_lse_error = 0;
};

inline double max_abs_score(const Case& c) {
  const int64_t batch = c.q.size(0), hq = c.q.size(1), hkv = c.k.size(1);
  const int64_t nq = c.q.size(2), nk = c.k.size(2), dk = c.q.size(3);
  const float* q = c.q.data();
  const std::vector<double> k_values = to_doubles(c.oracle_k());  // any dtype
  const double* k = k_values.data();
  double largest = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < nq; ++i) {
        const float* q_row = q + ((b * hq + h) * nq + i) * dk;
        for (int64_t j = 0; j < nk; ++j) {
          const double* k_row = k + ((b * hkv + h / (hq / hkv)) * nk + j) * dk;
          double dot = 0;
          for (int64_t d = 0; d < dk; ++d) dot += static_cast<double>(q_row[d]) * k_row[d];
          largest = std::max(largest, std::abs(dot) * c.scale);
        }
      }
  return largest;
}

inline Expected expect(const Case& c) {
  Expected e;
  e.max_abs_score = max_abs_score(c);
  qkv_test::OracleDropout dropout;
  if (c.dropout_p > 0) {
    dropout.p = c.dropout_p;
    dropout.keeps = [&c](int64_t b, int64_t h, int64_t i, int64_t j) {
      return qkv::dropout_keeps(c.seed, b, h, i, j, c.dropout_p);
    };
  }
  e.oracle = qkv_test::attention_oracle(c.q, c.oracle_k(), c.oracle_v(), c.scale, c.bias, dropout, c.modifiers());
  e.max_abs_score = std::max(e.max_abs_score, e.oracle.max_abs_row_max);
  KernelOutputs reference;
  qkv::detail::reference_attention(problem_of(c, reference));
  const qkv_test::Comparison out = qkv_test::compare(reference.output, e.oracle.output, 1e30);
  const qkv_test::Comparison l = qkv_test::compare(reference.lse, e.oracle.lse, 1e30);
  EXPECT_TRUE(std::isfinite(out.max_rel_diff) && std::isfinite(l.max_rel_diff))
      << "the reference kernel itself is off: " << c.name;
  e.reference_output_error = out.max_rel_diff;
  e.reference_lse_error = l.max_rel_diff;
  return e;
}

// A fast kernel under test: flash_attention, decode_kernel.
using Kernel = void (*)(const AttentionProblem&);

// decode_attention as a Kernel: the harness's problems have their scales checked (build_problem's
// ScaleValues::Scan), so it must report them valid.
inline void decode_kernel(const AttentionProblem& problem) { EXPECT_TRUE(qkv::detail::decode_attention(problem)); }

// Runs `kernel` on `c` into NaN-poisoned outputs and compares with the oracle.
inline void check_kernel(Kernel kernel, const Case& c, const Expected& e) {
  KernelOutputs got;  // poisoned with NaN
  kernel(problem_of(c, got));
  const std::vector<float>& output = got.output;
  const std::vector<float>& lse = got.lse;
  const double score_error = kScoreEpsilons * std::numeric_limits<float>::epsilon() * e.max_abs_score;
  const double output_tolerance =
      std::max({kToleranceFloor, kToleranceFactor * e.reference_output_error, score_error}) + e.added_output_error;
  const double lse_tolerance =
      std::max({kToleranceFloor, kToleranceFactor * e.reference_lse_error, score_error}) + e.added_lse_error;
  const qkv_test::Comparison out = qkv_test::compare(output, e.oracle.output, output_tolerance);
  const qkv_test::Comparison l = qkv_test::compare(lse, e.oracle.lse, lse_tolerance);
  EXPECT_TRUE(out.ok) << c.name << "\noutput (reference error " << e.reference_output_error << "):\n" << out.detail;
  EXPECT_TRUE(l.ok) << c.name << "\nlse (reference error " << e.reference_lse_error << "):\n" << l.detail;
  // The row stats agree with lse (lse = max + log(sum)) wherever lse is finite.
  for (size_t r = 0; r < lse.size(); ++r)
    if (std::isfinite(lse[r]))
      EXPECT_NEAR(got.row_max[r] + std::log(got.row_sum[r]), lse[r], 1e-5 * std::max(1.0f, std::abs(lse[r])))
          << c.name << " row " << r;
}

// Lowers the kernels' threading threshold for its lifetime, so that small cases really run on
// several threads, then restores it.
class ThreadEveryProblem {
 public:
  ThreadEveryProblem() : before_(qkv::detail::set_min_flops_to_thread_for_test(0)) {}
  ~ThreadEveryProblem() { qkv::detail::set_min_flops_to_thread_for_test(before_); }
  ThreadEveryProblem(const ThreadEveryProblem&) = delete;
  ThreadEveryProblem& operator=(const ThreadEveryProblem&) = delete;

 private:
  double before_;
};

// Sets the SIMD targets the kernels dispatch to for its lifetime, then restores the real CPU's.
class ForcedTarget {
 public:
  explicit ForcedTarget(int64_t target) { hwy::SetSupportedTargetsForTest(target); }
  ~ForcedTarget() { hwy::SetSupportedTargetsForTest(0); }
  ForcedTarget(const ForcedTarget&) = delete;
  ForcedTarget& operator=(const ForcedTarget&) = delete;
};

// The targets the kernels hold code for that this CPU can run, one bit each. Every kernel file
// is compiled with the same flags, so flash/forward.cpp's targets are every kernel's.
inline std::vector<int64_t> runnable_targets() {
  std::vector<int64_t> targets;
  const int64_t bits = qkv::detail::flash_attention_compiled_targets() & hwy::SupportedTargets();
  for (int64_t rest = bits; rest != 0; rest &= rest - 1) targets.push_back(rest & -rest);
  return targets;
}

// body() on every runnable target and on 1 and 2 threads (kernels threaded whatever the
// problem's size), each traced; the thread count restored after.
template <class Body>
void on_every_target_and_thread_count(const Body& body) {
  const std::vector<int64_t> targets = runnable_targets();
  ASSERT_FALSE(targets.empty());
  const int threads_before = omp_get_max_threads();
  for (int64_t target : targets) {
    ForcedTarget forced(target);
    SCOPED_TRACE(std::string("SIMD target ") + hwy::TargetName(target));
    // Highway's chosen target is one for the whole library: what flash dispatches to, every kernel does.
    ASSERT_EQ(qkv::detail::flash_attention_target(), target) << "the target was not forced";
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      ThreadEveryProblem threaded;
      SCOPED_TRACE("threads " + std::to_string(threads));
      body();
    }
  }
  omp_set_num_threads(threads_before);
}

// Runs `kernel` on every case, on every runnable target and on 1 and 2 threads.
// `added(c, e)` may set e's added errors (the kernel's documented error beyond rounding) on the
// target being run (qkv::detail::flash_attention_target(): every kernel's), called per target.
inline void check_everywhere(Kernel kernel, const std::vector<Case>& cases,
                             void (*added)(const Case&, Expected&) = nullptr) {
  std::vector<Expected> expected;
  for (const Case& c : cases) expected.push_back(expect(c));
  on_every_target_and_thread_count([&] {
    for (size_t n = 0; n < cases.size(); ++n) {
      Expected e = expected[n];
      if (added) added(cases[n], e);
      check_kernel(kernel, cases[n], e);
    }
  });
}

// ---- Lower matmul precision (MatmulPrecision High, Medium: products on AMX tiles)

// Why the AMX products cannot run in this process, or "": no AMX (or no tile state from the
// OS), or a dispatched SIMD target without 16 float lanes. Tests of them skip with the reason.
inline std::string without_amx() {
  if (!qkv::detail::amx::available()) return "no AMX on this CPU (or no tile state from the OS)";
  if (qkv::detail::flash_attention_target() > HWY_AVX3) return "the dispatched target has no 16 float lanes";
  return "";
}

#define QKV_SKIP_WITHOUT_AMX() \
  if (const std::string why = qkv_test::without_amx(); !why.empty()) GTEST_SKIP() << why

// `c` at a lower matmul precision, named so.
inline Case with_precision(Case c, qkv::MatmulPrecision precision) {
  c.precision = precision;
  c.name += " precision=" + std::string(qkv::to_string(precision));
  return c;
}

// The largest |a[x] - b[x]|.
inline double largest_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double largest = 0;
  for (size_t x = 0; x < a.size(); ++x) largest = std::max(largest, static_cast<double>(std::abs(a[x] - b[x])));
  return largest;
}

// The AMX tiles ran: High's results differ from Highest's somewhere, by less than `bound`, and
// Medium's by more than 4 x High's.
inline void expect_tiles_ran(const std::vector<float>& highest, const std::vector<float>& high,
                             const std::vector<float>& medium, double bound, const std::string& what) {
  const double off_high = largest_difference(high, highest), off_medium = largest_difference(medium, highest);
  EXPECT_GT(off_high, 0.0) << what << ": High gave Highest's bits, the AMX tiles did not run";
  EXPECT_LT(off_high, bound) << what;
  EXPECT_GT(off_medium, 4 * off_high) << what << ": Medium is no coarser than High";
}

// The relative error each operand of a product keeps at `precision`: 2^-16 for High's two bf16
// parts, 2^-8 for Medium's one.
inline double operand_error(qkv::MatmulPrecision precision) {
  return precision == qkv::MatmulPrecision::High ? std::ldexp(1.0, -16) : std::ldexp(1.0, -8);
}

// The largest sum_d |a_d b_d| over rows a of a (B, Ha, Na, D) array and rows b of the (B, Hb,
// Nb, D) array that head of a's group meets (grouped-query heads): how large a product's rounding
// can get when each operand is kept to a relative error.
inline double max_abs_dot_sum(const Tensor& a, const Tensor& b) {
  const int64_t batch = a.size(0), ha = a.size(1), hb = b.size(1), na = a.size(2), nb = b.size(2), d = a.size(3);
  const std::vector<double> x = to_doubles(a), y = to_doubles(b);
  double largest = 0;
  for (int64_t n = 0; n < batch; ++n)
    for (int64_t h = 0; h < ha; ++h)
      for (int64_t i = 0; i < na; ++i)
        for (int64_t j = 0; j < nb; ++j) {
          const double* x_row = x.data() + ((n * ha + h) * na + i) * d;
          const double* y_row = y.data() + ((n * hb + h / (ha / hb)) * nb + j) * d;
          double sum = 0;
          for (int64_t c = 0; c < d; ++c) sum += std::abs(x_row[c] * y_row[c]);
          largest = std::max(largest, sum);
        }
  return largest;
}

}  // namespace qkv_test
