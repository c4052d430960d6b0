// qkv::models::Model (include/qkv/models/model.hpp): checks the inputs, builds a pass over them,
// and runs the architecture's Network (network.hpp) over per-layer KV caches: fresh float32 ones
// for a full forward, options.kv_dtype ones kept across generate()'s steps.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "models/model_impl.hpp"
#include "qkv/error.hpp"

namespace qkv::models {

namespace detail {
std::string model_name(const ModelConfig& c) {
  return std::string(to_string(c.architecture)) + " (" + std::to_string(c.num_layers) + " layers, hidden " +
         std::to_string(c.hidden_size) + ")";
}
}  // namespace detail

Model::Model(const ModelConfig& config, std::shared_ptr<const WeightSource> weights, const ModelOptions& options)
    : impl_(std::make_unique<Impl>()) {
  check_config(config);
  if (!weights) throw Error("Model: no weight source given");
  const DType kv = options.kv_dtype;
  if (kv != DType::F32 && kv != DType::BF16 && kv != DType::F16 && kv != DType::I8 && kv != DType::I4)
    throw Error("Model: kv_dtype " + std::string(to_string(kv)) + " is not one of f32, bf16, f16, i8 or i4");
  if (kv == DType::I4 && config.head_dim % 2 != 0)
    throw Error("Model: kv_dtype i4 packs two values a byte, but " + detail::model_name(config) + " has head_dim " +
                std::to_string(config.head_dim));
  if (options.page_size < 1)
    throw Error("Model: page_size " + std::to_string(options.page_size) + " must be at least 1");
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
  impl_->check_activation_rows(who, pass.batch * pass.length,
                               std::to_string(pass.batch) + " sequences of up to " + std::to_string(pass.length) +
                                   " tokens");
  // need_attention keeps (B, H, N, N) weights for every layer.
  if (need_attention && pass.batch * c.num_heads * c.num_layers > Impl::kMaxActivationFloats / (pass.length * pass.length))
    throw Error(who + ": need_attention on " + std::to_string(pass.batch) + " sequences of up to " +
                std::to_string(pass.length) + " tokens keeps " + std::to_string(c.num_layers) + " layers x " +
                std::to_string(c.num_heads) + " heads of (N, N) weights, more than 2^31 floats: ask for fewer tokens");
  // A ragged batch without weights runs packed (forward_packed builds its own rows); the rest padded.
  const bool packed = pass.ragged() && !need_attention;
  if (!packed) {
    pass.ids.assign(static_cast<size_t>(pass.batch * pass.length), 0);
    if (types) pass.token_types.assign(pass.ids.size(), 0);
  }
  for (size_t b = 0; b < input.ids.size(); ++b) {
    if (!packed)
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
    if (!packed) std::copy(t.begin(), t.end(), pass.token_types.begin() + static_cast<int64_t>(b) * pass.length);
  }
  if (packed) return impl_->forward_packed(input, pass);
  std::vector<nn::KVCache> caches = impl_->make_caches(pass.batch, pass.length, DType::F32);
  pass.caches = &caches;
  ModelOutput out;
  if (need_attention) pass.attention = &out.attention;
  const Tensor hidden = impl_->network->hidden_states(pass);
  out.hidden = hidden.reshape({pass.batch, pass.length, c.hidden_size});
  if (c.has_lm_head()) out.logits = impl_->network->logits(hidden).reshape({pass.batch, pass.length, c.vocab_size});
  return out;
}

// A ragged batch without weights runs packed: no padding row is projected or attended. The
// outputs are then laid out as the padded forward's, padding rows zero.
ModelOutput Model::Impl::forward_packed(const ModelInput& input, const detail::Pass& padded) const {
  detail::Pass pass = detail::packed_pass(input.ids);
  for (size_t b = 0; b < input.token_type_ids.size(); ++b)
      pass.token_types.insert(pass.token_types.end(), input.token_type_ids[b].begin(), input.token_type_ids[b].end());
  const Tensor hidden = network->hidden_states(pass);
  const Tensor logits = config.has_lm_head() ? network->logits(hidden) : Tensor();
  const auto unpack = [&](const Tensor& rows) {
    const int64_t width = rows.size(1);
    Tensor out = Tensor::zeros({padded.batch, padded.length, width});
    for (int64_t b = 0; b < pass.batch; ++b)
      std::copy_n(rows.data() + pass.offsets[static_cast<size_t>(b)] * width,
                  pass.counts[static_cast<size_t>(b)] * width, out.data() + b * padded.length * width);
    return out;
  };
  ModelOutput out;
  out.hidden = unpack(hidden);
  if (logits.defined()) out.logits = unpack(logits);
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
  impl_->check_causal(who);
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
  impl_->check_causal(who);
  impl_->check_tokens(who, prompt, 0);
  check_generation_options(options);
  const auto prompt_length = static_cast<int64_t>(prompt.size());
  impl_->check_new_tokens(who, prompt_length, options);
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
    const bool eos = impl_->is_eos(token);
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
