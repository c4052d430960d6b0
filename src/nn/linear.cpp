// qkv::nn::Linear: y = x W^T + b through one linear_sgemm over all leading dims (the bias added as
// the product is stored); backward is two sgemms (dx = g W, dW += g^T x) and a column sum (db +=
// sum of g's rows). Both go through gemm/gemm.hpp, which picks the library per shape class.
#include <algorithm>
#include <cmath>

#include "nn/grad.hpp"
#include "gemm/gemm.hpp"
#include "qkv/nn.hpp"
#include "core/random.hpp"

namespace qkv::nn {

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, std::optional<uint64_t> seed_or_none) {
  const uint64_t seed = seed_or_none ? *seed_or_none : detail::next_seed();
  if (in_features < 1 || out_features < 1)
    throw Error("Linear: in_features (" + std::to_string(in_features) + ") and out_features (" +
                std::to_string(out_features) + ") must be at least 1");
  // torch.nn.Linear's default: kaiming_uniform(a = sqrt(5)) works out to U(-1/sqrt(in), 1/sqrt(in)),
  // and the same bound for the bias.
  const float bound = 1.0f / std::sqrt(static_cast<float>(in_features));
  weight = Tensor::uniform({out_features, in_features}, -bound, bound, seed);
  // The bias gets a stream of its own: a different seed derived from the weight's.
  if (bias) this->bias = Tensor::uniform({out_features}, -bound, bound, detail::mix64(seed + 1));
  zero_grad();
}

Tensor Linear::forward(const Tensor& x) const {
  Tensor y = apply(x);
  saved_input_ = x.contiguous();  // a handle, no copy, when x is contiguous already
  return y;
}

Tensor Linear::apply(const Tensor& x) const {
  // weight and bias are public (to load or inspect them): check they still fit each other.
  if (!weight.defined() || weight.dim() != 2 || (bias.defined() && bias.shape() != Shape{weight.size(0)}))
    throw Error("Linear: weight is " + (weight.defined() ? weight.shape().str() : std::string("undefined")) +
                " and bias " + (bias.defined() ? bias.shape().str() : std::string("none")) +
                ": expected (out, in) and (out)");
  if (!x.defined() || x.dim() < 1 || x.size(-1) != in_features())
    throw Error("Linear: x is " + (x.defined() ? x.shape().str() : std::string("undefined")) +
                " but in_features is " + std::to_string(in_features()));
  const Tensor input = x.contiguous();
  std::vector<int64_t> out_dims(x.shape().begin(), x.shape().end());
  out_dims.back() = out_features();
  Tensor y = Tensor::empty(Shape(out_dims));
  const int64_t rows = x.numel() / in_features();
  const int64_t n = out_features(), k = in_features();
  detail::linear_sgemm(rows, n, k, input.data(), k, weight.data(), k, bias.defined() ? bias.data() : nullptr, y.data(),
                       n);
  return y;
}

namespace {

// t read as a (rows, t.size(-1)) row-major matrix: t itself when its last dim is contiguous and
// its rows are evenly spaced (a contiguous tensor, or a narrow of a wider last dim), else a packed
// copy. *ld gets the distance between consecutive rows.
Tensor as_matrix(const Tensor& t, int64_t* ld) {
  const auto& dims = t.shape().dims();
  const auto& strides = t.strides();
  const size_t rank = dims.size();
  *ld = rank >= 2 ? std::max<int64_t>(strides[rank - 2], dims[rank - 1]) : dims[rank - 1];
  bool evenly_spaced = strides[rank - 1] == 1 || dims[rank - 1] <= 1;
  int64_t expected = *ld;  // the stride dim i needs for the rows to stay evenly spaced
  for (size_t i = rank - 1; evenly_spaced && i-- > 0;) {
    evenly_spaced = dims[i] <= 1 || strides[i] == expected;
    expected *= dims[i];
  }
  if (evenly_spaced) return t;
  *ld = dims[rank - 1];
  return t.contiguous();
}

}  // namespace

Tensor Linear::backward(const Tensor& grad_output) {
  accumulate_parameter_gradients(grad_output);
  return input_gradient(grad_output);
}

Tensor Linear::input_gradient(const Tensor& grad_output) const {
  if (!grad_output.defined() || grad_output.dim() < 1 || grad_output.size(-1) != out_features())
    throw Error("Linear::input_gradient: grad_output is " +
                (grad_output.defined() ? grad_output.shape().str() : std::string("undefined")) +
                " but out_features is " + std::to_string(out_features()));
  std::vector<int64_t> x_dims(grad_output.shape().begin(), grad_output.shape().end());
  x_dims.back() = in_features();
  Tensor dx = Tensor::empty(Shape(x_dims));
  const int64_t rows = dx.numel() / in_features(), n = out_features(), k = in_features();
  if (rows == 0) return dx;
  int64_t ld = 0;
  const Tensor g = as_matrix(grad_output, &ld);
  // y = x W^T + b  ->  dx = g W : (rows, n) x (n, k)
  detail::sgemm(false, false, rows, k, n, 1.0f, g.view_data(), ld, weight.data(), k, 0.0f, dx.data(), k);
  return dx;
}

void Linear::accumulate_parameter_gradients(const Tensor& grad_output) {
  if (!saved_input_.defined()) throw Error("Linear::backward: no forward to differentiate (call forward first)");
  const Tensor& x = saved_input_;
  std::vector<int64_t> y_dims(x.shape().begin(), x.shape().end());
  y_dims.back() = out_features();
  if (!grad_output.defined() || grad_output.shape() != Shape(y_dims))
    throw Error("Linear::backward: grad_output is " +
                (grad_output.defined() ? grad_output.shape().str() : std::string("undefined")) +
                " but the forward's output was " + Shape(y_dims).str());
  if (weight_grad.shape() != weight.shape() || bias.defined() != bias_grad.defined() ||
      (bias.defined() && bias_grad.shape() != bias.shape()))
    throw Error("Linear::backward: the grads do not match weight " + weight.shape().str() +
                " any more (parameters replaced?): call zero_grad() first");
  const int64_t rows = x.numel() / in_features(), n = out_features(), k = in_features();
  if (rows == 0) return;
  int64_t ld = 0;
  const Tensor matrix = as_matrix(grad_output, &ld);
  const float* g = matrix.view_data();
  // dW += g^T x : (n, rows) x (rows, k), beta = 1 accumulates
  detail::sgemm(true, false, n, k, rows, 1.0f, g, ld, x.data(), k, 1.0f, weight_grad.data(), k);
  // db += sum over rows of g
  if (bias.defined()) {
    float* db = bias_grad.data();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < n; ++o) db[o] += g[r * ld + o];
  }
}

void Linear::zero_grad() {
  grad::reset_grad(weight_grad, weight);
  grad::reset_grad(bias_grad, bias);
}

std::vector<NamedTensor> Linear::parameters(const std::string& prefix) const {
  std::vector<NamedTensor> params{{prefix + "weight", weight, weight_grad}};
  if (bias.defined()) params.push_back({prefix + "bias", bias, bias_grad});
  return params;
}

}  // namespace qkv::nn
