// qkv::models::Pretrained: a Hugging Face model folder opened whole - its config, its weights
// (memory-mapped, used in place in their stored dtype), its tokenizer and the Model that runs on
// them - in one call. The front ends (qkv generate/viz/heads/serve --model DIR, Python's
// qkv.load_model) start here.
#pragma once

#include <filesystem>
#include <memory>

#include "qkv/models/config.hpp"
#include "qkv/models/model.hpp"
#include "qkv/models/safetensors.hpp"
#include "qkv/models/tokenizer.hpp"

namespace qkv::models {

struct Pretrained {
  std::filesystem::path path;
  ModelConfig config;
  std::shared_ptr<const SafetensorsWeights> weights;  // shared with `model`, which reads them in place
  std::unique_ptr<Tokenizer> tokenizer;               // null when the folder has none and none was required
  Model model;
};

struct PretrainedOptions {
  ModelOptions model;           // the KV cache's dtype of generate()
  bool require_tokenizer = true;
};

// Opens `folder` (open_model_folder: config.json, model.safetensors or its shards, tokenizer.json
// or tokenizer.model), parses and checks the config, and builds the model, which checks every
// weight against it. Every fault is a qkv::Error naming the folder, file and tensor.
Pretrained load_pretrained(const std::filesystem::path& folder, const PretrainedOptions& options = {});

// Whether `path` is a directory holding a config.json: how the front ends tell a Hugging Face
// folder from a .qkv file.
bool is_model_folder(const std::filesystem::path& path);

}  // namespace qkv::models
