// The gradient of an additive mask term, AttentionGrads::dbias (src/attention/bias_gradient.hpp):
//   - a float64 analytic dbias (dS = P (dP - D) from the oracle's weights, summed over the
//     bias's broadcast dims) checked against central finite differences of the float64 oracle,
//     on every broadcast shape of the bias, with structured masks and score modifiers;
//   - the reference, flash and decode-then-flash backwards against it on the same small cases,
//     and flash against it on larger odd shapes (GQA, Nq != Nk, several chunks of keys, a strided
//     mask), within max(floor, 4 x the reference's own error), dbias poisoned with NaN first, on
//     1 and 2 threads and on every SIMD target;
//   - the same bits on a repeat; no dbias without an additive term or with two; bad dbias shapes
//     named in the error.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"
#include "qkv/attention.hpp"
#include "qkv/error.hpp"

namespace {

using qkv::AttentionGrads;
using qkv::AttentionOptions;
using qkv::AttentionResult;
using qkv::Backend;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

constexpr double kInf = std::numeric_limits<double>::infinity();

// A problem with a bias: the bias is added after a structured mask (`mask`, `structure` its
// float64 meaning) and the score modifiers in `options`.
struct BiasCase {
  std::string name;
  Tensor q, k, v, grad_output, bias;
  Mask mask;
  qkv_test::Bias structure;
  AttentionOptions options;  // modifiers only; mask and backend set per run

  AttentionOptions options_for(Backend backend) const {
    AttentionOptions o = options;
    o.mask = mask & Mask::additive(bias);
    o.backend = backend;
    return o;
  }
  qkv_test::OracleModifiers modifiers() const {
    qkv_test::OracleModifiers m;
    m.softcap = options.softcap;
    if (options.alibi_slopes.defined()) m.alibi_slopes = qkv_test::to_doubles(options.alibi_slopes);
    if (options.sinks.defined()) m.sinks = qkv_test::to_doubles(options.sinks);
    return m;
  }
};

// The bias's dims aligned to (B, H, Nq, Nk), 1 where absent.
std::vector<int64_t> aligned_sizes(const Tensor& bias) {
  std::vector<int64_t> sizes(4, 1);
  const int64_t rank = bias.dim();
  static const int kPlace[5][4] = {{}, {}, {2, 3}, {0, 2, 3}, {0, 1, 2, 3}};
  for (int64_t d = 0; d < rank; ++d) sizes[static_cast<size_t>(kPlace[rank][d])] = bias.size(d);
  return sizes;
}

// The element of a packed bias of aligned `sizes` that score (b, h, i, j) reads.
size_t bias_index(const std::vector<int64_t>& s, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t at = (((s[0] == 1 ? 0 : b) * s[1] + (s[1] == 1 ? 0 : h)) * s[2] + (s[2] == 1 ? 0 : i)) * s[3] +
                     (s[3] == 1 ? 0 : j);
  return static_cast<size_t>(at);
}

// The float64 meaning of the whole mask with the bias's values read from `values`.
qkv_test::Bias oracle_bias(const BiasCase& c, const std::vector<double>& values) {
  const std::vector<int64_t> sizes = aligned_sizes(c.bias);
  qkv_test::Bias additive = [&values, sizes](int64_t b, int64_t h, int64_t i, int64_t j) {
    return values[bias_index(sizes, b, h, i, j)];
  };
  return qkv_test::all_of({c.structure, additive});
}

double loss_of(const BiasCase& c, const std::vector<double>& values, const std::vector<double>& g) {
  const qkv_test::OracleResult r = qkv_test::attention_oracle(
      qkv_test::dims_of(c.q, c.k, c.v), qkv_test::to_doubles(c.q), qkv_test::to_doubles(c.k),
      qkv_test::to_doubles(c.v), *c.options.scale, oracle_bias(c, values), {}, c.modifiers());
  double total = 0;
  for (size_t n = 0; n < g.size(); ++n) total += g[n] * r.output[n];
  return total;
}

// dbias in float64 from the oracle's weights P: dS = P (dP - D), dP_ij = G_i . V_j,
// D_i = sum_j P_ij dP_ij (the sink has no value), summed into the bias's elements.
std::vector<double> analytic_dbias(const BiasCase& c) {
  const qkv_test::AttentionDims d = qkv_test::dims_of(c.q, c.k, c.v);
  const std::vector<double> values = qkv_test::to_doubles(c.bias), g = qkv_test::to_doubles(c.grad_output),
                            v = qkv_test::to_doubles(c.v);
  const qkv_test::OracleResult r =
      qkv_test::attention_oracle(d, qkv_test::to_doubles(c.q), qkv_test::to_doubles(c.k), v, *c.options.scale,
                                 oracle_bias(c, values), {}, c.modifiers());
  const std::vector<int64_t> sizes = aligned_sizes(c.bias);
  std::vector<double> dbias(values.size(), 0.0), grad_weights(static_cast<size_t>(d.kv_len));
  const int64_t group = d.q_heads / d.kv_heads;
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.q_heads; ++h)
      for (int64_t i = 0; i < d.q_len; ++i) {
        const int64_t row = (b * d.q_heads + h) * d.q_len + i;
        const double* p = &r.weights[static_cast<size_t>(row * d.kv_len)];
        double dot = 0;
        for (int64_t j = 0; j < d.kv_len; ++j) {
          const double* v_row = &v[static_cast<size_t>(((b * d.kv_heads + h / group) * d.kv_len + j) * d.v_dim)];
          double s = 0;
          for (int64_t x = 0; x < d.v_dim; ++x) s += g[static_cast<size_t>(row * d.v_dim + x)] * v_row[x];
          grad_weights[static_cast<size_t>(j)] = s;
          dot += p[j] * s;
        }
        for (int64_t j = 0; j < d.kv_len; ++j)
          dbias[bias_index(sizes, b, h, i, j)] += p[j] * (grad_weights[static_cast<size_t>(j)] - dot);
      }
  return dbias;
}

