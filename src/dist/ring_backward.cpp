// Ring attention's backward over MPI (include/qkv/dist.hpp; the layout and the forward ring in
// ring_attention.cpp): the K/V blocks go round the ring as in the forward, and the dK/dV
// accumulator of a block travels one step behind it: rank r computes its contribution into a
// fresh buffer while the accumulator from r-1 is in flight, adds it, and sends it on; after P
// steps each block's accumulator reaches its owner. dQ stays with its queries; dsinks need only
// the rows' O, dO and lse (merge.hpp).
#include "qkv/dist.hpp"

#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
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

// The local checks, then grad_output and forward.output shaped as q's leading dims + (n, Dv),
// lse as + (n).
std::string backward_problem(const Tensor& grad_output, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionResult& forward, const AttentionOptions& options, int ranks) {
  std::string problem = shard_problem(q, k, v, options, ranks);
  if (!problem.empty()) return problem;
  std::vector<int64_t> od = q.shape().dims(), ld = q.shape().dims();
  od.back() = v.size(-1);
  ld.pop_back();
  const Shape want_out(od), want_lse(ld);
  const auto bad = [](const Tensor& t, const Shape& want) { return !t.defined() || t.shape() != want; };
  const auto str = [](const Tensor& t) { return t.defined() ? t.shape().str() : std::string("undefined"); };
  if (bad(grad_output, want_out) || bad(forward.output, want_out) || bad(forward.lse, want_lse))
    return "grad_output " + str(grad_output) + ", forward.output " + str(forward.output) + " and forward.lse " +
           str(forward.lse) + " must be " + want_out.str() + ", " + want_out.str() + " and " + want_lse.str() +
           " (this rank's rows of ring_attention's result)";
  return "";
}

// What the backward ring works on: this rank's chunks of q, dO and the forward's rows, the dQ
// accumulators, the terms, and the K/V ring buffers (kv[0] holds this rank's block on entry).
struct Backward {
  Layout layout;
  BlockLayout bl;  // also the layout of a dK/dV accumulator
  Tensor kv[2];
  std::vector<Tensor> q_chunks, go_chunks, dq_chunks;
  std::vector<AttentionResult> forwards;  // per query chunk: the global output and lse rows
  Terms terms;
};

Backward enter(const Tensor& q4, const Tensor& k4, const Tensor& v4, const Tensor& go4, const Tensor& o4,
               const Tensor& lse4, const AttentionOptions& options, const Comm& comm, RingStats& stats) {
  Backward w;
  w.layout = make_layout(comm, q4.size(2), options.mask);
  const Layout& layout = w.layout;
  w.bl = block_layout(k4, v4, layout);
  w.kv[0] = workspace.get(0, Shape{w.bl.total()});
  w.kv[1] = workspace.get(1, Shape{w.bl.total()});
  std::vector<Tensor> k_chunks, v_chunks, o_chunks, lse_chunks;
  {
    Requests requests;
    w.q_chunks = scatter_chunks(q4, layout, comm, 0, requests, stats);
    k_chunks = scatter_chunks(k4, layout, comm, 1, requests, stats);
    v_chunks = scatter_chunks(v4, layout, comm, 2, requests, stats);
    w.go_chunks = scatter_chunks(go4, layout, comm, 3, requests, stats);
    o_chunks = scatter_chunks(o4, layout, comm, 4, requests, stats);
    lse_chunks = scatter_chunks(lse4, layout, comm, 5, requests, stats);
    w.terms = scatter_terms(options.mask, layout, comm, 6, requests, stats);
    requests.wait(stats);
  }
  load_block(w.bl, w.kv[0], k_chunks, v_chunks);
  for (int c = 0; c < layout.chunks; ++c) {
    AttentionResult f;
    f.output = o_chunks[static_cast<size_t>(c)];
    f.lse = lse_chunks[static_cast<size_t>(c)].squeeze(3);
    w.forwards.push_back(f);
    const Shape dq_shape = w.q_chunks[static_cast<size_t>(c)].shape();
    w.dq_chunks.push_back(layout.zigzag ? filled(workspace.get(7 + static_cast<size_t>(c), dq_shape), 0.0f)
                                        : Tensor::zeros(dq_shape));  // without zigzag: the result itself
  }
  return w;
}

// One step's pairs against `source`'s block in `current`: dQ into the query chunks' accumulators,
// dK and dV into `contribution` (laid out as a block), MPI progressed between the pairs.
void compute_step(Backward& w, const Tensor& current, int source, const Tensor& contribution,
                  const AttentionOptions& options, AttentionOptions& pair_options, AttentionGrads& g,
                  Requests& kv_requests, Requests& grad_recv, RingStats& stats) {
  const Layout& layout = w.layout;
  std::memset(contribution.data(), 0, sizeof(float) * static_cast<size_t>(w.bl.total()));
  for (int qc = 0; qc < layout.chunks; ++qc) {
    for (int kc = 0; kc < layout.chunks; ++kc) {
      const int64_t qs = layout.start(layout.rank, qc), ks = layout.start(source, kc);
      if (!pair_mask(options.mask, qs, layout.chunk, ks, layout.chunk, pair_options.mask)) continue;
      add_pair_terms(w.terms, qc, ks, layout.chunk, pair_options.mask);
      const size_t i = static_cast<size_t>(qc);
      detail::block_attention_backward_into(w.go_chunks[i], w.q_chunks[i], w.bl.k(current, kc), w.bl.v(current, kc),
                                            w.forwards[i], g, pair_options, qs - ks);
      add_into(w.dq_chunks[i].data(), g.dq.data(), g.dq.numel());
      add_into(w.bl.k(contribution, kc).data(), g.dk.data(), g.dk.numel());
      add_into(w.bl.v(contribution, kc).data(), g.dv.data(), g.dv.numel());
      ++stats.blocks_computed;
      kv_requests.poke();
      grad_recv.poke();
    }
  }
}

