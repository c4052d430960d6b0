#include "models/json_parse.hpp"

#include "qkv/error.hpp"

namespace qkv::models::detail {
namespace {

struct TooDeep {};

}  // namespace

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