std::vector<double> finite_difference_dbias(const BiasCase& c) {
  std::vector<double> values = qkv_test::to_doubles(c.bias);
  const std::vector<double> g = qkv_test::to_doubles(c.grad_output);
  constexpr double h = 1e-5;
  std::vector<double> grad(values.size());
  for (size_t n = 0; n < values.size(); ++n) {
    const double saved = values[n];
    if (std::isinf(saved)) continue;  // a hidden score: gradient 0
    values[n] = saved + h;
    const double up = loss_of(c, values, g);
    values[n] = saved - h;
    const double down = loss_of(c, values, g);
    values[n] = saved;
    grad[n] = (up - down) / (2 * h);
  }
  return grad;
}

// dbias from the library's forward and backward on `backend`, written into a NaN-poisoned
// tensor (so an element the backward leaves unwritten fails).
Tensor run_dbias(const BiasCase& c, Backend backend) {
  const AttentionOptions o = c.options_for(backend);
  const AttentionResult forward = qkv::scaled_dot_product_attention(c.q, c.k, c.v, o);
  AttentionGrads grads;
  grads.dbias = Tensor::full(c.bias.shape(), std::numeric_limits<float>::quiet_NaN());
  qkv::scaled_dot_product_attention_backward_into(c.grad_output, c.q, c.k, c.v, forward, grads, o);
  return grads.dbias;
}

// The bias shapes qkv accepts for scores (B, H, Nq, Nk): rank 2, 3 and 4, any dim 1.
std::vector<Shape> bias_shapes(int64_t b, int64_t h, int64_t nq, int64_t nk) {
  return {Shape{nq, nk},    Shape{1, nk},        Shape{nq, 1},        Shape{b, nq, nk},    Shape{1, nq, nk},
          Shape{b, 1, nk},  Shape{b, h, nq, nk}, Shape{1, h, nq, nk}, Shape{b, 1, nq, nk}, Shape{1, 1, nq, nk},
          Shape{1, h, 1, nk}, Shape{b, 1, 1, nk}, Shape{1, 1, 1, 1}};
}

