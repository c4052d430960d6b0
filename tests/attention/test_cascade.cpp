// Shared-prefix (cascade) attention (qkv/cascade.hpp): each sequence's rows against plain
// attention over its own concatenated keys concat(prefix, suffix[:length]) (the decode kernel,
// and the float64 oracle), with odd dims, grouped-query heads, suffix lengths 0, 1, ragged and
// full, a prefix of 0 and 1 keys and one long enough for decode's chunks, several causal
// queries (ragged and uniform suffixes), many stacked rows (the prefix pass on flash),
// f32 / bf16 / f16 K/V, softcap and sinks (counted once), on every SIMD target and 1 and 2
// threads, into NaN-poisoned outputs; and the refusals of bad shapes, lengths and options.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::AttentionResult;
using qkv::Backend;
using qkv::DType;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Sizes {
  int64_t batch, q_heads, kv_heads, q_len, prefix_len, suffix_len, dk, dv;
  std::vector<int64_t> lengths;  // empty: every sequence holds all suffix_len keys
  bool causal = false;
  DType dtype = DType::F32;
  bool modifiers = false;  // softcap and sinks
  Backend backend = Backend::Auto;
};

// A case: the f32 values drawn, the K/V in the case's dtype, and what cascade is told.
struct Case {
  Sizes s;
  Tensor q, prefix_k, prefix_v, suffix_k, suffix_v;  // q f32; K/V f32 values before rounding
  AttentionOptions options;

  std::string name() const {
    std::string lengths;
    for (int64_t l : s.lengths) lengths += std::to_string(l) + " ";
    return "B=" + std::to_string(s.batch) + " Hq=" + std::to_string(s.q_heads) + " Hkv=" + std::to_string(s.kv_heads) +
           " Nq=" + std::to_string(s.q_len) + " Np=" + std::to_string(s.prefix_len) + " Ns=" +
           std::to_string(s.suffix_len) + " lengths=[" + lengths + "] causal=" + std::to_string(s.causal) + " " +
           std::string(qkv::to_string(s.dtype)) + (s.modifiers ? " softcap+sinks" : "") + " backend " +
           std::string(qkv::to_string(s.backend));
  }
  int64_t length(int64_t b) const { return s.lengths.empty() ? s.suffix_len : s.lengths[static_cast<size_t>(b)]; }
};

Case make_case(const Sizes& s, Random& rng) {
  Case c{s, rng.randn(Shape{s.batch, s.q_heads, s.q_len, s.dk}), rng.randn(Shape{1, s.kv_heads, s.prefix_len, s.dk}),
         rng.randn(Shape{1, s.kv_heads, s.prefix_len, s.dv}), rng.randn(Shape{s.batch, s.kv_heads, s.suffix_len, s.dk}),
         rng.randn(Shape{s.batch, s.kv_heads, s.suffix_len, s.dv}), {}};
  Mask mask = s.causal ? Mask::causal() : Mask();
  if (!s.lengths.empty()) mask = mask & Mask::key_lengths(s.lengths);
  c.options.mask = mask;
  c.options.scale = static_cast<float>(rng.uniform(0.2, 0.5));
  c.options.backend = s.backend;
  if (s.modifiers) {
    c.options.softcap = 3.0f;
    c.options.sinks = rng.uniform_tensor(Shape{s.q_heads}, -1.0, 2.0);
  }
  return c;
}

// Sequence b's keys or values, concat(prefix, suffix[b][:length]) as a packed (1, Hkv, Np + L, D)
// f32 tensor (rounded to the case's dtype afterwards, element by element, as cascade's inputs are).
Tensor concatenated(const Tensor& prefix, const Tensor& suffix, int64_t b, int64_t length) {
  const int64_t heads = prefix.size(1), np = prefix.size(2), d = prefix.size(3);
  Tensor out = Tensor::empty(Shape{1, heads, np + length, d});
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < np + length; ++j)
      for (int64_t c = 0; c < d; ++c)
        out.at({0, h, j, c}) = j < np ? prefix.at({0, h, j, c}) : suffix.at({b, h, j - np, c});
  return out;
}

// What each sequence's rows must be: plain attention over its concatenated keys, on the decode
// kernel (output and lse, (B, Hq, Nq, Dv) and (B, Hq, Nq)) and in float64.
struct Expected {
  Tensor decode_output, decode_lse;
  std::vector<double> output, lse;
};

