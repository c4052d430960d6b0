// A head's queries as query tiles of whole SIMD vectors: tiles of max_vectors vectors, except that
// a remainder under half a tile shares the last whole tile's vectors as evenly as can be. The
// flash forward (flash/forward.cpp) and backward (flash/backward.cpp) both run a head's queries this way.
// Forward, 3-vector tiles: 256 queries are 4 x 48 + 2 x 32, not 5 x 48 + 16 (a one-vector
// tile's micro-GEMM, 8 broadcasts and 1 load per 8 FMAs, waits on loads). Backward, 6-vector
// tiles: 512 queries are 4 x 96 + 2 x 64, not 5 x 96 + 32, whose 2-vector products would run 32
// deep. The remainder is not spread over every tile (2 x 96 + 4 x 80): an 80-query tile's
// products run as a 3- and a 2-vector panel. For 3-vector tiles the two rules give the same
// tiles. (Measured: docs/performance-log.md, "flash/".)
#pragma once

#include <algorithm>
#include <cstdint>

namespace qkv::detail {

struct QueryTiles {
  int64_t nq, lanes, max_vectors;
  int64_t whole;                 // tiles of max_vectors vectors, first
  int64_t tail[2] = {0, 0};      // the vectors of the (at most two) tiles after them
  int64_t count;

  QueryTiles(int64_t nq_, int64_t lanes_, int64_t max_vectors_) : nq(nq_), lanes(lanes_), max_vectors(max_vectors_) {
    const int64_t vectors = (nq + lanes - 1) / lanes, left = vectors % max_vectors;
    whole = vectors / max_vectors;
    if (left > 0 && whole > 0 && 2 * left < max_vectors) {
      --whole;
      tail[0] = (max_vectors + left + 1) / 2;
      tail[1] = (max_vectors + left) / 2;
    } else {
      tail[0] = left;
    }
    count = whole + (tail[0] > 0 ? 1 : 0) + (tail[1] > 0 ? 1 : 0);
  }
  // The tile's vectors (its queries' lanes, padding included), first query and query count.
  int64_t vectors(int64_t tile) const { return tile < whole ? max_vectors : tail[tile - whole]; }
  int64_t first_query(int64_t tile) const {
    return lanes * (std::min(tile, whole) * max_vectors + (tile > whole ? tail[0] : 0));
  }
  int64_t rows(int64_t tile) const { return std::min(lanes * vectors(tile), nq - first_query(tile)); }
};

}  // namespace qkv::detail
