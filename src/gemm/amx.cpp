// The flash kernels' products on AMX tiles (amx.hpp). Only the functions between the target
// pragmas below use AMX and AVX-512 instructions; the kernels call them only when available()
// (compiled for any x86-64) says the CPU and the OS allow them. No compile flag of this file
// enables those instructions, so nothing the compiler emits here for shared inline functions can
// reach a CPU without them.
#include "gemm/amx.hpp"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/allocator.hpp"

namespace qkv::detail::amx {
namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an XSAVE feature's state
constexpr long kXfeatureXtiledata = 18;     // the AMX tile data

bool detect() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool avx512 = (ebx >> 16 & 1) && (ebx >> 17 & 1) && (ebx >> 30 & 1) && (ebx >> 31 & 1);  // F, DQ, BW, VL
  const bool amx = (edx >> 22 & 1) && (edx >> 24 & 1);  // AMX-BF16, AMX-TILE
  if (!avx512 || !amx || eax < 1) return false;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) || !(eax >> 5 & 1)) return false;  // AVX512-BF16
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool available() {
  static const bool usable = detect();
  return usable;
}

uint16_t* worker_blocks(size_t elements, int workers) {
  constexpr size_t kMaxBlockBytes = size_t{64} << 20, kMaxBytes = size_t{1} << 30;
  const size_t bytes = elements * sizeof(uint16_t), count = static_cast<size_t>(std::max(workers, 1));
  if (bytes > kMaxBlockBytes || count * bytes > kMaxBytes) return nullptr;
  try {
    return reinterpret_cast<uint16_t*>(thread_workspace(WorkspaceSlot::FlashAmx).floats(count * elements / 2));
  } catch (const Error&) {
    return nullptr;
  }
}

// ---- From here on, AMX and AVX-512 (with BF16) code.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")
#endif

namespace {

// ---- Splitting float32 into bf16 parts. For K, V, Qt and dS (`round`): hi = x rounded to the
// nearest bf16, lo = x - hi (exact in float32, |lo| <= 2^-9 |x|), rounded to nearest again when
// stored; for P (the weights, split per tile, where speed matters): hi = x with its low 16 bits
// cleared, |lo| < 2^-7 |x|. With one part (Medium) x is rounded to nearest. The splits report
// the lanes the parts cannot hold (`unfit`): NaN, +-inf, and finite values that round to inf in
// bf16; the kernels then keep that work to float32. All but the forward's P pairs, which the
// kernel computes itself in [0, 1] from a running max: the backward's P'^T comes from an lse
// its caller passes, and one far below the true one gives P' = inf, whose truncated parts would
// be inf and inf - inf = NaN where float32 gives inf.

// bf16 -> float32 (the maskz forms: GCC 12 warns that the unmasked ones read an undefined vector).
inline __m512 widen(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, bf16), 16));
}
// The lanes of x that bf16 parts cannot hold: NaN, +-inf, |x| >= the largest bf16 + half an ulp.
inline __mmask16 unfit(__m512 x) {
  const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
  return _mm512_cmpge_epu32_mask(magnitude, _mm512_set1_epi32(0x7F7F8000));
}
inline __m512 high_half(__m512 x) {  // x with its low 16 bits cleared: x truncated to bf16
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(-65536)));
}
inline void store_bf16(uint16_t* dst, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
}
// x's parts stored as bf16 at dst and dst + part_stride, hi converted once (split_rows,
// split_transposed); returns the lanes the parts cannot hold.
inline __mmask16 store_parts(uint16_t* dst, size_t part_stride, __m512 x, int parts, bool round) {
  if (parts == 1 || round) {
    const __m256i hi = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), hi);
    if (parts > 1) store_bf16(dst + part_stride, _mm512_sub_ps(x, widen(hi)));
  } else {
    const __m512 hi = high_half(x);
    store_bf16(dst, hi);
    store_bf16(dst + part_stride, _mm512_sub_ps(x, hi));
  }
  return unfit(x);
}

