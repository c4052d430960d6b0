// qkv::linear_attention and its backward against a direct O(N^2) float64 evaluation of the formula
//   out_i = sum_{j visible} phi(q_i).phi(k_j) v_j / (sum_{j visible} phi(q_i).phi(k_j) + eps)
// written here from the definition (every pair, no state, no chunks): both feature maps, causal
// or not (with offsets), lengths that are not multiples of the kernel's chunk, GQA, Nq != Nk,
// Dk != Dv, ranks 2 and 3, strided views; outputs poisoned with NaN first; every SIMD target,
// 1 and 2 threads. The backward against central finite differences of that float64 formula, and
// on larger shapes against a float64 analytic backward (itself checked by the differences).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"

namespace {

using qkv::FeatureMap;
using qkv::LinearAttentionOptions;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Dims {
  int64_t batch, q_heads, kv_heads, q_len, kv_len, dk, dv;
};

std::string describe(const Dims& d, const LinearAttentionOptions& o) {
  return "B" + std::to_string(d.batch) + " Hq" + std::to_string(d.q_heads) + " Hkv" + std::to_string(d.kv_heads) +
         " Nq" + std::to_string(d.q_len) + " Nk" + std::to_string(d.kv_len) + " Dk" + std::to_string(d.dk) + " Dv" +
         std::to_string(d.dv) + " " + std::string(qkv::to_string(o.feature_map)) +
         (o.causal ? " causal(offset=" + std::to_string(o.causal_offset) + ")" : " full") + " eps " +
         std::to_string(o.eps);
}

double phi(FeatureMap map, double x) {
  if (map == FeatureMap::Relu) return x > 0 ? x : 0;
  return x > 0 ? x + 1 : std::exp(x);
}
double phi_slope(FeatureMap map, double x) {
  if (map == FeatureMap::Relu) return x > 0 ? 1 : 0;
  return x > 0 ? 1 : std::exp(x);
}

bool visible(const LinearAttentionOptions& o, int64_t i, int64_t j) { return !o.causal || j <= i + o.causal_offset; }

// Packed (B, H, N, D) operands in float64.
struct Operands {
  std::vector<double> q, k, v;
};

Operands doubles(const Tensor& q, const Tensor& k, const Tensor& v) {
  return {qkv_test::to_doubles(q), qkv_test::to_doubles(k), qkv_test::to_doubles(v)};
}

// The formula, every pair. Also returns, per output element, the scale of its terms
// (sum_j a_ij |v_jc| / (den + eps) + |out|): float32's error is relative to that.
struct Forward {
  std::vector<double> out, scale;
};
Forward oracle(const Dims& d, const Operands& x, const LinearAttentionOptions& o) {
  Forward f;
  f.out.assign(static_cast<size_t>(d.batch * d.q_heads * d.q_len * d.dv), 0.0);
  f.scale = f.out;
  std::vector<double> num(static_cast<size_t>(d.dv)), mag(static_cast<size_t>(d.dv));
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.q_heads; ++h) {
      const int64_t g = h / (d.q_heads / d.kv_heads);
      for (int64_t i = 0; i < d.q_len; ++i) {
        const double* qi = &x.q[static_cast<size_t>(((b * d.q_heads + h) * d.q_len + i) * d.dk)];
        std::fill(num.begin(), num.end(), 0.0);
        std::fill(mag.begin(), mag.end(), 0.0);
        double den = 0;
        for (int64_t j = 0; j < d.kv_len; ++j) {
          if (!visible(o, i, j)) continue;
          const double* kj = &x.k[static_cast<size_t>(((b * d.kv_heads + g) * d.kv_len + j) * d.dk)];
          const double* vj = &x.v[static_cast<size_t>(((b * d.kv_heads + g) * d.kv_len + j) * d.dv)];
          double a = 0;
          for (int64_t f = 0; f < d.dk; ++f) a += phi(o.feature_map, qi[f]) * phi(o.feature_map, kj[f]);
          den += a;
          for (int64_t c = 0; c < d.dv; ++c) {
            num[static_cast<size_t>(c)] += a * vj[c];
            mag[static_cast<size_t>(c)] += a * std::abs(vj[c]);
          }
        }
        for (int64_t c = 0; c < d.dv; ++c) {
          const size_t at = static_cast<size_t>(((b * d.q_heads + h) * d.q_len + i) * d.dv + c);
          // A row of zero weights without eps: zeros (the header's contract), not 0 / 0.
          const double inverse = den + o.eps == 0 ? 0.0 : 1.0 / (den + o.eps);
          f.out[at] = num[static_cast<size_t>(c)] * inverse;
          f.scale[at] = mag[static_cast<size_t>(c)] * inverse + std::abs(f.out[at]);
        }
      }
    }
  return f;
}

