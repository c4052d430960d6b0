// qkv::models::Model::generate_batch and cached_logits_batch (include/qkv/models/model.hpp): many
// sequences at once on packed passes (network.hpp's Pass, attend_packed.cpp) over per-layer paged
// KV caches. The prompts' prefill is one packed pass; each later step is one packed pass of one
// token per unfinished sequence, at its own position, reading its own pages.
#include <chrono>
#include <string>
#include <vector>

#include "core/allocator.hpp"  // check_request
#include "core/quantize.hpp"  // kv_row_bytes
#include "models/model_impl.hpp"
#include "qkv/paged_cache.hpp"
#include "qkv/quantize.hpp"

namespace qkv::models {

namespace {

// Per-layer page pools holding `capacities.size()` sequences: element b is sequence b of every
// pool, with room for capacities[b] positions (the pools hold exactly the pages they need).
class PagedRun {
 public:
  // Refuses (qkv::Error naming the bytes, before allocating) pools larger than the memory qkv
  // may still use: the prompts' positions, not just one, decide their size.
  PagedRun(const char* who, const ModelConfig& config, const ModelOptions& options, const detail::Network& network,
           const std::vector<int64_t>& capacities)
      : config_(config), network_(network), lengths_(capacities.size(), 0) {
    const ModelConfig& c = config;
    // No sequence holds more than max_positions: a longer page would only be unused memory.
    const int64_t page = std::min(options.page_size, c.max_positions);
    int64_t pages = 0;
    for (int64_t n : capacities) pages += (n + page - 1) / page;
    pages = std::max<int64_t>(pages, 1);
    // A position's K and V in every layer, with the scales of a quantized pool.
    const DType dtype = options.kv_dtype;
    const double bytes = 2.0 * static_cast<double>(c.num_layers) * static_cast<double>(c.num_kv_heads) *
                         qkv::detail::kv_row_bytes(dtype, c.head_dim) * static_cast<double>(pages) *
                         static_cast<double>(page);
    qkv::detail::check_request(who, std::to_string(capacities.size()) + " sequences", {bytes, 0.0},
                               std::to_string(c.num_layers) + " layers' K/V pools of " + std::to_string(pages) +
                                   " pages of " + std::to_string(page) + " positions",
                               "generate fewer prompts, or fewer new tokens, at once");
    for (int64_t l = 0; l < c.num_layers; ++l) {
      pools_.emplace_back(pages, page, c.num_kv_heads, c.head_dim, options.kv_dtype);
      for (size_t b = 0; b < capacities.size(); ++b) pools_.back().add_sequence();
    }
  }

  // Feeds tokens[i] to element which[i], after the positions it holds: (which.size(), vocab) logits
  // of each one's last token.
  Tensor step(const std::vector<int64_t>& which, const std::vector<std::vector<int64_t>>& tokens) {
    detail::Pass pass = detail::packed_pass(tokens);
    for (size_t i = 0; i < which.size(); ++i) pass.positions[i] = lengths_[static_cast<size_t>(which[i])];
    pass.paged = &pools_;
    pass.sequences = which;
    const Tensor hidden = network_.hidden_states(pass);  // (rows, d)
    const int64_t d = config_.hidden_size;
    Tensor last = Tensor::empty({pass.batch, d});
    for (int64_t b = 0; b < pass.batch; ++b)
      std::copy_n(hidden.data() + (pass.offsets[static_cast<size_t>(b) + 1] - 1) * d, d, last.data() + b * d);
    for (size_t i = 0; i < which.size(); ++i)
      lengths_[static_cast<size_t>(which[i])] += static_cast<int64_t>(tokens[i].size());
    return network_.logits(last);
  }

  // Element b's pages back to the pools.
  void release(int64_t b) {
    for (nn::PagedKVCache& pool : pools_) pool.release(b);
  }

