// The decode kernel (few queries against a long KV cache, keys split into chunks whose partials
// are merged) against the float64 oracle and the reference kernel, called directly through the
// internal headers, on fresh random shapes: Nq in {1, 2, 3, 7}, Nk in {1, 3, 17, 113, 1000, 5000}
// (one chunk, several, a last chunk cut short), Dk != Dv, grouped-query heads (several query
// heads and queries per K/V head, more rows than one row block), every mask kind, the KV-cache
// causal mask Mask::causal(Nk - Nq), rows and whole chunks that see no key, large logits and
// dropout; on 1 and 2 threads and on every SIMD target. Cases, tolerance and the running on
// every target are harness/kernel_cases.hpp's, shared with attention/test_flash.cpp.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention/decode/plan.hpp"
#include "attention/kernels.hpp"
#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"

namespace {

using qkv::Mask;
using qkv::Tensor;
using qkv_test::Case;
using qkv_test::MaskKind;
using qkv_test::Random;
using qkv_test::Sizes;
using qkv_test::kAllMasks;
using qkv_test::make_case;
using qkv_test::problem_of;

void check_everywhere(const std::vector<Case>& cases) {
  qkv_test::check_everywhere(qkv_test::decode_kernel, cases);
}

// Decode-shaped random sizes: few queries, a key length from the list, dims from 1 to 130
// (rarely equal), 1 or 2 K/V heads each read by 1 to 4 query heads. The oracle's cost grows
// with Hq Nq Nk (Dk + Dv): the longest caches get small heads.
Sizes random_decode_sizes(Random& rng) {
  const int64_t query_lengths[] = {1, 2, 3, 7};
  const int64_t key_lengths[] = {1, 3, 17, 113, 1000, 5000};
  const int64_t dims[] = {1, 7, 16, 33, 64, 128};
  const int64_t nk = key_lengths[rng.integer(0, 5)];
  const int64_t max_dim = nk >= 5000 ? 48 : 130;
  auto dim = [&] {
    const int64_t d = rng.chance(0.6) ? dims[rng.integer(0, 5)] : rng.integer(1, 130);
    return std::min(d, max_dim);
  };
  const int64_t kv_heads = rng.integer(1, 2);
  return {rng.integer(1, 2), kv_heads * rng.integer(1, 4), kv_heads, query_lengths[rng.integer(0, 3)], nk, dim(),
          dim()};
}

// The KV-cache mask: the Nq new queries sit at the end of the cache, query i at position
// Nk - Nq + i sees keys j <= Nk - Nq + i.
void set_kv_cache_mask(Case& c) {
  const int64_t offset = c.k.size(2) - c.q.size(2);
  c.mask = Mask::causal(offset);
  c.bias = qkv_test::causal_bias(offset);
  c.name += " (causal offset Nk - Nq = " + std::to_string(offset) + ")";
}

TEST(Decode, EveryMaskKindOnRandomShapes) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  for (MaskKind kind : kAllMasks)
    for (int repeat = 0; repeat < 2; ++repeat)
      cases.push_back(make_case(rng, random_decode_sizes(rng), kind, 1.0, 0.0f));
  check_everywhere(cases);
}

// Softcap, ALiBi and sinks, alone and together, with every mask kind, against the float64 oracle
// on every target and thread count; the sink joins only the first chunk of a row's keys.
TEST(Decode, ScoreModifiersEveryMaskKind) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  for (qkv_test::Modifier m : qkv_test::kAllModifiers)
    for (MaskKind kind : kAllMasks)
      cases.push_back(make_case(rng, random_decode_sizes(rng), kind, 1.0, rng.chance(0.3) ? 0.2f : 0.0f, m));
  Case long_cache = make_case(rng, {1, 4, 2, 3, 5000, 32, 16}, MaskKind::None, 1.0, 0.0f, qkv_test::Modifier::All);
  set_kv_cache_mask(long_cache);
  cases.push_back(long_cache);
  check_everywhere(cases);
}

