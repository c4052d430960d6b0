// Paged K/V (AttentionOptions::block_table / cache_seqlens): a paged call against each sequence's
// own call on the same keys and values laid out contiguously (backend Decode, or Reference for the
// one-query calls decode reads page-major; the mask aligned to the end of the sequence's keys), with pages in shuffled pool order, pages shared between
// sequences (a common prefix), pool pages no sequence uses filled with NaN (a page read that
// should not be fails), unused block-table entries -1, empty and one-key sequences, more queries
// than keys, GQA and odd dims, page sizes 1, 16, 64 and odd ones, f32 / bf16 / f16 K/V, every mask
// kind a per-sequence call takes and the modifiers, on every SIMD target and 1 and 2 threads,
// outputs poisoned with NaN; and the refusals of bad tables and options.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"
#include "harness/sequence_cases.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::Backend;
using qkv::DType;
using qkv::Mask;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr int64_t kQHeads = 6, kKvHeads = 2, kDk = 19, kDv = 9;  // GQA groups of 3, odd dims

// A paged batch: each sequence's keys and values contiguous (1, Hkv, n, D), the same rows in the
// pools (num_pages, page_size, Hkv, D) through the block table (B x max_pages), and q (B, Hq, Nq, Dk).
struct Paged {
  int64_t page_size = 0, max_pages = 0;
  std::vector<int64_t> lengths, table;
  std::vector<Tensor> k_seq, v_seq;
  Tensor k_pool, v_pool, q;
  int64_t batch() const { return static_cast<int64_t>(lengths.size()); }
};

int64_t pages_for(int64_t n, int64_t page_size) { return (n + page_size - 1) / page_size; }

// Sequences of `lengths` keys; sequence 1 shares sequence 0's whole first pages (a common prefix);
// every other page is its own, all dealt to shuffled pool slots, two spare slots left NaN.
Paged random_paged(Random& rng, int64_t page_size, const std::vector<int64_t>& lengths, int64_t nq,
                   int64_t dk = kDk, int64_t dv = kDv, int64_t q_heads = kQHeads) {
  Paged p;
  p.page_size = page_size;
  p.lengths = lengths;
  for (int64_t n : lengths) p.max_pages = std::max(p.max_pages, pages_for(n, page_size) + 1);  // a spare column
  const int64_t batch = p.batch();
  const int64_t shared = std::min(lengths[0], lengths[1]) / page_size;  // whole pages of sequence 0
  int64_t needed = 0;
  for (int64_t b = 0; b < batch; ++b) needed += pages_for(lengths[b], page_size) - (b == 1 ? shared : 0);
  const int64_t num_pages = needed + 2;
  std::vector<int64_t> slots(static_cast<size_t>(num_pages));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937_64(rng.next_u64()));
  p.table.assign(static_cast<size_t>(batch * p.max_pages), -1);
  size_t next = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t page = 0; page < pages_for(lengths[b], page_size); ++page)
      p.table[b * p.max_pages + page] = b == 1 && page < shared ? p.table[page] : slots[next++];
  p.k_pool = Tensor::full(Shape{num_pages, page_size, kKvHeads, dk}, kNaN);
  p.v_pool = Tensor::full(Shape{num_pages, page_size, kKvHeads, dv}, kNaN);
  for (int64_t b = 0; b < batch; ++b) {
    Tensor k = rng.randn(Shape{1, kKvHeads, lengths[b], dk}), v = rng.randn(Shape{1, kKvHeads, lengths[b], dv});
    for (int64_t j = 0; j < lengths[b]; ++j) {
      const int64_t page = p.table[b * p.max_pages + j / page_size], row = j % page_size;
      for (int64_t h = 0; h < kKvHeads; ++h) {
        for (int64_t d = 0; d < dk; ++d) {
          float& pooled = p.k_pool.at({page, row, h, d});
          if (b == 1 && j < shared * page_size) k.at({0, h, j, d}) = pooled;  // the shared prefix
          pooled = k.at({0, h, j, d});
        }
        for (int64_t d = 0; d < dv; ++d) {
          float& pooled = p.v_pool.at({page, row, h, d});
          if (b == 1 && j < shared * page_size) v.at({0, h, j, d}) = pooled;
          pooled = v.at({0, h, j, d});
        }
      }
    }
    p.k_seq.push_back(k);
    p.v_seq.push_back(v);
  }
  p.q = rng.randn(Shape{batch, q_heads, nq, dk});
  return p;
}

