// Packed variable-length batches (AttentionOptions::cu_seqlens_q / cu_seqlens_k): a packed call
// against the calls of its sequences one by one, bit for bit, forward (output, lse, row max and
// sum) and backward (dq, dk, dv, dsinks), with empty sequences (no queries, no keys), length 1,
// more queries than keys, GQA and odd dims, every mask kind a packed batch takes (the band
// aligned to the end of each sequence's keys, the rules in the sequence's own positions), the
// modifiers ((Hq) and (B, Hq) ALiBi, softcap, sinks), dropout, on every kernel, SIMD target and
// 1 and 2 threads, outputs poisoned with NaN; and the refusals of bad offsets and options.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"
#include "harness/sequence_cases.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::Backend;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int64_t kQHeads = 4, kKvHeads = 2, kDk = 13, kDv = 11;

// A packed batch: q (total_q, Hq, Dk), k (total_k, Hkv, Dk), v (total_k, Hkv, Dv), the offsets,
// and a grad_output (total_q, Hq, Dv).
struct Packed {
  std::vector<int64_t> cu_q{0}, cu_k{0};
  Tensor q, k, v, grad_output;
  int64_t count() const { return static_cast<int64_t>(cu_q.size()) - 1; }
  int64_t nq(int64_t b) const { return cu_q[b + 1] - cu_q[b]; }
  int64_t nk(int64_t b) const { return cu_k[b + 1] - cu_k[b]; }
};

// Sequences of (queries, keys): none of either, one, more queries than keys, a decode-like
// single query over many keys, and lengths across flash's tiles.
Packed random_packed(Random& rng) {
  const std::vector<std::pair<int64_t, int64_t>> lengths = {{7, 7}, {0, 4}, {1, 1}, {3, 0}, {20, 45},
                                                            {66, 66}, {1, 90}, {13, 9}, {0, 0}};
  Packed p;
  for (auto [nq, nk] : lengths) {
    p.cu_q.push_back(p.cu_q.back() + nq);
    p.cu_k.push_back(p.cu_k.back() + nk);
  }
  p.q = rng.randn(Shape{p.cu_q.back(), kQHeads, kDk});
  p.k = rng.randn(Shape{p.cu_k.back(), kKvHeads, kDk});
  p.v = rng.randn(Shape{p.cu_k.back(), kKvHeads, kDv});
  p.grad_output = rng.randn(Shape{p.cu_q.back(), kQHeads, kDv});
  return p;
}

// Rows [start, start + n) of a (total, H, D) tensor as a packed (1, H, n, D) copy.
Tensor sequence_copy(const Tensor& t, int64_t start, int64_t n) {
  return t.narrow(0, start, n).transpose(0, 1).unsqueeze(0).contiguous();
}
// Columns [start, start + n) of (H, total) row statistics, in (H, n) order.
std::vector<float> stats_of(const Tensor& t, int64_t start, int64_t n) {
  return t.narrow(1, start, n).contiguous().to_vector();
}

using MaskCase = qkv_test::SequenceMask;
using qkv_test::expect_error;
std::vector<MaskCase> mask_cases() { return qkv_test::sequence_masks(); }

// The modifiers of a case: none, or one of each kind with (B, Hq) ALiBi slopes.
void set_modifiers(AttentionOptions& o, bool on, int64_t batch, Random& rng) {
  if (!on) return;
  o.softcap = static_cast<float>(rng.uniform(0.5, 5.0));
  o.alibi_slopes = rng.uniform_tensor(Shape{batch, kQHeads}, 0.0, 0.5);
  o.sinks = rng.uniform_tensor(Shape{kQHeads}, -3.0, 3.0);
}

// Sequence b's own call of a packed call's options.
AttentionOptions alone_options(const AttentionOptions& packed, const MaskCase& mask, const Packed& p, int64_t b) {
  AttentionOptions o = packed;
  o.cu_seqlens_q.clear();
  o.cu_seqlens_k.clear();
  o.mask = mask.alone(p.nk(b) - p.nq(b));
  if (packed.alibi_slopes.defined() && packed.alibi_slopes.dim() == 2)
    o.alibi_slopes = packed.alibi_slopes.narrow(0, b, 1).squeeze(0).contiguous();
  o.seed = packed.seed + static_cast<uint64_t>(b);
  return o;
}

