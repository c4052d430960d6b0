// qkv::models::Model (include/qkv/models/model.hpp): checks the inputs, builds a pass over them,
// and runs the architecture's Network (network.hpp) over per-layer KV caches: fresh float32 ones
// for a full forward, options.kv_dtype ones kept across generate()'s steps.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "models/network.hpp"
#include "qkv/error.hpp"
#include "qkv/models/model.hpp"

namespace qkv::models {

namespace detail {
std::string model_name(const ModelConfig& c) {
  return std::string(to_string(c.architecture)) + " (" + std::to_string(c.num_layers) + " layers, hidden " +
         std::to_string(c.hidden_size) + ")";
}
}  // namespace detail

struct Model::Impl {
  ModelConfig config;
  ModelOptions options;
  std::shared_ptr<const WeightSource> weights;
  std::unique_ptr<detail::Network> network;

  // `count` tokens starting at `position` fit the model's positions; ids are in the vocabulary.
  void check_tokens(const std::string& who, const std::vector<int64_t>& ids, int64_t position) const {
    if (ids.empty()) throw Error(who + ": a sequence is empty: give at least one token");
    const auto end = position + static_cast<int64_t>(ids.size());
    if (end > config.max_positions)
      throw Error(who + ": " + std::to_string(end) + " positions exceed the model's max_position_embeddings " +
                  std::to_string(config.max_positions));
    for (int64_t id : ids)
      if (id < 0 || id >= config.vocab_size)
        throw Error(who + ": token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                    std::to_string(config.vocab_size) + ")");
  }

  std::vector<nn::KVCache> make_caches(int64_t batch, int64_t capacity, DType dtype) const {
    std::vector<nn::KVCache> caches;
    for (int64_t l = 0; l < config.num_layers; ++l)
      caches.emplace_back(batch, config.num_kv_heads, capacity, config.head_dim, dtype);
    return caches;
  }

