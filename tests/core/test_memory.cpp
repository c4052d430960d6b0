// Memory: what the library allocates, counted by qkv::memory_stats(). The flash path's working
// memory stays O(N d) where the reference's grows as N^2; results written into caller-provided
// tensors (scaled_dot_product_attention_into) reuse them, and repeated calls allocate nothing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "harness/oracle.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::AttentionResult;
using qkv::Backend;
using qkv::Mask;
using qkv::Tensor;
using ::testing::HasSubstr;

constexpr int64_t kMiB = int64_t{1} << 20;

// The bytes a call allocates beyond what was held before it, at its peak.
template <typename Call>
int64_t extra_bytes(Call&& call) {
  const int64_t before = qkv::memory_stats().current_bytes;
  qkv::reset_peak_memory();
  call();
  return qkv::memory_stats().peak_bytes - before;
}

// The fused kernel never holds the N x N scores: at N = 32768, one head, d = 64 the reference
// would need 4 GiB for them, flash's whole extra memory (output and lse included) stays under
// 16 MiB. A sliding window keeps the test fast; flash's scratch does not depend on the mask.
TEST(Memory, FlashExtraMemoryStaysSmallAtLongSequences) {
  const int64_t n = 32768, d = 64;
  qkv_test::Random random;
  SCOPED_TRACE(random.note());
  const Tensor q = random.randn({1, 1, n, d}), k = random.randn({1, 1, n, d}), v = random.randn({1, 1, n, d});
  AttentionOptions options;
  options.backend = Backend::Flash;
  options.mask = Mask::causal() & Mask::window(63);
  qkv::release_workspaces();
  AttentionResult result;
  const int64_t extra = extra_bytes([&] { result = qkv::scaled_dot_product_attention(q, k, v, options); });
  EXPECT_LT(extra, 16 * kMiB) << "flash allocated " << extra << " bytes";
  EXPECT_GE(extra, n * d * int64_t{sizeof(float)}) << "the output alone is N x d floats: the counter missed it";
  // Spot-check a row against the oracle so the call did real work.
  const int64_t row = n - 1;
  double row_max = -qkv_test::kInf;
  std::vector<double> scores;
  for (int64_t j = row - 63; j <= row; ++j) {
    double dot = 0;
    for (int64_t c = 0; c < d; ++c) dot += double(q.at({0, 0, row, c})) * k.at({0, 0, j, c});
    scores.push_back(dot / 8.0);
    row_max = std::max(row_max, scores.back());
  }
  double sum = 0;
  for (double& s : scores) sum += (s = std::exp(s - row_max));
  for (int64_t c = 0; c < d; c += 9) {
    double want = 0;
    for (int64_t j = 0; j < 64; ++j) want += scores[j] / sum * v.at({0, 0, row - 63 + j, c});
    EXPECT_NEAR(result.output.at({0, 0, row, c}), want, 1e-4 * std::max(1.0, std::abs(want)));
  }
}

// The reference materialises the scores: its extra memory is at least Nq x Nk floats, which is
// what the flash test above is measured against.
TEST(Memory, ReferenceHoldsTheScoreMatrix) {
  const int64_t n = 1024, d = 16;
  const Tensor q = Tensor::randn({1, 1, n, d}, 1), k = Tensor::randn({1, 1, n, d}, 2), v = Tensor::randn({1, 1, n, d}, 3);
  AttentionOptions options;
  options.backend = Backend::Reference;
  qkv::release_workspaces();
  const int64_t extra = extra_bytes([&] { qkv::scaled_dot_product_attention(q, k, v, options); });
  EXPECT_GE(extra, n * n * int64_t{sizeof(float)});
}