struct Inputs {
  Tensor q, k, v;
};
Inputs random_inputs(Random& rng, const Dims& d) {
  return {rng.randn(Shape{d.batch, d.q_heads, d.q_len, d.dk}), rng.randn(Shape{d.batch, d.kv_heads, d.kv_len, d.dk}),
          rng.randn(Shape{d.batch, d.kv_heads, d.kv_len, d.dv})};
}

void expect_forward(const Tensor& got, const Forward& want, const std::string& what) {
  const std::vector<float> values = got.to_vector();
  ASSERT_EQ(values.size(), want.out.size()) << what;
  size_t bad = 0;
  for (size_t n = 0; n < values.size(); ++n) {
    const double tolerance = 2e-5 * (1 + want.scale[n]);
    if (!(std::abs(values[n] - want.out[n]) <= tolerance) && bad++ < 5)
      ADD_FAILURE() << what << ": element " << n << " is " << values[n] << ", the formula gives " << want.out[n];
  }
  EXPECT_EQ(bad, 0u) << what << ": elements off";
}

// Runs linear_attention_into on a NaN-poisoned output, on every runnable SIMD target and on 1
// and 2 threads, and compares each with the formula.
void check_everywhere(const Dims& d, const Inputs& in, const LinearAttentionOptions& o) {
  const Forward want = oracle(d, doubles(in.q, in.k, in.v), o);
  const std::string what = describe(d, o);
  const int threads_before = omp_get_max_threads();
  for (int64_t target : qkv_test::runnable_targets()) {
    qkv_test::ForcedTarget forced(target);
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      qkv_test::ThreadEveryProblem threaded;
      Tensor out = Tensor::full(Shape{d.batch, d.q_heads, d.q_len, d.dv}, kNaN);
      qkv::linear_attention_into(in.q, in.k, in.v, out, o);
      expect_forward(out, want, what + " on " + hwy::TargetName(target) + ", " + std::to_string(threads) + " threads");
    }
  }
  omp_set_num_threads(threads_before);
}

LinearAttentionOptions options(FeatureMap map, bool causal, int64_t offset = 0, float eps = 1e-6f) {
  LinearAttentionOptions o;
  o.feature_map = map;
  o.causal = causal;
  o.causal_offset = offset;
  o.eps = eps;
  return o;
}

// The message of the qkv::Error a call throws, or "no error".
std::string error_message(const std::function<void()>& call) {
  try {
    call();
  } catch (const qkv::Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(LinearAttention, MatchesTheFormulaOnOddShapes) {
  Random rng;
  SCOPED_TRACE(rng.note());
  // Lengths around the chunk (64): below, at, just past, several chunks and a tail.
  const std::vector<Dims> shapes = {
      {1, 1, 1, 1, 1, 1, 1},      {2, 2, 2, 5, 5, 3, 2},      {1, 4, 2, 63, 63, 16, 8},
      {1, 2, 1, 64, 64, 8, 16},   {2, 3, 3, 65, 65, 7, 5},    {1, 2, 2, 130, 130, 33, 17},
      {1, 4, 1, 200, 200, 64, 64}, {1, 2, 2, 129, 70, 9, 24},  {1, 2, 1, 40, 150, 12, 10},
  };
  for (const Dims& d : shapes) {
    const Inputs in = random_inputs(rng, d);
    for (FeatureMap map : {FeatureMap::EluPlusOne, FeatureMap::Relu}) {
      check_everywhere(d, in, options(map, false));
      check_everywhere(d, in, options(map, true));
    }
  }
}

TEST(LinearAttention, CausalOffsetsAndUnequalLengths) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<Dims> shapes = {{1, 2, 1, 70, 200, 8, 8}, {1, 2, 2, 150, 90, 5, 11}, {2, 1, 1, 3, 131, 16, 4}};
  for (const Dims& d : shapes) {
    const Inputs in = random_inputs(rng, d);
    // 0 (the default, as Mask::causal()), the queries at the end of the keys (a decoder), a
    // random offset either way, and one so negative that early queries see nothing.
    for (int64_t offset : {int64_t{0}, d.kv_len - d.q_len, rng.integer(-70, 70), -d.q_len / 2})
      for (FeatureMap map : {FeatureMap::EluPlusOne, FeatureMap::Relu})
        check_everywhere(d, in, options(map, true, offset, static_cast<float>(rng.uniform(0, 1e-3))));
  }
}

TEST(LinearAttention, RowsThatSeeNothingGetZeros) {
  Random rng;
  const Dims d{1, 1, 1, 10, 10, 4, 3};
  const Inputs in = random_inputs(rng, d);
  const Tensor out = qkv::linear_attention(in.q, in.k, in.v, options(FeatureMap::EluPlusOne, true, -4));
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(out.at({0, 0, i, c}), 0.0f) << "query " << i;
  EXPECT_NE(out.at({0, 0, 4, 0}), 0.0f);
}

TEST(LinearAttention, LongCausalSequence) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Dims d{1, 2, 1, 1000, 1000, 32, 32};
  const Inputs in = random_inputs(rng, d);
  for (FeatureMap map : {FeatureMap::EluPlusOne, FeatureMap::Relu}) {
    const LinearAttentionOptions o = options(map, true);
    Tensor out = Tensor::full(Shape{d.batch, d.q_heads, d.q_len, d.dv}, kNaN);
    qkv::linear_attention_into(in.q, in.k, in.v, out, o);
    expect_forward(out, oracle(d, doubles(in.q, in.k, in.v), o), describe(d, o));
  }
}

