// Inference pieces of qkv::nn: rotary position embeddings (from a base, or from tables) and the
// per-layer KV cache that lets MultiHeadAttention attend incrementally (include/qkv/nn.hpp:
// make_cache, forward(x, cache)).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "qkv/dtype.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

class PagedKVCache;  // qkv/paged_cache.hpp

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
  const std::vector<double>& inverse_frequencies() const { return inverse_frequency_; }  // theta_i

 private:
  int64_t head_dim_;
  RotaryEmbeddingOptions options_;
  std::vector<double> inverse_frequency_;  // theta_i, D/2 of them
};

// Rotary tables as FlashAttention's kvcache API takes them (flash_attn_with_kvcache's rotary_cos,
// rotary_sin, rotary_interleaved; flash_attn.layers.rotary.apply_rotary_emb): row p holds the
// cosines and sines of position p's angles, one column per pair of rotated features.
struct RotaryTableOptions {
  Tensor cos, sin;           // (seqlen_ro, rotary_dim / 2) each, F32, BF16 or F16, finite
  bool interleaved = false;  // false: pairs (x_i, x_{i + R/2}), GPT-NeoX; true: (x_{2i}, x_{2i+1}), GPT-J
};

// Rotary position embedding from caller-supplied tables. Only the first rotary_dim R =
// 2 * cos.size(1) features of each head (R <= head_dim) are rotated; the rest pass through. Token
// n at position p (an offset + n) gets, with c = cos[p][i], s = sin[p][i]:
//   half-split:  y_i = x_i c - x_{i+R/2} s,   y_{i+R/2} = x_{i+R/2} c + x_i s   (i < R/2)
//   interleaved: y_2i = x_2i c - x_2i+1 s,    y_2i+1 = x_2i+1 c + x_2i s
// which is FlashAttention's out = x * cos + rotate(x) * sin on the rotated part. The tables are
// kept in double (f32 widens exactly); each output is computed in double and rounded once, as
// RotaryEmbedding computes it. qkv::Error names the shapes and values of bad tables, of x, and
// of positions past the tables' end.
class RotaryTable {
 public:
  RotaryTable(int64_t head_dim, const RotaryTableOptions& options);
  // The tables of the base form for positions [0, length): pair i of position p at the angle
  // p * base^(-2i / rotary_dim) (or options.inverse_frequencies[i], rotary_dim / 2 of them), in
  // double. rotary_dim is even and <= head_dim (0: head_dim). On the first rotary_dim features
  // they rotate exactly as RotaryEmbedding(rotary_dim, options) does, bit for bit.
  static RotaryTable from_base(int64_t head_dim, int64_t length, const RotaryEmbeddingOptions& options = {},
                               int64_t rotary_dim = 0);

  // x (B, H, N, D) (or (H, N, D), (N, D)), f32: a new tensor with token n of every head rotated
  // as position position_offset + n.
  Tensor apply(const Tensor& x, int64_t position_offset = 0) const;
  // In place on x (B, H, N, D), any strides with a contiguous last dim: batch element b's token n
  // sits at position offsets[b] + n (one offset per batch element, e.g. a KVCache's lengths(),
  // FlashAttention's cache_seqlens; or one for all). inverse: the backward (the transpose).
  void apply_inplace(const Tensor& x, const std::vector<int64_t>& offsets, bool inverse = false) const;

  int64_t head_dim() const { return head_dim_; }
  int64_t rotary_dim() const { return rotary_dim_; }
  int64_t length() const { return length_; }  // positions the tables hold: seqlen_ro
  bool interleaved() const { return interleaved_; }
  Tensor cos() const;  // the tables as f32, (length, rotary_dim / 2)
  Tensor sin() const;

 private:
  RotaryTable() = default;
  int64_t head_dim_ = 0, rotary_dim_ = 0, length_ = 0;
  bool interleaved_ = false;
  std::vector<double> cos_, sin_;  // (length, rotary_dim / 2), row-major
};

