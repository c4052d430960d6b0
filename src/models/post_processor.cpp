// tokenizer.json post-processors, for a single sequence: TemplateProcessing ("single": special
// tokens around $A), BertProcessing and RobertaProcessing ([CLS] ... [SEP]), ByteLevel (adds
// nothing) and Sequence of them.
#include "models/json_parse.hpp"
#include "models/tokenizer_parts.hpp"

namespace qkv::models::detail {
namespace {

// A ["token", id] pair of BertProcessing; the id must be the token's.
int64_t token_pair(const Json& spec, const char* key, const std::string& where,
                   const std::function<std::optional<int64_t>(const std::string&)>& find) {
  const Json& pair = required(spec, key, where);
  if (!pair.is_array() || pair.size() != 2 || !pair[0].is_string() || !pair[1].is_number_integer())
    bad_field(where + "." + key, "expected [\"token\", id], found " + brief(pair));
  const std::string token = pair[0].get<std::string>();
  const std::optional<int64_t> id = find(token);
  if (!id || *id != pair[1].get<int64_t>())
    bad_field(where + "." + key, "'" + token + "' is not token " + brief(pair[1]) + " of the vocabulary");
  return *id;
}

// The ids of a template's special-token item, from the template's special_tokens map.
std::vector<int64_t> template_special(const Json& spec, const std::string& name, const std::string& where,
                                      const std::function<std::optional<int64_t>(const std::string&)>& find) {
  const auto specials = spec.find("special_tokens");
  if (specials != spec.end() && specials->is_object() && specials->contains(name)) {
    const Json& entry = (*specials)[name];
    const Json& ids = required(entry, "ids", where + ".special_tokens." + name);
    if (!ids.is_array()) bad_field(where + ".special_tokens." + name + ".ids", "expected a list of ids");
    std::vector<int64_t> out;
    for (const Json& id : ids) {
      if (!id.is_number_integer()) bad_field(where + ".special_tokens." + name + ".ids", "expected ids, found " + brief(id));
      out.push_back(id.get<int64_t>());
    }
    return out;
  }
  if (const auto id = find(name)) return {*id};
  bad_field(where, "the template's special token '" + name + "' is not in the vocabulary");
}

PostProcessor template_processing(const Json& spec, const std::string& where,
                                  const std::function<std::optional<int64_t>(const std::string&)>& find) {
  const Json& single = required(spec, "single", where);
  if (!single.is_array()) bad_field(where + ".single", "expected a list of template items");
  PostProcessor result;
  bool seen_sequence = false;
  for (const Json& item : single) {
    if (item.is_object() && item.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    if (!item.is_object() || !item.contains("SpecialToken") || !item["SpecialToken"].is_object())
      bad_field(where + ".single", "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}, found " + brief(item));
    const std::string name = string_or(item["SpecialToken"], "id", "", where + ".single");
    const std::vector<int64_t> ids = template_special(spec, name, where, find);
    auto& side = seen_sequence ? result.suffix : result.prefix;
    side.insert(side.end(), ids.begin(), ids.end());
  }
  if (!seen_sequence) bad_field(where + ".single", "the template has no $A sequence");
  return result;
}

}  // namespace

PostProcessor make_post_processor(const Json& spec, const std::string& where,
                                  const std::function<std::optional<int64_t>(const std::string&)>& find) {
  if (spec.is_null()) return {};
  const std::string type = string_or(spec, "type", "", where);
  if (type == "ByteLevel") return {};
  if (type == "TemplateProcessing") return template_processing(spec, where, find);
  if (type == "BertProcessing" || type == "RobertaProcessing")
    return {{token_pair(spec, "cls", where, find)}, {token_pair(spec, "sep", where, find)}};
  if (type == "Sequence") {
    const Json& list = required(spec, "processors", where);
    if (!list.is_array()) bad_field(where + ".processors", "expected a list");
    PostProcessor result;
    for (size_t i = 0; i < list.size(); ++i) {
      const PostProcessor step = make_post_processor(list[i], where + ".processors[" + std::to_string(i) + "]", find);
      // Each step wraps what the previous ones made.
      result.prefix.insert(result.prefix.begin(), step.prefix.begin(), step.prefix.end());
      result.suffix.insert(result.suffix.end(), step.suffix.begin(), step.suffix.end());
    }
    return result;
  }
  bad_field(where, "qkv does not support the post-processor type '" + type + "'");
}

}  // namespace qkv::models::detail
