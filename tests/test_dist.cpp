// qkv::dist (include/qkv/dist.hpp) under mpirun: every rank builds the same random global q, k,
// v and grad (seed broadcast from rank 0), passes its contiguous shard to ring_attention and
// ring_attention_backward, and compares its rows with the single-process kernels run on the whole
// sequence: float32 against float32, |got - want| <= 1e-5 * max(1, |want|), -inf exactly.
// Run by ctest as dist_ring_np1, _np2 and _np4 (tests/CMakeLists.txt), each bounded by a TIMEOUT.
// Every test is collective: EXPECT (never ASSERT) keeps all ranks on the same calls.
#include <mpi.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "oracle.hpp"
#include "qkv/dist.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;

int world_rank() { int r = 0; MPI_Comm_rank(MPI_COMM_WORLD, &r); return r; }
int world_size() { int p = 1; MPI_Comm_size(MPI_COMM_WORLD, &p); return p; }

// One seed for all ranks: rank 0's fresh (or replayed) seed.
uint64_t shared_seed() {
  uint64_t seed = qkv_test::Random().seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}

// Rows [start, start + len) of dim -2 of t (lse: of its last dim when `last` is true), packed.
Tensor rows(const Tensor& t, int64_t start, int64_t len, bool last = false) {
  const Tensor c = t.contiguous();
  const int64_t d = last ? 1 : c.size(-1);
  const int64_t n = last ? c.size(-1) : c.size(-2);
  const int64_t outer = c.numel() / (n * d);
  std::vector<int64_t> dims = c.shape().dims();
  dims[dims.size() - (last ? 1 : 2)] = len;
  std::vector<float> values;
  const float* x = c.data();
  for (int64_t o = 0; o < outer; ++o)
    values.insert(values.end(), x + (o * n + start) * d, x + (o * n + start + len) * d);
  return Tensor::from(std::move(values), Shape(std::move(dims)));
}

void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  const std::vector<float> w = want.to_vector();
  const qkv_test::Comparison c = qkv_test::compare(got, std::vector<double>(w.begin(), w.end()), 1e-5);
  EXPECT_EQ(got.shape(), want.shape()) << what;
  EXPECT_TRUE(c.ok) << what << " on rank " << world_rank() << ": " << c.detail;
}

struct Case {
  int64_t batch = 2, q_heads = 2, kv_heads = 2, per_rank = 8, dk = 16, dv = 16;
  int rank = 4;  // tensor rank: 4 (B, H, n, D), 3 (B, n, D) or 2 (n, D)
  AttentionOptions options;
};

Shape shape_of(const Case& c, int64_t heads, int64_t n, int64_t d) {
  if (c.rank == 4) return Shape{c.batch, heads, n, d};
  if (c.rank == 3) return Shape{c.batch, n, d};
  return Shape{n, d};
}

// Forward and backward of ring attention on this rank's shard against the single-process kernels.
void check(const Case& c) {
  const uint64_t seed = shared_seed();
  qkv_test::Random random(seed);
  SCOPED_TRACE(random.note() + ", mask " + c.options.mask.str() + ", P = " + std::to_string(world_size()));
  const int p = world_size(), r = world_rank();
  const int64_t n = c.per_rank, total = n * p;
  const Tensor q = random.randn(shape_of(c, c.q_heads, total, c.dk));
  const Tensor k = random.randn(shape_of(c, c.kv_heads, total, c.dk));
  const Tensor v = random.randn(shape_of(c, c.kv_heads, total, c.dv));
  const Tensor grad = random.randn(shape_of(c, c.q_heads, total, c.dv));

  const qkv::AttentionResult want = qkv::scaled_dot_product_attention(q, k, v, c.options);
  const qkv::AttentionGrads want_grads = qkv::scaled_dot_product_attention_backward(grad, q, k, v, want, c.options);

  const Tensor qs = rows(q, r * n, n), ks = rows(k, r * n, n), vs = rows(v, r * n, n), gs = rows(grad, r * n, n);
  qkv::dist::RingStats stats;
  const qkv::AttentionResult got = qkv::dist::ring_attention(qs, ks, vs, MPI_COMM_WORLD, c.options, &stats);
  expect_close(got.output, rows(want.output, r * n, n), "output");
  expect_close(got.lse, rows(want.lse, r * n, n, true), "lse");
  EXPECT_FALSE(got.weights.defined());
  EXPECT_GT(stats.total_seconds, 0);

  const qkv::AttentionGrads grads = qkv::dist::ring_attention_backward(gs, qs, ks, vs, got, MPI_COMM_WORLD, c.options);
  expect_close(grads.dq, rows(want_grads.dq, r * n, n), "dq");
  expect_close(grads.dk, rows(want_grads.dk, r * n, n), "dk");
  expect_close(grads.dv, rows(want_grads.dv, r * n, n), "dv");
}

TEST(RingAttention, FullAttention) {
  Case c;
  check(c);
}

TEST(RingAttention, Causal) {
  Case c;
  c.options.mask = Mask::causal();
  check(c);
}

TEST(RingAttention, CausalOddShardNoZigzag) {  // n odd: the contiguous layout, still exact
  Case c;
  c.per_rank = 5;
  c.options.mask = Mask::causal();
  check(c);
}

TEST(RingAttention, CausalWithOffset) {  // a negative offset: the first queries see no key
  Case c;
  c.options.mask = Mask::causal(-3);
  check(c);
}

