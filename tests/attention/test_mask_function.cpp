// Mask functions in C++ (qkv::mask_function, Mask::function; qkv/flex.hpp): forward and backward
// against the same function written as text (Mask::expression: the same 0/1 per pair, the same
// block map, so the same bits) and as a dense keep tensor (the same attention by another path,
// within a tolerance), on flash and the reference, every SIMD target and 1 and 2 threads, into
// outputs poisoned with NaN; functions of the batch and head with and without a block map; and a
// null function refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "harness/kernel_cases.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::Backend;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

struct Result {
  qkv::AttentionResult forward;
  qkv::AttentionGrads grads;
  std::vector<std::vector<float>> all() const {
    return {forward.output.to_vector(), forward.lse.to_vector(), grads.dq.to_vector(), grads.dk.to_vector(),
            grads.dv.to_vector()};
  }
};
const char* const kNames[] = {"output", "lse", "dq", "dk", "dv"};

struct Operands {
  Tensor q, k, v, grad_output;
};

// Forward and backward into outputs poisoned with NaN (an element left unwritten fails).
Result poisoned_run(const Operands& x, const AttentionOptions& o) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int64_t b = x.q.size(0), hq = x.q.size(1), nq = x.q.size(2);
  Result r;
  r.forward.output = Tensor::full(Shape{b, hq, nq, x.v.size(3)}, nan);
  r.forward.lse = Tensor::full(Shape{b, hq, nq}, nan);
  qkv::scaled_dot_product_attention_into(x.q, x.k, x.v, r.forward, o);
  r.grads.dq = Tensor::full(x.q.shape(), nan);
  r.grads.dk = Tensor::full(x.k.shape(), nan);
  r.grads.dv = Tensor::full(x.v.shape(), nan);
  qkv::scaled_dot_product_attention_backward_into(x.grad_output, x.q, x.k, x.v, r.forward, r.grads, o);
  return r;
}

// Per batch, a document id for each of `length` tokens, documents of random lengths.
std::vector<float> random_documents(Random& rng, int64_t batch, int64_t length) {
  std::vector<float> docs(static_cast<size_t>(batch * length));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t x = 0, doc = 0; x < length; ++x) {
      if (rng.chance(0.02)) ++doc;
      docs[static_cast<size_t>(b * length + x)] = static_cast<float>(doc);
    }
  return docs;
}

// One function three ways: C++, text, and the dense keep tensor (B, Hq, Nq, Nk) of its values.
struct Twins {
  std::string name;
  Mask callable, text, dense;
};

template <class F>
Twins make_twins(const std::string& name, const F& f, qkv::MaskReads reads, const std::string& text,
                 std::map<std::string, Tensor> inputs, int64_t batch, int64_t heads, int64_t nq, int64_t nk) {
  std::vector<float> keep(static_cast<size_t>(batch * heads * nq * nk));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t j = 0; j < nk; ++j) keep[static_cast<size_t>(((b * heads + h) * nq + i) * nk + j)] = f(b, h, i, j);
  return {name, Mask::function(qkv::mask_function(f, reads)), Mask::expression(text, std::move(inputs)),
          Mask::keep(Tensor::from(std::move(keep), Shape{batch, heads, nq, nk}))};
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, double tolerance,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double largest = 1;
  for (float w : want)
    if (std::isfinite(w)) largest = std::max(largest, static_cast<double>(std::fabs(w)));
  for (size_t x = 0; x < got.size(); ++x) {
    if (std::isinf(want[x]) && got[x] == want[x]) continue;  // a row that sees nothing: lse -inf
    ASSERT_NEAR(got[x], want[x], tolerance * largest) << what << " at " << x;
  }
}

TEST(MaskCallable, MatchesItsTextTwinBitForBitAndItsKeepTensorEverywhere) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t batch = 2, hq = 4, hkv = 2, nq = 150, nk = 203, d = 24;
  const Operands x{rng.randn(Shape{batch, hq, nq, d}, 2.0), rng.randn(Shape{batch, hkv, nk, d}, 2.0),
                   rng.randn(Shape{batch, hkv, nk, d}), rng.randn(Shape{batch, hq, nq, d})};
  const int64_t length = nk;
  const std::vector<float> docs = random_documents(rng, batch, length);
  const Tensor doc_tensor = Tensor::from(docs, Shape{batch, length});
  const float* doc = docs.data();
  const int64_t window = rng.integer(20, 90);
  std::vector<Twins> twins;
  // A document mask with a causal offset (per batch: reads b), the shape of W2-docs.
  twins.push_back(make_twins(
      "documents, causal",
      [doc, length](int64_t b, int64_t, int64_t q, int64_t k) {
        return doc[b * length + q] == doc[b * length + k] && k <= q + 53;
      },
      {true, false}, "doc(q) == doc(k) && k <= q + 53", {{"doc", doc_tensor}}, batch, hq, nq, nk));
  // Prefix-LM per batch and a window that widens with the head: reads b and h.
  twins.push_back(make_twins(
      "prefix-LM or head window",
      [window](int64_t b, int64_t h, int64_t q, int64_t k) {
        return k < 17 + 40 * b || (k <= q + 53 && q + 53 - k < window + 10 * h);
      },
      {}, "k < 17 + 40 * b || (k <= q + 53 && q + 53 - k < " + std::to_string(window) + " + 10 * h)", {}, batch, hq,
      nq, nk));
  for (const Twins& t : twins)
    for (const Backend backend : {Backend::Flash, Backend::Reference}) {
      SCOPED_TRACE(t.name + ", " + std::string(qkv::to_string(backend)));
      AttentionOptions callable, text, dense;
      callable.backend = text.backend = dense.backend = backend;
      callable.mask = t.callable;
      text.mask = t.text;
      dense.mask = t.dense;
      qkv_test::on_every_target_and_thread_count([&] {
        const std::vector<std::vector<float>> got = poisoned_run(x, callable).all();
        const std::vector<std::vector<float>> twin = poisoned_run(x, text).all();
        const std::vector<std::vector<float>> want = poisoned_run(x, dense).all();
        for (size_t n = 0; n < got.size(); ++n) {
          EXPECT_EQ(got[n], twin[n]) << kNames[n] << " vs the text twin";
          expect_close(got[n], want[n], 2e-5, std::string(kNames[n]) + " vs the keep tensor");
        }
      });
    }
}

// A problem too large for a block map per batch and head (2^24 pairs) classifies its tiles by
// calling the function: the same results as with the map it gets when it reads neither.
TEST(MaskCallable, WithoutABlockMapTheSameAsWithOne) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int64_t batch = 1, heads = 66, n = 520, d = 16;
  const Operands x{rng.randn(Shape{batch, heads, n, d}), rng.randn(Shape{batch, heads, n, d}),
                   rng.randn(Shape{batch, heads, n, d}), rng.randn(Shape{batch, heads, n, d})};
  const auto documents = [](int64_t, int64_t, int64_t q, int64_t k) { return q / 130 == k / 130 && k <= q; };
  AttentionOptions mapped, unmapped;
  mapped.mask = Mask::function(qkv::mask_function(documents, {false, false}));
  unmapped.mask = Mask::function(qkv::mask_function(documents));
  mapped.backend = unmapped.backend = Backend::Flash;
  const std::vector<std::vector<float>> want = poisoned_run(x, mapped).all(), got = poisoned_run(x, unmapped).all();
  for (size_t k = 0; k < got.size(); ++k) EXPECT_EQ(got[k], want[k]) << kNames[k];
}

TEST(MaskCallable, NullIsRefused) {
  EXPECT_THROW(Mask::function(nullptr), qkv::Error);
}

}  // namespace
