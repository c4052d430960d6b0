// Paged K/V (AttentionOptions::block_table / cache_seqlens, FlashAttention's flash_attn_with_kvcache
// layout): k and v are page pools (num_pages, page_size, Hkv, D), and sequence b's key j lies in
// pool page block_table[b, j / page_size], row j % page_size. The entry point (paged.cpp) checks
// the table once and runs each sequence as a decode problem whose K/V rows are found through
// PagedKv; the decode kernel reads them where they lie (decode/tiles-inl.h, KeyRow / ValueRow).
#pragma once

#include <cstdint>

#include "qkv/attention.hpp"

namespace qkv::detail {

// Whether options describe paged K/V (either list given; paged.cpp checks both).
inline bool is_paged(const AttentionOptions& options) {
  return !options.block_table.empty() || !options.cache_seqlens.empty();
}

// One sequence's pages, as AttentionProblem::paged holds them: its problem's k / v Rows view the
// pool's page 0 (row_stride between a page's rows, head_stride between heads, batch 0 only), and
// key j's row lies `offset(j, page_stride, row_stride)` elements past that view's row 0.
struct PagedKv {
  const int64_t* pages = nullptr;  // the sequence's block-table row; null: K/V are not paged
  int64_t page_size = 0;
  int page_shift = -1;             // log2(page_size) when it is a power of two, else -1
  int64_t k_page_stride = 0, v_page_stride = 0;  // elements (of the K/V dtype; bytes when quantized)
                                                  // between pool pages
  int64_t k_scale_page_stride = 0, v_scale_page_stride = 0;  // floats between the scale pools' pages

  bool on() const { return pages != nullptr; }
  int64_t page_of(int64_t j) const { return page_shift >= 0 ? j >> page_shift : j / page_size; }
  // Elements from the pool's row 0 of page 0 to key j's row, with the pool's page and row strides.
  int64_t offset(int64_t j, int64_t page_stride, int64_t row_stride) const {
    const int64_t page = page_of(j);
    return pages[page] * page_stride + (j - page * page_size) * row_stride;
  }
  // Key j's row of `rows`, a view of the pool's page 0 (paged) or of the whole cache (not paged).
  template <class T, class RowsT>
  const T* row(const RowsT& rows, int64_t page_stride, int64_t b, int64_t g, int64_t j) const {
    if (!on()) return rows.row(b, g, j);
    return rows.row(0, g, 0) + offset(j, page_stride, rows.row_stride);
  }
  // The first key past j's page: a run of keys [j, page_end(j)) is rows of one page, a strided view.
  int64_t page_end(int64_t j) const { return (page_of(j) + 1) * page_size; }
};

// The paged forward: q (B, Hq, Nq, Dk); k (num_pages, page_size, Hkv, Dk) and v (num_pages,
// page_size, Hkv, Dv) page pools; result.output (B, Hq, Nq, Dv), lse / row_max / row_sum
// (B, Hq, Nq). Each sequence runs decode on its pages, its queries at key positions
// cache_seqlens[b] - Nq + i (the band aligned to the end of its keys).
void paged_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                          const AttentionOptions& options);

}  // namespace qkv::detail
