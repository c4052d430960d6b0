// qkv::nn::KVCache (include/qkv/inference.hpp): preallocated per-layer keys and values, written
// in place by append() and read in place by attention through views of the storage.
#include <algorithm>
#include <string>

#include "qkv/error.hpp"
#include "qkv/inference.hpp"

namespace qkv::nn {

namespace {
constexpr const char* kWho = "KVCache: ";

std::string str(int64_t n) { return std::to_string(n); }
}  // namespace

KVCache::KVCache(int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, DType dtype, int64_t window)
    : batch_(batch), kv_heads_(kv_heads), capacity_(capacity), head_dim_(head_dim), window_(window), dtype_(dtype) {
  if (batch < 1 || kv_heads < 1 || head_dim < 1 || capacity < 1)
    throw Error(std::string(kWho) + "batch (" + str(batch) + "), kv_heads (" + str(kv_heads) + "), capacity (" +
                str(capacity) + ") and head_dim (" + str(head_dim) + ") must be at least 1");
  if (window < 0) throw Error(std::string(kWho) + "window must be >= 0 (0: no ring buffer), got " + str(window));
  if (window > 0 && capacity != window)
    throw Error(std::string(kWho) + "a ring buffer holds exactly its window: capacity " + str(capacity) +
                " but window " + str(window));
  keys_ = Tensor::zeros(Shape{batch, kv_heads, capacity, head_dim}, dtype);
  values_ = Tensor::zeros(Shape{batch, kv_heads, capacity, head_dim}, dtype);
  lengths_.assign(static_cast<size_t>(batch), 0);
}

int64_t KVCache::length() const {
  return lengths_.empty() ? 0 : *std::max_element(lengths_.begin(), lengths_.end());
}

int64_t KVCache::length(int64_t b) const {
  if (b < 0 || b >= batch_) throw Error(std::string(kWho) + "batch element " + str(b) + " of " + str(batch_));
  return lengths_[static_cast<size_t>(b)];
}

void KVCache::reset() { std::fill(lengths_.begin(), lengths_.end(), 0); }

Tensor KVCache::keys(int64_t len) const {
  if (len < 0 || len > capacity_)
    throw Error(std::string(kWho) + "keys(" + str(len) + ") of a cache with capacity " + str(capacity_));
  return keys_.narrow(2, 0, len);
}

Tensor KVCache::values(int64_t len) const {
  if (len < 0 || len > capacity_)
    throw Error(std::string(kWho) + "values(" + str(len) + ") of a cache with capacity " + str(capacity_));
  return values_.narrow(2, 0, len);
}

void KVCache::append(const Tensor& k, const Tensor& v, const std::vector<int64_t>& counts) {
  if (!defined()) throw Error(std::string(kWho) + "append to an empty cache (construct it with its sizes)");
  const Shape expected_prefix{batch_, kv_heads_};
  for (const Tensor* t : {&k, &v}) {
    if (!t->defined() || t->dim() != 4 || t->size(0) != batch_ || t->size(1) != kv_heads_ || t->size(3) != head_dim_)
      throw Error(std::string(kWho) + "append: " + (t == &k ? "k" : "v") + " is " +
                  (t->defined() ? t->shape().str() : std::string("undefined")) + " but the cache holds (" + str(batch_) +
                  ", " + str(kv_heads_) + ", N, " + str(head_dim_) + ")");
    if (t->dtype() != DType::F32 && t->dtype() != dtype_)
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
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t c = count[static_cast<size_t>(b)];
    if (c < 0 || c > n)
      throw Error(std::string(kWho) + "append: count[" + str(b) + "] = " + str(c) + " is outside [0, " + str(n) + "]");
    if (window_ == 0 && lengths_[static_cast<size_t>(b)] + c > capacity_)
      throw Error(std::string(kWho) + "append: batch element " + str(b) + " holds " + str(lengths_[static_cast<size_t>(b)]) +
                  " positions; " + str(c) + " more exceed the capacity " + str(capacity_) +
                  " (make a larger cache, or a ring buffer with a window)");
  }
  // Row by row: source rows through their strides (last dim contiguous), converted to the
  // cache's dtype as they are written.
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

}  // namespace qkv::nn