// Sparse Transformer's pattern at generation time: the queries sit at the end of a long cache
// (causal(Nk - Nq)) and each sees a window and every S-th key before it, keys decode gathers per
// query instead of reading every tile. Strides from 4 (the smallest gathered) to past Nk, any
// offset, with key lengths, GQA, Dk != Dv, modifiers, dropout and 16-bit K/V.
TEST(Decode, StridedKeysGatheredPerQuery) {
  namespace t = qkv_test;
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  for (int n = 0; n < 12; ++n) {
    Sizes s = random_decode_sizes(rng);
    s.nk = std::max<int64_t>(s.nk, 113);
    Case c = make_case(rng, s, MaskKind::None, 1.0, rng.chance(0.3) ? 0.2f : 0.0f,
                       n % 3 == 0 ? t::Modifier::All : t::Modifier::None);
    const int64_t stride = rng.chance(0.7) ? rng.integer(4, 40) : rng.integer(41, 2 * s.nk);
    const int64_t offset = rng.integer(-50, 50), window = rng.integer(0, 80), at_end = s.nk - s.nq;
    c.mask = Mask::causal(at_end) & (Mask::window(window, 0, at_end) | Mask::strided(stride, offset));
    c.bias = t::all_of(
        {t::causal_bias(at_end), t::any_of({t::window_bias(window, 0, at_end), t::strided_bias(stride, offset)})});
    if (rng.chance(0.5)) {
      const std::vector<int64_t> lengths = qkv_test::random_lengths(rng, s.batch, s.nk);
      c.mask = c.mask & Mask::key_lengths(lengths);
      c.bias = t::all_of({c.bias, t::key_lengths_bias(lengths)});
    }
    c.name += " stride " + std::to_string(stride) + " offset " + std::to_string(offset) + " window " +
              std::to_string(window);
    if (n % 4 == 3) {
      const qkv::DType dtype = n % 8 == 3 ? qkv::DType::BF16 : qkv::DType::F16;
      c.k = c.k.to(dtype);
      c.v = c.v.to(dtype);
      c.name += " kv=" + std::string(qkv::to_string(dtype));
    }
    cases.push_back(c);
  }
  check_everywhere(cases);
}

TEST(Decode, EveryLengthWithTheKvCacheMask) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  for (int64_t nq : {1, 2, 3, 7}) {
    for (int64_t nk : {1, 3, 17, 113, 1000, 5000}) {
      if (nk < nq) continue;
      const int64_t dk = nk == 5000 ? 33 : 64, dv = nk == 5000 ? 17 : 48;
      Case c = make_case(rng, {1, 4, 2, nq, nk, dk, dv}, MaskKind::None, 1.0, 0.0f);
      set_kv_cache_mask(c);
      cases.push_back(c);
    }
  }
  check_everywhere(cases);
}

TEST(Decode, ManyRowsPerGroupAndWholeVectors) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  // 6 query heads x 7 queries = 42 rows per K/V head: more than one row block per chunk, and
  // chunks lengthened so the partials stay small.
  cases.push_back(make_case(rng, {1, 12, 2, 7, 1000, 64, 80}, MaskKind::None, 1.0, 0.0f));
  cases.push_back(make_case(rng, {2, 6, 1, 7, 1000, 32, 16}, MaskKind::Combined, 1.0, 0.0f));
  // Dims that are whole vectors on every target (the W4 shape, shorter) and one that is not.
  Case w4 = make_case(rng, {1, 4, 4, 1, 1000, 128, 128}, MaskKind::None, 1.0, 0.0f);
  set_kv_cache_mask(w4);
  cases.push_back(w4);
  cases.push_back(make_case(rng, {1, 8, 1, 2, 1000, 128, 64}, MaskKind::KeyLengths, 1.0, 0.0f));
  cases.push_back(make_case(rng, {1, 3, 1, 3, 1000, 129, 127}, MaskKind::Window, 1.0, 0.0f));
  check_everywhere(cases);
}

