// How qkv's GEMM kernels cut a product into blocks of work and lay out rows in scratch: the
// arithmetic small.cpp, tiled.cpp, rows.cpp and micro_kernel-inl.h share. (src/attention/kernels.hpp
// has a size_t round_up of its own; these are in their own namespace so that both can be seen.)
#pragma once

#include <concepts>

namespace qkv::detail::layout {

// a / b rounded up (a >= 0, b >= 1).
template <std::integral T>
constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// a rounded up to a multiple of `multiple`: a row's floats padded to whole lines or vectors.
template <std::integral T>
constexpr T round_up(T a, T multiple) {
  return ceil_div(a, multiple) * multiple;
}

// How many blocks of about `about` items cover `items` when `threads` threads share them: a
// multiple of the threads, so that every thread's share is as even as can be.
template <std::integral T>
constexpr T block_count(T items, T about, T threads) {
  return round_up(ceil_div(items, about), threads);
}

// The size of each of `blocks` blocks covering `items`, in whole tiles of `tile` items.
template <std::integral T>
constexpr T tile_block_size(T items, T blocks, T tile) {
  return round_up(ceil_div(items, blocks), tile);
}

}  // namespace qkv::detail::layout
