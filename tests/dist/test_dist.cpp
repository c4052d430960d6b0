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
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "harness/oracle.hpp"
#include "qkv/dist.hpp"
#include "qkv/flex.hpp"

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

// A tensor mask term over the whole sequence, (.., N, N) or broadcasting (.., 1, N), (.., N, 1).
struct GlobalTerm {
  Tensor values;
  bool additive = false;
};

struct Case {
  int64_t batch = 2, q_heads = 2, kv_heads = 2, per_rank = 8, dk = 16, dv = 16;
  int rank = 4;  // tensor rank: 4 (B, H, n, D), 3 (B, n, D) or 2 (n, D)
  AttentionOptions options;
  // Score modifiers drawn in check() from the shared seed: slopes in [0, 0.5), sinks in [-3, 3).
  bool alibi = false, sinks = false;
  // Tensor mask terms over the whole sequence of `total` positions, drawn from the shared seed.
  std::function<std::vector<GlobalTerm>(qkv_test::Random&, int64_t total)> terms;
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
  const int64_t heads = c.rank == 4 ? c.q_heads : 1;
  AttentionOptions global = c.options, mine = c.options;  // mine: this rank's rows of the tensor terms
  if (c.alibi) global.alibi_slopes = mine.alibi_slopes = random.uniform_tensor(Shape{heads}, 0.0, 0.5);
  if (c.sinks) global.sinks = mine.sinks = random.uniform_tensor(Shape{heads}, -3.0, 3.0);
  if (c.terms) {
    for (const GlobalTerm& t : c.terms(random, total)) {
      const Tensor rows_of_mine = t.values.size(-2) == total ? rows(t.values, r * n, n) : t.values;
      global.mask &= t.additive ? Mask::additive(t.values) : Mask::keep(t.values);
      mine.mask &= t.additive ? Mask::additive(rows_of_mine) : Mask::keep(rows_of_mine);
    }
  }

  const qkv::AttentionResult want = qkv::scaled_dot_product_attention(q, k, v, global);
  const qkv::AttentionGrads want_grads = qkv::scaled_dot_product_attention_backward(grad, q, k, v, want, global);

  const Tensor qs = rows(q, r * n, n), ks = rows(k, r * n, n), vs = rows(v, r * n, n), gs = rows(grad, r * n, n);
  qkv::dist::RingStats stats;
  const qkv::AttentionResult got = qkv::dist::ring_attention(qs, ks, vs, MPI_COMM_WORLD, mine, &stats);
  expect_close(got.output, rows(want.output, r * n, n), "output");
  expect_close(got.lse, rows(want.lse, r * n, n, true), "lse");
  EXPECT_FALSE(got.weights.defined());
  EXPECT_GT(stats.total_seconds, 0);