// ---- The products. Tiles 0 .. QB - 1 accumulate (one per 16 query lanes), 3 .. 2 + QB hold
// one part of the B operand for each, 6 and 7 the parts of the A operand. A tile's registers
// are not renamed: consecutive products go to different accumulators, so that none waits on the
// one before.
template <int QB>
inline void zero_accumulators() {
  _tile_zero(0);
  if constexpr (QB > 1) _tile_zero(1);
  if constexpr (QB > 2) _tile_zero(2);
}
template <int QB>
inline void load_accumulators(const float* c, size_t stride) {
  _tile_loadd(0, c, stride);
  if constexpr (QB > 1) _tile_loadd(1, c + 16, stride);
  if constexpr (QB > 2) _tile_loadd(2, c + 32, stride);
}
template <int QB>
inline void store_accumulators(float* c, size_t stride) {
  _tile_stored(0, c, stride);
  if constexpr (QB > 1) _tile_stored(1, c + 16, stride);
  if constexpr (QB > 2) _tile_stored(2, c + 32, stride);
}
template <int QB>
inline void load_b(const uint16_t* b, size_t stride) {  // query block x at b + 32 x (16 pairs)
  _tile_loadd(3, b, stride);
  if constexpr (QB > 1) _tile_loadd(4, b + 32, stride);
  if constexpr (QB > 2) _tile_loadd(5, b + 64, stride);
}
// (GCC's _tile_dpbf16ps pastes its arguments into the instruction's text: literal numbers only.)
template <int QB, int A>
inline void products() {
  static_assert(A == 6 || A == 7);
  if constexpr (A == 6) {
    _tile_dpbf16ps(0, 6, 3);
    if constexpr (QB > 1) _tile_dpbf16ps(1, 6, 4);
    if constexpr (QB > 2) _tile_dpbf16ps(2, 6, 5);
  } else {
    _tile_dpbf16ps(0, 7, 3);
    if constexpr (QB > 1) _tile_dpbf16ps(1, 7, 4);
    if constexpr (QB > 2) _tile_dpbf16ps(2, 7, 5);
  }
}

// One depth block (32 steps) of C += A B in parts: a and b at the block's part 0, parts a_part
// and b_part apart. With 2 parts: a_hi b_hi + a_lo b_hi + a_hi b_lo; a_lo b_lo is left out, as
// torch's "high" does: at most 2^-18 of |a b| for two rounded splits, 2^-16 with P's truncated one.
template <int P, int QB>
inline void depth_block(const uint16_t* a, size_t a_stride, size_t a_part, const uint16_t* b, size_t b_stride,
                        size_t b_part) {
  _tile_loadd(6, a, a_stride);
  if constexpr (P > 1) _tile_loadd(7, a + a_part, a_stride);
  load_b<QB>(b, b_stride);
  products<QB, 6>();
  if constexpr (P > 1) {
    products<QB, 7>();
    load_b<QB>(b + b_part, b_stride);
    products<QB, 6>();
  }
}

// C (16 row_blocks x 16 QB) = or += A B, B's rows b_stride bytes apart.
template <int P, int QB>
void product_tiles(const uint16_t* a, size_t a_row, size_t a_part, size_t row_blocks, const uint16_t* b,
                   size_t b_stride, size_t b_part, size_t depth_steps, float* c, size_t c_row, bool add) {
  for (size_t rb = 0; rb < row_blocks; ++rb) {
    float* c_rows = c + rb * kRows * c_row;
    if (add) {
      load_accumulators<QB>(c_rows, c_row * sizeof(float));
    } else {
      zero_accumulators<QB>();
    }
    const uint16_t* a_rows = a + rb * kRows * a_row;
    for (size_t x = 0; x < depth_steps; ++x)
      depth_block<P, QB>(a_rows + x * kDepth, a_row * sizeof(uint16_t), a_part, b + x * (kDepth / 2) * (b_stride / sizeof(uint16_t)),
                         b_stride, b_part);
    store_accumulators<QB>(c_rows, c_row * sizeof(float));
  }
}

}  // namespace

// The tile configuration: palette 1, every tile 16 rows of 64 bytes. A constant in memory:
// GCC's _tile_loadconfig tells the compiler it reads only the first 8 bytes, so stores into a
// local configuration could be dropped as dead.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};
constexpr TileConfig kTileConfig = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
static_assert(sizeof(TileConfig) == 64 && kDepth * sizeof(uint16_t) == 64 && kRows == 16);

void configure() { _tile_loadconfig(&kTileConfig); }

void release() { _tile_release(); }

