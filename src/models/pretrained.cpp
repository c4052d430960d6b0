// load_pretrained: a model folder's parts, in the order their checks need them.
#include "qkv/models/pretrained.hpp"

#include <system_error>
#include <utility>

#include "qkv/models/model_folder.hpp"

namespace qkv::models {

Pretrained load_pretrained(const std::filesystem::path& folder, const PretrainedOptions& options) {
  ModelFolder parts = open_model_folder(folder, {.tokenizer = options.require_tokenizer});
  ModelConfig config = parse_config(parts.config_json, (folder / "config.json").string());
  auto weights = std::make_shared<const SafetensorsWeights>(std::move(parts.weights));
  Model model(config, weights, options.model);
  return Pretrained{folder, std::move(config), std::move(weights), std::move(parts.tokenizer), std::move(model)};
}

bool is_model_folder(const std::filesystem::path& path) {
  std::error_code error;
  return std::filesystem::is_directory(path, error) && std::filesystem::is_regular_file(path / "config.json", error);
}

}  // namespace qkv::models
