// Rotary tables as attention options (AttentionOptions::rotary_cos / rotary_sin /
// rotary_interleaved / rotary_keys): the forward against a float64 oracle that rotates q and k by
// FlashAttention's formula and attends in float64, on random tables (any values, not only cos/sin
// of an angle), odd dims with a partial rotary_dim, GQA, both pairings, masks with and without key
// lengths, ranks 2 to 4; the backward's dq and dk against central differences of the float64
// oracle; a packed batch against each sequence's own call, paged K/V against rotating q first;
// and the refusals (positions past the tables or before 0, bad tables, keys that are a cache).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "harness/oracle.hpp"
#include "harness/sequence_cases.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::DType;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

constexpr int64_t kQHeads = 6, kKvHeads = 2, kDk = 19, kDv = 7, kHalf = 7;  // rotary_dim 14 of 19

struct Tables {
  Tensor cos, sin;
};

// Random tables: any finite values rotate (FlashAttention does not ask for cos^2 + sin^2 = 1).
Tables random_tables(Random& rng, int64_t length, int64_t half = kHalf) {
  return {rng.uniform_tensor(Shape{length, half}, -1.5, 1.5), rng.uniform_tensor(Shape{length, half}, -1.5, 1.5)};
}

AttentionOptions rotary(const Tables& t, bool interleaved, Mask mask = Mask()) {
  AttentionOptions o;
  o.mask = std::move(mask);
  o.rotary_cos = t.cos;
  o.rotary_sin = t.sin;
  o.rotary_interleaved = interleaved;
  return o;
}

// FlashAttention's apply_rotary_emb on (B, H, N, D) doubles, in float64: token n of batch element b
// at position offsets[b] + n; out = x cos + rotate_half(x) sin on the first rotary_dim features.
std::vector<double> rotated64(std::vector<double> x, int64_t batch, int64_t heads, int64_t len, int64_t dim,
                              const std::vector<int64_t>& offsets, const Tables& t, bool interleaved) {
  const std::vector<double> cos = qkv_test::to_doubles(t.cos), sin = qkv_test::to_doubles(t.sin);
  const int64_t half = t.cos.size(1);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t n = 0; n < len; ++n) {
        double* row = &x[static_cast<size_t>(((b * heads + h) * len + n) * dim)];
        const int64_t p = offsets[static_cast<size_t>(b)] + n;
        std::vector<double> rotate_half(static_cast<size_t>(2 * half));
        for (int64_t i = 0; i < half; ++i) {
          const int64_t a = interleaved ? 2 * i : i, c = interleaved ? 2 * i + 1 : i + half;
          rotate_half[static_cast<size_t>(a)] = -row[c];
          rotate_half[static_cast<size_t>(c)] = row[a];
        }
        for (int64_t f = 0; f < 2 * half; ++f) {
          const int64_t i = interleaved ? f / 2 : f % half;
          const double cf = cos[static_cast<size_t>(p * half + i)], sf = sin[static_cast<size_t>(p * half + i)];
          row[f] = row[f] * cf + rotate_half[static_cast<size_t>(f)] * sf;
        }
      }
  return x;
}

// The oracle of a plain call: q (B, Hq, Nq, Dk) rotated at n_b - Nq + i, k at j, then attention.
struct Case {
  int64_t batch, nq, nk;
  std::vector<int64_t> lengths;  // key lengths (empty: none)
  bool causal;
};

qkv_test::OracleResult oracle(const Case& c, const std::vector<double>& q, const std::vector<double>& k,
                              const Tensor& v, const Tables& t, bool interleaved, bool rotate_keys = true) {
  std::vector<int64_t> q_offsets, k_offsets(static_cast<size_t>(c.batch), 0);
  for (int64_t b = 0; b < c.batch; ++b) q_offsets.push_back(c.nk - c.nq);
  qkv_test::AttentionDims d{c.batch, kQHeads, kKvHeads, c.nq, c.nk, kDk, kDv};
  std::vector<qkv_test::Bias> parts;
  if (c.causal) parts.push_back(qkv_test::causal_bias(c.nk - c.nq));
  if (!c.lengths.empty()) parts.push_back(qkv_test::key_lengths_bias(c.lengths));
  const qkv_test::Bias bias = parts.empty() ? qkv_test::Bias() : qkv_test::all_of(parts);
  return qkv_test::attention_oracle(
      d, rotated64(q, c.batch, kQHeads, c.nq, kDk, q_offsets, t, interleaved),
      rotate_keys ? rotated64(k, c.batch, kKvHeads, c.nk, kDk, k_offsets, t, interleaved) : k,
      qkv_test::to_doubles(v), 1.0 / std::sqrt(double(kDk)), bias);
}

