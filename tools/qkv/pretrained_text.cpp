// The helpers of pretrained.hpp that qkv serve shares with generate / viz / heads: token labels,
// a text's ids, head roles. In qkv_explorer_api (no plotting), which qkv_cli links.
#include <algorithm>
#include <span>

#include <fmt/core.h>

#include "pretrained.hpp"
#include "qkv/error.hpp"

namespace qkv::cli {

bool is_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t length = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (length == 0 || i + length > s.size()) return false;
    for (size_t k = 1; k < length; ++k)
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return false;
    i += length;
  }
  return true;
}

std::vector<std::string> token_labels(const models::Tokenizer& tokenizer, const std::vector<int64_t>& ids) {
  std::vector<std::string> labels;
  for (int64_t id : ids) {
    const int64_t one[] = {id};
    std::string text = tokenizer.decode(std::span<const int64_t>(one, 1));
    if (text.empty() || !is_utf8(text)) text = tokenizer.id_to_token(id);
    std::replace(text.begin(), text.end(), ' ', '_');
    std::replace(text.begin(), text.end(), '\n', '/');
    labels.push_back(text);
  }
  return labels;
}

std::vector<int64_t> encode_text(const models::Pretrained& model, const std::string& text) {
  if (!model.tokenizer) throw Error(model.path.string() + ": the folder has no tokenizer.json or tokenizer.model");
  std::vector<int64_t> ids = model.tokenizer->encode(text);
  if (ids.empty()) throw Error("the text '" + text + "' has no tokens");
  for (int64_t id : ids)
    if (id >= model.config.vocab_size)
      throw Error(fmt::format("the tokenizer gives id {} but the model's vocabulary has {} entries: they do not "
                              "belong together",
                              id, model.config.vocab_size));
  return ids;
}

std::vector<models::HeadRoleScores> measure_roles(const models::Pretrained& model, const std::vector<int64_t>& ids,
                                                  int64_t repeat_length, uint64_t seed) {
  // Tokens to draw the repeated sequence from: the vocabulary's ordinary tokens.
  std::vector<int64_t> candidates;
  const int64_t vocab = std::min<int64_t>(model.config.vocab_size, model.tokenizer->vocab_size());
  for (int64_t id = 0; id < vocab; ++id)
    if (!model.tokenizer->is_special(id)) candidates.push_back(id);
  // A special token the tokenizer puts first (BOS, [CLS]) starts the repeated sequence too.
  std::vector<int64_t> prefix;
  if (model.tokenizer->is_special(ids.front())) prefix.push_back(ids.front());
  // Both sequences within the model's positions: the text's first max_positions tokens, and a
  // repeated sequence short enough to fit twice.
  const int64_t positions = model.config.max_positions;
  const std::vector<int64_t> text(ids.begin(), ids.begin() + std::min<int64_t>(positions, std::ssize(ids)));
  const int64_t repeat = std::min<int64_t>(repeat_length, (positions - std::ssize(prefix)) / 2);
  return models::measure_head_roles(model.model, text, prefix, candidates, {.repeat_length = repeat, .seed = seed});
}

}  // namespace qkv::cli