enum class Structure { None, Causal, Window, KeyLengths, Keep, CausalAndLengths, Strided };

void set_structure(BiasCase& c, Structure s, Random& rng) {
  namespace t = qkv_test;
  const int64_t batch = c.q.size(0), heads = c.q.size(1), nq = c.q.size(2), nk = c.k.size(2);
  switch (s) {
    case Structure::None: c.mask = Mask(); c.structure = {}; c.name += " none"; return;
    case Structure::Causal: c.mask = Mask::causal(); c.structure = t::causal_bias(); c.name += " causal"; return;
    case Structure::Window: {
      const int64_t left = rng.integer(0, 5), right = rng.integer(0, 3);
      c.mask = Mask::window(left, right);
      c.structure = t::window_bias(left, right);
      c.name += " window";
      return;
    }
    case Structure::KeyLengths: {
      const std::vector<int64_t> lengths = t::random_lengths(rng, batch, nk);
      c.mask = Mask::key_lengths(lengths);
      c.structure = t::key_lengths_bias(lengths);
      c.name += " key_lengths";
      return;
    }
    case Structure::Keep: {
      const Tensor keep = t::random_keep(rng, Shape{batch, heads, nq, nk}, 0.7);
      c.mask = Mask::keep(keep);
      c.structure = t::keep_bias(keep);
      c.name += " keep";
      return;
    }
    case Structure::CausalAndLengths: {
      const std::vector<int64_t> lengths = t::random_lengths(rng, batch, nk);
      const int64_t offset = rng.integer(0, 4);
      c.mask = Mask::causal(offset) & Mask::key_lengths(lengths);
      c.structure = t::all_of({t::causal_bias(offset), t::key_lengths_bias(lengths)});
      c.name += " causal&key_lengths";
      return;
    }
    case Structure::Strided: {  // a stride >= flash's key tile: the forward gathers it by residues
      const int64_t stride = rng.integer(64, 90), left = rng.integer(0, 20);
      c.mask = Mask::causal() & (Mask::window(left) | Mask::strided(stride));
      c.structure = t::all_of({t::causal_bias(), t::any_of({t::window_bias(left), t::strided_bias(stride)})});
      c.name += " causal&(window|strided(" + std::to_string(stride) + "))";
      return;
    }
  }
}

// Modifiers: 0 none, 1 softcap, 2 ALiBi, 3 sinks, 4 all three.
BiasCase make_bias_case(Random& rng, const qkv_test::Sizes& s, const Shape& bias_shape, Structure structure,
                        int modifiers) {
  BiasCase c;
  c.q = rng.randn(Shape{s.batch, s.q_heads, s.nq, s.dk});
  c.k = rng.randn(Shape{s.batch, s.kv_heads, s.nk, s.dk});
  c.v = rng.randn(Shape{s.batch, s.kv_heads, s.nk, s.dv});
  c.grad_output = rng.randn(Shape{s.batch, s.q_heads, s.nq, s.dv});
  c.bias = qkv_test::random_additive(rng, bias_shape);
  c.options.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.dk)));
  if (modifiers == 1 || modifiers == 4) c.options.softcap = static_cast<float>(rng.uniform(0.5, 5.0));
  if (modifiers == 2 || modifiers == 4) c.options.alibi_slopes = rng.uniform_tensor(Shape{s.q_heads}, 0.0, 0.5);
  if (modifiers == 3 || modifiers == 4) c.options.sinks = rng.uniform_tensor(Shape{s.q_heads}, -3.0, 3.0);
  c.name = qkv_test::describe(s) + " bias " + bias_shape.str() + " modifiers " + std::to_string(modifiers) + " mask";
  set_structure(c, structure, rng);
  return c;
}

