// qkv::dist: attention over a sequence split across MPI processes (ring attention).
// Optional: built, as the target qkv::dist, only when CMake finds MPI (docs/distributed.md).
//
// Each of the P ranks of `comm` passes its contiguous shard of the sequence: rank r holds
// positions r*N/P ... (r+1)*N/P - 1 of q, k and v (N divisible by P, so every shard has the same
// shape), and gets back its shard of the output and of lse, exactly what
// qkv::scaled_dot_product_attention on the whole sequence would give for those rows.
//
// K/V blocks travel around the ring (rank r sends to r+1, receives from r-1) with non-blocking
// sends and receives that overlap the current block's compute; the partial results are merged
// through their lse. Causal attention is load balanced inside the call (zigzag: the sequence is
// cut into 2P chunks and rank r computes the query chunks r and 2P-1-r), so the caller still
// passes and gets contiguous shards.
//
// Masks and modifiers refer to global positions: Mask::causal(offset), Mask::window(left, right,
// offset), Mask::key_lengths(global lengths), softcap, alibi_slopes (distances of the whole
// sequence) and sinks (each row's softmax sees its head's sink once) mean what they mean for the
// whole sequence. Tensor masks (Mask::keep, Mask::additive) are sharded as the queries: rank r
// passes the rows of its n queries over all N keys, a tensor that broadcasts to (B, Hq, n, N) the
// way a single call's broadcasts to (B, Hq, Nq, Nk) (a dim of 1 still broadcasts; a term without a
// query dim of n, e.g. (B, 1, 1, N) padding, is the same on every rank). Any other shape is a
// qkv::Error naming it. Dropout, need_weights and Backend::Decode (no backward) are a qkv::Error.
// Shapes and options are compared across ranks with one MPI_Allgather before any ring traffic,
// so a mismatch is the same qkv::Error on every rank, never a hang. All calls are collective
// over `comm`; MPI must be initialised and the calls made from one thread per rank.
#pragma once

#include <cstdint>

#include <mpi.h>

#include "qkv/attention.hpp"

namespace qkv::dist {

// Where a call's time went on this rank, for benchmarks (tools/qkv/ring_bench.cpp).
struct RingStats {
  double total_seconds = 0;    // the whole call, shape checks and the zigzag exchange included
  double compute_seconds = 0;  // inside the single-process kernels and the merges
  double wait_seconds = 0;     // blocked in MPI_Wait for ring or zigzag messages
  int64_t bytes_sent = 0;      // by this rank
  int64_t blocks_computed = 0; // (query chunk, key chunk) kernel calls; skipped masked ones not counted
};

// q: (B, Hq, n, Dk), k: (B, Hkv, n, Dk), v: (B, Hkv, n, Dv) with n = N/P this rank's shard
// (rank 3 (B, n, D) and rank 2 (n, D) are one head, as in scaled_dot_product_attention).
// Returns output L + (n, Dv) and lse L + (n), this rank's rows. `stats`, when given, is filled.
AttentionResult ring_attention(const Tensor& q, const Tensor& k, const Tensor& v, MPI_Comm comm,
                               const AttentionOptions& options = {}, RingStats* stats = nullptr);

// Gradients of ring_attention for this rank's shard: dq, dk, dv shaped as q, k and v, and, with
// sinks, dsinks (Hq): the gradient over the whole sequence, the same on every rank.
// grad_output: shaped as forward.output; `forward` is this rank's result of ring_attention on the
// same q, k, v, options and comm. dK/dV accumulators travel around the ring with the K/V blocks.
AttentionGrads ring_attention_backward(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                       const Tensor& v, const AttentionResult& forward, MPI_Comm comm,
                                       const AttentionOptions& options = {}, RingStats* stats = nullptr);

// The calls keep their ring buffers and accumulators per thread for the next call (fresh pages
// cost as much as the compute on small shards); this frees the calling thread's.
void release_ring_workspaces();

}  // namespace qkv::dist
