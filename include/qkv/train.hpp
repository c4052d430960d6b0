// qkv::train: a small causal attention model (src/train/: model.cpp, cached_forward.cpp,
// model_file.cpp), its file format, synthetic
// tasks that only attention can solve (src/train/tasks.cpp), and the loop that trains one on them
// (src/train/training_loop.cpp): what `qkv train` runs.
//
// The model: token embedding + positions (a sinusoidal table added to the embedding, or rotary
// embeddings applied to q and k in every layer), num_layers x [LayerNorm, causal
// MultiHeadAttention (softmax or linear; softmax optionally and-ed with a sparse mask
// expression), residual], LayerNorm, linear head to the vocabulary. No MLP: every bit of mixing
// between positions is attention, so what it learns is what attention learns.
//
// The .qkv file, format version 3 (all integers and floats little-endian):
//   offset 0   8 bytes   magic "QKVMODEL"
//          8   u32       format version (kModelFormatVersion = 3)
//         12   u32       flags: bit 0 set = a checkpoint (training state after the tensors)
//         16   5 x i64   config: vocab_size, max_len, d_model, num_heads, num_layers
//         56   u32       attention: 0 softmax, 1 linear (elu+1 features, causal)
//         60   u32       positions: 0 sinusoidal, 1 rotary (half-split, base 10000)
//         64   u32       mask length M (<= kMaxMaskText), then M bytes: a Mask::parse expression
//                        every layer ands with causal ("" none), e.g. "window(3) | strided(4)"
//     68 + M   u32       tensor count, then per tensor, in parameters() order:
//                          u32 name length, name (UTF-8, no terminator),
//                          u32 rank, rank x i64 dims, numel x f32 values (row-major)
//   if a checkpoint:     i64 training step done, i64 AdamW step count, then per tensor in the
//                        same order numel x f32 first moments, then per tensor the second moments
//   last 4 bytes         u32 CRC-32C (Castagnoli) of every byte before it
// Version 2 is version 3 without the bytes at 56 .. 68 + M (softmax, sinusoidal, no mask).
// load() checks the magic, the version, the checksum, the config, every name and shape against
// the model the config describes, and that the file ends where it should; anything else is a
// qkv::Error that names the file and what was wrong (not a qkv model, corrupt or truncated,
// shape differs, unknown attention kind, a mask that does not parse, a config outside the bounds
// below, a non-finite weight or moment, named, ...). Version 2 files load as softmax / sinusoidal
// / no mask; version 1 files (no flags, no checksum) too, unchecked: file_warning() says so.
// load() opens without blocking and reads only a regular file (a directory, FIFO or device is an
// error naming it) of at most kMaxModelFileBytes.
//
// save() never loses the previous file: it writes a temporary file in the target's folder
// ("<name>.tmp-XXXXXX"), fsyncs it, renames it over the target and fsyncs the folder. A crash,
// a full disk, the file size limit (SIGXFSZ is blocked in the saving thread, so that is EFBIG, an
// error) or a signal before the rename leaves the old file as it was (and at worst the temporary
// file behind); after it, the new file is complete. The target is a regular file or a new one (a
// device, FIFO or directory is refused); a symbolic link stays a link and the file it points to
// is replaced, the same way. A model with a non-finite weight is refused before anything is written.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "qkv/mask.hpp"
#include "qkv/nn.hpp"
#include "qkv/tensor.hpp"

namespace qkv::train {

inline constexpr uint32_t kModelFormatVersion = 3;
inline constexpr size_t kMaxMaskText = 4096;  // bytes of a model's mask expression
// A config's bounds (checked by the constructor and by load() before anything is allocated):
// vocab_size in [1, kMaxVocabSize], max_len in [1, kMaxLen], d_model in [1, kMaxDModel],
// num_layers in [0, kMaxLayers], and the sinusoidal table every model builds (max_len x d_model
// floats, which the file does not carry) at most kMaxPositionTableBytes.
inline constexpr int64_t kMaxVocabSize = int64_t{1} << 20;
inline constexpr int64_t kMaxLen = int64_t{1} << 16;
inline constexpr int64_t kMaxDModel = int64_t{1} << 14;
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxPositionTableBytes = int64_t{256} << 20;
// load() refuses a file larger than this before reading it (it reads the whole file into memory).
inline constexpr int64_t kMaxModelFileBytes = int64_t{2} << 30;

// Where a model's tokens learn their positions.
enum class Positions {
  Sinusoidal,  // the fixed sin/cos table (max_len rows) added to the embedding
  Rotary,      // RoPE on q and k in every layer (nn::RotaryEmbedding, half-split, base 10000)
  T5,          // a learned T5 relative-position bias per head in every layer (causal buckets: 32, up to
               // distance 128; nn::RelativePositionBias), trained through the backward's dbias
};
Positions parse_positions(const std::string& name);  // "sinusoidal", "rotary", "t5"; else qkv::Error
std::string to_string(Positions positions);
nn::AttentionKind parse_attention_kind(const std::string& name);  // "softmax", "linear"
std::string to_string(nn::AttentionKind kind);

// The training state a checkpoint adds to the model: the last step done and AdamW's state.
struct Checkpoint {
  int64_t step = 0;
  nn::AdamWState optimizer;
};

struct ModelConfig {
  int64_t vocab_size = 17;  // token ids 0 .. vocab_size - 1
  int64_t max_len = 64;     // longest sequence the positional table covers
  int64_t d_model = 64;
  int64_t num_heads = 4;
  int64_t num_layers = 2;
  // Softmax, or Linear (linear_attention, elu+1, causal): such a model has no head weights to draw.
  nn::AttentionKind attention = nn::AttentionKind::Softmax;
  Positions positions = Positions::Sinusoidal;
  // A Mask::parse expression every layer ands with causal (softmax only), e.g. a sparse pattern
  // "window(3) | strided(4)"; empty: causal alone. Query i and key j are absolute positions.
  std::string mask;
};

class AttentionModel {
 public:
  // Weights drawn from `seed` alone: the same config and seed give the same model.
  AttentionModel(const ModelConfig& config, uint64_t seed);

