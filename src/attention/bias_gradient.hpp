// The gradient of an additive mask term, the bias: dL/dbias = dL/d(logit) summed over the dims
// the bias broadcasts over, shaped as the bias (AttentionGrads::dbias).
//
// The bias is added to the modified scores (after softcap, ALiBi and a score function; forward
// step 3 of reference/backward.cpp), so its gradient is the softmax's, dS = P (dP - D), before
// any modifier's slope; a hidden score has P = 0 and gives exactly 0. Every score (b, h, i, j)
// adds its dS into the one element of dbias it read its bias from: a bias (1, Hq, Nq, Nk) over a
// batch of 4 gets each element as the sum of 4 dS, and nothing of size B x Hq x Nq x Nk is ever
// made. Elements no score reaches (keys past the last visible one) stay 0.
//
// Who adds where (races):
//  - the reference backward runs its (b, h) one after another: add_bias_gradient_row per row;
//  - the flash backward's items are (b, g, chunk of keys) (flash/backward.cpp); each pair of
//    tiles adds its dS with the step AddBiasGradientTile (steps/bias_gradient-inl.h), by
//    dbias's rows through register transposes when it has them. Two items may add
//    into the same element only when they differ only in dims the bias broadcasts over;
//    bias_waves sorts the items into waves of items that never share an element, each wave the
//    same positions over the other dims, so the items at one position across the waves are the
//    ones that share: the flash backward runs each such group on one worker in wave order (the
//    groups in parallel). No atomics, no copies per thread, every element gets its terms in the
//    same order whatever the thread count (the same bits on a repeat), and a group's next item
//    finds its part of dbias still in cache. A bias (1, Hq, Nq, Nk) over B batches makes groups
//    of B items; a full (B, Hq, Nq, Nk) bias, or B = 1, groups of one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace qkv::detail {

// Where dS of score (b, h, i, j) is added: data[b stride_b + h stride_h + i stride_q + j stride_k],
// stride 0 on every dim the bias broadcasts over. data null: no bias gradient asked for.
struct BiasGradView {
  float* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_q = 0, stride_k = 0;

  float* row(int64_t b, int64_t h, int64_t i) const { return data + b * stride_b + h * stride_h + i * stride_q; }
};

// Reference: adds ds[j] (the dS of query i of head (b, h), keys 0 .. count - 1) into dbias.
inline void add_bias_gradient_row(const BiasGradView& g, int64_t b, int64_t h, int64_t i, const float* ds,
                                  int64_t count) {
  float* row = g.row(b, h, i);
  for (int64_t j = 0; j < count; ++j) row[j * g.stride_k] += ds[j];
}

// The flash backward's items (b, g, chunk), item = (b kv_heads + g) splits + chunk, sorted into
// waves whose items never add into the same dbias element (above), each wave of the same size,
// position n of every wave the same (b, g, chunk) but for the broadcast dims. Returns the items in
// wave order, `starts` the first of each wave (and a last entry, the count). Without a bias
// gradient: one wave of every item in order.
inline std::vector<int64_t> bias_waves(const BiasGradView& g, int64_t batch, int64_t q_heads, int64_t kv_heads,
                                       int64_t splits, std::vector<int64_t>& starts) {
  const int64_t items = batch * kv_heads * splits;
  // A dim the bias broadcasts over (stride 0) joins the wave key; query heads broadcast across
  // kv heads when the bias has one head (a group's own heads run inside one item).
  const bool by_b = g.data && g.stride_b == 0 && batch > 1;
  const bool by_g = g.data && g.stride_h == 0 && q_heads > 1 && kv_heads > 1;
  const bool by_chunk = g.data && g.stride_k == 0 && splits > 1;
  const int64_t waves = (by_b ? batch : 1) * (by_g ? kv_heads : 1) * (by_chunk ? splits : 1);
  std::vector<std::vector<int64_t>> members(static_cast<size_t>(waves));
  for (int64_t item = 0; item < items; ++item) {
    const int64_t pair = item / splits, chunk = item % splits, b = pair / kv_heads, gh = pair % kv_heads;
    const int64_t wave = ((by_b ? b : 0) * (by_g ? kv_heads : 1) + (by_g ? gh : 0)) * (by_chunk ? splits : 1) +
                         (by_chunk ? chunk : 0);
    members[static_cast<size_t>(wave)].push_back(item);
  }
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(items));
  starts.assign(1, 0);
  for (const std::vector<int64_t>& m : members) {
    order.insert(order.end(), m.begin(), m.end());
    starts.push_back(static_cast<int64_t>(order.size()));
  }
  return order;
}

// The number of waves bias_waves makes of the (b, g) pairs (chunks aside): the flash backward
// splits each pair's keys into more chunks when fewer groups of pairs run at once.
inline int64_t bias_pair_waves(const BiasGradView& g, int64_t batch, int64_t q_heads, int64_t kv_heads) {
  const bool by_b = g.data && g.stride_b == 0 && batch > 1;
  const bool by_g = g.data && g.stride_h == 0 && q_heads > 1 && kv_heads > 1;
  return (by_b ? batch : 1) * (by_g ? kv_heads : 1);
}

}  // namespace qkv::detail
