// qkv::nn::AdamW: torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments),
// step by step in the same order as torch's single-tensor implementation.
#include <cmath>

#include "nn/grad.hpp"
#include "qkv/nn.hpp"

namespace qkv::nn {

AdamW::AdamW(std::vector<NamedTensor> parameters, const AdamWOptions& options)
    : parameters_(std::move(parameters)), options_(options) {
  if (!(options.lr >= 0) || !(options.beta1 >= 0 && options.beta1 < 1) || !(options.beta2 >= 0 && options.beta2 < 1) ||
      !(options.eps >= 0) || !(options.weight_decay >= 0))
    throw Error("AdamW: need lr >= 0, 0 <= beta1, beta2 < 1, eps >= 0, weight_decay >= 0; got lr " +
                std::to_string(options.lr) + ", betas (" + std::to_string(options.beta1) + ", " +
                std::to_string(options.beta2) + "), eps " + std::to_string(options.eps) + ", weight_decay " +
                std::to_string(options.weight_decay));
  for (const NamedTensor& p : parameters_) {
    if (!p.tensor.defined() || !p.grad.defined() || p.grad.shape() != p.tensor.shape() || !p.tensor.is_contiguous() ||
        !p.grad.is_contiguous())
      throw Error("AdamW: parameter '" + p.name + "' is " + grad::shape_str(p.tensor) + " with grad " +
                  grad::shape_str(p.grad) + ": each needs a contiguous grad of its own shape");
    first_moment_.emplace_back(static_cast<size_t>(p.tensor.numel()), 0.0f);
    second_moment_.emplace_back(static_cast<size_t>(p.tensor.numel()), 0.0f);
  }
}

void AdamW::step() {
  ++steps_;
  const AdamWOptions& o = options_;
  const double bias_correction1 = 1.0 - std::pow(static_cast<double>(o.beta1), static_cast<double>(steps_));
  const double bias_correction2 = 1.0 - std::pow(static_cast<double>(o.beta2), static_cast<double>(steps_));
  const auto step_size = static_cast<float>(o.lr / bias_correction1);
  const auto bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float decay = 1.0f - o.lr * o.weight_decay;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    float* p = parameters_[i].tensor.data();
    const float* g = parameters_[i].grad.data();
    float* m = first_moment_[i].data();
    float* v = second_moment_[i].data();
    const int64_t n = parameters_[i].tensor.numel();
    for (int64_t e = 0; e < n; ++e) {
      p[e] *= decay;                                          // decoupled weight decay
      m[e] = o.beta1 * m[e] + (1 - o.beta1) * g[e];           // first moment
      v[e] = o.beta2 * v[e] + (1 - o.beta2) * g[e] * g[e];    // second moment
      const float denom = std::sqrt(v[e]) / bias_correction2_sqrt + o.eps;
      p[e] -= step_size * m[e] / denom;
    }
  }
}

void AdamW::load_state(const AdamWState& state) {
  auto fits = [&](const std::vector<std::vector<float>>& moments) {
    if (moments.size() != parameters_.size()) return false;
    for (size_t i = 0; i < moments.size(); ++i)
      if (static_cast<int64_t>(moments[i].size()) != parameters_[i].tensor.numel()) return false;
    return true;
  };
  if (state.steps < 0 || !fits(state.first_moment) || !fits(state.second_moment))
    throw Error("AdamW::load_state: the state has " + std::to_string(state.first_moment.size()) + " and " +
                std::to_string(state.second_moment.size()) + " moment tensors at step " + std::to_string(state.steps) +
                " for " + std::to_string(parameters_.size()) +
                " parameters: each parameter needs two moments of its size and the step must be >= 0");
  steps_ = state.steps;
  first_moment_ = state.first_moment;
  second_moment_ = state.second_moment;
}

void AdamW::zero_grad() {
  for (NamedTensor& p : parameters_) std::fill_n(p.grad.data(), p.grad.numel(), 0.0f);
}

}  // namespace qkv::nn
