// MultiHeadAttention's forward by heads (src/nn/mha_by_heads.cpp): its test hook.
#pragma once

#include <cstdint>

namespace qkv::detail {

// How many forwards have taken the by-heads path in this process (tests check which path a
// forward took: both give the same output).
uint64_t mha_by_heads_forwards_for_test();

// While > 0, the region opens this many threads, whatever the workers its heads are dealt to:
// a team smaller than asked for (as OpenMP may give), whose ownerless shares the others take.
// 0 restores the default. Returns the previous value.
int set_mha_by_heads_team_for_test(int team);

}  // namespace qkv::detail