 private:
  const ModelConfig& config_;
  const detail::Network& network_;
  std::vector<nn::PagedKVCache> pools_;
  std::vector<int64_t> lengths_;
};

int64_t total_tokens(const std::vector<std::vector<int64_t>>& sequences) {
  int64_t total = 0;
  for (const auto& s : sequences) total += static_cast<int64_t>(s.size());
  return total;
}

}  // namespace

std::vector<GenerationResult> Model::generate_batch(const std::vector<std::vector<int64_t>>& prompts,
                                                    const GenerationOptions& options,
                                                    const BatchTokenCallback& on_token) const {
  const Impl& m = *impl_;
  const std::string who = "Model::generate_batch";
  m.check_causal(who);
  check_generation_options(options);
  const auto batch = static_cast<int64_t>(prompts.size());
  std::vector<GenerationResult> results(prompts.size());
  std::vector<int64_t> capacities;
  for (int64_t b = 0; b < batch; ++b) {
    const auto& prompt = prompts[static_cast<size_t>(b)];
    const std::string which = who + ": prompt " + std::to_string(b);
    m.check_tokens(which, prompt, 0);
    m.check_new_tokens(which, static_cast<int64_t>(prompt.size()), options);
    results[static_cast<size_t>(b)].prompt_tokens = static_cast<int64_t>(prompt.size());
    // The last new token is never read back.
    capacities.push_back(static_cast<int64_t>(prompt.size()) + options.max_new_tokens - 1);
  }
  if (batch == 0 || options.max_new_tokens == 0) return results;
  m.check_activation_rows(who, total_tokens(prompts), std::to_string(batch) + " prompts of " +
                                                          std::to_string(total_tokens(prompts)) + " tokens");
  PagedRun run(who.c_str(), m.config, m.options, *m.network, capacities);
  std::vector<uint64_t> states(prompts.size(), options.seed);
  std::vector<int64_t> live;
  for (int64_t b = 0; b < batch; ++b) live.push_back(b);
  std::vector<std::vector<int64_t>> inputs = prompts;
  using Clock = std::chrono::steady_clock;
  for (bool prefill = true; !live.empty(); prefill = false) {
    const auto start = Clock::now();
    const Tensor logits = run.step(live, inputs);
    std::vector<int64_t> chosen;
    for (size_t i = 0; i < live.size(); ++i)
      chosen.push_back(sample_token(logits.data() + static_cast<int64_t>(i) * m.config.vocab_size,
                                    m.config.vocab_size, options, states[static_cast<size_t>(live[i])]));
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    std::vector<int64_t> next;
    inputs.clear();
    for (size_t i = 0; i < live.size(); ++i) {
      GenerationResult& r = results[static_cast<size_t>(live[i])];
      r.tokens.push_back(chosen[i]);
      (prefill ? r.prefill_seconds : r.decode_seconds) += elapsed;
      const bool eos = m.is_eos(chosen[i]) && options.stop_at_eos;
      const bool go_on = !on_token || on_token(live[i], chosen[i]);
      r.stopped_at_eos = eos;
      if (eos || !go_on || static_cast<int64_t>(r.tokens.size()) == options.max_new_tokens) {
        run.release(live[i]);
        continue;
      }
      next.push_back(live[i]);
      inputs.push_back({chosen[i]});
    }
    live = std::move(next);
  }
  return results;
}

std::vector<std::vector<std::vector<float>>> Model::cached_logits_batch(const std::vector<std::vector<int64_t>>& ids,
                                                                        const std::vector<int64_t>& prefill,
                                                                        int64_t chunk) const {
  const Impl& m = *impl_;
  const std::string who = "Model::cached_logits_batch";
  m.check_causal(who);
  if (prefill.size() != ids.size())
    throw Error(who + ": " + std::to_string(prefill.size()) + " prefill lengths for " + std::to_string(ids.size()) +
                " sequences");
  if (chunk < 1) throw Error(who + ": chunk " + std::to_string(chunk) + " must be at least 1");
  std::vector<int64_t> capacities;
  for (size_t b = 0; b < ids.size(); ++b) {
    const auto n = static_cast<int64_t>(ids[b].size());
    m.check_tokens(who + ": sequence " + std::to_string(b), ids[b], 0);
    if (prefill[b] < 1 || prefill[b] > n)
      throw Error(who + ": prefill[" + std::to_string(b) + "] = " + std::to_string(prefill[b]) + " is outside [1, " +
                  std::to_string(n) + "]");
    capacities.push_back(n);
  }
  std::vector<std::vector<std::vector<float>>> out(ids.size());
  if (ids.empty()) return out;
  m.check_activation_rows(who, total_tokens(ids), std::to_string(ids.size()) + " sequences");
  PagedRun run(who.c_str(), m.config, m.options, *m.network, capacities);
  std::vector<int64_t> live;
  std::vector<std::vector<int64_t>> inputs;
  for (size_t b = 0; b < ids.size(); ++b) {
    live.push_back(static_cast<int64_t>(b));
    inputs.emplace_back(ids[b].begin(), ids[b].begin() + prefill[b]);
  }
  std::vector<int64_t> fed = prefill;  // tokens fed so far
  while (!live.empty()) {
    const Tensor logits = run.step(live, inputs);
    std::vector<int64_t> next;
    inputs.clear();
    for (size_t i = 0; i < live.size(); ++i) {
      const auto b = static_cast<size_t>(live[i]);
      const float* row = logits.data() + static_cast<int64_t>(i) * m.config.vocab_size;
      out[b].emplace_back(row, row + m.config.vocab_size);
      const auto n = static_cast<int64_t>(ids[b].size());
      if (fed[b] == n) continue;
      next.push_back(live[i]);
      const int64_t take = std::min(chunk, n - fed[b]);
      inputs.emplace_back(ids[b].begin() + fed[b], ids[b].begin() + fed[b] + take);
      fed[b] += take;
    }
    live = std::move(next);
  }
  return out;
}

}  // namespace qkv::models
