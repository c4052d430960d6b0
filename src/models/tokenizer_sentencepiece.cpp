// tokenizer.model: a SentencePiece model, through libsentencepiece (QKV_HAVE_SENTENCEPIECE);
// without it, loading one is an error that says so.
#include <climits>

#include "models/file_access.hpp"
#include "qkv/error.hpp"
#include "qkv/models/tokenizer.hpp"

#ifdef QKV_HAVE_SENTENCEPIECE
#include <sentencepiece_processor.h>
#endif

namespace qkv::models {

#ifdef QKV_HAVE_SENTENCEPIECE
namespace {

// A model file is a few megabytes; the bound keeps a wrong file from being read whole.
constexpr size_t kMaxModelBytes = size_t{256} << 20;

std::optional<int64_t> id_or_none(int id) { return id < 0 ? std::nullopt : std::optional<int64_t>(id); }

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::filesystem::path& file) {
    const std::string bytes = detail::read_text_file(file, kMaxModelBytes, "SentencePiece model");
    const auto status = processor_.LoadFromSerializedProto(bytes);
    if (!status.ok()) throw Error(detail::quoted(file) + ": not a SentencePiece model: " + status.ToString());
    roles_.bos = id_or_none(processor_.bos_id());
    roles_.eos = id_or_none(processor_.eos_id());
    roles_.unk = id_or_none(processor_.unk_id());
    roles_.pad = id_or_none(processor_.pad_id());
  }

  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int> pieces;
    if (text.size() > static_cast<size_t>(INT_MAX)) throw Error("SentencePiece encodes at most 2 GiB of text at once");
    const auto status = processor_.Encode(std::string(text), &pieces);
    if (!status.ok()) throw Error("SentencePiece could not encode the text: " + status.ToString());
    std::vector<int64_t> ids;
    // Llama's tokenizers start a sequence with <s>, as their Hugging Face post-processor does.
    if (add_special_tokens && roles_.bos) ids.push_back(*roles_.bos);
    ids.insert(ids.end(), pieces.begin(), pieces.end());
    return ids;
  }

  std::string decode(std::span<const int64_t> ids, bool skip_special_tokens) const override {
    std::vector<int> pieces;
    for (const int64_t id : ids) {
      check(id);
      if (skip_special_tokens && is_special(id)) continue;
      pieces.push_back(static_cast<int>(id));
    }
    std::string text;
    const auto status = processor_.Decode(pieces, &text);
    if (!status.ok()) throw Error("SentencePiece could not decode the ids: " + status.ToString());
    return text;
  }

  int64_t vocab_size() const override { return processor_.GetPieceSize(); }
  std::optional<int64_t> token_to_id(std::string_view token) const override {
    const int id = processor_.PieceToId(std::string(token));
    // PieceToId answers unk_id for a piece it does not know.
    if (id < 0 || (id == processor_.unk_id() && processor_.IdToPiece(id) != token)) return std::nullopt;
    return id;
  }
  std::string id_to_token(int64_t id) const override {
    check(id);
    return processor_.IdToPiece(static_cast<int>(id));
  }
  bool is_special(int64_t id) const override {
    if (id < 0 || id >= vocab_size()) return false;
    return processor_.IsControl(static_cast<int>(id)) || processor_.IsUnknown(static_cast<int>(id));
  }

 private:
  void check(int64_t id) const {
    if (id < 0 || id >= vocab_size())
      throw Error("token id " + std::to_string(id) + " is outside the vocabulary [0, " + std::to_string(vocab_size()) + ")");
  }

  sentencepiece::SentencePieceProcessor processor_;
};

}  // namespace

bool has_sentencepiece() { return true; }

std::unique_ptr<Tokenizer> tokenizer_from_sentencepiece(const std::filesystem::path& model_file) {
  return std::make_unique<SentencePieceTokenizer>(model_file);
}

#else

bool has_sentencepiece() { return false; }

std::unique_ptr<Tokenizer> tokenizer_from_sentencepiece(const std::filesystem::path& model_file) {
  throw Error(detail::quoted(model_file) +
              ": this qkv was built without libsentencepiece, so it cannot read SentencePiece models "
              "(install libsentencepiece-dev and rebuild, or give the folder a tokenizer.json)");
}

#endif

}  // namespace qkv::models