// The ring; returns the buffer where the accumulator of this rank's own block arrives after
// visiting every rank.
Tensor run_ring(Backward& w, const AttentionOptions& options, const Comm& comm, RingStats& stats) {
  const int p = w.layout.ranks, r = w.layout.rank;
  const int right = (r + 1) % p, left = (r + p - 1) % p;
  const int64_t total = w.bl.total();
  // dK/dV buffers: this step's contribution, the accumulator arriving from the left, and the one
  // leaving to the right (still in flight from the previous step).
  Tensor contribution = workspace.get(2, Shape{total});
  Tensor arriving = workspace.get(3, Shape{total});
  Tensor leaving = workspace.get(4, Shape{total});
  Requests grad_sends, grad_recv;
  AttentionOptions pair_options = options;
  pair_options.sinks = Tensor();  // forward.lse includes them; dsinks come from the rows alone
  AttentionGrads g;               // one pair's gradients, reused pair after pair
  for (int step = 0; step < p; ++step) {
    const Tensor& current = w.kv[step % 2];
    Requests kv_requests;
    if (step + 1 < p) {
      kv_requests.recv(w.kv[(step + 1) % 2].data(), total, left, kTagKv, comm.get());
      kv_requests.send(current.data(), total, right, kTagKv, comm.get(), stats);
    }
    if (step > 0) grad_recv.recv(arriving.data(), total, left, kTagGrad, comm.get());
    const auto compute_start = Clock::now();
    compute_step(w, current, (r - step + p) % p, contribution, options, pair_options, g, kv_requests, grad_recv, stats);
    stats.compute_seconds += seconds_since(compute_start);
    if (step > 0) {
      grad_recv.wait(stats);
      add_into(contribution.data(), arriving.data(), total);
    }
    grad_sends.wait(stats);  // the previous step's accumulator has left: its buffer is free
    std::swap(contribution, leaving);
    grad_sends.send(leaving.data(), total, right, kTagGrad, comm.get(), stats);
    kv_requests.wait(stats);
  }
  grad_recv.recv(arriving.data(), total, left, kTagGrad, comm.get());
  grad_recv.wait(stats);
  grad_sends.wait(stats);
  return arriving;
}

}  // namespace

AttentionGrads ring_attention_backward(const Tensor& grad_output, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const AttentionResult& forward, MPI_Comm parent, const AttentionOptions& options,
                                       RingStats* stats_out) {
  const auto start = Clock::now();
  RingStats stats;
  Comm comm(parent);
  agree(describe({q, k, v, grad_output, forward.lse}, options,
                 backward_problem(grad_output, q, k, v, forward, options, comm.size())),
        comm, "ring_attention_backward", {"q", "k", "v", "grad_output", "forward.lse"});

  const Tensor q4 = as4(q), k4 = as4(k), v4 = as4(v);
  const Tensor go4 = as4(grad_output), o4 = as4(forward.output);
  const Tensor lse4 = forward.lse.contiguous().reshape(Shape{q4.size(0), q4.size(1), q4.size(2), 1});
  Backward w = enter(q4, k4, v4, go4, o4, lse4, options, comm, stats);
  const Tensor arrived = run_ring(w, options, comm, stats);

  const Layout& layout = w.layout;
  std::vector<Tensor> dk_chunks, dv_chunks;
  for (int c = 0; c < layout.chunks; ++c) {
    dk_chunks.push_back(w.bl.k(arrived, c));
    dv_chunks.push_back(w.bl.v(arrived, c));
  }
  Tensor dq4 = layout.zigzag ? poisoned(q4.shape()) : w.dq_chunks[0];
  Tensor dk4 = poisoned(k4.shape()), dv4 = poisoned(v4.shape());
  if (layout.zigzag) gather_chunks(w.dq_chunks, dq4, layout, comm, 2, stats);
  gather_chunks(dk_chunks, dk4, layout, comm, 3, stats);
  gather_chunks(dv_chunks, dv4, layout, comm, 4, stats);
  AttentionGrads grads{dq4.reshape(q.shape()), dk4.reshape(k.shape()), dv4.reshape(v.shape()), Tensor(), Tensor()};
  if (options.sinks.defined()) grads.dsinks = ring_sink_gradients(go4, o4, lse4, options.sinks, comm);
  stats.total_seconds = seconds_since(start);
  if (stats_out) *stats_out = stats;
  return grads;
}

}  // namespace qkv::dist
