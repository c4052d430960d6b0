// The .qkv file of qkv::train::AttentionModel (the format is documented in include/qkv/train.hpp):
// save, and load with every field checked. The bytes reach the disk through file_io.hpp.
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/crc32c.hpp"
#include "train/file_io.hpp"
#include "train/model.hpp"

namespace qkv::train {

namespace {

constexpr char kMagic[8] = {'Q', 'K', 'V', 'M', 'O', 'D', 'E', 'L'};
constexpr uint32_t kCheckpointFlag = 1;
static_assert(std::endian::native == std::endian::little, "the .qkv writer assumes a little-endian host");

// How many saves this process has started (the test hook below counts them).
std::atomic<int> saves_started{0};

// Test-only hook: QKV_TEST_KILL_IN_SAVE=n makes the n-th save of this process SIGKILL itself
// halfway through writing the temporary file, as a crash or `kill -9` would (tests/train/test_train.cpp
// and tests/cli/train_kill_check.cmake show the previous file survives).
bool kill_in_this_save(int save_number) {
  const char* env = std::getenv("QKV_TEST_KILL_IN_SAVE");
  return env != nullptr && std::atoi(env) == save_number;
}

// "" when every value is finite, else "nan at index i" / "inf at index i" for the first that is not.
std::string first_non_finite(const float* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i)
    if (!std::isfinite(values[i]))
      return std::string(std::isnan(values[i]) ? "nan" : values[i] > 0 ? "inf" : "-inf") + " at index " +
             std::to_string(i);
  return "";
}

// Reads the bytes of a .qkv file held in memory, each read bounds-checked.
class Reader {
 public:
  Reader(const char* data, int64_t size, const std::string& name) : data_(data), size_(size), name_(name) {}
  void bytes(void* out, int64_t n, const char* what) {
    if (n < 0 || n > size_ - offset_)
      throw Error("AttentionModel::load: '" + name_ + "' is truncated: " + what + " needs " + std::to_string(n) +
                  " bytes at offset " + std::to_string(offset_) + " but the data ends at " + std::to_string(size_));
    std::memcpy(out, data_ + offset_, static_cast<size_t>(n));
    offset_ += n;
  }
  template <typename T>
  T value(const char* what) {
    T v;
    bytes(&v, sizeof v, what);
    return v;
  }
  [[noreturn]] void fail(const std::string& message) const {
    throw Error("AttentionModel::load: '" + name_ + "': " + message);
  }
  int64_t offset() const { return offset_; }
  int64_t size() const { return size_; }
  void set_size(int64_t size) { size_ = size; }  // the checksum's 4 bytes are not content

