// qkv::Mask: which keys each query may attend to. Say what you mean:
//
//   Mask::causal(offset = 0)        query i (absolute position offset + i) sees keys j <= offset + i
//   Mask::window(left, right = 0)   query i sees keys i - left <= j <= i + right (local attention)
//   Mask::key_lengths({5, 3})       padding: batch b sees its first lengths[b] keys
//   Mask::keep(t)                   tensor, nonzero = attend, 0 = masked (TinyTorch, SDPA bool)
//   Mask::additive(t)               tensor added to the scores: 0 = attend, -inf = masked (PyTorch float)
//   Mask::strided(S, O = 0)         query i sees keys j with (O + i - j) mod S == 0 (Sparse Transformer)
//   Mask::global_tokens(G)          the first G keys are seen by every query, the first G queries
//                                   see every key (Longformer, BigBird)
//   Mask::block_sparse(layout, bq, bk)  block (a, c) of the keep tensor `layout` lets queries
//                                   a*bq..a*bq+bq-1 see keys c*bk..c*bk+bk-1 (DeepSpeed, BigBird)
//   Mask::parse("causal & (window(127) | strided(128)) | global(16)")  the same in text
//
// Masks combine with `&` (a key is visible only when every part allows it; additive tensors add
// up) and `|` (visible when either allows it; & binds tighter, as in C++). A union with an
// additive tensor is an error: a bias has no "either" meaning. Structured parts stay symbolic,
// so a fast kernel never builds an n x n matrix for them: the parts joined by `&` at the top
// that are causal, window or key lengths are normalised into one band lo(i) <= j <= hi(i) plus
// per-batch lengths; everything else (unions, strided, global, block-sparse) stays a boolean
// expression of rules, rule(), that kernels evaluate per element and classify per tile.
//
// Tensor masks broadcast over the attention scores (B, Hq, Nq, Nk) from 2-D (Nq, Nk),
// 3-D (B, Nq, Nk) or 4-D (B, Hq, Nq, Nk), where any dim may also be 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <map>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

class MaskFunction;  // qkv/flex.hpp

// A mask expression that does not parse: the message quotes the expression, the column and the
// bad token; column() is that 1-based column.
class MaskParseError : public Error {
 public:
  MaskParseError(const std::string& message, size_t column) : Error(message), column_(column) {}
  size_t column() const { return column_; }

 private:
  size_t column_;
};

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
  // Query i sees key j when (offset + i - j) mod stride == 0 (a true modulo: -1 mod 4 = 3); stride >= 1.
  static Mask strided(int64_t stride, int64_t offset = 0);
  // Key j is visible to query i when j < count or i < count; count >= 0.
  static Mask global_tokens(int64_t count);
  // layout: a keep tensor of blocks, (ceil(Nq / block_q), ceil(Nk / block_k)) or (Hq, ...) with
  // a leading query-head dim (of size Hq or 1); nonzero = the block is visible. Checked against
  // the problem's shapes when attention runs.
  static Mask block_sparse(Tensor layout, int64_t block_q, int64_t block_k);
  // A mask function (FlexAttention's mask_mod) as text: key k is visible to query q of head h,
  // batch b where `text` is true, e.g. "doc(q) == doc(k)" or "k < 4 || k <= q" (the language of
  // score and mask functions: docs/flex.md). `inputs` are the named tensors the text reads, each
  // (L) or (B, L) float32, indexed by q, k, h or b (L covering the index). Parsed here (throws
  // MaskParseError); the inputs' shapes are checked when attention runs.
  static Mask expression(const std::string& text, std::map<std::string, Tensor> inputs = {});
  // A mask function in C++ (qkv::mask_function of a callable, qkv/flex.hpp); kernels treat it as
  // they treat expression(), block map included.
  static Mask function(std::shared_ptr<const MaskFunction> f);

  // The mask a text expression describes; throws MaskParseError. Grammar (spaces free):
  //   expression := conjunction ("|" conjunction)*
  //   conjunction := primary ("&" primary)*
  //   primary    := "(" expression ")" | none | causal | window(L) | window(L, R) | padding(N)
  //               | key_lengths(N, ...) | strided(S) | strided(S, O) | global(N)
  // with whole numbers >= 0 (padding's N and strided's S >= 1); or, as the whole text,
  //   "mask:" followed by a mask function (expression() without inputs).
  static Mask parse(const std::string& expression);

  friend Mask operator&(const Mask& a, const Mask& b);
  Mask& operator&=(const Mask& other);
  friend Mask operator|(const Mask& a, const Mask& b);
  Mask& operator|=(const Mask& other);

  bool is_none() const;  // true when the mask hides nothing

  // A node of the symbolic part of the rule: a leaf rule, or `&` / `|` of two nodes.
  struct Rule {
    enum class Kind { Band, KeyLengths, Strided, Global, BlockSparse, Keep, Expression, And, Or };
    Kind kind = Kind::Band;
    int64_t lo = 0, hi = 0;            // Band: i + lo <= j <= i + hi
    int64_t stride = 1, offset = 0;    // Strided: (offset + i - j) mod stride == 0
    int64_t count = 0;                 // Global: j < count or i < count
    int64_t block_q = 1, block_k = 1;  // BlockSparse: layout[h][i / block_q][j / block_k] != 0
    std::vector<int64_t> lengths;      // KeyLengths: j < lengths[b]
    Tensor tensor;                     // Keep: the keep tensor; BlockSparse: the layout
    std::string expression;                 // Expression: the mask function's text (or:)
    std::shared_ptr<const MaskFunction> function;  // Expression: a C++ mask function (flex.hpp)
    std::map<std::string, Tensor> inputs;   // Expression: its named inputs
    std::shared_ptr<const Rule> left, right;  // And, Or
  };
  // The symbolic rule ANDed with the normalised band, lengths and terms below; nullptr when none.
  const std::shared_ptr<const Rule>& rule() const { return rule_; }

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

  // The mask in parse()'s syntax, e.g. "causal & (window(255) | strided(256))"; parts outside
  // the grammar print in a descriptive form parse() does not read: causal(offset=3),
  // window(2, 0, offset=1), keep(4, 4), additive(4, 4), block_sparse(2, 2; 64, 64).
  std::string str() const;

 private:
  // The whole mask as one rule tree (band, lengths, keep terms and rule ANDed); for `|`.
  std::shared_ptr<const Rule> as_rule() const;

  int64_t band_lo_ = -kUnbounded;
  int64_t band_hi_ = kUnbounded;
  bool has_key_lengths_ = false;
  std::vector<int64_t> lengths_;
  std::vector<Term> terms_;
  std::shared_ptr<const Rule> rule_;
  std::string text_;        // str(), empty for none
  bool text_is_or_ = false;  // text_'s top operator is `|` (parenthesised under `&`)
};

// The (n, n) keep matrix of a causal mask: 1 on and below the diagonal, 0 above.
Tensor create_causal_mask(int64_t n);
// The (B, 1, 1, max_len) keep tensor of a padding mask: 1 for j < lengths[b], else 0.
Tensor create_padding_mask(const std::vector<int64_t>& lengths, int64_t max_len);

}  // namespace qkv