  // The logits (vocab) of the last of `tokens`, which follow `position` cached ones (batch 1).
  std::vector<float> step(const std::vector<int64_t>& tokens, int64_t position,
                          std::vector<nn::KVCache>& caches) const {
    detail::Pass pass;
    pass.batch = 1;
    pass.length = static_cast<int64_t>(tokens.size());
    pass.counts = {pass.length};
    pass.ids = tokens;
    pass.position = position;
    pass.caches = &caches;
    const Tensor hidden = network->hidden_states(pass);
    const Tensor last = hidden.narrow(1, pass.length - 1, 1).reshape({1, config.hidden_size}).contiguous();
    return network->logits(last).to_vector();
  }
};

Model::Model(const ModelConfig& config, std::shared_ptr<const WeightSource> weights, const ModelOptions& options)
    : impl_(std::make_unique<Impl>()) {
  check_config(config);
  if (!weights) throw Error("Model: no weight source given");
  if (options.kv_dtype != DType::F32 && options.kv_dtype != DType::BF16 && options.kv_dtype != DType::F16)
    throw Error("Model: kv_dtype must be f32, bf16 or f16");
  impl_->config = config;
  impl_->options = options;
  impl_->weights = std::move(weights);
  const WeightSource& source = *impl_->weights;
  switch (config.architecture) {
    case Architecture::GPT2: impl_->network = detail::make_gpt2(config, source); break;
    case Architecture::Bert:
    case Architecture::BertMaskedLM: impl_->network = detail::make_bert(config, source); break;
    case Architecture::Llama:
    case Architecture::Mistral:
    case Architecture::Qwen2: impl_->network = detail::make_llama(config, source); break;
  }
}

Model::~Model() = default;
Model::Model(Model&&) noexcept = default;
Model& Model::operator=(Model&&) noexcept = default;

const ModelConfig& Model::config() const { return impl_->config; }

ModelOutput Model::forward(const std::vector<int64_t>& ids, bool need_attention) const {
  return forward(ModelInput{.ids = {ids}, .token_type_ids = {}}, need_attention);
}

ModelOutput Model::forward(const ModelInput& input, bool need_attention) const {
  const ModelConfig& c = impl_->config;
  const std::string who = "Model::forward";
  if (input.ids.empty()) throw Error(who + ": the batch is empty");
  const bool types = !input.token_type_ids.empty();
  if (types && c.type_vocab_size == 0)
    throw Error(who + ": token_type_ids given, but " + std::string(to_string(c.architecture)) + " has no token types");
  if (types && input.token_type_ids.size() != input.ids.size())
    throw Error(who + ": " + std::to_string(input.token_type_ids.size()) + " token_type_ids sequences for " +
                std::to_string(input.ids.size()) + " sequences of ids");
  detail::Pass pass;
  pass.batch = static_cast<int64_t>(input.ids.size());
  for (const auto& sequence : input.ids) {
    impl_->check_tokens(who, sequence, 0);
    pass.counts.push_back(static_cast<int64_t>(sequence.size()));
    pass.length = std::max(pass.length, pass.counts.back());
  }
  // The widest activation (logits, or the MLP's inner rows) of the whole batch must stay allocatable.
  const int64_t widest = std::max({c.has_lm_head() ? c.vocab_size : 0, c.intermediate_size, 3 * c.hidden_size});
  constexpr int64_t kMaxActivationFloats = int64_t{1} << 31;
  if (pass.batch * pass.length > kMaxActivationFloats / widest)
    throw Error(who + ": " + std::to_string(pass.batch) + " sequences of up to " + std::to_string(pass.length) +
                " tokens need " + std::to_string(pass.batch * pass.length) + " x " + std::to_string(widest) +
                " floats of activations, more than 2^31: split the batch");
  // need_attention keeps (B, H, N, N) weights for every layer.
  if (need_attention && pass.batch * c.num_heads * c.num_layers > kMaxActivationFloats / (pass.length * pass.length))
    throw Error(who + ": need_attention on " + std::to_string(pass.batch) + " sequences of up to " +
                std::to_string(pass.length) + " tokens keeps " + std::to_string(c.num_layers) + " layers x " +
                std::to_string(c.num_heads) + " heads of (N, N) weights, more than 2^31 floats: ask for fewer tokens");
  pass.ids.assign(static_cast<size_t>(pass.batch * pass.length), 0);
  if (types) pass.token_types.assign(pass.ids.size(), 0);
  for (size_t b = 0; b < input.ids.size(); ++b) {
    std::copy(input.ids[b].begin(), input.ids[b].end(), pass.ids.begin() + static_cast<int64_t>(b) * pass.length);
    if (!types) continue;
    const auto& t = input.token_type_ids[b];
    if (t.size() != input.ids[b].size())
      throw Error(who + ": sequence " + std::to_string(b) + " has " + std::to_string(input.ids[b].size()) +
                  " ids but " + std::to_string(t.size()) + " token_type_ids");
    for (int64_t type : t)
      if (type < 0 || type >= c.type_vocab_size)
        throw Error(who + ": token type " + std::to_string(type) + " is outside [0, " +
                    std::to_string(c.type_vocab_size) + ")");
    std::copy(t.begin(), t.end(), pass.token_types.begin() + static_cast<int64_t>(b) * pass.length);
  }
  std::vector<nn::KVCache> caches = impl_->make_caches(pass.batch, pass.length, DType::F32);
  pass.caches = &caches;
  ModelOutput out;
  if (need_attention) pass.attention = &out.attention;
  out.hidden = impl_->network->hidden_states(pass);
  if (c.has_lm_head())
    out.logits = impl_->network->logits(out.hidden.reshape({pass.batch * pass.length, c.hidden_size}))
                     .reshape({pass.batch, pass.length, c.vocab_size});
  return out;
}

QueryKeys Model::query_keys(const std::vector<int64_t>& ids, int64_t layer) const {
  const ModelConfig& c = impl_->config;
  const std::string who = "Model::query_keys";
  impl_->check_tokens(who, ids, 0);
  if (layer < 0 || layer >= c.num_layers)
    throw Error(who + ": layer " + std::to_string(layer) + " is outside [0, " + std::to_string(c.num_layers) + ")");
  detail::Pass pass;
  pass.batch = 1;
  pass.length = static_cast<int64_t>(ids.size());
  pass.counts = {pass.length};
  pass.ids = ids;
  std::vector<nn::KVCache> caches = impl_->make_caches(1, pass.length, DType::F32);
  pass.caches = &caches;
  QueryKeys out;
  out.layer = layer;
  out.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  pass.stop_layer = layer;
  pass.queries = &out.queries;
  pass.keys = &out.keys;
  (void)impl_->network->hidden_states(pass);
  out.queries = out.queries.reshape({c.num_heads, pass.length, c.head_dim});
  out.keys = out.keys.reshape({c.num_kv_heads, pass.length, c.head_dim});
  return out;
}

std::vector<std::vector<float>> Model::cached_logits(const std::vector<int64_t>& ids, int64_t prefill) const {
  const std::string who = "Model::cached_logits";
  if (!impl_->config.is_causal())
    throw Error(who + ": " + std::string(to_string(impl_->config.architecture)) + " is not a causal language model");
  impl_->check_tokens(who, ids, 0);
  if (prefill < 1 || prefill > static_cast<int64_t>(ids.size()))
    throw Error(who + ": prefill " + std::to_string(prefill) + " is outside [1, " + std::to_string(ids.size()) + "]");
  std::vector<nn::KVCache> caches = impl_->make_caches(1, static_cast<int64_t>(ids.size()), impl_->options.kv_dtype);
  std::vector<std::vector<float>> out;
  out.push_back(impl_->step({ids.begin(), ids.begin() + prefill}, 0, caches));
  for (auto position = prefill; position < static_cast<int64_t>(ids.size()); ++position)
    out.push_back(impl_->step({ids[static_cast<size_t>(position)]}, position, caches));
  return out;
}

GenerationResult Model::generate(const std::vector<int64_t>& prompt, const GenerationOptions& options,
                                 const TokenCallback& on_token) const {
  const ModelConfig& c = impl_->config;
  const std::string who = "Model::generate";
  if (!c.is_causal())
    throw Error(who + ": " + std::string(to_string(c.architecture)) + " is not a causal language model");
  impl_->check_tokens(who, prompt, 0);
  check_generation_options(options);
  const auto prompt_length = static_cast<int64_t>(prompt.size());
  if (options.max_new_tokens < 0 || options.max_new_tokens > c.max_positions - prompt_length + 1)
    throw Error(who + ": max_new_tokens " + std::to_string(options.max_new_tokens) + " is outside [0, " +
                std::to_string(c.max_positions - prompt_length + 1) + "] for a prompt of " +
                std::to_string(prompt_length) + " tokens (max_position_embeddings " + std::to_string(c.max_positions) +
                ")");
  uint64_t state = options.seed;
  GenerationResult result;
  result.prompt_tokens = prompt_length;
  if (options.max_new_tokens == 0) return result;
  // The last new token is never read back: the caches hold prompt + max_new_tokens - 1 positions.
  std::vector<nn::KVCache> caches =
      impl_->make_caches(1, prompt_length + options.max_new_tokens - 1, impl_->options.kv_dtype);
  using Clock = std::chrono::steady_clock;
  auto start = Clock::now();
  std::vector<float> logits = impl_->step(prompt, 0, caches);
  for (int64_t t = 0; t < options.max_new_tokens; ++t) {
    if (t > 0) logits = impl_->step({result.tokens.back()}, prompt_length + t - 1, caches);
    const int64_t token = sample_token(logits.data(), c.vocab_size, options, state);
    result.tokens.push_back(token);
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    (t == 0 ? result.prefill_seconds : result.decode_seconds) += elapsed;
    const bool eos = std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), token) != c.eos_token_ids.end();
    const bool go_on = !on_token || on_token(token);
    start = Clock::now();
    if (eos && options.stop_at_eos) {
      result.stopped_at_eos = true;
      break;
    }
    if (!go_on) break;
  }
  return result;
}

double GenerationResult::prefill_tokens_per_second() const {
  return prefill_seconds > 0 ? static_cast<double>(prompt_tokens) / prefill_seconds : 0;
}

double GenerationResult::decode_tokens_per_second() const {
  return decode_seconds > 0 && tokens.size() > 1 ? static_cast<double>(tokens.size() - 1) / decode_seconds : 0;
}

}  // namespace qkv::models
