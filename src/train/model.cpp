// qkv::train::AttentionModel: embedding + positions, [LayerNorm, causal attention, residual] x L,
// LayerNorm, head. Forward in numbered passes; backward walks them in reverse. Also the .qkv
// file format (documented in include/qkv/train.hpp).
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <new>

#include "core/crc32c.hpp"
#include "qkv/train.hpp"
#include "core/random.hpp"

namespace qkv::train {

namespace {

// Each module draws its weights from a seed of its own, derived from the model's.
uint64_t module_seed(uint64_t seed, uint64_t module) { return detail::mix64(seed * 64 + module); }

// Bytes of what a config implies beyond its parameters: the sinusoidal table (max_len x d_model
// floats, built for every model). Counted before anything is allocated, so that a small file
// cannot ask for a huge table.
int64_t derived_bytes(const ModelConfig& c) { return c.max_len * c.d_model * static_cast<int64_t>(sizeof(float)); }

ModelConfig checked(const ModelConfig& c) {
  // Bounds keep a corrupt file from asking for absurd allocations as well as catching mistakes.
  auto in_range = [](int64_t v, int64_t most) { return v >= 1 && v <= most; };
  if (!in_range(c.vocab_size, kMaxVocabSize) || !in_range(c.max_len, kMaxLen) || !in_range(c.d_model, kMaxDModel) ||
      !in_range(c.num_heads, c.d_model) || c.num_layers < 0 || c.num_layers > kMaxLayers ||
      c.d_model % c.num_heads != 0)
    throw Error("AttentionModel: config vocab_size " + std::to_string(c.vocab_size) + ", max_len " +
                std::to_string(c.max_len) + ", d_model " + std::to_string(c.d_model) + ", num_heads " +
                std::to_string(c.num_heads) + ", num_layers " + std::to_string(c.num_layers) +
                ": vocab_size must be in [1, " + std::to_string(kMaxVocabSize) + "], max_len in [1, " +
                std::to_string(kMaxLen) + "], d_model in [1, " + std::to_string(kMaxDModel) + "], layers in [0, " +
                std::to_string(kMaxLayers) + "], d_model divisible by num_heads");
  if (derived_bytes(c) > kMaxPositionTableBytes)
    throw Error("AttentionModel: config max_len " + std::to_string(c.max_len) + " x d_model " +
                std::to_string(c.d_model) + " needs a positional table of " + std::to_string(derived_bytes(c)) +
                " bytes, over the limit of " + std::to_string(kMaxPositionTableBytes));
  if (c.attention != nn::AttentionKind::Softmax && c.attention != nn::AttentionKind::Linear)
    throw Error("AttentionModel: unknown attention kind " + std::to_string(static_cast<int>(c.attention)));
  if (c.positions != Positions::Sinusoidal && c.positions != Positions::Rotary)
    throw Error("AttentionModel: unknown positions " + std::to_string(static_cast<int>(c.positions)));
  if (c.positions == Positions::Rotary && (c.d_model / c.num_heads) % 2 != 0)
    throw Error("AttentionModel: rotary positions need an even head dim, but d_model " + std::to_string(c.d_model) +
                " / num_heads " + std::to_string(c.num_heads) + " is odd");
  if (c.mask.size() > kMaxMaskText)
    throw Error("AttentionModel: the mask expression has " + std::to_string(c.mask.size()) + " bytes (at most " +
                std::to_string(kMaxMaskText) + ")");
  if (!c.mask.empty() && c.attention == nn::AttentionKind::Linear)
    throw Error("AttentionModel: mask '" + c.mask + "' with linear attention: linear attention takes no mask "
                "(it is causal only)");
  return c;
}

// The config's mask expression, parsed; a descriptive form parse() cannot read back is refused,
// so that what a model file says is what the model does.
Mask parsed_mask(const std::string& text) {
  if (text.empty()) return {};
  Mask mask;
  try {
    mask = Mask::parse(text);
  } catch (const Error& e) {
    throw Error(std::string("AttentionModel: mask: ") + e.what());
  }
  return mask;
}

// x (B, N, d_model) + pe[offset .. offset + N): the sinusoidal table at the tokens' positions.
Tensor add_positions(const Tensor& x, const Tensor& table, int64_t offset) {
  Tensor y = x.clone();
  const int64_t batch = x.size(0), len = x.size(1), d = x.size(2);
  float* out = y.data();
  const float* pe = table.data() + offset * d;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t e = 0; e < len * d; ++e) out[b * len * d + e] += pe[e];
  return y;
}

// A linear-attention layer's weights on x (B, N, d_model): w_ij = phi(q_i).phi(k_j) /
// (sum_j' phi(q_i).phi(k_j') + eps) over j <= i, (B, H, N, N). They are what linear attention
// multiplies the values by, so the library's own linear_attention computes them, with the
// identity as the values: out_i = sum_j w_ij e_j = row i of the weights.
Tensor linear_head_weights(const nn::MultiHeadAttention& layer, const Tensor& x) {
  const int64_t batch = x.size(0), len = x.size(1), heads = layer.num_heads(), kv_heads = layer.num_kv_heads(),
                hd = layer.head_dim();
  const Tensor q = layer.q_proj.apply(x).reshape({batch, len, heads, hd}).transpose(1, 2);
  const Tensor k = layer.k_proj.apply(x).reshape({batch, len, kv_heads, hd}).transpose(1, 2);
  if (layer.rotary()) {
    layer.rotary()->apply_inplace(q, {0});
    layer.rotary()->apply_inplace(k, {0});
  }
  Tensor identity = Tensor::zeros({batch, kv_heads, len, len});
  for (int64_t b = 0; b < batch * kv_heads; ++b)
    for (int64_t j = 0; j < len; ++j) identity.data()[(b * len + j) * len + j] = 1;
  LinearAttentionOptions options;
  options.feature_map = layer.options().feature_map;
  options.causal = layer.options().causal;
  return linear_attention(q, k, identity, options);
}

// A band j - i in [lo, hi] (lo <= 0 <= hi, as window and causal make) for queries at position
// offset + i: Mask::window's offset.
Mask shifted_band(int64_t lo, int64_t hi, int64_t offset) {
  if (lo > 0 || hi < 0)
    throw Error("AttentionModel: the cached forward cannot shift a band [" + std::to_string(lo) + ", " +
                std::to_string(hi) + "] that excludes the query itself");
  return Mask::window(-lo, hi, offset);
}

Mask shifted_rule(const Mask::Rule& rule, int64_t offset, int64_t batch, int64_t keys) {
  using Kind = Mask::Rule::Kind;
  switch (rule.kind) {
    case Kind::Band: return shifted_band(rule.lo, rule.hi, offset);
    case Kind::KeyLengths: return Mask::key_lengths(rule.lengths);
    case Kind::Strided: return Mask::strided(rule.stride, rule.offset + offset);
    case Kind::Global:
      // j < count or offset + i < count: the first keys for every query, every key for the
      // queries before count - offset.
      return Mask::key_lengths(std::vector<int64_t>(static_cast<size_t>(batch), std::min(rule.count, keys))) |
             Mask::global_tokens(std::max<int64_t>(0, rule.count - offset));
    case Kind::And: return shifted_rule(*rule.left, offset, batch, keys) & shifted_rule(*rule.right, offset, batch, keys);
    case Kind::Or: return shifted_rule(*rule.left, offset, batch, keys) | shifted_rule(*rule.right, offset, batch, keys);
    case Kind::Keep:
    case Kind::BlockSparse: break;
  }
  throw Error("AttentionModel: the cached forward cannot shift a tensor or block-sparse mask");
}

// The model's mask for `len` new queries at positions offset.. over the keys 0 .. offset + len:
// the same expression with every query-relative part moved by offset (Mask::parse's masks only:
// bands, key lengths, strided, global, and their & and |).
Mask shifted_mask(const Mask& mask, int64_t offset, int64_t batch, int64_t keys) {
  Mask out = mask.has_band() ? shifted_band(mask.band_lo(), mask.band_hi(), offset) : Mask();
  if (mask.has_key_lengths()) out &= Mask::key_lengths(mask.lengths());
  if (!mask.terms().empty()) throw Error("AttentionModel: the cached forward cannot shift a tensor mask");
  if (mask.rule()) out &= shifted_rule(*mask.rule(), offset, batch, keys);
  return out;
}

// One layer of the cached forward under the model's mask: what MultiHeadAttention::forward(x,
// cache) does for causal attention alone (project, rotate to the positions, append to the cache,
// attend over its slice in place, project out), with the mask moved to the new queries' positions.
Tensor masked_cached_attention(const nn::MultiHeadAttention& layer, const Tensor& x, nn::KVCache& cache,
                               const Mask& mask) {
  const int64_t batch = x.size(0), len = x.size(1), heads = layer.num_heads(), kv_heads = layer.num_kv_heads(),
                hd = layer.head_dim(), offset = cache.length();
  const Tensor q = layer.q_proj.apply(x).reshape({batch, len, heads, hd}).transpose(1, 2);
  const Tensor k = layer.k_proj.apply(x).reshape({batch, len, kv_heads, hd}).transpose(1, 2);
  const Tensor v = layer.v_proj.apply(x).reshape({batch, len, kv_heads, hd}).transpose(1, 2);
  if (layer.rotary()) {
    layer.rotary()->apply_inplace(q, {offset});
    layer.rotary()->apply_inplace(k, {offset});
  }
  cache.append(k, v);
  const int64_t keys = offset + len;
  AttentionOptions options;
  options.mask = Mask::causal(offset) & shifted_mask(mask, offset, batch, keys);
  const Tensor concatenated = Tensor::empty({batch, len, heads, hd});
  AttentionResult result;
  result.output = concatenated.transpose(1, 2);
  scaled_dot_product_attention_into(q, cache.keys(keys), cache.values(keys), result, options);
  return layer.out_proj.apply(concatenated.reshape({batch, len, layer.embed_dim()}));
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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
      config_(config),
      mask_(parsed_mask(config.mask)) {
  for (int64_t l = 0; l < config.num_layers; ++l) {
    nn::MultiHeadAttentionOptions options;
    options.causal = true;
    options.seed = module_seed(seed, 2 + static_cast<uint64_t>(l));
    options.attention = config.attention;
    if (config.positions == Positions::Rotary) options.rotary = nn::RotaryEmbeddingOptions{};
    layers.push_back({nn::LayerNorm(config.d_model), nn::MultiHeadAttention(config.d_model, config.num_heads, options)});
  }
}


Tensor AttentionModel::forward(const std::vector<int64_t>& ids, int64_t batch, int64_t length, const Mask& mask,
                               std::vector<Tensor>* head_weights, double* attention_seconds) const {
  if (batch < 1 || length < 1 || length > config_.max_len || static_cast<int64_t>(ids.size()) != batch * length)
    throw Error("AttentionModel: " + std::to_string(ids.size()) + " ids for batch " + std::to_string(batch) +
                " x length " + std::to_string(length) + " (max_len " + std::to_string(config_.max_len) + ")");
  if (head_weights) head_weights->clear();
  // ---- 1. x = embedding(ids) + pe   (rotary: the layers rotate q and k instead)
  Tensor x = embedding.forward(ids, {batch, length});
  if (config_.positions == Positions::Sinusoidal) x = positions.forward(x);
  // ---- 2. per layer: x = x + attention(norm(x))   (attention is causal, and-ed with the
  // model's mask and the call's)
  const Mask layer_mask = mask_.is_none() ? mask : mask_ & mask;
  for (const Block& block : layers) {
    const Tensor normed = block.norm.forward(x);
    const auto start = std::chrono::steady_clock::now();
    const bool linear = config_.attention == nn::AttentionKind::Linear;
    const nn::MultiHeadAttentionOutput attended = block.attention.forward(
        normed, layer_mask, head_weights && !linear ? nn::Weights::PerHead : nn::Weights::None);
    if (attention_seconds) *attention_seconds += seconds_since(start);
    if (head_weights) head_weights->push_back(linear ? linear_head_weights(block.attention, normed) : attended.weights);
    x = add(x, attended.output);
  }
  // ---- 3. logits = head(final_norm(x))
  return head.forward(final_norm.forward(x));
}

std::vector<nn::KVCache> AttentionModel::make_caches(int64_t batch, int64_t capacity, DType dtype) const {
  if (config_.attention != nn::AttentionKind::Softmax)
    throw Error("AttentionModel::make_caches: a KV cache serves softmax attention; this model uses " +
                to_string(config_.attention) + " attention (generate without the cache)");
  if (capacity < 1 || capacity > config_.max_len)
    throw Error("AttentionModel::make_caches: capacity " + std::to_string(capacity) + " must be in [1, max_len " +
                std::to_string(config_.max_len) + "]");
  std::vector<nn::KVCache> caches;
  for (const Block& block : layers) caches.push_back(block.attention.make_cache(batch, capacity, dtype));
  return caches;
}

Tensor AttentionModel::forward(const std::vector<int64_t>& ids, int64_t batch, int64_t length,
                               std::vector<nn::KVCache>& caches, double* attention_seconds) const {
  const std::string who = "AttentionModel::forward(ids, caches): ";
  if (caches.size() != layers.size())
    throw Error(who + std::to_string(caches.size()) + " caches for " + std::to_string(layers.size()) +
                " layers: use make_caches");
  const int64_t offset = caches.empty() ? 0 : caches.front().length();
  for (const nn::KVCache& cache : caches)
    for (int64_t l : cache.lengths())
      if (l != offset) throw Error(who + "the caches hold different lengths; every sequence must be at the same position");
  if (batch < 1 || length < 1 || offset + length > config_.max_len ||
      static_cast<int64_t>(ids.size()) != batch * length)
    throw Error(who + std::to_string(ids.size()) + " ids for batch " + std::to_string(batch) + " x length " +
                std::to_string(length) + " after " + std::to_string(offset) + " cached positions (max_len " +
                std::to_string(config_.max_len) + ")");
  // ---- 1. x = embedding(ids) + pe at the positions offset .. offset + length
  Tensor x = embedding.forward(ids, {batch, length});
  if (config_.positions == Positions::Sinusoidal) x = add_positions(x, positions.encoding(), offset);
  // ---- 2. per layer: x = x + attention(norm(x)), the layer's keys and values from its cache
  for (size_t l = 0; l < layers.size(); ++l) {
    const Tensor normed = layers[l].norm.forward(x);
    const auto start = std::chrono::steady_clock::now();
    const Tensor attended = mask_.is_none() ? layers[l].attention.forward(normed, caches[l]).output
                                            : masked_cached_attention(layers[l].attention, normed, caches[l], mask_);
    if (attention_seconds) *attention_seconds += seconds_since(start);
    x = add(x, attended);
  }
  // ---- 3. logits = head(final_norm(x))
  return head.forward(final_norm.forward(x));
}

AttentionModel AttentionModel::with_max_len(int64_t max_len) const {
  ModelConfig config = config_;
  config.max_len = max_len;
  AttentionModel longer(config, 0);
  const auto from = parameters(), to = longer.parameters();
  for (size_t i = 0; i < from.size(); ++i) {
    const Tensor values = from[i].tensor.contiguous();
    std::copy(values.data(), values.data() + values.numel(), to[i].tensor.data());
  }
  return longer;
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

// What a non-regular file is, for the errors of load and save.
std::string file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

[[noreturn]] void save_failure(const std::string& path, const std::string& what) {
  throw Error("AttentionModel::save: '" + path + "': " + what + "; the previous file, if any, is unchanged");
}

// The file a save to `path` replaces: `path` itself, or through symbolic links the file they
// point to (so the link stays a link and its target is updated). Refuses what is not a regular
// file or a new one: renaming over a device, a FIFO or a directory would replace it.
std::string save_target(const std::string& path) {
  std::filesystem::path target(path);
  if (target.filename().empty() || target.filename() == "." || target.filename() == "..")
    save_failure(path, "the path names a folder, not a file");
  for (int hops = 0;; ++hops) {
    struct stat st {};
    if (::lstat(target.c_str(), &st) != 0) {
      if (errno == ENOENT) return target.string();  // a new file
      save_failure(path, "cannot stat '" + target.string() + "' (" + std::strerror(errno) + ")");
    }
    if (S_ISREG(st.st_mode)) return target.string();
    if (!S_ISLNK(st.st_mode))
      save_failure(path, (target == path ? std::string("it") : "its link's target '" + target.string() + "'") +
                             " is " + file_kind(st.st_mode) + ": a model is saved only to a regular file or a new one");
    if (hops == 40) save_failure(path, "too many levels of symbolic links");
    std::error_code error;
    const std::filesystem::path link = std::filesystem::read_symlink(target, error);
    if (error) save_failure(path, "cannot read the link '" + target.string() + "' (" + error.message() + ")");
    target = link.is_absolute() ? link : target.parent_path() / link;
    if (target.filename().empty()) save_failure(path, "the link '" + link.string() + "' names a folder, not a file");
  }
}

// While it lives, SIGXFSZ is blocked in the calling thread, so a write past the file size limit
// (ulimit -f) fails with EFBIG, which the save reports, instead of killing the process; the
// signal such a write left pending is taken back before the thread's mask is restored.
class BlockFileSizeSignal {
 public:
  BlockFileSizeSignal() {
    sigemptyset(&only_);
    sigaddset(&only_, SIGXFSZ);
    pthread_sigmask(SIG_BLOCK, &only_, &previous_);
  }
  ~BlockFileSizeSignal() {
    if (!sigismember(&previous_, SIGXFSZ)) {
      const timespec now{0, 0};
      while (sigtimedwait(&only_, nullptr, &now) == SIGXFSZ) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }
  BlockFileSizeSignal(const BlockFileSizeSignal&) = delete;
  BlockFileSizeSignal& operator=(const BlockFileSizeSignal&) = delete;

 private:
  sigset_t only_{}, previous_{};
};

// Writes a file atomically: bytes go to a temporary file beside the target (same folder, so the
// rename cannot cross file systems), with a running CRC-32C; commit() appends the CRC, fsyncs,
// renames over the target and fsyncs the folder. Destroyed without commit(): the temporary is
// removed and the target untouched.
class AtomicWriter {
 public:
  explicit AtomicWriter(const std::string& path) : path_(path), target_(save_target(path)) {
    const std::filesystem::path target(target_);
    folder_ = target.parent_path().empty() ? std::filesystem::path(".") : target.parent_path();
    temp_ = (folder_ / (target.filename().string() + ".tmp-XXXXXX")).string();
    fd_ = ::mkstemp(temp_.data());
    if (fd_ < 0) fail("cannot create a temporary file in '" + folder_.string() + "'", errno);
    // mkstemp makes it 0600; give the new file the old one's mode, or rw-r--r--.
    struct stat old {};
    ::fchmod(fd_, ::stat(target_.c_str(), &old) == 0 ? (old.st_mode & 07777) : 0644);
    buffer_.reserve(kBuffer);
  }
  ~AtomicWriter() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temp_.c_str());
  }
  AtomicWriter(const AtomicWriter&) = delete;
  AtomicWriter& operator=(const AtomicWriter&) = delete;

  void bytes(const void* data, size_t n) {
    crc_ = detail::crc32c_update(crc_, data, n);
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const size_t take = std::min(n, kBuffer - buffer_.size());
      buffer_.insert(buffer_.end(), p, p + take);
      p += take;
      n -= take;
      if (buffer_.size() == kBuffer) flush();
    }
  }
  template <typename T>
  void value(T v) { bytes(&v, sizeof v); }

  // The test hook's crash: what is buffered reaches the temporary file, then the process dies.
  void die_here() {
    flush();
    ::raise(SIGKILL);
  }

  void commit() {
    const uint32_t crc = crc_;
    bytes(&crc, sizeof crc);
    flush();
    if (::fsync(fd_) != 0) fail("fsync of '" + temp_ + "' failed", errno);
    if (::close(fd_) != 0) {
      fd_ = -1;
      fail("closing '" + temp_ + "' failed", errno);
    }
    fd_ = -1;
    if (::rename(temp_.c_str(), target_.c_str()) != 0) fail("cannot rename '" + temp_ + "' over it", errno);
    committed_ = true;
    // The rename itself is durable once the folder's entry is on disk.
    const int folder = ::open(folder_.c_str(), O_RDONLY | O_DIRECTORY);
    if (folder >= 0) {
      ::fsync(folder);
      ::close(folder);
    }
  }

 private:
  static constexpr size_t kBuffer = size_t{1} << 16;

  void flush() {
    const char* p = buffer_.data();
    size_t left = buffer_.size();
    while (left > 0) {
      const ssize_t wrote = ::write(fd_, p, left);
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote <= 0) fail("writing '" + temp_ + "' failed", wrote < 0 ? errno : ENOSPC);
      p += wrote;
      left -= static_cast<size_t>(wrote);
    }
    buffer_.clear();
  }
  [[noreturn]] void fail(const std::string& what, int error = 0) const {
    throw Error("AttentionModel::save: '" + path_ + "': " + what +
                (error ? std::string(" (") + std::strerror(error) + ")" : std::string()) +
                "; the previous file, if any, is unchanged");
  }