void expect_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t x = 0; x < got.size(); ++x)
    if (!(got[x] == want[x] || (std::isnan(got[x]) && std::isnan(want[x]))))
      FAIL() << what << " differs at " << x << ": packed " << got[x] << ", alone " << want[x];
}
void expect_zeros(const std::vector<float>& got, const std::string& what) {
  expect_bits(got, std::vector<float>(got.size(), 0.0f), what);
}

// The packed call, into NaN-poisoned results, against each sequence's own call.
void check_against_sequences(const Packed& p, const AttentionOptions& packed, const MaskCase& mask) {
  const int64_t total_q = p.cu_q.back();
  qkv::AttentionResult r;
  r.output = Tensor::full(Shape{total_q, kQHeads, kDv}, kNaN);
  for (Tensor* t : {&r.lse, &r.row_max, &r.row_sum}) *t = Tensor::full(Shape{kQHeads, total_q}, kNaN);
  qkv::scaled_dot_product_attention_into(p.q, p.k, p.v, r, packed);
  qkv::AttentionGrads g;
  g.dq = Tensor::full(p.q.shape(), kNaN);
  g.dk = Tensor::full(p.k.shape(), kNaN);
  g.dv = Tensor::full(p.v.shape(), kNaN);
  qkv::scaled_dot_product_attention_backward_into(p.grad_output, p.q, p.k, p.v, r, g, packed);

  std::vector<float> dsinks(kQHeads, 0.0f);
  for (int64_t b = 0; b < p.count(); ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b) + ": Nq=" + std::to_string(p.nq(b)) +
                 " Nk=" + std::to_string(p.nk(b)));
    const int64_t q0 = p.cu_q[b], k0 = p.cu_k[b], nq = p.nq(b), nk = p.nk(b);
    if (nq == 0) {
      expect_zeros(sequence_copy(g.dk, k0, nk).to_vector(), "dk of a sequence without queries");
      expect_zeros(sequence_copy(g.dv, k0, nk).to_vector(), "dv of a sequence without queries");
      continue;
    }
    const AttentionOptions o = alone_options(packed, mask, p, b);
    const Tensor q = sequence_copy(p.q, q0, nq), k = sequence_copy(p.k, k0, nk), v = sequence_copy(p.v, k0, nk);
    const qkv::AttentionResult alone = qkv::scaled_dot_product_attention(q, k, v, o);
    expect_bits(sequence_copy(r.output, q0, nq).to_vector(), alone.output.to_vector(), "output");
    expect_bits(stats_of(r.lse, q0, nq), alone.lse.to_vector(), "lse");
    expect_bits(stats_of(r.row_max, q0, nq), alone.row_max.to_vector(), "row_max");
    expect_bits(stats_of(r.row_sum, q0, nq), alone.row_sum.to_vector(), "row_sum");
    if (nk == 0) {
      expect_zeros(sequence_copy(g.dq, q0, nq).to_vector(), "dq of a sequence without keys");
      continue;
    }
    const qkv::AttentionGrads ga = qkv::scaled_dot_product_attention_backward(
        sequence_copy(p.grad_output, q0, nq), q, k, v, alone, o);
    expect_bits(sequence_copy(g.dq, q0, nq).to_vector(), ga.dq.to_vector(), "dq");
    expect_bits(sequence_copy(g.dk, k0, nk).to_vector(), ga.dk.to_vector(), "dk");
    expect_bits(sequence_copy(g.dv, k0, nk).to_vector(), ga.dv.to_vector(), "dv");
    if (ga.dsinks.defined())
      for (int64_t h = 0; h < kQHeads; ++h) dsinks[h] += ga.dsinks.to_vector()[h];
  }
  if (packed.sinks.defined()) expect_bits(g.dsinks.to_vector(), dsinks, "dsinks");
}