Mask mask_of(const Case& c) {
  Mask m;
  if (c.causal) m = m & Mask::causal(c.nk - c.nq);
  if (!c.lengths.empty()) m = m & Mask::key_lengths(c.lengths);
  return m;
}

const std::vector<Case> kCases = {
    {2, 5, 13, {}, false},      // decode-like: the queries are the last 5 of 13 positions
    {2, 9, 9, {}, true},        // a whole sequence, causal
    {3, 9, 9, {9, 6, 4}, true},  // a right-padded batch: query i at position i, its padding keys hidden
    {1, 1, 17, {}, false},
};

TEST(RotaryOptions, PlainCallsMatchTheFloat64Oracle) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (const Case& c : kCases)
    for (bool interleaved : {false, true})
      for (qkv::Backend backend : {qkv::Backend::Auto, qkv::Backend::Reference}) {
        SCOPED_TRACE("B " + std::to_string(c.batch) + " Nq " + std::to_string(c.nq) + " Nk " + std::to_string(c.nk) +
                     (interleaved ? " interleaved" : " half-split"));
        const Tables t = random_tables(rng, c.nk + rng.integer(0, 5));
        const Tensor q = rng.randn(Shape{c.batch, kQHeads, c.nq, kDk}), k = rng.randn(Shape{c.batch, kKvHeads, c.nk, kDk}),
                     v = rng.randn(Shape{c.batch, kKvHeads, c.nk, kDv});
        AttentionOptions o = rotary(t, interleaved, mask_of(c));
        o.backend = backend;
        const std::vector<float> q_before = q.to_vector(), k_before = k.to_vector();
        const qkv::AttentionResult got = qkv::scaled_dot_product_attention(q, k, v, o);
        const auto want = oracle(c, qkv_test::to_doubles(q), qkv_test::to_doubles(k), v, t, interleaved);
        const auto cmp = qkv_test::compare(got.output, want.output, 2e-5);
        EXPECT_TRUE(cmp.ok) << cmp.detail;
        EXPECT_TRUE(qkv_test::compare(got.lse, want.lse, 2e-5).ok);
        // The caller's q and k are read, never rotated in place.
        EXPECT_EQ(q.to_vector(), q_before);
        EXPECT_EQ(k.to_vector(), k_before);

        // rotary_keys = false: k is a cache of rotated keys, read as given.
        o.rotary_keys = false;
        const auto cached = oracle(c, qkv_test::to_doubles(q), qkv_test::to_doubles(k), v, t, interleaved, false);
        EXPECT_TRUE(qkv_test::compare(qkv::scaled_dot_product_attention(q, k, v, o).output, cached.output, 2e-5).ok);
      }
}

// The same rotation as nn::RotaryTable's: rotating first with it and attending without tables
// gives the same bits, for every rank attention takes.
TEST(RotaryOptions, RotatesAsRotaryTableForEveryRank) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tables t = random_tables(rng, 40);
  const qkv::nn::RotaryTable table(kDk, {.cos = t.cos, .sin = t.sin, .interleaved = true});
  const std::vector<std::vector<Shape>> shapes = {
      {Shape{2, 3, 6, kDk}, Shape{2, 3, 15, kDk}, Shape{2, 3, 15, kDv}},
      {Shape{2, 6, kDk}, Shape{2, 15, kDk}, Shape{2, 15, kDv}},
      {Shape{6, kDk}, Shape{15, kDk}, Shape{15, kDv}}};
  for (const auto& s : shapes) {
    const Shape& q_shape = s[0];
    const Tensor q = rng.randn(s[0]), k = rng.randn(s[1]), v = rng.randn(s[2]);
    const qkv::AttentionResult got = qkv::scaled_dot_product_attention(q, k, v, rotary(t, true, Mask::causal(9)));
    const Tensor q_rot = table.apply(q, 15 - 6), k_rot = table.apply(k, 0);
    AttentionOptions plain;
    plain.mask = Mask::causal(9);
    const qkv::AttentionResult want = qkv::scaled_dot_product_attention(q_rot, k_rot, v, plain);
    EXPECT_EQ(got.output.to_vector(), want.output.to_vector()) << q_shape;
  }
}

