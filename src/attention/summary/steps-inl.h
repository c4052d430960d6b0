// The summary steps, queries in the lanes (summary/forward.cpp): what a flash key tile adds to
// each query's summary, and what a finished query tile writes.
//
//   TopLogits     the tile's logits offered to each query's top k (softmax is monotone, so the
//                 top k weights are the top k logits): a vector compare against each query's
//                 k-th logit, and a sorted insertion for the lanes that pass (found from the
//                 compare's mask bits: a scalar loop over every lane cost a third of the kernel)
//   EntropyUpdate T = sum_j p_j (s_j - m) over the keys seen, with p_j = e^(s_j - m) at the
//                 running max m, moved to a grown max m' as l is: T' = c (T + (m - m') K), c =
//                 e^(m - m') (K, the keys' own sum, beside it); then entropy = (K log l - T) / l (see
//                 FinishRowSummaries)
//   KeepMax       the max each key tile's P was computed at (the kernel computes P in the tile's
//                 slot of the kept weights), for the received mass, folded in once the query
//                 tile's final max and sum are known (FoldReceived)
//
// Included inside a Highway foreach_target pass (the -inl.h convention), after
// attention/flash/operands-inl.h.
#if defined(QKV_ATTENTION_SUMMARY_STEPS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_SUMMARY_STEPS_INL_H_
#undef QKV_ATTENTION_SUMMARY_STEPS_INL_H_
#else
#define QKV_ATTENTION_SUMMARY_STEPS_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention/flash/layout.hpp"
#include "attention/summary/layout.hpp"
#include "attention/summary/summary.hpp"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace summary_steps {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
constexpr float kInf = std::numeric_limits<float>::infinity();

// One worker's summary scratch (summary::ScratchLayout), viewed as typed pointers.
struct SummaryScratch {
  float *logits, *old_max, *key_sum, *entropy, *top_logits, *threshold, *kept, *kept_max, *seen;
  int64_t *top_keys, *count;
  size_t k;
  SummaryScratch(float* base, const summary::ScratchLayout& l)
      : logits(base + l.logits), old_max(base + l.old_max), key_sum(base + l.key_sum), entropy(base + l.entropy),
        top_logits(base + l.top_logits), threshold(base + l.threshold), kept(base + l.kept),
        kept_max(base + l.kept_max), seen(base + l.seen), top_keys(reinterpret_cast<int64_t*>(base + l.top_keys)),
        count(reinterpret_cast<int64_t*>(base + l.count)), k(l.k) {}
};

// A query tile's start: no key in any top k, T = 0; lanes past `rows` (padding) never take a key.
inline void StartSummaries(size_t rows, size_t br, size_t tiles, const SummaryScratch& s) {
  std::fill_n(s.entropy, br, 0.0f);
  std::fill_n(s.key_sum, br, 0.0f);
  std::fill_n(s.count, br, 0);
  std::fill_n(s.threshold, br, -kInf);
  std::fill_n(s.threshold + rows, br - rows, kInf);
  std::fill_n(s.seen, tiles, 0.0f);
}

// Inserts (logit, key) into lane n's top k, sorted by logit descending; an equal logit goes after
// the ones already there (keys arrive in increasing order: ties to the lower index). Full, the
// k-th goes, and the lane's threshold becomes the new k-th: a later key with a logit equal to it
// cannot enter (its index is higher).
inline void InsertTop(size_t n, float logit, int64_t key, const SummaryScratch& s) {
  float* logits = s.top_logits + n * s.k;
  int64_t* keys = s.top_keys + n * s.k;
  size_t at = static_cast<size_t>(s.count[n]);
  if (at == s.k) --at;
  while (at > 0 && logit > logits[at - 1]) {
    logits[at] = logits[at - 1];
    keys[at] = keys[at - 1];
    --at;
  }
  logits[at] = logit;
  keys[at] = key;
  if (static_cast<size_t>(s.count[n]) < s.k) ++s.count[n];
  if (static_cast<size_t>(s.count[n]) == s.k) s.threshold[n] = logits[s.k - 1];
}

// The tile's logits (cols key lines of br queries; key j0 + j on line j) offered to the top k:
// a vector compare per line, then only the lanes that passed. Logits -inf (hidden keys) and NaN
// never pass.
template <size_t V>
HWY_INLINE void TopLogits(const float* HWY_RESTRICT logits, size_t cols, int64_t j0, const SummaryScratch& s) {
  const DF df;
  const size_t lanes = hn::Lanes(df), br = V * lanes;
  uint8_t bits[8] = {};
  for (size_t j = 0; j < cols; ++j)
    for (size_t n = 0; n < br; n += lanes) {
      const auto pass = hn::Gt(hn::Load(df, logits + j * br + n), hn::Load(df, s.threshold + n));
      if (hn::AllFalse(df, pass)) continue;
      hn::StoreMaskBits(df, pass, bits);
      uint64_t lanes_passed;
      std::memcpy(&lanes_passed, bits, sizeof(lanes_passed));
      for (; lanes_passed != 0; lanes_passed &= lanes_passed - 1) {
        const size_t x = n + static_cast<size_t>(__builtin_ctzll(lanes_passed));
        InsertTop(x, logits[j * br + x], j0 + static_cast<int64_t>(j), s);
      }
    }
}

