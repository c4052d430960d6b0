// What the one attention pipeline promises beyond matching the oracle (src/attention/problem.cpp,
// attention/steps/pipeline-inl.h): views are read and written where they are, with the same bits as their packed
// copies; gradients stay exact when a row's keys carry huge finite biases; the modifiers' options
// are checked; the threads deal every work item exactly once.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <omp.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "attention/kernels.hpp"
#include "harness/oracle.hpp"

namespace {

using qkv::AttentionGrads;
using qkv::AttentionOptions;
using qkv::AttentionResult;
using qkv::Backend;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;
using testing::HasSubstr;

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape()) return false;
  const std::vector<float> x = a.to_vector(), y = b.to_vector();
  return std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

// A (B, H, N, D) view of a (B, N, H, D) tensor holding the same values as `packed`: the head
// split of a multi-head module, read in place.
Tensor head_split_view(const Tensor& packed) {
  const Tensor bnhd = packed.transpose(1, 2).contiguous();
  return bnhd.transpose(1, 2);
}

// A view of the first N rows of a longer (B, H, capacity, D) cache holding `packed`'s values.
Tensor cache_slice_view(const Tensor& packed, int64_t extra, Random& rng) {
  const Shape& s = packed.shape();
  Tensor cache = rng.randn(Shape{s[0], s[1], s[2] + extra, s[3]});
  Tensor slice = cache.narrow(2, 0, s[2]);
  for (int64_t b = 0; b < s[0]; ++b)
    for (int64_t h = 0; h < s[1]; ++h)
      for (int64_t i = 0; i < s[2]; ++i)
        for (int64_t d = 0; d < s[3]; ++d) slice.at({b, h, i, d}) = packed.at({b, h, i, d});
  return slice;
}

TEST(Pipeline, StridedViewsGiveTheBitsOfTheirPackedCopies) {
  Random rng;
  SCOPED_TRACE(rng.note());
  // Head dims that are and are not whole vectors, and a query count that fills the flash
  // backward's query tiles on every target (whole tiles' Q and dO rows are read in place, here
  // H x D floats apart).
  for (const auto& [flash_nq, dk, dv] : {std::array<int64_t, 3>{37, 24, 20}, std::array<int64_t, 3>{96, 32, 32}})
    for (Backend backend : {Backend::Reference, Backend::Flash, Backend::Decode}) {
      SCOPED_TRACE("Nq " + std::to_string(flash_nq) + ", Dk " + std::to_string(dk) + ", Dv " + std::to_string(dv));
      const int64_t nq = backend == Backend::Decode ? 3 : flash_nq;
      const Tensor q = rng.randn(Shape{2, 4, nq, dk}), k = rng.randn(Shape{2, 2, 70, dk}),
                   v = rng.randn(Shape{2, 2, 70, dv});
      AttentionOptions options;
      options.backend = backend;
      options.mask = Mask::causal(70 - nq) & Mask::key_lengths({70, 50});
      options.softcap = 5;
      options.sinks = rng.randn(Shape{4});
      const AttentionResult packed = qkv::scaled_dot_product_attention(q, k, v, options);
      const AttentionResult split =
          qkv::scaled_dot_product_attention(head_split_view(q), head_split_view(k), head_split_view(v), options);
      const AttentionResult sliced =
          qkv::scaled_dot_product_attention(q, cache_slice_view(k, 9, rng), cache_slice_view(v, 9, rng), options);
      // The output written through a view: (B, Nq, H, Dv) memory, seen as (B, H, Nq, Dv).
      AttentionResult into;
      into.output = Tensor::empty(Shape{2, nq, 4, dv}).transpose(1, 2);
      qkv::scaled_dot_product_attention_into(q, k, v, into, options);
      for (const AttentionResult* r :
           std::initializer_list<const AttentionResult*>{&split, &sliced, static_cast<const AttentionResult*>(&into)}) {
        EXPECT_TRUE(same_bits(r->output, packed.output)) << qkv::to_string(backend);
        EXPECT_TRUE(same_bits(r->lse, packed.lse)) << qkv::to_string(backend);
      }
      const Tensor grad_output = rng.randn(packed.output.shape());
      const AttentionGrads want = qkv::scaled_dot_product_attention_backward(grad_output, q, k, v, packed, options);
      AttentionGrads got;  // gradients written into (B, N, H, D) buffers through transposed views
      got.dq = Tensor::empty(Shape{2, nq, 4, dk}).transpose(1, 2);
      got.dk = Tensor::empty(Shape{2, 70, 2, dk}).transpose(1, 2);
      got.dv = Tensor::empty(Shape{2, 70, 2, dv}).transpose(1, 2);
      qkv::scaled_dot_product_attention_backward_into(head_split_view(grad_output), head_split_view(q),
                                                      head_split_view(k), head_split_view(v), split, got, options);
      EXPECT_TRUE(same_bits(got.dq, want.dq)) << qkv::to_string(backend);
      EXPECT_TRUE(same_bits(got.dk, want.dk)) << qkv::to_string(backend);
      EXPECT_TRUE(same_bits(got.dv, want.dv)) << qkv::to_string(backend);
      EXPECT_TRUE(same_bits(got.dsinks, want.dsinks)) << qkv::to_string(backend);
    }
}