  // ids: batch x length token ids, row-major. Returns logits (batch, length, vocab_size).
  // Every attention layer is causal; `mask` is and-ed into each (e.g. a diagonal keep mask).
  // head_weights: when given, receives each layer's per-head weights (batch, heads, length, length);
  // for linear attention phi(q_i).phi(k_j) / (sum_{j' <= i} phi(q_i).phi(k_j') + eps), j <= i.
  // attention_seconds: when given, the time spent in the attention layers (their forward calls,
  // projections included) is added to it.
  Tensor forward(const std::vector<int64_t>& ids, int64_t batch, int64_t length, const Mask& mask = {},
                 std::vector<Tensor>* head_weights = nullptr, double* attention_seconds = nullptr) const;
  // ---- Inference with a KV cache (nn::KVCache per layer; include/qkv/inference.hpp).
  // One cache per layer for `batch` sequences of up to `capacity` (<= max_len) positions, K/V in
  // `dtype`. Softmax models only (a linear model's state is not cached): else qkv::Error.
  std::vector<nn::KVCache> make_caches(int64_t batch, int64_t capacity, DType dtype = DType::F32) const;
  // ids: batch x length new tokens, at the positions after the caches' (every batch element at
  // the same position). Appends their keys and values and returns their logits (batch, length,
  // vocab_size): what forward() over the whole sequence returns for those tokens (a model's mask
  // expression moved to the new tokens' positions). attention_seconds as above.
  Tensor forward(const std::vector<int64_t>& ids, int64_t batch, int64_t length, std::vector<nn::KVCache>& caches,
                 double* attention_seconds = nullptr) const;

  // The same weights with a positional range of max_len (a longer sinusoidal table; rotary
  // needs none): for running past the trained length, e.g. to time generation at long positions.
  AttentionModel with_max_len(int64_t max_len) const;
  // The config's mask expression, parsed (none when empty).
  const Mask& mask() const { return mask_; }

  // grad_logits shaped as the last forward's logits; adds every parameter's gradient.
  void backward(const Tensor& grad_logits);
  void zero_grad();

  // "embedding.weight", "layers.0.norm.weight", "layers.0.attention.q_proj.weight", ...,
  // "final_norm.weight", "final_norm.bias", "head.weight", "head.bias".
  std::vector<nn::NamedTensor> parameters() const;
  int64_t parameter_count() const;
  const ModelConfig& config() const { return config_; }
  // The format version of the file load() read this model from (0: not loaded from a file).
  uint32_t file_version() const { return file_version_; }
  // What a front end should tell its user about that file, or "" (a version 1 file carries no
  // checksum, so damage to it cannot be detected; saving it again writes the current version).
  std::string file_warning() const;

  // The .qkv format above; with `checkpoint`, the training state too. Atomic: see above.
  void save(const std::string& path, const Checkpoint* checkpoint = nullptr) const;
  // Throws qkv::Error on a bad file. With `checkpoint`, receives the file's training state
  // (step 0 and no moments for a plain model file).
  static AttentionModel load(const std::string& path, Checkpoint* checkpoint = nullptr);
  // The same from bytes in memory (`name` only labels the errors): what load() runs on the file.
  static AttentionModel load_bytes(const void* data, size_t size, const std::string& name,
                                   Checkpoint* checkpoint = nullptr);

  struct Block {
    nn::LayerNorm norm;
    nn::MultiHeadAttention attention;
  };

  nn::Embedding embedding;
  nn::SinusoidalPositionalEncoding positions;
  std::vector<Block> layers;
  nn::LayerNorm final_norm;
  nn::Linear head;

