// A tokenizer.json as one Tokenizer: added tokens split out of the text first (leftmost,
// longest), each remaining segment normalized, pre-tokenized and given to the model; the
// post-processor's tokens around the whole. Decoding maps ids to tokens (added tokens verbatim)
// and runs the decoder.
#include <array>

#include "models/byte_level.hpp"
#include "models/json_parse.hpp"
#include "models/tokenizer_parts.hpp"
#include "models/unicode.hpp"
#include "models/vocabulary.hpp"
#include "qkv/error.hpp"
#include "qkv/models/tokenizer.hpp"

namespace qkv::models::detail {

std::unique_ptr<Model> make_bpe(const Json& spec, const std::string& where);
std::unique_ptr<Model> make_wordpiece(const Json& spec, const std::string& where);

std::unique_ptr<Model> make_model(const Json& spec, const std::string& where) {
  const std::string type = string_or(spec, "type", "", where);
  if (type == "BPE") return make_bpe(spec, where);
  if (type == "WordPiece") return make_wordpiece(spec, where);
  bad_field(where, "qkv does not support the model type '" + type + "' (it reads BPE and WordPiece)");
}

void require_byte_alphabet(const Vocabulary& vocabulary, const std::string& where);

namespace {

struct AddedToken {
  std::string content;
  int64_t id;
  bool special, lstrip, rstrip;
};

// Whether `spec` or an object nested in it has "type": `type`.
bool mentions_type(const Json& spec, const std::string& type) {
  if (spec.is_object()) {
    if (const auto it = spec.find("type"); it != spec.end() && it->is_string() && it->get<std::string>() == type) return true;
    for (const auto& [key, value] : spec.items())
      if (mentions_type(value, type)) return true;
  } else if (spec.is_array()) {
    for (const Json& value : spec)
      if (mentions_type(value, type)) return true;
  }
  return false;
}

const Json& member_or_null(const Json& object, const char* key) {
  static const Json null;
  const auto it = object.find(key);
  return it == object.end() ? null : *it;
}

// The length of the whitespace that ends `text` (lstrip) or starts it (rstrip).
size_t trailing_space(std::string_view text) {
  const std::vector<Utf8Unit> units = utf8_units(text);
  size_t n = 0;
  for (size_t k = units.size(); k > 0 && is_whitespace(units[k - 1]); --k) n += units[k - 1].length;
  return n;
}
size_t leading_space(std::string_view text) {
  size_t n = 0;
  for (const Utf8Unit& unit : utf8_units(text)) {
    if (!is_whitespace(unit)) break;
    n += unit.length;
  }
  return n;
}

class JsonTokenizer final : public Tokenizer {
 public:
  JsonTokenizer(const Json& json, const std::string& source, std::string_view config_json) {
    if (!json.is_object()) bad_field(source, "expected a JSON object");
    model_ = make_model(required(json, "model", source), source + ": model");
    vocabulary_ = model_->vocabulary();
    read_added_tokens(member_or_null(json, "added_tokens"), source + ": added_tokens");
    normalizer_ = make_normalizer(member_or_null(json, "normalizer"), source + ": normalizer");
    pre_tokenizer_ = make_pre_tokenizer(member_or_null(json, "pre_tokenizer"), source + ": pre_tokenizer");
    decoder_ = make_decoder(member_or_null(json, "decoder"), source + ": decoder");
    post_ = make_post_processor(member_or_null(json, "post_processor"), source + ": post_processor",
                                [this](const std::string& token) { return token_to_id(token); });
    for (const int64_t id : post_.prefix) check_id(id, source + ": post_processor");
    for (const int64_t id : post_.suffix) check_id(id, source + ": post_processor");
    if (mentions_type(member_or_null(json, "pre_tokenizer"), "ByteLevel"))
      require_byte_alphabet(model_->vocabulary(), source + ": model.vocab");
    assign_roles(config_json, source);
  }

  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int64_t> ids;
    if (add_special_tokens) ids = post_.prefix;
    size_t segment = 0;  // start of the text not yet encoded
    for (size_t at = 0; at < text.size();) {
      const AddedToken* token = added_at(text, at);
      if (token == nullptr) {
        ++at;
        continue;
      }
      size_t begin = at, end = at + token->content.size();
      if (token->lstrip) begin -= trailing_space(text.substr(segment, begin - segment));
      if (token->rstrip) end += leading_space(text.substr(end));
      encode_segment(text.substr(segment, begin - segment), segment == 0, ids);
      ids.push_back(token->id);
      segment = at = end;
    }
    encode_segment(text.substr(segment), segment == 0, ids);
    if (add_special_tokens) ids.insert(ids.end(), post_.suffix.begin(), post_.suffix.end());
    return ids;
  }

  std::string decode(std::span<const int64_t> ids, bool skip_special_tokens) const override {
    std::vector<DecodedToken> tokens;
    for (const int64_t id : ids) {
      const std::string& token = id_to_token_ref(id);
      const bool added = is_added(id);
      if (skip_special_tokens && is_special(id)) continue;
      tokens.push_back({token, added});
    }
    decoder_(tokens);
    std::string text;
    for (const DecodedToken& token : tokens) text += token.text;
    return text;
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(vocabulary_.tokens.size()); }
  std::optional<int64_t> token_to_id(std::string_view token) const override { return vocabulary_.find(token); }
  std::string id_to_token(int64_t id) const override { return id_to_token_ref(id); }
  bool is_special(int64_t id) const override {
    return id >= 0 && static_cast<size_t>(id) < special_.size() && special_[static_cast<size_t>(id)];
  }