using MaskCase = qkv_test::SequenceMask;
using qkv_test::expect_error;
std::vector<MaskCase> mask_cases() { return qkv_test::sequence_masks(); }

// Paged and contiguous tiles end at different keys (a tile stops at a page's end), so the online
// softmax rounds differently: a few float32 ulps of outputs of size ~1.
constexpr double kTolerance = 2e-5;

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t x = 0; x < got.size(); ++x) {
    if (std::isinf(want[x]) && got[x] == want[x]) continue;  // lse -inf: no key seen
    if (!(std::abs(got[x] - want[x]) <= kTolerance * std::max(1.0f, std::abs(want[x]))))
      FAIL() << what << " differs at " << x << ": paged " << got[x] << ", contiguous " << want[x];
  }
}

// The paged call, into NaN-poisoned results, against each sequence's own contiguous call on
// `backend` (Decode, or the Reference kernel).
void check_against_contiguous(const Paged& p, AttentionOptions paged, const MaskCase& mask, DType dtype,
                              Backend backend = Backend::Decode) {
  paged.block_table = p.table;
  paged.cache_seqlens = p.lengths;
  const int64_t nq = p.q.size(2);
  qkv::AttentionResult r;
  const int64_t q_heads = p.q.size(1);
  r.output = Tensor::full(Shape{p.batch(), q_heads, nq, kDv}, kNaN);
  for (Tensor* t : {&r.lse, &r.row_max, &r.row_sum}) *t = Tensor::full(Shape{p.batch(), q_heads, nq}, kNaN);
  qkv::scaled_dot_product_attention_into(p.q, p.k_pool.to(dtype), p.v_pool.to(dtype), r, paged);
  for (int64_t b = 0; b < p.batch(); ++b) {
    const int64_t n = p.lengths[b];
    SCOPED_TRACE("sequence " + std::to_string(b) + ": Nk=" + std::to_string(n));
    AttentionOptions o = paged;
    o.block_table.clear();
    o.cache_seqlens.clear();
    o.backend = backend;
    o.mask = mask.alone(n - nq);
    if (paged.alibi_slopes.defined() && paged.alibi_slopes.dim() == 2)
      o.alibi_slopes = paged.alibi_slopes.narrow(0, b, 1).squeeze(0).contiguous();
    o.seed = paged.seed + static_cast<uint64_t>(b);
    const qkv::AttentionResult alone = qkv::scaled_dot_product_attention(
        p.q.narrow(0, b, 1).contiguous(), p.k_seq[b].to(dtype), p.v_seq[b].to(dtype), o);
    expect_close(r.output.narrow(0, b, 1).contiguous().to_vector(), alone.output.to_vector(), "output");
    expect_close(r.lse.narrow(0, b, 1).contiguous().to_vector(), alone.lse.to_vector(), "lse");
  }
}

void set_modifiers(AttentionOptions& o, int64_t batch, Random& rng, int64_t q_heads = kQHeads) {
  o.softcap = static_cast<float>(rng.uniform(0.5, 5.0));
  o.alibi_slopes = rng.uniform_tensor(Shape{batch, q_heads}, 0.0, 0.5);
  o.sinks = rng.uniform_tensor(Shape{q_heads}, -3.0, 3.0);
}

// Sequence lengths: a shared prefix (0 and 1), an empty cache, one key, lengths across decode's
// tiles (64) and chunks (512 f32 keys).
const std::vector<int64_t> kLengths = {70, 150, 0, 1, 37, 600};

TEST(Paged, EveryMaskAgainstContiguousKeys) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (int64_t page_size : {1, 16, 64, 7, 33}) {
    for (int64_t nq : {1, 5}) {
      SCOPED_TRACE("page_size " + std::to_string(page_size) + ", Nq " + std::to_string(nq));
      const Paged p = random_paged(rng, page_size, kLengths, nq);
      qkv_test::on_every_target_and_thread_count([&] {
        for (const MaskCase& mask : mask_cases())
          for (bool modifiers : {false, true}) {
            SCOPED_TRACE("mask " + mask.name + (modifiers ? " with softcap, (B, Hq) ALiBi, sinks" : ""));
            AttentionOptions o;
            o.mask = mask.whole;
            if (modifiers) set_modifiers(o, p.batch(), rng);
            check_against_contiguous(p, o, mask, DType::F32);
          }
      });
    }
  }
}

