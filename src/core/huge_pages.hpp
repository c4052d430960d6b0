// Transparent huge pages for the library's own long-lived pools.
#pragma once

#include <cstddef>

#include "qkv/tensor.hpp"

namespace qkv::detail {

// Asks the kernel to back the 2 MB-aligned part of [data, data + bytes) with transparent huge
// pages (Linux madvise(MADV_HUGEPAGE), which THP's default "madvise" mode needs; elsewhere
// nothing). For buffers streamed in full (a KV cache: a TLB miss every 4 KB on small pages) and
// pools read with a large stride (a paged KV cache's rows of one head lie Hkv x D elements
// apart, a new 4 KB page per key): call it before the memory is first written, as pages faulted
// in before stay 4 KB. A hint: a refusal is ignored. Defined in allocator.cpp.
void advise_huge_pages(void* data, size_t bytes);

// Tensor::zeros(shape, dtype) whose memory is advised for huge pages before the zeros first
// touch it: the long-lived K/V buffers of nn::KVCache and nn::PagedKVCache, which decode streams
// in full every step (fewer TLB misses: docs/inference.md). Defined in tensor.cpp.
Tensor zeros_on_huge_pages(const Shape& shape, DType dtype);

}  // namespace qkv::detail