bool split_rows(int parts, bool round, const float* src, size_t src_row, size_t rows, size_t cols, uint16_t* dst,
                size_t dst_row, size_t rows_pad, size_t cols_pad, size_t part_stride) {
  __mmask16 bad = 0;
  for (size_t r = 0; r < rows_pad; ++r) {
    const float* row = src + r * src_row;
    for (size_t c = 0; c < cols_pad; c += 16) {
      __m512 x = _mm512_setzero_ps();
      if (r < rows && c + 16 <= cols) {
        x = _mm512_loadu_ps(row + c);
      } else if (r < rows && c < cols) {
        x = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (cols - c)) - 1), row + c);
      }
      bad |= store_parts(dst + r * dst_row + c, part_stride, x, parts, round);
    }
  }
  return bad == 0;
}

namespace {
// x[j] <- (x[0][j], ..., x[15][j]): a 16 x 16 transpose in registers. Within 128-bit lanes by
// 32 and 64 bits, then across lanes: after the first two steps lane k of x[4g + m] holds
// column 4k + m of rows 4g .. 4g + 3.
inline void transpose16(__m512 x[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_maskz_unpacklo_ps(0xFFFF, x[i], x[i + 1]);
    t[i + 1] = _mm512_maskz_unpackhi_ps(0xFFFF, x[i], x[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {
    x[g] = _mm512_maskz_shuffle_ps(0xFFFF, t[g], t[g + 2], 0x44);
    x[g + 1] = _mm512_maskz_shuffle_ps(0xFFFF, t[g], t[g + 2], 0xEE);
    x[g + 2] = _mm512_maskz_shuffle_ps(0xFFFF, t[g + 1], t[g + 3], 0x44);
    x[g + 3] = _mm512_maskz_shuffle_ps(0xFFFF, t[g + 1], t[g + 3], 0xEE);
  }
  for (int m = 0; m < 4; ++m) {
    t[m] = _mm512_maskz_shuffle_f32x4(0xFFFF, x[m], x[4 + m], 0x88);       // lanes 0, 2 of rows 0-7
    t[4 + m] = _mm512_maskz_shuffle_f32x4(0xFFFF, x[m], x[4 + m], 0xDD);   // lanes 1, 3 of rows 0-7
    t[8 + m] = _mm512_maskz_shuffle_f32x4(0xFFFF, x[8 + m], x[12 + m], 0x88);
    t[12 + m] = _mm512_maskz_shuffle_f32x4(0xFFFF, x[8 + m], x[12 + m], 0xDD);
  }
  for (int m = 0; m < 4; ++m) {
    x[m] = _mm512_maskz_shuffle_f32x4(0xFFFF, t[m], t[8 + m], 0x88);
    x[4 + m] = _mm512_maskz_shuffle_f32x4(0xFFFF, t[4 + m], t[12 + m], 0x88);
    x[8 + m] = _mm512_maskz_shuffle_f32x4(0xFFFF, t[m], t[8 + m], 0xDD);
    x[12 + m] = _mm512_maskz_shuffle_f32x4(0xFFFF, t[4 + m], t[12 + m], 0xDD);
  }
}
}  // namespace

bool split_transposed(int parts, const float* src, size_t src_row, size_t rows, size_t cols, uint16_t* dst,
                      size_t dst_row, size_t rows_pad, size_t part_stride) {
  // By blocks of 16 x 16, transposed in registers, which is faster than gathering each column;
  // the splitting, not the reads, takes most of the time here.
  __mmask16 bad = 0;
  for (size_t r = 0; r < rows_pad; r += 16) {
    const size_t live = r < rows ? std::min<size_t>(16, rows - r) : 0;
    for (size_t c = 0; c < cols; c += 16) {
      const size_t width = std::min<size_t>(16, cols - c);
      const __mmask16 columns = static_cast<__mmask16>((1u << width) - 1);
      __m512 x[16];
      for (size_t l = 0; l < 16; ++l)
        x[l] = l < live ? _mm512_maskz_loadu_ps(columns, src + (r + l) * src_row + c) : _mm512_setzero_ps();
      transpose16(x);
      for (size_t j = 0; j < width; ++j) {
        bad |= store_parts(dst + (c + j) * dst_row + r, part_stride, x[j], parts, true);
      }
    }
  }
  return bad == 0;
}

bool split_pairs(int parts, bool round, const float* src, size_t src_row, size_t width, size_t valid, size_t pairs,
                 uint16_t* dst, size_t part_stride) {
  // Element 2i of a pair row is the even row's lane i, element 2i + 1 the odd row's.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const auto store_pairs = [&](uint16_t* at, __m512 odd_part, __m512 even_part) {
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd_part, even_part));
    _mm512_storeu_si512(at, _mm512_permutexvar_epi16(interleave, both));
  };
  __mmask16 bad = 0;
  for (size_t x = 0; x < pairs; ++x) {
    for (size_t n = 0; n < width; n += 16) {
      const __m512 even = 2 * x < valid ? _mm512_loadu_ps(src + 2 * x * src_row + n) : _mm512_setzero_ps();
      const __m512 odd = 2 * x + 1 < valid ? _mm512_loadu_ps(src + (2 * x + 1) * src_row + n) : _mm512_setzero_ps();
      uint16_t* at = dst + (x * width + n) * 2;
      if (round || parts == 1) {
        // hi: both rows rounded by one conversion; lo from hi widened back.
        if (round) bad |= unfit(even) | unfit(odd);
        const __m512i hi = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));  // even's in the low half
        _mm512_storeu_si512(at, _mm512_permutexvar_epi16(interleave, hi));
        if (parts > 1)
          store_pairs(at + part_stride, _mm512_sub_ps(odd, widen(_mm512_maskz_extracti64x4_epi64(0xFF, hi, 1))),
                      _mm512_sub_ps(even, widen(_mm512_maskz_extracti64x4_epi64(0xFF, hi, 0))));
      } else {
        // hi truncated: its bf16 is a float's high half, so the interleaved pairs are odd's high
        // halves over even's shifted down; lo rounded.
        _mm512_storeu_si512(at, _mm512_mask_blend_epi16(0x55555555, _mm512_castps_si512(odd),
                                                        _mm512_maskz_srli_epi32(0xFFFF, _mm512_castps_si512(even), 16)));
        store_pairs(at + part_stride, _mm512_sub_ps(odd, high_half(odd)), _mm512_sub_ps(even, high_half(even)));
      }
    }
  }
  return bad == 0;
}

