// qkv::train::AttentionModel: embedding + positions, [LayerNorm, causal attention, residual] x L,
// LayerNorm, head. Forward in numbered passes; backward walks them in reverse. Also the .qkv
// file format (documented in include/qkv/train.hpp).
#include <bit>
#include <cstring>
#include <fstream>
#include <limits>

#include "qkv/train.hpp"
#include "random.hpp"

namespace qkv::train {

namespace {

// Each module draws its weights from a seed of its own, derived from the model's.
uint64_t module_seed(uint64_t seed, uint64_t module) { return detail::mix64(seed * 64 + module); }

ModelConfig checked(const ModelConfig& c) {
  // Bounds keep a corrupt file from asking for absurd allocations as well as catching mistakes.
  constexpr int64_t kMaxSize = int64_t{1} << 20;
  auto in_range = [&](int64_t v) { return v >= 1 && v <= kMaxSize; };
  if (!in_range(c.vocab_size) || !in_range(c.max_len) || !in_range(c.d_model) || !in_range(c.num_heads) ||
      c.num_layers < 0 || c.num_layers > 1024 || c.d_model % c.num_heads != 0)
    throw Error("AttentionModel: config vocab_size " + std::to_string(c.vocab_size) + ", max_len " +
                std::to_string(c.max_len) + ", d_model " + std::to_string(c.d_model) + ", num_heads " +
                std::to_string(c.num_heads) + ", num_layers " + std::to_string(c.num_layers) +
                ": sizes must be in [1, 2^20], layers in [0, 1024], d_model divisible by num_heads");
  return c;
}

// a + b, same shapes, as a new tensor (the residual connections of forward: x itself must not
// change, the LayerNorm that read it keeps it for backward).
Tensor add(const Tensor& a, const Tensor& b) {
  Tensor sum = a.clone();
  const float* in = b.data();
  float* out = sum.data();
  const int64_t count = sum.numel();
  for (int64_t e = 0; e < count; ++e) out[e] += in[e];
  return sum;
}

// In place: a += b, same shapes (the residual connections of backward).
void add_into(const Tensor& a, const Tensor& b) {
  float* out = a.data();
  const float* in = b.data();
  const int64_t count = a.numel();
  for (int64_t e = 0; e < count; ++e) out[e] += in[e];
}

}  // namespace

AttentionModel::AttentionModel(const ModelConfig& config, uint64_t seed)
    : embedding(checked(config).vocab_size, config.d_model, module_seed(seed, 0)),
      positions(config.max_len, config.d_model),
      final_norm(config.d_model),
      head(config.d_model, config.vocab_size, true, module_seed(seed, 1)),
      config_(config) {
  for (int64_t l = 0; l < config.num_layers; ++l)
    layers.push_back({nn::LayerNorm(config.d_model),
                      nn::MultiHeadAttention(config.d_model, config.num_heads,
                                             {.causal = true, .seed = module_seed(seed, 2 + static_cast<uint64_t>(l))})});
}

Tensor AttentionModel::forward(const std::vector<int64_t>& ids, int64_t batch, int64_t length, const Mask& mask,
                               std::vector<Tensor>* head_weights) const {
  if (batch < 1 || length < 1 || length > config_.max_len || static_cast<int64_t>(ids.size()) != batch * length)
    throw Error("AttentionModel: " + std::to_string(ids.size()) + " ids for batch " + std::to_string(batch) +
                " x length " + std::to_string(length) + " (max_len " + std::to_string(config_.max_len) + ")");
  if (head_weights) head_weights->clear();
  // ---- 1. x = embedding(ids) + pe
  Tensor x = positions.forward(embedding.forward(ids, {batch, length}));
  // ---- 2. per layer: x = x + attention(norm(x))   (attention is causal, and-ed with mask)
  for (const Block& block : layers) {
    const nn::MultiHeadAttentionOutput attended =
        block.attention.forward(block.norm.forward(x), mask, head_weights ? nn::Weights::PerHead : nn::Weights::None);
    if (head_weights) head_weights->push_back(attended.weights);
    x = add(x, attended.output);
  }
  // ---- 3. logits = head(final_norm(x))
  return head.forward(final_norm.forward(x));
}

void AttentionModel::backward(const Tensor& grad_logits) {
  // ---- 3. logits = head(final_norm(x))
  const Tensor dx = final_norm.backward(head.backward(grad_logits));
  // ---- 2. x = x + attention(norm(x)): the residual passes dx through, the branch adds to it
  for (auto block = layers.rbegin(); block != layers.rend(); ++block)
    add_into(dx, block->norm.backward(block->attention.backward(dx)));
  // ---- 1. x = embedding(ids) + pe: pe is fixed, so dx flows to the embedding rows unchanged
  embedding.backward(dx);
}

void AttentionModel::zero_grad() {
  embedding.zero_grad();
  for (Block& block : layers) {
    block.norm.zero_grad();
    block.attention.zero_grad();
  }
  final_norm.zero_grad();
  head.zero_grad();
}

std::vector<nn::NamedTensor> AttentionModel::parameters() const {
  std::vector<nn::NamedTensor> params = embedding.parameters("embedding.");
  auto append = [&](std::vector<nn::NamedTensor> more, const std::string& prefix) {
    for (auto& p : more) params.push_back({prefix + p.name, p.tensor, p.grad});
  };
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string prefix = "layers." + std::to_string(l) + ".";
    append(layers[l].norm.parameters(), prefix + "norm.");
    append(layers[l].attention.parameters(), prefix + "attention.");
  }
  append(final_norm.parameters(), "final_norm.");
  append(head.parameters(), "head.");
  return params;
}

