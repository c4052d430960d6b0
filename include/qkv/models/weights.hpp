// qkv::models::WeightSource: named, read-only weight tensors in their stored dtype, as a model
// folder holds them (safetensors files, memory-mapped). The architectures (src/models/) read
// their parameters through it; the loaders implement it; tests implement it over memory.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/dtype.hpp"

namespace qkv::models {

// One stored tensor: row-major, contiguous, element 0 at `data`, valid as long as its source.
struct WeightView {
  DType dtype = DType::F32;     // F32, BF16 or F16, as stored: never widened on load
  std::vector<int64_t> shape;   // as stored
  const void* data = nullptr;
};

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // The tensor called `name` (e.g. "model.layers.0.self_attn.q_proj.weight"), or nullptr.
  virtual const WeightView* find(std::string_view name) const = 0;
  // Where `name` lives, for error messages: "model-00001-of-00002.safetensors: tensor 'x'".
  virtual std::string describe(std::string_view name) const = 0;
};

}  // namespace qkv::models
