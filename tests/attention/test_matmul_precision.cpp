// MatmulPrecision High and Medium: the flash forward's products on AMX tiles (gemm/amx.hpp)
// against the float64 oracle, on fresh random shapes (dims that are no multiple of a tile, so
// Q and K are zero-padded to 32 depth steps and Dv % 16 != 0 takes the float32 product for P V),
// every mask kind, the score modifiers, grouped-query heads, strided residues (which stay
// float32 and hand their state to AMX tiles), dropout, large logits, and V rows that are not
// finite behind the mask. Outputs are poisoned with NaN first (check_kernel).
//
// The tolerance is the precision's: with each operand kept to e relative (2^-16 for High's two
// bf16 parts, 2^-8 for Medium's one), a score is off by at most about 2 e scale sum_d |q_d k_d|
// and a product P V by 2 e max |v|, so output and lse may be off by a few times
// e (1 + scale max sum_d |q_d k_d|), which is what check_kernel's floor is set to here.
//
// On a CPU without AMX (or a kernel that did not grant the tile state) the tests are skipped: the
// precision then changes nothing, which PrecisionChangesNothingWithoutAmx checks instead.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gemm/amx.hpp"
#include "attention/flash/flash.hpp"
#include "attention/kernels.hpp"
#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"

namespace {

using qkv::MatmulPrecision;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Case;
using qkv_test::KernelOutputs;
using qkv_test::MaskKind;
using qkv_test::Random;
using qkv_test::Sizes;

using qkv_test::operand_error;

// scale * max over (b, h, i, j) of sum_d |q_d k_d|: how large a score's rounding can get.
double max_abs_product_sum(const Case& c) { return c.scale * qkv_test::max_abs_dot_sum(c.q, c.k); }

// Runs flash on `run` at its precision on 1 and 2 threads, against the oracle's values for
// `truth` (the same problem, but for values the mask hides), with the precision's tolerance
// (check_kernel, its floor raised).
void check_precision(const Case& run, const Case& truth) {
  const int threads_before = omp_get_max_threads();
  qkv_test::Expected e = qkv_test::expect(truth);
  // check_kernel's tolerance is max(1e-4, 4 x the reference's error, 4 eps max |s|): the
  // reference's error stands in for the precision's (it is only ever raised here).
  const double allowed = 4 * operand_error(run.precision) * (1 + max_abs_product_sum(truth));
  e.reference_output_error = std::max(e.reference_output_error, allowed / qkv_test::kToleranceFactor);
  e.reference_lse_error = std::max(e.reference_lse_error, allowed / qkv_test::kToleranceFactor);
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    qkv_test::ThreadEveryProblem threaded;
    SCOPED_TRACE("threads " + std::to_string(threads) + ", precision " + std::string(to_string(run.precision)));
    qkv_test::check_kernel(qkv::detail::flash_attention, run, e);
  }
  omp_set_num_threads(threads_before);
}

void check_precision(const std::vector<Case>& cases) {
  for (const Case& c : cases) check_precision(c, c);
}

Sizes random_sizes(Random& rng) {
  const int64_t lengths[] = {1, 3, 17, 64, 113};
  auto length = [&] { return rng.chance(0.5) ? lengths[rng.integer(0, 4)] : rng.integer(1, 200); };
  const int64_t dims[] = {1, 16, 33, 48, 64, 128};
  auto dim = [&] { return rng.chance(0.6) ? dims[rng.integer(0, 5)] : rng.integer(1, 130); };
  const int64_t kv_heads = rng.integer(1, 3);
  return {rng.integer(1, 3), kv_heads * rng.integer(1, 3), kv_heads, length(), length(), dim(), dim()};
}

using qkv_test::with_precision;

TEST(MatmulPrecision, EveryMaskKindOnRandomShapes) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  for (MatmulPrecision precision : {MatmulPrecision::High, MatmulPrecision::Medium})
    for (MaskKind kind : qkv_test::kAllMasks)
      cases.push_back(with_precision(qkv_test::make_case(rng, random_sizes(rng), kind, 1.0, 0.0f), precision));
  check_precision(cases);
}

TEST(MatmulPrecision, ModifiersDropoutAndLongRows) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  using qkv_test::Modifier;
  std::vector<Case> cases;
  for (MatmulPrecision precision : {MatmulPrecision::High, MatmulPrecision::Medium}) {
    for (Modifier m : qkv_test::kAllModifiers)
      cases.push_back(with_precision(
          qkv_test::make_case(rng, random_sizes(rng), MaskKind::Causal, 1.0, rng.chance(0.5) ? 0.2f : 0.0f, m),
          precision));
    cases.push_back(with_precision(qkv_test::make_case(rng, {1, 2, 1, 1000, 1000, 64, 64}, MaskKind::Causal, 1.0, 0.0f),
                                   precision));
    cases.push_back(with_precision(qkv_test::make_case(rng, {2, 4, 2, 300, 700, 128, 80}, MaskKind::Window, 1.0, 0.0f),
                                   precision));
    // Scores in the thousands: High only (Medium's bound is then no test).
    if (precision == MatmulPrecision::High)
      cases.push_back(with_precision(
          qkv_test::make_case(rng, {1, 2, 2, 200, 333, 96, 32}, MaskKind::None, 30.0, 0.0f), precision));
    cases.push_back(with_precision(
        qkv_test::strided_residue_case(rng, {1, 2, 1, 1300, 1300, 64, 64}, 0, 0.0f, Modifier::Alibi), precision));
  }
  check_precision(cases);
}

