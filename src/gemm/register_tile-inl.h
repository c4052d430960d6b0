// The register tile qkv's GEMM kernels are built on, compiled once per Highway target (include it
// inside a foreach_target pass, as Highway's -inl.h convention asks):
//   gemm/micro_kernel-inl.h  MicroTile, the fused kernels' and the Tiled path's C (+)= A B
//   gemm/small.cpp           the Small path's x W^T dot tiles
//   gemm/rows.cpp            rows_gemm's tiles on W in its stored dtype
//   attention/steps/dot_scores-inl.h  decode's score tile (and the flash backward's decode order)
//   attention/decode/tiles-inl.h      decode's value tile
// A tile is R x V vector accumulators that stay in registers across a loop over depth; a step adds
// one depth step (or one vector of depth) to them, in one of two forms:
//   BroadcastSteps  acc[r][v] += A(r, k) b_k[v]: an element of A broadcast against the V vectors
//                   of B's step k, which a loader gives (C's row r is V vectors of outputs)
//   DotStep         acc[r][o] += x_r * w_o lane by lane: vector partial sums of R x O dot products,
//                   which the caller reduces across lanes once at the end
// A dot tile's partial sums become outputs through ReduceDots. WithConstant turns a run-time
// remainder of rows or vectors into a tile of its own size.
// Loaders are types or callables, never function pointers: every step is inlined into the tile's
// loop, which the accumulators must not leave. Operands of float or a 16-bit type are widened in
// registers (simd/kv_load-inl.h's LoadWide).

// Per-target include guard (Highway's pattern: toggles once per target).
#if defined(QKV_GEMM_REGISTER_TILE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_GEMM_REGISTER_TILE_INL_H_
#undef QKV_GEMM_REGISTER_TILE_INL_H_
#else
#define QKV_GEMM_REGISTER_TILE_INL_H_
#endif

#include <cstddef>
#include <type_traits>

#include "hwy/highway.h"
#include "simd/kv_load-inl.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace tile_gemm {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// The register file: 32 vector registers on every AVX-512 target (later ones included), 16 on the
// others. Tiles size their accumulators by it.
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
constexpr bool kWideRegisterFile = true;
#else
constexpr bool kWideRegisterFile = false;
#endif
// Rows of a tile four columns wide (four vectors of B, or four dot products): 4 x 4 = 16
// accumulators + 4 loads + up to 4 more on 32 registers; the 16-register targets halve the rows,
// 8 + 4 + up to 4.
constexpr size_t kFourWideColumns = 4;
constexpr size_t kFourWideRows = kWideRegisterFile ? 4 : 2;

// Calls body(std::integral_constant<size_t, n>()) for a run-time 1 <= n <= Max, so the remainder
// of a register tile gets its own fully unrolled instance.
template <size_t Max, class Body>
HWY_INLINE void WithConstant(size_t n, const Body& body) {
  if constexpr (Max >= 1) {
    if (n == Max) return body(std::integral_constant<size_t, Max>());
    WithConstant<Max - 1>(n, body);
  }
}

// acc[r][v] = C's vector v of row r, c + r * ldc + v * lanes (StoreTile's layout), when
// `accumulate`; else 0.
template <size_t R, size_t V>
HWY_INLINE void LoadTileOrZero(VF (&acc)[R][V], bool accumulate, const float* HWY_RESTRICT c, size_t ldc) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  HWY_UNROLL(16)  // fully: the accumulators must live in registers
  for (size_t r = 0; r < R; ++r) {
    HWY_UNROLL(16)
    for (size_t v = 0; v < V; ++v) acc[r][v] = accumulate ? hn::LoadU(df, c + r * ldc + v * lanes) : hn::Zero(df);
  }
}

template <size_t R, size_t V>
HWY_INLINE void ZeroTile(VF (&acc)[R][V]) {
  LoadTileOrZero(acc, false, nullptr, 0);
}

template <size_t R, size_t V>
HWY_INLINE void StoreTile(const VF (&acc)[R][V], float* HWY_RESTRICT c, size_t ldc) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  HWY_UNROLL(16)
  for (size_t r = 0; r < R; ++r) {
    HWY_UNROLL(16)
    for (size_t v = 0; v < V; ++v) hn::StoreU(acc[r][v], df, c + r * ldc + v * lanes);
  }
}

