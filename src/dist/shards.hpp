// Where ring attention's rows live: the layout of the sequence over the ranks (contiguous shards,
// or zigzag chunks under a causal band: see ring_attention.cpp), the exchange between the two on
// entry and exit, the ring buffers of K/V blocks, and the per-thread workspace they live in.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "dist/comm.hpp"
#include "qkv/dist.hpp"

namespace qkv::dist::ring {

// t as (B, H, n, D): rank 4 as it is, rank 3 (B, n, D) and rank 2 (n, D) with heads of 1.
Tensor as4(const Tensor& t);

// Buffers kept per thread between calls (ring buffers, accumulators, the pair results), so a loop
// of calls pays for fresh pages once (a page fault costs as much as the kernel's work on a small
// shard). Never handed to the caller; release_ring_workspaces() frees them.
struct Workspace {
  std::vector<Tensor> buffers;
  AttentionResult pair;  // scaled_dot_product_attention_into's result, reused pair after pair
  // The buffer in `slot`, shaped `shape`, contents unspecified.
  Tensor get(size_t slot, const Shape& shape);
};
extern thread_local Workspace workspace;

// Which rows of the global sequence each rank computes on (see the file comment).
struct Layout {
  int ranks = 1, rank = 0;
  int64_t n = 0;        // rows per caller shard
  bool zigzag = false;
  int64_t chunk = 0;    // rows per chunk: n, or n / 2 with zigzag
  int chunks = 1;       // per rank: 1, or 2 with zigzag
  // Global first row of chunk `slot` computed by rank `r`.
  int64_t start(int r, int slot) const {
    if (!zigzag) return int64_t{r} * n;
    return (slot == 0 ? int64_t{r} : int64_t{2} * ranks - 1 - r) * chunk;
  }
};

Layout make_layout(const Comm& comm, int64_t n, const Mask& mask);

// The zigzag exchange on entry: this rank's contiguous (B, H, n, D) shard becomes its chunks
// (itself without zigzag). `index` keeps the tags of tensors apart.
std::vector<Tensor> scatter_chunks(const Tensor& shard, const Layout& layout, const Comm& comm, int index,
                                   Requests& requests, RingStats& stats);
// The zigzag exchange on exit: this rank's chunks (in slot order) go back to the ranks whose
// contiguous shards hold them; `shard` (B, H, n, D) receives this rank's rows.
void gather_chunks(const std::vector<Tensor>& chunks, const Tensor& shard, const Layout& layout, const Comm& comm,
                   int index, RingStats& stats);

// A (B, H, rows, D) view into a ring buffer, kept alive by the buffer tensor.
Tensor view(const Tensor& buffer, int64_t offset, const Shape& shape);

// The K/V chunks of one block laid out in one buffer: chunk 0's k, v, then chunk 1's k, v.
struct BlockLayout {
  Shape k_shape, v_shape;
  int64_t k_size = 0, v_size = 0, chunks = 1;
  int64_t total() const { return chunks * (k_size + v_size); }
  Tensor k(const Tensor& buf, int64_t c) const { return view(buf, c * (k_size + v_size), k_shape); }
  Tensor v(const Tensor& buf, int64_t c) const { return view(buf, c * (k_size + v_size) + k_size, v_shape); }
};

BlockLayout block_layout(const Tensor& k4, const Tensor& v4, const Layout& layout);
// Copies this rank's K and V chunks into ring buffer `buffer`, laid out by bl.
void load_block(const BlockLayout& bl, const Tensor& buffer, const std::vector<Tensor>& k_chunks,
                const std::vector<Tensor>& v_chunks);

// The caller's shapes of a (B, H, n, D) result of `original`'s rank, and of its lse.
Shape shape_like(const Tensor& original, const Tensor& t4);
Shape lse_shape_like(const Tensor& original, const Tensor& q4);
Tensor poisoned(const Shape& shape);
Tensor filled(Tensor t, float value);
void add_into(float* dst, const float* src, int64_t count);

}  // namespace qkv::dist::ring