TEST(BiasGradient, AnalyticMatchesFiniteDifferencesAndKernelsMatchIt) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const qkv_test::Sizes s{2, 4, 2, 5, 7, 6, 5};
  const Structure structures[] = {Structure::None, Structure::Causal, Structure::Window, Structure::KeyLengths,
                                  Structure::Keep, Structure::CausalAndLengths};
  int n = 0;
  for (const Shape& shape : bias_shapes(s.batch, s.q_heads, s.nq, s.nk)) {
    const BiasCase c = make_bias_case(rng, s, shape, structures[n % 6], n % 5);
    ++n;
    SCOPED_TRACE(c.name);
    const std::vector<double> want = analytic_dbias(c);
    const qkv_test::Comparison fd = qkv_test::compare(
        std::vector<float>(want.begin(), want.end()), finite_difference_dbias(c), 1e-5);
    EXPECT_TRUE(fd.ok) << "analytic vs finite differences:\n" << fd.detail;
    for (Backend backend : {Backend::Reference, Backend::Flash, Backend::Decode}) {
      const Tensor got = run_dbias(c, backend);
      ASSERT_EQ(got.shape(), shape) << qkv::to_string(backend);
      const qkv_test::Comparison k = qkv_test::compare(got, want, 2e-5);
      EXPECT_TRUE(k.ok) << qkv::to_string(backend) << ":\n" << k.detail;
    }
  }
}

// Larger odd shapes: flash (and the reference) against the float64 dbias on every target and
// on 1 and 2 threads.
TEST(BiasGradient, FlashMatchesTheOracleEverywhere) {
  Random rng;
  SCOPED_TRACE(rng.note());
  struct Spec {
    qkv_test::Sizes sizes;
    int shape;  // index into bias_shapes
    Structure structure;
    int modifiers;
  };
  const Spec specs[] = {
      {{1, 2, 1, 300, 333, 64, 48}, 7, Structure::Causal, 0},       // (1, H, Nq, Nk), one pair: key chunks
      {{2, 4, 2, 150, 130, 32, 32}, 7, Structure::None, 4},         // (1, H, Nq, Nk) over 2 batches
      {{2, 4, 2, 113, 129, 17, 33}, 0, Structure::KeyLengths, 1},   // (Nq, Nk) over batches and heads
      {{3, 3, 1, 65, 150, 16, 8}, 6, Structure::Keep, 3},           // full
      {{2, 2, 2, 97, 120, 24, 24}, 10, Structure::Window, 2},       // (1, H, 1, Nk)
      {{2, 2, 1, 70, 90, 16, 16}, 2, Structure::CausalAndLengths, 0},  // (Nq, 1): across key chunks
      {{1, 2, 1, 400, 420, 16, 16}, 9, Structure::Strided, 0},      // strided: no residues with dbias
      {{2, 6, 3, 1, 200, 32, 32}, 11, Structure::None, 0},          // one query (decode's shape)
      {{2, 4, 2, 9, 140, 16, 16}, 8, Structure::Causal, 1},         // (B, 1, Nq, Nk), rows under a vector
  };
  std::vector<BiasCase> cases;
  std::vector<std::vector<double>> want;
  std::vector<double> tolerance;
  for (const Spec& spec : specs) {
    const qkv_test::Sizes& s = spec.sizes;
    cases.push_back(make_bias_case(rng, s, bias_shapes(s.batch, s.q_heads, s.nq, s.nk)[spec.shape], spec.structure,
                                   spec.modifiers));
    want.push_back(analytic_dbias(cases.back()));
    const double reference_error = qkv_test::compare(run_dbias(cases.back(), Backend::Reference), want.back(), kInf)
                                       .max_rel_diff;
    tolerance.push_back(std::max(2e-4, qkv_test::kToleranceFactor * reference_error));
  }
  qkv_test::on_every_target_and_thread_count([&] {
    for (size_t n = 0; n < cases.size(); ++n) {
      const qkv_test::Comparison c = qkv_test::compare(run_dbias(cases[n], Backend::Flash), want[n], tolerance[n]);
      EXPECT_TRUE(c.ok) << cases[n].name << ":\n" << c.detail;
    }
  });
}

