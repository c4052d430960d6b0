// qkv::nn::LayerNorm: normalise each row over the last dim, then scale and shift. Forward keeps
// x and each row's mean and 1/std; backward is llm.c's layernorm_backward, row by row.
#include <cmath>

#include "nn/grad.hpp"
#include "qkv/nn.hpp"

namespace qkv::nn {

LayerNorm::LayerNorm(int64_t dim, float eps, bool elementwise_affine) : dim_(dim), eps_(eps) {
  if (dim < 1) throw Error("LayerNorm: dim (" + std::to_string(dim) + ") must be at least 1");
  if (!(eps > 0)) throw Error("LayerNorm: eps must be positive, got " + std::to_string(eps));
  if (elementwise_affine) {
    weight = Tensor::full({dim}, 1.0f);
    bias = Tensor::zeros({dim});
  }
  zero_grad();
}

Tensor LayerNorm::forward(const Tensor& x) const {
  if (!x.defined() || x.dim() < 1 || x.size(-1) != dim_)
    throw Error("LayerNorm: x is " + grad::shape_str(x) + " but dim is " + std::to_string(dim_));
  if (weight.defined() != bias.defined() || (weight.defined() && (weight.shape() != Shape{dim_} || bias.shape() != Shape{dim_})))
    throw Error("LayerNorm: weight is " + grad::shape_str(weight) + " and bias " + grad::shape_str(bias) +
                ": expected (" + std::to_string(dim_) + ") each");
  const Tensor input = x.contiguous();
  const int64_t rows = x.numel() / dim_;
  Tensor y = Tensor::empty(x.shape());
  std::vector<float> mean(static_cast<size_t>(rows)), rstd(static_cast<size_t>(rows));
  const float* in = input.data();
  float* out = y.data();
  const float* w = weight.defined() ? weight.data() : nullptr;
  const float* b = bias.defined() ? bias.data() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = in + r * dim_;
    // 1. mean, 2. biased variance (two passes, in double: rows are short, accuracy is free)
    double sum = 0;
    for (int64_t e = 0; e < dim_; ++e) sum += row[e];
    const double mu = sum / static_cast<double>(dim_);
    double squares = 0;
    for (int64_t e = 0; e < dim_; ++e) squares += (row[e] - mu) * (row[e] - mu);
    const double inv_std = 1.0 / std::sqrt(squares / static_cast<double>(dim_) + eps_);
    // 3. y = (x - mean) * rstd * w + b
    for (int64_t e = 0; e < dim_; ++e) {
      const auto normed = static_cast<float>((row[e] - mu) * inv_std);
      out[r * dim_ + e] = w ? normed * w[e] + b[e] : normed;
    }
    mean[static_cast<size_t>(r)] = static_cast<float>(mu);
    rstd[static_cast<size_t>(r)] = static_cast<float>(inv_std);
  }
  saved_input_ = input;
  saved_mean_ = std::move(mean);
  saved_rstd_ = std::move(rstd);
  return y;
}

Tensor LayerNorm::backward(const Tensor& grad_output) {
  if (!saved_input_.defined()) throw Error("LayerNorm::backward: no forward to differentiate (call forward first)");
  if (!grad_output.defined() || grad_output.shape() != saved_input_.shape())
    throw Error("LayerNorm::backward: grad_output is " + grad::shape_str(grad_output) + " but the forward's output was " +
                saved_input_.shape().str());
  if (weight.defined() && (weight_grad.shape() != weight.shape() || bias_grad.shape() != bias.shape()))
    throw Error("LayerNorm::backward: the grads do not match the parameters any more: call zero_grad() first");
  const Tensor g = grad_output.contiguous();
  const int64_t rows = saved_input_.numel() / dim_;
  Tensor dx = Tensor::empty(saved_input_.shape());
  const float* in = saved_input_.data();
  const float* gd = g.data();
  float* dxd = dx.data();
  const float* w = weight.defined() ? weight.data() : nullptr;
  float* dw = weight.defined() ? weight_grad.data() : nullptr;
  float* db = bias.defined() ? bias_grad.data() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    const float mu = saved_mean_[static_cast<size_t>(r)], inv_std = saved_rstd_[static_cast<size_t>(r)];
    const float* row = in + r * dim_;
    const float* grow = gd + r * dim_;
    // 3. y = norm * w + b  ->  dnorm = g * w, dw += g * norm, db += g
    // 1-2. norm = (x - mean) * rstd  ->  dx = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm))
    double dnorm_mean = 0, dnorm_norm_mean = 0;
    for (int64_t e = 0; e < dim_; ++e) {
      const float norm = (row[e] - mu) * inv_std;
      const float dnorm = w ? grow[e] * w[e] : grow[e];
      dnorm_mean += dnorm;
      dnorm_norm_mean += static_cast<double>(dnorm) * norm;
      if (w) {
        dw[e] += grow[e] * norm;
        db[e] += grow[e];
      }
    }
    dnorm_mean /= static_cast<double>(dim_);
    dnorm_norm_mean /= static_cast<double>(dim_);
    for (int64_t e = 0; e < dim_; ++e) {
      const float norm = (row[e] - mu) * inv_std;
      const float dnorm = w ? grow[e] * w[e] : grow[e];
      dxd[r * dim_ + e] = static_cast<float>(inv_std * (dnorm - dnorm_mean - norm * dnorm_norm_mean));
    }
  }
  return dx;
}

void LayerNorm::zero_grad() {
  grad::reset_grad(weight_grad, weight);
  grad::reset_grad(bias_grad, bias);
}

std::vector<NamedTensor> LayerNorm::parameters(const std::string& prefix) const {
  if (!weight.defined()) return {};
  return {{prefix + "weight", weight, weight_grad}, {prefix + "bias", bias, bias_grad}};
}

}  // namespace qkv::nn