AttentionOptions packed_options(const Packed& p, Backend backend) {
  AttentionOptions o;
  o.cu_seqlens_q = p.cu_q;
  o.cu_seqlens_k = p.cu_k;
  o.backend = backend;
  return o;
}

TEST(Varlen, EverySequenceAsItsOwnCall) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Packed p = random_packed(rng);
  qkv_test::on_every_target_and_thread_count([&] {
    for (Backend backend : {Backend::Auto, Backend::Reference, Backend::Flash, Backend::Decode}) {
      SCOPED_TRACE("backend " + std::string(qkv::to_string(backend)));
      for (const MaskCase& mask : mask_cases())
        for (bool modifiers : {false, true}) {
          SCOPED_TRACE("mask " + mask.name + (modifiers ? " with softcap, (B, Hq) ALiBi, sinks" : ""));
          AttentionOptions o = packed_options(p, backend);
          o.mask = mask.whole;
          set_modifiers(o, modifiers, p.count(), rng);
          check_against_sequences(p, o, mask);
        }
    }
  });
}

TEST(Varlen, HeadAlibiAndDropout) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Packed p = random_packed(rng);
  const MaskCase causal = mask_cases()[1];
  qkv_test::on_every_target_and_thread_count([&] {
    for (Backend backend : {Backend::Auto, Backend::Reference, Backend::Flash}) {
      SCOPED_TRACE("backend " + std::string(qkv::to_string(backend)));
      AttentionOptions o = packed_options(p, backend);
      o.mask = causal.whole;
      o.alibi_slopes = rng.uniform_tensor(Shape{kQHeads}, 0.0, 0.5);
      check_against_sequences(p, o, causal);
      o.alibi_slopes = Tensor();
      o.dropout_p = 0.25f;
      o.seed = rng.next_u64();
      check_against_sequences(p, o, causal);
    }
  });
}

// A sequence's keys are its own: a packed call equals, on its rows, the same sequences padded to
// the longest with key lengths (the slow layout packing replaces), checked against the oracle's
// float64 reading through the per-sequence calls above, here once more on self-attention lengths.
TEST(Varlen, SelfAttentionMatchesPaddedKeyLengths) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<int64_t> lengths = {5, 1, 37, 0, 18};
  const int64_t longest = 37, batch = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> cu{0};
  for (int64_t n : lengths) cu.push_back(cu.back() + n);
  const Tensor q = rng.randn(Shape{cu.back(), kQHeads, kDk}), k = rng.randn(Shape{cu.back(), kKvHeads, kDk}),
               v = rng.randn(Shape{cu.back(), kKvHeads, kDv});
  AttentionOptions o;
  o.cu_seqlens_q = o.cu_seqlens_k = cu;
  o.mask = Mask::causal();
  const qkv::AttentionResult packed = qkv::scaled_dot_product_attention(q, k, v, o);
  // Padded: (B, H, longest, D) zeros with each sequence's rows at the start.
  auto pad = [&](const Tensor& t) {
    Tensor padded = Tensor::zeros(Shape{batch, t.size(1), longest, t.size(2)});
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < lengths[b]; ++i)
        for (int64_t h = 0; h < t.size(1); ++h)
          for (int64_t d = 0; d < t.size(2); ++d) padded.at({b, h, i, d}) = t.at({cu[b] + i, h, d});
    return padded;
  };
  AttentionOptions po;
  po.mask = Mask::causal() & Mask::key_lengths(lengths);
  const qkv::AttentionResult padded = qkv::scaled_dot_product_attention(pad(q), pad(k), pad(v), po);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < lengths[b]; ++i)
      for (int64_t h = 0; h < kQHeads; ++h) {
        EXPECT_NEAR(packed.lse.at({h, cu[b] + i}), padded.lse.at({b, h, i}), 1e-5);
        for (int64_t d = 0; d < kDv; ++d)
          EXPECT_NEAR(packed.output.at({cu[b] + i, h, d}), padded.output.at({b, h, i, d}), 1e-5);
      }
}

