// What model.cpp, cached_forward.cpp and model_file.cpp share beyond include/qkv/train.hpp.
#pragma once

#include <chrono>
#include <string>

#include "qkv/train.hpp"

namespace qkv::train {

// The config if it is within the bounds and consistent, else a qkv::Error naming what is not.
ModelConfig checked(const ModelConfig& c);

// The config's mask expression, parsed; a descriptive form parse() cannot read back is refused,
// so that what a model file says is what the model does.
Mask parsed_mask(const std::string& text);

double seconds_since(std::chrono::steady_clock::time_point start);

// a + b, same shapes, as a new tensor (the residual connections of forward: x itself must not
// change, the LayerNorm that read it keeps it for backward).
Tensor add(const Tensor& a, const Tensor& b);

}  // namespace qkv::train
