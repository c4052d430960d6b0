// qkv::nn::PagedKVCache: sequences grown a page at a time, forked with shared pages and copy on
// write of a shared last page, read back through the block table against the rows each sequence
// was given (a fork's own appends never change its parent's keys, nor the parent's its fork's),
// reference counts and the free list, attention over the pool against each sequence's
// contiguous keys, 16-bit pools, and the refusals (an exhausted pool leaves the cache unchanged).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "harness/oracle.hpp"
#include "harness/sequence_cases.hpp"
#include "qkv/paged_cache.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::DType;
using qkv::Shape;
using qkv::Tensor;
using qkv::nn::PagedKVCache;
using qkv_test::Random;

constexpr int64_t kHeads = 3, kDim = 7, kPageSize = 5;

// A sequence's rows as given: (kHeads, N, kDim) keys and values, grown by `grow`.
struct Rows {
  std::vector<Tensor> k, v;
  Tensor all(const std::vector<Tensor>& parts) const {
    int64_t n = 0;
    for (const Tensor& t : parts) n += t.size(1);
    Tensor out = Tensor::empty(Shape{kHeads, n, kDim});
    int64_t at = 0;
    for (const Tensor& t : parts) {
      for (int64_t h = 0; h < kHeads; ++h)
        for (int64_t i = 0; i < t.size(1); ++i)
          for (int64_t d = 0; d < kDim; ++d) out.at({h, at + i, d}) = t.at({h, i, d});
      at += t.size(1);
    }
    return out;
  }
};

void grow(PagedKVCache& cache, int64_t id, Rows& rows, int64_t n, Random& rng) {
  rows.k.push_back(rng.randn(Shape{kHeads, n, kDim}));
  rows.v.push_back(rng.randn(Shape{kHeads, n, kDim}));
  cache.append(id, rows.k.back(), rows.v.back());
}

// The sequence's keys or values read through its pages, (kHeads, length, kDim), as floats.
Tensor read_back(const PagedKVCache& cache, int64_t id, const Tensor& pool) {
  const Tensor floats = pool.to(DType::F32);
  Tensor out = Tensor::empty(Shape{kHeads, cache.length(id), kDim});
  for (int64_t j = 0; j < cache.length(id); ++j)
    for (int64_t h = 0; h < kHeads; ++h)
      for (int64_t d = 0; d < kDim; ++d)
        out.at({h, j, d}) = floats.at({cache.pages(id)[j / kPageSize], j % kPageSize, h, d});
  return out;
}

// A grouped-query layer (24 wide, 4 heads, 2 for keys and values) with rotary positions, in eval.
qkv::nn::MultiHeadAttention rotary_module(Random& rng) {
  qkv::nn::MultiHeadAttentionOptions options;
  options.num_kv_heads = 2;
  options.rotary = qkv::nn::RotaryEmbeddingOptions{};
  options.seed = rng.next_u64();
  qkv::nn::MultiHeadAttention m(24, 4, options);
  m.eval();
  return m;
}

void expect_same(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<float> a = got.to_vector(), b = want.to_vector();
  for (size_t x = 0; x < a.size(); ++x) ASSERT_EQ(a[x], b[x]) << what << " at " << x;
}

