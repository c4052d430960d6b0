// Checked access to the fields of tokenizer.json objects.
#include "models/json_parse.hpp"
#include "models/tokenizer_parts.hpp"
#include "qkv/error.hpp"

namespace qkv::models::detail {

void bad_field(const std::string& where, const std::string& what) { throw Error(where + ": " + what); }

const Json& required(const Json& object, const char* key, const std::string& where) {
  if (!object.is_object()) bad_field(where, std::string("expected an object, found ") + object.type_name());
  const auto it = object.find(key);
  if (it == object.end()) bad_field(where, std::string("no '") + key + "'");
  return *it;
}

std::string string_or(const Json& object, const char* key, const std::string& fallback, const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_string()) bad_field(where + "." + key, std::string("expected a string, found ") + brief(*it));
  return it->get<std::string>();
}

bool bool_or(const Json& object, const char* key, bool fallback, const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) bad_field(where + "." + key, std::string("expected true or false, found ") + brief(*it));
  return it->get<bool>();
}

std::optional<int64_t> Vocabulary::find(std::string_view token) const {
  const auto it = ids.find(token);
  if (it == ids.end()) return std::nullopt;
  return it->second;
}

}  // namespace qkv::models::detail