// Infinite V rows behind the mask: keys 50 .. 69 of 70, hidden by key lengths of 50, under
// causal. The query tile of queries 0 .. 47 sees keys 0 .. 47, and an AMX step of 32 keys would
// take keys 48 .. 63 with zero weights: 0 x inf is NaN, so that tile must keep to float32 there.
// Every row is finite and matches the oracle of the same problem with zeros in those rows.
TEST(MatmulPrecision, InfiniteValuesBehindTheMask) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  for (MatmulPrecision precision : {MatmulPrecision::High, MatmulPrecision::Medium}) {
    Case clean = with_precision(qkv_test::make_case(rng, {1, 2, 1, 70, 70, 64, 64}, MaskKind::None, 1.0, 0.0f), precision);
    clean.mask = qkv::Mask::causal() & qkv::Mask::key_lengths({50});
    clean.bias = qkv_test::all_of({qkv_test::causal_bias(), qkv_test::key_lengths_bias({50})});
    clean.name += " causal & key_lengths(50)";
    Case infinite = clean;
    infinite.v = clean.v.clone();
    float* v = infinite.v.data();
    for (int64_t j = 50; j < 70; ++j)
      for (int64_t d = 0; d < 64; ++d) v[j * 64 + d] = std::numeric_limits<float>::infinity();
    infinite.name += ", V rows 50-69 = +inf";
    check_precision(infinite, clean);
  }
}

// NaN and infinities in Q, K and V: a head or query tile holding one keeps to float32, so every
// NaN and infinity of the output is where Highest has it, and the finite values are within the
// precision's tolerance of Highest's.
TEST(MatmulPrecision, NonFiniteOperandsAsHighest) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (MatmulPrecision precision : {MatmulPrecision::High, MatmulPrecision::Medium}) {
    // Each value in a head of its own (a head keeps its key tiles from the one holding it on to
    // float32).
    Case c = qkv_test::make_case(rng, {1, 4, 4, 150, 150, 64, 64}, MaskKind::Causal, 1.0, 0.0f);
    const double bound = 4 * operand_error(precision) * (1 + max_abs_product_sum(c));
    const auto at = [](int64_t head, int64_t row, int64_t d) { return (head * 150 + row) * 64 + d; };
    c.q.data()[at(0, 100, 5)] = nan;       // query 100 of head 0
    c.k.data()[at(1, 120, 7)] = -inf;      // key 120 of head 1: scores of +-inf
    c.v.data()[at(2, 90, 3)] = inf;        // key 90 of head 2: inf in column 3 of the rows that weigh it
    c.v.data()[at(3, 140, 9)] = 3.4e38f;   // key 140 of head 3: finite, but inf as a bf16
    KernelOutputs highest, lower;
    qkv::detail::flash_attention(qkv_test::problem_of(c, highest));
    qkv::detail::flash_attention(qkv_test::problem_of(with_precision(c, precision), lower));
    int64_t non_finite = 0;
    for (size_t x = 0; x < highest.output.size(); ++x) {
      const float want = highest.output[x], got = lower.output[x];
      if (std::isnan(want) || std::isinf(want)) {
        ++non_finite;
        EXPECT_TRUE(std::isnan(want) ? std::isnan(got) : got == want) << "element " << x << ": " << got << " for " << want;
      } else {
        EXPECT_NEAR(got, want, bound * std::max(1.0f, std::abs(want))) << "element " << x;
      }
    }
    EXPECT_GT(non_finite, 0);
  }
}

