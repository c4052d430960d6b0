// libFuzzer target: the safetensors reader (qkv::models::SafetensorsWeights). Input byte 0 picks
// the mode: even = the rest is a .safetensors file; odd = the rest is a
// model.safetensors.index.json beside one valid shard, "shard.safetensors". Every outcome must
// be weights or a qkv::Error; every tensor found is read whole, so a view past its file faults.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "qkv/error.hpp"
#include "qkv/models/safetensors.hpp"

namespace {

// A folder of this process's own, in memory where the system has one; removed at exit.
struct Scratch {
  std::filesystem::path path;
  Scratch() {
    const std::filesystem::path base =
        std::filesystem::exists("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path();
    path = base / ("qkv-fuzz-safetensors-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
    const std::vector<uint8_t> eight(8, 1);
    qkv::models::write_safetensors(path / "shard.safetensors",
                                   std::vector<qkv::models::SafetensorsTensor>{{"a", "F32", {2}, eight}});
  }
  ~Scratch() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

const std::filesystem::path& scratch() {
  static const Scratch folder;
  return folder.path;
}

void write(const std::filesystem::path& path, const uint8_t* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool index = (data[0] & 1) != 0;
  const std::filesystem::path file = scratch() / (index ? "model.safetensors.index.json" : "model.safetensors");
  write(file, data + 1, size - 1);
  try {
    const qkv::models::SafetensorsWeights weights =
        index ? qkv::models::SafetensorsWeights::open_index(file) : qkv::models::SafetensorsWeights::open_file(file);
    volatile uint8_t sink = 0;
    for (const std::string& name : weights.names()) {
      (void)weights.describe(name);
      const qkv::models::WeightView* view = nullptr;
      try {
        view = weights.find(name);
      } catch (const qkv::Error&) {
        continue;  // a dtype qkv does not read
      }
      if (view == nullptr) __builtin_trap();  // names() lists it
      size_t bytes = qkv::element_size(view->dtype);
      for (const int64_t dim : view->shape) bytes *= static_cast<size_t>(dim);
      const auto* p = static_cast<const uint8_t*>(view->data);
      for (size_t i = 0; i < bytes; ++i) sink = sink ^ p[i];
    }
  } catch (const qkv::Error&) {
  }
  return 0;
}
