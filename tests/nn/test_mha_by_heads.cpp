// MultiHeadAttention's inference forward(x) by heads (src/nn/mha_by_heads.cpp): against the general
// forward (the same layer called as forward(x, x, x), which projects q, k and v apart and attends
// over every head in one call) on layers with GQA, MQA, causal, softcap, ALiBi, sinks and rotary,
// masks that read no head, odd batches and lengths, a strided x, on 2, 4 and 3 threads; which
// forwards take it; and an error thrown inside its region.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gemm/gemm.hpp"
#include "gemm/small.hpp"
#include "harness/oracle.hpp"
#include "nn/mha_by_heads.hpp"
#include "qkv/nn.hpp"

namespace {

using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv::nn::MultiHeadAttention;
using qkv::nn::MultiHeadAttentionOptions;
using qkv::nn::Weights;
using qkv_test::Random;

// 64 features: from about 6 rows on, the in-projection is enough work for the Small GEMM kernel
// to run on several threads, which is where the by-heads forward applies.
constexpr int64_t kEmbed = 64, kHeads = 8;

// OpenMP's thread count for a scope (the by-heads path needs more than one).
class Threads {
 public:
  explicit Threads(int n) : before_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~Threads() { omp_set_num_threads(before_); }
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;

 private:
  int before_;
};

// Forwards by heads so far (the counter is process-wide).
uint64_t by_heads() { return qkv::detail::mha_by_heads_forwards_for_test(); }

// Whether a forward of `rows` rows should go by heads on the current thread count: where the
// in-projection (E + 2 Hkv hd outputs) runs the Small kernel on several threads and the threads
// divide the KV heads (mha_by_heads.cpp's gate, for the layers and masks below).
bool goes_by_heads(int64_t rows, int64_t kv_heads) {
  const int64_t n = kEmbed + 2 * kv_heads * (kEmbed / kHeads);
  const int threads = omp_get_max_threads();
  return threads > 1 && kv_heads % threads == 0 &&
         qkv::detail::choose_gemm_path(false, true, rows, n, kEmbed) == qkv::detail::GemmPath::Small &&
         qkv::detail::small_rows_gemm_threads(rows, n, kEmbed);
}

// Where this build's GEMM choice never takes the Small kernel for these rows (oneDNN on a CPU
// without its wide tile), nothing goes by heads: the tests skip.
bool by_heads_possible() { return qkv::detail::choose_gemm_path(false, true, 20, 3 * kEmbed, kEmbed) == qkv::detail::GemmPath::Small; }

struct LayerCase {
  std::string name;
  MultiHeadAttentionOptions options;
};

std::vector<LayerCase> layers() {
  std::vector<LayerCase> out;
  out.push_back({"plain", {}});
  out.push_back({"GQA 2", {.num_kv_heads = 2}});
  out.push_back({"causal GQA 4", {.num_kv_heads = 4, .causal = true}});
  out.push_back({"causal softcap ALiBi sinks", {.causal = true, .softcap = 3.0f, .alibi = true, .sinks = true}});
  out.push_back({"rotary GQA 2", {.num_kv_heads = 2, .rotary = qkv::nn::RotaryEmbeddingOptions{}}});
  out.push_back({"no biases, precision High", {.bias = false, .precision = qkv::MatmulPrecision::High}});
  return out;
}

TEST(MhaByHeads, EqualsTheGeneralForward) {
  if (!by_heads_possible()) GTEST_SKIP() << "this build's GEMM choice takes no Small kernel here";
  Random rng;
  SCOPED_TRACE(rng.note());
  uint64_t taken = 0;
  for (const int threads : {2, 4, 3}) {
    const Threads scope(threads);
    for (const LayerCase& layer_case : layers()) {
      MultiHeadAttentionOptions options = layer_case.options;
      options.seed = rng.next_u64();
      MultiHeadAttention layer(kEmbed, kHeads, options);
      for (const auto& p : layer.parameters()) {  // biases and sinks too (they start at zero)
        const Tensor values = rng.randn(p.tensor.shape());
        std::copy_n(values.data(), values.numel(), p.tensor.data());
      }
      layer.eval();
      const int64_t kv_heads = layer.num_kv_heads();
      for (const auto& [batch, len] : std::vector<std::pair<int64_t, int64_t>>{{1, 13}, {2, 10}, {3, 7}, {1, 40}}) {
        // (B, N, E) through a transpose of (N, B, E) for one shape: x need not be contiguous
        const Tensor x = batch == 3 ? rng.randn(Shape{len, batch, kEmbed}).transpose(0, 1)
                                    : rng.randn(Shape{batch, len, kEmbed});
        std::vector<int64_t> lengths;
        for (int64_t b = 0; b < batch; ++b) lengths.push_back(rng.integer(1, len));
        for (const Mask& mask : {Mask(), Mask::window(2), Mask::key_lengths(lengths)}) {
          SCOPED_TRACE(layer_case.name + ", " + std::to_string(threads) + " threads, x " + x.shape().str() +
                       ", mask " + mask.str());
          const uint64_t before = by_heads();
          const Tensor got = layer.forward(x, mask).output;
          const bool expected = goes_by_heads(batch * len, kv_heads);
          EXPECT_EQ(by_heads(), before + (expected ? 1 : 0)) << "went by heads: expected " << expected;
          taken += by_heads() - before;
          const Tensor want = layer.forward(x, x, x, mask).output;
          ASSERT_EQ(got.shape(), want.shape());
          EXPECT_LE(qkv_test::max_rel_diff(got, want), 1e-5);
        }
      }
      // Unbatched (N, E) input: the same rows.
      const Tensor x = rng.randn(Shape{11, kEmbed});
      const uint64_t before = by_heads();
      const Tensor got = layer.forward(x).output;
      EXPECT_EQ(by_heads(), before + (goes_by_heads(11, kv_heads) ? 1 : 0)) << layer_case.name << ", unbatched";
      ASSERT_EQ(got.shape(), (Shape{11, kEmbed}));
      EXPECT_LE(qkv_test::max_rel_diff(got, layer.forward(x, x, x).output), 1e-5) << layer_case.name;
    }
  }
  EXPECT_GT(taken, 50u) << "too few forwards went by heads to test it";
}

// Only inference forward(x) of few rows on several threads, with a mask that reads no head and no
// weights asked for, goes by heads; everything else takes the general path.
TEST(MhaByHeads, TakenOnlyWhereItApplies) {
  if (!by_heads_possible()) GTEST_SKIP() << "this build's GEMM choice takes no Small kernel here";
  Random rng;
  SCOPED_TRACE(rng.note());
  const Threads scope(2);
  MultiHeadAttention layer(kEmbed, kHeads, {.seed = rng.next_u64()});
  const Tensor x = rng.randn(Shape{2, 10, kEmbed});
  const auto takes = [&](const MultiHeadAttention& l, const Mask& mask, Weights weights) {
    const uint64_t before = by_heads();
    (void)l.forward(x, mask, weights);
    return by_heads() == before + 1;
  };
  EXPECT_FALSE(takes(layer, {}, Weights::None)) << "training forward";
  layer.eval();
  EXPECT_TRUE(takes(layer, {}, Weights::None));
  EXPECT_EQ(omp_get_max_threads(), 2) << "the region's one-thread setting leaked to the caller";
  EXPECT_FALSE(takes(layer, {}, Weights::PerHead));
  EXPECT_FALSE(takes(layer, {}, Weights::Averaged));
  EXPECT_FALSE(takes(layer, Mask::keep(Tensor::full({1, 1, 10, 10}, 1.0f)), Weights::None)) << "a tensor term";
  EXPECT_FALSE(takes(layer, Mask::parse("mask: h < 4 || q >= k"), Weights::None)) << "a mask function";
  EXPECT_FALSE(takes(layer, Mask::causal() | Mask::window(3), Weights::None)) << "a rule tree";
  {
    const Threads one(1);
    EXPECT_FALSE(takes(layer, {}, Weights::None)) << "one thread";
  }
  {
    const Threads three(3);
    EXPECT_FALSE(takes(layer, {}, Weights::None)) << "3 threads for 8 KV heads: uneven";
  }
  // Many rows: the in-projection leaves the Small kernel, and the attention its threshold.
  const Tensor long_x = rng.randn(Shape{4, 512, kEmbed});
  const uint64_t before = by_heads();
  (void)layer.forward(long_x);
  EXPECT_EQ(by_heads(), before) << "4 x 512 rows";

  MultiHeadAttention mqa(kEmbed, kHeads, {.num_kv_heads = 1, .seed = rng.next_u64()});
  mqa.eval();
  EXPECT_FALSE(takes(mqa, {}, Weights::None)) << "one KV head: nothing to split";
  MultiHeadAttention gqa(kEmbed, kHeads, {.num_kv_heads = 2, .seed = rng.next_u64()});
  gqa.eval();
  EXPECT_TRUE(takes(gqa, {}, Weights::None)) << "2 KV heads, 2 threads";
  {
    const Threads four(4);
    EXPECT_FALSE(takes(gqa, {}, Weights::None)) << "2 KV heads, 4 threads";
  }
  MultiHeadAttention linear(kEmbed, kHeads, {.seed = rng.next_u64(), .attention = qkv::nn::AttentionKind::Linear});
  linear.eval();
  EXPECT_FALSE(takes(linear, {}, Weights::None)) << "linear attention";
}

// A team smaller than asked for (OpenMP may give fewer threads than num_threads): 2 threads for 4
// workers' shares. The shares nobody owns are taken from their back, so a thread holds runs of
// heads with gaps, each run attended where it was projected.
TEST(MhaByHeads, ATeamSmallerThanAskedTakesTheOwnerlessShares) {
  if (!by_heads_possible()) GTEST_SKIP() << "this build's GEMM choice takes no Small kernel here";
  Random rng;
  SCOPED_TRACE(rng.note());
  const Threads scope(4);
  const int team_before = qkv::detail::set_mha_by_heads_team_for_test(2);
  MultiHeadAttention layer(kEmbed, kHeads, {.causal = true, .alibi = true, .seed = rng.next_u64()});
  layer.eval();
  // Rounds enough that some thread surely steals across a gap (which heads each takes is timing).
  for (int round = 0; round < 100; ++round) {
    const Tensor x = rng.randn(Shape{2, 10, kEmbed});
    const uint64_t before = by_heads();
    const Tensor got = layer.forward(x).output;
    EXPECT_EQ(by_heads(), before + 1);
    EXPECT_LE(qkv_test::max_rel_diff(got, layer.forward(x, x, x).output), 1e-5) << "round " << round;
  }
  qkv::detail::set_mha_by_heads_team_for_test(team_before);
}

// An error inside the region (here the key lengths, which the core checks in every thread's call)
// comes out of forward as the general path's error, the team neither hangs nor leaks its thread
// count, and the next forward runs.
TEST(MhaByHeads, AnErrorInsideTheRegionIsThrownOnce) {
  if (!by_heads_possible()) GTEST_SKIP() << "this build's GEMM choice takes no Small kernel here";
  const Threads scope(2);
  MultiHeadAttention layer(kEmbed, kHeads);
  layer.eval();
  const Tensor x = Tensor::zeros({2, 10, kEmbed});
  const auto error_of = [&](const auto& forward) -> std::string {
    try {
      forward();
    } catch (const qkv::Error& e) {
      return e.what();
    }
    return "no error";
  };
  const Mask bad = Mask::key_lengths({4, 11});
  const std::string by_heads_error = error_of([&] { (void)layer.forward(x, bad); });
  const std::string general_error = error_of([&] { (void)layer.forward(x, x, x, bad); });
  EXPECT_NE(by_heads_error.find("mask key_lengths[1] = 11 is outside [0, 10]"), std::string::npos) << by_heads_error;
  EXPECT_EQ(by_heads_error, general_error);
  EXPECT_EQ(omp_get_max_threads(), 2);
  const uint64_t before = by_heads();
  EXPECT_EQ(layer.forward(x).output.shape(), (Shape{2, 10, kEmbed}));
  EXPECT_EQ(by_heads(), before + 1);
}

// Wrong sinks (a public member) get the general path's error, which names every head from 0.
TEST(MhaByHeads, BadSinksGetTheGeneralPathsError) {
  const Threads scope(2);
  MultiHeadAttention layer(kEmbed, kHeads, {.sinks = true});
  layer.eval();
  const Tensor x = Tensor::zeros({2, 10, kEmbed});
  const auto error_of = [&]() -> std::string {
    try {
      (void)layer.forward(x);
    } catch (const qkv::Error& e) {
      return e.what();
    }
    return "no error";
  };
  std::vector<float> values(kHeads, 0.5f);
  values[6] = std::nanf("");
  layer.sinks = Tensor::from(values, {kHeads});
  EXPECT_NE(error_of().find("sinks[6] = nan is not finite"), std::string::npos) << error_of();
  layer.sinks = Tensor::zeros({3});
  EXPECT_NE(error_of().find("sinks is (3) but should be (8)"), std::string::npos) << error_of();
}

}  // namespace