// Writing into the same result again reuses its tensors and, once the workspaces are warm,
// allocates nothing; the values equal a fresh call's.
TEST(Memory, IntoReusesResultAndWorkspaces) {
  qkv_test::Random random;
  SCOPED_TRACE(random.note());
  const Tensor q = random.randn({2, 4, 37, 24}), k = random.randn({2, 2, 53, 24}), v = random.randn({2, 2, 53, 20});
  for (Backend backend : {Backend::Flash, Backend::Decode, Backend::Reference}) {
    for (bool need_weights : {false, true}) {
      if (backend != Backend::Reference && need_weights) continue;
      AttentionOptions options;
      options.backend = backend;
      options.need_weights = need_weights;
      options.mask = Mask::causal(16);
      AttentionResult result;
      qkv::scaled_dot_product_attention_into(q, k, v, result, options);  // allocates, warms up
      const float* output_data = result.output.data();
      const int64_t extra = extra_bytes([&] { qkv::scaled_dot_product_attention_into(q, k, v, result, options); });
      EXPECT_EQ(extra, 0) << qkv::to_string(backend) << " allocated on a warm call";
      EXPECT_EQ(result.output.data(), output_data) << "the output tensor was replaced, not reused";
      const AttentionResult fresh = qkv::scaled_dot_product_attention(q, k, v, options);
      EXPECT_EQ(result.output.to_vector(), fresh.output.to_vector());
      EXPECT_EQ(result.lse.to_vector(), fresh.lse.to_vector());
      if (need_weights) EXPECT_EQ(result.weights.to_vector(), fresh.weights.to_vector());
    }
  }
}