TEST(LinearAttention, RanksAndViewsGiveTheSameNumbers) {
  Random rng;
  const int64_t n = 77, dk = 12, dv = 9, heads = 3;
  const LinearAttentionOptions o = options(FeatureMap::EluPlusOne, true);
  // Rank 2 and 3 are one head of rank 4.
  const Tensor q2 = rng.randn(Shape{n, dk}), k2 = rng.randn(Shape{n, dk}), v2 = rng.randn(Shape{n, dv});
  const Tensor out2 = qkv::linear_attention(q2, k2, v2, o);
  EXPECT_EQ(out2.shape(), (Shape{n, dv}));
  const Tensor out4 = qkv::linear_attention(q2.reshape(Shape{1, 1, n, dk}), k2.reshape(Shape{1, 1, n, dk}),
                                            v2.reshape(Shape{1, 1, n, dv}), o);
  EXPECT_EQ(out2.to_vector(), out4.to_vector());
  const Tensor out3 = qkv::linear_attention(q2.reshape(Shape{1, n, dk}), k2.reshape(Shape{1, n, dk}),
                                            v2.reshape(Shape{1, n, dv}), o);
  EXPECT_EQ(out3.shape(), (Shape{1, n, dv}));
  EXPECT_EQ(out2.to_vector(), out3.to_vector());
  // A (B, N, H, D) head split read through its strides gives the bits of its packed copy.
  const Tensor qs = rng.randn(Shape{2, n, heads, dk}).transpose(1, 2);
  const Tensor ks = rng.randn(Shape{2, n, heads, dk}).transpose(1, 2);
  const Tensor vs = rng.randn(Shape{2, n, heads, dv}).transpose(1, 2);
  const Tensor packed = qkv::linear_attention(qs.contiguous(), ks.contiguous(), vs.contiguous(), o);
  EXPECT_EQ(qkv::linear_attention(qs, ks, vs, o).to_vector(), packed.to_vector());
  // An output view (the (B, N, H, Dv) layout multi-head attention concatenates) is written in place.
  Tensor into = Tensor::full(Shape{2, n, heads, dv}, kNaN).transpose(1, 2);
  qkv::linear_attention_into(qs, ks, vs, into, o);
  EXPECT_EQ(into.contiguous().to_vector(), packed.to_vector());
  // So are gradient views.
  const Tensor grad_output = rng.randn(Shape{2, heads, n, dv});
  const qkv::AttentionGrads want = qkv::linear_attention_backward(qs.contiguous(), ks.contiguous(), vs.contiguous(),
                                                                  grad_output, o);
  qkv::AttentionGrads views{Tensor::full(Shape{2, n, heads, dk}, kNaN).transpose(1, 2),
                            Tensor::full(Shape{2, n, heads, dk}, kNaN).transpose(1, 2),
                            Tensor::full(Shape{2, n, heads, dv}, kNaN).transpose(1, 2), Tensor()};
  qkv::linear_attention_backward_into(qs, ks, vs, grad_output.transpose(2, 3).contiguous().transpose(2, 3), views, o);
  EXPECT_EQ(views.dq.contiguous().to_vector(), want.dq.to_vector());
  EXPECT_EQ(views.dk.contiguous().to_vector(), want.dk.to_vector());
  EXPECT_EQ(views.dv.contiguous().to_vector(), want.dv.to_vector());
}

