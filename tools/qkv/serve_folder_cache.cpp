// FolderCache: see serve_folder_cache.hpp.
#include "serve_folder_cache.hpp"

#include <algorithm>
#include <utility>

namespace qkv::cli {

// measure_roles' choices (pretrained_text.cpp), kept the same: the repeated sequence's length
// and seed, drawn from the ordinary tokens, after the special token the text starts with.
namespace {
constexpr int64_t kRepeatLength = 24;
constexpr uint64_t kSeed = 0;
}  // namespace

std::shared_ptr<const models::RepeatedAttention> FolderCache::repeated(const models::Pretrained& model,
                                                                       const std::vector<int64_t>& prefix) {
  std::shared_ptr<const std::vector<int64_t>> candidates;
  {
    std::lock_guard lock(mutex_);
    if (auto found = repeated_.find(prefix); found != repeated_.end()) return found->second;
    candidates = candidates_;
  }
  if (!candidates) {
    auto list = std::make_shared<std::vector<int64_t>>();
    const int64_t vocab = std::min<int64_t>(model.config.vocab_size, model.tokenizer->vocab_size());
    for (int64_t id = 0; id < vocab; ++id)
      if (!model.tokenizer->is_special(id)) list->push_back(id);
    candidates = std::move(list);
  }
  const int64_t positions = model.config.max_positions;
  const int64_t length = std::min<int64_t>(kRepeatLength, (positions - std::ssize(prefix)) / 2);
  auto computed = std::make_shared<const models::RepeatedAttention>(
      models::repeated_attention(model.model, prefix, *candidates, {.repeat_length = length, .seed = kSeed}));
  std::lock_guard lock(mutex_);
  if (!candidates_) candidates_ = candidates;
  ++counts_.repeated_runs;
  return repeated_.try_emplace(prefix, std::move(computed)).first->second;
}

std::vector<models::HeadRoleScores> FolderCache::roles(const models::Pretrained& model, const std::vector<int64_t>& ids,
                                                       const std::vector<Tensor>& text_attention) {
  if (ids.size() < 2) throw Error("head roles: the text has " + std::to_string(ids.size()) + " tokens; give at least 2");
  std::vector<int64_t> prefix;
  if (model.tokenizer->is_special(ids.front())) prefix.push_back(ids.front());
  const auto repeat = repeated(model, prefix);
  return models::score_heads(text_attention, repeat->attention, repeat->start, repeat->length,
                             model.config.is_causal());
}

std::shared_ptr<const models::QueryKeys> FolderCache::query_keys(const models::Pretrained& model,
                                                                 const std::vector<int64_t>& ids, int64_t layer) {
  const auto matches = [&](const QueryKeysEntry& e) { return e.layer == layer && e.ids == ids; };
  {
    std::lock_guard lock(mutex_);
    if (auto found = std::find_if(query_keys_.begin(), query_keys_.end(), matches); found != query_keys_.end()) {
      query_keys_.splice(query_keys_.begin(), query_keys_, found);
      ++counts_.query_keys_hits;
      return found->value;
    }
  }
  auto computed = std::make_shared<const models::QueryKeys>(model.model.query_keys(ids, layer));
  std::lock_guard lock(mutex_);
  ++counts_.query_keys_runs;
  if (auto found = std::find_if(query_keys_.begin(), query_keys_.end(), matches); found != query_keys_.end())
    return found->value;  // another request computed it meanwhile
  query_keys_.push_front({ids, layer, computed});
  if (query_keys_.size() > kQueryKeysEntries) query_keys_.pop_back();
  return computed;
}

FolderCache::Counts FolderCache::counts() const {
  std::lock_guard lock(mutex_);
  return counts_;
}

}  // namespace qkv::cli
