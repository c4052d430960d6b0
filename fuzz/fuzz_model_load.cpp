// libFuzzer target: the .qkv model loader (qkv::train::AttentionModel::load_bytes, what load()
// runs on a file's bytes). Input byte 0 picks the mode: odd = the rest as is (the checksum
// check's own fuzzing), even = the rest with its last 4 bytes replaced by the right CRC-32C, so
// mutations reach the parser behind the checksum. Every outcome must be a model or a qkv::Error;
// a model must be within the config bounds of qkv/train.hpp, hold finite weights and run.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/crc32c.hpp"
#include "qkv/qkv.hpp"
#include "qkv/train.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  qkv::set_memory_limit(int64_t{256} << 20);
  if (size == 0) return 0;
  std::vector<uint8_t> bytes(data + 1, data + size);
  if ((data[0] & 1) == 0 && bytes.size() >= 4) {
    const uint32_t crc = qkv::detail::crc32c_update(0, bytes.data(), bytes.size() - 4);
    std::memcpy(bytes.data() + bytes.size() - 4, &crc, 4);
  }
  try {
    qkv::train::Checkpoint checkpoint;
    const qkv::train::AttentionModel model =
        qkv::train::AttentionModel::load_bytes(bytes.data(), bytes.size(), "fuzz input", &checkpoint);
    // A loaded model is within the documented bounds and holds finite weights only...
    const qkv::train::ModelConfig& c = model.config();
    if (c.max_len > qkv::train::kMaxLen || c.max_len * c.d_model * 4 > qkv::train::kMaxPositionTableBytes)
      __builtin_trap();
    for (const auto& p : model.parameters()) {
      const qkv::Tensor values = p.tensor.contiguous();
      if (!std::all_of(values.data(), values.data() + values.numel(), [](float x) { return std::isfinite(x); }))
        __builtin_trap();
    }
    // ... and runs.
    const int64_t length = std::min<int64_t>(model.config().max_len, 3);
    std::vector<int64_t> ids(static_cast<size_t>(length), 0);
    (void)model.forward(ids, 1, length);
  } catch (const qkv::Error&) {
  }
  return 0;
}