TEST(PagedKVCache, ForkSharesPagesAndCopiesTheSharedLastPageOnWrite) {
  Random rng;
  SCOPED_TRACE(rng.note());
  PagedKVCache cache(12, kPageSize, kHeads, kDim);
  Rows a_rows;
  const int64_t a = cache.add_sequence();
  grow(cache, a, a_rows, 7, rng);
  grow(cache, a, a_rows, 5, rng);  // 12 positions: pages 0, 1 full, page 2 holding 2
  ASSERT_EQ(cache.pages(a).size(), 3u);
  const int64_t b = cache.fork(a);
  Rows b_rows = a_rows;
  EXPECT_EQ(cache.pages(b), cache.pages(a));
  for (int64_t page : cache.pages(a)) EXPECT_EQ(cache.references(page), 2);
  EXPECT_EQ(cache.free_pages(), 9);
  grow(cache, b, b_rows, 4, rng);  // writes into the shared last page: copied first
  grow(cache, a, a_rows, 9, rng);
  EXPECT_EQ(cache.pages(a)[0], cache.pages(b)[0]);
  EXPECT_EQ(cache.pages(a)[1], cache.pages(b)[1]);
  EXPECT_NE(cache.pages(a)[2], cache.pages(b)[2]);
  EXPECT_EQ(cache.references(cache.pages(a)[2]), 1);
  for (int64_t id : {a, b}) {
    const Rows& rows = id == a ? a_rows : b_rows;
    expect_same(read_back(cache, id, cache.key_pool()), rows.all(rows.k), "keys of sequence " + std::to_string(id));
    expect_same(read_back(cache, id, cache.value_pool()), rows.all(rows.v), "values of sequence " + std::to_string(id));
  }
  const int64_t used = 12 - cache.free_pages();
  cache.release(a);
  EXPECT_EQ(cache.free_pages(), 12 - used + 3);  // a's own pages freed; the shared two stay with b
  cache.release(b);
  EXPECT_EQ(cache.free_pages(), 12);
}

TEST(PagedKVCache, AttentionOverThePoolMatchesContiguousKeys) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (DType dtype : {DType::F32, DType::BF16}) {
    SCOPED_TRACE(std::string(qkv::to_string(dtype)));
    PagedKVCache cache(40, kPageSize, kHeads, kDim, dtype);
    std::vector<Rows> rows(3);
    const int64_t first = cache.add_sequence();
    grow(cache, first, rows[0], 23, rng);
    const int64_t second = cache.fork(first);
    rows[1] = rows[0];
    grow(cache, second, rows[1], 6, rng);
    const int64_t third = cache.add_sequence();
    grow(cache, third, rows[2], 1, rng);
    qkv::AttentionOptions o;
    o.mask = qkv::Mask::causal();
    cache.set_paged_options({first, second, third}, o);
    const int64_t nq = 2, q_heads = 6;
    const Tensor q = rng.randn(Shape{3, q_heads, nq, kDim});
    const qkv::AttentionResult paged = qkv::scaled_dot_product_attention(q, cache.key_pool(), cache.value_pool(), o);
    for (int64_t b = 0; b < 3; ++b) {
      qkv::AttentionOptions alone;
      alone.mask = qkv::Mask::causal(rows[b].all(rows[b].k).size(1) - nq);
      const qkv::AttentionResult want = qkv::scaled_dot_product_attention(
          q.narrow(0, b, 1).contiguous(), rows[b].all(rows[b].k).unsqueeze(0).to(dtype),
          rows[b].all(rows[b].v).unsqueeze(0).to(dtype), alone);
      const std::vector<float> got = paged.output.narrow(0, b, 1).contiguous().to_vector(),
                               expected = want.output.to_vector();
      for (size_t x = 0; x < got.size(); ++x) ASSERT_NEAR(got[x], expected[x], 2e-5) << "sequence " << b << " at " << x;
    }
  }
}

