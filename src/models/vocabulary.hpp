// A tokenizer's vocabulary read from tokenizer.json, with the bounds every id keeps: ids are
// unique, non-negative and dense (a table by id cannot be made huge by one large id).
#pragma once

#include <algorithm>

#include "models/tokenizer_parts.hpp"

namespace qkv::models::detail {

constexpr int64_t kMaxTokenId = int64_t{1} << 24;
constexpr size_t kMaxIdGap = 1 << 16;

// Adds `token` with `id`; a token with two ids, an id with two tokens, an empty token or an id
// out of bounds is an error.
void add_token(Vocabulary& vocabulary, const std::string& token, int64_t id, const std::string& where);
// A {"token": id} object.
Vocabulary read_vocabulary(const Json& spec, const std::string& where);

}  // namespace qkv::models::detail
