// small_rows_gemm (gemm/small.hpp): y = alpha x W^T + beta y as dot products of x rows with W rows, a
// register tile of kRows x kOutputs accumulators at a time (each a vector of partial sums over k,
// reduced once at the end), so W streams through once per kRows rows and is never packed.
//
// Highway's foreach_target re-includes this file once per SIMD target; the threading and the
// exported entry point live in the HWY_ONCE part below.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "gemm/small.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "gemm/register_tile-inl.h"
#include "hwy/highway.h"

#ifndef QKV_NN_SMALL_GEMM_ONCE
#define QKV_NN_SMALL_GEMM_ONCE
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "simd/item_shares.hpp"
#include "core/allocator.hpp"
#include "qkv/error.hpp"
#include "gemm/layout.hpp"
#include "gemm/small.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using tile_gemm::DF;
using tile_gemm::DotStep;
using tile_gemm::VF;

// The tile: kRows x kOutputs accumulators + kOutputs W vectors + 1 x vector must fit the
// register file: 5 x 4 + 5 = 25 of AVX-512's 32; 4 x 3 + 4 = 16 of the 16-register targets
// (W5's 20 rows are 5 tiles of 4, where 3 x 3 left 2 rows to 1 x 3 tiles, 3 accumulators that
// wait on the FMA latency).
#undef QKV_SMALL_GEMM_WIDE_TILE  // once per target
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3  // every AVX-512 target, later ones included
#define QKV_SMALL_GEMM_WIDE_TILE 1
constexpr size_t kRows = 5, kOutputs = 4;
constexpr bool kWideTile = true;
#else
#define QKV_SMALL_GEMM_WIDE_TILE 0
constexpr size_t kRows = 4, kOutputs = 3;
constexpr bool kWideTile = false;
#endif

bool WideTile() { return kWideTile; }
size_t TileOutputs() { return kOutputs; }

#if HWY_TARGET != HWY_SCALAR
using D4 = hn::Full128<float>;
using V4 = hn::Vec<D4>;

// v's lanes added down to 128 bits (four partial sums), by halves.
template <class D>
HWY_INLINE V4 To128(D /*d*/, hn::Vec<D> v) {
  if constexpr (hn::MaxLanes(D()) <= 4) {
    return v;
  } else {
    const hn::Half<D> dh;
    return To128(dh, hn::Add(hn::LowerHalf(dh, v), hn::UpperHalf(dh, v)));
  }
}