// Whether a key tile runs on AMX tiles depends on the keys alone: with a hidden key of NaN at key
// 300, the tiles from key 256 on keep to float32 whichever worker meets them, so 1 and 2 threads
// (which deal the head's query tiles differently) give the same bits. A worker used to keep a
// head to float32 from its first bad key on, for every later query tile too: on 2 threads the
// worker starting mid-head ran the early key tiles of its first query tile on AMX tiles, where 1
// thread, which had met the bad key in an earlier query tile, did not.
TEST(MatmulPrecision, TheSameBitsOnAnyThreads) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  const int threads_before = omp_get_max_threads();
  for (MatmulPrecision precision : {MatmulPrecision::High, MatmulPrecision::Medium}) {
    Case c = with_precision(qkv_test::make_case(rng, {1, 1, 1, 300, 400, 64, 64}, MaskKind::None, 1.0, 0.0f),
                            precision);
    std::vector<float> keep(300 * 400, 1.0f);
    for (int64_t i = 0; i < 300; ++i) keep[static_cast<size_t>(i * 400 + 300)] = 0.0f;
    c.mask = qkv::Mask::keep(Tensor::from(keep, Shape{300, 400}));
    for (int64_t d = 0; d < 64; ++d) {
      c.k.data()[300 * 64 + d] = std::numeric_limits<float>::quiet_NaN();
      c.v.data()[300 * 64 + d] = std::numeric_limits<float>::quiet_NaN();
    }
    std::vector<KernelOutputs> runs(3);
    for (size_t run = 0; run < runs.size(); ++run) {
      omp_set_num_threads(run == 0 ? 1 : 2);
      qkv::detail::flash_attention(qkv_test::problem_of(c, runs[run]));
    }
    omp_set_num_threads(threads_before);
    EXPECT_TRUE(std::all_of(runs[0].output.begin(), runs[0].output.end(), [](float x) { return std::isfinite(x); }));
    for (size_t run = 1; run < runs.size(); ++run) {
      EXPECT_EQ(std::memcmp(runs[run].output.data(), runs[0].output.data(), runs[0].output.size() * sizeof(float)), 0)
          << "output, run " << run << " on 2 threads";
      EXPECT_EQ(std::memcmp(runs[run].lse.data(), runs[0].lse.data(), runs[0].lse.size() * sizeof(float)), 0)
          << "lse, run " << run << " on 2 threads";
    }
  }
}

// Two calls on the same shapes with different keys: the second must not reuse the first's splits.
TEST(MatmulPrecision, EachCallSplitsItsOwnKeys) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  const Case first = with_precision(qkv_test::make_case(rng, {1, 2, 1, 100, 100, 64, 64}, MaskKind::None, 1.0, 0.0f),
                                    MatmulPrecision::High);
  Case second = first;
  second.k = rng.randn(first.k.shape());
  second.name += " (new keys)";
  check_precision({first, second});
}

// The AMX products ran: High's output differs from Highest's (float32 products) in some element
// and by no more than the tolerance, and Medium's by more than High's.
TEST(MatmulPrecision, TheTilesRun) {
  QKV_SKIP_WITHOUT_AMX();
  Random rng;
  SCOPED_TRACE(rng.note());
  const Case base = qkv_test::make_case(rng, {1, 2, 1, 150, 150, 64, 64}, MaskKind::None, 1.0, 0.0f);
  KernelOutputs out[3];
  const MatmulPrecision levels[3] = {MatmulPrecision::Highest, MatmulPrecision::High, MatmulPrecision::Medium};
  for (int n = 0; n < 3; ++n) qkv::detail::flash_attention(qkv_test::problem_of(with_precision(base, levels[n]), out[n]));
  qkv_test::expect_tiles_ran(out[0].output, out[1].output, out[2].output, 1e-3, "output");
}

// Where the tiles do not run, a lower precision is only a permission: the results are Highest's,
// bit for bit (every case on a CPU without AMX; with AMX, 16-bit K/V, and keys so many that a
// head's splits would pass flash's cap of 64 MiB a worker).
TEST(MatmulPrecision, PrecisionChangesNothingWithoutAmx) {
  Random rng;
  SCOPED_TRACE(rng.note());
  Case base = qkv_test::make_case(rng, {1, 2, 1, 90, 90, 32, 32}, MaskKind::Causal, 1.0, 0.0f);
  std::vector<Case> cases{base};
  if (qkv::detail::amx::available()) {
    base.k = base.k.to(qkv::DType::BF16);
    base.v = base.v.to(qkv::DType::BF16);
    cases = {base, qkv_test::make_case(rng, {1, 1, 1, 3, 70000, 128, 128}, MaskKind::None, 1.0, 0.0f)};
  }
  for (const Case& c : cases) {
    KernelOutputs highest, high;
    qkv::detail::flash_attention(qkv_test::problem_of(c, highest));
    qkv::detail::flash_attention(qkv_test::problem_of(with_precision(c, MatmulPrecision::High), high));
    EXPECT_EQ(0, std::memcmp(highest.output.data(), high.output.data(), highest.output.size() * sizeof(float)));
    EXPECT_EQ(0, std::memcmp(highest.lse.data(), high.lse.data(), highest.lse.size() * sizeof(float)));
  }
}

TEST(MatmulPrecision, Names) {
  EXPECT_EQ(to_string(MatmulPrecision::Highest), "highest");
  EXPECT_EQ(to_string(MatmulPrecision::High), "high");
  EXPECT_EQ(to_string(MatmulPrecision::Medium), "medium");
  for (MatmulPrecision precision : {MatmulPrecision::Highest, MatmulPrecision::High, MatmulPrecision::Medium})
    EXPECT_EQ(qkv::matmul_precision_from_string(to_string(precision)), precision);
  EXPECT_THROW(
      {
        try {
          qkv::matmul_precision_from_string("low");
        } catch (const qkv::Error& e) {
          EXPECT_STREQ(e.what(), "unknown matmul precision 'low': expected highest, high or medium");
          throw;
        }
      },
      qkv::Error);
}

}  // namespace
