// BERT's WordPiece model: a word becomes its longest vocabulary prefix, then the longest
// "##"-prefixed continuations, greedily; a word some position of which has no continuation, or
// longer than max_input_chars_per_word characters, is the unknown token as a whole.
#include "models/unicode.hpp"
#include "models/vocabulary.hpp"

namespace qkv::models::detail {
namespace {

constexpr uint64_t kMostCharsPerWord = 1024;

class WordPiece final : public Model {
 public:
  WordPiece(const Json& spec, const std::string& where) {
    vocabulary_ = read_vocabulary(required(spec, "vocab", where), where + ".vocab");
    const std::string unk = string_or(spec, "unk_token", "[UNK]", where);
    unk_ = vocabulary_.find(unk);
    if (!unk_) bad_field(where + ".unk_token", "'" + unk + "' is not in the vocabulary");
    prefix_ = string_or(spec, "continuing_subword_prefix", "##", where);
    if (const auto it = spec.find("max_input_chars_per_word"); it != spec.end()) {
      // The greedy search is quadratic in a word's length: the bound keeps it short.
      if (!it->is_number_unsigned() || it->get<uint64_t>() > kMostCharsPerWord)
        bad_field(where + ".max_input_chars_per_word",
                  "expected a count up to " + std::to_string(kMostCharsPerWord) + ", found " + brief(*it));
      max_chars_ = it->get<uint64_t>();
    }
  }

  void encode(std::string_view word, std::vector<int64_t>& out) const override {
    const std::vector<Utf8Unit> units = utf8_units(word);
    if (units.empty()) return;
    if (units.size() > max_chars_) {
      out.push_back(*unk_);
      return;
    }
    std::vector<int64_t> pieces;
    for (size_t start = 0; start < units.size();) {
      std::optional<int64_t> found;
      size_t end = units.size();
      for (; end > start; --end) {
        const size_t begin_byte = units[start].begin;
        const size_t end_byte = end == units.size() ? word.size() : units[end].begin;
        std::string candidate(word.substr(begin_byte, end_byte - begin_byte));
        if (start > 0) candidate = prefix_ + candidate;
        if ((found = vocabulary_.find(candidate))) break;
      }
      if (!found) {
        out.push_back(*unk_);
        return;
      }
      pieces.push_back(*found);
      start = end;
    }
    out.insert(out.end(), pieces.begin(), pieces.end());
  }
  const Vocabulary& vocabulary() const override { return vocabulary_; }
  std::optional<int64_t> unk() const override { return unk_; }

 private:
  Vocabulary vocabulary_;
  std::optional<int64_t> unk_;
  std::string prefix_;
  uint64_t max_chars_ = 100;
};

}  // namespace

std::unique_ptr<Model> make_wordpiece(const Json& spec, const std::string& where) {
  return std::make_unique<WordPiece>(spec, where);
}

}  // namespace qkv::models::detail