// T moved to the new running max and the tile's terms added (s.logits: the tile's logits,
// weights: its P at the new max, correction: e^(old - new), old max saved before the softmax
// update). T sums over the keys alone (not the sink), so it moves by the keys' own sum K, kept
// beside it (K' = c K + the tile's sum). A query with no key yet (K = 0) has T = 0.
template <size_t V>
HWY_INLINE void EntropyUpdate(const float* HWY_RESTRICT weights, size_t cols, const float* HWY_RESTRICT running_max,
                              const float* HWY_RESTRICT correction, const SummaryScratch& s) {
  const DF df;
  const size_t lanes = hn::Lanes(df), br = V * lanes;
  const VF zero = hn::Zero(df);
  VF acc[V], max[V], keys[V];
  HWY_UNROLL(4)
  for (size_t n = 0; n < V; ++n) {
    const size_t at = n * lanes;
    max[n] = hn::Load(df, running_max + at);
    const VF c = hn::Load(df, correction + at), keys_sum = hn::Load(df, s.key_sum + at);
    const VF moved = hn::IfThenZeroElse(hn::Eq(keys_sum, zero),
                                        hn::Mul(hn::Sub(hn::Load(df, s.old_max + at), max[n]), keys_sum));
    acc[n] = hn::Mul(c, hn::Add(hn::Load(df, s.entropy + at), moved));
    keys[n] = hn::Mul(c, keys_sum);
  }
  for (size_t j = 0; j < cols; ++j) {
    HWY_UNROLL(4)
    for (size_t n = 0; n < V; ++n) {
      const VF p = hn::Load(df, weights + j * br + n * lanes);
      const VF term = hn::Mul(p, hn::Sub(hn::Load(df, s.logits + j * br + n * lanes), max[n]));
      acc[n] = hn::Add(acc[n], hn::IfThenZeroElse(hn::Eq(p, zero), term));
      keys[n] = hn::Add(keys[n], p);
    }
  }
  HWY_UNROLL(4)
  for (size_t n = 0; n < V; ++n) {
    hn::Store(acc[n], df, s.entropy + n * lanes);
    hn::Store(keys[n], df, s.key_sum + n * lanes);
  }
}

// Key tile `tile`'s P stays in its slot of s.kept (the kernel computes it there); keeps the
// running max it was computed at.
inline void KeepMax(size_t br, size_t tile, const float* HWY_RESTRICT running_max, const SummaryScratch& s) {
  std::copy_n(running_max, br, s.kept_max + tile * br);
  s.seen[tile] = 1.0f;
}

// received[j] += sum over the tile's queries of their final weight of key j, for every kept key
// tile: w = P e^(m_tile - M) / l. `inverse`: 1 / l per query (0 for an empty row, NaN for a NaN
// one), `max`: M; lanes past `rows` count 0. `kv_begin`, `kv_end`: the keys the tiles covered.
inline void FoldReceived(size_t tiles, int64_t kv_begin, int64_t kv_end, size_t rows, size_t br,
                         const float* HWY_RESTRICT max, const float* HWY_RESTRICT inverse,
                         float* HWY_RESTRICT factor, float* HWY_RESTRICT received, const SummaryScratch& s) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const VF zero = hn::Zero(df);
  const int64_t bc = static_cast<int64_t>(flash::kKeyTile);
  for (size_t t = 0; t < tiles; ++t) {
    if (s.seen[t] == 0.0f) continue;
    for (size_t n = 0; n < br; n += lanes) {
      const VF inv = hn::Load(df, inverse + n);
      const VF shift = hn::Sub(hn::Load(df, s.kept_max + t * br + n), hn::Load(df, max + n));
      hn::Store(hn::IfThenZeroElse(hn::Eq(inv, zero), hn::Mul(hn::Exp(df, shift), inv)), df, factor + n);
    }
    std::fill_n(factor + rows, br - rows, 0.0f);
    const int64_t j0 = kv_begin + static_cast<int64_t>(t) * bc;
    const size_t cols = static_cast<size_t>(std::min(bc, kv_end - j0));
    const float* p = s.kept + t * flash::kKeyTile * br;
    for (size_t j = 0; j < cols; ++j) {
      VF sum = zero;
      for (size_t n = 0; n < br; n += lanes)
        sum = hn::MulAdd(hn::Load(df, p + j * br + n), hn::Load(df, factor + n), sum);
      received[j0 + static_cast<int64_t>(j)] += hn::GetLane(hn::SumOfLanes(df, sum));
    }
  }
}

// Each of the tile's `rows` queries finished (max M, sum l, 1 / l): entropy = (log l) K / l -
// T / l (K / l: the keys' share of the weight, 1 without a sink), 0 for an empty row; its top
// keys with their weights e^(s - M) / l, a key whose weight is 0 dropped (-1, 0). Row r of the
// tile is row `row0 + r` of the outputs.
inline void FinishRowSummaries(size_t rows, const float* max, const float* sum, const float* inverse,
                               int64_t row0, const SummaryOutputs& out, const SummaryScratch& s) {
  const size_t k = s.k;
  for (size_t r = 0; r < rows; ++r) {
    const float l = sum[r], m = max[r], inv = inverse[r];
    const int64_t row = row0 + static_cast<int64_t>(r);
    out.entropy[row] = l == 0.0f ? 0.0f : std::log(l) * s.key_sum[r] * inv - s.entropy[r] * inv;
    float* weights = out.top_weights + row * static_cast<int64_t>(k);
    int64_t* keys = out.top_keys + row * static_cast<int64_t>(k);
    size_t e = 0;
    for (size_t x = 0; x < static_cast<size_t>(s.count[r]); ++x) {
      const float w = std::exp(s.top_logits[r * k + x] - m) * inv;
      if (!(w > 0.0f) && !std::isnan(w)) continue;
      weights[e] = w;
      keys[e++] = s.top_keys[r * k + x];
    }
    std::fill(weights + e, weights + k, 0.0f);
    std::fill(keys + e, keys + k, int64_t{-1});
  }
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace summary_steps
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // QKV_ATTENTION_SUMMARY_STEPS_INL_H_ toggle