TEST(RingAttention, GroupedQueryCausal) {
  Case c;
  c.q_heads = 6;
  c.kv_heads = 2;
  c.options.mask = Mask::causal();
  check(c);
}

TEST(RingAttention, GroupedQueryFull) {
  Case c;
  c.q_heads = 4;
  c.kv_heads = 1;
  check(c);
}

TEST(RingAttention, WindowCrossesShards) {
  Case c;
  c.per_rank = 6;
  c.options.mask = Mask::window(7, 2);
  check(c);
}

TEST(RingAttention, WindowWithOffset) {  // query i sees keys i + 2 - 4 ... i + 2 + 1
  Case c;
  c.options.mask = Mask::window(4, 1, 2);
  check(c);
}

TEST(RingAttention, CausalWindow) {
  Case c;
  c.options.mask = Mask::causal() & Mask::window(5);
  check(c);
}

TEST(RingAttention, KeyLengths) {  // global lengths: one batch sees part of rank 0 only, one sees none
  Case c;
  c.batch = 3;
  c.options.mask = Mask::key_lengths({c.per_rank * world_size() - 3, 0, 3});
  check(c);
}

TEST(RingAttention, KeyLengthsAndCausal) {
  Case c;
  c.options.mask = Mask::causal() & Mask::key_lengths({c.per_rank * world_size() - 5, std::min<int64_t>(c.per_rank + 1, c.per_rank * world_size())});
  check(c);
}

TEST(RingAttention, OddHeadDimsRank3Causal) {
  Case c;
  c.rank = 3;
  c.dk = 13;
  c.dv = 7;
  c.options.mask = Mask::causal();
  check(c);
}

TEST(RingAttention, Rank2WithScaleAndReference) {
  Case c;
  c.rank = 2;
  c.dk = 5;
  c.dv = 9;
  c.options.scale = 0.3f;
  c.options.backend = qkv::Backend::Reference;
  c.options.mask = Mask::window(3, 3);
  check(c);
}

TEST(RingAttention, LongerShardsFlash) {  // large enough for the flash kernel's tiles
  Case c;
  c.batch = 1;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.per_rank = 96;
  c.dk = c.dv = 64;
  c.options.mask = Mask::causal();
  check(c);
}

// ---- errors: the same qkv::Error on every rank, and the communicator still works after ----

// Runs ring_attention with this rank's shard length and expects a qkv::Error naming `needle`.
void expect_error_everywhere(int64_t n, const AttentionOptions& options, const std::string& needle) {
  const Tensor q = Tensor::randn(Shape{1, 2, n, 8}, 1), k = Tensor::randn(Shape{1, 2, n, 8}, 2),
               v = Tensor::randn(Shape{1, 2, n, 8}, 3);
  try {
    qkv::dist::ring_attention(q, k, v, MPI_COMM_WORLD, options);
    ADD_FAILURE() << "rank " << world_rank() << ": no qkv::Error, expected one naming '" << needle << "'";
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "rank " << world_rank() << ": " << e.what();
  }
  // No message left behind: a good call right after works.
  Case c;
  check(c);
}

TEST(RingAttentionErrors, ShardsOfDifferentShapes) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  expect_error_everywhere(world_rank() == 1 ? 5 : 4, {}, "shards differ");
}

TEST(RingAttentionErrors, RankCountDoesNotDivideN) {  // N = 4P - 1 split as evenly as it goes
  const int p = world_size();
  if (p < 2) GTEST_SKIP() << "needs 2 ranks";
  const int64_t total = 4 * p - 1;
  const int64_t n = total / p + (world_rank() < total % p ? 1 : 0);
  expect_error_everywhere(n, {}, "N divisible by P");
}

TEST(RingAttentionErrors, TensorMask) {
  AttentionOptions options;
  options.mask = Mask::keep(Tensor::full(Shape{4, 4}, 1.0f));
  expect_error_everywhere(4, options, "tensor masks");
}

TEST(RingAttentionErrors, OneRankAsksForDropout) {
  AttentionOptions options;
  if (world_rank() == world_size() - 1) options.dropout_p = 0.5f;
  expect_error_everywhere(4, options, "dropout");
}

TEST(RingAttentionErrors, KeyLengthBeyondN) {
  AttentionOptions options;
  options.mask = Mask::key_lengths({4 * world_size() + 1});
  expect_error_everywhere(4, options, "global positions");
}

TEST(RingAttentionErrors, BackwardWithWrongForward) {
  const Tensor q = Tensor::randn(Shape{1, 2, 4, 8}, 1);
  qkv::AttentionResult forward = qkv::dist::ring_attention(q, q, q, MPI_COMM_WORLD);
  if (world_rank() == 0) forward.lse = Tensor::zeros(Shape{1, 2, 3});
  EXPECT_THROW(qkv::dist::ring_attention_backward(q, q, q, q, forward, MPI_COMM_WORLD), qkv::Error);
}

}  // namespace

// MPI around GoogleTest: rank 0 prints the full report, the others only failures (--gtest_brief).
// The exit code is the worst over all ranks, so mpirun fails when any rank fails.
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (world_rank() != 0) GTEST_FLAG_SET(brief, true);  // before InitGoogleTest, which picks the printer
  testing::InitGoogleTest(&argc, argv);
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
