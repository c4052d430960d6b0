// Inference pieces of qkv::nn: rotary position embeddings and the per-layer KV cache that lets
// MultiHeadAttention attend incrementally (include/qkv/nn.hpp: make_cache, forward(x, cache)).
#pragma once

#include <cstdint>
#include <vector>

#include "qkv/dtype.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

struct RotaryEmbeddingOptions {
  double base = 10000;       // theta_i = base^(-2 i / head_dim)
  bool interleaved = false;  // false: half-split pairs (x_i, x_{i + D/2}), GPT-NeoX / LLaMA;
                             // true: adjacent pairs (x_{2i}, x_{2i+1}), GPT-J
  // Non-empty: the D/2 theta_i themselves, in place of base's (rope scaling: linear interpolation
  // divides them by a factor, Llama 3.1 blends them per wavelength); each finite and > 0.
  std::vector<double> inverse_frequencies;
};

// Rotary position embedding (RoFormer): the pair i of a head vector at position p is rotated by
// the angle p * theta_i, theta_i = base^(-2 i / D):
//   half-split:  y_i = x_i cos - x_{i+D/2} sin,   y_{i+D/2} = x_{i+D/2} cos + x_i sin   (i < D/2)
//   interleaved: y_2i = x_2i cos - x_2i+1 sin,    y_2i+1 = x_2i+1 cos + x_2i sin
// so q.k depends only on the distance between their positions. The angles are computed in
// double and rounded once.
class RotaryEmbedding {
 public:
  explicit RotaryEmbedding(int64_t head_dim, const RotaryEmbeddingOptions& options = {});

  // x (B, H, N, D) (or (H, N, D), (N, D)), f32: a new tensor with token n of every head rotated
  // as position position_offset + n.
  Tensor apply(const Tensor& x, int64_t position_offset = 0) const;
  // In place on x, any strides with a contiguous last dim (4-D (B, H, N, D)): batch element b's
  // token n sits at position offsets[b] + n (one offset per batch element, or one for all).
  // inverse: rotate by the negative angle (the transpose: the backward of a rotation).
  void apply_inplace(const Tensor& x, const std::vector<int64_t>& offsets, bool inverse = false) const;

  int64_t head_dim() const { return head_dim_; }
  const RotaryEmbeddingOptions& options() const { return options_; }

 private:
  int64_t head_dim_;
  RotaryEmbeddingOptions options_;
  std::vector<double> inverse_frequency_;  // theta_i, D/2 of them
};

// One attention layer's cache of keys and values: (B, Hkv, capacity, D) each, allocated once in
// the chosen dtype (BF16 / F16 halve its bytes, and decode reads them as they are). Every batch
// element has its own length (prompts of different lengths). append() writes new positions in
// place, never reallocating; keys()/values() are views that attention reads in place.
//
// window > 0 makes it a ring buffer of `window` slots (capacity = window): position p lives in
// slot p % window, and a sliding-window model (each query sees its last `window` positions) never
// needs more. Attention over a ring sees the slots in rotated order, which softmax does not mind
// (ALiBi, whose bias depends on the key's index, is therefore refused on a ring).
class KVCache {
 public:
  KVCache() = default;
  KVCache(int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, DType dtype = DType::F32,
          int64_t window = 0);

  int64_t batch() const { return batch_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t capacity() const { return capacity_; }
  int64_t head_dim() const { return head_dim_; }
  DType dtype() const { return dtype_; }
  int64_t window() const { return window_; }  // 0: not a ring
  bool defined() const { return keys_.defined(); }

  // Positions appended so far: per batch element, and the largest.
  const std::vector<int64_t>& lengths() const { return lengths_; }
  int64_t length() const;
  int64_t length(int64_t b) const;
  void reset();  // length 0 everywhere; the storage stays

  // Appends k, v (B, Hkv, N, D), any strides, f32 or the cache's dtype: batch element b's first
  // counts[b] tokens (all N when counts is empty) go to positions [length(b), length(b) + counts[b]).
  // Throws, leaving the cache unchanged, when a non-ring cache would exceed its capacity.
  void append(const Tensor& k, const Tensor& v, const std::vector<int64_t>& counts = {});

  // The first `len` slots (len <= capacity), (B, Hkv, len, D) views of the storage.
  Tensor keys(int64_t len) const;
  Tensor values(int64_t len) const;
  // The whole storage.
  const Tensor& key_storage() const { return keys_; }
  const Tensor& value_storage() const { return values_; }

 private:
  int64_t batch_ = 0, kv_heads_ = 0, capacity_ = 0, head_dim_ = 0, window_ = 0;
  DType dtype_ = DType::F32;
  Tensor keys_, values_;
  std::vector<int64_t> lengths_;
};

}  // namespace qkv::nn
