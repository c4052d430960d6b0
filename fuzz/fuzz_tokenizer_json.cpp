// libFuzzer target: tokenizer.json (qkv::models::tokenizer_from_json) and the tokenizer it
// makes. The input is a tokenizer.json, a 0 byte, then a text to encode. Loading must give a
// tokenizer or a qkv::Error; a loaded tokenizer must encode any text, and decode what it
// encoded without an error.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string_view>

#include "qkv/error.hpp"
#include "qkv/models/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find('\0');
  const std::string_view json = input.substr(0, split);
  const std::string_view text = split == std::string_view::npos ? std::string_view() : input.substr(split + 1);
  std::unique_ptr<qkv::models::Tokenizer> tokenizer;
  try {
    tokenizer = qkv::models::tokenizer_from_json(json, "fuzz tokenizer.json");
  } catch (const qkv::Error&) {
    return 0;
  }
  try {
    for (const bool specials : {false, true}) {
      const std::vector<int64_t> ids = tokenizer->encode(text, specials);
      (void)tokenizer->decode(ids, false);
      (void)tokenizer->decode(ids, true);
      for (const int64_t id : ids) (void)tokenizer->id_to_token(id);
    }
  } catch (const qkv::Error& e) {
    // Encoding and decoding what was encoded have no bad input to report.
    std::fprintf(stderr, "unexpected qkv::Error: %s\n", e.what());
    __builtin_trap();
  }
  return 0;
}
