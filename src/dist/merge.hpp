// Ring attention's merges: each pair's (output, lse) into a query chunk's accumulators, the sinks
// once per row after the ring, and the sinks' gradient summed over the ranks. The arithmetic is
// attention/lse_merge.hpp's, shared with decode and the single-process backward.
#pragma once

#include "dist/comm.hpp"

namespace qkv::dist::ring {

// o1, lse1 (accumulated, (B, H, rows, D) and (B, H, rows)) <- their log-sum-exp merge with o2, lse2.
void merge(const Tensor& o1, const Tensor& lse1, const Tensor& o2, const Tensor& lse2);
// out and lse merged in place with the sinks, a key of logit sinks[h] and no value.
void merge_sinks(const Tensor& out, const Tensor& lse, const Tensor& sinks);
// dsinks from this rank's rows (go4, o4 (B, H, n, Dv), lse4 (B, H, n, 1)), summed over every rank.
Tensor ring_sink_gradients(const Tensor& go4, const Tensor& o4, const Tensor& lse4, const Tensor& sinks,
                           const Comm& comm);

}  // namespace qkv::dist::ring
