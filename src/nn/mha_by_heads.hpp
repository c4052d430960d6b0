// MultiHeadAttention's forward by heads (src/nn/mha_by_heads.cpp): its test hook.
#pragma once

#include <cstdint>

namespace qkv::detail {

// How many forwards have taken the by-heads path in this process (tests check which path a
// forward took: both give the same output).
uint64_t mha_by_heads_forwards_for_test();

}  // namespace qkv::detail