 private:
  void read_added_tokens(const Json& list, const std::string& where) {
    if (list.is_null()) return;
    if (!list.is_array()) bad_field(where, "expected a list");
    for (size_t i = 0; i < list.size(); ++i) {
      const Json& entry = list[i];
      const std::string at = where + "[" + std::to_string(i) + "]";
      const Json& id = required(entry, "id", at);
      if (!id.is_number_integer()) bad_field(at + ".id", "expected an id, found " + brief(id));
      AddedToken token{string_or(entry, "content", "", at), id.is_number_unsigned() && id.get<uint64_t>() > INT64_MAX ? -1 : id.get<int64_t>(),
                       bool_or(entry, "special", false, at), bool_or(entry, "lstrip", false, at),
                       bool_or(entry, "rstrip", false, at)};
      if (token.content.empty()) bad_field(at, "an added token must have a non-empty content");
      add_token(vocabulary_, token.content, token.id, at);
      added_.push_back(token);
    }
    std::sort(added_.begin(), added_.end(), [](const AddedToken& a, const AddedToken& b) {
      return a.content.size() > b.content.size();
    });
    for (size_t i = 0; i < added_.size(); ++i)
      by_first_byte_[static_cast<uint8_t>(added_[i].content[0])].push_back(i);
    special_.assign(vocabulary_.tokens.size(), false);
    added_ids_.assign(vocabulary_.tokens.size(), false);
    for (const AddedToken& token : added_) {
      special_[static_cast<size_t>(token.id)] = token.special;
      added_ids_[static_cast<size_t>(token.id)] = true;
    }
  }

  // The longest added token at text[at], or nullptr.
  const AddedToken* added_at(std::string_view text, size_t at) const {
    for (const size_t i : by_first_byte_[static_cast<uint8_t>(text[at])])
      if (text.substr(at).starts_with(added_[i].content)) return &added_[i];
    return nullptr;
  }

  void encode_segment(std::string_view segment, bool first, std::vector<int64_t>& ids) const {
    if (segment.empty()) return;
    std::vector<std::string> pieces{normalizer_(segment)};
    pre_tokenizer_(pieces, first);
    for (const std::string& piece : pieces) model_->encode(piece, ids);
  }

  bool is_added(int64_t id) const { return static_cast<size_t>(id) < added_ids_.size() && added_ids_[static_cast<size_t>(id)]; }

  const std::string& id_to_token_ref(int64_t id) const {
    if (id < 0 || id >= vocab_size())
      throw Error("token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(vocab_size()) + ")");
    const std::string& token = vocabulary_.tokens[static_cast<size_t>(id)];
    if (token.empty()) throw Error("token id " + std::to_string(id) + " has no token in the vocabulary");
    return token;
  }

  void check_id(int64_t id, const std::string& where) const {
    if (id < 0 || id >= vocab_size() || vocabulary_.tokens[static_cast<size_t>(id)].empty())
      bad_field(where, "id " + std::to_string(id) + " is no token of the vocabulary");
  }

  // The special tokens' roles: tokenizer_config.json's bos_token, ... when given, else the
  // well-known spellings.
  void assign_roles(std::string_view config_json, const std::string& source) {
    Json config = Json::object();
    if (!config_json.empty()) config = parse_json(config_json, source + ": tokenizer_config.json");
    if (!config.is_object()) config = Json::object();
    const auto role = [&](const char* key, std::initializer_list<const char*> spellings) -> std::optional<int64_t> {
      if (const auto it = config.find(key); it != config.end()) {
        const Json* name = &*it;
        if (name->is_object() && name->contains("content")) name = &(*name)["content"];
        if (name->is_string()) {
          if (const auto id = token_to_id(name->get<std::string>())) return id;
        }
      }
      for (const char* spelling : spellings)
        if (const auto id = token_to_id(spelling)) return id;
      return std::nullopt;
    };
    roles_.bos = role("bos_token", {"<s>", "<|begin_of_text|>", "<|endoftext|>"});
    roles_.eos = role("eos_token", {"</s>", "<|end_of_text|>", "<|endoftext|>"});
    roles_.unk = model_->unk() ? model_->unk() : role("unk_token", {"<unk>", "[UNK]"});
    roles_.pad = role("pad_token", {"<pad>", "[PAD]"});
    roles_.cls = role("cls_token", {"[CLS]", "<cls>"});
    roles_.sep = role("sep_token", {"[SEP]", "<sep>"});
    roles_.mask = role("mask_token", {"[MASK]", "<mask>"});
  }

  std::unique_ptr<Model> model_;
  Vocabulary vocabulary_;  // the model's and the added tokens
  std::vector<AddedToken> added_;  // longest first
  std::array<std::vector<size_t>, 256> by_first_byte_;
  std::vector<bool> special_, added_ids_;
  Normalizer normalizer_;
  PreTokenizer pre_tokenizer_;
  Decoder decoder_;
  PostProcessor post_;
};

}  // namespace

void require_byte_alphabet(const Vocabulary& vocabulary, const std::string& where) {
  for (int byte = 0; byte < 256; ++byte) {
    std::string token;
    append_utf8(token, byte_to_char(static_cast<uint8_t>(byte)));
    if (!vocabulary.find(token))
      bad_field(where, "byte-level BPE needs a token for every byte; byte " + std::to_string(byte) + " ('" + token +
                           "') has none");
  }
}

}  // namespace qkv::models::detail

namespace qkv::models {

std::unique_ptr<Tokenizer> tokenizer_from_json(std::string_view json, const std::string& source,
                                               std::string_view config_json) {
  const detail::Json parsed = detail::parse_json(json, source);
  return std::make_unique<detail::JsonTokenizer>(parsed, source, config_json);
}

}  // namespace qkv::models
