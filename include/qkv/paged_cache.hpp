// qkv::nn::PagedKVCache: the keys and values of many sequences in one pool of fixed-size pages,
// each sequence a list of pages (its block-table row), as vLLM keeps its caches. Sequences grow a
// page at a time (append takes a free page when the last one is full); fork() starts a sequence
// that shares another's pages (a common prompt), counted by reference, and the first append that
// would write into a shared page copies it first (copy on write), so no sequence ever changes
// another's keys. Attention reads the pool in place through block_table / cache_seqlens
// (AttentionOptions, docs/inference.md); set_paged_options fills them for a batch of sequences.
#pragma once

#include <cstdint>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/dtype.hpp"
#include "qkv/tensor.hpp"

namespace qkv::nn {

class PagedKVCache {
 public:
  // A pool of num_pages pages of page_size positions, K/V (num_pages, page_size, kv_heads,
  // head_dim) in dtype (F32, BF16 or F16), every page free. I8 / I4 store each row quantized
  // (qkv/quantize.hpp; I4 rows head_dim / 2 bytes, head_dim even) with its scales in scale pools
  // (num_pages, page_size, kv_heads, groups) that pages share and copy with their rows.
  PagedKVCache(int64_t num_pages, int64_t page_size, int64_t kv_heads, int64_t head_dim, DType dtype = DType::F32);

  // A new empty sequence; returns its id (ids are never reused).
  int64_t add_sequence();
  // A new sequence holding `parent`'s keys and values: its pages, shared (their counts + 1).
  int64_t fork(int64_t parent);
  // Ends a sequence: its pages' counts - 1, a page whose count reaches 0 freed.
  void release(int64_t sequence);
  // Empties a sequence as release does, keeping it (and its id) live at length 0.
  void clear(int64_t sequence);

  // Appends k (kv_heads, N, head_dim) and v (the same), f32 or the pool's dtype (f32 only for a
  // quantized pool, each element finite), any strides, to `sequence`'s positions [length,
  // length + N): free pages taken as needed, a shared last page copied first. Throws qkv::Error,
  // leaving the cache unchanged, when the pool has too few pages or an input is bad.
  void append(int64_t sequence, const Tensor& k, const Tensor& v);

  int64_t length(int64_t sequence) const;
  const std::vector<int64_t>& pages(int64_t sequence) const;  // pool pages in key order
  int64_t references(int64_t page) const;                     // sequences holding the page
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  // The free pages appending n positions to `sequence` takes (a copy of a shared last page included).
  int64_t pages_needed(int64_t sequence, int64_t n) const;
  int64_t page_size() const { return page_size_; }
  const Tensor& key_pool() const { return keys_; }    // (num_pages, page_size, kv_heads, head_dim)
  const Tensor& value_pool() const { return values_; }
  const Tensor& key_scale_pool() const { return key_scales_; }  // quantized pools only (else undefined)
  const Tensor& value_scale_pool() const { return value_scales_; }

  // options.block_table (B x the longest page list, -1 past a sequence's pages) and
  // options.cache_seqlens for attention over `sequences` (batch element b = sequences[b]); for a
  // quantized pool also options.k_scales / v_scales, the scale pools.
  void set_paged_options(const std::vector<int64_t>& sequences, AttentionOptions& options) const;

 private:
  struct Sequence {
    std::vector<int64_t> pages;
    int64_t length = 0;
    bool live = false;
  };
  int64_t page_size_, kv_heads_, head_dim_;
  Tensor keys_, values_;
  Tensor key_scales_, value_scales_;  // quantized pools only
  std::vector<int64_t> counts_;  // per page: the sequences holding it
  std::vector<int64_t> free_;    // free pages, taken from the back
  std::vector<Sequence> sequences_;

  Sequence& live(int64_t sequence, const char* what);
  const Sequence& live(int64_t sequence, const char* what) const;
  int64_t take_page();
  void write_rows(const Tensor& from, const Tensor& pool, const Tensor& scales, int64_t page, int64_t slot, int64_t n,
                  int64_t first) const;
};

}  // namespace qkv::nn