int64_t AttentionModel::parameter_count() const {
  int64_t count = 0;
  for (const auto& p : parameters()) count += p.tensor.numel();
  return count;
}

// ---------------------------------------------------------------------------------------------
// The .qkv file

namespace {

constexpr char kMagic[8] = {'Q', 'K', 'V', 'M', 'O', 'D', 'E', 'L'};
static_assert(std::endian::native == std::endian::little, "the .qkv writer assumes a little-endian host");

class Writer {
 public:
  explicit Writer(const std::string& path) : path_(path), out_(path, std::ios::binary | std::ios::trunc) {
    if (!out_) throw Error("AttentionModel::save: cannot open '" + path + "' for writing");
  }
  void bytes(const void* data, size_t n) { out_.write(static_cast<const char*>(data), static_cast<std::streamsize>(n)); }
  template <typename T>
  void value(T v) { bytes(&v, sizeof v); }
  void finish() {
    out_.flush();
    if (!out_) throw Error("AttentionModel::save: writing '" + path_ + "' failed");
  }

 private:
  std::string path_;
  std::ofstream out_;
};

class Reader {
 public:
  explicit Reader(const std::string& path) : path_(path), in_(path, std::ios::binary) {
    if (!in_) throw Error("AttentionModel::load: cannot open '" + path + "'");
    in_.seekg(0, std::ios::end);
    size_ = static_cast<int64_t>(in_.tellg());
    in_.seekg(0);
  }
  void bytes(void* data, int64_t n, const char* what) {
    if (n > size_ - offset_)
      throw Error("AttentionModel::load: '" + path_ + "' is truncated: " + what + " needs " + std::to_string(n) +
                  " bytes at offset " + std::to_string(offset_) + " but the file ends at " + std::to_string(size_));
    in_.read(static_cast<char*>(data), static_cast<std::streamsize>(n));
    if (!in_) throw Error("AttentionModel::load: reading '" + path_ + "' failed at offset " + std::to_string(offset_));
    offset_ += n;
  }
  template <typename T>
  T value(const char* what) {
    T v;
    bytes(&v, sizeof v, what);
    return v;
  }
  [[noreturn]] void fail(const std::string& message) const {
    throw Error("AttentionModel::load: '" + path_ + "': " + message);
  }
  int64_t offset() const { return offset_; }
  int64_t size() const { return size_; }

