// qkv::nn::Embedding: row lookup in a (vocab, dim) table.
#include <algorithm>

#include "qkv/nn.hpp"
#include "random.hpp"

namespace qkv::nn {

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim, std::optional<uint64_t> seed) {
  if (num_embeddings < 1 || embedding_dim < 1)
    throw Error("Embedding: num_embeddings (" + std::to_string(num_embeddings) + ") and embedding_dim (" +
                std::to_string(embedding_dim) + ") must be at least 1");
  weight = Tensor::randn({num_embeddings, embedding_dim}, seed ? *seed : detail::next_seed());  // N(0, 1), as torch
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
  return y;
}

std::vector<NamedTensor> Embedding::parameters(const std::string& prefix) const {
  return {{prefix + "weight", weight}};
}

}  // namespace qkv::nn
