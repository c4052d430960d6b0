// qkv::train::generate: greedy generation with a trained AttentionModel, with its per-layer KV
// caches (one prefill of the prompt, then one token per step) or recomputing the whole prefix at
// every step, timing each step and the time spent in its attention layers.
#include <algorithm>
#include <chrono>
#include <string>

#include "qkv/train.hpp"

namespace qkv::train {

namespace {

// The argmax of the logits of the last position of a (1, n, vocab) tensor.
int64_t last_argmax(const Tensor& logits) {
  const int64_t n = logits.size(1), vocab = logits.size(2);
  const float* row = logits.data() + (n - 1) * vocab;
  return std::max_element(row, row + vocab) - row;
}

}  // namespace

Generation generate(const AttentionModel& model, const std::vector<int64_t>& prompt, const GenerateOptions& options) {
  const ModelConfig& c = model.config();
  const auto prompt_length = static_cast<int64_t>(prompt.size());
  if (prompt.empty()) throw Error("generate: the prompt is empty: give at least one token");
  if (options.tokens < 0 || prompt_length + options.tokens > c.max_len + 1)
    throw Error("generate: a prompt of " + std::to_string(prompt_length) + " tokens and " +
                std::to_string(options.tokens) + " new ones need " +
                std::to_string(prompt_length + std::max<int64_t>(options.tokens, 1) - 1) +
                " positions, but the model reads at most max_len " + std::to_string(c.max_len));
  for (int64_t id : prompt)
    if (id < 0 || id >= c.vocab_size)
      throw Error("generate: token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                  std::to_string(c.vocab_size) + ")");
  Generation out;
  if (options.tokens == 0) return out;
  std::vector<int64_t> sequence = prompt;
  std::vector<nn::KVCache> caches;
  // The last new token is never read: the prefix read at most is prompt + tokens - 1.
  if (options.use_cache) caches = model.make_caches(1, prompt_length + options.tokens - 1, options.kv_dtype);
  for (int64_t t = 0; t < options.tokens; ++t) {
    GenerationStep step;
    const auto start = std::chrono::steady_clock::now();
    Tensor logits;
    if (options.use_cache) {
      // The first step prefills the prompt; each later one reads the token just generated.
      const std::vector<int64_t> fresh = t == 0 ? prompt : std::vector<int64_t>{sequence.back()};
      step.read = static_cast<int64_t>(fresh.size());
      logits = model.forward(fresh, 1, step.read, caches, &step.attention_seconds);
    } else {
      step.read = static_cast<int64_t>(sequence.size());
      logits = model.forward(sequence, 1, step.read, {}, nullptr, &step.attention_seconds);
    }
    const int64_t next = last_argmax(logits);
    step.total_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    step.position = static_cast<int64_t>(sequence.size()) - 1;
    sequence.push_back(next);
    out.ids.push_back(next);
    out.steps.push_back(step);
  }
  return out;
}

}  // namespace qkv::train