// The sums of a, b, c and d's four lanes each, in lanes 0-3.
HWY_INLINE V4 SumsOf4(V4 a, V4 b, V4 c, V4 d) {
  const D4 d4;
  const V4 ab = hn::Add(hn::InterleaveLower(d4, a, b), hn::InterleaveUpper(d4, a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
  const V4 cd = hn::Add(hn::InterleaveLower(d4, c, d), hn::InterleaveUpper(d4, c, d));
  return hn::Add(hn::ConcatLowerLower(d4, cd, ab), hn::ConcatUpperUpper(d4, cd, ab));
}
#endif

#if QKV_SMALL_GEMM_WIDE_TILE
// The sums of a, b, c and d's 16 lanes each, in lanes 0-3, by one tree over all four: halves of
// a and c (b and d) added into one vector, then 128-bit blocks of those two, then lanes within
// the blocks; 16 vector ops where To128 of each and SumsOf4 take 25, beside the tile's 640 FMAs
// at k = 512.
HWY_INLINE V4 SumsOf4Wide(VF a, VF b, VF c, VF d) {
  const DF df;
  // a's partial sums in blocks 0-1, c's in 2-3 (likewise b and d).
  const VF ac = hn::Add(hn::ConcatUpperLower(df, c, a), hn::ConcatLowerUpper(df, c, a));
  const VF bd = hn::Add(hn::ConcatUpperLower(df, d, b), hn::ConcatLowerUpper(df, d, b));
  // Block x holds four partial sums of output x.
  const VF blocks = hn::Add(hn::OddEvenBlocks(hn::SwapAdjacentBlocks(bd), ac),
                            hn::OddEvenBlocks(bd, hn::SwapAdjacentBlocks(ac)));
  VF sums = hn::Add(blocks, hn::Shuffle1032(blocks));
  sums = hn::Add(sums, hn::Shuffle2301(sums));  // every lane of block x: output x's sum
  alignas(64) static constexpr int32_t kFirstOfBlocks[16] = {0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12};
  const VF firsts = hn::TableLookupLanes(sums, hn::SetTableIndices(df, kFirstOfBlocks));
  return hn::LowerHalf(hn::LowerHalf(firsts));
}
#endif

#if HWY_TARGET != HWY_SCALAR
// The sums of a row's accumulators o .. o + 3 (zero past O), in lanes 0-3.
template <size_t O>
HWY_INLINE V4 SumsAt(const VF* acc, size_t o) {
#if QKV_SMALL_GEMM_WIDE_TILE
  if constexpr (O % 4 == 0) return SumsOf4Wide(acc[o], acc[o + 1], acc[o + 2], acc[o + 3]);
#endif
  const DF df;
  const D4 d4;
  V4 part[4];
  HWY_UNROLL(4)
  for (size_t q = 0; q < 4; ++q) part[q] = o + q < O ? To128(df, acc[std::min(o + q, O - 1)]) : hn::Zero(d4);
  return SumsOf4(part[0], part[1], part[2], part[3]);
}
#endif

// y = alpha sums + bias + beta y for the tile's R x O dot products (acc: their vector partial
// sums; bias: the tile's O outputs' terms, or null for none), y not read when beta is 0.
template <size_t R, size_t O>
HWY_INLINE void StoreSums(const VF (&acc)[R][O], float alpha, const float* HWY_RESTRICT bias, float beta,
                          float* HWY_RESTRICT y, size_t ldy) {
#if HWY_TARGET == HWY_SCALAR
  for (size_t r = 0; r < R; ++r) {
    for (size_t o = 0; o < O; ++o) {
      const float sum = alpha * hn::GetLane(acc[r][o]) + (bias ? bias[o] : 0.0f);
      float& out = y[r * ldy + o];
      out = beta == 0.0f ? sum : sum + beta * out;
    }
  }
#else
  // Each row's sums by fours (SumsAt: on AVX-512 one tree over four accumulators, SumsOf4Wide;
  // elsewhere a vector's halves added down to 128 bits, then four of them transposed and added,
  // SumsOf4), one lane per output; y's outputs updated four at once where the tile is four wide
  // (AVX-512), else (3 wide, or leftover outputs) one by one.
  const D4 d4;
  HWY_UNROLL(16)
  for (size_t r = 0; r < R; ++r) {
    HWY_UNROLL(16)
    for (size_t o = 0; o < O; o += 4) {
      V4 sums = hn::Mul(hn::Set(d4, alpha), SumsAt<O>(acc[r], o));
      float* HWY_RESTRICT out = y + r * ldy + o;
      if (o + 4 <= O) {
        if (bias) sums = hn::Add(sums, hn::LoadU(d4, bias + o));
        hn::StoreU(beta == 0.0f ? sums : hn::MulAdd(hn::Set(d4, beta), hn::LoadU(d4, out), sums), d4, out);
      } else {
        HWY_ALIGN float four[4];
        hn::Store(sums, d4, four);
        for (size_t q = 0; o + q < O; ++q) {
          const float sum = four[q] + (bias ? bias[o + q] : 0.0f);
          out[q] = beta == 0.0f ? sum : sum + beta * out[q];
        }
      }
    }
  }
#endif
}

// y[r, o] = alpha sum_i x[r, i] w[o, i] + beta y[r, o] for r < R, o < O (y not read when beta is
// 0): x rows ldx apart, w rows ldw apart, y rows ldy apart, k terms. Not inlined, and its loops
// unrolled down to the stores: the k loop holds R x O accumulators, O W vectors and an x vector,
// and inlined into the loop over tiles (as it was) GCC kept that loop's scalars (alpha, beta, a
// pointer) in vector registers, spilled a W vector that R FMAs a step reloaded, and stored every
// accumulator to the stack to sum it with a scalar tail loop. The k % lanes tail is one more
// step on zero-padded copies, and the sums go by fours (SumsAt).
template <size_t R, size_t O>
HWY_NOINLINE void Tile(const float* HWY_RESTRICT x, size_t ldx, const float* HWY_RESTRICT w, size_t ldw, size_t k,
                       float alpha, const float* HWY_RESTRICT bias, float beta, float* HWY_RESTRICT y, size_t ldy) {
  const size_t lanes = hn::Lanes(DF());
  VF acc[R][O];
  tile_gemm::ZeroTile(acc);
  size_t i = 0;
  for (; i + lanes <= k; i += lanes) DotStep(x + i, ldx, w + i, ldw, acc);
  if (i < k) {  // the last k % lanes terms, zero-padded to a vector
    constexpr size_t kMaxLanes = hn::MaxLanes(DF());
    HWY_ALIGN float x_tail[R * kMaxLanes] = {}, w_tail[O * kMaxLanes] = {};
    for (size_t r = 0; r < R; ++r) std::copy(x + r * ldx + i, x + r * ldx + k, x_tail + r * lanes);
    for (size_t o = 0; o < O; ++o) std::copy(w + o * ldw + i, w + o * ldw + k, w_tail + o * lanes);
    DotStep(x_tail, lanes, w_tail, lanes, acc);
  }
  StoreSums(acc, alpha, bias, beta, y, ldy);
}

// The operands of one call, for the helpers below: x rows ldx apart, W rows ldw apart, y rows
// ldy apart, k terms, bias (one term per output, or null).
struct Operands {
  const float* x;
  size_t ldx;
  const float* w;
  size_t ldw;
  size_t k;
  float alpha;
  const float* bias;
  float beta;
  float* y;
  size_t ldy;

  const float* bias_at(size_t o) const { return bias ? bias + o : nullptr; }
};

// Rows [r, r + R) (R < kRows: the rows whole tiles leave) of outputs [o, o + O), as one tile: a
// tile of one row has O accumulators, which wait on the FMA latency (64 rows on AVX-512 left
// four such tiles per four outputs).
template <size_t O, size_t R = 1>
void TailRows(const Operands& op, size_t rows, size_t r, size_t o) {
  if constexpr (R < kRows) {
    if (rows == R)
      return Tile<R, O>(op.x + r * op.ldx, op.ldx, op.w + o * op.ldw, op.ldw, op.k, op.alpha, op.bias_at(o),
                        op.beta, op.y + r * op.ldy + o, op.ldy);
    TailRows<O, R + 1>(op, rows, r, o);
  }
}

// Every row of outputs [o, o + O): tiles of kRows rows, then the rows left.
template <size_t O>
void OutputColumns(const Operands& op, size_t rows, size_t o) {
  size_t r = 0;
  for (; r + kRows <= rows; r += kRows)
    Tile<kRows, O>(op.x + r * op.ldx, op.ldx, op.w + o * op.ldw, op.ldw, op.k, op.alpha, op.bias_at(o), op.beta,
                   op.y + r * op.ldy + o, op.ldy);
  if (r < rows) TailRows<O>(op, rows - r, r, o);
}

// The outputs [o, o + outputs) that whole tiles leave (fewer than kOutputs), as one column of tiles.
template <size_t O = 1>
void TailOutputs(const Operands& op, size_t rows, size_t outputs, size_t o) {
  if constexpr (O < kOutputs) {
    if (outputs == O) return OutputColumns<O>(op, rows, o);
    TailOutputs<O + 1>(op, rows, outputs, o);
  }
}

// Outputs [o_begin, o_end) of every row: columns of kOutputs, then the outputs left over.
void OutputBlock(const float* HWY_RESTRICT x, size_t ldx, size_t rows, size_t k, const float* HWY_RESTRICT w,
                 size_t ldw, float alpha, const float* HWY_RESTRICT bias, float beta, float* HWY_RESTRICT y,
                 size_t ldy, size_t o_begin, size_t o_end) {
  const Operands op{x, ldx, w, ldw, k, alpha, bias, beta, y, ldy};
  size_t o = o_begin;
  for (; o + kOutputs <= o_end; o += kOutputs) OutputColumns<kOutputs>(op, rows, o);
  if (o < o_end) TailOutputs(op, rows, o_end - o, o);
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::detail {

HWY_EXPORT(OutputBlock);
HWY_EXPORT(WideTile);
HWY_EXPORT(TileOutputs);

bool small_rows_gemm_has_wide_tile() { return HWY_DYNAMIC_DISPATCH(WideTile)(); }

namespace {
// Outputs per block of work: about this many (below, with several threads).
constexpr int64_t kBlock = 48;

// x rows that do not start on a 64-byte line (numpy allocates on 16 bytes; a view's offset; a row
// stride not a multiple of 16 floats) make each x load of the tile straddle two lines, which
// costs up to a quarter of the time. Such rows are first copied into aligned ones, by each
// worker into its own part of the calling thread's scratch (small_rows_gemm). The copy costs
// about what one output of the product does, so it is made from a few dozen outputs on, for two
// rows or more (one row: the same time
// either way), and for up to 256 KiB of rows a worker (the scratch stays held, as every
// workspace, until release_workspaces()). With more than kMaxCopyWorkers threads, nobody copies.
constexpr int64_t kAlignedLine = 64;  // bytes
constexpr int64_t kMinOutputsForCopy = 32;
constexpr int64_t kMaxCopiedFloats = int64_t{1} << 16;  // 256 KiB: W5's x is 40 KiB
constexpr int kMaxCopyWorkers = 64;

bool rows_off_lines(const float* x, int64_t ldx) {
  return reinterpret_cast<uintptr_t>(x) % kAlignedLine != 0 ||
         (ldx * static_cast<int64_t>(sizeof(float))) % kAlignedLine != 0;
}
}  // namespace

bool small_rows_gemm_threads(int64_t rows, int64_t n, int64_t k) {
  // Multiply-adds: as rows_gemm's (gemm/rows.cpp), from 2^16 on two threads read a float32 W
  // faster than one, start and join included (a decode step's products; docs/models.md).
  constexpr int64_t kMinWorkForThreads = int64_t{1} << 16;
  return rows * n * k >= kMinWorkForThreads && n > kBlock && omp_get_max_threads() > 1;
}

void small_rows_gemm(const float* x, int64_t ldx, int64_t rows, int64_t k, const float* w, int64_t ldw, int64_t n,
                     float alpha, float beta, float* y, int64_t ldy, const float* bias) {
  // Threads take blocks of about kBlock outputs, each from its own contiguous share first and
  // then helping the others (for_each_item: one slow thread on a busy machine does not hold the
  // others back); below about a million multiply-adds one thread is faster. Threaded, the blocks
  // are about as many as a multiple of the threads (rounded to whole tiles): W5's 512 outputs are
  // 12 blocks of 44 (the last 28), not 11 of 48, which left one of two threads a sixth block
  // while the other waited. The same share from call to call keeps a thread's part of W in its
  // L2 (W5's in-projection W is 3 MiB, an L2 2 MiB a core), which OpenMP's dynamic schedule,
  // dealing the blocks to whichever thread is free, did not.
  const int64_t threads = omp_get_max_threads();
  const bool threaded = small_rows_gemm_threads(rows, n, k);
  const int workers = threaded ? static_cast<int>(threads) : 1;
  int64_t block_size = kBlock;
  if (threaded) {
    const int64_t tile = static_cast<int64_t>(HWY_DYNAMIC_DISPATCH(TileOutputs)());
    block_size = layout::tile_block_size(n, layout::block_count(n, kBlock, threads), tile);
  }
  const int64_t blocks = layout::ceil_div(n, block_size);
  // x rows off the lines: each worker copies them into its own aligned rows before its first
  // block, so a copy is written in the cache that reads it (one copy, made by the calling thread
  // and read by both, crossed from one core's cache to the other's on every call).
  const int64_t line_floats = kAlignedLine / static_cast<int64_t>(sizeof(float));
  const int64_t aligned_ld = layout::round_up(k, line_floats);
  float* copies = nullptr;
  std::array<bool, kMaxCopyWorkers> copied{};  // per worker, written by it alone
  if (rows > 1 && k > 0 && n >= kMinOutputsForCopy && rows * k <= kMaxCopiedFloats && workers <= kMaxCopyWorkers &&
      rows_off_lines(x, ldx)) {
    try {
      copies = thread_workspace(WorkspaceSlot::GemmRows).floats(static_cast<size_t>(workers * rows * aligned_ld));
    } catch (const Error&) {  // under a memory limit: the rows as they are, only slower
    }
  }
  for_each_item(workers, blocks, [&](int64_t block) {
    const float* rows_x = x;
    int64_t rows_ld = ldx;
    if (copies) {
      const int worker = worker_index(workers);
      float* copy = copies + static_cast<int64_t>(worker) * rows * aligned_ld;
      if (!copied[static_cast<size_t>(worker)]) {
        for (int64_t r = 0; r < rows; ++r) std::copy(x + r * ldx, x + r * ldx + k, copy + r * aligned_ld);
        copied[static_cast<size_t>(worker)] = true;
      }
      rows_x = copy;
      rows_ld = aligned_ld;
    }
    HWY_DYNAMIC_DISPATCH(OutputBlock)(rows_x, static_cast<size_t>(rows_ld), static_cast<size_t>(rows),
                                      static_cast<size_t>(k), w, static_cast<size_t>(ldw), alpha, bias, beta, y,
                                      static_cast<size_t>(ldy), static_cast<size_t>(block * block_size),
                                      static_cast<size_t>(std::min(n, (block + 1) * block_size)));
  });
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
