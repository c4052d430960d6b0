// Reading keys and values of any element type (qkv::DType) as float vectors, per SIMD target:
// the "load" half of the pipeline's load step for 16-bit K/V. A kernel templated on the element
// type T (float, hwy::bfloat16_t, hwy::float16_t) loads with LoadWide and never keeps a widened
// copy: bfloat16 widens with a shift, float16 with F16C's vcvtph2ps where the target has it.
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

// One element as a float, for the scalar tails.
HWY_INLINE float ToFloat(float x) { return x; }
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

}  // namespace kv
// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#endif  // QKV_ATTENTION_KV_LOAD_INL_H_
