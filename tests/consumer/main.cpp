// A program outside qkv's tree, built against the installed package (find_package(qkv)) and
// using only <qkv/qkv.hpp>: it checks that the installed library reproduces a float64
// computation to 1e-4 relative for every mask kind, grouped-query heads, cross shapes
// (Nq != Nk, Dk != Dv) and rank-3 inputs. Exit status 0 only when every case matches.
#include <qkv/qkv.hpp>

#include <cstdio>
#include <string>

#include "harness/oracle.hpp"  // the float64 oracle, which uses the public API only

namespace {

using namespace qkv_test;

struct Case {
  std::string name;
  qkv::Shape q, k, v;
  qkv::Mask mask;
  Bias bias;  // the same mask, said to the oracle element by element
};

bool run(const Case& c, Random& random) {
  const qkv::Tensor q = random.randn(c.q), k = random.randn(c.k), v = random.randn(c.v);
  qkv::AttentionOptions options;
  options.mask = c.mask;
  options.need_weights = true;
  const qkv::AttentionResult got = qkv::scaled_dot_product_attention(q, k, v, options);
  const OracleResult want = attention_oracle(q, k, v, 1.0 / std::sqrt(double(q.size(-1))), c.bias);
  const Comparison output = compare(got.output, want.output);
  const Comparison weights = compare(got.weights, want.weights);
  const Comparison lse = compare(got.lse, want.lse);
  const bool ok = output.ok && weights.ok && lse.ok;
  std::printf("%-28s %s, maxdiff = %.2e\n", c.name.c_str(), ok ? "OK" : "FAILED",
              std::max({output.max_rel_diff, weights.max_rel_diff, lse.max_rel_diff}));
  if (!ok) std::printf("%s%s%s", output.detail.c_str(), weights.detail.c_str(), lse.detail.c_str());
  return ok;
}

}  // namespace

int main() {
  Random random;
  std::printf("qkv %s, %s\n", qkv::version(), random.note().c_str());
  const qkv::Tensor keep = random.uniform_tensor({2, 1, 13, 17}, 0, 1);
  qkv::Tensor keep01 = qkv::Tensor::from(keep.to_vector(), keep.shape());
  for (int64_t n = 0; n < keep01.numel(); ++n) keep01.data()[n] = keep01.data()[n] < 0.3f ? 0.0f : 1.0f;
  qkv::Tensor additive = random.randn({13, 17});
  for (int64_t n = 0; n < additive.numel(); n += 5) additive.data()[n] = -INFINITY;

  const std::vector<Case> cases = {
      {"none", {2, 4, 13, 16}, {2, 4, 17, 16}, {2, 4, 17, 8}, {}, {}},
      {"causal", {2, 4, 13, 16}, {2, 4, 13, 16}, {2, 4, 13, 16}, qkv::Mask::causal(), causal_bias()},
      {"causal offset 4 (cache)", {1, 2, 3, 8}, {1, 2, 7, 8}, {1, 2, 7, 5}, qkv::Mask::causal(4), causal_bias(4)},
      {"window(3, 1)", {2, 2, 17, 8}, {2, 2, 17, 8}, {2, 2, 17, 8}, qkv::Mask::window(3, 1), window_bias(3, 1)},
      {"key_lengths", {2, 4, 13, 16}, {2, 4, 17, 16}, {2, 4, 17, 8}, qkv::Mask::key_lengths({17, 6}),
       key_lengths_bias({17, 6})},
      {"keep (B, 1, Nq, Nk)", {2, 4, 13, 16}, {2, 4, 17, 16}, {2, 4, 17, 8}, qkv::Mask::keep(keep01),
       keep_bias(keep01)},
      {"additive (Nq, Nk) with -inf", {2, 4, 13, 16}, {2, 4, 17, 16}, {2, 4, 17, 8}, qkv::Mask::additive(additive),
       additive_bias(additive)},
      {"causal & key_lengths", {2, 2, 17, 8}, {2, 2, 17, 8}, {2, 2, 17, 8},
       qkv::Mask::causal() & qkv::Mask::key_lengths({3, 17}), all_of({causal_bias(), key_lengths_bias({3, 17})})},
      {"GQA 8 query / 2 kv heads", {1, 8, 13, 16}, {1, 2, 17, 16}, {1, 2, 17, 12}, qkv::Mask::causal(4),
       causal_bias(4)},
      {"rank 3 (B, N, D) cross", {3, 13, 16}, {3, 29, 16}, {3, 29, 7}, qkv::Mask::key_lengths({29, 1, 0}),
       key_lengths_bias({29, 1, 0})},
      {"rank 2 (N, D)", {5, 16}, {9, 16}, {9, 16}, {}, {}},
  };
  int failures = 0;
  for (const Case& c : cases) failures += run(c, random) ? 0 : 1;
  std::printf("consumer: %zu cases OK, %d FAILED\n", cases.size() - failures, failures);
  return failures == 0 ? 0 : 1;
}
