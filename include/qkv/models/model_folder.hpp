// A model folder as Hugging Face writes it (save_pretrained, or a hub snapshot):
//   config.json                                       the architecture's settings
//   model.safetensors | model.safetensors.index.json + shards    the weights
//   tokenizer.json | tokenizer.model (+ tokenizer_config.json)   the tokenizer
// open_model_folder finds and checks each part; a missing one is a qkv::Error naming the folder
// and the files looked for.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "qkv/models/safetensors.hpp"
#include "qkv/models/tokenizer.hpp"

namespace qkv::models {

struct ModelFolderOptions {
  bool tokenizer = true;  // false: weights and config only (benchmarks, folders without one)
};

struct ModelFolder {
  std::filesystem::path path;
  std::string config_json;                // config.json's text, checked to be a JSON object
  SafetensorsWeights weights;
  std::unique_ptr<Tokenizer> tokenizer;   // null when not asked for
};

ModelFolder open_model_folder(const std::filesystem::path& folder, const ModelFolderOptions& options = {});

}  // namespace qkv::models
