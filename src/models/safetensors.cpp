#include "qkv/models/safetensors.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "models/file_access.hpp"
#include "models/json_parse.hpp"
#include "qkv/error.hpp"

namespace qkv::models {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors are little-endian, as this reader's host");

using Json = nlohmann::json;
using detail::brief;

// The header may be at most this long (the format's reference reader has the same bound).
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
// An index is a few hundred kilobytes for the largest models.
constexpr size_t kMaxIndexBytes = size_t{64} << 20;

// Every dtype the safetensors format defines, with its element size in bytes.
std::optional<size_t> element_bytes(std::string_view dtype) {
  static const std::map<std::string_view, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8}, {"U64", 8}};
  const auto it = sizes.find(dtype);
  if (it == sizes.end()) return std::nullopt;
  return it->second;
}

std::optional<DType> qkv_dtype(std::string_view dtype) {
  if (dtype == "F32") return DType::F32;
  if (dtype == "BF16") return DType::BF16;
  if (dtype == "F16") return DType::F16;
  return std::nullopt;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "(";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + (shape.size() == 1 ? ",)" : ")");
}

struct Entry {
  size_t file = 0;          // index into State::files
  std::string dtype;        // as stored
  WeightView view;          // view.dtype meaningful only when `supported`
  bool supported = false;
  uint64_t begin = 0, end = 0;  // within the data section
};

// What one file's header says, checked.
struct Header {
  std::map<std::string, Entry> tensors;
};

[[noreturn]] void bad(const std::filesystem::path& file, const std::string& what) {
  throw Error(detail::quoted(file) + ": " + what);
}

[[noreturn]] void bad_tensor(const std::filesystem::path& file, const std::string& name, const std::string& what) {
  bad(file, "tensor '" + name + "': " + what);
}

std::vector<int64_t> parse_shape(const std::filesystem::path& file, const std::string& name, const Json& shape) {
  if (!shape.is_array()) bad_tensor(file, name, "shape must be an array of dims, found " + brief(shape));
  std::vector<int64_t> dims;
  for (const Json& dim : shape) {
    if (!dim.is_number_integer() || (dim.is_number_integer() && !dim.is_number_unsigned() && dim.get<int64_t>() < 0))
      bad_tensor(file, name, "shape " + brief(shape) + " must hold non-negative integers");
    const uint64_t value = dim.get<uint64_t>();
    if (value > static_cast<uint64_t>(INT64_MAX)) bad_tensor(file, name, "shape " + brief(shape) + " has a dim past 2^63");
    dims.push_back(static_cast<int64_t>(value));
  }
  return dims;
}

// Bytes of `dims` elements of `element` bytes each; throws when the product overflows 64 bits.
uint64_t tensor_bytes(const std::filesystem::path& file, const std::string& name, const std::vector<int64_t>& dims,
                      size_t element) {
  if (std::find(dims.begin(), dims.end(), 0) != dims.end()) return 0;
  uint64_t bytes = element;
  for (const int64_t dim : dims) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(dim), &bytes))
      bad_tensor(file, name, "shape " + shape_text(dims) + " holds more bytes than 2^64");
  }
  return bytes;
}

Entry parse_entry(const std::filesystem::path& file, const std::string& name, const Json& value, uint64_t data_bytes) {
  if (name.empty()) bad(file, "a tensor has an empty name");
  if (!value.is_object()) bad_tensor(file, name, "expected an object with dtype, shape and data_offsets, found " + brief(value));
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!value.contains(key)) bad_tensor(file, name, std::string("no '") + key + "'");
  Entry entry;
  const Json& dtype = value["dtype"];
  if (!dtype.is_string()) bad_tensor(file, name, "dtype must be a string, found " + brief(dtype));
  entry.dtype = dtype.get<std::string>();
  const std::optional<size_t> element = element_bytes(entry.dtype);
  if (!element) bad_tensor(file, name, "unknown dtype '" + entry.dtype + "'");
  entry.view.shape = parse_shape(file, name, value["shape"]);
  const uint64_t bytes = tensor_bytes(file, name, entry.view.shape, *element);
  const Json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned())
    bad_tensor(file, name, "data_offsets must be [begin, end], two non-negative integers, found " + brief(offsets));
  entry.begin = offsets[0].get<uint64_t>();
  entry.end = offsets[1].get<uint64_t>();
  if (entry.begin > entry.end)
    bad_tensor(file, name, "data_offsets " + brief(offsets) + " end before they begin");
  if (entry.end > data_bytes)
    bad_tensor(file, name, "data_offsets " + brief(offsets) + " run past the data section's " +
                               std::to_string(data_bytes) + " bytes");
  if (entry.end - entry.begin != bytes)
    bad_tensor(file, name, "data_offsets " + brief(offsets) + " hold " + std::to_string(entry.end - entry.begin) +
                               " bytes but " + entry.dtype + " " + shape_text(entry.view.shape) + " needs " +
                               std::to_string(bytes));
  if (const std::optional<DType> type = qkv_dtype(entry.dtype)) {
    entry.supported = true;
    entry.view.dtype = *type;
  }
  return entry;
}

