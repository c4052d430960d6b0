// One summary worker's scratch beyond the flash forward's (flash::ForwardScratchLayout): offsets
// in floats from the end of that block, each part on its own cache line. br = queries per tile,
// k = summary_top_k, nk = keys. The kept weights are a query tile's P over every key tile it
// visits (br x Nk rounded up to whole key tiles): O(Nk) per worker, never Nq x Nk.
#pragma once

#include <cstddef>

#include "attention/flash/layout.hpp"

namespace qkv::detail::summary {

// The top k's slots per query: k rounded up to 4, 8 or 16 (the kernel holds that many in
// registers, summary/steps-inl.h), k itself above 16; the slots above the k real ones hold +inf.
inline size_t top_slots(size_t k) { return k <= 4 ? 4 : k <= 8 ? 8 : k <= 16 ? 16 : k; }

struct ScratchLayout {
  size_t k, slots, tiles;
  size_t key_sum, entropy, top_logits, top_keys, kept, kept_max, seen, factor;
  size_t total;

  ScratchLayout(size_t br, size_t k_, size_t nk)
      : k(k_), slots(top_slots(k_)), tiles((nk + flash::kKeyTile - 1) / flash::kKeyTile + 1) {
    flash::Parts parts;
    key_sum = parts.take(br);                   // K per query: the sum of the keys' p (no sink)
    entropy = parts.take(br);                   // T per query
    top_logits = parts.take(slots * br);        // slots of br logits, descending
    top_keys = parts.take(slots * br);          // their int32 keys, -1 in an empty slot
    kept = parts.take(tiles * flash::kKeyTile * br);  // P of each key tile
    kept_max = parts.take(tiles * br);                // the running max each was computed at
    seen = parts.take(tiles);                         // 1 where the key tile was visited
    factor = parts.take(br);
    total = parts.total();
  }
};

}  // namespace qkv::detail::summary
