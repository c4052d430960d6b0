// JSON as the model loaders parse it: nlohmann-json, nesting bounded (no file qkv reads nests
// deeper than a few levels, and printing or walking a deeper one would recurse without bound).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace qkv::models::detail {

constexpr int kMaxJsonDepth = 64;

// A JSON value as an error message quotes it: its text, cut to 80 characters.
std::string brief(const nlohmann::json& value);

// Throws qkv::Error "<source>: not valid JSON: ..." or "... nested deeper than 64 levels".
nlohmann::json parse_json(std::string_view text, const std::string& source);

}  // namespace qkv::models::detail