// The tensors must tile the data section: none overlap, and no byte belongs to none (the
// format's rule, which keeps a file from hiding other content between its tensors).
void check_layout(const std::filesystem::path& file, const std::map<std::string, Entry>& tensors, uint64_t data_bytes) {
  std::vector<std::pair<const std::string*, const Entry*>> order;
  for (const auto& [name, entry] : tensors)
    if (entry.end > entry.begin) order.emplace_back(&name, &entry);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  uint64_t covered = 0;
  const std::string* previous = nullptr;
  for (const auto& [name, entry] : order) {
    if (entry->begin < covered)
      bad_tensor(file, *name, "data_offsets [" + std::to_string(entry->begin) + ", " + std::to_string(entry->end) +
                                  "] overlap tensor '" + *previous + "', which ends at " + std::to_string(covered));
    if (entry->begin > covered)
      bad(file, "bytes [" + std::to_string(covered) + ", " + std::to_string(entry->begin) +
                    ") of the data section belong to no tensor");
    covered = entry->end;
    previous = name;
  }
  if (covered != data_bytes)
    bad(file, "bytes [" + std::to_string(covered) + ", " + std::to_string(data_bytes) +
                  ") of the data section belong to no tensor");
}

Header parse_header(const detail::MappedFile& mapped) {
  const std::filesystem::path& file = mapped.path();
  if (mapped.size() < 8)
    bad(file, "the file is " + std::to_string(mapped.size()) + " bytes, too short for the 8-byte header length");
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, mapped.data(), 8);
  if (header_bytes > kMaxHeaderBytes)
    bad(file, "the header length " + std::to_string(header_bytes) + " is more than the " +
                  std::to_string(kMaxHeaderBytes) + " bytes allowed");
  if (header_bytes > mapped.size() - 8)
    bad(file, "the header length " + std::to_string(header_bytes) + " runs past the end of the file (" +
                  std::to_string(mapped.size()) + " bytes)");
  const char* text = reinterpret_cast<const char*>(mapped.data() + 8);
  const Json json = detail::parse_json(std::string_view(text, header_bytes), detail::quoted(file) + ": the header");
  if (!json.is_object()) bad(file, "the header must be a JSON object, found " + std::string(json.type_name()));
  const uint64_t data_bytes = mapped.size() - 8 - header_bytes;
  Header header;
  for (const auto& [name, value] : json.items()) {
    if (name == "__metadata__") continue;
    header.tensors.emplace(name, parse_entry(file, name, value, data_bytes));
  }
  check_layout(file, header.tensors, data_bytes);
  return header;
}

std::string list_files(const std::vector<detail::MappedFile>& files) {
  std::string text;
  for (size_t i = 0; i < files.size(); ++i) {
    if (i > 0) text += ", ";
    text += detail::quoted(files[i].path());
  }
  return text;
}

// A shard's name as an index gives it: a plain file name in the index's folder.
void check_shard_name(const std::filesystem::path& index, const std::string& tensor, const std::string& shard) {
  const bool escapes = shard.empty() || shard == "." || shard == ".." ||
                       shard.find_first_of(std::string("/\\\0", 3)) != std::string::npos;
  if (escapes)
    bad(index, "weight_map puts tensor '" + tensor + "' in '" + shard +
                   "', which is not a plain file name in the index's folder");
}

}  // namespace

struct SafetensorsWeights::State {
  std::vector<detail::MappedFile> files;
  std::map<std::string, Entry, std::less<>> tensors;
  std::vector<std::unique_ptr<uint64_t[]>> aligned_copies;  // tensors the files hold misaligned

  void add_file(detail::MappedFile mapped) {
    const size_t index = files.size();
    Header header = parse_header(mapped);
    const uint64_t header_bytes = [&] {
      uint64_t n = 0;
      std::memcpy(&n, mapped.data(), 8);
      return n;
    }();
    const uint8_t* data = mapped.data() + 8 + header_bytes;
    files.push_back(std::move(mapped));
    for (auto& [name, entry] : header.tensors) {
      if (const auto it = tensors.find(name); it != tensors.end())
        throw Error("tensor '" + name + "' is in both '" + files[it->second.file].path().string() + "' and '" +
                    files[index].path().string() + "'");
      entry.file = index;
      entry.view.data = place(data + entry.begin, entry);
      tensors.emplace(name, std::move(entry));
    }
  }

