// The qkv tool on Hugging Face model folders (qkv::models::load_pretrained): generate, viz and
// heads with --model DIR. The commands' own files (generate.cpp, viz.cpp) hand a folder here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "qkv/models/head_roles.hpp"
#include "qkv/models/pretrained.hpp"

namespace qkv::cli {

// `qkv generate --model DIR "prompt"`: streams the text as it is generated, then prints prefill
// and decode tokens/s.
struct PretrainedGenerateOptions {
  std::string folder;
  std::vector<std::string> prompts;  // several: generated together (Model::generate_batch)
  int64_t max_tokens = 32;
  std::string kv_dtype = "bf16";
  float temperature = 0;  // 0: greedy
  int64_t top_k = 0;
  float top_p = 1;
  uint64_t seed = 0;
  bool ignore_eos = false;
};
void run_pretrained_generate(const PretrainedGenerateOptions& options);

// `qkv viz --model DIR "text" [--layer L]`: the model's heads of one layer on its tokens.
struct PretrainedVizOptions {
  std::string folder;
  std::string text;
  int64_t layer = -1;  // -1: the layer whose heads have the most named roles (qkv heads)
  std::string output;
};
void run_pretrained_viz(const PretrainedVizOptions& options);

// Whether `s` is whole UTF-8 (no stray continuation byte, no cut sequence).
bool is_utf8(const std::string& s);

// The labels of tokens for figures: each token's own text (" the" shown as "_the"), or its
// vocabulary spelling when it is not whole UTF-8 on its own.
std::vector<std::string> token_labels(const models::Tokenizer& tokenizer, const std::vector<int64_t>& ids);

// Every head's role scores on `ids` and on a random sequence of `repeat_length` tokens repeated
// (models::measure_head_roles), each cut to fit the model's positions.
std::vector<models::HeadRoleScores> measure_roles(const models::Pretrained& model, const std::vector<int64_t>& ids,
                                                  int64_t repeat_length = 24, uint64_t seed = 0);

// The ids of `text` for `model`; qkv::Error when the folder has no tokenizer or the text no tokens.
std::vector<int64_t> encode_text(const models::Pretrained& model, const std::string& text);

}  // namespace qkv::cli
