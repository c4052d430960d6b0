// The JSON API of `qkv serve` as plain functions, JSON text in, status and JSON text out, so
// tests call it without a socket (tests/serve/test_serve_api.cpp) and serve.cpp only moves bytes.
//
//   POST /api/attention  {"text": "The cat sat", "heads": 8, "embed": 64, "seed": 42,
//                         "temperature": 1.0, "mask": "causal", "chars": false, "model": null}
//     untrained layer -> {"tokens": [...], "weights": [head][query][key], "entropy": [per head],
//                         "average": [query][key], "average_entropy": x, "uniform_entropy": ln N,
//                         "mask": "...", "heads": H, "embed": E, "seed": S, "temperature": T,
//                         "visible": ["100", "110", "111"]}  (query i sees key j where row i has '1')
//     "model": name   -> {"model": name, "task": ..., "tokens": [...], "note": "...",
//                         "layers": [{"weights": [head][query][key], "entropy": [...]}, ...],
//                         "visible": [...], ...}
// Weights are rounded to 4 significant digits (a row sums to 1 within 1e-3); entropies are
// computed before rounding.
//   GET /api/models     {"models": [{"name", "kind": "qkv", "layers", "heads", "d_model", "max_len", "task"},
//                                  {"name", "kind": "pretrained", "architecture", "layers", "heads",
//                                   "kv_heads", "head_dim", "hidden", "vocab_size", "max_positions",
//                                   "causal", "task"}, ...]}
//
// A Hugging Face folder (--model DIR, loaded at start-up, memory-mapped) is named by its folder
// name; its request gives "text" (or "ids", the token ids themselves) and "model", nothing else:
//     -> {"model", "kind": "pretrained", "architecture", "task", "tokens": [labels], "ids": [...],
//         "layers": [{"weights": [head][query][key], "entropy": [...],
//                     "roles": [{"role": "previous-token" | ... | "-", "scores": {...}}]}],
//         "first_layer": L, "first_layer_why": "...", "visible": [...], "mask": "causal" | "none",
//         "prediction": {"kind": "next", "top": [{"id", "token", "p"}] (5)}        causal LM
//                     | {"kind": "fill", "masks": [{"position", "top": [...]}]}     BERT MLM
//                     | null                                                       BertModel
//     with "neuron": {"layer": L, "head": h, "query": i} instead: one row of one head as the
//     attention computes it (models::Model::query_keys) -> {"model", "tokens", "neuron":
//         {"layer", "head", "kv_head", "query", "head_dim", "scale", "q": [d], "k": [key][d],
//          "visible": [key] (bool), "scores": [key] (scale q.k; null when masked), "max",
//          "exp": [key] (exp(score - max); 0 when masked), "sum", "weights": [key]}}
//   The text has at most max_tokens tokens and the model's positions.
//
// Every field but text is optional. Any bad input answers 400 with {"error": "..."} naming the
// field and the value. Weights come from qkv::scaled_dot_product_attention (text_attention.cpp)
// or, for a model, from its own forward pass; entropies from qkv::analysis.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "qkv/models/pretrained.hpp"
#include "qkv/train.hpp"
#include "serve_folder_cache.hpp"
#include "text_attention.hpp"

namespace qkv::cli {

// What one request may ask for; beyond these the answer is a 400 naming the limit.
struct ServeLimits {
  size_t max_body_bytes = 16 * 1024;  // the request body
  size_t max_text_bytes = 2000;       // the "text" field
  int64_t max_tokens = 64;            // tokens of the text (a heatmap's rows)
  int64_t max_heads = 16;
  int64_t max_embed = 512;
  double max_temperature = 100;
  size_t max_mask_chars = 200;        // the "mask" field, a qkv::Mask::parse expression
};

struct ApiResponse {
  int status = 200;
  std::string body;  // JSON
};

// One model named at start-up: its file, weights and task. forward() keeps state for backward,
// so one request at a time uses it (mutex).
struct LoadedModel {
  std::string name;  // the file name without directories, what requests name
  std::string path;
  train::AttentionModel model;
  ModelTask task;
  std::unique_ptr<std::mutex> busy = std::make_unique<std::mutex>();
};

// One Hugging Face model folder named at start-up. Model::forward keeps no state: requests share it,
// and its cache (the roles' repeated sequence, the neuron view's q and k; thread-safe).
struct LoadedPretrained {
  std::string name;  // the folder's name, what requests name
  std::string path;
  std::unique_ptr<models::Pretrained> model;
  std::unique_ptr<FolderCache> cache = std::make_unique<FolderCache>();
};

class ExplorerApi {
 public:
  // Loads every model file and folder (models::is_model_folder tells them apart); qkv::Error
  // naming the file on a bad one or a repeated name.
  ExplorerApi(const std::vector<std::string>& model_paths, ServeLimits limits);

  // POST /api/attention with this body. Never throws: bad input is a 400, a failure of ours a 500.
  ApiResponse attention(const std::string& request_body) const;
  // GET /api/models.
  ApiResponse models() const;

  const ServeLimits& limits() const { return limits_; }
  const std::vector<LoadedModel>& loaded_models() const { return models_; }
  const std::vector<LoadedPretrained>& loaded_pretrained() const { return pretrained_; }
  size_t model_count() const { return models_.size() + pretrained_.size(); }

 private:
  ServeLimits limits_;
  std::vector<LoadedModel> models_;
  std::vector<LoadedPretrained> pretrained_;
};

// {"error": message} as JSON text.
std::string error_json(const std::string& message);

// Text from a request as a message quotes it: control characters as \u0000 ... \u001f and
// \u007f, so a NUL byte neither ends the message (C strings stop there) nor hides the rest.
std::string escaped_text(const std::string& text);

}  // namespace qkv::cli