TEST(Paged, SixteenBitPagesHeadAlibiAndDropout) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const MaskCase causal = mask_cases()[1];
  for (int64_t page_size : {16, 5, 64}) {
    SCOPED_TRACE("page_size " + std::to_string(page_size));
    const Paged p = random_paged(rng, page_size, kLengths, 3);
    qkv_test::on_every_target_and_thread_count([&] {
      for (DType dtype : {DType::BF16, DType::F16, DType::F32}) {
        SCOPED_TRACE("K/V " + std::string(qkv::to_string(dtype)));
        AttentionOptions o;
        o.mask = causal.whole;
        set_modifiers(o, p.batch(), rng);
        check_against_contiguous(p, o, causal, dtype);
        o = AttentionOptions();
        o.mask = causal.whole;
        o.alibi_slopes = rng.uniform_tensor(Shape{kQHeads}, 0.0, 0.5);
        o.dropout_p = 0.25f;
        o.seed = rng.next_u64();
        check_against_contiguous(p, o, causal, dtype);
      }
    });
  }
}

// One query per sequence, float or 16-bit pages, no rule, term or dropout: the decode items
// that read a page's rows of every head together (decode/page_major-inl.h; which problems take
// them: attention/test_decode.cpp, Decode.PagedProblemsThatFitReadPageMajor), against the
// Reference kernel on each sequence's contiguous keys. Sequences over several of their chunks
// (512 float keys, 1024 16-bit ones), within one, empty and of one key; page sizes that cut the
// key blocks (1, 7) and whole tiles (64); the masks a one-query sequence sees as a key range,
// with and without softcap, (B, Hq) ALiBi and sinks; 6 query heads, and 40 (GQA groups of 20:
// more rows than the (b, g, chunk) items' row block; f32 with the modifiers); on every target, 1
// and 2 threads.
TEST(Paged, OneQueryPageMajorAgainstTheReference) {
  Random rng;
  SCOPED_TRACE(rng.note());
  std::vector<MaskCase> masks;
  for (const MaskCase& mask : mask_cases())
    if (mask.name.find("strided") == std::string::npos && mask.name.find("global") == std::string::npos)
      masks.push_back(mask);
  ASSERT_GE(masks.size(), 5u);
  for (auto [page_size, q_heads] : {std::pair<int64_t, int64_t>{1, kQHeads}, {7, kQHeads}, {64, kQHeads}, {7, 40}}) {
    SCOPED_TRACE("page_size " + std::to_string(page_size) + ", " + std::to_string(q_heads) + " query heads");
    const Paged p = q_heads == kQHeads ? random_paged(rng, page_size, {1100, 600, 0, 1, 300}, 1)
                                       : random_paged(rng, page_size, {1100, 300}, 1, kDk, kDv, q_heads);
    // The 40-head pool (the larger scratch) on f32 with the modifiers only: the test's cost under
    // the sanitizers.
    const bool wide = q_heads != kQHeads;
    qkv_test::on_every_target_and_thread_count([&] {
      for (DType dtype : {DType::F32, DType::BF16, DType::F16})
        for (const MaskCase& mask : masks)
          for (bool modifiers : {false, true}) {
            if (wide && (dtype != DType::F32 || !modifiers)) continue;
            SCOPED_TRACE("K/V " + std::string(qkv::to_string(dtype)) + ", mask " + mask.name +
                         (modifiers ? " with softcap, (B, Hq) ALiBi, sinks" : ""));
            AttentionOptions o;
            o.mask = mask.whole;
            if (modifiers) set_modifiers(o, p.batch(), rng, q_heads);
            check_against_contiguous(p, o, mask, dtype, Backend::Reference);
          }
    });
  }
}