TEST(Decode, LargeLogits) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  for (MaskKind kind : {MaskKind::None, MaskKind::CausalOffset, MaskKind::Combined, MaskKind::Additive2D})
    for (int repeat = 0; repeat < 2; ++repeat) cases.push_back(make_case(rng, random_decode_sizes(rng), kind, 30.0, 0.0f));
  Case c = make_case(rng, {1, 2, 1, 3, 1000, 64, 64}, MaskKind::None, 30.0, 0.0f);
  set_kv_cache_mask(c);
  cases.push_back(c);
  check_everywhere(cases);
}

TEST(Decode, Dropout) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<Case> cases;
  for (MaskKind kind : {MaskKind::None, MaskKind::CausalOffset, MaskKind::KeyLengths, MaskKind::Combined,
                        MaskKind::EmptyRows})
    for (float p : {0.1f, 0.5f, 0.9f}) cases.push_back(make_case(rng, random_decode_sizes(rng), kind, 1.0, p));
  Case c = make_case(rng, {1, 4, 2, 2, 1000, 64, 32}, MaskKind::None, 1.0, 0.25f);
  set_kv_cache_mask(c);
  c.dropout_p = 0.25f;
  cases.push_back(c);
  check_everywhere(cases);
}

TEST(Decode, EmptyRowsAndEmptyChunksGiveZerosAndMinusInfinity) {
  Random rng;
  SCOPED_TRACE(rng.note());
  // Every row masked: by key length 0, by a causal offset below every query, by a keep of zeros;
  // with 1000 keys (two chunks) and 17 (one).
  std::vector<Case> empty;
  for (int64_t nk : {17, 1000}) {
    const Sizes s{2, 4, 2, 3, nk, 16, 24};
    for (int n = 0; n < 3; ++n) {
      Case c = make_case(rng, s, MaskKind::None, 1.0, 0.0f);
      if (n == 0) {
        c.mask = Mask::key_lengths({0, 0});
        c.bias = qkv_test::key_lengths_bias({0, 0});
      } else if (n == 1) {
        c.mask = Mask::causal(-s.nq);
        c.bias = qkv_test::causal_bias(-s.nq);
      } else {
        const Tensor keep = Tensor::zeros(qkv::Shape{s.nq, s.nk});
        c.mask = Mask::keep(keep);
        c.bias = qkv_test::keep_bias(keep);
      }
      empty.push_back(c);
    }
  }
  check_everywhere(empty);
  for (const Case& c : empty) {  // and exactly so: zeros, -inf, no NaN
    qkv_test::KernelOutputs out;
    EXPECT_TRUE(qkv::detail::decode_attention(problem_of(c, out, 1.0f)));
    for (float x : out.output) ASSERT_EQ(x, 0.0f) << c.name;
    for (float x : out.lse) ASSERT_EQ(x, -std::numeric_limits<float>::infinity()) << c.name;
  }

  // Chunks that see nothing next to chunks that do: a short key length in a long cache (only
  // the first chunk sees keys), a narrow window at the end of the cache (only the last), keys
  // visible in the middle only, and a keep tensor that hides every key of some chunks.
  std::vector<Case> partly;
  Case short_length = make_case(rng, {2, 2, 1, 2, 5000, 16, 8}, MaskKind::None, 1.0, 0.0f);
  short_length.mask = Mask::key_lengths({100, 3});
  short_length.bias = qkv_test::key_lengths_bias({100, 3});
  partly.push_back(short_length);
  Case window = make_case(rng, {1, 2, 2, 3, 5000, 16, 8}, MaskKind::None, 1.0, 0.0f);
  window.mask = Mask::window(40, 0, 5000 - 3);
  window.bias = qkv_test::window_bias(40, 0, 5000 - 3);
  partly.push_back(window);
  Case middle = make_case(rng, {1, 1, 1, 7, 1000, 8, 8}, MaskKind::None, 1.0, 0.0f);
  middle.mask = Mask::window(10, 20, 600) & Mask::key_lengths({610});
  middle.bias = qkv_test::all_of({qkv_test::window_bias(10, 20, 600), qkv_test::key_lengths_bias({610})});
  partly.push_back(middle);
  std::vector<float> keep_values(2 * 5000, 0.0f);
  for (int64_t j = 0; j < 5000; ++j) keep_values[static_cast<size_t>(j)] = (j / 512) % 3 == 1 ? 1.0f : 0.0f;
  for (int64_t j = 0; j < 5000; ++j) keep_values[static_cast<size_t>(5000 + j)] = j == 4999 ? 1.0f : 0.0f;
  const Tensor keep = Tensor::from(std::move(keep_values), qkv::Shape{2, 5000});
  Case sparse = make_case(rng, {1, 2, 1, 2, 5000, 8, 16}, MaskKind::None, 1.0, 0.0f);
  sparse.mask = Mask::keep(keep);
  sparse.bias = qkv_test::keep_bias(keep);
  partly.push_back(sparse);
  check_everywhere(partly);
}