  const qkv::AttentionGrads grads = qkv::dist::ring_attention_backward(gs, qs, ks, vs, got, MPI_COMM_WORLD, mine);
  expect_close(grads.dq, rows(want_grads.dq, r * n, n), "dq");
  expect_close(grads.dk, rows(want_grads.dk, r * n, n), "dk");
  expect_close(grads.dv, rows(want_grads.dv, r * n, n), "dv");
  EXPECT_EQ(grads.dsinks.defined(), c.sinks);
  if (c.sinks) expect_close(grads.dsinks, want_grads.dsinks, "dsinks");
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

// ---- score modifiers: global positions (ALiBi), one sink per row (sinks), per score (softcap) ----

TEST(RingAttentionModifiers, Softcap) {
  Case c;
  c.options.softcap = 1.5f;
  check(c);
}

TEST(RingAttentionModifiers, SoftcapCausal) {
  Case c;
  c.options.softcap = 0.8f;
  c.options.mask = Mask::causal();
  check(c);
}

TEST(RingAttentionModifiers, AlibiFull) {  // keys both before and after the queries' shards
  Case c;
  c.alibi = true;
  check(c);
}

TEST(RingAttentionModifiers, AlibiCausalZigzag) {
  Case c;
  c.alibi = true;
  c.options.mask = Mask::causal();
  check(c);
}

TEST(RingAttentionModifiers, AlibiWindowWithOffsetGroupedQuery) {
  Case c;
  c.q_heads = 6;
  c.kv_heads = 3;
  c.per_rank = 6;
  c.alibi = true;
  c.options.mask = Mask::window(5, 3, 1);
  check(c);
}

TEST(RingAttentionModifiers, SinksFull) {
  Case c;
  c.sinks = true;
  check(c);
}

TEST(RingAttentionModifiers, SinksCausalRowsThatSeeNothing) {  // rows before the offset: lse = sink
  Case c;
  c.sinks = true;
  c.options.mask = Mask::causal(-3);
  check(c);
}

TEST(RingAttentionModifiers, SinksKeyLengthsWithAnEmptyBatch) {
  Case c;
  c.batch = 3;
  c.sinks = true;
  c.options.mask = Mask::key_lengths({c.per_rank * world_size() - 3, 0, 3});
  check(c);
}

TEST(RingAttentionModifiers, AllWithCausalWindow) {
  Case c;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.alibi = c.sinks = true;
  c.options.softcap = 2.0f;
  c.options.mask = Mask::causal() & Mask::window(9);
  check(c);
}

TEST(RingAttentionModifiers, AllRank3OddShardOddDims) {  // no zigzag (n odd), one head
  Case c;
  c.rank = 3;
  c.per_rank = 5;
  c.dk = 13;
  c.dv = 7;
  c.alibi = c.sinks = true;
  c.options.softcap = 1.0f;
  c.options.mask = Mask::causal();
  check(c);
}

TEST(RingAttentionModifiers, AllReferenceBackend) {
  Case c;
  c.alibi = c.sinks = true;
  c.options.softcap = 3.0f;
  c.options.backend = qkv::Backend::Reference;
  c.options.mask = Mask::window(4, 2);
  check(c);
}

TEST(RingAttentionModifiers, AllLongerShardsFlash) {  // large enough for the flash kernel's tiles
  Case c;
  c.batch = 1;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.per_rank = 96;
  c.dk = c.dv = 64;
  c.alibi = c.sinks = true;
  c.options.softcap = 5.0f;
  c.options.mask = Mask::causal();
  check(c);
}

// ---- tensor masks, sharded as the queries: each rank passes its rows over all N keys ----

// A keep tensor with about `hidden` of its elements 0, and query row 1 hidden entirely.
Tensor random_keep(qkv_test::Random& random, const Shape& shape, double hidden) {
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  for (float& x : values) x = random.chance(hidden) ? 0.0f : 1.0f;
  const int64_t total = shape[-1];
  if (shape[-2] > 1)
    for (int64_t j = 0; j < total; ++j) values[static_cast<size_t>(total + j)] = 0.0f;
  return Tensor::from(std::move(values), shape);
}

// Normal biases times 2, with about `masked` of them -inf.
Tensor random_additive(qkv_test::Random& random, const Shape& shape, double masked) {
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  for (float& x : values)
    x = random.chance(masked) ? -std::numeric_limits<float>::infinity() : static_cast<float>(2 * random.normal());
  return Tensor::from(std::move(values), shape);
}

TEST(RingAttentionTensorMasks, KeepPerHead) {
  Case c;
  c.terms = [&c](qkv_test::Random& random, int64_t total) {
    return std::vector<GlobalTerm>{{random_keep(random, Shape{c.batch, c.q_heads, total, total}, 0.3), false}};
  };
  check(c);
}

TEST(RingAttentionTensorMasks, AdditiveCausalZigzag) {  // the terms' rows travel with the queries
  Case c;
  c.options.mask = Mask::causal();
  c.terms = [&c](qkv_test::Random& random, int64_t total) {
    return std::vector<GlobalTerm>{{random_additive(random, Shape{c.batch, total, total}, 0.2), true}};
  };
  check(c);
}

TEST(RingAttentionTensorMasks, BroadcastTermsWithWindowAndKeyLengths) {
  // (B, 1, 1, N) padding biases (the same on every rank), (N, 1) per-query keeps, a 2-D keep.
  Case c;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.options.mask = Mask::window(6, 6) & Mask::key_lengths({c.per_rank * world_size() - 2, c.per_rank * world_size()});
  c.terms = [&c](qkv_test::Random& random, int64_t total) {
    return std::vector<GlobalTerm>{{random_additive(random, Shape{c.batch, 1, 1, total}, 0.1), true},
                                   {random_keep(random, Shape{total, 1}, 0.1), false},
                                   {random_keep(random, Shape{total, total}, 0.2), false}};
  };
  check(c);
}

TEST(RingAttentionTensorMasks, WithAllModifiersCausalRank3) {
  Case c;
  c.rank = 3;
  c.dk = 11;
  c.alibi = c.sinks = true;
  c.options.softcap = 2.5f;
  c.options.mask = Mask::causal();
  c.terms = [&c](qkv_test::Random& random, int64_t total) {
    return std::vector<GlobalTerm>{{random_keep(random, Shape{c.batch, total, total}, 0.25), false},
                                   {random_additive(random, Shape{total, total}, 0.1), true}};
  };
  check(c);
}

TEST(RingAttentionTensorMasks, LongerShardsFlash) {
  Case c;
  c.batch = 1;
  c.per_rank = 80;
  c.dk = c.dv = 32;
  c.sinks = true;
  c.options.mask = Mask::causal();
  c.terms = [&c](qkv_test::Random& random, int64_t total) {
    return std::vector<GlobalTerm>{{random_additive(random, Shape{c.batch, c.q_heads, total, total}, 0.05), true}};
  };
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

TEST(RingAttentionErrors, TensorMaskOverTheShardsKeysOnly) {  // (n, n): a block, not all N keys
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  AttentionOptions options;
  options.mask = Mask::keep(Tensor::full(Shape{4, 4}, 1.0f));
  expect_error_everywhere(4, options, "over all N = " + std::to_string(4 * world_size()) + " keys");
}

TEST(RingAttentionErrors, TensorMaskWithTooManyRowsOnOneRank) {
  AttentionOptions options;
  const int64_t rows = world_rank() == world_size() - 1 ? 5 : 4;
  options.mask = Mask::additive(Tensor::zeros(Shape{1, 2, rows, 4 * world_size()}));
  expect_error_everywhere(4, options, "does not broadcast to (B, Hq, n, N)");
}

TEST(RingAttentionErrors, TensorMasksBroadcastDifferentlyAcrossRanks) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  AttentionOptions options;
  options.mask = Mask::causal() & Mask::keep(Tensor::full(Shape{world_rank() == 1 ? 1 : 4, 4 * world_size()}, 1.0f));
  expect_error_everywhere(4, options, "broadcast shapes");
}

TEST(RingAttentionErrors, SinksOfTheWrongShape) {
  AttentionOptions options;
  options.sinks = Tensor::zeros(Shape{3});
  expect_error_everywhere(4, options, "sinks is (3) but should be (2)");
}

TEST(RingAttentionErrors, SymbolicRulesAndFunctionsAreRefusedNotReadLocally) {
  AttentionOptions strided;
  strided.mask = Mask::causal() & Mask::strided(3);
  expect_error_everywhere(4, strided, "mask causal & strided(3) is not supported");
  AttentionOptions function;
  function.mask_mod = "k <= q";
  expect_error_everywhere(4, function, "score_mod and mask_mod are not supported");
  AttentionOptions callable;
  callable.score_function = qkv::score_function([](auto s, int64_t, int64_t, int64_t q, int64_t k) {
    return s - 0.1f * static_cast<float>(q > k ? q - k : k - q);
  });
  expect_error_everywhere(4, callable, "score_mod and mask_mod are not supported");
}

TEST(RingAttentionErrors, SummariesAreRefused) {
  AttentionOptions options;
  options.summary_top_k = 4;
  expect_error_everywhere(4, options, "summary_top_k is not supported");
}

// Options of calls the ring cannot split (packed batches, pages, rotary tables, quantized K/V)
// would be dropped by its per-pair calls: refused on every rank instead.
TEST(RingAttentionErrors, PerSequenceAndRotaryOptionsAreRefused) {
  AttentionOptions packed;
  packed.cu_seqlens_q = packed.cu_seqlens_k = {0, 4};
  expect_error_everywhere(4, packed, "cu_seqlens, block_table and cache_seqlens are not supported");
  AttentionOptions rotary;
  rotary.rotary_cos = rotary.rotary_sin = Tensor::zeros(Shape{64, 2});
  expect_error_everywhere(4, rotary, "rotary tables are not supported");
  AttentionOptions quantized;
  quantized.k_scales = Tensor::zeros(Shape{1});
  expect_error_everywhere(4, quantized, "quantized K/V");
}

TEST(RingAttentionErrors, NegativeSoftcap) {
  AttentionOptions options;
  options.softcap = -1.0f;
  expect_error_everywhere(4, options, "softcap");
}

TEST(RingAttentionErrors, OneRankWithOtherAlibiSlopes) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  AttentionOptions options;
  options.alibi_slopes = Tensor::from({0.25f, world_rank() == 1 ? 0.125f : 0.5f}, Shape{2});
  expect_error_everywhere(4, options, "alibi_slopes");
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
