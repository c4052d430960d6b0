// qkv::Mask: which keys each query may attend to. Say what you mean:
//
//   Mask::causal(offset = 0)        query i (absolute position offset + i) sees keys j <= offset + i
//   Mask::window(left, right = 0)   query i sees keys i - left <= j <= i + right (local attention)
//   Mask::key_lengths({5, 3})       padding: batch b sees its first lengths[b] keys
//   Mask::keep(t)                   tensor, nonzero = attend, 0 = masked (TinyTorch, SDPA bool)
//   Mask::additive(t)               tensor added to the scores: 0 = attend, -inf = masked (PyTorch float)
//
// Masks combine with `&`: a key is visible only when every part allows it (additive tensors
// add up). Structured parts stay symbolic, so a fast kernel never builds an n x n matrix for
// them: causal and window are normalised into one band, lo(i) <= j <= hi(i).
//
// Tensor masks broadcast over the attention scores (B, Hq, Nq, Nk) from 2-D (Nq, Nk),
// 3-D (B, Nq, Nk) or 4-D (B, Hq, Nq, Nk), where any dim may also be 1.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qkv/tensor.hpp"

namespace qkv {

class Mask {
 public:
  // An unbounded band edge: large enough that no sequence reaches it, small enough that
  // query + edge never overflows int64.
  static constexpr int64_t kUnbounded = int64_t{1} << 60;

  Mask() = default;  // attend everywhere

  static Mask causal(int64_t offset = 0);
  // Query i sees keys j with offset + i - left <= j <= offset + i + right; left, right >= 0.
  static Mask window(int64_t left, int64_t right = 0, int64_t offset = 0);
  static Mask key_lengths(std::vector<int64_t> lengths);  // one length per batch
  static Mask keep(Tensor keep);        // nonzero = attend
  static Mask additive(Tensor scores);  // added to the scaled scores; -inf = masked

  friend Mask operator&(const Mask& a, const Mask& b);
  Mask& operator&=(const Mask& other);

  bool is_none() const;  // true when the mask hides nothing

  // The normalised rule the kernels implement. Key j is visible to query i of batch b when
  //   i + band_lo() <= j <= i + band_hi(),
  //   j < lengths()[b] (if has_key_lengths()), and every tensor term allows it.
  int64_t band_lo() const { return band_lo_; }
  int64_t band_hi() const { return band_hi_; }
  bool has_band() const { return band_lo_ > -kUnbounded || band_hi_ < kUnbounded; }
  bool has_key_lengths() const { return has_key_lengths_; }
  const std::vector<int64_t>& lengths() const { return lengths_; }
  struct Term {
    Tensor values;
    bool additive;  // false: a keep tensor (nonzero = attend); true: added to the scores
  };
  const std::vector<Term>& terms() const { return terms_; }

  std::string str() const;  // "causal(offset=0) & key_lengths(2, 5)", for messages and printing

 private:
  int64_t band_lo_ = -kUnbounded;
  int64_t band_hi_ = kUnbounded;
  bool has_key_lengths_ = false;
  std::vector<int64_t> lengths_;
  std::vector<Term> terms_;
  std::vector<std::string> parts_;  // what the user said, for str()
};

// The (n, n) keep matrix of a causal mask: 1 on and below the diagonal, 0 above.
Tensor create_causal_mask(int64_t n);
// The (B, 1, 1, max_len) keep tensor of a padding mask: 1 for j < lengths[b], else 0.
Tensor create_padding_mask(const std::vector<int64_t>& lengths, int64_t max_len);

}  // namespace qkv