TEST(Decode, EmptyProblems) {
  Random rng;
  SCOPED_TRACE(rng.note());
  // Nk = 0: every row sees nothing. Nq = 0 and B = 0: nothing to write.
  std::vector<Case> cases;
  cases.push_back(make_case(rng, {2, 2, 2, 5, 0, 8, 8}, MaskKind::None, 1.0, 0.0f));
  cases.push_back(make_case(rng, {2, 2, 2, 0, 5, 8, 8}, MaskKind::Causal, 1.0, 0.0f));
  cases.push_back(make_case(rng, {0, 2, 2, 5, 5, 8, 8}, MaskKind::None, 1.0, 0.0f));
  check_everywhere(cases);
}

// Which paged problems take the page-major items (decode/plan.hpp, page_major_fits): one query,
// float, 16-bit or int8 K/V, no rule, tensor term or dropout, at most kPageMajorMaxRows query heads and
// an item for each thread; any other takes the (b, g, chunk) items. Paged problems are built by
// attention/paged.cpp (their results: attention/test_paged.cpp); here a contiguous problem is
// marked paged, which is all the plan reads.
// Auto's choice (decode_is_faster): decode up to 8 queries; from 9 to 64 only where flash's (batch,
// head, query tile) items are fewer than the threads; never past 64 queries or where decode's
// own items are fewer than the threads. 4 threads: one head of 12 (32) queries is 1 (1-3) flash
// items on every target (query tiles of 12 rows or more), 16 heads at least 16.
TEST(Decode, AutoTakesDecodeForFewQueriesOrWhereFlashWouldIdleThreads) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(4);
  const auto decode_faster = [&](const Sizes& sizes) {
    const Case c = make_case(rng, sizes, MaskKind::None, 1.0, 0.0f);
    qkv_test::KernelOutputs out;
    return qkv::detail::decode_is_faster(problem_of(c, out));
  };
  // 4096 keys of d = 64: 8 chunks a head, enough decode items for 4 threads.
  EXPECT_TRUE(decode_faster({2, 8, 8, 8, 4096, 64, 64})) << "8 queries, flash busy";
  EXPECT_FALSE(decode_faster({2, 8, 8, 12, 4096, 64, 64})) << "12 queries, flash busy";
  EXPECT_FALSE(decode_faster({2, 8, 2, 12, 4096, 64, 64})) << "12 queries, GQA, flash busy";
  EXPECT_TRUE(decode_faster({1, 1, 1, 12, 4096, 64, 64})) << "12 queries, one flash item";
  EXPECT_TRUE(decode_faster({1, 1, 1, 32, 4096, 64, 64})) << "32 queries, one head: 1-3 flash items";
  EXPECT_FALSE(decode_faster({1, 1, 1, 65, 4096, 64, 64})) << "65 queries";
  EXPECT_FALSE(decode_faster({1, 1, 1, 4, 300, 64, 64})) << "one decode item for 4 threads";
  omp_set_num_threads(threads_before);
}