 private:
  ModelConfig config_;
  Mask mask_;
  uint32_t file_version_ = 0;
};

// ---- Greedy generation: each new token is the argmax of the logits at the last position.
struct GenerateOptions {
  int64_t tokens = 16;      // new tokens to generate
  bool use_cache = true;    // false: recompute the whole prefix at every step
  DType kv_dtype = DType::F32;  // the cache's K/V (BF16 / F16 halve its bytes)
};
// One forward of the generation loop: it read `read` tokens (the prompt at the cached prefill,
// else 1 with the cache, or the whole prefix without) and predicted the token after `position`.
struct GenerationStep {
  int64_t position = 0;  // index of the last token read
  int64_t read = 0;
  double attention_seconds = 0;  // in the attention layers
  double total_seconds = 0;      // the whole step (embedding, layers, head, argmax)
};
struct Generation {
  std::vector<int64_t> ids;           // the new tokens (options.tokens of them)
  std::vector<GenerationStep> steps;  // one per new token
};
// prompt: at least one token id; prompt + tokens must fit in the model's max_len. Runs on one
// sequence; qkv::Error on bad ids or lengths (and use_cache with a model that has no cached forward).
Generation generate(const AttentionModel& model, const std::vector<int64_t>& prompt, const GenerateOptions& options);

// ---- synthetic tasks. Symbols are ids 0 .. symbols - 1; id `symbols` is the separator '|'.
//   copy:    a b c d | a b c d      (predict the part after '|')
//   reverse: a b c d | d c b a
//   recall:  k1 v1 k2 v2 ... kP vP  q -> the value paired with key q (keys distinct, values free)
enum class Task { Copy, Recall, Reverse };
Task parse_task(const std::string& name);  // "copy", "recall", "reverse"; else qkv::Error
std::string to_string(Task task);

struct TaskOptions {
  Task task = Task::Recall;
  int64_t symbols = 16;  // vocabulary of the task, separator not counted
  int64_t pairs = 8;     // recall: key-value pairs per sequence (<= symbols)
  int64_t length = 8;    // copy, reverse: symbols per sequence
};
int64_t vocab_size(const TaskOptions& task);       // symbols + 1
int64_t sequence_length(const TaskOptions& task);  // what the model reads: recall 2P + 1, copy/reverse 2L

// One batch, row-major (batch, length): the model reads ids and at each position predicts
// targets (the next token), or nothing where targets is -100 (nn::CrossEntropyLoss's ignore_index).
struct Batch {
  int64_t batch = 0, length = 0;
  std::vector<int64_t> ids;
  std::vector<int64_t> targets;
};
// Deterministic in (options, batch, seed).
Batch make_batch(const TaskOptions& task, int64_t batch, uint64_t seed);
// A sequence as text, the separator as '|', symbols as letters: "a f c h | a f c h".
std::string token_text(const TaskOptions& task, int64_t id);

struct TrainOptions {
  TaskOptions task;
  int64_t steps = 2000;
  int64_t batch = 64;
  uint64_t seed = 0;          // model weights and every batch
  nn::AdamWOptions adamw{.lr = 3e-3f};
  int64_t warmup_steps = 100;  // linear warm-up of the learning rate, then cosine decay to lr / 10
  Mask mask;                   // and-ed into every attention (the learning test's diagonal control)

  // Checkpoints: every checkpoint_every steps (0: never) and when stop_requested() turns true
  // (checked after each step; e.g. set from a SIGINT handler), save model + AdamW state + step to
  // checkpoint_path (atomically, AttentionModel::save). resume: continue from that state (steps
  // resume->step + 1 .. steps); with the same options the result equals an uninterrupted run.
  int64_t checkpoint_every = 0;
  std::string checkpoint_path;
  const Checkpoint* resume = nullptr;
  std::function<bool()> stop_requested;
};

struct TrainResult {
  int64_t step = 0;          // the last step done
  bool interrupted = false;  // stop_requested() ended the run early (a checkpoint was saved)
};

struct TrainStep {
  int64_t step = 0;      // 1-based
  float loss = 0;        // this step's batch loss
  float lr = 0;
  double seconds = 0;    // since training started
  int64_t tokens = 0;    // tokens read so far
};

// Trains `model` in place; calls `progress` after every step (may be empty). A step that leaves a
// non-finite loss or weight throws qkv::Error "training diverged at step N" before any progress
// call or checkpoint of that step, so no file is written from such weights.
TrainResult train(AttentionModel& model, const TrainOptions& options,
           const std::function<void(const TrainStep&)>& progress = {});

// Held-out accuracy: the fraction of predicted positions (argmax == target) over `sequences`
// fresh sequences drawn from a seed stream that training never uses.
struct Evaluation {
  double accuracy = 0;           // per predicted token
  double sequence_accuracy = 0;  // every predicted token of the sequence right
  float loss = 0;
};
Evaluation evaluate(const AttentionModel& model, const TaskOptions& task, int64_t sequences, uint64_t seed,
                    const Mask& mask = {});

// The seed of the held-out stream for a training seed (disjoint from the training batches').
uint64_t held_out_seed(uint64_t seed);

}  // namespace qkv::train