TEST(BiasGradient, FlashIsBitIdenticalOnRepeat) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(2);
  qkv_test::ThreadEveryProblem threaded;
  // Key lengths that differ per batch element with a bias broadcast over the batch: the key
  // chunks of the elements must line up (a race on dbias lines when they did not).
  for (const auto& [shape, structure] : {std::pair{0, Structure::Causal}, std::pair{7, Structure::Causal},
                                         std::pair{0, Structure::KeyLengths}, std::pair{7, Structure::KeyLengths}}) {
    const qkv_test::Sizes s{3, 4, 2, 200, 180, 32, 32};
    const BiasCase c = make_bias_case(rng, s, bias_shapes(s.batch, s.q_heads, s.nq, s.nk)[shape], structure, 1);
    const std::vector<float> first = run_dbias(c, Backend::Flash).to_vector();
    for (int repeat = 0; repeat < 6; ++repeat) EXPECT_EQ(run_dbias(c, Backend::Flash).to_vector(), first) << c.name;
  }
  omp_set_num_threads(threads_before);
}

// Mask terms given as strided views (a key stride other than 1: a transposed tensor) are read
// line by line, where terms laid out by query rows are read by a tile's rows and transposed in
// registers (steps/tile_mask-inl.h, TileTerms): the same values, so the same bits, forward
// (output, lse) and backward (dQ, dK, dV, dbias), for a keep and an additive term of each
// query-row layout, on every SIMD target and thread count.
TEST(BiasGradient, FlashReadsTermsGivenAsStridedViews) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const qkv_test::Sizes s{2, 4, 2, 70, 83, 16, 24};
  // A view with the values of `t` whose last two dims are strided (key stride Nq).
  const auto strided = [](const Tensor& t) { return t.transpose(-1, -2).contiguous().transpose(-1, -2); };
  const Shape shapes[] = {Shape{s.nq, s.nk}, Shape{1, s.q_heads, s.nq, s.nk}, Shape{s.batch, s.q_heads, s.nq, s.nk}};
  for (const Shape& shape : shapes) {
    BiasCase c = make_bias_case(rng, s, shape, Structure::None, 1);
    const Tensor keep = qkv_test::random_keep(rng, shape, 0.8);
    const auto run = [&](const Tensor& keep_term, const Tensor& bias_term) {
      AttentionOptions o = c.options;
      o.mask = Mask::causal(20) & Mask::keep(keep_term) & Mask::additive(bias_term);
      o.backend = Backend::Flash;
      const AttentionResult forward = qkv::scaled_dot_product_attention(c.q, c.k, c.v, o);
      AttentionGrads g;
      g.dbias = Tensor::full(shape, std::numeric_limits<float>::quiet_NaN());
      qkv::scaled_dot_product_attention_backward_into(c.grad_output, c.q, c.k, c.v, forward, g, o);
      return std::vector<std::vector<float>>{forward.output.to_vector(), forward.lse.to_vector(),
                                             g.dq.to_vector(), g.dk.to_vector(), g.dv.to_vector(),
                                             g.dbias.to_vector()};
    };
    const Tensor keep_view = strided(keep), bias_view = strided(c.bias);
    ASSERT_FALSE(bias_view.is_contiguous());
    qkv_test::on_every_target_and_thread_count([&] {
      const auto want = run(keep, c.bias), got = run(keep_view, bias_view);
      for (size_t n = 0; n < want.size(); ++n) EXPECT_EQ(got[n], want[n]) << c.name << " part " << n;
    });
  }
}