 private:
  const char* data_;
  int64_t size_;
  std::string name_;
  int64_t offset_ = 0;
};

// How many floats the parameters of a model with this config hold (what parameters() returns),
// computed before building it so a file cannot make load() allocate more than it carries.
int64_t parameter_floats(const ModelConfig& c) {
  const int64_t d = c.d_model, v = c.vocab_size;
  const int64_t per_layer = 2 * d + 4 * (d * d + d);  // norm weight + bias, four projections with bias
  return v * d + c.num_layers * per_layer + 2 * d + d * v + v;
}

// What the bytes before the tensors say: the format version, the flags, the config.
struct Header {
  uint32_t version = 0;
  uint32_t flags = 0;
  ModelConfig config;
};

// The magic number, the version and, from version 2, the checksum of the whole file and the flags.
void read_preamble(Reader& in, const void* bytes, size_t size, Header& header) {
  char magic[sizeof kMagic];
  if (in.size() < static_cast<int64_t>(sizeof kMagic)) in.fail("not a qkv model file (too short for the magic number)");
  in.bytes(magic, sizeof magic, "the magic number");
  if (std::memcmp(magic, kMagic, sizeof kMagic) != 0) in.fail("not a qkv model file (no QKVMODEL magic number)");
  const auto version = in.value<uint32_t>("the version");
  if (version < 1 || version > kModelFormatVersion)
    in.fail("format version " + std::to_string(version) + ", but this qkv reads versions 1 to " +
            std::to_string(kModelFormatVersion));
  uint32_t flags = 0;
  if (version >= 2) {
    // The checksum first: whatever else is wrong with a damaged file, this says what happened.
    if (in.size() < 16) in.value<uint32_t>("the flags");  // throws "truncated"
    uint32_t stored;
    std::memcpy(&stored, static_cast<const char*>(bytes) + size - 4, 4);
    const uint32_t computed = detail::crc32c_update(0, bytes, size - 4);
    if (stored != computed) {
      char message[160];
      std::snprintf(message, sizeof message,
                    "corrupt or truncated: the CRC-32C of its %zu bytes is %08x but the file says %08x", size - 4,
                    computed, stored);
      in.fail(message);
    }
    in.set_size(in.size() - 4);
    flags = in.value<uint32_t>("the flags");
    if (flags & ~kCheckpointFlag) in.fail("unknown flags " + std::to_string(flags));
  }
  header.version = version;
  header.flags = flags;
}

// The config, checked as the constructor checks it (version 3 adds attention, positions, mask).
void read_config(Reader& in, Header& header) {
  ModelConfig& config = header.config;
  for (int64_t* field : {&config.vocab_size, &config.max_len, &config.d_model, &config.num_heads, &config.num_layers})
    *field = in.value<int64_t>("the config");
  if (header.version >= 3) {
    const auto attention = in.value<uint32_t>("the attention kind");
    if (attention > 1) in.fail("unknown attention kind " + std::to_string(attention) + " (0 softmax, 1 linear)");
    config.attention = attention == 1 ? nn::AttentionKind::Linear : nn::AttentionKind::Softmax;
    const auto positions = in.value<uint32_t>("the positions");
    if (positions > 2) in.fail("unknown positions " + std::to_string(positions) + " (0 sinusoidal, 1 rotary, 2 t5)");
    config.positions = positions == 2 ? Positions::T5 : positions == 1 ? Positions::Rotary : Positions::Sinusoidal;
    const auto mask_length = in.value<uint32_t>("the mask's length");
    if (mask_length > kMaxMaskText)
      in.fail("a mask expression of " + std::to_string(mask_length) + " bytes (at most " +
              std::to_string(kMaxMaskText) + ")");
    config.mask.resize(mask_length);
    in.bytes(config.mask.data(), mask_length, "the mask expression");
  }
  try {
    checked(config);
    (void)parsed_mask(config.mask);
  } catch (const Error& e) {
    in.fail(std::string("bad config: ") + e.what());
  }
}

// Every tensor's name, shape and values, in parameters() order, into the model's tensors.
void read_tensors(Reader& in, const std::vector<nn::NamedTensor>& params) {
  const auto count = in.value<uint32_t>("the tensor count");
  if (count != params.size())
    in.fail(std::to_string(count) + " tensors, but the config's model has " + std::to_string(params.size()));
  for (const auto& p : params) {
    const auto name_length = in.value<uint32_t>("a tensor name's length");
    if (name_length != p.name.size()) in.fail("expected tensor '" + p.name + "' at offset " + std::to_string(in.offset() - 4));
    std::string tensor_name(name_length, '\0');
    in.bytes(tensor_name.data(), name_length, "a tensor name");
    if (tensor_name != p.name) in.fail("expected tensor '" + p.name + "' but found '" + tensor_name + "'");
    const auto rank = in.value<uint32_t>("a tensor rank");
    if (rank != static_cast<uint32_t>(p.tensor.dim()))
      in.fail(tensor_name + " has rank " + std::to_string(rank) + " but should be " + p.tensor.shape().str());
    std::vector<int64_t> dims(rank);
    for (auto& d : dims) d = in.value<int64_t>("a tensor shape");
    bool same = true;
    for (uint32_t i = 0; i < rank; ++i) same = same && dims[i] == p.tensor.size(i);
    if (!same) {
      std::string got = "(";
      for (uint32_t i = 0; i < rank; ++i) got += (i ? ", " : "") + std::to_string(dims[i]);
      in.fail(tensor_name + " is " + got + ") in the file but " + p.tensor.shape().str() +
              " in the model its config describes");
    }
    in.bytes(p.tensor.data(), p.tensor.numel() * static_cast<int64_t>(sizeof(float)), tensor_name.c_str());
    if (const std::string bad = first_non_finite(p.tensor.data(), p.tensor.numel()); !bad.empty())
      in.fail("tensor '" + tensor_name + "' holds " + bad + ": a model's weights must be finite");
  }
}

// The training state after the tensors: the step, the optimizer's step count and moments.
Checkpoint read_checkpoint(Reader& in, const std::vector<nn::NamedTensor>& params, int64_t floats) {
  Checkpoint state;
  state.step = in.value<int64_t>("the checkpoint's step");
  state.optimizer.steps = in.value<int64_t>("the optimizer's step count");
  if (state.step < 0 || state.optimizer.steps < 0)
    in.fail("checkpoint step " + std::to_string(state.step) + " and optimizer step " +
            std::to_string(state.optimizer.steps) + " must be >= 0");
  if (floats > (in.size() - in.offset()) / static_cast<int64_t>(2 * sizeof(float)))
    in.fail("truncated: the optimizer state needs " + std::to_string(2 * floats * 4) + " bytes but " +
            std::to_string(in.size() - in.offset()) + " follow");
  for (auto* moments : {&state.optimizer.first_moment, &state.optimizer.second_moment})
    for (const auto& p : params) {
      moments->emplace_back(static_cast<size_t>(p.tensor.numel()));
      in.bytes(moments->back().data(), p.tensor.numel() * static_cast<int64_t>(sizeof(float)), "a moment");
      if (const std::string bad = first_non_finite(moments->back().data(), p.tensor.numel()); !bad.empty())
        in.fail("the optimizer's " + std::string(moments == &state.optimizer.first_moment ? "first" : "second") +
                " moment of '" + p.name + "' holds " + bad + ": a checkpoint's state must be finite");
    }
  return state;
}

}  // namespace

