// qkv::nn::PagedKVCache (include/qkv/paged_cache.hpp): a page pool, its free list and reference
// counts, and each sequence's page list; append writes rows into the pool, copying a shared last
// page first. Attention reads the pool in place (src/attention/paged.cpp).
#include "qkv/paged_cache.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/allocator.hpp"  // check_request
#include "core/huge_pages.hpp"
#include "core/quantize.hpp"  // quantize_row, kv_row_bytes
#include "qkv/error.hpp"

namespace qkv::nn {
namespace {
constexpr const char* kWho = "PagedKVCache: ";
std::string str(int64_t n) { return std::to_string(n); }
[[noreturn]] void fail(const std::string& message) { throw Error(kWho + message); }
}  // namespace

PagedKVCache::PagedKVCache(int64_t num_pages, int64_t page_size, int64_t kv_heads, int64_t head_dim, DType dtype)
    : page_size_(page_size), kv_heads_(kv_heads), head_dim_(head_dim) {
  if (num_pages < 1 || page_size < 1 || kv_heads < 1 || head_dim < 1)
    fail("num_pages (" + str(num_pages) + "), page_size (" + str(page_size) + "), kv_heads (" + str(kv_heads) +
         ") and head_dim (" + str(head_dim) + ") must be at least 1");
  if (dtype == DType::I4 && head_dim % 2 != 0)
    fail("an int4 pool packs two values a byte: head_dim " + str(head_dim) + " must be even");
  // The pools, their scales and a use count and free-list slot a page, against the memory there
  // is, before any is allocated: each tensor's own check alone let 2^32 one-float pages through
  // (16 GiB a pool) into the memset and the bookkeeping.
  const double pages = static_cast<double>(num_pages);
  detail::check_request(kWho,
                        str(num_pages) + " pages of " + str(page_size) + " positions, kv_heads " + str(kv_heads) +
                            ", head_dim " + str(head_dim) + " (" + std::string(to_string(dtype)) + ")",
                        {pages * 2.0 * static_cast<double>(page_size) * static_cast<double>(kv_heads) *
                             detail::kv_row_bytes(dtype, head_dim),
                         pages * 16.0},
                        std::string("the K and V pools") + (is_quantized(dtype) ? " with their scales" : "") +
                            " and a page's bookkeeping",
                        "fewer or smaller pages");
  const int64_t row = dtype == DType::I4 ? head_dim / 2 : head_dim;
  if (is_quantized(dtype))
    for (Tensor* scales : {&key_scales_, &value_scales_})
      *scales = detail::zeros_on_huge_pages(Shape{num_pages, page_size, kv_heads, quantized_groups(dtype, head_dim)},
                                            DType::F32);
  // Huge pages for the pools (and the scales above): attention reads a head's rows Hkv x
  // head_dim elements apart, a new 4 KB page per key (docs/inference.md).
  for (Tensor* pool : {&keys_, &values_})
    *pool = detail::zeros_on_huge_pages(Shape{num_pages, page_size, kv_heads, row}, dtype);
  counts_.assign(static_cast<size_t>(num_pages), 0);
  for (int64_t page = num_pages - 1; page >= 0; --page) free_.push_back(page);  // page 0 taken first
}

PagedKVCache::Sequence& PagedKVCache::live(int64_t sequence, const char* what) {
  if (sequence < 0 || sequence >= static_cast<int64_t>(sequences_.size()) || !sequences_[static_cast<size_t>(sequence)].live)
    fail(std::string(what) + ": sequence " + str(sequence) + " is not a live sequence (ids 0 to " +
         str(static_cast<int64_t>(sequences_.size()) - 1) + ", released ones excluded)");
  return sequences_[static_cast<size_t>(sequence)];
}
const PagedKVCache::Sequence& PagedKVCache::live(int64_t sequence, const char* what) const {
  return const_cast<PagedKVCache*>(this)->live(sequence, what);
}

int64_t PagedKVCache::add_sequence() {
  sequences_.push_back({{}, 0, true});
  return static_cast<int64_t>(sequences_.size()) - 1;
}

int64_t PagedKVCache::fork(int64_t parent) {
  Sequence child = live(parent, "fork");
  for (int64_t page : child.pages) ++counts_[static_cast<size_t>(page)];
  sequences_.push_back(std::move(child));
  return static_cast<int64_t>(sequences_.size()) - 1;
}

void PagedKVCache::release(int64_t sequence) {
  clear(sequence);
  live(sequence, "release").live = false;
}

void PagedKVCache::clear(int64_t sequence) {
  Sequence& s = live(sequence, "clear");
  for (int64_t page : s.pages)
    if (--counts_[static_cast<size_t>(page)] == 0) free_.push_back(page);
  s.pages.clear();
  s.length = 0;
}

int64_t PagedKVCache::take_page() {
  const int64_t page = free_.back();
  free_.pop_back();
  counts_[static_cast<size_t>(page)] = 1;
  return page;
}

// Rows [first, first + n) of from (kv_heads, N, head_dim) into slots [slot, slot + n) of `page`:
// converted to the pool's dtype, or quantized with their scales into `scales` (quantized pools).
void PagedKVCache::write_rows(const Tensor& from, const Tensor& pool, const Tensor& scales, int64_t page, int64_t slot,
                              int64_t n, int64_t first) const {
  const int64_t row_elements = pool.size(3);  // head_dim, or its bytes for int4
  auto* base = static_cast<std::byte*>(pool.raw_data());
  const auto* source = static_cast<const std::byte*>(from.raw_data());
  for (int64_t r = 0; r < n; ++r)
    for (int64_t h = 0; h < kv_heads_; ++h) {
      const std::byte* row = source + ((h * from.size(1) + first + r) * head_dim_) * element_size(from.dtype());
      const int64_t at = (page * page_size_ + slot + r) * kv_heads_ + h;
      if (is_quantized(pool.dtype())) {
        detail::quantize_row(pool.dtype(), reinterpret_cast<const float*>(row), head_dim_,
                             reinterpret_cast<uint8_t*>(base) + at * row_elements, scales.data() + at * scales.size(3));
      } else {
        std::byte* to = base + at * row_elements * static_cast<int64_t>(element_size(pool.dtype()));
        convert(row, from.dtype(), to, pool.dtype(), static_cast<size_t>(head_dim_));
      }
    }
}

int64_t PagedKVCache::pages_needed(int64_t sequence, int64_t n) const {
  const Sequence& s = live(sequence, "pages_needed");
  if (n < 0) fail("pages_needed: n = " + str(n) + " is negative");
  const int64_t room = static_cast<int64_t>(s.pages.size()) * page_size_ - s.length;
  const bool shared_last = room > 0 && n > 0 && counts_[static_cast<size_t>(s.pages.back())] > 1;
  return (std::max<int64_t>(0, n - room) + page_size_ - 1) / page_size_ + (shared_last ? 1 : 0);
}

void PagedKVCache::append(int64_t sequence, const Tensor& k, const Tensor& v) {
  Sequence& s = live(sequence, "append");
  for (auto [t, name] : {std::pair{&k, "k"}, {&v, "v"}}) {
    if (!t->defined() || t->dim() != 3 || t->size(0) != kv_heads_ || t->size(2) != head_dim_)
      fail(std::string(name) + " is " + (t->defined() ? t->shape().str() : std::string("undefined")) +
           " but should be (" + str(kv_heads_) + ", N, " + str(head_dim_) + ")");
    if (t->dtype() != DType::F32 && (t->dtype() != keys_.dtype() || is_quantized(t->dtype())))
      fail(std::string(name) + " is " + std::string(to_string(t->dtype())) + ": append takes f32 or the pool's " +
           std::string(to_string(keys_.dtype())) + (is_quantized(keys_.dtype()) ? " (quantized here: f32 only)" : ""));
  }
  if (v.size(1) != k.size(1)) fail("k is " + k.shape().str() + " but v is " + v.shape().str());
  const int64_t n = k.size(1), room = static_cast<int64_t>(s.pages.size()) * page_size_ - s.length;
  const bool shared_last = room > 0 && n > 0 && counts_[static_cast<size_t>(s.pages.back())] > 1;
  const int64_t needed = pages_needed(sequence, n);
  if (needed > free_pages())
    fail("appending " + str(n) + " positions to sequence " + str(sequence) + " (length " + str(s.length) +
         ") needs " + str(needed) + " free pages but the pool has " + str(free_pages()));
  const Tensor kc = k.contiguous(), vc = v.contiguous();
  if (is_quantized(keys_.dtype()))  // checked before anything is written: the cache stays as it was
    for (auto [t, name] : {std::pair{&kc, "k"}, {&vc, "v"}}) {
      const float* x = t->data();
      for (int64_t e = 0; e < t->numel(); ++e)
        if (!std::isfinite(x[e]))
          fail(std::string("append: ") + name + " " + t->shape().str() + " has " + std::to_string(x[e]) +
               " at flat index " + str(e) + ": a quantized pool needs finite keys and values");
    }
  if (shared_last) {  // copy on write: the sequence gets its own copy of the last page (and its scales)
    const int64_t old = s.pages.back(), copy = take_page();
    --counts_[static_cast<size_t>(old)];
    for (const Tensor* pool : {&keys_, &values_, &key_scales_, &value_scales_}) {
      if (!pool->defined()) continue;
      const size_t bytes = static_cast<size_t>(pool->numel() / pool->size(0)) * element_size(pool->dtype());
      auto* base = static_cast<std::byte*>(pool->raw_data());
      std::memcpy(base + copy * bytes, base + old * bytes, bytes);
    }
    s.pages.back() = copy;
  }
  for (int64_t done = 0; done < n;) {
    if (s.length == static_cast<int64_t>(s.pages.size()) * page_size_) s.pages.push_back(take_page());
    const int64_t slot = s.length % page_size_, rows = std::min(n - done, page_size_ - slot);
    write_rows(kc, keys_, key_scales_, s.pages.back(), slot, rows, done);
    write_rows(vc, values_, value_scales_, s.pages.back(), slot, rows, done);
    s.length += rows;
    done += rows;
  }
}

int64_t PagedKVCache::length(int64_t sequence) const { return live(sequence, "length").length; }

const std::vector<int64_t>& PagedKVCache::pages(int64_t sequence) const { return live(sequence, "pages").pages; }

int64_t PagedKVCache::references(int64_t page) const {
  if (page < 0 || page >= static_cast<int64_t>(counts_.size()))
    fail("page " + str(page) + " is outside [0, " + str(static_cast<int64_t>(counts_.size())) + ")");
  return counts_[static_cast<size_t>(page)];
}

void PagedKVCache::set_paged_options(const std::vector<int64_t>& sequences, AttentionOptions& options) const {
  size_t width = 1;
  for (int64_t id : sequences) width = std::max(width, live(id, "set_paged_options").pages.size());
  options.block_table.assign(sequences.size() * width, -1);
  options.cache_seqlens.clear();
  for (size_t b = 0; b < sequences.size(); ++b) {
    const Sequence& s = live(sequences[b], "set_paged_options");
    std::copy(s.pages.begin(), s.pages.end(), options.block_table.begin() + static_cast<std::ptrdiff_t>(b * width));
    options.cache_seqlens.push_back(s.length);
  }
  options.k_scales = key_scales_;
  options.v_scales = value_scales_;
}

}  // namespace qkv::nn
