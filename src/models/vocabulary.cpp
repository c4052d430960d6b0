// Reading a model's vocabulary ({"token": id, ...}) and the id bound every tokenizer keeps.
#include "models/vocabulary.hpp"

#include "qkv/error.hpp"

namespace qkv::models::detail {

void add_token(Vocabulary& vocabulary, const std::string& token, int64_t id, const std::string& where) {
  if (id < 0 || id >= kMaxTokenId)
    bad_field(where, "token '" + token + "' has id " + std::to_string(id) + ", outside [0, " +
                         std::to_string(kMaxTokenId) + ")");
  const size_t at = static_cast<size_t>(id);
  // Ids must be dense enough for a table by id: no more than kMaxIdGap past the count so far.
  if (at > vocabulary.ids.size() + kMaxIdGap)
    bad_field(where, "token '" + token + "' has id " + std::to_string(id) + ", far past the " +
                         std::to_string(vocabulary.ids.size()) + " tokens seen so far (ids must be dense)");
  if (at >= vocabulary.tokens.size()) vocabulary.tokens.resize(at + 1);
  if (const auto known = vocabulary.ids.find(token); known != vocabulary.ids.end() && known->second != id)
    bad_field(where, "token '" + token + "' has two ids, " + std::to_string(known->second) + " and " +
                         std::to_string(id));
  if (!vocabulary.tokens[at].empty() && vocabulary.tokens[at] != token)
    bad_field(where, "id " + std::to_string(id) + " is both '" + vocabulary.tokens[at] + "' and '" + token + "'");
  if (token.empty()) bad_field(where, "id " + std::to_string(id) + " is the empty token");
  vocabulary.tokens[at] = token;
  vocabulary.ids[token] = id;
}

Vocabulary read_vocabulary(const Json& spec, const std::string& where) {
  if (!spec.is_object()) bad_field(where, std::string("expected an object of token: id, found ") + spec.type_name());
  Vocabulary vocabulary;
  // Dense ids in any order: sort them first so that the gap rule sees them rising.
  std::vector<std::pair<int64_t, std::string>> entries;
  for (const auto& [token, id] : spec.items()) {
    if (!id.is_number_integer()) bad_field(where, "token '" + token + "': the id must be an integer, found " + brief(id));
    const int64_t value = id.is_number_unsigned() && id.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
                              ? -1 : id.get<int64_t>();
    entries.emplace_back(value, token);
  }
  std::sort(entries.begin(), entries.end());
  for (const auto& [id, token] : entries) add_token(vocabulary, token, id, where);
  return vocabulary;
}

}  // namespace qkv::models::detail
