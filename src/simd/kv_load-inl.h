// Reading keys and values of any element type (qkv::DType) as float vectors, per SIMD target:
// the "load" half of the pipeline's load step for 16-bit K/V. A kernel templated on the element
// type T (float, hwy::bfloat16_t, hwy::float16_t) loads with LoadWide and never keeps a widened
// copy: bfloat16 widens with a shift, float16 with F16C's vcvtph2ps where the target has it.
// Quantized rows (int8, int4) dequantise a row at a time into a float tile (DequantizeRow).
//
// Included inside a Highway foreach_target pass (the -inl.h convention).
#if defined(QKV_ATTENTION_KV_LOAD_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef QKV_ATTENTION_KV_LOAD_INL_H_
#undef QKV_ATTENTION_KV_LOAD_INL_H_
#else
#define QKV_ATTENTION_KV_LOAD_INL_H_
#endif

#include <cstdint>

#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {
namespace kv {
namespace hn = hwy::HWY_NAMESPACE;

// Lanes(d) elements at p (any alignment) as floats.
template <class D>
HWY_INLINE hn::Vec<D> LoadWide(D d, const float* HWY_RESTRICT p) {
  return hn::LoadU(d, p);
}
template <class D>
HWY_INLINE hn::Vec<D> LoadWide(D d, const hwy::bfloat16_t* HWY_RESTRICT p) {
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::bfloat16_t, D>(), p));
}
template <class D>
HWY_INLINE hn::Vec<D> LoadWide(D d, const hwy::float16_t* HWY_RESTRICT p) {
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::float16_t, D>(), p));  // vcvtph2ps (F16C)
#else
  // No F16C: the fields moved by integer ops (Highway's own emulation turns inf and NaN into
  // large finite numbers). Normal: exponent rebased 15 -> 127; inf/NaN: exponent all ones;
  // zero/subnormal: mantissa x 2^-24, exact.
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const auto bits = hn::PromoteTo(du, hn::LoadU(hn::Rebind<uint16_t, D>(), reinterpret_cast<const uint16_t*>(p)));
  const auto sign = hn::ShiftLeft<16>(hn::And(bits, hn::Set(du, 0x8000u)));
  const auto exponent = hn::And(hn::ShiftRight<10>(bits), hn::Set(du, 0x1fu));
  const auto mantissa = hn::And(bits, hn::Set(du, 0x3ffu));
  const auto normal = hn::Or(hn::ShiftLeft<23>(hn::Add(exponent, hn::Set(du, 112u))), hn::ShiftLeft<13>(mantissa));
  const auto special = hn::Or(hn::Set(du, 0x7f800000u), hn::ShiftLeft<13>(mantissa));
  const auto small = hn::BitCast(du, hn::Mul(hn::ConvertTo(d, hn::BitCast(di, mantissa)), hn::Set(d, 1.0f / 16777216.0f)));
  const auto magnitude = hn::IfThenElse(hn::Eq(exponent, hn::Set(du, 0x1fu)), special,
                                        hn::IfThenElse(hn::Eq(exponent, hn::Zero(du)), small, normal));
  return hn::BitCast(d, hn::Or(sign, magnitude));
#endif
}

// int8 (quantized K/V read in place; the caller applies the row's scale): sign-extend, convert.
template <class D>
HWY_INLINE hn::Vec<D> LoadWide(D d, const int8_t* HWY_RESTRICT p) {
  return hn::ConvertTo(d, hn::PromoteTo(hn::RebindToSigned<D>(), hn::LoadU(hn::Rebind<int8_t, D>(), p)));
}

// One element as a float, for the scalar tails.
HWY_INLINE float ToFloat(float x) { return x; }
HWY_INLINE float ToFloat(int8_t x) { return static_cast<float>(x); }
HWY_INLINE float ToFloat(hwy::bfloat16_t x) { return hwy::F32FromBF16(x); }
HWY_INLINE float ToFloat(hwy::float16_t x) {
  const uint16_t bits = x.bits;
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1f) {
    u = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else {
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);  // 2^-24, exact
    return sign ? -magnitude : magnitude;
  }
  float f;
  hwy::CopySameSize(&u, &f);
  return f;
}

// ---- Quantized rows (qkv/quantize.hpp): out[0, dim) = q * scale, the one dequantisation of the
// library (core/quantize.cpp's scalar entry dispatches here).

// int8: dim bytes, one scale.
template <class D>
HWY_INLINE void DequantizeInt8(D d, const uint8_t* HWY_RESTRICT values, float scale, size_t dim,
                               float* HWY_RESTRICT out) {
  const auto* q = reinterpret_cast<const int8_t*>(values);
  const auto s = hn::Set(d, scale);
  const size_t lanes = hn::Lanes(d);
  size_t c = 0;
  for (; c + lanes <= dim; c += lanes) hn::StoreU(hn::Mul(LoadWide(d, q + c), s), d, out + c);
  for (; c < dim; ++c) out[c] = static_cast<float>(q[c]) * scale;
}

// int4: a group of n <= 32 values in n / 2 bytes, byte j = element j (low 4 bits) and element
// j + n / 2 (high 4 bits), each q + 8.
template <class D>
HWY_INLINE void DequantizeInt4Group(D d, const uint8_t* HWY_RESTRICT bytes, float scale, size_t n,
                                    float* HWY_RESTRICT out) {
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;
  const hn::Rebind<uint8_t, D> d8;
  const auto s = hn::Set(d, scale);
  const auto offset = hn::Set(di, 8);
  const size_t half = n / 2, lanes = hn::Lanes(d);
  size_t j = 0;
  for (; j + lanes <= half; j += lanes) {
    const auto packed = hn::PromoteTo(du, hn::LoadU(d8, bytes + j));
    const auto low = hn::Sub(hn::BitCast(di, hn::And(packed, hn::Set(du, 0x0fu))), offset);
    const auto high = hn::Sub(hn::BitCast(di, hn::ShiftRight<4>(packed)), offset);
    hn::StoreU(hn::Mul(hn::ConvertTo(d, low), s), d, out + j);
    hn::StoreU(hn::Mul(hn::ConvertTo(d, high), s), d, out + half + j);
  }
  for (; j < half; ++j) {
    out[j] = static_cast<float>((bytes[j] & 0x0f) - 8) * scale;
    out[half + j] = static_cast<float>((bytes[j] >> 4) - 8) * scale;
  }
}

// A row of `dim` values of dtype I8 (dim bytes, scales[0]) or I4 (dim / 2 bytes, a scale per
// group of 32; dim even).
template <class D>
HWY_INLINE void DequantizeRow(D d, bool int4, const uint8_t* HWY_RESTRICT values, const float* HWY_RESTRICT scales,
                              size_t dim, float* HWY_RESTRICT out) {
  if (!int4) return DequantizeInt8(d, values, scales[0], dim, out);
  constexpr size_t kGroup = 32;  // qkv::kInt4Group
  for (size_t first = 0, group = 0; first < dim; first += kGroup, ++group)
    DequantizeInt4Group(d, values + first / 2, scales[group], dim - first < kGroup ? dim - first : kGroup, out + first);
}

}  // namespace kv
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // QKV_ATTENTION_KV_LOAD_INL_H_
