// The summary steps, queries in the lanes (summary/forward.cpp): what a flash key tile adds to
// each query's summary, and what a finished query tile writes.
//
//   TopLogits     the tile's logits offered to each query's top k (softmax is monotone, so the
//                 top k weights are the top k logits), kept as k vectors of logits and k of keys
//                 per query vector, slot 0 the largest: a key line is one compare against the k-th
//                 slot per vector, and only a vector where some lane passes is inserted, all its
//                 lanes at once, by blends from the bottom slot up to the highest slot that moves
//                 (one scalar insertion per lane, with its mispredicted branches and its
//                 store-to-load stalls, was a fifth of the kernel)
//   EntropyTerms  in the softmax's own passes (pipeline::SoftmaxColumnsUpdateWith), no pass and
//                 no copy of its own: T = sum_j p_j (s_j - m) over the keys seen, with p_j =
//                 e^(s_j - m) at the running max m, moved to a grown max m' as l is: T' = c (T +
//                 (m - m') K), c = e^(m - m') (K, the keys' own sum, beside it); then entropy =
//                 (K log l - T) / l (see FinishRowSummaries)
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

using DI = hn::RebindToSigned<DF>;
using VI = hn::Vec<DI>;

// One worker's summary scratch (summary::ScratchLayout), viewed as typed pointers. The top k of
// query lane x: slot r at top_logits[r * br + x] and top_keys[r * br + x], logits descending, the
// k real slots the last k of `slots` (the ones above hold +inf: nothing displaces them).
struct SummaryScratch {
  float *key_sum, *entropy, *top_logits, *kept, *kept_max, *seen;
  int32_t* top_keys;
  size_t k, slots;
  SummaryScratch(float* base, const summary::ScratchLayout& l)
      : key_sum(base + l.key_sum), entropy(base + l.entropy), top_logits(base + l.top_logits), kept(base + l.kept),
        kept_max(base + l.kept_max), seen(base + l.seen), top_keys(reinterpret_cast<int32_t*>(base + l.top_keys)),
        k(l.k), slots(l.slots) {}
};

// A query tile's start: T = K = 0, the k real slots empty (logit -inf, key -1: nothing is greater
// than -inf, so a hidden key never enters), the slots above them +inf; lanes past `rows`
// (padding) +inf in every slot, so they never take a key.
inline void StartSummaries(size_t rows, size_t br, size_t tiles, const SummaryScratch& s) {
  std::fill_n(s.entropy, br, 0.0f);
  std::fill_n(s.key_sum, br, 0.0f);
  const size_t first = s.slots - s.k;
  std::fill_n(s.top_logits, first * br, kInf);
  for (size_t r = first; r < s.slots; ++r) {
    std::fill_n(s.top_logits + r * br, rows, -kInf);
    std::fill_n(s.top_logits + r * br + rows, br - rows, kInf);
  }
  std::fill_n(s.top_keys, s.slots * br, int32_t{-1});
  std::fill_n(s.seen, tiles, 0.0f);
}

// One sorted insertion of logit x of key `key` into S slots (slot 0 the largest) in every lane at
// once, all from the old slots, no chain from slot to slot: with above_r = x > slot r, slot r
// takes slot r - 1 where above_(r-1), else x where above_r, else keeps its own. Strictly above: an
// equal logit goes below the ones already there (keys arrive in increasing order: ties to the
// lower index); a lane where x is not above the last slot is unchanged, and NaN never enters.
template <size_t S>
HWY_INLINE void InsertHeld(VF x, VI key, VF* HWY_RESTRICT top, VI* HWY_RESTRICT keys) {
  const DI di;
  HWY_UNROLL(16)
  for (size_t r = S - 1; r > 0; --r) {
    const auto above = hn::Gt(x, top[r]), shift = hn::Gt(x, top[r - 1]);
    top[r] = hn::IfThenElse(shift, top[r - 1], hn::IfThenElse(above, x, top[r]));
    keys[r] = hn::IfThenElse(hn::RebindMask(di, shift), keys[r - 1],
                             hn::IfThenElse(hn::RebindMask(di, above), key, keys[r]));
  }
  const auto above = hn::Gt(x, top[0]);
  top[0] = hn::IfThenElse(above, x, top[0]);
  keys[0] = hn::IfThenElse(hn::RebindMask(di, above), key, keys[0]);
}

// The tile's logits (cols key lines of br queries; key j0 + j on line j) offered to the top k of
// the query vector at lane `at`, its S slots held in registers: per line one compare against the
// last slot, an insertion only where some lane passes (after a row's first keys, rarely: about
// k / j of a lane's keys at key j). Logits -inf (hidden keys) and NaN never pass.
template <size_t S>
HWY_INLINE void TopLogitsHeld(const float* HWY_RESTRICT logits, size_t cols, size_t br, int64_t j0, size_t at,
                              const SummaryScratch& s) {
  const DF df;
  const DI di;
  VF top[S];
  VI keys[S];
  HWY_UNROLL(16)
  for (size_t r = 0; r < S; ++r) {
    top[r] = hn::Load(df, s.top_logits + r * br + at);
    keys[r] = hn::Load(di, s.top_keys + r * br + at);
  }
  for (size_t j = 0; j < cols; ++j) {
    const VF x = hn::Load(df, logits + j * br + at);
    if (HWY_LIKELY(hn::AllFalse(df, hn::Gt(x, top[S - 1])))) continue;
    InsertHeld<S>(x, hn::Set(di, static_cast<int32_t>(j0 + static_cast<int64_t>(j))), top, keys);
  }
  HWY_UNROLL(16)
  for (size_t r = 0; r < S; ++r) {
    hn::Store(top[r], df, s.top_logits + r * br + at);
    hn::Store(keys[r], di, s.top_keys + r * br + at);
  }
}