TEST(LinearAttention, BadArgumentsNameTheShapes) {
  Random rng;
  const Tensor q = rng.randn(Shape{1, 4, 8, 16}), k = rng.randn(Shape{1, 2, 8, 16}), v = rng.randn(Shape{1, 2, 8, 8});
  using testing::HasSubstr;
  EXPECT_THAT(error_message([&] { qkv::linear_attention(q, rng.randn(Shape{1, 2, 8, 15}), v); }),
              HasSubstr("linear_attention: q is (1, 4, 8, 16) but k is (1, 2, 8, 15): head dims differ"));
  EXPECT_THAT(error_message([&] { qkv::linear_attention(q, rng.randn(Shape{1, 3, 8, 16}), rng.randn(Shape{1, 3, 8, 8})); }),
              HasSubstr("query heads (4) must be a multiple of key/value heads (3)"));
  EXPECT_THAT(error_message([&] { qkv::linear_attention(q, k, rng.randn(Shape{1, 2, 9, 8})); }),
              HasSubstr("key and value lengths differ"));
  EXPECT_THAT(error_message([&] { qkv::linear_attention(q, k.reshape(Shape{2, 8, 16}), v); }), HasSubstr("ranks differ"));
  EXPECT_THAT(error_message([&] { qkv::linear_attention(rng.randn(Shape{16}), k, v); }), HasSubstr("rank must be 2, 3 or 4"));
  EXPECT_THAT(error_message([&] { qkv::linear_attention(Tensor(), k, v); }), HasSubstr("q is undefined"));
  EXPECT_THAT(error_message([&] { qkv::linear_attention(q, k, v, options(FeatureMap::Relu, false, 0, -1.0f)); }),
              HasSubstr("eps must be finite and >= 0"));
  EXPECT_THAT(error_message([&] { qkv::linear_attention(q, k, v, options(FeatureMap::Relu, false, 0, kNaN)); }),
              HasSubstr("eps must be finite and >= 0"));
  EXPECT_THAT(error_message([&] { qkv::linear_attention(q, k, v, options(static_cast<FeatureMap>(7), false)); }),
              HasSubstr("unknown feature map"));
  EXPECT_THAT(error_message([&] { qkv::linear_attention(q, k, v, options(FeatureMap::Relu, true, int64_t{1} << 61)); }),
              HasSubstr("causal_offset"));
  Tensor wrong = Tensor::empty(Shape{1, 4, 8, 9});
  EXPECT_THAT(error_message([&] { qkv::linear_attention_into(q, k, v, wrong); }),
              HasSubstr("output is (1, 4, 8, 9) but should be (1, 4, 8, 8)"));
  Tensor aliased = q.narrow(3, 0, 8);
  EXPECT_THAT(error_message([&] { qkv::linear_attention_into(q, k, v, aliased); }),
              HasSubstr("output shares storage with an input"));
  EXPECT_THAT(error_message([] { qkv::feature_map_from_string("softmax"); }), HasSubstr("choose elu+1 or relu"));
  EXPECT_EQ(qkv::feature_map_from_string("relu"), FeatureMap::Relu);
  EXPECT_EQ(qkv::feature_map_from_string("elu+1"), FeatureMap::EluPlusOne);
}

// ---- The backward.

struct Grads {
  std::vector<double> dq, dk, dv;
};

// The loss sum(grad_output * out) of the float64 formula.
double loss(const Dims& d, const Operands& x, const std::vector<double>& grad_output, const LinearAttentionOptions& o) {
  const Forward f = oracle(d, x, o);
  double sum = 0;
  for (size_t n = 0; n < f.out.size(); ++n) sum += f.out[n] * grad_output[n];
  return sum;
}

