// qkv::nn::CrossEntropyLoss: log-softmax + negative log-likelihood in one step; forward keeps the
// softmax, so backward is (softmax - onehot) / count.
#include <algorithm>
#include <cmath>
#include <limits>

#include "nn/grad.hpp"
#include "qkv/nn.hpp"

namespace qkv::nn {

float CrossEntropyLoss::forward(const Tensor& logits, const std::vector<int64_t>& targets) {
  if (!logits.defined() || logits.dim() < 1 || logits.size(-1) < 1)
    throw Error("CrossEntropyLoss: logits are " + grad::shape_str(logits) + ", expected (..., classes)");
  const int64_t classes = logits.size(-1), rows = logits.numel() / classes;
  if (static_cast<int64_t>(targets.size()) != rows)
    throw Error("CrossEntropyLoss: logits " + logits.shape().str() + " have " + std::to_string(rows) + " rows but " +
                std::to_string(targets.size()) + " targets were given");
  for (size_t r = 0; r < targets.size(); ++r)
    if (targets[r] != ignore_index_ && (targets[r] < 0 || targets[r] >= classes))
      throw Error("CrossEntropyLoss: target " + std::to_string(targets[r]) + " at row " + std::to_string(r) +
                  " is outside [0, " + std::to_string(classes) + ") and is not ignore_index (" +
                  std::to_string(ignore_index_) + ")");
  const Tensor input = logits.contiguous();
  Tensor probabilities = Tensor::empty(logits.shape());
  const float* in = input.data();
  float* p = probabilities.data();
  double total = 0;
  int64_t count = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = in + r * classes;
    // softmax with the running max subtracted; log-sum-exp = max + log(sum)
    const float max = *std::max_element(row, row + classes);
    double sum = 0;
    for (int64_t c = 0; c < classes; ++c) sum += std::exp(static_cast<double>(row[c]) - max);
    for (int64_t c = 0; c < classes; ++c)
      p[r * classes + c] = static_cast<float>(std::exp(static_cast<double>(row[c]) - max) / sum);
    if (targets[static_cast<size_t>(r)] == ignore_index_) continue;
    total += max + std::log(sum) - row[targets[static_cast<size_t>(r)]];
    ++count;
  }
  probabilities_ = probabilities;
  targets_ = targets;
  count_ = count;
  return count == 0 ? 0.0f : static_cast<float>(total / static_cast<double>(count));
}

Tensor CrossEntropyLoss::backward(float grad_loss) const {
  if (!probabilities_.defined()) throw Error("CrossEntropyLoss::backward: no forward to differentiate");
  const int64_t classes = probabilities_.size(-1), rows = probabilities_.numel() / classes;
  Tensor grad = Tensor::zeros(probabilities_.shape());
  if (count_ == 0) return grad;
  const float per_target = grad_loss / static_cast<float>(count_);
  const float* p = probabilities_.data();
  float* g = grad.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t target = targets_[static_cast<size_t>(r)];
    if (target == ignore_index_) continue;
    // loss_r = logsumexp(z) - z[t]  ->  dz = softmax(z) - onehot(t)
    for (int64_t c = 0; c < classes; ++c) g[r * classes + c] = p[r * classes + c] * per_target;
    g[r * classes + target] -= per_target;
  }
  return grad;
}

}  // namespace qkv::nn
