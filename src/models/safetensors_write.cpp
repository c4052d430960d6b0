// write_safetensors and write_safetensors_shards: valid checkpoints for tests and benchmarks.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>

#include "models/file_access.hpp"
#include "qkv/error.hpp"
#include "qkv/models/safetensors.hpp"

namespace qkv::models {
namespace {

using Json = nlohmann::ordered_json;

size_t element_bytes_or_throw(const SafetensorsTensor& tensor, const std::filesystem::path& path) {
  static const std::pair<std::string_view, size_t> sizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  for (const auto& [name, size] : sizes)
    if (name == tensor.dtype) return size;
  throw Error("write_safetensors '" + path.string() + "': tensor '" + tensor.name + "': unknown dtype '" +
              tensor.dtype + "'");
}

// Checks `tensor` against the format and returns its byte count.
size_t checked_bytes(const SafetensorsTensor& tensor, const std::filesystem::path& path) {
  const std::string where = "write_safetensors '" + path.string() + "': tensor '" + tensor.name + "': ";
  if (tensor.name.empty() || tensor.name == "__metadata__")
    throw Error("write_safetensors '" + path.string() + "': a tensor cannot be called '" + tensor.name + "'");
  uint64_t bytes = element_bytes_or_throw(tensor, path);
  for (const int64_t dim : tensor.shape) {
    if (dim < 0) throw Error(where + "negative dim " + std::to_string(dim));
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes)) throw Error(where + "shape overflows");
  }
  if (bytes != tensor.bytes.size())
    throw Error(where + "has " + std::to_string(tensor.bytes.size()) + " bytes but its dtype and shape need " +
                std::to_string(bytes));
  return bytes;
}

}  // namespace

std::string_view safetensors_dtype(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I8:
    case DType::I4: break;  // quantized K/V carry scales beside them: not a safetensors dtype
  }
  throw Error("safetensors_dtype: " + std::string(to_string(dtype)) + " has no safetensors dtype");
}

void write_safetensors(const std::filesystem::path& path, std::span<const SafetensorsTensor> tensors) {
  Json header = Json::object();
  std::set<std::string> seen;
  uint64_t offset = 0;
  std::vector<uint64_t> starts;
  for (const SafetensorsTensor& tensor : tensors) {
    if (!seen.insert(tensor.name).second)
      throw Error("write_safetensors '" + path.string() + "': tensor '" + tensor.name + "' given twice");
    const size_t bytes = checked_bytes(tensor, path);
    starts.push_back(offset);
    header[tensor.name] = {{"dtype", tensor.dtype}, {"shape", tensor.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string text = header.dump();
  // The data section starts 8-aligned, as the format's own writer pads it.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string file(8, '\0');
  const uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) file[static_cast<size_t>(i)] = static_cast<char>((length >> (8 * i)) & 0xff);
  file += text;
  file.reserve(file.size() + offset);
  for (const SafetensorsTensor& tensor : tensors)
    file.append(reinterpret_cast<const char*>(tensor.bytes.data()), tensor.bytes.size());
  detail::write_file_atomically(path, file);
}

void write_safetensors_shards(const std::filesystem::path& folder, std::span<const SafetensorsTensor> tensors,
                              int shards) {
  if (shards < 1 || static_cast<size_t>(shards) > tensors.size())
    throw Error("write_safetensors_shards: " + std::to_string(shards) + " shards for " +
                std::to_string(tensors.size()) + " tensors");
  uint64_t total = 0;
  std::set<std::string> seen;
  for (const SafetensorsTensor& tensor : tensors) {
    if (!seen.insert(tensor.name).second)
      throw Error("write_safetensors_shards: tensor '" + tensor.name + "' given twice");
    total += tensor.bytes.size();
  }
  Json index = {{"metadata", {{"total_size", total}}}, {"weight_map", Json::object()}};
  size_t next = 0;
  uint64_t written = 0;
  for (int shard = 0; shard < shards; ++shard) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", shard + 1, shards);
    // Take tensors until this shard's share of the bytes is reached, leaving one per shard left.
    const uint64_t target = total * static_cast<uint64_t>(shard + 1) / static_cast<uint64_t>(shards);
    const size_t first = next;
    const size_t last_allowed = tensors.size() - static_cast<size_t>(shards - shard - 1);
    do {
      written += tensors[next].bytes.size();
      index["weight_map"][tensors[next].name] = name;
      ++next;
    } while (next < last_allowed && (written < target || shard == shards - 1));
    write_safetensors(folder / name, tensors.subspan(first, next - first));
  }
  detail::write_file_atomically(folder / "model.safetensors.index.json", index.dump(2));
}

}  // namespace qkv::models
