#include "models/json_parse.hpp"

#include "qkv/error.hpp"

namespace qkv::models::detail {
namespace {

struct TooDeep {};

}  // namespace

std::string brief(const nlohmann::json& value) {
  constexpr size_t kMost = 80;
  std::string text = value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > kMost) text = text.substr(0, kMost) + "...";
  return text;
}

nlohmann::json parse_json(std::string_view text, const std::string& source) {
  try {
    return nlohmann::json::parse(text.begin(), text.end(), [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
      if (depth > kMaxJsonDepth) throw TooDeep{};
      return true;
    });
  } catch (const TooDeep&) {
    throw Error(source + ": the JSON nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  } catch (const nlohmann::json::exception& e) {
    throw Error(source + ": not valid JSON: " + e.what());
  }
}

}  // namespace qkv::models::detail