 private:
  std::string path_;
  std::ifstream in_;
  int64_t size_ = 0, offset_ = 0;
};

}  // namespace

void AttentionModel::save(const std::string& path) const {
  Writer out(path);
  out.bytes(kMagic, sizeof kMagic);
  out.value<uint32_t>(kModelFormatVersion);
  for (int64_t v : {config_.vocab_size, config_.max_len, config_.d_model, config_.num_heads, config_.num_layers})
    out.value<int64_t>(v);
  const auto params = parameters();
  out.value<uint32_t>(static_cast<uint32_t>(params.size()));
  for (const auto& p : params) {
    out.value<uint32_t>(static_cast<uint32_t>(p.name.size()));
    out.bytes(p.name.data(), p.name.size());
    out.value<uint32_t>(static_cast<uint32_t>(p.tensor.dim()));
    for (int64_t d : p.tensor.shape()) out.value<int64_t>(d);
    const Tensor values = p.tensor.contiguous();
    out.bytes(values.data(), static_cast<size_t>(values.numel()) * sizeof(float));
  }
  out.finish();
}

AttentionModel AttentionModel::load(const std::string& path) {
  Reader in(path);
  char magic[sizeof kMagic];
  if (in.size() < static_cast<int64_t>(sizeof kMagic)) in.fail("not a qkv model file (too short for the magic number)");
  in.bytes(magic, sizeof magic, "the magic number");
  if (std::memcmp(magic, kMagic, sizeof kMagic) != 0) in.fail("not a qkv model file (no QKVMODEL magic number)");
  const auto version = in.value<uint32_t>("the version");
  if (version != kModelFormatVersion)
    in.fail("format version " + std::to_string(version) + ", but this qkv reads version " +
            std::to_string(kModelFormatVersion));
  ModelConfig config;
  for (int64_t* field : {&config.vocab_size, &config.max_len, &config.d_model, &config.num_heads, &config.num_layers})
    *field = in.value<int64_t>("the config");
  try {
    checked(config);
  } catch (const Error& e) {
    in.fail(std::string("bad config: ") + e.what());
  }
  AttentionModel model(config, 0);
  const auto params = model.parameters();
  const auto count = in.value<uint32_t>("the tensor count");
  if (count != params.size())
    in.fail(std::to_string(count) + " tensors, but the config's model has " + std::to_string(params.size()));
  for (const auto& p : params) {
    const auto name_length = in.value<uint32_t>("a tensor name's length");
    if (name_length != p.name.size()) in.fail("expected tensor '" + p.name + "' at offset " + std::to_string(in.offset() - 4));
    std::string name(name_length, '\0');
    in.bytes(name.data(), name_length, "a tensor name");
    if (name != p.name) in.fail("expected tensor '" + p.name + "' but found '" + name + "'");
    const auto rank = in.value<uint32_t>("a tensor rank");
    if (rank != static_cast<uint32_t>(p.tensor.dim()))
      in.fail(name + " has rank " + std::to_string(rank) + " but should be " + p.tensor.shape().str());
    std::vector<int64_t> dims(rank);
    for (auto& d : dims) d = in.value<int64_t>("a tensor shape");
    bool same = true;
    for (uint32_t i = 0; i < rank; ++i) same = same && dims[i] == p.tensor.size(i);
    if (!same) {
      std::string got = "(";
      for (uint32_t i = 0; i < rank; ++i) got += (i ? ", " : "") + std::to_string(dims[i]);
      in.fail(name + " is " + got + ") in the file but " + p.tensor.shape().str() + " in the model its config describes");
    }
    in.bytes(p.tensor.data(), p.tensor.numel() * static_cast<int64_t>(sizeof(float)), name.c_str());
  }
  if (in.offset() != in.size())
    in.fail(std::to_string(in.size() - in.offset()) + " unexpected bytes after the last tensor");
  return model;
}

}  // namespace qkv::train
