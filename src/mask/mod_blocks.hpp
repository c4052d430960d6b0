// A mask function's block map (FlexAttention's block mask, made once per call): the visibility of
// every kBlock x kBlock block of queries x keys, so that classifying a kernel's tile reads a few
// bytes instead of evaluating the function over the tile's every pair (which cost as much as the
// attention it skips: docs/flex.md). Built when the problem is built (mask/rule.cpp) for problems
// of at most kMaxPairs pairs; larger ones classify by evaluating the tile (MaskRule::classify).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "mask/mod_expression.hpp"
#include "mask/rule.hpp"
#include "qkv/flex.hpp"

namespace qkv::detail {

class ModBlocks {
 public:
  static constexpr int64_t kBlock = 16;
  // Pairs (B Hq Nq Nk, or fewer when the function reads neither b nor h) evaluated at most.
  static constexpr double kMaxPairs = double{1 << 24};
  // Pairs from which the map is built on every thread.
  static constexpr double kParallelPairs = double{1 << 18};

  // The map of mask function `e` over inputs `inputs` for a problem (B, Hq, Nq, Nk); null when
  // the problem is too large (kMaxPairs) or empty.
  static std::shared_ptr<const ModBlocks> build(const ModExpression& e, const std::vector<ModInput>& inputs,
                                                int64_t batch, int64_t q_heads, int64_t q_len, int64_t kv_len);
  // The same of a C++ mask function (qkv/flex.hpp), per batch and head only where it says it
  // reads them.
  static std::shared_ptr<const ModBlocks> build(const MaskFunction& f, int64_t batch, int64_t q_heads, int64_t q_len,
                                                int64_t kv_len);

  // The tile queries [i0, i1] x keys [j0, j1] of head h, batch b: Hidden or Full when every block
  // it touches is, else Partial (a block partly covered may be Partial where the tile is not: the
  // answer is then Partial, which is always correct); nullopt for a tile outside Nq x Nk.
  std::optional<TileVisibility> classify(int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1) const;

 private:
  // Evaluates one query's keys: line(coordinates, count, out, the thread's scratch).
  using LineFunction = std::function<void(const ModLine&, size_t, float*, std::vector<float>&)>;
  static std::shared_ptr<const ModBlocks> build_from(const LineFunction& line, bool reads_batch, bool reads_head,
                                                     int64_t batch, int64_t q_heads, int64_t q_len, int64_t kv_len);

  int64_t batches_ = 1, heads_ = 1, q_len_ = 0, kv_len_ = 0, q_blocks_ = 0, k_blocks_ = 0;
  std::vector<TileVisibility> blocks_;  // [batch][head][query block][key block]
};

}  // namespace qkv::detail
