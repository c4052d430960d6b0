// qkv::nn::Embedding: row lookup in a (vocab, dim) table; backward scatters rows back into it.
#include <algorithm>

#include "nn/grad.hpp"
#include "qkv/nn.hpp"
#include "core/random.hpp"

namespace qkv::nn {

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim, std::optional<uint64_t> seed) {
  if (num_embeddings < 1 || embedding_dim < 1)
    throw Error("Embedding: num_embeddings (" + std::to_string(num_embeddings) + ") and embedding_dim (" +
                std::to_string(embedding_dim) + ") must be at least 1");
  weight = Tensor::randn({num_embeddings, embedding_dim}, seed ? *seed : detail::next_seed());  // N(0, 1), as torch
  zero_grad();
}

Tensor Embedding::forward(const std::vector<int64_t>& ids) const {
  return forward(ids, Shape{static_cast<int64_t>(ids.size())});
}

Tensor Embedding::forward(const std::vector<int64_t>& ids, const Shape& leading) const {
  if (leading.numel() != static_cast<int64_t>(ids.size()))
    throw Error("Embedding: " + std::to_string(ids.size()) + " ids do not fill the leading shape " + leading.str());
  const int64_t vocab = weight.size(0), dim = weight.size(1);
  std::vector<int64_t> dims(leading.begin(), leading.end());
  dims.push_back(dim);
  Tensor y = Tensor::empty(Shape(std::move(dims)));
  const float* table = weight.data();
  float* out = y.data();
  for (size_t n = 0; n < ids.size(); ++n) {
    if (ids[n] < 0 || ids[n] >= vocab)
      throw Error("Embedding: id " + std::to_string(ids[n]) + " at position " + std::to_string(n) +
                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    std::copy_n(table + ids[n] * dim, dim, out + static_cast<int64_t>(n) * dim);
  }
  saved_ids_ = ids;
  return y;
}

void Embedding::backward(const Tensor& grad_output) {
  const int64_t dim = weight.size(1), count = static_cast<int64_t>(saved_ids_.size());
  if (!grad_output.defined() || grad_output.dim() < 1 || grad_output.size(-1) != dim || grad_output.numel() != count * dim)
    throw Error("Embedding::backward: grad_output is " + grad::shape_str(grad_output) + " but the forward looked up " +
                std::to_string(count) + " ids of dim " + std::to_string(dim));
  if (weight_grad.shape() != weight.shape())
    throw Error("Embedding::backward: weight_grad is " + grad::shape_str(weight_grad) + " but weight is " +
                weight.shape().str() + ": call zero_grad() after replacing weight");
  const Tensor g = grad_output.contiguous();
  // y[n] = table[ids[n]]  ->  dtable[ids[n]] += g[n]
  float* dtable = weight_grad.data();
  const float* gd = g.data();
  for (int64_t n = 0; n < count; ++n)
    for (int64_t e = 0; e < dim; ++e) dtable[saved_ids_[n] * dim + e] += gd[n * dim + e];
}

void Embedding::zero_grad() { grad::reset_grad(weight_grad, weight); }

std::vector<NamedTensor> Embedding::parameters(const std::string& prefix) const {
  return {{prefix + "weight", weight, weight_grad}};
}

}  // namespace qkv::nn