// One attention layer's cache of keys and values: (B, Hkv, capacity, D) each, allocated once in
// the chosen dtype (BF16 / F16 halve its bytes, and decode reads them as they are; I8 / I4 store
// them quantized, qkv/quantize.hpp, with their scales beside them: key_scales(), value_scales(),
// which attention takes as AttentionOptions::k_scales / v_scales). Every batch
// element has its own length (prompts of different lengths). append() writes new positions in
// place, never reallocating; keys()/values() are views that attention reads in place.
//
// window > 0 makes it a ring buffer of `window` slots (capacity = window): position p lives in
// slot p % window, and a sliding-window model (each query sees its last `window` positions) never
// needs more. Attention over a ring sees the slots in rotated order, which softmax does not mind
// (ALiBi, whose bias depends on the key's index, is therefore refused on a ring).
//
// page_size > 0 makes it paged instead (not with a window): the batch's keys and values live in
// a pool of page_size-position pages (a qkv::nn::PagedKVCache of batch x ceil(capacity /
// page_size) pages, paged()), batch element b being the pool's sequence sequences()[b], and
// MultiHeadAttention attends over the pages in place. A paged cache has no contiguous storage:
// keys(), values() and their scales throw (read paged()); append, lengths and reset work alike.
// Copies of a paged cache are the same cache (one pool, one set of sequences: an append through
// one shows in the other), where copies of a contiguous one share storage but keep their own
// lengths.
class KVCache {
 public:
  KVCache() = default;
  KVCache(int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, DType dtype = DType::F32,
          int64_t window = 0, int64_t page_size = 0);

  int64_t batch() const { return batch_; }
  int64_t kv_heads() const { return kv_heads_; }
  int64_t capacity() const { return capacity_; }
  int64_t head_dim() const { return head_dim_; }
  DType dtype() const { return dtype_; }
  int64_t window() const { return window_; }  // 0: not a ring
  bool defined() const { return keys_.defined() || paged_ != nullptr; }
  int64_t page_size() const;                                     // 0: contiguous
  PagedKVCache* paged() const { return paged_.get(); }           // the page pool, or null
  const std::vector<int64_t>& sequences() const { return sequences_; }  // paged: element b's sequence

  // Positions appended so far: per batch element, and the largest.
  std::vector<int64_t> lengths() const;  // paged: read from the pool
  int64_t length() const;
  int64_t length(int64_t b) const;
  void reset();  // length 0 everywhere; the storage stays

  // Appends k, v (B, Hkv, N, D), any strides, f32 or the cache's 16-bit dtype (a quantized cache
  // quantizes f32 rows as it writes them, and throws on a non-finite one): batch element b's first
  // counts[b] tokens (all N when counts is empty) go to positions [length(b), length(b) + counts[b]).
  // Throws, leaving the cache unchanged, when a non-ring cache would exceed its capacity.
  void append(const Tensor& k, const Tensor& v, const std::vector<int64_t>& counts = {});

  // The first `len` slots (len <= capacity), (B, Hkv, len, D) views of the storage (I4: D / 2).
  Tensor keys(int64_t len) const;
  Tensor values(int64_t len) const;
  // Their scales when the cache is quantized, (B, Hkv, len, groups) views; undefined otherwise.
  Tensor key_scales(int64_t len) const;
  Tensor value_scales(int64_t len) const;
  // The whole storage (undefined when paged).
  const Tensor& key_storage() const { return keys_; }
  const Tensor& value_storage() const { return values_; }

 private:
  int64_t batch_ = 0, kv_heads_ = 0, capacity_ = 0, head_dim_ = 0, window_ = 0;
  DType dtype_ = DType::F32;
  Tensor keys_, values_;
  Tensor key_scales_, value_scales_;  // quantized dtypes only
  std::vector<int64_t> lengths_;           // contiguous only (a paged cache's are the pool's)
  std::shared_ptr<PagedKVCache> paged_;    // paged mode only
  std::vector<int64_t> sequences_;

  void check_contiguous(const char* what) const;
  void check_finite(const Tensor& k, const Tensor& v, const std::vector<int64_t>& count) const;
  void append_quantized(const Tensor& k, const Tensor& v, const std::vector<int64_t>& count);  // checked by append
};

}  // namespace qkv::nn