// The weights float32 autograd differentiates: softmax of the float32 scores fl(s + bias),
// computed here in float64 from those rounded scores. Query `row` of the (1, 1, 4, Nk) case.
std::vector<double> float32_softmax_row(const Tensor& q, const Tensor& k, const Tensor& bias, int64_t row) {
  const int64_t nk = k.size(2), d = q.size(3);
  std::vector<double> p(static_cast<size_t>(nk));
  double max = -std::numeric_limits<double>::infinity(), sum = 0;
  for (int64_t j = 0; j < nk; ++j) {
    double dot = 0;
    for (int64_t c = 0; c < d; ++c) dot += double{q.at({0, 0, row, c})} * k.at({0, 0, j, c});
    const float scaled = static_cast<float>(dot / std::sqrt(double(d)));
    p[static_cast<size_t>(j)] = static_cast<float>(scaled + bias.at({row, j}));
    max = std::max(max, p[static_cast<size_t>(j)]);
  }
  for (double& x : p) sum += (x = std::exp(x - max));
  for (double& x : p) x /= sum;
  return p;
}

// The reproducer and its relatives: a row whose keys (some or all) carry -1e4 (BERT),
// -1e9 (many tutorials) or float32's lowest (Hugging Face). dV = P^T dO checks the recomputed
// weights, which must be the forward's (summing to 1), not exp(s - lse) with log(n) lost in lse.
TEST(Pipeline, GradientsStayExactUnderHugeFiniteBiases) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (float bias_value : {-1e4f, -1e9f, std::numeric_limits<float>::lowest()}) {
    for (bool all_keys : {true, false}) {
      const Tensor q = rng.randn(Shape{1, 1, 4, 8}), k = rng.randn(Shape{1, 1, 4, 8}), v = rng.randn(Shape{1, 1, 4, 8});
      Tensor bias = Tensor::zeros(Shape{4, 4});
      for (int64_t j = 0; j < 4; ++j)
        if (all_keys || j % 2 == 1) bias.at({3, j}) = bias_value;
      for (Backend backend : {Backend::Reference, Backend::Flash}) {
        AttentionOptions options;
        options.mask = Mask::additive(bias);
        options.backend = backend;
        const AttentionResult forward = qkv::scaled_dot_product_attention(q, k, v, options);
        Tensor grad_output = Tensor::zeros(Shape{1, 1, 4, 8});
        grad_output.at({0, 0, 3, 0}) = 1;
        const AttentionGrads grads = qkv::scaled_dot_product_attention_backward(grad_output, q, k, v, forward, options);
        const std::vector<double> p = float32_softmax_row(q, k, bias, 3);
        const std::string what = "bias " + std::to_string(bias_value) + (all_keys ? " on all keys" : " on some keys") +
                                 ", " + std::string(qkv::to_string(backend));
        for (int64_t j = 0; j < 4; ++j)
          EXPECT_NEAR(grads.dv.at({0, 0, j, 0}), p[static_cast<size_t>(j)], 1e-5) << what << ", key " << j;
        if (all_keys && bias_value <= -1e9f)  // every score rounds to the bias: uniform weights
          for (int64_t j = 0; j < 4; ++j) EXPECT_FLOAT_EQ(grads.dv.at({0, 0, j, 0}), 0.25f) << what;
        for (float x : grads.dq.to_vector()) ASSERT_TRUE(std::isfinite(x)) << what;
        for (float x : grads.dk.to_vector()) ASSERT_TRUE(std::isfinite(x)) << what;
      }
    }
  }
}

