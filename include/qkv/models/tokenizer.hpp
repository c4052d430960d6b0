// Tokenizers of Hugging Face model folders, behind one interface:
//   - tokenizer.json (the `tokenizers` library's file): byte-level BPE (GPT-2, Llama 3, Qwen2,
//     SmolLM), SentencePiece-style BPE with byte fallback (Llama 2 / TinyLlama / Mistral's
//     tokenizer.json) and WordPiece (BERT), with their normalizers, pre-tokenizers, added
//     tokens, post-processors and decoders;
//   - tokenizer.model (SentencePiece's protobuf), through libsentencepiece when qkv is built
//     with it.
// Ids are int64_t, as the models take them. Every fault of a file is a qkv::Error naming the
// file and the field.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::models {

// The roles some tokens play; a role a tokenizer has no token for is empty.
struct SpecialTokens {
  std::optional<int64_t> bos, eos, unk, pad, cls, sep, mask;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // The ids of `text` (any bytes; UTF-8 expected). With `add_special_tokens`, what the model's
  // post-processor adds around a sequence: BERT's [CLS] ... [SEP], Llama's <s> / <|begin_of_text|>.
  // Special tokens written in the text are recognised as such.
  virtual std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = true) const = 0;
  // The text of `ids`. Byte-level tokenizers give back the exact bytes: decode(encode(t, false))
  // == t for every t (normalizing tokenizers: for every t already normal). Throws qkv::Error
  // for an id outside [0, vocab_size()).
  virtual std::string decode(std::span<const int64_t> ids, bool skip_special_tokens = false) const = 0;

  // Ids run over [0, vocab_size()), added tokens included.
  virtual int64_t vocab_size() const = 0;
  // The id of a token as the vocabulary spells it ("Ġthe", "##ing", "▁the", "[CLS]").
  virtual std::optional<int64_t> token_to_id(std::string_view token) const = 0;
  // The vocabulary's spelling of `id`; qkv::Error outside [0, vocab_size()).
  virtual std::string id_to_token(int64_t id) const = 0;
  // Whether `id` is a special token (control tokens: <s>, [CLS], ...); false outside the vocabulary.
  virtual bool is_special(int64_t id) const = 0;
  const SpecialTokens& special_tokens() const { return roles_; }

 protected:
  SpecialTokens roles_;
};

// A tokenizer.json's text; `source` names it in errors. `config_json`, when not empty, is the
// folder's tokenizer_config.json, whose bos_token, eos_token, ... name the special tokens' roles
// (without it, roles come from the well-known spellings: <s>, </s>, <|endoftext|>, [CLS], ...).
std::unique_ptr<Tokenizer> tokenizer_from_json(std::string_view json, const std::string& source,
                                               std::string_view config_json = {});
// A SentencePiece model file (tokenizer.model).
std::unique_ptr<Tokenizer> tokenizer_from_sentencepiece(const std::filesystem::path& model_file);
// Whether this qkv was built with libsentencepiece (tokenizer.model support).
bool has_sentencepiece();
// A model folder's tokenizer: tokenizer.json when present, else tokenizer.model; with the
// folder's tokenizer_config.json for the special tokens' roles when it has one.
std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& folder);

}  // namespace qkv::models
