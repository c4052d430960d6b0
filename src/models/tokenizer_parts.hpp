// The stages of a tokenizer.json pipeline, each built from its JSON object:
//   text -> added tokens split out -> normalizer -> pre-tokenizer -> model -> post-processor
//   ids  -> tokens -> decoder -> text
// `where` names the file and the field in every error ("'x/tokenizer.json': pre_tokenizer").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "models/json_parse.hpp"

namespace qkv::models::detail {

using Json = nlohmann::json;

[[noreturn]] void bad_field(const std::string& where, const std::string& what);
const Json& required(const Json& object, const char* key, const std::string& where);
std::string string_or(const Json& object, const char* key, const std::string& fallback, const std::string& where);
bool bool_or(const Json& object, const char* key, bool fallback, const std::string& where);

// Normalizer: the text of a segment, normalized. Null JSON: the identity.
using Normalizer = std::function<std::string(std::string_view)>;
Normalizer make_normalizer(const Json& spec, const std::string& where);

// Pre-tokenizer: splits each piece further; `first_segment` is whether the pieces start the text
// (Metaspace's prepend_scheme "first"). Null JSON: the segment is one piece.
using PreTokenizer = std::function<void(std::vector<std::string>& pieces, bool first_segment)>;
PreTokenizer make_pre_tokenizer(const Json& spec, const std::string& where);

// The vocabulary of a model: token <-> id, ids checked to be non-negative and unique.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
struct Vocabulary {
  std::unordered_map<std::string, int64_t, StringHash, std::equal_to<>> ids;
  std::vector<std::string> tokens;  // by id; holes are empty and absent from `ids`
  std::optional<int64_t> find(std::string_view token) const;
};

// Model: the ids of one pre-tokenized piece.
class Model {
 public:
  virtual ~Model() = default;
  virtual void encode(std::string_view piece, std::vector<int64_t>& out) const = 0;
  virtual const Vocabulary& vocabulary() const = 0;
  virtual std::optional<int64_t> unk() const = 0;
};
// BPE or WordPiece; any other type is an error naming it.
std::unique_ptr<Model> make_model(const Json& spec, const std::string& where);
// Whether every byte of GPT-2's byte-level alphabet is a token (checked for ByteLevel tokenizers).
void require_byte_alphabet(const Vocabulary& vocabulary, const std::string& where);

// Post-processor: the ids added before and after a single sequence. `find` maps a token to its id.
struct PostProcessor {
  std::vector<int64_t> prefix, suffix;
};
PostProcessor make_post_processor(const Json& spec, const std::string& where,
                                  const std::function<std::optional<int64_t>(const std::string&)>& find);

// Decoder: rewrites the tokens in place; added tokens are `verbatim` (their text is kept as is by
// the steps that map characters). The result is the tokens' texts joined.
struct DecodedToken {
  std::string text;
  bool verbatim = false;
};
using Decoder = std::function<void(std::vector<DecodedToken>& tokens)>;
Decoder make_decoder(const Json& spec, const std::string& where);

}  // namespace qkv::models::detail
