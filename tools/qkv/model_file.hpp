// How the CLI's commands (train --resume, generate, viz) load a .qkv file: the library's
// AttentionModel::load, and on stderr the warning the file deserves (a version 1 file carries no
// checksum), so that a model whose damage cannot be detected never loads silently.
#pragma once

#include <string>

#include "qkv/train.hpp"

namespace qkv::cli {

train::AttentionModel load_model(const std::string& path, train::Checkpoint* checkpoint = nullptr);

}  // namespace qkv::cli