// dL/dq and dL/dk of L = sum(g * output) against central differences of the float64 oracle along
// random directions: a gradient left rotated (or turned the wrong way) fails.
TEST(RotaryOptions, BackwardMatchesDifferencesOfTheOracle) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (const Case& c : {kCases[1], kCases[2]})
    for (bool interleaved : {false, true}) {
      const Tables t = random_tables(rng, c.nk + 3);
      const Tensor q = rng.randn(Shape{c.batch, kQHeads, c.nq, kDk}), k = rng.randn(Shape{c.batch, kKvHeads, c.nk, kDk}),
                   v = rng.randn(Shape{c.batch, kKvHeads, c.nk, kDv});
      const Tensor g = rng.randn(Shape{c.batch, kQHeads, c.nq, kDv});
      const AttentionOptions o = rotary(t, interleaved, mask_of(c));
      const qkv::AttentionResult forward = qkv::scaled_dot_product_attention(q, k, v, o);
      const qkv::AttentionGrads grads = qkv::scaled_dot_product_attention_backward(g, q, k, v, forward, o);
      const std::vector<double> q64 = qkv_test::to_doubles(q), k64 = qkv_test::to_doubles(k),
                                g64 = qkv_test::to_doubles(g);
      const auto loss = [&](const std::vector<double>& qx, const std::vector<double>& kx) {
        const auto r = oracle(c, qx, kx, v, t, interleaved);
        double sum = 0;
        for (size_t n = 0; n < g64.size(); ++n) sum += g64[n] * r.output[n];
        return sum;
      };
      for (int which = 0; which < 2; ++which) {
        const std::vector<double>& x = which == 0 ? q64 : k64;
        const Tensor& dx = which == 0 ? grads.dq : grads.dk;
        std::vector<double> direction(x.size());
        for (double& e : direction) e = rng.normal();
        constexpr double kStep = 1e-5;
        std::vector<double> plus = x, minus = x;
        for (size_t n = 0; n < x.size(); ++n) {
          plus[n] += kStep * direction[n];
          minus[n] -= kStep * direction[n];
        }
        const double numeric = which == 0 ? (loss(plus, k64) - loss(minus, k64)) / (2 * kStep)
                                          : (loss(q64, plus) - loss(q64, minus)) / (2 * kStep);
        const std::vector<double> analytic = qkv_test::to_doubles(dx);
        double dot = 0, scale = 0;
        for (size_t n = 0; n < x.size(); ++n) {
          dot += analytic[n] * direction[n];
          scale += std::abs(analytic[n] * direction[n]);
        }
        EXPECT_NEAR(dot, numeric, 1e-4 * std::max(1.0, scale)) << (which == 0 ? "dq" : "dk");
      }
    }
}