// A backward given only lse (as from an older caller) still works where lse is exact.
TEST(Pipeline, BackwardFromLseAloneMatchesRowStats) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = rng.randn(Shape{2, 3, 9, 8}), k = rng.randn(Shape{2, 3, 11, 8}), v = rng.randn(Shape{2, 3, 11, 5});
  AttentionOptions options;
  options.mask = Mask::causal(2);
  options.sinks = rng.randn(Shape{3});
  const AttentionResult forward = qkv::scaled_dot_product_attention(q, k, v, options);
  AttentionResult lse_only{forward.output, {}, forward.lse, {}, {}};
  const Tensor grad_output = rng.randn(forward.output.shape());
  const AttentionGrads a = qkv::scaled_dot_product_attention_backward(grad_output, q, k, v, forward, options);
  const AttentionGrads b = qkv::scaled_dot_product_attention_backward(grad_output, q, k, v, lse_only, options);
  EXPECT_LT(qkv_test::max_rel_diff(a.dq, b.dq), 1e-5);
  EXPECT_LT(qkv_test::max_rel_diff(a.dk, b.dk), 1e-5);
  EXPECT_LT(qkv_test::max_rel_diff(a.dv, b.dv), 1e-5);
  EXPECT_LT(qkv_test::max_rel_diff(a.dsinks, b.dsinks), 1e-5);
}

// The same biases with lse alone (PyTorch's and FlashAttention's backward signature): rows whose
// lse lost log(n) get their max and sum back, so dV is the oracle's; when every row needs it, the
// gradients are those of the row stats, bit for bit. The reproducer: 1 query, 4 keys, -1e9
// on all of them, dv = 0.25 (it was 1.0).
TEST(Pipeline, BackwardFromLseAloneStaysExactUnderHugeFiniteBiases) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (float bias_value : {-1e4f, -1e9f, std::numeric_limits<float>::lowest()}) {
    for (bool all_rows : {false, true}) {
      const Tensor q = rng.randn(Shape{1, 1, 4, 8}), k = rng.randn(Shape{1, 1, 4, 8}), v = rng.randn(Shape{1, 1, 4, 8});
      Tensor bias = Tensor::zeros(Shape{4, 4});
      for (int64_t i = all_rows ? 0 : 3; i < 4; ++i)
        for (int64_t j = 0; j < 4; ++j) bias.at({i, j}) = bias_value;
      for (Backend backend : {Backend::Reference, Backend::Flash, Backend::Decode, Backend::Auto}) {
        AttentionOptions options;
        options.mask = Mask::additive(bias);
        options.backend = backend;
        const AttentionResult forward = qkv::scaled_dot_product_attention(q, k, v, options);
        const AttentionResult lse_only{forward.output, {}, forward.lse, {}, {}};
        Tensor grad_output = Tensor::zeros(Shape{1, 1, 4, 8});
        grad_output.at({0, 0, 3, 0}) = 1;
        const AttentionGrads from_lse =
            qkv::scaled_dot_product_attention_backward(grad_output, q, k, v, lse_only, options);
        const std::vector<double> p = float32_softmax_row(q, k, bias, 3);
        const std::string what = "bias " + std::to_string(bias_value) + (all_rows ? " on all rows" : " on one row") +
                                 ", " + std::string(qkv::to_string(backend));
        for (int64_t j = 0; j < 4; ++j)
          EXPECT_NEAR(from_lse.dv.at({0, 0, j, 0}), p[static_cast<size_t>(j)], 1e-5) << what << ", key " << j;
        if (bias_value <= -1e9f)  // every score rounds to the bias: uniform weights
          for (int64_t j = 0; j < 4; ++j) EXPECT_FLOAT_EQ(from_lse.dv.at({0, 0, j, 0}), 0.25f) << what;
        if (all_rows) {
          const AttentionGrads from_stats =
              qkv::scaled_dot_product_attention_backward(grad_output, q, k, v, forward, options);
          EXPECT_TRUE(same_bits(from_lse.dq, from_stats.dq)) << what;
          EXPECT_TRUE(same_bits(from_lse.dk, from_stats.dk)) << what;
          EXPECT_TRUE(same_bits(from_lse.dv, from_stats.dv)) << what;
        }
      }
    }
  }
  // The reproducer.
  const Tensor q = rng.randn(Shape{1, 8}), k = rng.randn(Shape{4, 8}), v = rng.randn(Shape{4, 8});
  AttentionOptions options;
  options.mask = Mask::additive(Tensor::full(Shape{1, 4}, -1e9f));
  const AttentionResult forward = qkv::scaled_dot_product_attention(q, k, v, options);
  Tensor grad_output = Tensor::zeros(Shape{1, 8});
  grad_output.at({0, 0}) = 1;
  const AttentionGrads grads = qkv::scaled_dot_product_attention_backward(
      grad_output, q, k, v, AttentionResult{forward.output, {}, forward.lse, {}, {}}, options);
  for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(grads.dv.at({j, 0}), 0.25f) << "key " << j;
}

