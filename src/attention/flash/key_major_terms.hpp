// The flash kernels' key-major copies of tensor mask terms, and of a bias's gradient.
//
// A term laid out by query rows, (.., Nq, Nk), is read by a tile's key lines one query row apart:
// Br rows Nk floats apart per line, which the hardware prefetchers do not follow and which map to
// a few L1 sets, so the mask step (steps/tile_mask-inl.h, MaskTerms) gathered one float per score
// and missed L1 on each (W1-bias forward 1.7 x W1, its backward with dbias 1.6 x W1-bwd; the
// bias gradient the same way; docs/flex.md). KeyMajorTerms copies each such term transposed,
// (.., Nk, Nq), once per call (by register transposes), and points the problem's term at the
// copy, so that a tile's line reads whole vectors; with a bias gradient asked for, it points
// grad_bias at a key-major accumulator too, which finish() writes into dbias transposed back.
// Each copy has the term's own size (never B x H x Nq x Nk for a broadcast term), in the calling
// thread's workspace (core/allocator.hpp), kept for its next call. A term without query rows (broadcast over
// queries, or Nq below one vector of queries) is left as it is (its line is one value), as is
// one broadcast over keys (key-major elements would each hold a part of one dbias element).
#pragma once

#include <cstdint>

#include "attention/problem.hpp"
#include "core/allocator.hpp"

namespace qkv::detail {

class KeyMajorTerms {
 public:
  // The forward's terms (flash and summary forwards): every term with query rows, rewired.
  explicit KeyMajorTerms(AttentionProblem& p);
  // The backward's: its forward's terms, and grad_bias when asked for (the additive term's
  // gradient; a bias without query rows or broadcast over keys keeps its own layout and view).
  explicit KeyMajorTerms(AttentionBackwardProblem& bp);
  // After the kernel: dbias = the key-major gradient, transposed (nothing when not rewired).
  void finish() const;

 private:
  KeyMajorTerms(AttentionProblem& p, BiasGradView* grad, WorkspaceSlot slot);

  BiasGradView dbias_;               // the caller's dbias
  float* key_major_grad_ = nullptr;  // (Bt, Ht, Nk, Nq), null: not rewired
  int64_t planes_b_ = 1, planes_h_ = 1, q_len_ = 0, kv_len_ = 0;
};

}  // namespace qkv::detail
