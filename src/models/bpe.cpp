// The BPE model of tokenizer.json: a piece starts as its characters' tokens (or its bytes'
// <0xXX> tokens with byte_fallback, or the unknown token), then the adjacent pair of lowest merge
// rank is merged until no pair has a merge (ties: the leftmost first), as the `tokenizers`
// library does. Merges come as "a b" strings or ["a", "b"] lists.
#include <queue>

#include "models/unicode.hpp"
#include "models/vocabulary.hpp"

namespace qkv::models::detail {
namespace {

struct MergeResult {
  int64_t rank;
  int64_t id;
};

uint64_t pair_key(int64_t left, int64_t right) {
  return (static_cast<uint64_t>(left) << 32) | static_cast<uint64_t>(right);
}

class Bpe final : public Model {
 public:
  Bpe(const Json& spec, const std::string& where) {
    vocabulary_ = read_vocabulary(required(spec, "vocab", where), where + ".vocab");
    const std::string unk = string_or(spec, "unk_token", "", where);
    if (!unk.empty()) {
      unk_ = vocabulary_.find(unk);
      if (!unk_) bad_field(where + ".unk_token", "'" + unk + "' is not in the vocabulary");
    }
    prefix_ = string_or(spec, "continuing_subword_prefix", "", where);
    suffix_ = string_or(spec, "end_of_word_suffix", "", where);
    byte_fallback_ = bool_or(spec, "byte_fallback", false, where);
    fuse_unk_ = bool_or(spec, "fuse_unk", false, where);
    ignore_merges_ = bool_or(spec, "ignore_merges", false, where);
    if (const auto dropout = spec.find("dropout"); dropout != spec.end() && !dropout->is_null())
      if (!dropout->is_number() || dropout->get<double>() != 0.0)
        bad_field(where + ".dropout", "qkv encodes without BPE dropout; found " + brief(*dropout));
    read_merges(spec.contains("merges") ? spec["merges"] : Json::array(), where + ".merges");
  }

  void encode(std::string_view piece, std::vector<int64_t>& out) const override {
    if (piece.empty()) return;
    if (ignore_merges_) {
      if (const auto id = vocabulary_.find(piece)) {
        out.push_back(*id);
        return;
      }
    }
    std::vector<Symbol> symbols = initial_symbols(piece);
    merge(symbols);
    for (const Symbol& symbol : symbols)
      if (symbol.alive) out.push_back(symbol.id);
  }
  const Vocabulary& vocabulary() const override { return vocabulary_; }
  std::optional<int64_t> unk() const override { return unk_; }

 private:
  struct Symbol {
    int64_t id;
    int64_t previous, next;  // indices of the neighbours, -1 at the ends
    bool alive = true;
  };