void AttentionModel::save(const std::string& path, const Checkpoint* checkpoint) const {
  const int save_number = ++saves_started;
  const auto params = parameters();
  if (checkpoint) {
    const auto& o = checkpoint->optimizer;
    bool fits = o.first_moment.size() == params.size() && o.second_moment.size() == params.size();
    for (size_t i = 0; fits && i < params.size(); ++i)
      fits = static_cast<int64_t>(o.first_moment[i].size()) == params[i].tensor.numel() &&
             static_cast<int64_t>(o.second_moment[i].size()) == params[i].tensor.numel();
    if (!fits)
      throw Error("AttentionModel::save: '" + path + "': the checkpoint's optimizer state has " +
                  std::to_string(o.first_moment.size()) + " moment tensors for " + std::to_string(params.size()) +
                  " parameters (or sizes differ)");
  }
  for (const auto& p : params)
    if (const std::string bad = first_non_finite(p.tensor.contiguous().data(), p.tensor.numel()); !bad.empty())
      save_failure(path, "tensor '" + p.name + "' holds " + bad + ": a model with non-finite weights is not saved");
  AtomicWriter out(path);
  out.bytes(kMagic, sizeof kMagic);
  out.value<uint32_t>(kModelFormatVersion);
  out.value<uint32_t>(checkpoint ? kCheckpointFlag : 0);
  for (int64_t v : {config_.vocab_size, config_.max_len, config_.d_model, config_.num_heads, config_.num_layers})
    out.value<int64_t>(v);
  out.value<uint32_t>(config_.attention == nn::AttentionKind::Linear ? 1 : 0);
  out.value<uint32_t>(config_.positions == Positions::T5 ? 2 : config_.positions == Positions::Rotary ? 1 : 0);
  out.value<uint32_t>(static_cast<uint32_t>(config_.mask.size()));
  out.bytes(config_.mask.data(), config_.mask.size());
  out.value<uint32_t>(static_cast<uint32_t>(params.size()));
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    out.value<uint32_t>(static_cast<uint32_t>(p.name.size()));
    out.bytes(p.name.data(), p.name.size());
    out.value<uint32_t>(static_cast<uint32_t>(p.tensor.dim()));
    for (int64_t d : p.tensor.shape()) out.value<int64_t>(d);
    const Tensor values = p.tensor.contiguous();
    out.bytes(values.data(), static_cast<size_t>(values.numel()) * sizeof(float));
    if (i == params.size() / 2 && kill_in_this_save(save_number)) out.die_here();
  }
  if (checkpoint) {
    out.value<int64_t>(checkpoint->step);
    out.value<int64_t>(checkpoint->optimizer.steps);
    for (const auto* moments : {&checkpoint->optimizer.first_moment, &checkpoint->optimizer.second_moment})
      for (const auto& m : *moments) out.bytes(m.data(), m.size() * sizeof(float));
  }
  out.commit();
}

std::string AttentionModel::file_warning() const {
  if (file_version_ != 1) return "";
  return "a format version 1 file, which carries no checksum: damage to its weights cannot be detected (saving "
         "the model again writes version " + std::to_string(kModelFormatVersion) + ", checksummed)";
}

AttentionModel AttentionModel::load(const std::string& path, Checkpoint* checkpoint) {
  const std::vector<char> data = read_model_file(path);
  return load_bytes(data.data(), data.size(), path, checkpoint);
}

AttentionModel AttentionModel::load_bytes(const void* bytes, size_t size, const std::string& name,
                                          Checkpoint* checkpoint) {
  Reader in(static_cast<const char*>(bytes), static_cast<int64_t>(size), name);
  Header header;
  read_preamble(in, bytes, size, header);
  read_config(in, header);
  const int64_t floats = parameter_floats(header.config);
  if (floats > (in.size() - in.offset()) / static_cast<int64_t>(sizeof(float)))
    in.fail("truncated: its config describes " + std::to_string(floats) + " parameters (" +
            std::to_string(floats * static_cast<int64_t>(sizeof(float))) + " bytes) but only " +
            std::to_string(in.size() - in.offset()) + " bytes follow the config");
  AttentionModel model(header.config, 0);
  const auto params = model.parameters();
  read_tensors(in, params);
  Checkpoint state;
  if (header.flags & kCheckpointFlag) state = read_checkpoint(in, params, floats);
  if (in.offset() != in.size())
    in.fail(std::to_string(in.size() - in.offset()) + " unexpected bytes after the last tensor");
  if (checkpoint) *checkpoint = std::move(state);
  model.file_version_ = header.version;
  return model;
}

}  // namespace qkv::train
