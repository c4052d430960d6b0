// The flash kernel against the reference kernel, both called directly through the internal
// headers, on fresh random shapes: lengths 1, 3, 17, 113, 1000 and random ones (never a
// multiple of a tile), Nq != Nk, Dk != Dv, grouped-query heads, every mask kind and their
// combinations, rows that see no key, large logits and dropout; on 1 and 2 threads and on every
// SIMD target flash/forward.cpp was compiled for (forced in turn with hwy::SetSupportedTargetsForTest).
// Flash's outputs are poisoned with NaN before each call, so an element left unwritten fails.
//
// Cases, tolerance and the running on every target live in harness/kernel_cases.hpp, shared with
// attention/test_decode.cpp.
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <omp.h>

#include <cstdint>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "attention/flash/flash.hpp"
#include "attention/kernels.hpp"
#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"

namespace {

using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Case;
using qkv_test::MaskKind;
using qkv_test::Random;
using qkv_test::Sizes;
using qkv_test::kAllMasks;
using qkv_test::make_case;
using qkv_test::problem_of;
using qkv_test::runnable_targets;

void check_everywhere(const std::vector<Case>& cases) {
  qkv_test::check_everywhere(qkv::detail::flash_attention, cases);
}

// Random sizes: lengths from the awkward list or anything up to 200, dims from 1 to 130.
Sizes random_sizes(Random& rng) {
  const int64_t lengths[] = {1, 3, 17, 113};
  auto length = [&] { return rng.chance(0.5) ? lengths[rng.integer(0, 3)] : rng.integer(1, 200); };
  const int64_t dims[] = {1, 7, 16, 33, 64, 128};
  auto dim = [&] { return rng.chance(0.6) ? dims[rng.integer(0, 5)] : rng.integer(1, 130); };
  const int64_t kv_heads = rng.integer(1, 3);
  return {rng.integer(1, 3), kv_heads * rng.integer(1, 3), kv_heads, length(), length(), dim(), dim()};
}

TEST(Flash, RunsOnSeveralTargets) {
  std::string names;
  for (int64_t target : runnable_targets()) names += std::string(" ") + hwy::TargetName(target);
  std::cout << "flash targets run by these tests:" << names << "\n";
  EXPECT_FALSE(names.empty());
}

TEST(Flash, EveryMaskKindOnRandomShapes) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  for (MaskKind kind : kAllMasks)
    for (int repeat = 0; repeat < 3; ++repeat) cases.push_back(make_case(rng, random_sizes(rng), kind, 1.0, 0.0f));
  check_everywhere(cases);
}

// Softcap, ALiBi and sinks, alone and together, with every mask kind, GQA, Nq != Nk, Dk != Dv
// and dropout, against the float64 oracle on every target and thread count.
TEST(Flash, ScoreModifiersEveryMaskKind) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  for (qkv_test::Modifier m : qkv_test::kAllModifiers)
    for (MaskKind kind : kAllMasks)
      cases.push_back(make_case(rng, random_sizes(rng), kind, 1.0, rng.chance(0.3) ? 0.2f : 0.0f, m));
  cases.push_back(make_case(rng, {1, 4, 2, 130, 300, 64, 48}, MaskKind::Causal, 3.0, 0.0f, qkv_test::Modifier::All));
  check_everywhere(cases);
}

TEST(Flash, AwkwardLengthsAndDims) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  // Lengths around and away from every tile size; Dk != Dv; GQA.
  for (int64_t nq : {1, 3, 17, 113})
    for (int64_t nk : {1, 3, 17, 113})
      cases.push_back(make_case(rng, {1, 4, 2, nq, nk, 33, 17}, nq % 2 ? MaskKind::None : MaskKind::Causal, 1.0, 0.0f));
  cases.push_back(make_case(rng, {1, 2, 1, 1000, 1000, 64, 64}, MaskKind::None, 1.0, 0.0f));
  cases.push_back(make_case(rng, {1, 2, 2, 1000, 1000, 64, 48}, MaskKind::Causal, 1.0, 0.0f));
  cases.push_back(make_case(rng, {2, 2, 1, 1000, 113, 128, 80}, MaskKind::Combined, 1.0, 0.0f));
  cases.push_back(make_case(rng, {1, 1, 1, 113, 1000, 17, 3}, MaskKind::WindowRight, 1.0, 0.0f));
  cases.push_back(make_case(rng, {1, 3, 3, 1000, 1000, 1, 1}, MaskKind::Window, 1.0, 0.0f));
  // Heads split into uneven query tiles (AVX-512: 80 = 48 + 32, 200 = 3 x 48 + 32 + 24, 256 =
  // 4 x 48 + 2 x 32; other widths their own splits), causal so that each tile sees other keys.
  for (int64_t nq : {80, 200, 256})
    cases.push_back(make_case(rng, {1, 2, 1, nq, nq, 24, 24}, MaskKind::Causal, 1.0, 0.0f));
  check_everywhere(cases);
}

