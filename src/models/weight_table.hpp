// The weights an architecture asks for, each checked once against the config when the model is
// built: present, of a dtype qkv reads (F32, BF16, F16), with the shape the config implies.
// Matrices stay where the WeightSource holds them; vectors (norms, biases) are widened to float32
// copies, a few kilobytes a layer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/linear_any.hpp"
#include "qkv/models/weights.hpp"

namespace qkv::models::detail {

class WeightTable {
 public:
  // `model` names the model in error messages ("LlamaForCausalLM (2 layers, hidden 40)").
  WeightTable(const WeightSource& source, std::string model) : source_(source), model_(std::move(model)) {}

  bool contains(const std::string& name) const { return source_.find(name) != nullptr; }

  // A (rows, cols) tensor as stored, read as W in `layout`: OutIn rows = out, InOut rows = in.
  StoredMatrix matrix(const std::string& name, int64_t rows, int64_t cols, Layout layout = Layout::OutIn) const;
  // A (n) tensor, widened to float32.
  std::vector<float> vector(const std::string& name, int64_t n) const;

 private:
  // The tensor `name` with exactly `shape`, else qkv::Error naming it, the expected and found shapes.
  const WeightView& expect(const std::string& name, const std::vector<int64_t>& shape) const;

  const WeightSource& source_;
  std::string model_;
};

}  // namespace qkv::models::detail
