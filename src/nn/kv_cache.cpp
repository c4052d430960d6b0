// qkv::nn::KVCache (include/qkv/inference.hpp): preallocated per-layer keys and values, written
// in place by append() and read in place by attention through views of the storage.
#include <algorithm>
#include <cmath>
#include <string>

#include "core/allocator.hpp"  // check_request
#include "core/huge_pages.hpp"
#include "core/quantize.hpp"
#include "qkv/error.hpp"
#include "qkv/inference.hpp"
#include "qkv/paged_cache.hpp"

namespace qkv::nn {

namespace {
constexpr const char* kWho = "KVCache: ";

std::string str(int64_t n) { return std::to_string(n); }
}  // namespace

KVCache::KVCache(int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, DType dtype, int64_t window,
                 int64_t page_size)
    : batch_(batch), kv_heads_(kv_heads), capacity_(capacity), head_dim_(head_dim), window_(window), dtype_(dtype) {
  if (batch < 1 || kv_heads < 1 || head_dim < 1 || capacity < 1)
    throw Error(std::string(kWho) + "batch (" + str(batch) + "), kv_heads (" + str(kv_heads) + "), capacity (" +
                str(capacity) + ") and head_dim (" + str(head_dim) + ") must be at least 1");
  if (window < 0) throw Error(std::string(kWho) + "window must be >= 0 (0: no ring buffer), got " + str(window));
  if (page_size < 0) throw Error(std::string(kWho) + "page_size must be >= 0 (0: contiguous), got " + str(page_size));
  if (page_size > 0 && window > 0)
    throw Error(std::string(kWho) + "window " + str(window) + " is a ring buffer; a paged cache (page_size " +
                str(page_size) + ") has none");
  if (window > 0 && capacity != window)
    throw Error(std::string(kWho) + "a ring buffer holds exactly its window: capacity " + str(capacity) +
                " but window " + str(window));
  if (dtype == DType::I4 && head_dim % 2 != 0)
    throw Error(std::string(kWho) + "an int4 cache packs two values a byte: head_dim " + str(head_dim) + " must be even");
  // The whole request against the memory there is, before anything is allocated: the lengths
  // (one per sequence) come first, and a batch of 2^31 made 16 GiB of them before the tensors'
  // own check refused the terabytes of K/V.
  const int64_t pages_each = page_size > 0 ? capacity / page_size + (capacity % page_size != 0 ? 1 : 0) : 0;
  const double positions = page_size > 0 ? static_cast<double>(pages_each) * static_cast<double>(page_size)
                                         : static_cast<double>(capacity);
  const double row_bytes = detail::kv_row_bytes(dtype, head_dim);
  // Per sequence: its length, or its id and page list; per page: a use count and a free-list slot.
  const double bookkeeping = 64.0 * static_cast<double>(batch) +
                             16.0 * static_cast<double>(batch) * static_cast<double>(pages_each);
  detail::check_request(kWho,
                        "batch " + str(batch) + ", kv_heads " + str(kv_heads) + ", capacity " + str(capacity) +
                            ", head_dim " + str(head_dim) + " (" + std::string(to_string(dtype)) + ")",
                        {2.0 * static_cast<double>(batch) * static_cast<double>(kv_heads) * positions * row_bytes,
                         bookkeeping},
                        std::string("K and V") + (is_quantized(dtype) ? " with their scales" : "") +
                            (page_size > 0 ? " in " + str(pages_each) + " pages of " + str(page_size) + " a sequence" : "") +
                            ", and the bookkeeping",
                        "a smaller batch or capacity");
  if (page_size == 0) lengths_.assign(static_cast<size_t>(batch), 0);
  if (page_size > 0) {
    if (pages_each > INT64_MAX / batch)
      throw Error(std::string(kWho) + str(batch) + " x " + str(pages_each) + " pages overflow");
    paged_ = std::make_shared<PagedKVCache>(batch * pages_each, page_size, kv_heads, head_dim, dtype);
    for (int64_t b = 0; b < batch; ++b) sequences_.push_back(paged_->add_sequence());
    return;
  }
  const int64_t row = dtype == DType::I4 ? head_dim / 2 : head_dim;
  // Huge pages for K, V and their scales: every decode step streams all of them (docs/inference.md).
  keys_ = detail::zeros_on_huge_pages(Shape{batch, kv_heads, capacity, row}, dtype);
  values_ = detail::zeros_on_huge_pages(Shape{batch, kv_heads, capacity, row}, dtype);
  if (is_quantized(dtype)) {
    key_scales_ = detail::zeros_on_huge_pages(Shape{batch, kv_heads, capacity, quantized_groups(dtype, head_dim)},
                                              DType::F32);
    value_scales_ = detail::zeros_on_huge_pages(Shape{batch, kv_heads, capacity, quantized_groups(dtype, head_dim)},
                                                DType::F32);
  }
}

int64_t KVCache::page_size() const { return paged_ ? paged_->page_size() : 0; }

std::vector<int64_t> KVCache::lengths() const {
  if (!paged_) return lengths_;
  std::vector<int64_t> out;  // MultiHeadAttention appends to the pool directly
  for (int64_t s : sequences_) out.push_back(paged_->length(s));
  return out;
}

void KVCache::check_contiguous(const char* what) const {
  if (paged_)
    throw Error(std::string(kWho) + what + ": a paged cache (page_size " + str(page_size()) +
                ") keeps its keys and values in pages, not contiguous storage: read paged()");
}

int64_t KVCache::length() const {
  const std::vector<int64_t>& all = lengths();
  return all.empty() ? 0 : *std::max_element(all.begin(), all.end());
}

int64_t KVCache::length(int64_t b) const {
  if (b < 0 || b >= batch_) throw Error(std::string(kWho) + "batch element " + str(b) + " of " + str(batch_));
  return lengths()[static_cast<size_t>(b)];
}

void KVCache::reset() {
  std::fill(lengths_.begin(), lengths_.end(), 0);
  if (paged_)
    for (int64_t s : sequences_) paged_->clear(s);  // the pages back to the pool, the ids kept
}

Tensor KVCache::keys(int64_t len) const {
  check_contiguous("keys()");
  if (len < 0 || len > capacity_)
    throw Error(std::string(kWho) + "keys(" + str(len) + ") of a cache with capacity " + str(capacity_));
  return keys_.narrow(2, 0, len);
}

Tensor KVCache::values(int64_t len) const {
  check_contiguous("values()");
  if (len < 0 || len > capacity_)
    throw Error(std::string(kWho) + "values(" + str(len) + ") of a cache with capacity " + str(capacity_));
  return values_.narrow(2, 0, len);
}

Tensor KVCache::key_scales(int64_t len) const {
  check_contiguous("key_scales()");
  return key_scales_.defined() ? key_scales_.narrow(2, 0, keys(len).size(2)) : Tensor(); }
Tensor KVCache::value_scales(int64_t len) const {
  check_contiguous("value_scales()");
  return value_scales_.defined() ? value_scales_.narrow(2, 0, values(len).size(2)) : Tensor();
}

void KVCache::append(const Tensor& k, const Tensor& v, const std::vector<int64_t>& counts) {
  if (!defined()) throw Error(std::string(kWho) + "append to an empty cache (construct it with its sizes)");
  const Shape expected_prefix{batch_, kv_heads_};
  for (const Tensor* t : {&k, &v}) {
    if (!t->defined() || t->dim() != 4 || t->size(0) != batch_ || t->size(1) != kv_heads_ || t->size(3) != head_dim_)
      throw Error(std::string(kWho) + "append: " + (t == &k ? "k" : "v") + " is " +
                  (t->defined() ? t->shape().str() : std::string("undefined")) + " but the cache holds (" + str(batch_) +
                  ", " + str(kv_heads_) + ", N, " + str(head_dim_) + ")");
    if (t->dtype() != DType::F32 && (t->dtype() != dtype_ || is_quantized(dtype_)))
      throw Error(std::string(kWho) + "append: k/v are " + std::string(to_string(t->dtype())) +
                  " but the cache stores " + std::string(to_string(dtype_)) + " (give f32 or " +
                  std::string(to_string(dtype_)) + ")");
  }
  if (k.size(2) != v.size(2))
    throw Error(std::string(kWho) + "append: k is " + k.shape().str() + " but v is " + v.shape().str());
  const int64_t n = k.size(2);
  std::vector<int64_t> count = counts.empty() ? std::vector<int64_t>(static_cast<size_t>(batch_), n) : counts;
  if (static_cast<int64_t>(count.size()) != batch_)
    throw Error(std::string(kWho) + "append: " + str(static_cast<int64_t>(count.size())) + " counts for a batch of " +
                str(batch_));
  const std::vector<int64_t> held = lengths();
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t c = count[static_cast<size_t>(b)];
    if (c < 0 || c > n)
      throw Error(std::string(kWho) + "append: count[" + str(b) + "] = " + str(c) + " is outside [0, " + str(n) + "]");
    if (window_ == 0 && held[static_cast<size_t>(b)] + c > capacity_)
      throw Error(std::string(kWho) + "append: batch element " + str(b) + " holds " + str(held[static_cast<size_t>(b)]) +
                  " positions; " + str(c) + " more exceed the capacity " + str(capacity_) +
                  " (make a larger cache, or a ring buffer with a window)");
  }
  if (paged_) {
    // Each element's rows to its sequence (pages taken as needed: the pool holds each sequence's
    // capacity, checked above); a quantized pool's rows all checked finite first, so that a throw
    // leaves every sequence as it was.
    if (is_quantized(dtype_)) check_finite(k, v, count);
    int64_t needed = 0;  // more than the pool's own when forks of its sequences hold pages
    for (int64_t b = 0; b < batch_; ++b)
      needed += paged_->pages_needed(sequences_[static_cast<size_t>(b)], count[static_cast<size_t>(b)]);
    if (needed > paged_->free_pages())
      throw Error(std::string(kWho) + "append: the batch needs " + str(needed) + " free pages but the pool has " +
                  str(paged_->free_pages()) + " (its sequences were forked)");
    for (int64_t b = 0; b < batch_; ++b) {
      const int64_t c = count[static_cast<size_t>(b)];
      if (c > 0)
        paged_->append(sequences_[static_cast<size_t>(b)], k.narrow(0, b, 1).squeeze(0).narrow(1, 0, c),
                       v.narrow(0, b, 1).squeeze(0).narrow(1, 0, c));
    }
    return;
  }
  // Row by row: source rows through their strides (last dim contiguous), converted to the
  // cache's dtype (or quantized, every row checked finite first) as they are written.
  if (is_quantized(dtype_)) return append_quantized(k, v, count);
  const size_t dim = static_cast<size_t>(head_dim_), bytes = element_size(dtype_);
  for (const auto& [source_tensor, storage] : {std::pair{&k, &keys_}, std::pair{&v, &values_}}) {
    const Tensor source = source_tensor->strides()[3] == 1 ? *source_tensor : source_tensor->contiguous();
    const auto* base = static_cast<const std::byte*>(source.raw_view_data());
    const size_t source_bytes = element_size(source.dtype());
    const auto& st = source.strides();
    auto* target = static_cast<std::byte*>(storage->raw_data());
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t h = 0; h < kv_heads_; ++h)
        for (int64_t t = 0; t < count[static_cast<size_t>(b)]; ++t) {
          const int64_t position = lengths_[static_cast<size_t>(b)] + t;
          const int64_t slot = window_ > 0 ? position % window_ : position;
          const std::byte* from = base + (b * st[0] + h * st[1] + t * st[2]) * static_cast<int64_t>(source_bytes);
          std::byte* to = target + (((b * kv_heads_ + h) * capacity_ + slot) * head_dim_) * static_cast<int64_t>(bytes);
          convert(from, source.dtype(), to, dtype_, dim);
        }
  }
  for (int64_t b = 0; b < batch_; ++b) lengths_[static_cast<size_t>(b)] += count[static_cast<size_t>(b)];
}