// The strided residues (flash/forward.cpp) on sequences long enough for many residue and key tiles:
// every kind of `rest`, GQA, Nq != Nk both ways, odd dims, modifiers, dropout, 16-bit K/V.
TEST(Flash, StridedResiduesOnLongSequences) {
  Random rng;
  SCOPED_TRACE(rng.note());
  using qkv_test::Modifier;
  using qkv_test::strided_residue_case;
  std::vector<Case> cases;
  cases.push_back(strided_residue_case(rng, {1, 2, 1, 1900, 1900, 33, 17}, 0, 0.0f));
  cases.push_back(strided_residue_case(rng, {2, 2, 2, 1500, 2100, 16, 24}, 0, 0.2f, Modifier::All));
  cases.push_back(strided_residue_case(rng, {1, 4, 2, 140, 8100, 40, 24}, 1, 0.0f, Modifier::Alibi));
  cases.push_back(strided_residue_case(rng, {1, 1, 1, 1300, 1200, 64, 64}, 2, 0.0f, Modifier::Sinks));
  cases.push_back(strided_residue_case(rng, {1, 2, 1, 1200, 1200, 7, 9}, 3, 0.1f, Modifier::Softcap));
  cases.push_back(strided_residue_case(rng, {2, 2, 1, 1100, 1400, 20, 20}, 4, 0.0f));
  cases.push_back(strided_residue_case(rng, {1, 2, 2, 1600, 1600, 24, 1}, 5, 0.0f, Modifier::All));
  for (qkv::DType dtype : {qkv::DType::BF16, qkv::DType::F16}) {
    Case c = strided_residue_case(rng, {1, 2, 1, 1400, 1500, 32, 32}, 0, 0.0f, Modifier::Alibi);
    c.k = c.k.to(dtype);
    c.v = c.v.to(dtype);
    c.name += " kv=" + std::string(qkv::to_string(dtype));
    cases.push_back(std::move(c));
  }
  check_everywhere(cases);
}

TEST(Flash, LargeLogits) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  for (MaskKind kind : {MaskKind::None, MaskKind::Causal, MaskKind::Combined, MaskKind::Additive2D})
    for (int repeat = 0; repeat < 2; ++repeat) cases.push_back(make_case(rng, random_sizes(rng), kind, 30.0, 0.0f));
  cases.push_back(make_case(rng, {1, 2, 1, 1000, 1000, 64, 64}, MaskKind::Causal, 30.0, 0.0f));
  check_everywhere(cases);
}

TEST(Flash, Dropout) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  for (MaskKind kind : {MaskKind::None, MaskKind::Causal, MaskKind::KeyLengths, MaskKind::Combined, MaskKind::EmptyRows})
    for (float p : {0.1f, 0.5f, 0.9f}) cases.push_back(make_case(rng, random_sizes(rng), kind, 1.0, p));
  cases.push_back(make_case(rng, {1, 2, 1, 300, 1000, 64, 32}, MaskKind::Causal, 1.0, 0.25f));
  check_everywhere(cases);
}