// Central finite differences of that loss, every input element, and each one's own error: the
// difference from the same at twice the step. It is large where the difference is unreliable: an
// input within a step of ReLU's kink, or a row whose denominator is near eps, where the loss
// curves so much that a 1e-6 step is off by 1e-5 of the largest gradient (such rows made the
// comparisons below fail about one run in a hundred).
struct FiniteDifferences {
  Grads value, error;
};
FiniteDifferences finite_differences(const Dims& d, Operands x, const std::vector<double>& grad_output,
                                     const LinearAttentionOptions& o) {
  const double step = 1e-6;
  auto derivative = [&](std::vector<double>& values, std::vector<double>& into, std::vector<double>& error) {
    into.resize(values.size());
    error.resize(values.size());
    auto central = [&](size_t n, double h) {
      const double keep = values[n];
      values[n] = keep + h;
      const double up = loss(d, x, grad_output, o);
      values[n] = keep - h;
      const double down = loss(d, x, grad_output, o);
      values[n] = keep;
      return (up - down) / (2 * h);
    };
    for (size_t n = 0; n < values.size(); ++n) {
      into[n] = central(n, step);
      error[n] = std::abs(into[n] - central(n, 2 * step));
    }
  };
  FiniteDifferences fd;
  derivative(x.q, fd.value.dq, fd.error.dq);
  derivative(x.k, fd.value.dk, fd.error.dk);
  derivative(x.v, fd.value.dv, fd.error.dv);
  return fd;
}

// The analytic backward in float64, pair by pair: with a_ij = phi(q_i).phi(k_j), den_i = sum a_ij
// + eps, out_i = sum a_ij v_j / den_i: da_ij = (dO_i . v_j - dO_i . out_i) / den_i, then
// dq_i = phi'(q_i) * sum_j da_ij phi(k_j), dk_j = phi'(k_j) * sum_i da_ij phi(q_i), dv_j = sum_i a_ij dO_i / den_i.
Grads analytic(const Dims& d, const Operands& x, const std::vector<double>& grad_output,
               const LinearAttentionOptions& o) {
  const Forward f = oracle(d, x, o);
  Grads g{std::vector<double>(x.q.size()), std::vector<double>(x.k.size()), std::vector<double>(x.v.size())};
  const FeatureMap map = o.feature_map;
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.q_heads; ++h) {
      const int64_t gh = h / (d.q_heads / d.kv_heads);
      for (int64_t i = 0; i < d.q_len; ++i) {
        const size_t qi = static_cast<size_t>(((b * d.q_heads + h) * d.q_len + i) * d.dk);
        const size_t oi = static_cast<size_t>(((b * d.q_heads + h) * d.q_len + i) * d.dv);
        double den = o.eps, d_out_dot_out = 0;
        for (int64_t c = 0; c < d.dv; ++c) d_out_dot_out += grad_output[oi + c] * f.out[oi + c];
        auto a_of = [&](size_t kj) {
          double a = 0;
          for (int64_t e = 0; e < d.dk; ++e) a += phi(map, x.q[qi + e]) * phi(map, x.k[kj + e]);
          return a;
        };
        for (int64_t j = 0; j < d.kv_len; ++j)
          if (visible(o, i, j)) den += a_of(static_cast<size_t>(((b * d.kv_heads + gh) * d.kv_len + j) * d.dk));
        if (den == 0) continue;  // a row of zero weights without eps: zero gradients (the contract)
        for (int64_t j = 0; j < d.kv_len; ++j) {
          if (!visible(o, i, j)) continue;
          const size_t kj = static_cast<size_t>(((b * d.kv_heads + gh) * d.kv_len + j) * d.dk);
          const size_t vj = static_cast<size_t>(((b * d.kv_heads + gh) * d.kv_len + j) * d.dv);
          const double a = a_of(kj);
          double d_out_dot_v = 0;
          for (int64_t c = 0; c < d.dv; ++c) {
            d_out_dot_v += grad_output[oi + c] * x.v[vj + c];
            g.dv[vj + c] += a * grad_output[oi + c] / den;
          }
          const double da = (d_out_dot_v - d_out_dot_out) / den;
          for (int64_t e = 0; e < d.dk; ++e) {
            g.dq[qi + e] += da * phi(map, x.k[kj + e]) * phi_slope(map, x.q[qi + e]);
            g.dk[kj + e] += da * phi(map, x.q[qi + e]) * phi_slope(map, x.k[kj + e]);
          }
        }
      }
    }
  return g;
}