// MultiHeadAttention (GQA, rotary) on a paged cache: a prompt, forked into two continuations
// decoded a token or two at a time as one batch, gives each continuation's rows of the full
// causal forward over its whole sequence.
TEST(PagedKVCache, MultiHeadAttentionContinuesForkedSequences) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const qkv::nn::MultiHeadAttention m = rotary_module(rng);
  const int64_t prompt_len = 7, steps = 5;
  const Tensor prompt = rng.randn(Shape{1, prompt_len, 24});
  std::vector<Tensor> full = {Tensor(), Tensor()};  // each continuation's whole sequence (1, T, 24)
  const Tensor tails = rng.randn(Shape{2, steps, 24});
  PagedKVCache cache(30, 3, 2, m.head_dim());
  const int64_t root = cache.add_sequence();
  (void)m.forward(prompt, cache, {root});
  const std::vector<int64_t> ids = {cache.fork(root), cache.fork(root)};
  std::vector<std::vector<float>> got(2);
  for (int64_t t = 0; t < steps; t += 2) {
    const int64_t n = std::min<int64_t>(2, steps - t);
    const Tensor out = m.forward(tails.narrow(1, t, n).contiguous(), cache, ids).output;  // (2, n, 24)
    for (int64_t b = 0; b < 2; ++b) {
      const std::vector<float> rows = out.narrow(0, b, 1).contiguous().to_vector();
      got[b].insert(got[b].end(), rows.begin(), rows.end());
    }
  }
  for (int64_t b = 0; b < 2; ++b) {
    Tensor whole = Tensor::empty(Shape{1, prompt_len + steps, 24});
    for (int64_t i = 0; i < prompt_len + steps; ++i)
      for (int64_t c = 0; c < 24; ++c)
        whole.at({0, i, c}) = i < prompt_len ? prompt.at({0, i, c}) : tails.at({b, i - prompt_len, c});
    const std::vector<float> want =
        m.forward(whole, qkv::Mask::causal()).output.narrow(1, prompt_len, steps).contiguous().to_vector();
    ASSERT_EQ(got[b].size(), want.size());
    for (size_t x = 0; x < want.size(); ++x) ASSERT_NEAR(got[b][x], want[x], 1e-4) << "continuation " << b << " at " << x;
  }
}

TEST(PagedKVCache, RefusalsLeaveTheCacheUnchanged) {
  Random rng;
  PagedKVCache cache(3, kPageSize, kHeads, kDim);
  Rows rows;
  const int64_t a = cache.add_sequence();
  grow(cache, a, rows, 11, rng);  // 3 pages
  const int64_t b = cache.fork(a);
  const Tensor one = rng.randn(Shape{kHeads, 1, kDim});
  qkv_test::expect_error([&] { cache.append(b, one, one); }, {"needs 1 free pages but the pool has 0"});
  EXPECT_EQ(cache.length(b), 11);
  EXPECT_EQ(cache.pages(b), cache.pages(a));
  qkv_test::expect_error([&] { cache.append(a, rng.randn(Shape{kHeads, 1, kDim + 1}), one); }, {"(3, N, 7)"});
  qkv_test::expect_error([&] { cache.append(7, one, one); }, {"sequence 7 is not a live sequence"});
  cache.release(b);
  qkv_test::expect_error([&] { cache.length(b); }, {"not a live sequence"});
  qkv_test::expect_error([] { PagedKVCache(0, 4, 1, 1); }, {"at least 1"});
  qkv_test::expect_error([] { PagedKVCache(2, 4, 1, 3, DType::I4); }, {"head_dim 3 must be even"});
  PagedKVCache quantized(2, 4, 1, 2, DType::I8);
  const int64_t q_seq = quantized.add_sequence();
  qkv_test::expect_error([&] { quantized.append(q_seq, Tensor::full(Shape{1, 1, 2}, NAN), Tensor::zeros(Shape{1, 1, 2})); },
                         {"needs finite keys and values"});
  qkv_test::expect_error(
      [&] { quantized.append(q_seq, Tensor::zeros(Shape{1, 1, 2}).to(DType::BF16), Tensor::zeros(Shape{1, 1, 2})); },
      {"quantized here: f32 only"});
  EXPECT_EQ(quantized.length(q_seq), 0);
  EXPECT_EQ(quantized.free_pages(), 2);
}

