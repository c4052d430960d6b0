// Writes the seed corpora of the model-folder fuzzers (committed in fuzz/corpus/; rerun to
// regenerate):
//   fuzz_make_model_seeds <dir>  ->  <dir>/fuzz_safetensors/{dtypes,index}.seed
//                                    <dir>/fuzz_tokenizer_json/{gpt2,llama3,llama2,bert}.seed
// Safetensors seeds start with fuzz_safetensors.cpp's mode byte (0: a file, 1: an index);
// tokenizer seeds are a tokenizer.json, a 0 byte and a text. Each is the smallest of its kind.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/byte_level.hpp"
#include "qkv/models/safetensors.hpp"

namespace {

using Json = nlohmann::ordered_json;

void write(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

Json special(int64_t id, const std::string& content) {
  return {{"id", id}, {"content", content}, {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}};
}

// Byte-level BPE with a few merges and one special token after them; `pre_tokenizer` as given.
Json byte_level(const Json& pre_tokenizer, const Json& post_processor) {
  Json vocab = Json::object();
  for (int b = 0; b < 256; ++b) vocab[qkv::models::detail::to_byte_level(std::string(1, static_cast<char>(b)))] = b;
  vocab["Ġt"] = 256;
  vocab["he"] = 257;
  vocab["Ġthe"] = 258;
  return {{"added_tokens", {special(259, "<|endoftext|>")}},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre_tokenizer},
          {"post_processor", post_processor},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model", {{"type", "BPE"}, {"ignore_merges", false}, {"vocab", vocab}, {"merges", {"Ġ t", {"h", "e"}, "Ġt he"}}}}};
}

Json llama2() {
  Json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  vocab["▁"] = 259;
  vocab["h"] = 260;
  vocab["▁h"] = 261;
  return {{"added_tokens", {special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")}},
          {"normalizer", {{"type", "Sequence"}, {"normalizers", {{{"type", "Prepend"}, {"prepend", "▁"}},
                                                                  {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "▁"}}}}}},
          {"pre_tokenizer", nullptr},
          {"post_processor", {{"type", "TemplateProcessing"},
                              {"single", {{{"SpecialToken", {{"id", "<s>"}}}}, {{"Sequence", {{"id", "A"}}}}}},
                              {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
          {"decoder", {{"type", "Sequence"}, {"decoders", {{{"type", "Replace"}, {"pattern", {{"String", "▁"}}}, {"content", " "}},
                                                          {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                                          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
          {"model", {{"type", "BPE"}, {"unk_token", "<unk>"}, {"fuse_unk", true}, {"byte_fallback", true},
                     {"vocab", vocab}, {"merges", {"▁ h"}}}}};
}

Json bert() {
  return {{"added_tokens", {special(0, "[UNK]"), special(1, "[CLS]"), special(2, "[SEP]")}},
          {"normalizer", {{"type", "BertNormalizer"}, {"lowercase", true}}},
          {"pre_tokenizer", {{"type", "BertPreTokenizer"}}},
          {"post_processor", {{"type", "BertProcessing"}, {"sep", {"[SEP]", 2}}, {"cls", {"[CLS]", 1}}}},
          {"decoder", {{"type", "WordPiece"}, {"prefix", "##"}}},
          {"model", {{"type", "WordPiece"}, {"unk_token", "[UNK]"}, {"max_input_chars_per_word", 100},
                     {"vocab", {{"[UNK]", 0}, {"[CLS]", 1}, {"[SEP]", 2}, {"un", 3}, {"##aff", 4}, {"!", 5}}}}}};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path root(argv[1]);
  const std::filesystem::path safetensors = root / "fuzz_safetensors", tokenizers = root / "fuzz_tokenizer_json";
  std::filesystem::create_directories(safetensors);
  std::filesystem::create_directories(tokenizers);

  const std::vector<uint8_t> f32(8, 1), bf16(4, 2), f16(2, 3), i64(8, 4);
  const std::vector<qkv::models::SafetensorsTensor> tensors = {
      {"a", "F32", {2}, f32}, {"b", "BF16", {1, 2}, bf16}, {"c", "F16", {}, f16}, {"d", "I64", {1}, i64}};
  const std::filesystem::path scratch = root / "scratch.safetensors";
  qkv::models::write_safetensors(scratch, tensors);
  write(safetensors / "dtypes.seed", std::string(1, '\0') + read(scratch));
  std::filesystem::remove(scratch);
  write(safetensors / "index.seed", std::string(1, '\1') + R"({"metadata": {}, "weight_map": {"a": "shard.safetensors"}})");

  const char* llama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  const std::string text = std::string(1, '\0') + "Hello, the world's 1234 <|endoftext|> 日本 🙂 unaff!\n";
  write(tokenizers / "gpt2.seed", byte_level({{"type", "ByteLevel"}, {"add_prefix_space", false}}, nullptr).dump() + text);
  write(tokenizers / "llama3.seed",
        byte_level({{"type", "Sequence"},
                    {"pretokenizers", {{{"type", "Split"}, {"pattern", {{"Regex", llama3}}}, {"behavior", "Isolated"}},
                                       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}},
                   {{"type", "ByteLevel"}})
                .dump() +
            text);
  write(tokenizers / "llama2.seed", llama2().dump() + text);
  write(tokenizers / "bert.seed", bert().dump() + text);
  return 0;
}