// The loaders of a step's V vectors: `out[v]` from p + v * lanes (consecutive vectors of a row of
// B), or from p + v * ld (the same columns of V rows, ld elements apart: W's rows in a dot tile).
template <size_t V, class T>
HWY_INLINE void LoadConsecutive(const T* HWY_RESTRICT p, VF (&out)[V]) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  HWY_UNROLL(16)
  for (size_t v = 0; v < V; ++v) out[v] = kv::LoadWide(df, p + v * lanes);
}
template <size_t V, class T>
HWY_INLINE void LoadStrided(const T* HWY_RESTRICT p, size_t ld, VF (&out)[V]) {
  const DF df;
  HWY_UNROLL(16)
  for (size_t v = 0; v < V; ++v) out[v] = kv::LoadWide(df, p + v * ld);
}

// acc (+)= A B over `depth` steps: A(r, k) = a[r * a_row + k * a_depth], broadcast (the broadcast
// folds into the FMA); load_b(k, b) fills b[0 .. V) with B's step k (and may do more first, as
// MicroTile's prefetches).
template <size_t R, size_t V, class LoadB>
HWY_INLINE void BroadcastSteps(size_t depth, const float* HWY_RESTRICT a, size_t a_row, size_t a_depth,
                               const LoadB& load_b, VF (&acc)[R][V]) {
  const DF df;
  for (size_t k = 0; k < depth; ++k) {
    const float* HWY_RESTRICT a_col = a + k * a_depth;
    VF b[V];
    load_b(k, b);
    HWY_UNROLL(16)
    for (size_t r = 0; r < R; ++r) {
      const VF a_elem = hn::Set(df, a_col[r * a_row]);
      HWY_UNROLL(16)
      for (size_t v = 0; v < V; ++v) acc[r][v] = hn::MulAdd(a_elem, b[v], acc[r][v]);
    }
  }
}

// The third loader: the same columns of O rows anywhere, rows[o] + offset (keys read in place).
template <size_t O, class T>
HWY_INLINE void LoadGathered(const T* const* rows, size_t offset, VF (&out)[O]) {
  const DF df;
  HWY_UNROLL(16)
  for (size_t o = 0; o < O; ++o) out[o] = kv::LoadWide(df, rows[o] + offset);
}

// One vector of depth of R x O dot products: acc[r][o] += x(r) * wv[o] lane by lane, x's rows ldx
// apart from the step's first element, W's step already loaded.
template <size_t R, size_t O>
HWY_INLINE void DotStep(const float* HWY_RESTRICT x, size_t ldx, const VF (&wv)[O], VF (&acc)[R][O]) {
  const DF df;
  HWY_UNROLL(16)
  for (size_t r = 0; r < R; ++r) {
    const VF xv = hn::LoadU(df, x + r * ldx);
    HWY_UNROLL(16)
    for (size_t o = 0; o < O; ++o) acc[r][o] = hn::MulAdd(xv, wv[o], acc[r][o]);
  }
}
// The same with W's rows (float or 16-bit) ldw apart from the step's first element.
template <size_t R, size_t O, class T>
HWY_INLINE void DotStep(const float* HWY_RESTRICT x, size_t ldx, const T* HWY_RESTRICT w, size_t ldw,
                        VF (&acc)[R][O]) {
  VF wv[O];
  LoadStrided(w, ldw, wv);
  DotStep(x, ldx, wv, acc);
}

// A dot tile's outputs: out(r, o, sum) with sum = the lanes of acc[r][o] added (SumOfLanes), for
// the caller to add its scalar tail to and store.
template <size_t R, size_t O, class Out>
HWY_INLINE void ReduceDots(const VF (&acc)[R][O], const Out& out) {
  const DF df;
  HWY_UNROLL(16)
  for (size_t r = 0; r < R; ++r) {
    HWY_UNROLL(16)
    for (size_t o = 0; o < O; ++o) out(r, o, hn::GetLane(hn::SumOfLanes(df, acc[r][o])));
  }
}

}  // namespace tile_gemm
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