// |got - want| <= tolerance * max(1, max |want|) (+ 4 x want's own error, when given) for every element.
void expect_grad(const std::vector<float>& got, const std::vector<double>& want, double tolerance,
                 const std::string& what, const std::vector<double>* want_error = nullptr) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double largest = 1;
  for (double w : want) largest = std::max(largest, std::abs(w));
  size_t bad = 0;
  for (size_t n = 0; n < got.size(); ++n) {
    const double allowed = tolerance * largest + (want_error ? 4 * (*want_error)[n] : 0.0);
    if (!(std::abs(got[n] - want[n]) <= allowed) && bad++ < 5)
      ADD_FAILURE() << what << ": element " << n << " is " << got[n] << ", expected " << want[n];
  }
  EXPECT_EQ(bad, 0u) << what;
}
void expect_grads(const Grads& got, const Grads& want, double tolerance, const std::string& what,
                  const Grads* want_error = nullptr) {
  expect_grad(std::vector<float>(got.dq.begin(), got.dq.end()), want.dq, tolerance, what + " dq",
              want_error ? &want_error->dq : nullptr);
  expect_grad(std::vector<float>(got.dk.begin(), got.dk.end()), want.dk, tolerance, what + " dk",
              want_error ? &want_error->dk : nullptr);
  expect_grad(std::vector<float>(got.dv.begin(), got.dv.end()), want.dv, tolerance, what + " dv",
              want_error ? &want_error->dv : nullptr);
}

// The library's backward into NaN-poisoned gradients.
qkv::AttentionGrads poisoned_backward(const Inputs& in, const Tensor& grad_output, const LinearAttentionOptions& o) {
  qkv::AttentionGrads grads{Tensor::full(in.q.shape(), kNaN), Tensor::full(in.k.shape(), kNaN),
                            Tensor::full(in.v.shape(), kNaN), Tensor()};
  qkv::linear_attention_backward_into(in.q, in.k, in.v, grad_output, grads, o);
  return grads;
}

Grads as_grads(const qkv::AttentionGrads& g) {
  return {qkv_test::to_doubles(g.dq), qkv_test::to_doubles(g.dk), qkv_test::to_doubles(g.dv)};
}

TEST(LinearAttentionBackward, MatchesFiniteDifferences) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<Dims> shapes = {{1, 2, 1, 7, 9, 3, 2}, {2, 1, 1, 6, 4, 2, 3}, {1, 2, 2, 5, 5, 4, 4}};
  for (const Dims& d : shapes) {
    const Inputs in = random_inputs(rng, d);
    const Tensor grad_output = rng.randn(Shape{d.batch, d.q_heads, d.q_len, d.dv});
    const Operands x = doubles(in.q, in.k, in.v);
    const std::vector<double> go = qkv_test::to_doubles(grad_output);
    for (FeatureMap map : {FeatureMap::EluPlusOne, FeatureMap::Relu})
      for (int64_t offset : {int64_t{-1}, int64_t{0}, int64_t{2}})
        for (bool causal : {false, true}) {
          if (!causal && offset != 0) continue;
          const LinearAttentionOptions o = options(map, causal, offset, 1e-3f);
          const FiniteDifferences fd = finite_differences(d, x, go, o);
          const std::string what = describe(d, o);
          expect_grads(analytic(d, x, go, o), fd.value, 1e-6, what + " analytic vs finite differences", &fd.error);
          expect_grads(as_grads(poisoned_backward(in, grad_output, o)), fd.value, 2e-5,
                       what + " library vs finite differences", &fd.error);
        }
  }
}

TEST(LinearAttentionBackward, MatchesTheAnalyticBackwardOnLargerShapes) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<Dims> shapes = {
      {1, 2, 1, 130, 130, 16, 8}, {2, 2, 2, 65, 63, 7, 5}, {1, 4, 2, 100, 170, 33, 17}, {1, 1, 1, 190, 70, 64, 64},
  };
  const int threads_before = omp_get_max_threads();
  for (const Dims& d : shapes) {
    const Inputs in = random_inputs(rng, d);
    const Tensor grad_output = rng.randn(Shape{d.batch, d.q_heads, d.q_len, d.dv});
    const Operands x = doubles(in.q, in.k, in.v);
    const std::vector<double> go = qkv_test::to_doubles(grad_output);
    for (FeatureMap map : {FeatureMap::EluPlusOne, FeatureMap::Relu})
      for (bool causal : {false, true}) {
        const int64_t offset = causal ? rng.integer(-20, 20) : 0;
        const LinearAttentionOptions o = options(map, causal, offset);
        const Grads want = analytic(d, x, go, o);
        for (int64_t target : qkv_test::runnable_targets()) {
          qkv_test::ForcedTarget forced(target);
          for (int threads : {1, 2}) {
            omp_set_num_threads(threads);
            qkv_test::ThreadEveryProblem threaded;
            expect_grads(as_grads(poisoned_backward(in, grad_output, o)), want, 1e-4,
                         describe(d, o) + " on " + hwy::TargetName(target) + ", " + std::to_string(threads) +
                             " threads");
          }
        }
      }
  }
  omp_set_num_threads(threads_before);
}