// The same for more than 16 slots, in memory: from the last slot up to the first no lane moves past.
HWY_INLINE void TopLogitsInMemory(const float* HWY_RESTRICT logits, size_t cols, size_t br, int64_t j0, size_t at,
                                  const SummaryScratch& s) {
  const DF df;
  const DI di;
  float* top = s.top_logits + at;
  int32_t* keys = s.top_keys + at;
  for (size_t j = 0; j < cols; ++j) {
    const VF x = hn::Load(df, logits + j * br + at);
    auto above = hn::Gt(x, hn::Load(df, top + (s.slots - 1) * br));
    if (HWY_LIKELY(hn::AllFalse(df, above))) continue;
    const VI key = hn::Set(di, static_cast<int32_t>(j0 + static_cast<int64_t>(j)));
    for (size_t r = s.slots - 1; r > 0; --r) {
      const VF prior = hn::Load(df, top + (r - 1) * br);
      const auto shift = hn::Gt(x, prior);
      hn::Store(hn::IfThenElse(shift, prior, hn::IfThenElse(above, x, hn::Load(df, top + r * br))), df, top + r * br);
      hn::Store(hn::IfThenElse(hn::RebindMask(di, shift), hn::Load(di, keys + (r - 1) * br),
                               hn::IfThenElse(hn::RebindMask(di, above), key, hn::Load(di, keys + r * br))),
                di, keys + r * br);
      above = shift;
      if (hn::AllFalse(df, above)) break;
    }
    if (!hn::AllFalse(df, above)) {
      hn::Store(hn::IfThenElse(above, x, hn::Load(df, top)), df, top);
      hn::Store(hn::IfThenElse(hn::RebindMask(di, above), key, hn::Load(di, keys)), di, keys);
    }
  }
}

// The tile's logits offered to the top k of each of its V query vectors.
template <size_t V>
HWY_INLINE void TopLogits(const float* HWY_RESTRICT logits, size_t cols, int64_t j0, const SummaryScratch& s) {
  const size_t lanes = hn::Lanes(DF()), br = V * lanes;
  for (size_t at = 0; at < br; at += lanes) {
    if (s.slots == 4) {
      TopLogitsHeld<4>(logits, cols, br, j0, at, s);
    } else if (s.slots == 8) {
      TopLogitsHeld<8>(logits, cols, br, j0, at, s);
    } else if (s.slots == 16) {
      TopLogitsHeld<16>(logits, cols, br, j0, at, s);
    } else {
      TopLogitsInMemory(logits, cols, br, j0, at, s);
    }
  }
}

// The entropy's terms, added in the softmax's passes (pipeline::SoftmaxColumnsUpdateWith's
// `extra`): per query vector, T and K moved to the tile's max (Moved), p (s - m) added to T per
// weight (Weight: d = s - m; where p is 0, d may be -inf, clamped so the term is 0, not NaN; a
// NaN weight keeps T NaN), the tile's sum added to K (Summed). A query with no key yet (K = 0)
// has T = 0.
template <size_t V>
struct EntropyTerms {
  const SummaryScratch& s;
  VF terms[V], keys[V];

  explicit EntropyTerms(const SummaryScratch& scratch) : s(scratch) {}
  HWY_INLINE void Moved(size_t n, VF old_max, VF new_max, VF factor) {
    const DF df;
    const size_t at = n * hn::Lanes(df);
    const VF keys_sum = hn::Load(df, s.key_sum + at);
    const VF moved = hn::IfThenZeroElse(hn::Eq(keys_sum, hn::Zero(df)), hn::Mul(hn::Sub(old_max, new_max), keys_sum));
    terms[n] = hn::Mul(factor, hn::Add(hn::Load(df, s.entropy + at), moved));
    keys[n] = hn::Mul(factor, keys_sum);
  }
  HWY_INLINE void Weight(size_t n, VF d, VF weight) {
    terms[n] = hn::MulAdd(weight, hn::Max(d, hn::Set(DF(), -100.0f)), terms[n]);
  }
  HWY_INLINE void Summed(size_t n, VF tile_sum) {
    const DF df;
    const size_t at = n * hn::Lanes(df);
    hn::Store(terms[n], df, s.entropy + at);
    hn::Store(hn::Add(keys[n], tile_sum), df, s.key_sum + at);
  }
};

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
inline void FinishRowSummaries(size_t rows, size_t br, const float* max, const float* sum, const float* inverse,
                               int64_t row0, const SummaryOutputs& out, const SummaryScratch& s) {
  const size_t k = s.k;
  for (size_t r = 0; r < rows; ++r) {
    const float l = sum[r], m = max[r], inv = inverse[r];
    const int64_t row = row0 + static_cast<int64_t>(r);
    out.entropy[row] = l == 0.0f ? 0.0f : std::log(l) * s.key_sum[r] * inv - s.entropy[r] * inv;
    float* weights = out.top_weights + row * static_cast<int64_t>(k);
    int64_t* keys = out.top_keys + row * static_cast<int64_t>(k);
    size_t e = 0;
    for (size_t x = s.slots - k; x < s.slots && s.top_keys[x * br + r] >= 0; ++x) {
      const float w = std::exp(s.top_logits[x * br + r] - m) * inv;
      if (!(w > 0.0f) && !std::isnan(w)) continue;
      weights[e] = w;
      keys[e++] = s.top_keys[x * br + r];
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
