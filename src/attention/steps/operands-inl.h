// Step "load a tile", operands read in place: a residue's rows as a view (EveryStepRows), rows
// fetched ahead (PrefetchRows), whether rows are finite (RowsFinite: a non-finite V takes the
// accumulation that skips zero weights), and the strided residues' query tile.
//
// Included inside a Highway foreach_target pass (the -inl.h convention), through pipeline-inl.h or
// on its own.

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_ATTENTION_STEPS_OPERANDS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_STEPS_OPERANDS_INL_H_
#undef QKV_ATTENTION_STEPS_OPERANDS_INL_H_
#else
#define QKV_ATTENTION_STEPS_OPERANDS_INL_H_
#endif

#include <cstddef>
#include <cstdint>

#include "attention/problem.hpp"
#include "attention/steps/lines-inl.h"
#include "gemm/micro_kernel-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace pipeline {
namespace hn = hwy::HWY_NAMESPACE;

// ---- The strided residues (flash, flash backward): a root `rest | strided(S, O)` rule's strided
// keys run apart as dense tiles of queries i0, i0 + S, ... against keys j0, j0 + S, ....
// Their query tile: kResidueVectors vectors, so that the micro-GEMM still runs 8 accumulator
// chains (kTileRows x vectors) while a residue's few queries waste few lanes (W6: 64 queries a
// residue, each seeing the residue's earlier keys).
constexpr size_t kResidueVectors = tile_gemm::kTileRows >= 8 ? 1 : 2;
HWY_INLINE size_t ResidueTileRows() { return kResidueVectors * hn::Lanes(DF()); }

// Rows first, first + step, ... of an operand, as rows 0, 1, ... of a view (a residue's queries or keys).
template <class T>
HWY_INLINE Rows<T> EveryStepRows(const Rows<T>& rows, int64_t first, int64_t step) {
  return {rows.data + first * rows.row_stride, rows.batch_stride, rows.head_stride, rows.row_stride * step};
}

// Prefetches rows first, first + step, ... (`count` of them, `floats` each) of head (b, h) into
// L2 (locality hint 2: prefetcht1 on x86), for writing when `write`, so that a kernel fetches the
// rows it reads next while it computes: rows a stride apart (a residue's) defeat the hardware
// prefetchers, and contiguous ones read in bursts (a query tile's) outrun them.
template <class T>
HWY_INLINE void PrefetchRows(const Rows<T>& rows, int64_t b, int64_t h, int64_t first, int64_t step, int64_t count,
                             int64_t floats, bool write = false) {
  for (int64_t x = 0; x < count; ++x) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(rows.row(b, h, first + x * step));
    const uintptr_t end = begin + static_cast<uintptr_t>(floats) * sizeof(T);
    for (uintptr_t line = begin & ~uintptr_t{63}; line < end; line += 64) {
      if (write) {
        __builtin_prefetch(reinterpret_cast<const void*>(line), 1, 2);
      } else {
        __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 2);
      }
    }
  }
}

// True when the `rows` rows of `cols` floats (row stride `stride`) are all finite.
HWY_INLINE bool RowsFinite(const float* HWY_RESTRICT values, size_t rows, size_t cols, int64_t stride) {
  for (size_t r = 0; r < rows; ++r)
    if (!tile_gemm::AllFinite(values + static_cast<int64_t>(r) * stride, cols)) return false;
  return true;
}

}  // namespace pipeline
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
