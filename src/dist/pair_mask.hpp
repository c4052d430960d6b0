// The caller's mask seen by one (query chunk, key chunk) pair of ring attention: the band and key
// lengths shifted to the pair's positions, and the tensor terms' view of the pair.
#pragma once

#include <cstdint>
#include <vector>

#include "dist/comm.hpp"
#include "dist/shards.hpp"

namespace qkv::dist::ring {

// The caller's mask for the pair (query chunk at global row qs, key chunk at global row ks, lq
// and lk rows), in the chunks' local positions. Returns false when no key of the chunk is
// visible to any query of it (the pair is skipped).
bool pair_mask(const Mask& global, int64_t qs, int64_t lq, int64_t ks, int64_t lk, Mask& out);

// The caller's tensor terms per query chunk, as (Bm, Hm, rows or 1, N or 1): a term with a row
// per query travels with the queries in the zigzag exchange (tensor index `first_index` on), one
// that broadcasts over the queries serves every chunk as it is.
struct Terms {
  struct Term {
    std::vector<Tensor> chunks;
    bool additive = false;
  };
  std::vector<Term> list;
  int64_t total = 0;  // N, the global number of keys
};

Terms scatter_terms(const Mask& mask, const Layout& layout, const Comm& comm, int first_index, Requests& requests,
                    RingStats& stats);

// Adds the terms' part for query chunk `qc` and the lk keys from global row ks (views, no copy).
void add_pair_terms(const Terms& terms, int qc, int64_t ks, int64_t lk, Mask& out);

}  // namespace qkv::dist::ring
