// The pairs' masks of ring attention (dist/pair_mask.hpp).
#include "dist/pair_mask.hpp"

#include <algorithm>
#include <utility>

namespace qkv::dist::ring {

bool pair_mask(const Mask& global, int64_t qs, int64_t lq, int64_t ks, int64_t lk, Mask& out) {
  out = Mask();
  if (global.has_band()) {
    // Global: qs + i + lo <= ks + j <= qs + i + hi, so locally i + (lo + qs - ks) <= j <= ...
    const bool lo_open = global.band_lo() <= -Mask::kUnbounded;
    const bool hi_open = global.band_hi() >= Mask::kUnbounded;
    int64_t lo = lo_open ? -lq : global.band_lo() + qs - ks;
    int64_t hi = hi_open ? lk : global.band_hi() + qs - ks;
    if (hi < -(lq - 1) || lo > lk - 1 || lo > hi) return false;
    lo = std::max(lo, -lq);  // every query already sees key 0 on this side: no constraint
    hi = std::min(hi, lk);   // every query already sees key lk - 1
    if (lo == -lq && hi == lk) {
      // the band hides nothing of this pair
    } else if (lo == -lq) {
      out = Mask::causal(hi);
    } else {
      out = Mask::window(hi - lo, 0, hi);
    }
  }
  if (global.has_key_lengths()) {
    std::vector<int64_t> lengths;
    bool any = false;
    for (int64_t length : global.lengths()) {
      lengths.push_back(std::clamp<int64_t>(length - ks, 0, lk));
      any = any || lengths.back() > 0;
    }
    if (!any) return false;
    out &= Mask::key_lengths(std::move(lengths));
  }
  return true;
}

Terms scatter_terms(const Mask& mask, const Layout& layout, const Comm& comm, int first_index, Requests& requests,
                    RingStats& stats) {
  Terms terms;
  terms.total = layout.n * layout.ranks;
  int index = first_index;
  for (const Mask::Term& term : mask.terms()) {
    const Tensor t4 = as4(term.values);
    Terms::Term t;
    t.additive = term.additive;
    if (layout.zigzag && t4.size(2) == layout.n) {
      t.chunks = scatter_chunks(t4, layout, comm, index++, requests, stats);
    } else {
      t.chunks.assign(static_cast<size_t>(layout.chunks), t4);
    }
    terms.list.push_back(std::move(t));
  }
  return terms;
}

void add_pair_terms(const Terms& terms, int qc, int64_t ks, int64_t lk, Mask& out) {
  for (const Terms::Term& t : terms.list) {
    Tensor c = t.chunks[static_cast<size_t>(qc)];
    if (c.size(3) == terms.total) c = c.narrow(3, ks, lk);
    out &= t.additive ? Mask::additive(c) : Mask::keep(c);
  }
}

}  // namespace qkv::dist::ring
