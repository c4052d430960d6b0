// Ring attention's rows: layouts, the zigzag exchange, ring buffers (dist/shards.hpp).
#include "dist/shards.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>

namespace qkv::dist::ring {

// t as (B, H, n, D): rank 4 as it is, rank 3 (B, n, D) and rank 2 (n, D) with heads of 1.
Tensor as4(const Tensor& t) {
  if (t.dim() == 4) return t.contiguous();
  if (t.dim() == 3) return t.contiguous().unsqueeze(1);
  return t.contiguous().unsqueeze(0).unsqueeze(0);
}

// Copies rows [start, start + len) of dim 2 of a contiguous (A, C, rows, D) tensor into `out`,
// a contiguous (A, C, len, D) tensor (or the reverse when to_rows is true).
void copy_rows(const Tensor& rows, int64_t start, const Tensor& chunk, bool to_rows) {
  const int64_t outer = rows.size(0) * rows.size(1), n = rows.size(2), d = rows.size(3);
  const int64_t len = chunk.size(2);
  float* big = rows.data();
  float* small = chunk.data();
  for (int64_t o = 0; o < outer; ++o) {
    float* a = big + (o * n + start) * d;
    float* b = small + o * len * d;
    if (to_rows) std::memcpy(a, b, sizeof(float) * static_cast<size_t>(len * d));
    else std::memcpy(b, a, sizeof(float) * static_cast<size_t>(len * d));
  }
}

Tensor Workspace::get(size_t slot, const Shape& shape) {
  if (slot >= buffers.size()) buffers.resize(slot + 1);
  if (!buffers[slot].defined() || buffers[slot].shape() != shape) buffers[slot] = Tensor::empty(shape);
  return buffers[slot];
}
thread_local Workspace workspace;

// Workspace slot `slot` shaped as t4 with `rows` rows.
Tensor with_rows(const Tensor& t4, int64_t rows, size_t slot) {
  return workspace.get(slot, Shape{t4.size(0), t4.size(1), rows, t4.size(3)});
}

Layout make_layout(const Comm& comm, int64_t n, const Mask& mask) {
  Layout l;
  l.ranks = comm.size();
  l.rank = comm.rank();
  l.n = n;
  const bool causal_band = mask.band_lo() <= -Mask::kUnbounded && mask.band_hi() < Mask::kUnbounded;
  l.zigzag = causal_band && l.ranks > 1 && n % 2 == 0;
  l.chunk = l.zigzag ? n / 2 : n;
  l.chunks = l.zigzag ? 2 : 1;
  return l;
}

// Global chunk g (rows g*c ...) lies in caller shard g / 2 (half g % 2) and is computed by rank
// g (slot 0) when g < P, else by rank 2P-1-g (slot 1). `index` keeps the tags of tensors apart.
std::vector<Tensor> scatter_chunks(const Tensor& shard, const Layout& layout, const Comm& comm, int index,
                                   Requests& requests, RingStats& stats) {
  // Workspace: 2 chunks, 2 outgoing halves per index, after gather_chunks' slots 40 ... 49.
  const size_t slots = 64 + 4 * static_cast<size_t>(index);
  std::vector<Tensor> chunks;
  if (!layout.zigzag) {
    chunks.push_back(shard);
    return chunks;
  }
  const int p = layout.ranks, r = layout.rank;
  for (int slot = 0; slot < 2; ++slot) {
    chunks.push_back(with_rows(shard, layout.chunk, slots + static_cast<size_t>(slot)));
    const int64_t g = slot == 0 ? r : 2 * p - 1 - r;
    requests.recv(chunks.back().data(), chunks.back().numel(), static_cast<int>(g / 2), kTagZigzag + 2 * index + slot,
                  comm.get());
  }
  for (int half = 0; half < 2; ++half) {
    const int64_t g = 2 * int64_t{r} + half;
    const int dest = static_cast<int>(g < p ? g : 2 * p - 1 - g);
    const int slot = g < p ? 0 : 1;
    const Tensor outgoing = with_rows(shard, layout.chunk, slots + 2 + static_cast<size_t>(half));
    copy_rows(shard, half * layout.chunk, outgoing, false);
    requests.send(outgoing.data(), outgoing.numel(), dest, kTagZigzag + 2 * index + slot, comm.get(), stats);
  }
  return chunks;
}

// The zigzag exchange on exit: this rank's chunks (in slot order) go back to the ranks whose
// contiguous shards hold them; `shard` (B, H, n, D) receives this rank's rows.
void gather_chunks(const std::vector<Tensor>& chunks, const Tensor& shard, const Layout& layout, const Comm& comm,
                   int index, RingStats& stats) {
  if (!layout.zigzag) {
    copy_rows(shard, 0, chunks[0], true);
    return;
  }
  const int p = layout.ranks, r = layout.rank;
  std::vector<Tensor> incoming;
  Requests requests;
  for (int half = 0; half < 2; ++half) {
    incoming.push_back(with_rows(shard, layout.chunk, 40 + 2 * static_cast<size_t>(index) + static_cast<size_t>(half)));
    const int64_t g = 2 * int64_t{r} + half;
    const int source = static_cast<int>(g < p ? g : 2 * p - 1 - g);
    requests.recv(incoming.back().data(), incoming.back().numel(), source, kTagZigzag + 2 * index + half, comm.get());
  }
  for (int slot = 0; slot < 2; ++slot) {
    const int64_t g = slot == 0 ? r : 2 * p - 1 - r;
    requests.send(chunks[static_cast<size_t>(slot)].data(), chunks[static_cast<size_t>(slot)].numel(),
                  static_cast<int>(g / 2), kTagZigzag + 2 * index + static_cast<int>(g % 2), comm.get(), stats);
  }
  requests.wait(stats);
  for (int half = 0; half < 2; ++half) copy_rows(shard, half * layout.chunk, incoming[static_cast<size_t>(half)], true);
}

void add_into(float* dst, const float* src, int64_t count) {
#pragma omp parallel for schedule(static) if (count > 65536)
  for (int64_t i = 0; i < count; ++i) dst[i] += src[i];
}

// A (B, H, rows, D) view into a ring buffer, kept alive by the buffer tensor.
Tensor view(const Tensor& buffer, int64_t offset, const Shape& shape) {
  return Tensor::from_blob(buffer.data() + offset, shape, std::make_shared<Tensor>(buffer));
}

BlockLayout block_layout(const Tensor& k4, const Tensor& v4, const Layout& layout) {
  BlockLayout b;
  b.k_shape = Shape{k4.size(0), k4.size(1), layout.chunk, k4.size(3)};
  b.v_shape = Shape{v4.size(0), v4.size(1), layout.chunk, v4.size(3)};
  b.k_size = b.k_shape.numel();
  b.v_size = b.v_shape.numel();
  b.chunks = layout.chunks;
  return b;
}

Shape shape_like(const Tensor& original, const Tensor& t4) {
  if (original.dim() == 4) return t4.shape();
  if (original.dim() == 3) return Shape{t4.size(0), t4.size(2), t4.size(3)};
  return Shape{t4.size(2), t4.size(3)};
}

Shape lse_shape_like(const Tensor& original, const Tensor& q4) {
  if (original.dim() == 4) return Shape{q4.size(0), q4.size(1), q4.size(2)};
  if (original.dim() == 3) return Shape{q4.size(0), q4.size(2)};
  return Shape{q4.size(2)};
}

Tensor poisoned(const Shape& shape) { return Tensor::full(shape, std::numeric_limits<float>::quiet_NaN()); }

Tensor filled(Tensor t, float value) {
  std::fill_n(t.data(), t.numel(), value);
  return t;
}

void load_block(const BlockLayout& bl, const Tensor& buffer, const std::vector<Tensor>& k_chunks,
                const std::vector<Tensor>& v_chunks) {
  for (int c = 0; c < bl.chunks; ++c) {
    std::memcpy(bl.k(buffer, c).data(), k_chunks[static_cast<size_t>(c)].data(), sizeof(float) * static_cast<size_t>(bl.k_size));
    std::memcpy(bl.v(buffer, c).data(), v_chunks[static_cast<size_t>(c)].data(), sizeof(float) * static_cast<size_t>(bl.v_size));
  }
}

}  // namespace qkv::dist::ring