Expected expect(const Case& c) {
  const Sizes& s = c.s;
  Expected e{Tensor::empty(Shape{s.batch, s.q_heads, s.q_len, s.dv}), Tensor::empty(Shape{s.batch, s.q_heads, s.q_len}),
             {}, {}};
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t keys = s.prefix_len + c.length(b);
    const Tensor q = c.q.narrow(0, b, 1).contiguous();
    const Tensor k = concatenated(c.prefix_k, c.suffix_k, b, c.length(b)).to(s.dtype);
    const Tensor v = concatenated(c.prefix_v, c.suffix_v, b, c.length(b)).to(s.dtype);
    AttentionOptions o;
    o.scale = c.options.scale;
    o.softcap = c.options.softcap;
    o.sinks = c.options.sinks;
    o.backend = Backend::Decode;
    if (s.causal) o.mask = Mask::causal(keys - s.q_len);  // the queries are the sequence's last positions
    AttentionResult alone;
    alone.output = e.decode_output.narrow(0, b, 1);
    alone.lse = e.decode_lse.narrow(0, b, 1);
    qkv::scaled_dot_product_attention_into(q, k, v, alone, o);

    qkv_test::OracleModifiers modifiers;
    modifiers.softcap = c.options.softcap;
    if (c.options.sinks.defined()) modifiers.sinks = qkv_test::to_doubles(c.options.sinks);
    const auto oracle = qkv_test::attention_oracle(
        q, k, v, *c.options.scale, s.causal ? qkv_test::causal_bias(keys - s.q_len) : qkv_test::Bias(), {}, modifiers);
    e.output.insert(e.output.end(), oracle.output.begin(), oracle.output.end());
    e.lse.insert(e.lse.end(), oracle.lse.begin(), oracle.lse.end());
  }
  return e;
}

// The case's call into NaN-poisoned outputs, against the expected values.
void check(const Case& c, const Expected& e) {
  SCOPED_TRACE(c.name());
  AttentionResult r;
  r.output = Tensor::full(Shape{c.s.batch, c.s.q_heads, c.s.q_len, c.s.dv}, kNaN);
  r.lse = Tensor::full(Shape{c.s.batch, c.s.q_heads, c.s.q_len}, kNaN);
  qkv::cascade_attention_into(c.q, c.prefix_k.to(c.s.dtype), c.prefix_v.to(c.s.dtype), c.suffix_k.to(c.s.dtype),
                              c.suffix_v.to(c.s.dtype), r, c.options);
  const auto against_oracle = qkv_test::compare(r.output, e.output);
  EXPECT_TRUE(against_oracle.ok) << "output against float64: " << against_oracle.detail;
  const auto lse_against_oracle = qkv_test::compare(r.lse, e.lse);
  EXPECT_TRUE(lse_against_oracle.ok) << "lse against float64: " << lse_against_oracle.detail;
  // Two float32 computations of one value, each within a few ulps of a sum of tens of terms.
  EXPECT_LE(qkv_test::max_rel_diff(r.output, e.decode_output), 1e-5) << "output against decode";
  EXPECT_LE(qkv_test::max_rel_diff(r.lse, e.decode_lse), 1e-5) << "lse against decode";
}

std::vector<Sizes> sizes() {
  return {
      // decode steps: GQA, odd dims, suffix lengths 0, 1 and full; with softcap and sinks
      {3, 6, 2, 1, 37, 21, 13, 11, {21, 0, 1}},
      {3, 6, 2, 1, 37, 21, 13, 11, {0, 1, 20}, false, DType::F32, true},
      {2, 4, 4, 1, 0, 9, 16, 16, {9, 4}},                                // no prefix
      {4, 2, 1, 1, 1, 5, 7, 9, {0, 1, 5, 3}, false, DType::F32, true},  // a prefix of one key
      {2, 3, 3, 1, 70, 0, 8, 8, {}, false, DType::F32, true},            // no suffix at all, a sink
      {2, 2, 1, 1, 19, 6, 8, 5, {0, 0}},                                 // every suffix empty
      {2, 2, 1, 1, 19, 6, 8, 5, {0, 0}, false, DType::F32, true},        // ... with sinks
      {2, 4, 2, 1, 1100, 33, 32, 24, {33, 2}},                           // a prefix of several decode chunks
      {5, 8, 2, 1, 300, 64, 64, 64, {}, false, DType::BF16, true},       // bf16, uniform suffixes
      {3, 4, 1, 1, 150, 40, 20, 20, {40, 0, 17}, false, DType::F16},
      // several queries: causal ragged (a call per sequence), causal uniform, non-causal ragged
      {3, 4, 2, 3, 29, 8, 13, 11, {8, 2, 5}, true, DType::F32, true},
      {2, 4, 2, 4, 29, 6, 12, 12, {}, true, DType::BF16},
      {2, 2, 2, 3, 17, 7, 9, 9, {0, 7}, false, DType::F16},
      {2, 2, 1, 3, 0, 5, 9, 9, {2, 5}, true},  // no prefix; query 0 of sequence 0 sees no key
      // 100 stacked rows: the prefix pass on flash
      {5, 4, 1, 20, 130, 40, 16, 16, {19, 40, 25, 33, 20}, true},
      // the passes on other kernels
      {3, 6, 2, 1, 37, 21, 13, 11, {21, 0, 1}, false, DType::F32, true, Backend::Reference},
      {3, 4, 2, 3, 29, 8, 13, 11, {8, 2, 5}, true, DType::BF16, true, Backend::Flash},
  };
}

TEST(Cascade, EqualsAttentionOverEachSequencesConcatenatedKeys) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  std::vector<Expected> expected;
  for (const Sizes& s : sizes()) {
    cases.push_back(make_case(s, rng));
    expected.push_back(expect(cases.back()));
  }
  qkv_test::on_every_target_and_thread_count([&] {
    for (size_t n = 0; n < cases.size(); ++n) check(cases[n], expected[n]);
  });
}

