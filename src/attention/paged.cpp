// Paged K/V (paged.hpp): the pools, the block table and the sequence lengths checked once, with
// messages naming the offending shapes and values; then each sequence runs the decode kernel on a
// problem whose K/V rows are found through its block-table row (AttentionProblem::paged), reading
// every page where it lies: no gather, no copy. A sequence's problem is built by build_problem
// like any call's (its K/V shape (1, Hkv, cache_seqlens[b], D) given by a stand-in over the pool
// that no kernel reads, its rows then bound to the pages), so its checks and normalisation are
// the library's own; its output rows and row statistics are views of the caller's, written in place.
#include "attention/paged.hpp"

#include <memory>
#include <string>
#include <vector>

#include "attention/kernels.hpp"  // decode_attention
#include "attention/problem.hpp"
#include "attention/summary/summary.hpp"  // clear_summary_outputs
#include "attention/varlen.hpp"           // check_sequence_options, sequence_options
#include "core/quantize.hpp"               // check_quantized
#include "qkv/error.hpp"

namespace qkv::detail {
namespace {

[[noreturn]] void fail(const char* who, const std::string& message) { throw Error(who + message); }

std::string entry(const char* name, int64_t b, int64_t at, int64_t value) {
  return std::string(name) + "[" + std::to_string(b) + (at >= 0 ? ", " + std::to_string(at) : "") +
         "] = " + std::to_string(value);
}

// The pool shapes: k (num_pages, page_size, Hkv, Dk) and v (num_pages, page_size, Hkv, Dv), float,
// 16-bit or quantized (int4 pools hold Dk / 2 bytes a row; options.k_scales / v_scales are then
// their scale pools, (num_pages, page_size, Hkv, groups), checked here once), last dims contiguous;
// q (B, Hq, Nq, Dk).
void check_pools(const char* who, const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o) {
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}})
    if (!t->defined()) fail(who, std::string(name) + " is undefined");
  if (q.dim() != 4) fail(who, "q is " + q.shape().str() + ": with block_table it must be (B, Hq, Nq, Dk)");
  for (auto [t, name, d] : {std::tuple{&k, "k", "Dk"}, {&v, "v", "Dv"}}) {
    if (t->dim() != 4)
      fail(who, std::string(name) + " is " + t->shape().str() + ": with block_table it must be a page pool (num_pages, "
                    "page_size, Hkv, " + d + ")");
    if (t->strides()[3] != 1 && t->size(3) > 1)
      fail(who, std::string(name) + " " + t->shape().str() + " has a strided last dim: a page pool's rows are read in place");
  }
  if (k.size(0) != v.size(0) || k.size(1) != v.size(1) || k.size(2) != v.size(2))
    fail(who, "k is " + k.shape().str() + " but v is " + v.shape().str() + ": they need the same (num_pages, page_size, Hkv)");
  const int64_t per_byte = k.dtype() == DType::I4 ? 2 : 1;  // int4: two values a byte
  if (k.size(3) * per_byte != q.size(3))
    fail(who, "q is " + q.shape().str() + " but k is " + k.shape().str() + " " + std::string(to_string(k.dtype())) +
                  ": head dims differ");
  if (k.size(1) < 1) fail(who, "k is " + k.shape().str() + ": page_size must be at least 1");
  if (is_quantized(k.dtype()) || is_quantized(v.dtype())) {
    if (v.dtype() != k.dtype())
      fail(who, "k is " + std::string(to_string(k.dtype())) + " but v is " + std::string(to_string(v.dtype())) +
                    ": quantized pools share one dtype");
    // The layout here; the scales' values page by page as a sequence reaches them (check_scales).
    check_quantized(who, "k", k, o.k_scales, q.size(3), /*scale_values=*/false);
    check_quantized(who, "v", v, o.v_scales, v.size(3) * per_byte, /*scale_values=*/false);
  } else if (o.k_scales.defined() || o.v_scales.defined()) {
    fail(who, "k_scales / v_scales are for int8 or int4 pools, but k is " + std::string(to_string(k.dtype())));
  }
}