// A packed batch (cu_seqlens) gives each sequence's own rotary call, forward and backward, bit for
// bit: its queries the last of its keys, its keys from position 0; empty and one-token sequences.
TEST(RotaryOptions, PackedBatchIsEachSequencesCall) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<int64_t> nq = {3, 0, 1, 6, 2}, nk = {7, 4, 1, 6, 0};
  std::vector<int64_t> cu_q{0}, cu_k{0};
  for (size_t s = 0; s < nq.size(); ++s) {
    cu_q.push_back(cu_q.back() + nq[s]);
    cu_k.push_back(cu_k.back() + nk[s]);
  }
  const Tables t = random_tables(rng, 9);
  const Tensor q = rng.randn(Shape{cu_q.back(), kQHeads, kDk}), k = rng.randn(Shape{cu_k.back(), kKvHeads, kDk}),
               v = rng.randn(Shape{cu_k.back(), kKvHeads, kDv}), g = rng.randn(Shape{cu_q.back(), kQHeads, kDv});
  for (const Mask& mask : {Mask(), Mask::causal()}) {
    AttentionOptions o = rotary(t, false, mask);
    o.cu_seqlens_q = cu_q;
    o.cu_seqlens_k = cu_k;
    o.backend = qkv::Backend::Flash;
    const qkv::AttentionResult packed = qkv::scaled_dot_product_attention(q, k, v, o);
    const qkv::AttentionGrads grads = qkv::scaled_dot_product_attention_backward(g, q, k, v, packed, o);
    const auto rows = [](const Tensor& x, int64_t start, int64_t n) {
      return x.narrow(0, start, n).transpose(0, 1).unsqueeze(0).contiguous();
    };
    for (size_t s = 0; s < nq.size(); ++s) {
      if (nq[s] == 0 || nk[s] == 0) continue;
      SCOPED_TRACE("sequence " + std::to_string(s));
      AttentionOptions own = rotary(t, false, mask.band_hi() == 0 ? Mask::causal(nk[s] - nq[s]) : Mask());
      own.backend = qkv::Backend::Flash;
      const Tensor qs = rows(q, cu_q[s], nq[s]), ks = rows(k, cu_k[s], nk[s]), vs = rows(v, cu_k[s], nk[s]);
      const qkv::AttentionResult alone = qkv::scaled_dot_product_attention(qs, ks, vs, own);
      EXPECT_EQ(rows(packed.output, cu_q[s], nq[s]).to_vector(), alone.output.to_vector());
      const qkv::AttentionGrads own_grads =
          qkv::scaled_dot_product_attention_backward(rows(g, cu_q[s], nq[s]), qs, ks, vs, alone, own);
      EXPECT_EQ(rows(grads.dq, cu_q[s], nq[s]).to_vector(), own_grads.dq.to_vector());
      EXPECT_EQ(rows(grads.dk, cu_k[s], nk[s]).to_vector(), own_grads.dk.to_vector());
    }
  }
}

// Paged K/V: the pools are a cache of rotated keys; q alone turns, query i of sequence b at
// cache_seqlens[b] - Nq + i: the bits of rotating q first with nn::RotaryTable.
TEST(RotaryOptions, PagedCallsRotateTheQueriesAlone) {
  Random rng;
  SCOPED_TRACE(rng.note());
  constexpr int64_t kPage = 4, kPages = 6;
  const Tensor k_pool = rng.randn(Shape{kPages, kPage, kKvHeads, kDk}), v_pool = rng.randn(Shape{kPages, kPage, kKvHeads, kDv});
  const std::vector<int64_t> lengths = {7, 10}, table = {5, 3, -1, 0, 2, 4};  // (2, 3), pages in any order
  const Tables t = random_tables(rng, 12);
  const qkv::nn::RotaryTable rope(kDk, {.cos = t.cos, .sin = t.sin});
  for (int64_t nq : {1, 3}) {
    const Tensor q = rng.randn(Shape{2, kQHeads, nq, kDk});
    AttentionOptions o = rotary(t, false, nq > 1 ? Mask::causal() : Mask());
    o.block_table = table;
    o.cache_seqlens = lengths;
    o.rotary_keys = false;
    const qkv::AttentionResult got = qkv::scaled_dot_product_attention(q, k_pool, v_pool, o);
    Tensor q_rot = q.clone();
    rope.apply_inplace(q_rot, {lengths[0] - nq, lengths[1] - nq});
    AttentionOptions plain = o;
    plain.rotary_cos = plain.rotary_sin = Tensor();
    EXPECT_EQ(got.output.to_vector(), qkv::scaled_dot_product_attention(q_rot, k_pool, v_pool, plain).output.to_vector());
  }
}

