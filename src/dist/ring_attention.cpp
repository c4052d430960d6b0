// Ring attention over MPI (include/qkv/dist.hpp): the sequence is split across the ranks of a
// communicator, K/V blocks travel around the ring, and each rank merges the partial results of
// its queries through their lse. Each (query chunk, key chunk) pair is one call of
// scaled_dot_product_attention or its backward, through src/attention/ring_block.hpp, which differs only
// in ALiBi's distances (those of the whole sequence), with the global mask shifted to the pair's
// positions and the tensor terms' view of the pair; any kernel behind it serves the distributed call
// unchanged. Softcap acts per score and needs nothing more. Sinks join each row's softmax once,
// after the ring (merge_sinks); their gradient needs only the rows' O, dO and lse.
//
// Layout inside a call. The caller's shard on rank r is the contiguous rows r*n ... (r+1)*n - 1
// (n = N/P). Without a causal band each rank computes on that shard as it is: one chunk. With a
// causal band (band_lo unbounded, band_hi finite) and n even, the sequence is cut into 2P chunks
// of c = n/2 rows and rank r computes on chunks r and 2P-1-r (zigzag), so every rank has about
// the same number of visible (query, key) pairs; the chunks are exchanged point to point on
// entry and the results sent back on exit, so the caller still sees contiguous shards.
//
// Forward, step s = 0 .. P-1: rank r holds the K/V chunks of rank (r - s) mod P. It posts the
// receive of the next block from r-1 and the send of the current one to r+1, computes every
// visible (query chunk, key chunk) pair, merges (output, lse) into its accumulators, then waits.
// Backward: the same ring for K/V; the dK/dV accumulator of a block travels one step behind it:
// rank r computes its contribution into a fresh buffer while the accumulator from r-1 is in
// flight, adds it, and sends it on; after P steps each block's accumulator reaches its owner.
//
// Files: comm.hpp (MPI), shards.{hpp,cpp} (layouts, the zigzag exchange, ring buffers),
// pair_mask.{hpp,cpp} (a pair's mask), agree.{hpp,cpp} (the collective check), merge.{hpp,cpp}
// (results and sinks through attention/lse_merge.hpp), this file (the forward ring) and
// ring_backward.cpp.
#include "qkv/dist.hpp"

#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "attention/ring_block.hpp"
#include "dist/agree.hpp"
#include "dist/comm.hpp"
#include "dist/merge.hpp"
#include "dist/pair_mask.hpp"
#include "dist/shards.hpp"