void add_transposed(const float* src, size_t src_row, size_t rows, size_t cols, float factor, float* dst,
                    size_t dst_row) {
  const __m512 f = _mm512_set1_ps(factor);
  for (size_t i = 0; i < rows; i += 16) {  // 16 rows of dst (columns of src: src_row >= rows rounded up)
    for (size_t c = 0; c < cols; c += 16) {
      __m512 x[16];
      for (size_t l = 0; l < 16; ++l) x[l] = _mm512_loadu_ps(src + (c + l) * src_row + i);
      transpose16(x);
      for (size_t j = 0; j < std::min<size_t>(16, rows - i); ++j) {
        float* out = dst + (i + j) * dst_row + c;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(f, x[j], _mm512_loadu_ps(out)));
      }
    }
  }
}

void product(int parts, const uint16_t* a, size_t a_row, size_t a_part, size_t row_blocks, const uint16_t* b,
             size_t b_part, size_t depth_steps, size_t cols, float* c, size_t c_row, bool add) {
  // By column blocks of at most 48 (three accumulators, three B tiles, two A tiles: 8 tiles).
  const size_t b_stride = cols * 2 * sizeof(uint16_t);  // a row of B: a pair of depth steps
  for (size_t n = 0; n < cols; n += 3 * kRows) {
    const size_t width = std::min(cols - n, 3 * kRows);
    const uint16_t* b_cols = b + n * 2;
    float* c_cols = c + n;
    switch (width / kRows * 2 + (parts == 1 ? 0 : 1)) {
      case 2: product_tiles<1, 1>(a, a_row, a_part, row_blocks, b_cols, b_stride, b_part, depth_steps, c_cols, c_row, add); break;
      case 3: product_tiles<2, 1>(a, a_row, a_part, row_blocks, b_cols, b_stride, b_part, depth_steps, c_cols, c_row, add); break;
      case 4: product_tiles<1, 2>(a, a_row, a_part, row_blocks, b_cols, b_stride, b_part, depth_steps, c_cols, c_row, add); break;
      case 5: product_tiles<2, 2>(a, a_row, a_part, row_blocks, b_cols, b_stride, b_part, depth_steps, c_cols, c_row, add); break;
      case 6: product_tiles<1, 3>(a, a_row, a_part, row_blocks, b_cols, b_stride, b_part, depth_steps, c_cols, c_row, add); break;
      default: product_tiles<2, 3>(a, a_row, a_part, row_blocks, b_cols, b_stride, b_part, depth_steps, c_cols, c_row, add);
    }
  }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

}  // namespace qkv::detail::amx
