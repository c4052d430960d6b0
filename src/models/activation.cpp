// qkv::models::detail::activate and gated_activate (token_ops.hpp): the MLP's activations on
// whole vectors (Highway's Tanh and Exp). libm's scalar tanhf and expf took a GPT-2 prefill about
// as long as its bf16 matrix products (docs/models.md, "Speed"); on vectors they are a small part.
// A prefill's activations run on every thread (token_ops.hpp's for_each_run), a decode step's on one.
//
// Each activation has one formula, on vectors: the last count % lanes elements go through it in a
// padded vector, so no scalar twin can disagree with it. GELU-erf has no vector erf in Highway and
// stays on std::erf (BERT only).
//
// Highway's foreach_target re-includes this file once per SIMD target; the exported entry points
// live in the HWY_ONCE part below.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "models/activation.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

#ifndef QKV_MODELS_ACTIVATION_ONCE
#define QKV_MODELS_ACTIVATION_ONCE
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>

#include "models/token_ops.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::models::detail {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// act(x) on one vector; `kind` as Activation (GeluErf excepted).
HWY_INLINE VF Apply(DF df, VF x, int kind) {
  switch (static_cast<Activation>(kind)) {
    case Activation::GeluTanh: {  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
      const VF x3 = hn::Mul(hn::Mul(x, x), x);
      const VF inner = hn::Mul(hn::Set(df, static_cast<float>(std::sqrt(2.0 / std::numbers::pi))),
                               hn::MulAdd(hn::Set(df, 0.044715f), x3, x));
      const VF half_x = hn::Mul(hn::Set(df, 0.5f), x);
      return hn::MulAdd(half_x, hn::Tanh(df, inner), half_x);
    }
    case Activation::Silu:  // x / (1 + exp(-x))
      return hn::Div(x, hn::Add(hn::Set(df, 1.0f), hn::Exp(df, hn::Neg(x))));
    case Activation::Relu: return hn::Max(x, hn::Zero(df));
    case Activation::GeluErf: break;
  }
  return x;
}

// x[i] <- act(x[i]) * (up ? up[i] : 1) for i < count (up may be null).
void ActivateRange(float* HWY_RESTRICT x, const float* HWY_RESTRICT up, size_t count, int kind) {
  const DF df;
  const size_t lanes = hn::Lanes(df);
  const auto one = [&](const float* in, const float* factor, float* out) {
    VF y = Apply(df, hn::LoadU(df, in), kind);
    if (factor != nullptr) y = hn::Mul(y, hn::LoadU(df, factor));
    hn::StoreU(y, df, out);
  };
  size_t i = 0;
  for (; i + lanes <= count; i += lanes) one(x + i, up ? up + i : nullptr, x + i);
  if (i == count) return;
  HWY_ALIGN float padded_x[hn::MaxLanes(DF())] = {}, padded_up[hn::MaxLanes(DF())] = {};
  const size_t rest = count - i;
  std::copy_n(x + i, rest, padded_x);
  if (up != nullptr) std::copy_n(up + i, rest, padded_up);
  one(padded_x, up ? padded_up : nullptr, padded_x);
  std::copy_n(padded_x, rest, x + i);
}

}  // namespace HWY_NAMESPACE
}  // namespace qkv::models::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::models::detail {

HWY_EXPORT(ActivateRange);

namespace {

float gelu_erf(float x) { return 0.5f * x * (1.0f + std::erf(x * static_cast<float>(1.0 / std::numbers::sqrt2))); }

// Runs of 1024 elements (whole vectors on every target), on every thread for a prefill's rows.
void activate_any(float* x, const float* up, int64_t count, Activation act) {
  if (act != Activation::GeluErf) {
    for_each_run(count, 1024, 2, [&](int64_t first, int64_t last) {
      HWY_DYNAMIC_DISPATCH(ActivateRange)(x + first, up ? up + first : nullptr, static_cast<size_t>(last - first),
                                          static_cast<int>(act));
    });
    return;
  }
  for_each_run(count, 1024, 20, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) x[i] = gelu_erf(x[i]) * (up ? up[i] : 1.0f);
  });
}

}  // namespace

void activate(float* x, int64_t count, Activation act) { activate_any(x, nullptr, count, act); }

void gated_activate(float* gate, const float* up, int64_t count, Activation act) {
  activate_any(gate, up, count, act);
}

}  // namespace qkv::models::detail
#endif  // HWY_ONCE