namespace qkv::dist {
namespace {

using namespace ring;  // NOLINT(google-build-using-namespace): this file is the ring's own

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// What the forward ring works on: this rank's query chunks and their accumulators, the terms,
// and the ring buffers of K/V blocks (buffer 0 holds this rank's block on entry).
struct Forward {
  Layout layout;
  BlockLayout bl;
  Tensor buffers[2];
  std::vector<Tensor> q_chunks, out_chunks, lse_chunks;
  Terms terms;
  bool direct = true;  // without zigzag the one chunk is this rank's shard: accumulators are results
};

// Entry: this rank's query chunks and its K/V block in ring buffer 0; accumulators per query
// chunk with output 0 and lse -inf (no key seen yet).
Forward enter(const Tensor& q4, const Tensor& k4, const Tensor& v4, const AttentionOptions& options,
              const Comm& comm, RingStats& stats) {
  Forward f;
  f.layout = make_layout(comm, q4.size(2), options.mask);
  const Layout& layout = f.layout;
  f.bl = block_layout(k4, v4, layout);
  f.buffers[0] = workspace.get(0, Shape{f.bl.total()});
  f.buffers[1] = workspace.get(1, Shape{f.bl.total()});
  std::vector<Tensor> k_chunks, v_chunks;
  {
    Requests requests;
    f.q_chunks = scatter_chunks(q4, layout, comm, 0, requests, stats);
    k_chunks = scatter_chunks(k4, layout, comm, 1, requests, stats);
    v_chunks = scatter_chunks(v4, layout, comm, 2, requests, stats);
    f.terms = scatter_terms(options.mask, layout, comm, 3, requests, stats);
    requests.wait(stats);
  }
  load_block(f.bl, f.buffers[0], k_chunks, v_chunks);
  f.direct = !layout.zigzag;
  for (int c = 0; c < layout.chunks; ++c) {
    const Shape out_shape{q4.size(0), q4.size(1), layout.chunk, v4.size(3)}, lse_shape{q4.size(0), q4.size(1), layout.chunk};
    const size_t slot = 2 + 2 * static_cast<size_t>(c);
    f.out_chunks.push_back(f.direct ? Tensor::zeros(out_shape) : filled(workspace.get(slot, out_shape), 0.0f));
    f.lse_chunks.push_back(f.direct ? Tensor::full(lse_shape, kMinusInf) : filled(workspace.get(slot + 1, lse_shape), kMinusInf));
  }
  return f;
}

// Step s of the ring: every visible (query chunk, key chunk of `source`'s block in `current`)
// pair computed and merged into the accumulators, MPI progressed between the pairs.
void compute_step(Forward& f, const Tensor& current, int source, const AttentionOptions& options,
                  AttentionOptions& pair_options, Requests& requests, RingStats& stats) {
  const Layout& layout = f.layout;
  for (int qc = 0; qc < layout.chunks; ++qc) {
    for (int kc = 0; kc < layout.chunks; ++kc) {
      const int64_t qs = layout.start(layout.rank, qc), ks = layout.start(source, kc);
      if (!pair_mask(options.mask, qs, layout.chunk, ks, layout.chunk, pair_options.mask)) continue;
      add_pair_terms(f.terms, qc, ks, layout.chunk, pair_options.mask);
      AttentionResult& part = workspace.pair;
      detail::block_attention_into(f.q_chunks[static_cast<size_t>(qc)], f.bl.k(current, kc), f.bl.v(current, kc), part,
                                   pair_options, qs - ks);
      merge(f.out_chunks[static_cast<size_t>(qc)], f.lse_chunks[static_cast<size_t>(qc)], part.output, part.lse);
      ++stats.blocks_computed;
      requests.poke();
    }
  }
}

// The ring: step s computes on the K/V block of rank (r - s) mod P while the next one arrives.
void run_ring(Forward& f, const Tensor& q4, const Tensor& v4, const AttentionOptions& options, const Comm& comm,
              RingStats& stats) {
  const int p = f.layout.ranks, r = f.layout.rank;
  const int right = (r + 1) % p, left = (r + p - 1) % p;
  // The pairs see no sinks (merge_sinks adds them once per row after the ring), and ALiBi's
  // distances of the whole sequence through alibi_shift (src/attention/ring_block.hpp).
  AttentionOptions pair_options = options;
  pair_options.sinks = Tensor();
  if (workspace.pair.output.defined() &&
      workspace.pair.output.shape() != Shape{q4.size(0), q4.size(1), f.layout.chunk, v4.size(3)})
    workspace.pair = AttentionResult();  // another problem's shapes: let the next call allocate
  for (int step = 0; step < p; ++step) {
    const Tensor& current = f.buffers[step % 2];
    Requests requests;
    if (step + 1 < p) {
      requests.recv(f.buffers[(step + 1) % 2].data(), f.bl.total(), left, kTagKv, comm.get());
      requests.send(current.data(), f.bl.total(), right, kTagKv, comm.get(), stats);
    }
    const auto compute_start = Clock::now();
    compute_step(f, current, (r - step + p) % p, options, pair_options, requests, stats);
    stats.compute_seconds += seconds_since(compute_start);
    requests.wait(stats);
  }
}

// Exit: the chunks go back to the contiguous shards, shaped as the caller's q.
AttentionResult leave(const Forward& f, const Tensor& q, const Tensor& q4, const Tensor& v4, const Comm& comm,
                      RingStats& stats) {
  AttentionResult result;
  Tensor out4 = f.out_chunks[0], lse4 = f.lse_chunks[0].unsqueeze(3);
  if (!f.direct) {
    out4 = poisoned(Shape{q4.size(0), q4.size(1), q4.size(2), v4.size(3)});
    lse4 = poisoned(Shape{q4.size(0), q4.size(1), q4.size(2), 1});
    std::vector<Tensor> lse_rows;
    for (const Tensor& t : f.lse_chunks) lse_rows.push_back(t.unsqueeze(3));
    gather_chunks(f.out_chunks, out4, f.layout, comm, 0, stats);
    gather_chunks(lse_rows, lse4, f.layout, comm, 1, stats);
  }
  result.output = out4.reshape(shape_like(q, out4));
  result.lse = lse4.reshape(lse_shape_like(q, q4));
  return result;
}

}  // namespace

void release_ring_workspaces() { workspace = Workspace(); }

AttentionResult ring_attention(const Tensor& q, const Tensor& k, const Tensor& v, MPI_Comm parent,
                               const AttentionOptions& options, RingStats* stats_out) {
  const auto start = Clock::now();
  RingStats stats;
  Comm comm(parent);
  agree(describe({q, k, v}, options, shard_problem(q, k, v, options, comm.size())), comm, "ring_attention",
        {"q", "k", "v"});

  const Tensor q4 = as4(q), k4 = as4(k), v4 = as4(v);
  Forward f = enter(q4, k4, v4, options, comm, stats);
  run_ring(f, q4, v4, options, comm, stats);
  if (options.sinks.defined())
    for (int c = 0; c < f.layout.chunks; ++c)
      merge_sinks(f.out_chunks[static_cast<size_t>(c)], f.lse_chunks[static_cast<size_t>(c)], options.sinks);
  AttentionResult result = leave(f, q, q4, v4, comm, stats);
  stats.total_seconds = seconds_since(start);
  if (stats_out) *stats_out = stats;
  return result;
}

}  // namespace qkv::dist