// A row that sees no key with a sink: output zeros, lse = the sink, no NaN anywhere.
TEST(Pipeline, EmptyRowWithASinkGivesTheSinkAsLse) {
  for (Backend backend : {Backend::Reference, Backend::Flash, Backend::Decode}) {
    const Tensor q = Tensor::randn(Shape{1, 2, 3, 4}, 1), k = Tensor::randn(Shape{1, 2, 5, 4}, 2),
                 v = Tensor::randn(Shape{1, 2, 5, 4}, 3);
    AttentionOptions options;
    options.backend = backend;
    options.mask = Mask::key_lengths({0});
    options.sinks = Tensor::from({0.5f, -2.0f}, Shape{2});
    const AttentionResult r = qkv::scaled_dot_product_attention(q, k, v, options);
    for (float x : r.output.to_vector()) EXPECT_EQ(x, 0.0f) << qkv::to_string(backend);
    for (int64_t i = 0; i < 3; ++i) {
      EXPECT_EQ(r.lse.at({0, 0, i}), 0.5f) << qkv::to_string(backend);
      EXPECT_EQ(r.lse.at({0, 1, i}), -2.0f) << qkv::to_string(backend);
    }
  }
}

TEST(Pipeline, ModifierOptionsAreChecked) {
  const Tensor q = Tensor::randn(Shape{1, 2, 3, 4}, 1), k = Tensor::randn(Shape{1, 2, 5, 4}, 2),
               v = Tensor::randn(Shape{1, 2, 5, 4}, 3);
  auto message = [&](const AttentionOptions& options) {
    try {
      qkv::scaled_dot_product_attention(q, k, v, options);
    } catch (const qkv::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  AttentionOptions options;
  options.softcap = -1;
  EXPECT_THAT(message(options), HasSubstr("softcap must be 0 (off) or finite and positive, got -1"));
  options = {};
  options.alibi_slopes = Tensor::zeros(Shape{3});
  EXPECT_THAT(message(options), HasSubstr("alibi_slopes is (3) but should be (2), one per query head, or (1, 2), "
                                          "one per batch element and query head"));
  options.alibi_slopes = Tensor::zeros(Shape{2, 2});  // the batch is 1
  EXPECT_THAT(message(options), HasSubstr("alibi_slopes is (2, 2) but should be (2)"));
  options.alibi_slopes = Tensor::from({0.5f, std::numeric_limits<float>::quiet_NaN()}, Shape{1, 2});
  EXPECT_THAT(message(options), HasSubstr("alibi_slopes[0, 1] = nan is not finite"));
  options = {};
  options.sinks = Tensor::from({0.0f, std::numeric_limits<float>::infinity()}, Shape{2});
  EXPECT_THAT(message(options), HasSubstr("sinks[1] = inf is not finite"));
}

// for_each_item (simd/item_shares.hpp) runs every item exactly once for any count of workers and
// items, and a thread that runs out of its own share takes the others' items: with thread 0
// held in its first item until the other thread has run 7/8 of all items (which it can only by
// taking most of thread 0's share; the wait gives up after 20 s), thread 0 runs few of its own.
TEST(Pipeline, ForEachItemRunsEveryItemOnceAndBalances) {
  for (int workers : {2, 3, 4, 8, 70}) {
    for (int64_t items : {1, 2, 7, 64, 1001}) {
      std::vector<std::atomic<int>> runs(static_cast<size_t>(items));
      qkv::detail::for_each_item(workers, items, [&](int64_t item) { runs[static_cast<size_t>(item)]++; });
      for (int64_t item = 0; item < items; ++item)
        ASSERT_EQ(runs[static_cast<size_t>(item)].load(), 1) << workers << " workers, " << items << " items, item " << item;
    }
  }
  const int64_t items = 64;
  std::atomic<int64_t> by_thread_0{0}, by_others{0}, total{0};
  qkv::detail::for_each_item(2, items, [&](int64_t) {
    if (omp_get_thread_num() == 0) {
      if (by_thread_0++ == 0) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (by_others.load() < items - items / 8 && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    } else {
      by_others++;
    }
    total++;
  });
  EXPECT_EQ(total.load(), items);
  EXPECT_LT(by_thread_0.load(), items / 4) << "thread 0's share was not taken over by the other thread";

  // 2^31 items or more are dealt in runs of several (one 64-bit atomic per share holds a range
  // of 31-bit units below 2^31 - 1): 5 x 2^31 items in runs of 6, worker 1's share from the middle.
  const int64_t huge = int64_t{5} << 31;
  qkv::detail::ItemShares shares(2, huge);
  int64_t first = -1, last = -1;
  ASSERT_TRUE(shares.next(0, first, last));
  EXPECT_EQ(first, 0);
  EXPECT_EQ(last, 6);
  ASSERT_TRUE(shares.next(1, first, last));
  const int64_t units = (huge + 5) / 6;
  EXPECT_EQ(first, units / 2 * 6);
  EXPECT_EQ(last, first + 6);
}

}  // namespace