// A caller-provided output of the wrong shape, a view, or one that aliases an input is refused.
TEST(Memory, IntoRejectsUnfitOutputs) {
  const Tensor q = Tensor::randn({2, 5, 8}, 1), k = Tensor::randn({2, 6, 8}, 2), v = Tensor::randn({2, 6, 3}, 3);
  auto message = [&](AttentionResult result) {
    try {
      qkv::scaled_dot_product_attention_into(q, k, v, result);
    } catch (const qkv::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(message({Tensor::empty({2, 5, 4}), {}, {}}),
              HasSubstr("result.output is (2, 5, 4) but should be (2, 5, 3)"));
  EXPECT_THAT(message({Tensor::empty({2, 3, 5}).transpose(1, 2), {}, {}}),
              HasSubstr("result.output (2, 5, 3) has a strided last dim"));
  EXPECT_THAT(message({{}, {}, Tensor::empty({2, 6})}), HasSubstr("result.lse is (2, 6) but should be (2, 5)"));
  const Tensor v_same = Tensor::randn({2, 5, 3}, 4);  // q-length values, so output could alias v
  AttentionResult aliased{v_same, {}, {}};
  EXPECT_THROW(qkv::scaled_dot_product_attention_into(q, Tensor::randn({2, 5, 8}, 5), v_same, aliased), qkv::Error);
}

// nn::MultiHeadAttention copies none of q, k and v, forward or backward: its heads are views the
// core reads and writes in place. The peak memory of forward + backward is exactly what the steps
// must allocate (the projections' outputs and input gradients, the concatenated heads, the row
// statistics), within less than half of one q-sized copy: any copy of q, k, v (or of their
// gradients) would cross that line. Self-attention (one fused projection) and cross-attention.
TEST(Memory, MultiHeadAttentionCopiesNoHeads) {
  const int64_t batch = 2, len = 64, embed = 256, heads = 4;
  const int64_t bne = batch * len * embed;       // floats of one (B, N, E) tensor: q, k or v
  const int64_t stats = 3 * batch * heads * len;  // lse, row_max, row_sum
  const int64_t copy_bytes = bne * int64_t{sizeof(float)};
  qkv_test::Random random;
  SCOPED_TRACE(random.note());
  const Tensor x = random.randn({batch, len, embed}), memory = random.randn({batch, len, embed});
  const Tensor grad = random.randn({batch, len, embed});
  for (const bool self : {true, false}) {
    SCOPED_TRACE(self ? "self-attention" : "cross-attention");
    const auto run = [&](qkv::nn::MultiHeadAttention& mha) {
      Tensor out = self ? mha.forward(x).output : mha.forward(x, memory, memory).output;
      if (self) return std::vector<Tensor>{out, mha.backward(grad)};
      const qkv::nn::MultiHeadAttentionGrads g = mha.backward_cross(grad);
      return std::vector<Tensor>{out, g.query, g.key, g.value};
    };
    qkv::nn::MultiHeadAttention warm(embed, heads, {.seed = 1});
    (void)run(warm);  // the kernels' per-thread workspaces, kept between calls
    qkv::nn::MultiHeadAttention mha(embed, heads, {.seed = 2});
    std::vector<Tensor> kept;
    const int64_t extra = extra_bytes([&] { kept = run(mha); });
    // Held by the forward: projections (3 bne), concatenated heads, row statistics, output. The
    // backward's peak: d of the projections' outputs (3 bne) beside either d of the concatenated
    // heads (while attention's backward runs) or the input gradients (1 summed, or 3 apart).
    const int64_t needed_floats = 3 * bne + bne + stats + bne + 3 * bne + (self ? 1 : 3) * bne;
    const int64_t needed = needed_floats * int64_t{sizeof(float)};
    EXPECT_GE(extra, needed) << "the counter missed an allocation";
    EXPECT_LT(extra, needed + copy_bytes / 2)
        << "forward + backward allocated " << extra - needed << " bytes beyond the " << needed
        << " they need; one copy of q is " << copy_bytes;
  }
}

// Tensors count their storage while alive and give it back when the last handle goes.
TEST(Memory, TensorStorageIsCounted) {
  const int64_t before = qkv::memory_stats().current_bytes;
  {
    const Tensor t = Tensor::zeros({256, 256});
    const Tensor view = t.transpose(0, 1);  // shares storage: counted once
    EXPECT_EQ(qkv::memory_stats().current_bytes - before, 256 * 256 * int64_t{sizeof(float)});
  }
  EXPECT_EQ(qkv::memory_stats().current_bytes, before);
}

// ---------------------------------------------------------------------------------------------
// Large requests: refused before allocating, with the bytes and shapes that asked.

// The weights of 200000 x 200000 scores are 160 GB, more than this machine (or the CI's) has.
TEST(Memory, HugeWeightsAreRefusedBeforeAllocating) {
  const Tensor q = Tensor::randn({1, 1, 200000, 8}, 1);
  const int64_t before = qkv::memory_stats().current_bytes;
  AttentionOptions options;
  options.need_weights = true;
  EXPECT_THAT([&] { (void)qkv::scaled_dot_product_attention(q, q, q, options); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::AllOf(
                  HasSubstr("scaled_dot_product_attention: q (1, 1, 200000, 8), k (1, 1, 200000, 8)"),
                  HasSubstr("need 160007200000 bytes"), HasSubstr("weights (1, 1, 200000, 200000) 149.0 GiB"),
                  HasSubstr("physical memory"), HasSubstr("need_weights = false"), HasSubstr("Backend::Flash"))));
  EXPECT_EQ(qkv::memory_stats().current_bytes, before);
}

// Restores the memory limit when a test ends, whatever happens in it.
struct LimitGuard {
  explicit LimitGuard(int64_t bytes) { qkv::set_memory_limit(bytes); }
  ~LimitGuard() { qkv::set_memory_limit(0); }
};

TEST(Memory, TheLimitIsEnforcedWithShapesAndBytes) {
  const Tensor q = Tensor::randn({2, 4, 512, 32}, 1);
  const LimitGuard limit(qkv::memory_stats().current_bytes + 2 * kMiB);
  EXPECT_EQ(qkv::memory_limit(), qkv::memory_stats().current_bytes + 2 * kMiB);
  // Output 512 KiB fits; with weights (2, 4, 512, 512) = 8 MiB it does not.
  EXPECT_NO_THROW((void)qkv::scaled_dot_product_attention(q, q, q));
  AttentionOptions options;
  options.need_weights = true;
  EXPECT_THAT([&] { (void)qkv::scaled_dot_product_attention(q, q, q, options); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::AllOf(
                  HasSubstr("need 8929280 bytes"), HasSubstr("weights (2, 4, 512, 512) 8.0 MiB"),
                  HasSubstr("the memory limit leaves"), HasSubstr("need_weights = false"))));
  // Any tensor: the shape and the bytes.
  EXPECT_THAT([] { (void)Tensor::zeros({1024, 1024}); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::AllOf(
                  HasSubstr("Tensor (1024, 1024): cannot allocate 4194304 bytes (4.0 MiB): over the memory limit"))));
  EXPECT_THAT([] { qkv::set_memory_limit(-1); }, ::testing::ThrowsMessage<qkv::Error>(HasSubstr(">= 0")));
}

// No std::bad_alloc: a tensor larger than the machine is a qkv::Error too.
TEST(Memory, NoBadAllocEscapes) {
  EXPECT_THAT([] { (void)Tensor::empty({int64_t{1} << 20, int64_t{1} << 20}); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::AllOf(HasSubstr("Tensor (1048576, 1048576)"),
                                                                    HasSubstr("4398046511104 bytes"))));
}

}  // namespace