TEST(Flash, EmptyRowsGiveZerosAndMinusInfinity) {
  Random rng;
  SCOPED_TRACE(rng.note());
  // Every row masked: by key length 0, by a causal offset below every query, by a keep of zeros.
  const Sizes s{2, 2, 1, 70, 90, 16, 24};
  std::vector<Case> cases;
  for (int n = 0; n < 3; ++n) {
    Case c = make_case(rng, s, MaskKind::None, 1.0, 0.0f);
    if (n == 0) {
      c.mask = Mask::key_lengths({0, 0});
      c.bias = qkv_test::key_lengths_bias({0, 0});
    } else if (n == 1) {
      c.mask = Mask::causal(-s.nq);
      c.bias = qkv_test::causal_bias(-s.nq);
    } else {
      const Tensor keep = Tensor::zeros(Shape{s.nq, s.nk});
      c.mask = Mask::keep(keep);
      c.bias = qkv_test::keep_bias(keep);
    }
    cases.push_back(c);
  }
  check_everywhere(cases);
  for (const Case& c : cases) {  // and exactly so: zeros, -inf, no NaN
    qkv_test::KernelOutputs out;
    qkv::detail::flash_attention(problem_of(c, out, 1.0f));
    for (float x : out.output) ASSERT_EQ(x, 0.0f);
    for (float x : out.lse) ASSERT_EQ(x, -std::numeric_limits<float>::infinity());
  }
}

TEST(Flash, EmptyProblems) {
  Random rng;
  SCOPED_TRACE(rng.note());
  // Nk = 0: every row sees nothing. Nq = 0 and B = 0: nothing to write.
  std::vector<Case> cases;
  cases.push_back(make_case(rng, {2, 2, 2, 5, 0, 8, 8}, MaskKind::None, 1.0, 0.0f));
  cases.push_back(make_case(rng, {2, 2, 2, 0, 5, 8, 8}, MaskKind::Causal, 1.0, 0.0f));
  cases.push_back(make_case(rng, {0, 2, 2, 5, 5, 8, 8}, MaskKind::None, 1.0, 0.0f));
  check_everywhere(cases);
}

}  // namespace

namespace {

// The kernels called from inside the caller's own OpenMP region, each thread its own small call
// (one worker, no region of the kernel's): each finds its scratch as worker 0 of its call, not
// by the caller's thread number (which indexed past a one-worker workspace: AddressSanitizer
// reports it), and decode's merge binds no barrier to the caller's region. Every thread's
// results equal the same calls made outside.
TEST(Kernels, InsideTheCallersOpenMPRegion) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor q = rng.randn(Shape{1, 2, 40, 32}), k = rng.randn(Shape{1, 2, 300, 32}), v = rng.randn(Shape{1, 2, 300, 32});
  const Tensor q1 = rng.randn(Shape{1, 2, 1, 32});
  qkv::AttentionOptions flash, decode;
  flash.backend = qkv::Backend::Flash;
  decode.backend = qkv::Backend::Decode;
  const qkv::AttentionResult want_flash = qkv::scaled_dot_product_attention(q, k, v, flash);
  const qkv::AttentionResult want_decode = qkv::scaled_dot_product_attention(q1, k, v, decode);
  const Tensor grad = rng.randn(want_flash.output.shape());
  const qkv::AttentionGrads want_grads = qkv::scaled_dot_product_attention_backward(grad, q, k, v, want_flash, flash);
  constexpr int kThreads = 3;
  std::vector<int> same(kThreads, 0);
#pragma omp parallel num_threads(kThreads)
  {
    const int t = omp_get_thread_num();
    const qkv::AttentionResult f = qkv::scaled_dot_product_attention(q, k, v, flash);
    const qkv::AttentionResult d = qkv::scaled_dot_product_attention(q1, k, v, decode);
    const qkv::AttentionGrads g = qkv::scaled_dot_product_attention_backward(grad, q, k, v, f, flash);
    same[static_cast<size_t>(t)] = f.output.to_vector() == want_flash.output.to_vector() &&
                                   d.output.to_vector() == want_decode.output.to_vector() &&
                                   g.dq.to_vector() == want_grads.dq.to_vector() &&
                                   g.dk.to_vector() == want_grads.dk.to_vector();
  }
  for (int t = 0; t < kThreads; ++t) EXPECT_TRUE(same[static_cast<size_t>(t)]) << "thread " << t;
}

}  // namespace