// MultiHeadAttention's paged forward checks the whole batch before it appends anything: a batch
// the pool cannot hold, or one naming a sequence twice, is refused with every sequence unchanged.
TEST(PagedKVCache, MultiHeadAttentionRefusesABatchWholeBeforeAppending) {
  Random rng;
  qkv::nn::MultiHeadAttention m(8, 2);
  m.eval();
  PagedKVCache cache(3, 4, 2, m.head_dim());
  const int64_t s0 = cache.add_sequence(), s1 = cache.add_sequence();
  (void)m.forward(rng.randn(Shape{2, 4, 8}), cache, {s0, s1});  // one full page each, one page free
  qkv_test::expect_error([&] { (void)m.forward(rng.randn(Shape{2, 1, 8}), cache, {s0, s1}); },
                         {"needs 2 free pages but the pool has 1"});
  EXPECT_EQ(cache.length(s0), 4);
  EXPECT_EQ(cache.length(s1), 4);
  EXPECT_EQ(cache.free_pages(), 1);
  const std::string twice = "sequence " + std::to_string(s1) + " is batch elements 0 and 1";
  qkv_test::expect_error([&] { (void)m.forward(rng.randn(Shape{2, 1, 8}), cache, {s1, s1}); }, {twice.c_str()});
  EXPECT_EQ(cache.length(s1), 4);
  EXPECT_EQ(m.forward(Tensor::empty(Shape{0, 3, 8}), cache, {}).output.shape(), (Shape{0, 3, 8}));
  EXPECT_EQ(m.forward(rng.randn(Shape{1, 1, 8}), cache, {s0}).output.shape(), (Shape{1, 1, 8}));
  EXPECT_EQ(cache.length(s0), 5);

  // A quantized cache refuses non-finite rows: a batch whose second element has one is refused
  // before the first element's rows are appended.
  PagedKVCache quantized(4, 4, 2, m.head_dim(), DType::I8);
  const int64_t q0 = quantized.add_sequence(), q1 = quantized.add_sequence();
  Tensor x = rng.randn(Shape{2, 1, 8});
  x.at({1, 0, 3}) = NAN;
  qkv_test::expect_error([&] { (void)m.forward(x, quantized, {q0, q1}); }, {"needs finite keys and values"});
  EXPECT_EQ(quantized.length(q0), 0);
  EXPECT_EQ(quantized.free_pages(), 4);
}

// KVCache's paged mode (make_cache(..., page_size)): MultiHeadAttention on it, a prompt and then
// steps of one and two tokens, equals the contiguous cache of the same dtype (f32 and int8, page
// sizes 1 and 4 against a capacity of 11); lengths follow, reset returns the pages, keys() and
// counts are refused by name, and a call past the capacity leaves the cache unchanged.
TEST(PagedKVCache, KVCachePagedModeMatchesTheContiguousCache) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const qkv::nn::MultiHeadAttention m = rotary_module(rng);
  const int64_t capacity = 11;
  const Tensor tokens = rng.randn(Shape{2, capacity, 24});
  for (DType dtype : {DType::F32, DType::I8})
    for (int64_t page_size : {1, 4}) {
      const std::string what = std::string(qkv::to_string(dtype)) + " page_size " + std::to_string(page_size);
      qkv::nn::KVCache contiguous = m.make_cache(2, capacity, dtype);
      qkv::nn::KVCache paged = m.make_cache(2, capacity, dtype, 0, page_size);
      ASSERT_NE(paged.paged(), nullptr) << what;
      EXPECT_EQ(paged.page_size(), page_size);
      EXPECT_EQ(paged.paged()->free_pages(), 2 * ((capacity + page_size - 1) / page_size)) << what;
      for (int64_t reset = 0; reset < 2; ++reset) {
        for (auto [start, n] : {std::pair<int64_t, int64_t>{0, 6}, {6, 1}, {7, 2}, {9, 1}}) {
          const Tensor x = tokens.narrow(1, start, n).contiguous();
          const std::vector<float> want = m.forward(x, contiguous).output.to_vector();
          const std::vector<float> got = m.forward(x, paged).output.to_vector();
          ASSERT_EQ(got.size(), want.size());
          for (size_t e = 0; e < want.size(); ++e)
            ASSERT_NEAR(got[e], want[e], 1e-5) << what << " tokens " << start << "+" << n << " at " << e;
          EXPECT_EQ(paged.lengths(), contiguous.lengths()) << what;
        }
        EXPECT_EQ(paged.length(), 10);
        // Past the capacity: refused, nothing appended.
        EXPECT_THROW((void)m.forward(tokens.narrow(1, 0, 2).contiguous(), paged), qkv::Error);
        EXPECT_EQ(paged.length(), 10);
        const std::vector<int64_t> ids = paged.sequences();
        paged.reset();
        contiguous.reset();
        EXPECT_EQ(paged.length(), 0);
        EXPECT_EQ(paged.sequences(), ids) << "reset keeps the pool's sequences";
        EXPECT_EQ(paged.paged()->free_pages(), 2 * ((capacity + page_size - 1) / page_size)) << what;
      }
      try {
        (void)paged.keys(1);
        ADD_FAILURE() << "keys() of a paged cache";
      } catch (const qkv::Error& e) {
        EXPECT_NE(std::string(e.what()).find("read paged()"), std::string::npos) << e.what();
      }
      try {
        (void)m.forward(tokens.narrow(1, 0, 3).contiguous(), paged, {3, 1});
        ADD_FAILURE() << "counts on a paged cache";
      } catch (const qkv::Error& e) {
        EXPECT_NE(std::string(e.what()).find("no counts"), std::string::npos) << e.what();
      }
    }
  EXPECT_THROW(qkv::nn::KVCache(1, 2, 8, 6, DType::F32, 8, 4), qkv::Error);  // a ring is not paged
  // append on a paged KVCache directly, as on a contiguous one.
  qkv::nn::KVCache direct(2, kHeads, 9, kDim, DType::F32, 0, kPageSize);
  const Tensor k = rng.randn(Shape{2, kHeads, 3, kDim}), v = rng.randn(Shape{2, kHeads, 3, kDim});
  direct.append(k, v, {3, 2});
  EXPECT_EQ(direct.lengths(), (std::vector<int64_t>{3, 2}));
  expect_same(read_back(*direct.paged(), direct.sequences()[1], direct.paged()->key_pool()),
              k.narrow(0, 1, 1).squeeze(0).narrow(1, 0, 2).contiguous(), "element 1's keys");
}

}  // namespace

