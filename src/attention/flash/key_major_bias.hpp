// The flash backward's key-major copy of a bias and of its gradient.
//
// A bias laid out by query rows, (.., Nq, Nk), is read by a tile's key lines one query row apart:
// Br rows Nk floats apart per line, which the hardware prefetchers do not follow and which map to
// a few L1 sets, so the mask step (steps/tile_mask-inl.h, MaskTerms) and the bias gradient each
// missed L1 once per element (W1-bias-bwd, (1, 12, 512, 512): 1.6 x W1-bwd before this copy;
// docs/flex.md). KeyMajorBias copies the bias transposed, (.., Nk, Nq), once per call, and points
// the problem's term and grad_bias at key-major storage, so that a tile's line reads and adds
// whole vectors; finish() writes the accumulated gradient into dbias transposed back. Each copy
// has the bias's own size (never B x H x Nq x Nk for a broadcast bias), in storage this thread
// keeps for its next call. A bias without query rows (broadcast over queries, or Nq = 1) is left
// as it is (its line is one value), as is one broadcast over keys (key-major elements would
// each hold a part of one dbias element).
#pragma once

#include <cstdint>

#include "attention/problem.hpp"

namespace qkv::detail {

class KeyMajorBias {
 public:
  // Rewires bp's additive term and grad_bias (both must be there) when the bias has query rows.
  explicit KeyMajorBias(AttentionBackwardProblem& bp);
  // After the kernel: dbias = the key-major gradient, transposed (nothing when not rewired).
  void finish() const;

 private:
  BiasGradView dbias_;               // the caller's dbias
  float* key_major_grad_ = nullptr;  // (Bt, Ht, Nk, Nq), null: not rewired
  int64_t planes_b_ = 1, planes_h_ = 1, q_len_ = 0, kv_len_ = 0;
};

}  // namespace qkv::detail