TEST(LinearAttentionBackward, BadArguments) {
  Random rng;
  const Tensor q = rng.randn(Shape{1, 2, 8, 4}), k = rng.randn(Shape{1, 2, 8, 4}), v = rng.randn(Shape{1, 2, 8, 3});
  using testing::HasSubstr;
  EXPECT_THAT(error_message([&] { qkv::linear_attention_backward(q, k, v, rng.randn(Shape{1, 2, 8, 4})); }),
              HasSubstr("linear_attention_backward: grad_output is (1, 2, 8, 4) but should be (1, 2, 8, 3)"));
  EXPECT_THAT(error_message([&] { qkv::linear_attention_backward(q, k, v, Tensor()); }), HasSubstr("grad_output is undefined"));
  EXPECT_THAT(error_message([&] { qkv::linear_attention_backward(q, rng.randn(Shape{1, 2, 7, 4}), v, v); }),
              HasSubstr("key and value lengths differ"));
  qkv::AttentionGrads wrong{Tensor::empty(Shape{1, 2, 8, 5}), Tensor(), Tensor(), Tensor()};
  EXPECT_THAT(error_message([&] { qkv::linear_attention_backward_into(q, k, v, rng.randn(Shape{1, 2, 8, 3}), wrong); }),
              HasSubstr("grads.dq is (1, 2, 8, 5) but should be (1, 2, 8, 4)"));
}

// With eps = 0, rows whose weights are all 0 (no keys at all, keys a causal offset hides, ReLU
// zeroing every product) give zeros forward and zero gradients, as softmax attention: not 0 / 0.
TEST(LinearAttention, ZeroWeightRowsWithoutEpsGetZeros) {
  Random rng;
  SCOPED_TRACE(rng.note());
  struct Case {
    Dims d;
    LinearAttentionOptions o;
    bool negative_keys;
  };
  const std::vector<Case> cases = {
      {{1, 2, 1, 5, 0, 3, 4}, options(FeatureMap::EluPlusOne, false, 0, 0.0f), false},
      {{1, 2, 1, 5, 0, 3, 4}, options(FeatureMap::Relu, true, 0, 0.0f), false},
      {{1, 1, 1, 9, 7, 4, 3}, options(FeatureMap::EluPlusOne, true, -4, 0.0f), false},
      {{2, 1, 1, 6, 5, 3, 2}, options(FeatureMap::Relu, false, 0, 0.0f), true},
  };
  for (const Case& c : cases) {
    Inputs in = random_inputs(rng, c.d);
    if (c.negative_keys) in.k = Tensor::full(in.k.shape(), -1.0f);  // ReLU: every product 0
    check_everywhere(c.d, in, c.o);
    const Tensor grad_output = rng.randn(Shape{c.d.batch, c.d.q_heads, c.d.q_len, c.d.dv});
    const Grads want = analytic(c.d, doubles(in.q, in.k, in.v), qkv_test::to_doubles(grad_output), c.o);
    for (int64_t target : qkv_test::runnable_targets()) {
      qkv_test::ForcedTarget forced(target);
      expect_grads(as_grads(poisoned_backward(in, grad_output, c.o)), want, 1e-4,
                   describe(c.d, c.o) + " backward on " + hwy::TargetName(target));
    }
  }
}

// 16-bit K/V are for softmax attention's caches: linear attention says so instead of reading them.
TEST(LinearAttention, SixteenBitKeysAndValuesAreAClearError) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = rng.randn({1, 2, 5, 4});
  const Tensor k = rng.randn({1, 2, 5, 4}).to(qkv::DType::BF16), v = rng.randn({1, 2, 5, 4}).to(qkv::DType::BF16);
  EXPECT_THAT(error_message([&] { (void)qkv::linear_attention(q, k, v); }),
              testing::HasSubstr("linear attention reads f32 K/V only"));
}

}  // namespace