// A KVCache or PagedKVCache too large for the memory there is is refused by one check of the
// whole request (K, V and scales, which a memory limit counts, and the bookkeeping) before anything is
// allocated. Before it, a batch of 2^31 first filled 16 GiB of lengths (100 s, then a Tensor
// error), and 2^32 one-float pages passed each pool's own check (16 GiB each) into the memset.
// The sizes are past any machine's memory, so the refusals do not depend on this one's.
TEST(KVCache, RefusesWhatMemoryCannotHoldBeforeAllocating) {
  const int64_t held = qkv::memory_stats().current_bytes;
  qkv_test::expect_error([] { qkv::nn::KVCache(int64_t{1} << 31, 3, 17, 3); },
                         {"KVCache: batch 2147483648, kv_heads 3, capacity 17, head_dim 3 (f32) need", "bytes"});
  qkv_test::expect_error([] { qkv::nn::KVCache(int64_t{1} << 40, 1, 1, 1, DType::F32, 0, 1); },
                         {"KVCache: batch 1099511627776", "in 1 pages of 1 a sequence", "a smaller batch or capacity"});
  qkv_test::expect_error([] { qkv::nn::KVCache(2, 1, INT64_MAX, 2, DType::I4, 0, 1024); }, {"need", "with their scales"});
  qkv_test::expect_error([] { PagedKVCache(int64_t{1} << 44, 1, 1, 1); },
                         {"PagedKVCache: 17592186044416 pages of 1 positions, kv_heads 1, head_dim 1 (f32) need",
                          "fewer or smaller pages"});
  EXPECT_EQ(qkv::memory_stats().current_bytes, held);
  // Under a memory limit the same check counts the tensors the cache would hold, as the limit
  // does: 2 x (1, 2, 64, 8) floats, 8 KiB.
  struct NoLimitAfter {
    ~NoLimitAfter() { qkv::set_memory_limit(0); }
  } no_limit_after;
  qkv::set_memory_limit(held + 8191);
  qkv_test::expect_error([] { qkv::nn::KVCache(1, 2, 64, 8); }, {"need 8192 bytes (8192 bytes: K and V, and the bookkeeping; the limit counts the tensors only)", "the memory limit leaves"});
  qkv::set_memory_limit(held + 8192);
  EXPECT_NO_THROW(qkv::nn::KVCache(1, 2, 64, 8));
}