// The scales of the pages sequence b's n keys reach (only those are read, as only their table
// entries are), each as check_quantized checks a contiguous cache's.
void check_scales(const char* who, const AttentionOptions& o, DType dtype, const int64_t* pages, int64_t n,
                  int64_t page_size) {
  if (!o.k_scales.defined()) return;
  for (int64_t page = 0; page < (n + page_size - 1) / page_size; ++page)
    for (auto [scales, name] : {std::pair{&o.k_scales, "k"}, {&o.v_scales, "v"}}) {
      // A page's scales, contiguous in a packed pool, are scanned in place (a Tensor per page
      // cost more than the scan: 1.4 x W4-int8's time at 64-key pages); the message comes from
      // check_scale_values, as do views whose pages are not contiguous.
      const int64_t per_page = scales->numel() / scales->size(0);
      const bool packed = scales->strides()[1] == scales->size(2) * scales->size(3) &&
                          scales->strides()[2] == scales->size(3);
      if (packed && scales_valid(static_cast<const float*>(scales->raw_view_data()) + pages[page] * scales->strides()[0],
                                 per_page, dtype))
        continue;
      check_scale_values(std::string(who) + name + " page " + std::to_string(pages[page]),
                         std::string(name) + "_scales", dtype, scales->narrow(0, pages[page], 1));
    }
}

// cache_seqlens (B) in [0, max_pages x page_size]; block_table B x max_pages, the entries each
// sequence's keys reach in [0, num_pages). Returns max_pages.
int64_t check_table(const char* who, const AttentionOptions& o, int64_t batch, int64_t num_pages, int64_t page_size) {
  const auto& lengths = o.cache_seqlens;
  const auto& table = o.block_table;
  if (lengths.empty() || table.empty())
    fail(who, "block_table has " + std::to_string(table.size()) + " entries and cache_seqlens " +
                  std::to_string(lengths.size()) + ": paged K/V need both");
  if (static_cast<int64_t>(lengths.size()) != batch)
    fail(who, "cache_seqlens has " + std::to_string(lengths.size()) + " entries but q's batch is " +
                  std::to_string(batch) + ": one length per sequence");
  if (static_cast<int64_t>(table.size()) % batch != 0)
    fail(who, "block_table has " + std::to_string(table.size()) + " entries, not a multiple of the batch " +
                  std::to_string(batch) + ": it is (B, max_pages) row-major");
  const int64_t max_pages = static_cast<int64_t>(table.size()) / batch;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = lengths[static_cast<size_t>(b)];
    if (n < 0 || n > max_pages * page_size)
      fail(who, entry("cache_seqlens", b, -1, n) + " is outside [0, " + std::to_string(max_pages * page_size) +
                    "] (max_pages " + std::to_string(max_pages) + " x page_size " + std::to_string(page_size) + ")");
    for (int64_t page = 0; page < (n + page_size - 1) / page_size; ++page) {
      const int64_t at = table[static_cast<size_t>(b * max_pages + page)];
      if (at < 0 || at >= num_pages)
        fail(who, entry("block_table", b, page, at) + " is outside [0, " + std::to_string(num_pages) +
                      ") (k has " + std::to_string(num_pages) + " pages); sequence " + std::to_string(b) + " holds " +
                      std::to_string(n) + " keys");
    }
  }
  return max_pages;
}

void check_paged_options(const char* who, const AttentionOptions& o, int64_t batch) {
  if (!o.cu_seqlens_q.empty() || !o.cu_seqlens_k.empty())
    fail(who, "cu_seqlens_q / cu_seqlens_k (a packed batch) are not taken with block_table / cache_seqlens");
  if (o.backend == Backend::Flash || o.backend == Backend::Reference)
    fail(who, "backend " + std::string(to_string(o.backend)) +
                  " does not read paged K/V: block_table runs the decode kernel (backend Auto or Decode)");
  AttentionOptions others = o;  // quantized pools are this file's to check (check_pools)
  others.k_scales = others.v_scales = Tensor();
  check_sequence_options(who, others, batch, "block_table / cache_seqlens");
}

// A (1, Hkv, n, D) tensor over the pool's first element, of its dtype: the shape build_problem
// checks and normalises a sequence's problem with. Never read: its rows are rebound to the pages
// (a scale pool's stand-in likewise: build_problem is told the scales were checked).
Tensor stand_in(const Tensor& pool, int64_t n) {
  if (!pool.defined()) return pool;
  return Tensor::from_blob(pool.raw_view_data(), Shape{1, pool.size(2), n, pool.size(3)}, pool.dtype(),
                           std::make_shared<Tensor>(pool));
}

