// The symbolic part of a mask as a kernel reads it (Mask::rule(), normalised by build_problem):
// a boolean expression of rules (band, key lengths, strided, global tokens, block-sparse layout,
// keep tensor) joined by & and |, that a kernel evaluates per element (visible) and per tile
// (classify: hidden, partial or fully visible). It is ANDed with the problem's band, key
// lengths and tensor terms.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "mask/mod_expression.hpp"
#include "qkv/flex.hpp"
#include "qkv/mask.hpp"

namespace qkv::detail {

// A tensor mask as a kernel reads it: the value for scores element (b, h, i, j) is
//   data[b * stride_b + h * stride_h + i * stride_q + j * stride_k],
// with stride 0 on every broadcast dim.
struct MaskTermView {
  const float* data;
  int64_t stride_b, stride_h, stride_q, stride_k;
  bool additive;  // false: keep (0 = masked); true: added to the scaled score

  float at(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return data[b * stride_b + h * stride_h + i * stride_q + j * stride_k];
  }
};

// How a mask treats a tile of queries x keys: no pair visible, some, or every pair.
enum class TileVisibility { Hidden, Partial, Full };

// The true modulo, in [0, m) for m >= 1 (-1 mod 4 = 3).
inline int64_t floor_mod(int64_t a, int64_t m) {
  const int64_t r = a % m;
  return r < 0 ? r + m : r;
}

struct RuleNode {
  using Kind = Mask::Rule::Kind;
  Kind kind = Kind::Band;
  int64_t lo = 0, hi = 0;            // Band: i + lo <= j <= i + hi
  int64_t stride = 1, offset = 0;    // Strided: (offset + i - j) mod stride == 0
  int64_t count = 0;                 // Global: j < count or i < count
  int64_t block_q = 1, block_k = 1;  // BlockSparse: view.at(0, h, i / block_q, j / block_k) != 0
  std::vector<int64_t> lengths;      // KeyLengths: j < lengths[b]
  MaskTermView view{};               // Keep (per element) or BlockSparse (per block)
  std::shared_ptr<const ModExpression> expression;  // Expression: the mask function as text, or
  std::shared_ptr<const MaskFunction> function;     // Expression: as C++ (qkv/flex.hpp)
  std::vector<ModInput> inputs;                     // Expression: its inputs, in its order
  std::shared_ptr<const class ModBlocks> blocks;    // Expression: its block map, or null (mod_blocks.hpp)
  int left = -1, right = -1;         // And, Or: indices of the children in MaskRule::nodes
};

struct MaskRule {
  std::vector<RuleNode> nodes;  // children before their parents; the root is the last
  int root_node = -1;           // >= 0: evaluate this node as the root instead (a kernel's part)

  bool empty() const { return nodes.empty(); }
  int root() const { return root_node >= 0 ? root_node : static_cast<int>(nodes.size()) - 1; }
  // Whether key j is visible to query i of head h, batch b, under node `node` (the root by default).
  bool visible(int64_t b, int64_t h, int64_t i, int64_t j, int node = -2) const;
  // A mask function node over the `count` elements of a line: out[x] = 1 where it shows the key.
  void function_line(int node, const ModLine& line, size_t count, float* out) const;
  // The tile of queries [i0, i1] x keys [j0, j1] (inclusive) of head h, batch b. A mask function
  // is read from its block map (FlexAttention's block mask, made once per call) when it has one,
  // else evaluated over the whole tile.
  TileVisibility classify(int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1, int node = -2) const;
};

// A rule `rest | strided(stride, offset)` (either order) at the root: the strided keys are a few
// diagonals j - i = offset (mod stride) that a fused kernel can gather by residues instead of
// scanning tiles, leaving `rest` to the tiles. rest < 0: the rule has no such form (or stride < min_stride).
struct StridedSplit {
  int rest = -1;
  int64_t stride = 0, offset = 0;

  // The residue class of the keys query i meets: j = i + offset (mod stride). Queries i0, i0 + S,
  // ... (a "residue" of queries) and keys j0, j0 + S, ... with j0 = key_residue(i0) meet as a
  // dense queries x keys block, which a kernel computes as a tile.
  int64_t key_residue(int64_t i) const { return floor_mod(i + offset, stride); }
  // The number of keys of residue `residue` (in [0, stride)) before key `end`: key index c of
  // the residue is residue + c * stride, so [from, to) of keys is [keys_before(from), keys_before(to)).
  int64_t keys_before(int64_t residue, int64_t end) const {
    return end <= residue ? 0 : (end - residue + stride - 1) / stride;
  }
};
StridedSplit strided_split(const MaskRule& rule, int64_t min_stride);

// The rule a kernel's tiles evaluate once the strided keys of `split` are gathered apart: `rest`
// alone. A rest that is one band (the Sparse Transformer's window) narrows [band_lo, band_hi]
// instead and leaves no rule, so the tiles mask it in SIMD from the band and skip the tiles it hides.
MaskRule rest_rule(const MaskRule& rule, const StridedSplit& split, int64_t& band_lo, int64_t& band_hi);

// The rule of `mask` for a problem (B, Hq, Nq, Nk): each node checked (key lengths one per batch
// in [0, Nk], a block layout of (ceil(Nq/bq), ceil(Nk/bk)) or (Hq or 1, ...), a mask function's
// inputs covering what it indexes them by); keep tensors
// read through `keep_view`, which checks their broadcast and keeps them alive. Errors start with `who`.
MaskRule compile_mask_rule(const char* who, const Mask& mask, int64_t batch, int64_t q_heads, int64_t q_len,
                           int64_t kv_len, const std::function<MaskTermView(const Tensor&)>& keep_view,
                           std::vector<Tensor>& held);

}  // namespace qkv::detail