  void read_merges(const Json& merges, const std::string& where) {
    if (!merges.is_array()) bad_field(where, "expected a list");
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const Json& merge = merges[rank];
      const std::string at = where + "[" + std::to_string(rank) + "]";
      std::string left, right;
      if (merge.is_string()) {
        const std::string text = merge.get<std::string>();
        const size_t space = text.find(' ');
        if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos)
          bad_field(at, "expected \"left right\", found '" + text + "'");
        left = text.substr(0, space);
        right = text.substr(space + 1);
      } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
        left = merge[0].get<std::string>();
        right = merge[1].get<std::string>();
      } else {
        bad_field(at, "expected \"left right\" or [\"left\", \"right\"], found " + brief(merge));
      }
      // With a continuing-subword prefix, "a" + "##b" is "ab": the right side's prefix goes.
      const std::string merged = !prefix_.empty() && right.starts_with(prefix_) ? left + right.substr(prefix_.size())
                                                                               : left + right;
      const auto left_id = vocabulary_.find(left), right_id = vocabulary_.find(right),
                 merged_id = vocabulary_.find(merged);
      for (const auto& [part, id] : {std::pair{left, left_id}, {right, right_id}, {merged, merged_id}})
        if (!id) bad_field(at, "the merge of '" + left + "' and '" + right + "' uses '" + part + "', which is not in the vocabulary");
      merges_.try_emplace(pair_key(*left_id, *right_id), MergeResult{static_cast<int64_t>(rank), *merged_id});
    }
  }

  std::vector<Symbol> initial_symbols(std::string_view piece) const {
    std::vector<Symbol> symbols;
    const std::vector<Utf8Unit> units = utf8_units(piece);
    bool previous_unknown = false;
    const auto push = [&](int64_t id) {
      const auto index = static_cast<int64_t>(symbols.size());
      symbols.push_back({id, index - 1, -1});
      if (index > 0) symbols[static_cast<size_t>(index - 1)].next = index;
    };
    for (size_t i = 0; i < units.size(); ++i) {
      std::string token(piece.substr(units[i].begin, units[i].length));
      if (i > 0) token = prefix_ + token;
      if (i + 1 == units.size()) token += suffix_;
      if (const auto id = vocabulary_.find(token)) {
        push(*id);
        previous_unknown = false;
        continue;
      }
      if (byte_fallback_ && push_bytes(piece.substr(units[i].begin, units[i].length), push)) {
        previous_unknown = false;
        continue;
      }
      if (!unk_) continue;  // no unknown token: the character is dropped, as the library does
      if (!(fuse_unk_ && previous_unknown)) push(*unk_);
      previous_unknown = true;
    }
    return symbols;
  }

  // The <0xXX> tokens of `bytes`, when the vocabulary has every one of them.
  template <typename Push>
  bool push_bytes(std::string_view bytes, Push& push) const {
    std::vector<int64_t> ids;
    for (const char byte : bytes) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", static_cast<unsigned>(static_cast<uint8_t>(byte)));
      const auto id = vocabulary_.find(name);
      if (!id) return false;
      ids.push_back(*id);
    }
    for (const int64_t id : ids) push(id);
    return true;
  }

  const MergeResult* merge_of(int64_t left, int64_t right) const {
    const auto it = merges_.find(pair_key(left, right));
    return it == merges_.end() ? nullptr : &it->second;
  }

  void merge(std::vector<Symbol>& symbols) const {
    struct Candidate {
      int64_t rank, position, id;
      bool operator>(const Candidate& other) const {
        return rank != other.rank ? rank > other.rank : position > other.position;
      }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
    const auto offer = [&](int64_t position) {
      if (position < 0) return;
      const Symbol& symbol = symbols[static_cast<size_t>(position)];
      if (symbol.next < 0) return;
      if (const MergeResult* m = merge_of(symbol.id, symbols[static_cast<size_t>(symbol.next)].id))
        queue.push({m->rank, position, m->id});
    };
    for (size_t i = 0; i + 1 < symbols.size(); ++i) offer(static_cast<int64_t>(i));
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[static_cast<size_t>(top.position)];
      if (!left.alive || left.next < 0) continue;
      Symbol& right = symbols[static_cast<size_t>(left.next)];
      // Stale when either side has changed since the candidate was offered.
      const MergeResult* now = merge_of(left.id, right.id);
      if (now == nullptr || now->rank != top.rank) continue;
      left.id = now->id;
      right.alive = false;
      left.next = right.next;
      if (right.next >= 0) symbols[static_cast<size_t>(right.next)].previous = top.position;
      offer(left.previous);
      offer(top.position);
    }
  }

  Vocabulary vocabulary_;
  std::unordered_map<uint64_t, MergeResult> merges_;
  std::optional<int64_t> unk_;
  std::string prefix_, suffix_;
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false;
};

}  // namespace

std::unique_ptr<Model> make_bpe(const Json& spec, const std::string& where) { return std::make_unique<Bpe>(spec, where); }

}  // namespace qkv::models::detail