// The allocating call gives what the _into call gives, and a second _into call into the same
// outputs overwrites them.
TEST(Cascade, AllocatingCallAndReusedOutputs) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Case c = make_case({4, 4, 2, 1, 45, 12, 16, 16, {12, 3, 0, 7}, false, DType::F32, true}, rng);
  const AttentionResult once = qkv::cascade_attention(c.q, c.prefix_k, c.prefix_v, c.suffix_k, c.suffix_v, c.options);
  ASSERT_EQ(once.output.shape(), (Shape{4, 4, 1, 16}));
  ASSERT_EQ(once.lse.shape(), (Shape{4, 4, 1}));
  EXPECT_FALSE(once.row_max.defined());
  AttentionResult reused;
  for (int round = 0; round < 2; ++round)
    qkv::cascade_attention_into(c.q, c.prefix_k, c.prefix_v, c.suffix_k, c.suffix_v, reused, c.options);
  EXPECT_EQ(reused.output.to_vector(), once.output.to_vector());
  EXPECT_EQ(reused.lse.to_vector(), once.lse.to_vector());
}

void expect_error(const std::function<void()>& call, const std::string& words) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one saying: " << words;
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("cascade_attention: ", 0), 0u) << e.what();
  }
}

TEST(Cascade, BadInputsAreRefusedWithTheirValues) {
  Random rng;
  const Tensor q = rng.randn(Shape{2, 4, 1, 8}), pk = rng.randn(Shape{1, 2, 5, 8}), pv = rng.randn(Shape{1, 2, 5, 6});
  const Tensor sk = rng.randn(Shape{2, 2, 3, 8}), sv = rng.randn(Shape{2, 2, 3, 6});
  const auto call = [&](const Tensor& a, const Tensor& b, const Tensor& c, const Tensor& d, const Tensor& e,
                        const AttentionOptions& o = {}) {
    return [=] { qkv::cascade_attention(a, b, c, d, e, o); };
  };
  const auto with = [](auto set) {
    AttentionOptions o;
    set(o);
    return o;
  };
  expect_error(call(q.squeeze(2), pk, pv, sk, sv), "q is (2, 4, 8): it must be (B, Hq, Nq, Dk)");
  expect_error(call(q, rng.randn(Shape{2, 2, 5, 8}), pv, sk, sv), "the prefix must be one copy");
  expect_error(call(q, pk, rng.randn(Shape{1, 2, 4, 6}), sk, sv), "prefix_v (1, 2, 4, 6)");
  expect_error(call(q, pk, pv, rng.randn(Shape{3, 2, 3, 8}), sv), "suffix_k (3, 2, 3, 8)");
  expect_error(call(q, pk, pv, sk, rng.randn(Shape{2, 2, 3, 7})), "suffix_v (2, 2, 3, 7)");
  expect_error(call(rng.randn(Shape{2, 3, 1, 8}), pk, pv, sk, sv), "Hq = 3 is not a multiple of Hkv = 2");
  expect_error(call(q.to(DType::BF16), pk, pv, sk, sv), "q is bf16: it must be f32");
  expect_error(call(q, pk.to(DType::BF16), pv, sk, sv), "prefix_k is bf16 and prefix_v f32");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.mask = Mask::key_lengths({3, 4}); })),
               "key_lengths[1] = 4 is outside [0, Ns = 3]");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.mask = Mask::key_lengths({3}); })),
               "key_lengths has 1 entries but q has B = 2");
  expect_error(call(rng.randn(Shape{2, 4, 3, 8}), pk, pv, sk, sv,
                    with([](auto& o) { o.mask = Mask::causal() & Mask::key_lengths({3, 1}); })),
               "sequence 1 holds 1 suffix keys for Nq = 3 queries");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.mask = Mask::window(4); })),
               "the mask window(4) is not taken");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.mask = Mask::causal(2); })), "is not taken");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.mask = Mask::keep(Tensor::full(Shape{1, 8}, 1)); })),
               "is not taken");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.dropout_p = 0.1f; })), "dropout_p");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.need_weights = true; })), "need_weights");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.alibi_slopes = Tensor::full(Shape{4}, 0.1f); })),
               "alibi_slopes");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.score_mod = "s * 2"; })), "score or mask function");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.cu_seqlens_q = {0, 1}; })), "cu_seqlens");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.block_table = {0}; })), "block_table");
  expect_error(call(q, pk, pv, sk, sv, with([](auto& o) { o.sinks = Tensor::full(Shape{3}, 0.0f); })),
               "sinks is (3): it must be (Hq) = (4)");
  expect_error(call(q, pk, pv, sk, sv, with([&](auto& o) {
                 o.sinks = Tensor::from({0, 1, kNaN, 2}, Shape{4});
               })),
               "sinks[2] = nan");
  AttentionResult wrong;
  wrong.output = Tensor::empty(Shape{2, 4, 1, 5});
  expect_error([&] { qkv::cascade_attention_into(q, pk, pv, sk, sv, wrong); }, "result.output");
}

}  // namespace