void KVCache::check_finite(const Tensor& k, const Tensor& v, const std::vector<int64_t>& count) const {
  const Tensor sources[2] = {k.contiguous(), v.contiguous()};
  const int64_t n = k.size(2);
  for (const Tensor& source : sources) {
    const float* data = source.data();
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t h = 0; h < kv_heads_; ++h)
        for (int64_t t = 0; t < count[static_cast<size_t>(b)]; ++t)
          for (int64_t d = 0; d < head_dim_; ++d)
            if (!std::isfinite(data[((b * kv_heads_ + h) * n + t) * head_dim_ + d]))
              throw Error(std::string(kWho) + "append: " + (&source == sources ? "k" : "v") + "[" + str(b) + ", " +
                          str(h) + ", " + str(t) + ", " + str(d) + "] is not finite: a quantized cache needs finite keys "
                          "and values");
  }
}

void KVCache::append_quantized(const Tensor& k, const Tensor& v, const std::vector<int64_t>& count) {
  check_finite(k, v, count);  // all finite before any row is written: a throw leaves the cache as it was
  const Tensor sources[2] = {k.contiguous(), v.contiguous()};
  const int64_t n = k.size(2);
  const int64_t row = keys_.size(3), groups = key_scales_.size(3);
  const Tensor* storage[2][2] = {{&keys_, &key_scales_}, {&values_, &value_scales_}};
  for (int which = 0; which < 2; ++which) {
    const float* data = sources[which].data();
    auto* values = static_cast<uint8_t*>(storage[which][0]->raw_data());
    float* scales = storage[which][1]->data();
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t h = 0; h < kv_heads_; ++h)
        for (int64_t t = 0; t < count[static_cast<size_t>(b)]; ++t) {
          const int64_t position = lengths_[static_cast<size_t>(b)] + t;
          const int64_t slot = (b * kv_heads_ + h) * capacity_ + (window_ > 0 ? position % window_ : position);
          detail::quantize_row(dtype_, data + ((b * kv_heads_ + h) * n + t) * head_dim_, head_dim_, values + slot * row,
                               scales + slot * groups);
        }
  }
  for (int64_t b = 0; b < batch_; ++b) lengths_[static_cast<size_t>(b)] += count[static_cast<size_t>(b)];
}

}  // namespace qkv::nn
