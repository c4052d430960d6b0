// Helpers the modules' backward passes share (internal to src/nn).
#pragma once

#include <algorithm>
#include <string>

#include "qkv/tensor.hpp"

namespace qkv::nn::grad {

// Sets `grad` to zeros shaped as `param`, in place when it already has that shape (so the handles
// an optimizer holds stay valid), freshly allocated otherwise; undefined when `param` is.
inline void reset_grad(Tensor& grad, const Tensor& param) {
  if (!param.defined()) {
    grad = Tensor();
  } else if (grad.defined() && grad.shape() == param.shape()) {
    std::fill_n(grad.data(), grad.numel(), 0.0f);
  } else {
    grad = Tensor::zeros(param.shape());
  }
}

inline std::string shape_str(const Tensor& t) { return t.defined() ? t.shape().str() : std::string("undefined"); }

}  // namespace qkv::nn::grad