TEST(RotaryOptions, RefusesWhatItCannotPlace) {
  Random rng;
  const Tensor q = rng.randn(Shape{1, 2, 4, kDk}), k = rng.randn(Shape{1, 2, 9, kDk}), v = rng.randn(Shape{1, 2, 9, kDv});
  const auto call = [&](const Tensor& qx, const Tensor& kx, const AttentionOptions& o) {
    return [&, o] { qkv::scaled_dot_product_attention(qx, kx, v, o); };
  };
  const Tables t = random_tables(rng, 9);
  qkv_test::expect_error(call(q, k, rotary(random_tables(rng, 8), false)),
                         {"reach position 8", "positions 0 to 7 (seqlen_ro 8)"});
  const Tensor v_short = rng.randn(Shape{1, 2, 3, kDv});
  qkv_test::expect_error([&] { qkv::scaled_dot_product_attention(q, k.narrow(2, 0, 3), v_short, rotary(t, false)); },
                         {"4 queries but 3 keys", "query 0 would sit at position -1"});
  AttentionOptions mismatched = rotary(t, false);
  mismatched.rotary_sin = rng.uniform_tensor(Shape{9, kHalf + 1}, -1, 1);
  qkv_test::expect_error(call(q, k, mismatched), {"rotary tables", "(9, 7)", "(9, 8)", "same shape"});
  const Tables wide = random_tables(rng, 9, 10);
  qkv_test::expect_error(call(q, k, rotary(wide, false)), {"rotary_dim 20", "head_dim 19"});
  Tables poisoned = random_tables(rng, 20);
  poisoned.cos.at({15, 2}) = NAN;  // past the reached rows: fine
  EXPECT_NO_THROW(qkv::scaled_dot_product_attention(q, k, v, rotary(poisoned, false)));
  poisoned.cos.at({6, 2}) = INFINITY;
  qkv_test::expect_error(call(q, k, rotary(poisoned, false)), {"cos[6, 2] is inf", "finite"});
  AttentionOptions half_given;
  half_given.rotary_cos = t.cos;
  qkv_test::expect_error(call(q, k, half_given), {"sin is undefined"});
  qkv_test::expect_error(call(q, k.to(DType::BF16), rotary(t, false)), {"k is bf16", "rotary_keys = false"});
  const Tensor v_bf16 = v.to(DType::BF16);
  AttentionOptions cached = rotary(t, false);
  cached.rotary_keys = false;
  EXPECT_NO_THROW(qkv::scaled_dot_product_attention(q, k.to(DType::BF16), v_bf16, cached));

  // Masks that place the queries elsewhere than the tables would: a top-left band with Nq < Nk,
  // and per-batch key lengths over a longer cache.
  AttentionOptions top_left = rotary(t, false, Mask::causal());
  qkv_test::expect_error(call(q, k, top_left), {"keys up to i + 0", "i + 5", "Mask::causal(5)"});
  AttentionOptions padded_cache = rotary(t, false, Mask::key_lengths({7}));
  qkv_test::expect_error(call(q, k, padded_cache), {"key_lengths with 4 queries over 9 keys", "block_table"});
  // Outputs over the caller's q: refused as without tables (the kernels see only the copies).
  const Tensor v_wide = rng.randn(Shape{1, 2, 9, kDk});
  qkv::AttentionResult over_q;
  over_q.output = q;
  qkv_test::expect_error([&] { qkv::scaled_dot_product_attention_into(q, k, v_wide, over_q, rotary(t, false)); },
                         {"result.output shares storage with q"});
  // Cascade's levels are caches of rotated keys: the tables are refused, not dropped.
  qkv_test::expect_error(
      [&] { qkv::cascade_attention(q.narrow(2, 0, 1), k, v, k, v, rotary(t, false)); }, {"rotary_cos / rotary_sin"});

  const Tensor pool = rng.randn(Shape{3, 4, 2, kDk}), v_pool = rng.randn(Shape{3, 4, 2, kDv});
  AttentionOptions paged = rotary(random_tables(rng, 16), false);
  paged.block_table = {0, 1, 2};
  paged.cache_seqlens = {11};
  qkv_test::expect_error([&] { qkv::scaled_dot_product_attention(q, pool, v_pool, paged); },
                         {"rotary_keys is set with block_table", "rotary_keys = false"});
  paged.rotary_keys = false;
  qkv_test::expect_error([&] { qkv::scaled_dot_product_attention(q, pool, v_pool, paged); },
                         {"4 queries need a band", "flash_attn_with_kvcache"});
  paged.mask = Mask::causal();
  EXPECT_NO_THROW(qkv::scaled_dot_product_attention(q, pool, v_pool, paged));
}

}  // namespace
