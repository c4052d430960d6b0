// Safetensors checkpoints, as Hugging Face writes them: one `model.safetensors`, or shards listed
// by `model.safetensors.index.json`. A file is an 8-byte little-endian header length N, N bytes
// of JSON ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}),
// then the data section the offsets index.
//
// SafetensorsWeights memory-maps each file read-only (MAP_PRIVATE) and hands out views into the
// mapping in the stored dtype (F32, BF16, F16): nothing is widened or copied, except a tensor
// whose offset leaves its elements misaligned for their type, which is copied once, aligned.
// Every header field is checked when the file is opened; any fault is a qkv::Error naming the
// file, the tensor and what was expected against what was found.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "qkv/models/weights.hpp"

namespace qkv::models {

class SafetensorsWeights : public WeightSource {
 public:
  // One file (e.g. "model.safetensors").
  static SafetensorsWeights open_file(const std::filesystem::path& file);
  // The shards an index (e.g. "model.safetensors.index.json") names in its weight_map: plain
  // file names in the index's folder; every tensor of the map must be in the shard it names.
  static SafetensorsWeights open_index(const std::filesystem::path& index);
  // A model folder's weights: model.safetensors.index.json when present, else model.safetensors.
  static SafetensorsWeights open_folder(const std::filesystem::path& folder);

  SafetensorsWeights(SafetensorsWeights&&) noexcept;
  SafetensorsWeights& operator=(SafetensorsWeights&&) noexcept;
  ~SafetensorsWeights() override;  // unmaps every file

  // A tensor stored in F32, BF16 or F16, or nullptr when there is none of that name. A tensor
  // of another safetensors dtype (I64, F64, ...) throws qkv::Error naming it and its dtype.
  const WeightView* find(std::string_view name) const override;
  // "<file>: tensor '<name>'", or "<files>: no tensor '<name>'".
  std::string describe(std::string_view name) const override;
  // Every tensor's name, sorted; those of unsupported dtypes included.
  std::vector<std::string> names() const;
  // The safetensors dtype of `name` as stored ("F32", "I64", ...); throws when there is none.
  std::string stored_dtype(std::string_view name) const;

 private:
  struct State;
  explicit SafetensorsWeights(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// One tensor to write: its name, safetensors dtype ("F32", "BF16", "F16", or any other dtype the
// format defines, e.g. "I64"), shape and row-major bytes (exactly numel x element size of them).
struct SafetensorsTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;
};

// The format's name of a qkv dtype: "F32", "BF16", "F16".
std::string_view safetensors_dtype(DType dtype);

// Writes a valid safetensors file at `path` atomically (a temporary file beside it, renamed over
// it once complete), tensors in the order given, each aligned to 8 bytes. Throws qkv::Error for a
// repeated or empty name, an unknown dtype, a negative dim or bytes that do not match the shape.
void write_safetensors(const std::filesystem::path& path, std::span<const SafetensorsTensor> tensors);

// Writes `tensors` in `shards` files "model-0000i-of-0000n.safetensors" (consecutive runs of
// tensors, about equal in bytes) and "model.safetensors.index.json" naming them, into `folder`.
void write_safetensors_shards(const std::filesystem::path& folder, std::span<const SafetensorsTensor> tensors,
                              int shards);

}  // namespace qkv::models