TEST(Decode, PagedProblemsThatFitReadPageMajor) {
  Random rng;
  SCOPED_TRACE(rng.note());
  namespace decode = qkv::detail::decode;
  const int64_t pages[] = {0};
  const auto plan_of = [&](const Sizes& sizes, MaskKind kind, float dropout_p, int threads,
                           qkv::DType dtype = qkv::DType::F32, bool paged = true) {
    const Case c = make_case(rng, sizes, kind, 1.0, dropout_p);
    qkv_test::KernelOutputs out;
    qkv::detail::AttentionProblem p = problem_of(c, out);
    if (paged) p.paged = qkv::detail::PagedKv{pages, 64, 6, 0, 0, 0, 0};
    p.kv_dtype = dtype;
    return decode::Plan(p, threads);
  };
  // 32 query heads on 8 K/V heads of d = 64: 4 KB a key, so 512-key chunks (a (b, g, chunk) item's
  // keys bound kPageMajorItemBytes' 1024), 4 of them; 16-bit: 1024 keys, 2 chunks.
  const Sizes gqa{1, 32, 8, 1, 2048, 64, 64};
  for (MaskKind kind : {MaskKind::None, MaskKind::Causal, MaskKind::Window, MaskKind::KeyLengths}) {
    SCOPED_TRACE(qkv_test::to_string(kind));
    const decode::Plan plan = plan_of(gqa, kind, 0.0f, 2);
    EXPECT_TRUE(plan.page_major);
    EXPECT_EQ(plan.chunk_keys, 512);
    EXPECT_EQ(plan.items, 4);
    EXPECT_EQ(plan.block_rows, 32);
  }
  const decode::Plan bf16 = plan_of(gqa, MaskKind::None, 0.0f, 2, qkv::DType::BF16);
  EXPECT_TRUE(bf16.page_major);
  EXPECT_EQ(bf16.chunk_keys, 1024);
  EXPECT_TRUE(plan_of(gqa, MaskKind::None, 0.0f, 2, qkv::DType::F16).page_major);
  // int8: 1 KB a key, one 2048-key chunk: page-major on one thread, not on two.
  const decode::Plan int8 = plan_of(gqa, MaskKind::None, 0.0f, 1, qkv::DType::I8);
  EXPECT_TRUE(int8.page_major);
  EXPECT_EQ(int8.chunk_keys, 2048);
  EXPECT_FALSE(plan_of(gqa, MaskKind::None, 0.0f, 2, qkv::DType::I8).page_major);
  // The rest take (b, g, chunk) items of kChunkKeys float keys.
  const auto head_items = [](const decode::Plan& plan, const std::string& why) {
    EXPECT_FALSE(plan.page_major) << why;
    EXPECT_EQ(plan.block_rows, static_cast<int64_t>(decode::kRowBlock)) << why;
    EXPECT_EQ(plan.items, 8 * plan.chunks) << why;
  };
  head_items(plan_of(gqa, MaskKind::None, 0.0f, 2, qkv::DType::F32, false), "not paged");
  head_items(plan_of({1, 32, 8, 2, 2048, 64, 64}, MaskKind::None, 0.0f, 2), "two queries");
  head_items(plan_of(gqa, MaskKind::None, 0.25f, 2), "dropout");
  head_items(plan_of(gqa, MaskKind::Strided, 0.0f, 2), "a rule");
  head_items(plan_of(gqa, MaskKind::Keep2D, 0.0f, 2), "a tensor term");
  head_items(plan_of(gqa, MaskKind::None, 0.0f, 1, qkv::DType::I4), "int4 K/V");
  head_items(plan_of(gqa, MaskKind::None, 0.0f, 5), "fewer chunks than threads");
  const decode::Plan wide = plan_of({1, 136, 8, 1, 2048, 8, 8}, MaskKind::None, 0.0f, 2);
  EXPECT_FALSE(wide.page_major) << "more query heads than kPageMajorMaxRows";
}

}  // namespace