// int8 and int4 pools (qkv::quantize_kv of the pools, scales paged with their rows), two queries
// and one (int8's then read page-major, decode/page_major-inl.h: on 1 thread every sequence, on 2
// the 2500-key one), against each
// sequence's own contiguous call on the same quantized rows (a row's bytes and scales do not
// depend on where it lies): shared and shuffled pages, page sizes that cut decode's tiles, a
// sequence over several of decode's chunks (2048 quantized keys), GQA, int4 with a partial last
// group (Dk 48: 32 + 16) and whole groups (Dv 64). The pool pages no sequence uses get NaN scales:
// only the pages a sequence reaches are checked and read, so a stray read shows as NaN.
TEST(Paged, QuantizedPagesAgainstContiguousQuantizedKeys) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const MaskCase causal = mask_cases()[1];
  for (int64_t page_size : {16, 5}) {
    for (auto [dtype, nq] : {std::pair{DType::I8, 2}, {DType::I8, 1}, {DType::I4, 2}, {DType::I4, 1}}) {
      SCOPED_TRACE("page_size " + std::to_string(page_size) + ", " + std::string(qkv::to_string(dtype)) + ", Nq " +
                   std::to_string(nq));
      const Paged p = random_paged(rng, page_size, {70, 150, 0, 1, 37, 2500}, nq, 48, 64);
      const auto finite = [](const Tensor& pool) {  // the spare pages' NaN rows cannot be quantized
        std::vector<float> x = pool.to_vector();
        for (float& e : x) e = std::isnan(e) ? 0.0f : e;
        return Tensor::from(std::move(x), pool.shape());
      };
      const qkv::QuantizedTensor kq = qkv::quantize_kv(finite(p.k_pool), dtype),
                                 vq = qkv::quantize_kv(finite(p.v_pool), dtype);
      for (int64_t page = 0; page < kq.scales.size(0); ++page)
        if (std::find(p.table.begin(), p.table.end(), page) == p.table.end())
          for (const Tensor& scales : {kq.scales, vq.scales}) {
            const Tensor spare = scales.narrow(0, page, 1);
            std::fill_n(spare.data(), spare.numel(), kNaN);
          }
      qkv_test::on_every_target_and_thread_count([&] {
        for (bool modifiers : {false, true}) {
          AttentionOptions o;
          o.mask = causal.whole;
          if (modifiers) set_modifiers(o, p.batch(), rng);
          o.block_table = p.table;
          o.cache_seqlens = p.lengths;
          o.k_scales = kq.scales;
          o.v_scales = vq.scales;
          qkv::AttentionResult r;
          r.output = Tensor::full(Shape{p.batch(), kQHeads, nq, 64}, kNaN);
          r.lse = Tensor::full(Shape{p.batch(), kQHeads, nq}, kNaN);
          qkv::scaled_dot_product_attention_into(p.q, kq.values, vq.values, r, o);
          for (int64_t b = 0; b < p.batch(); ++b) {
            const int64_t n = p.lengths[b];
            SCOPED_TRACE("sequence " + std::to_string(b) + ": Nk=" + std::to_string(n));
            const qkv::QuantizedTensor ks = qkv::quantize_kv(p.k_seq[b], dtype), vs = qkv::quantize_kv(p.v_seq[b], dtype);
            AttentionOptions alone = o;
            alone.block_table.clear();
            alone.cache_seqlens.clear();
            alone.backend = Backend::Decode;
            alone.mask = causal.alone(n - nq);
            alone.k_scales = ks.scales;
            alone.v_scales = vs.scales;
            if (o.alibi_slopes.defined()) alone.alibi_slopes = o.alibi_slopes.narrow(0, b, 1).squeeze(0).contiguous();
            const qkv::AttentionResult want =
                qkv::scaled_dot_product_attention(p.q.narrow(0, b, 1).contiguous(), ks.values, vs.values, alone);
            expect_close(r.output.narrow(0, b, 1).contiguous().to_vector(), want.output.to_vector(), "output");
            expect_close(r.lse.narrow(0, b, 1).contiguous().to_vector(), want.lse.to_vector(), "lse");
          }
        }
      });
      // A bad scale on a page a sequence reaches is named, before any output is written.
      const int64_t reached = p.table[0];
      const float saved = kq.scales.narrow(0, reached, 1).data()[3];
      kq.scales.narrow(0, reached, 1).data()[3] = -1.0f;
      AttentionOptions o;
      o.block_table = p.table;
      o.cache_seqlens = p.lengths;
      o.k_scales = kq.scales;
      o.v_scales = vq.scales;
      expect_error([&] { qkv::scaled_dot_product_attention(p.q, kq.values, vq.values, o); },
                   {("k page " + std::to_string(reached)).c_str(), "k_scales has -1"});
      kq.scales.narrow(0, reached, 1).data()[3] = saved;
    }
  }
}

// Prefill with a cache: more queries than a sequence's keys (the first queries see nothing and
// get zeros and lse -inf, as the contiguous call's), and rows (Hq x Nq) past decode's row block.
TEST(Paged, PrefillWithACache) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (int64_t nq : {9, 40}) {
    SCOPED_TRACE("Nq " + std::to_string(nq));
    const Paged p = random_paged(rng, 16, {20, 40, 3, 700}, nq);
    qkv_test::on_every_target_and_thread_count([&] {
      for (int mask : {0, 1, 4}) {  // none, causal, window(4)
        AttentionOptions o;
        o.mask = mask_cases()[mask].whole;
        check_against_contiguous(p, o, mask_cases()[mask], DType::F32);
      }
    });
  }
}