// A pool's rows as the problem's K or V view (page 0, heads head_stride apart, rows row_stride).
template <class T>
Rows<const T> pool_rows(const Tensor& pool) {
  return {static_cast<const T*>(pool.raw_view_data()), 0, pool.strides()[2], pool.strides()[1]};
}

// Points a sequence's problem at its pages: b's block-table row, the pools' rows (and the scale
// pools' of quantized pools).
void bind_pages(AttentionProblem& p, const Tensor& k, const Tensor& v, const AttentionOptions& o,
                const int64_t* pages) {
  const int64_t page_size = k.size(1);
  int shift = -1;
  for (int s = 0; s < 63 && shift < 0; ++s)
    if ((int64_t{1} << s) == page_size) shift = s;
  p.paged = PagedKv{pages, page_size, shift, k.strides()[0], v.strides()[0], 0, 0};
  if (is_quantized(k.dtype())) {
    p.k_quant = pool_rows<uint8_t>(k);
    p.v_quant = pool_rows<uint8_t>(v);
    p.k_scales = pool_rows<float>(o.k_scales);
    p.v_scales = pool_rows<float>(o.v_scales);
    p.paged.k_scale_page_stride = o.k_scales.strides()[0];
    p.paged.v_scale_page_stride = o.v_scales.strides()[0];
  } else if (k.dtype() == DType::F32) {
    p.k = pool_rows<float>(k);
    p.v = pool_rows<float>(v);
  } else {
    p.k_bits = pool_rows<uint16_t>(k);
    p.v_bits = pool_rows<uint16_t>(v);
  }
}
}  // namespace

void paged_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                          const AttentionOptions& options) {
  const char* who = "scaled_dot_product_attention: ";
  check_pools(who, q, k, v, options);
  const int64_t batch = q.size(0), heads = q.size(1), nq = q.size(2);
  check_paged_options(who, options, batch);
  const int64_t max_pages = check_table(who, options, batch, k.size(0), k.size(1));
  if (is_quantized(k.dtype()))  // every sequence's scale pages, before any output is written
    for (int64_t b = 0; b < batch; ++b)
      check_scales(who, options, k.dtype(), options.block_table.data() + b * max_pages,
                   options.cache_seqlens[static_cast<size_t>(b)], k.size(1));
  const auto inputs = {&q, &k, &v};
  const int64_t dv = v.size(3) * (v.dtype() == DType::I4 ? 2 : 1);  // int4: two values a byte
  prepare_result(who, result.output, "result.output", Shape{batch, heads, nq, dv}, inputs, false);
  for (auto [t, name] : {std::pair{&result.lse, "result.lse"}, {&result.row_max, "result.row_max"},
                         {&result.row_sum, "result.row_sum"}})
    prepare_result(who, *t, name, Shape{batch, heads, nq}, inputs, true);
  result.weights = Tensor();
  clear_summary_outputs(result);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = options.cache_seqlens[static_cast<size_t>(b)];
    const Tensor qb = q.narrow(0, b, 1);
    AttentionOptions own = sequence_options(options, b);
    own.k_scales = stand_in(options.k_scales, n);
    own.v_scales = stand_in(options.v_scales, n);
    BuiltProblem built = build_problem(who, qb, stand_in(k, n), stand_in(v, n), own, ScaleValues::Checked);
    align_band_to_end(built.problem);  // query i at key position n - Nq + i
    AttentionResult part;
    part.output = result.output.narrow(0, b, 1);
    part.lse = result.lse.narrow(0, b, 1);
    part.row_max = result.row_max.narrow(0, b, 1);
    part.row_sum = result.row_sum.narrow(0, b, 1);
    bind_forward_outputs(built, part, false, qb, k, v);
    bind_pages(built.problem, k, v, options, options.block_table.data() + b * max_pages);
    decode_attention(built.problem);  // the pages' scales are checked above (ScaleValues::Checked)
  }
}

}  // namespace qkv::detail