  std::string path_, target_, temp_;
  std::filesystem::path folder_;
  BlockFileSizeSignal no_sigxfsz_;
  int fd_ = -1;
  bool committed_ = false;
  uint32_t crc_ = 0;
  std::vector<char> buffer_;
};

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

// The bytes of a model file. Opened without blocking (a FIFO would wait for a writer) and
// checked to be a regular file of at most kMaxModelFileBytes before anything is read or allocated.
std::vector<char> read_model_file(const std::string& path) {
  const std::string who = "AttentionModel::load: '" + path + "': ";
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw Error("AttentionModel::load: cannot open '" + path + "' (" + std::strerror(errno) + ")");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(who + "cannot stat it (" + std::strerror(errno) + ")");
  if (!S_ISREG(st.st_mode)) throw Error(who + "is " + file_kind(st.st_mode) + ", not a model file");
  if (st.st_size > kMaxModelFileBytes)
    throw Error(who + "is " + std::to_string(st.st_size) + " bytes, over the limit of " +
                std::to_string(kMaxModelFileBytes) + " for a model file");
  std::vector<char> data;
  try {
    data.resize(static_cast<size_t>(st.st_size));
  } catch (const std::bad_alloc&) {
    throw Error(who + "cannot hold its " + std::to_string(st.st_size) + " bytes in memory");
  }
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t got = ::read(fd, data.data() + done, data.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw Error(who + "reading failed (" + std::strerror(errno) + ")");
    if (got == 0) break;  // shrank while read: the checks below see a truncated file
    done += static_cast<size_t>(got);
  }
  data.resize(done);
  return data;
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
  out.value<uint32_t>(config_.positions == Positions::Rotary ? 1 : 0);
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
  ModelConfig config;
  for (int64_t* field : {&config.vocab_size, &config.max_len, &config.d_model, &config.num_heads, &config.num_layers})
    *field = in.value<int64_t>("the config");
  if (version >= 3) {
    const auto attention = in.value<uint32_t>("the attention kind");
    if (attention > 1) in.fail("unknown attention kind " + std::to_string(attention) + " (0 softmax, 1 linear)");
    config.attention = attention == 1 ? nn::AttentionKind::Linear : nn::AttentionKind::Softmax;
    const auto positions = in.value<uint32_t>("the positions");
    if (positions > 1) in.fail("unknown positions " + std::to_string(positions) + " (0 sinusoidal, 1 rotary)");
    config.positions = positions == 1 ? Positions::Rotary : Positions::Sinusoidal;
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
  const int64_t floats = parameter_floats(config);
  if (floats > (in.size() - in.offset()) / static_cast<int64_t>(sizeof(float)))
    in.fail("truncated: its config describes " + std::to_string(floats) + " parameters (" +
            std::to_string(floats * static_cast<int64_t>(sizeof(float))) + " bytes) but only " +
            std::to_string(in.size() - in.offset()) + " bytes follow the config");
  AttentionModel model(config, 0);
  const auto params = model.parameters();
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
  Checkpoint state;
  if (flags & kCheckpointFlag) {
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
  }
  if (in.offset() != in.size())
    in.fail(std::to_string(in.size() - in.offset()) + " unexpected bytes after the last tensor");
  if (checkpoint) *checkpoint = std::move(state);
  model.file_version_ = version;
  return model;
}

}  // namespace qkv::train
