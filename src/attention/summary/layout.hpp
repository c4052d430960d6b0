// One summary worker's scratch beyond the flash forward's (flash::ForwardScratchLayout): offsets
// in floats from the end of that block, each part on its own cache line. br = queries per tile,
// k = summary_top_k, nk = keys. The kept weights are a query tile's P over every key tile it
// visits (br x Nk rounded up to whole key tiles): O(Nk) per worker, never Nq x Nk.
#pragma once

#include <cstddef>

#include "attention/flash/layout.hpp"

namespace qkv::detail::summary {

struct ScratchLayout {
  size_t k, tiles;
  size_t logits, old_max, key_sum, entropy, top_logits, top_keys, count, threshold, kept, kept_max, seen, factor;
  size_t total;

  ScratchLayout(size_t br, size_t k_, size_t nk) : k(k_), tiles((nk + flash::kKeyTile - 1) / flash::kKeyTile + 1) {
    flash::Parts parts;
    logits = parts.take(flash::kKeyTile * br);  // the tile's logits before the softmax makes them P
    old_max = parts.take(br);                   // running max before the tile's update
    key_sum = parts.take(br);                   // K per query: the sum of the keys' p (no sink)
    entropy = parts.take(br);                   // T per query
    top_logits = parts.take(k * br);            // per query, k logits, descending
    top_keys = parts.take(2 * k * br);          // per query, their int64 keys
    count = parts.take(2 * br);                 // per query, int64: keys in its top so far
    threshold = parts.take(br);                 // per query: the k-th logit, -inf until k, +inf padding
    kept = parts.take(tiles * flash::kKeyTile * br);  // P of each key tile
    kept_max = parts.take(tiles * br);                // the running max each was computed at
    seen = parts.take(tiles);                         // 1 where the key tile was visited
    factor = parts.take(br);
    total = parts.total();
  }
};

}  // namespace qkv::detail::summary