TEST(Paged, BadTablesAndOptionsAreNamed) {
  Random rng;
  const Paged p = random_paged(rng, 8, {10, 20}, 1);  // pages: 2 + 3 (one shared) = 4, + 2 spare
  const auto forward = [&](const AttentionOptions& o, const Tensor& q, const Tensor& k, const Tensor& v) {
    return [=] { qkv::scaled_dot_product_attention(q, k, v, o); };
  };
  AttentionOptions good;
  good.block_table = p.table;
  good.cache_seqlens = p.lengths;
  const auto with = [&](const std::function<void(AttentionOptions&)>& change) {
    AttentionOptions o = good;
    change(o);
    return forward(o, p.q, p.k_pool, p.v_pool);
  };
  EXPECT_NO_THROW(with([](AttentionOptions&) {})());
  expect_error(with([](AttentionOptions& o) { o.block_table[1] = 6; }), {"block_table[0, 1] = 6", "[0, 6)"});
  expect_error(with([&](AttentionOptions& o) { o.block_table[p.max_pages] = -1; }), {"block_table[1, 0] = -1"});
  expect_error(with([](AttentionOptions& o) { o.cache_seqlens[1] = 33; }), {"cache_seqlens[1] = 33", "[0, 32]"});
  expect_error(with([](AttentionOptions& o) { o.cache_seqlens[0] = -1; }), {"cache_seqlens[0] = -1"});
  expect_error(with([](AttentionOptions& o) { o.cache_seqlens.pop_back(); }), {"cache_seqlens has 1 entries", "batch is 2"});
  expect_error(with([](AttentionOptions& o) { o.block_table.pop_back(); }), {"not a multiple of the batch 2"});
  expect_error(with([](AttentionOptions& o) { o.cache_seqlens.clear(); }), {"need both"});
  expect_error(with([](AttentionOptions& o) { o.need_weights = true; }), {"need_weights"});
  expect_error(with([](AttentionOptions& o) { o.backend = Backend::Flash; }), {"backend Flash", "decode"});
  expect_error(with([](AttentionOptions& o) { o.mask = Mask::key_lengths({3, 4}); }), {"key_lengths"});
  expect_error(with([&](AttentionOptions& o) { o.mask = Mask::keep(Tensor::full(Shape{1, 10}, 1.0f)); }),
               {"tensor mask"});
  expect_error(with([](AttentionOptions& o) { o.score_mod = "s * 2"; }), {"score or mask function"});
  expect_error(with([](AttentionOptions& o) { o.cu_seqlens_q = o.cu_seqlens_k = {0, 1, 2}; }), {"cu_seqlens"});
  expect_error(forward(good, p.q.narrow(0, 0, 1), p.k_pool, p.v_pool), {"cache_seqlens has 2 entries"});
  expect_error(forward(good, p.q.narrow(3, 0, 5), p.k_pool, p.v_pool), {"head dims differ"});
  expect_error(forward(good, p.q, p.k_pool.narrow(0, 0, 1).squeeze(0), p.v_pool), {"page pool"});
  expect_error(forward(good, p.q, p.k_pool, p.v_pool.narrow(1, 0, 4)), {"same (num_pages, page_size, Hkv)"});
  const qkv::QuantizedTensor kq = qkv::quantize_kv(Tensor::zeros(p.k_pool.shape()), DType::I8),
                             vq = qkv::quantize_kv(Tensor::zeros(p.v_pool.shape()), DType::I8);
  expect_error(forward(good, p.q, kq.values, vq.values), {"k (6, 8, 2, 19) int8 needs k_scales"});
  AttentionOptions scaled = good;
  scaled.k_scales = kq.scales;
  scaled.v_scales = vq.scales.narrow(0, 0, 5);  // a scale pool of fewer pages than its values
  const auto forward_scaled = [&] { qkv::scaled_dot_product_attention(p.q, kq.values, vq.values, scaled); };
  expect_error(forward_scaled, {"v_scales is (5, 8, 2, 1) but should be (6, 8, 2, 1)"});
  scaled.v_scales = vq.scales;
  expect_error([&] { qkv::scaled_dot_product_attention(p.q, kq.values, p.v_pool, scaled); }, {"int8 but v is f32"});
  expect_error([&] {
    const qkv::AttentionResult r = qkv::scaled_dot_product_attention(p.q, p.k_pool, p.v_pool, good);
    qkv::scaled_dot_product_attention_backward(r.output, p.q, p.k_pool, p.v_pool, r, good);
  }, {"forward only"});
}

}  // namespace
