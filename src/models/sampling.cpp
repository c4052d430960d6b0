// qkv::models::sample_token (include/qkv/models/model.hpp): greedy, or temperature sampling
// restricted to the top k tokens and to the top-p nucleus (Holtzman et al. 2020), in that order,
// as Hugging Face's TopKLogitsWarper then TopPLogitsWarper do.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/models/model.hpp"
#include "core/random.hpp"

namespace qkv::models {

void check_generation_options(const GenerationOptions& o) {
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature))
    throw Error("generate: temperature must be finite and >= 0 (0: greedy), got " + std::to_string(o.temperature));
  if (o.top_k < 0) throw Error("generate: top_k must be >= 0 (0: off), got " + std::to_string(o.top_k));
  if (!(o.top_p > 0 && o.top_p <= 1)) throw Error("generate: top_p must be in (0, 1], got " + std::to_string(o.top_p));
}

namespace {

// A uniform draw in [0, 1) from the sampler's state (SplitMix64), advancing it.
double next_uniform(uint64_t& state) {
  state += 0x9e3779b97f4a7c15ULL;
  return static_cast<double>(detail::mix64(state) >> 11) * 0x1.0p-53;
}

// NaN sorts last, so that sorting never meets an unordered pair.
float ordered(float logit) { return std::isnan(logit) ? -INFINITY : logit; }

}  // namespace

int64_t sample_token(const float* logits, int64_t vocab, const GenerationOptions& options, uint64_t& state) {
  check_generation_options(options);
  if (options.temperature == 0) return std::max_element(logits, logits + vocab) - logits;
  // The candidates, most likely first: all of them, or the top k.
  const int64_t keep = options.top_k > 0 ? std::min(options.top_k, vocab) : vocab;
  std::vector<int64_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                    [&](int64_t a, int64_t b) { return ordered(logits[a]) > ordered(logits[b]); });
  order.resize(static_cast<size_t>(keep));
  if (!std::isfinite(logits[order[0]]))
    throw Error("generate: the most likely token's logit is " + std::to_string(logits[order[0]]) +
                ": the model's logits hold no finite value to sample from");
  // softmax(logits / temperature) over them, in double.
  std::vector<double> p(order.size());
  const double top = logits[order[0]];
  double sum = 0;
  for (size_t i = 0; i < order.size(); ++i) sum += p[i] = std::exp((logits[order[i]] - top) / options.temperature);
  // The nucleus: the fewest leading candidates whose probability reaches top_p (at least one).
  size_t nucleus = order.size();
  if (options.top_p < 1) {
    double mass = 0;
    for (size_t i = 0; i < order.size(); ++i)
      if ((mass += p[i] / sum) >= options.top_p) {
        nucleus = i + 1;
        break;
      }
  }
  const double total = std::accumulate(p.begin(), p.begin() + static_cast<int64_t>(nucleus), 0.0);
  double u = next_uniform(state) * total;
  for (size_t i = 0; i < nucleus; ++i)
    if ((u -= p[i]) < 0) return order[i];
  return order[nucleus - 1];
}

}  // namespace qkv::models
