#include "qkv/models/model_folder.hpp"

#include <system_error>

#include "models/file_access.hpp"
#include "models/json_parse.hpp"
#include "qkv/error.hpp"

namespace qkv::models {
namespace {

constexpr size_t kMaxConfigBytes = size_t{16} << 20;
constexpr size_t kMaxTokenizerJsonBytes = size_t{128} << 20;

bool present(const std::filesystem::path& path) {
  std::error_code error;
  return std::filesystem::exists(path, error);
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& folder) {
  const std::filesystem::path json = folder / "tokenizer.json", model = folder / "tokenizer.model",
                              config = folder / "tokenizer_config.json";
  if (present(json)) {
    const std::string text = detail::read_text_file(json, kMaxTokenizerJsonBytes, "tokenizer");
    const std::string config_text = present(config) ? detail::read_text_file(config, kMaxConfigBytes, "tokenizer config") : "";
    return tokenizer_from_json(text, detail::quoted(json), config_text);
  }
  if (present(model)) return tokenizer_from_sentencepiece(model);
  throw Error(detail::quoted(folder) + ": no tokenizer: looked for tokenizer.json and tokenizer.model");
}

ModelFolder open_model_folder(const std::filesystem::path& folder, const ModelFolderOptions& options) {
  std::error_code error;
  if (!std::filesystem::is_directory(folder, error))
    throw Error(detail::quoted(folder) + ": not a model folder (no such folder)");
  const std::filesystem::path config = folder / "config.json";
  if (!present(config)) throw Error(detail::quoted(folder) + ": no config.json in the model folder");
  std::string config_json = detail::read_text_file(config, kMaxConfigBytes, "model config");
  if (!detail::parse_json(config_json, detail::quoted(config)).is_object())
    throw Error(detail::quoted(config) + ": expected a JSON object of the model's settings");
  SafetensorsWeights weights = SafetensorsWeights::open_folder(folder);
  std::unique_ptr<Tokenizer> tokenizer = options.tokenizer ? load_tokenizer(folder) : nullptr;
  return ModelFolder{folder, std::move(config_json), std::move(weights), std::move(tokenizer)};
}

}  // namespace qkv::models
