// The CLI's model loading (model_file.hpp).
#include "model_file.hpp"

#include <cstdio>

#include <fmt/core.h>

namespace qkv::cli {

train::AttentionModel load_model(const std::string& path, train::Checkpoint* checkpoint) {
  train::AttentionModel model = train::AttentionModel::load(path, checkpoint);
  if (const std::string warning = model.file_warning(); !warning.empty()) {
    fmt::print(stderr, "qkv: warning: {}: {}\n", path, warning);
    std::fflush(stderr);
  }
  return model;
}

}  // namespace qkv::cli