  // The tensor's bytes where they are, or an aligned copy when its elements are misaligned.
  const void* place(const uint8_t* at, const Entry& entry) {
    const size_t element = *element_bytes(entry.dtype);
    if (reinterpret_cast<uintptr_t>(at) % element == 0) return at;
    const size_t bytes = entry.end - entry.begin;
    aligned_copies.push_back(std::make_unique<uint64_t[]>((bytes + 7) / 8));
    std::memcpy(aligned_copies.back().get(), at, bytes);
    return aligned_copies.back().get();
  }
};

SafetensorsWeights::SafetensorsWeights(std::unique_ptr<State> state) : state_(std::move(state)) {}
SafetensorsWeights::SafetensorsWeights(SafetensorsWeights&&) noexcept = default;
SafetensorsWeights& SafetensorsWeights::operator=(SafetensorsWeights&&) noexcept = default;
SafetensorsWeights::~SafetensorsWeights() = default;

SafetensorsWeights SafetensorsWeights::open_file(const std::filesystem::path& file) {
  auto state = std::make_unique<State>();
  state->add_file(detail::MappedFile(file));
  return SafetensorsWeights(std::move(state));
}

SafetensorsWeights SafetensorsWeights::open_index(const std::filesystem::path& index) {
  const std::string text = detail::read_text_file(index, kMaxIndexBytes, "safetensors index");
  const Json json = detail::parse_json(text, detail::quoted(index));
  if (!json.is_object() || !json.contains("weight_map") || !json["weight_map"].is_object())
    bad(index, "expected an object with a 'weight_map' object of tensor names to shard files");
  std::map<std::string, std::string> where;  // tensor -> shard
  std::vector<std::string> shards;          // in first-mention order
  for (const auto& [tensor, shard] : json["weight_map"].items()) {
    if (!shard.is_string()) bad(index, "weight_map['" + tensor + "'] must be a file name, found " + brief(shard));
    const std::string name = shard.get<std::string>();
    check_shard_name(index, tensor, name);
    if (std::find(shards.begin(), shards.end(), name) == shards.end()) shards.push_back(name);
    where[tensor] = name;
  }
  if (shards.empty()) bad(index, "weight_map names no tensor");
  const std::filesystem::path folder = index.parent_path();
  auto state = std::make_unique<State>();
  for (const std::string& shard : shards) {
    const std::filesystem::path path = folder / shard;
    try {
      detail::require_regular_file(path, "safetensors shard");
    } catch (const Error& e) {
      bad(index, "weight_map names shard '" + shard + "': " + e.what());
    }
    state->add_file(detail::MappedFile(path));
  }
  for (const auto& [tensor, shard] : where) {
    const auto it = state->tensors.find(tensor);
    if (it == state->tensors.end() || state->files[it->second.file].path().filename() != shard)
      bad(index, "weight_map puts tensor '" + tensor + "' in '" + shard + "', which does not hold it");
  }
  return SafetensorsWeights(std::move(state));
}

SafetensorsWeights SafetensorsWeights::open_folder(const std::filesystem::path& folder) {
  const std::filesystem::path index = folder / "model.safetensors.index.json";
  const std::filesystem::path single = folder / "model.safetensors";
  std::error_code error;
  if (std::filesystem::exists(index, error)) return open_index(index);
  if (std::filesystem::exists(single, error)) return open_file(single);
  throw Error(detail::quoted(folder) + ": no weights: looked for model.safetensors.index.json and model.safetensors");
}

const WeightView* SafetensorsWeights::find(std::string_view name) const {
  const auto it = state_->tensors.find(name);
  if (it == state_->tensors.end()) return nullptr;
  if (!it->second.supported)
    throw Error(describe(name) + " has dtype " + it->second.dtype + "; qkv reads F32, BF16 and F16 weights");
  return &it->second.view;
}

std::string SafetensorsWeights::describe(std::string_view name) const {
  const auto it = state_->tensors.find(name);
  if (it == state_->tensors.end()) return list_files(state_->files) + ": no tensor '" + std::string(name) + "'";
  return detail::quoted(state_->files[it->second.file].path()) + ": tensor '" + std::string(name) + "'";
}

std::vector<std::string> SafetensorsWeights::names() const {
  std::vector<std::string> all;
  for (const auto& [name, entry] : state_->tensors) all.push_back(name);
  return all;
}

std::string SafetensorsWeights::stored_dtype(std::string_view name) const {
  const auto it = state_->tensors.find(name);
  if (it == state_->tensors.end()) throw Error(describe(name));
  return it->second.dtype;
}

}  // namespace qkv::models