// The flash backward takes dbias from the softmax gradient's dS when the scores have no slope
// and computes it apart when they do (flash/backward.cpp): an identity score function (slope 1)
// takes the second way, and must give the same bits as the first, for dbias and dQ, dK, dV.
TEST(BiasGradient, FlashWithoutSlopeEqualsIdentityScoreFunctionBitForBit) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const qkv_test::Sizes sizes[] = {{2, 4, 2, 150, 130, 32, 32}, {1, 2, 1, 113, 129, 17, 33}};
  const int shapes[] = {7, 0};
  const Structure structures[] = {Structure::Causal, Structure::KeyLengths};
  auto gradients = [](const BiasCase& c) {
    const AttentionOptions o = c.options_for(Backend::Flash);
    const AttentionResult forward = qkv::scaled_dot_product_attention(c.q, c.k, c.v, o);
    AttentionGrads g;
    g.dbias = Tensor::full(c.bias.shape(), std::numeric_limits<float>::quiet_NaN());
    qkv::scaled_dot_product_attention_backward_into(c.grad_output, c.q, c.k, c.v, forward, g, o);
    return std::vector<std::vector<float>>{g.dbias.to_vector(), g.dq.to_vector(), g.dk.to_vector(),
                                           g.dv.to_vector()};
  };
  for (size_t n = 0; n < 2; ++n) {
    const qkv_test::Sizes& s = sizes[n];
    BiasCase plain = make_bias_case(rng, s, bias_shapes(s.batch, s.q_heads, s.nq, s.nk)[shapes[n]], structures[n], 0);
    BiasCase identity = plain;
    identity.options.score_mod = "s";
    qkv_test::on_every_target_and_thread_count([&] {
      const std::vector<std::vector<float>> want = gradients(plain), got = gradients(identity);
      const char* names[] = {"dbias", "dq", "dk", "dv"};
      for (size_t t = 0; t < want.size(); ++t) {
        size_t differ = 0, first = 0;
        for (size_t e = 0; e < want[t].size(); ++e)
          if (!(got[t][e] == want[t][e]) && differ++ == 0) first = e;
        EXPECT_EQ(differ, 0u) << plain.name << " " << names[t] << ": first at " << first << ", "
                              << got[t][first] << " vs " << want[t][first];
      }
    });
  }
}

TEST(BiasGradient, OnlyForOneAdditiveTerm) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = rng.randn(Shape{1, 2, 9, 8}), k = rng.randn(Shape{1, 2, 11, 8}), v = rng.randn(Shape{1, 2, 11, 8});
  const Tensor g = rng.randn(Shape{1, 2, 9, 8});
  for (Backend backend : {Backend::Reference, Backend::Flash}) {
    AttentionOptions o;
    o.backend = backend;
    o.mask = Mask::causal() & Mask::keep(qkv_test::random_keep(rng, Shape{9, 11}, 0.8));
    AttentionGrads none = qkv::scaled_dot_product_attention_backward(g, q, k, v,
                                                                     qkv::scaled_dot_product_attention(q, k, v, o), o);
    EXPECT_FALSE(none.dbias.defined());
    o.mask = Mask::additive(rng.randn(Shape{9, 11})) & Mask::additive(rng.randn(Shape{1, 2, 9, 11}));
    AttentionGrads two = qkv::scaled_dot_product_attention_backward(g, q, k, v,
                                                                    qkv::scaled_dot_product_attention(q, k, v, o), o);
    EXPECT_FALSE(two.dbias.defined());
    EXPECT_TRUE(two.dq.defined());
  }
}

TEST(BiasGradient, ErrorsNameTheShapes) {
  Random rng;
  const Tensor q = rng.randn(Shape{2, 9, 8}), k = rng.randn(Shape{2, 11, 8}), v = rng.randn(Shape{2, 11, 8});
  const Tensor g = rng.randn(Shape{2, 9, 8});
  AttentionOptions o;
  o.mask = Mask::additive(rng.randn(Shape{1, 9, 11}));
  const AttentionResult forward = qkv::scaled_dot_product_attention(q, k, v, o);
  AttentionGrads grads;
  grads.dbias = Tensor::zeros(Shape{2, 9, 11});
  try {
    qkv::scaled_dot_product_attention_backward_into(g, q, k, v, forward, grads, o);
    FAIL() << "no error for a dbias of the wrong shape";
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("grads.dbias is (2, 9, 11) but should be (1, 9, 11)"), std::string::npos)
        << e.what();
  }
}

}  // namespace