TEST(Varlen, BadOffsetsAndOptionsAreRefused) {
  Random rng;
  const Tensor q = rng.randn(Shape{9, kQHeads, kDk}), k = rng.randn(Shape{9, kKvHeads, kDk}),
               v = rng.randn(Shape{9, kKvHeads, kDv});
  auto with = [](std::vector<int64_t> cq, std::vector<int64_t> ck) {
    AttentionOptions o;
    o.cu_seqlens_q = std::move(cq);
    o.cu_seqlens_k = std::move(ck);
    return o;
  };
  auto forward = [&](const AttentionOptions& o) { return [&, o] { qkv::scaled_dot_product_attention(q, k, v, o); }; };
  expect_error(forward(with({1, 5, 9}, {0, 4, 9})), {"cu_seqlens_q[0] = 1", "start at 0"});
  expect_error(forward(with({0, 5, 3, 9}, {0, 3, 4, 9})), {"cu_seqlens_q[2] = 3 is below cu_seqlens_q[1] = 5"});
  expect_error(forward(with({0, 4, 9}, {0, 4, 8})), {"cu_seqlens_k[2] = 8", "k has 9 rows"});
  expect_error(forward(with({0, 4, 9}, {0, 9})), {"cu_seqlens_q has 3 entries but cu_seqlens_k 2"});
  expect_error(forward(with({0, 9}, {})), {"needs both"});
  expect_error(forward(with({0}, {0})), {"cu_seqlens_q has 1 entries", "B + 1 >= 2"});
  AttentionOptions o = with({0, 4, 9}, {0, 4, 9});
  expect_error([&] { qkv::scaled_dot_product_attention(q.unsqueeze(0), k, v, o); },
               {"q is (1, 9, 4, 13)", "(total_q, Hq, Dk)"});
  expect_error([&] { qkv::scaled_dot_product_attention(q, k, v.narrow(0, 0, 8), o); }, {"k is", "v is (8, 2, 11)"});
  AttentionOptions weights = o;
  weights.need_weights = true;
  expect_error(forward(weights), {"need_weights"});
  AttentionOptions lengths = o;
  lengths.mask = Mask::key_lengths({4, 5});
  expect_error(forward(lengths), {"key_lengths"});
  AttentionOptions tensor = o;
  tensor.mask = Mask::keep(Tensor::full(Shape{5, 5}, 1.0f));
  expect_error(forward(tensor), {"tensor mask"});
  // Rules that read by (b, i, j) would see sequence b's rows as batch 0's: refused wherever they sit.
  AttentionOptions function = o;
  function.mask = Mask::expression("flag(q) > 0", {{"flag", Tensor::full(Shape{9}, 1.0f)}});
  expect_error(forward(function), {"mask rule that reads", "mask function"});
  AttentionOptions keep_in_union = o;
  keep_in_union.mask = Mask::causal() | Mask::keep(Tensor::full(Shape{5, 5}, 1.0f));
  expect_error(forward(keep_in_union), {"mask rule that reads a keep tensor"});
  AttentionOptions quantized = o;
  quantized.k_scales = Tensor::full(Shape{9, kKvHeads, 1}, 1.0f);
  expect_error(forward(quantized), {"quantized K/V"});
  AttentionOptions slopes = o;
  slopes.alibi_slopes = Tensor::full(Shape{3, kQHeads}, 0.1f);
  expect_error(forward(slopes), {"alibi_slopes is (3, 4)", "2 sequences"});
  // The backward checks what the forward returned against the packed shapes.
  const qkv::AttentionResult r = qkv::scaled_dot_product_attention(q, k, v, o);
  qkv::AttentionResult bad = r;
  bad.lse = Tensor::zeros(Shape{1, kQHeads, 9});
  expect_error([&] { qkv::scaled_dot_product_attention_backward(rng.randn(Shape{9, kQHeads, kDv}), q, k, v, bad, o); },
               {"forward.lse is (1, 4, 9)", "(Hq, total_q)"});
}

}  // namespace
