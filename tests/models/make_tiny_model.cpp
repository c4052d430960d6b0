// qkv_make_tiny_model FOLDER gpt2|llama|bert|gpt2-induction [f32|bf16]: writes a tiny random-weight
// model folder in the Hugging Face layout (config.json, model.safetensors, tokenizer.json) for the
// CLI and Python tests, so they run the real loading path on files nothing committed. The weights
// are the architecture tests' random checkpoints (checkpoint.hpp), or for gpt2-induction a GPT-2
// set by hand with a previous-token and an induction head (induction_model.hpp); the tokenizers
// are a byte-level BPE (256 bytes, a few merges, <|endoftext|>) and a small WordPiece ([CLS] ...
// [SEP]).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint.hpp"
#include "induction_model.hpp"
#include "models/byte_level.hpp"
#include "qkv/error.hpp"
#include "qkv/models/safetensors.hpp"

namespace qkv::models::testing {
namespace {

using Json = nlohmann::ordered_json;

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) throw Error("cannot write " + path.string());
}

// Byte b is token b; each merge's result the next id; <|endoftext|> last. Returns the vocab size.
int64_t write_byte_level(const std::filesystem::path& path) {
  const std::vector<std::pair<std::string, std::string>> merges = {{"Ġ", "t"}, {"h", "e"}, {"Ġt", "he"}, {"a", "t"}};
  Json vocab = Json::object();
  int64_t next = 0;
  for (int b = 0; b < 256; ++b) vocab[detail::to_byte_level(std::string(1, static_cast<char>(b)))] = next++;
  Json merge_list = Json::array();
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = next++;
    merge_list.push_back(a + " " + b);
  }
  const Json added = Json::array({{{"id", next}, {"content", "<|endoftext|>"}, {"single_word", false},
                                   {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}}});
  const Json level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  const Json tokenizer = {{"version", "1.0"},   {"added_tokens", added}, {"normalizer", nullptr},
                          {"pre_tokenizer", level}, {"post_processor", nullptr}, {"decoder", level},
                          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}}};
  write_text(path, tokenizer.dump());
  return next + 1;
}

int64_t write_wordpiece(const std::filesystem::path& path) {
  const std::vector<std::string> tokens = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on",
                                           "mat",   "a",     "dog",   "##s",   ".",      ",",   "it",  "was"};
  Json vocab = Json::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab[tokens[i]] = static_cast<int64_t>(i);
  Json added = Json::array();
  for (int64_t id = 0; id < 5; ++id)
    added.push_back({{"id", id}, {"content", tokens[static_cast<size_t>(id)]}, {"single_word", false},
                     {"lstrip", false}, {"rstrip", false}, {"normalized", false}, {"special", true}});
  const Json tokenizer = {
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", {{"type", "BertNormalizer"}, {"clean_text", true}, {"handle_chinese_chars", true},
                      {"strip_accents", nullptr}, {"lowercase", true}}},
      {"pre_tokenizer", {{"type", "BertPreTokenizer"}}},
      {"post_processor", {{"type", "BertProcessing"}, {"sep", {"[SEP]", 3}}, {"cls", {"[CLS]", 2}}}},
      {"decoder", {{"type", "WordPiece"}, {"prefix", "##"}, {"cleanup", true}}},
      {"model", {{"type", "WordPiece"}, {"unk_token", "[UNK]"}, {"continuing_subword_prefix", "##"},
                 {"max_input_chars_per_word", 100}, {"vocab", vocab}}}};
  write_text(path, tokenizer.dump());
  return static_cast<int64_t>(tokens.size());
}

std::string config_json(const std::string& arch, int64_t vocab) {
  if (arch == "gpt2-induction") return induction_config_json(vocab);
  const std::string v = std::to_string(vocab), eos = std::to_string(vocab - 1);
  if (arch == "gpt2")
    return R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": )" + v +
           R"(, "n_embd": 48, "n_layer": 2, "n_head": 4, "n_positions": 128, "layer_norm_epsilon": 1e-5,
      "activation_function": "gelu_new", "tie_word_embeddings": true, "eos_token_id": )" + eos +
           ", \"bos_token_id\": " + eos + "}";
  if (arch == "llama")
    return R"({"architectures": ["LlamaForCausalLM"], "vocab_size": )" + v +
           R"(, "hidden_size": 40, "intermediate_size": 72, "num_hidden_layers": 3, "num_attention_heads": 4,
      "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
      "hidden_act": "silu", "tie_word_embeddings": false, "eos_token_id": )" + eos + "}";
  return R"({"architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": )" + v +
         R"(, "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 3, "intermediate_size": 80,
      "hidden_act": "gelu", "max_position_embeddings": 64, "type_vocab_size": 2, "layer_norm_eps": 1e-12})";
}

void write_model(const std::filesystem::path& folder, const std::string& arch, DType dtype) {
  std::filesystem::create_directories(folder);
  const int64_t vocab = arch == "bert" ? write_wordpiece(folder / "tokenizer.json")
                                       : write_byte_level(folder / "tokenizer.json");
  const std::string config = config_json(arch, vocab);
  write_text(folder / "config.json", config);
  const ModelConfig c = parse_config(config);
  const Checkpoint checkpoint = arch == "gpt2-induction" ? induction_checkpoint(c)
                                : arch == "gpt2"         ? gpt2_checkpoint(c, dtype, 7)
                                : arch == "bert"         ? bert_checkpoint(c, dtype, 7)
                                                         : llama_checkpoint(c, dtype, 7);
  std::vector<SafetensorsTensor> tensors;
  for (const auto& [name, values] : checkpoint.values) {
    const WeightView* view = checkpoint.weights->find(name);
    int64_t count = 1;
    for (int64_t d : view->shape) count *= d;
    const auto* bytes = static_cast<const uint8_t*>(view->data);
    tensors.push_back({name, std::string(safetensors_dtype(view->dtype)), view->shape,
                       std::span<const uint8_t>(bytes, static_cast<size_t>(count) * element_size(view->dtype))});
  }
  write_safetensors(folder / "model.safetensors", tensors);
}

}  // namespace
}  // namespace qkv::models::testing

int main(int argc, char** argv) {
  const std::string arch = argc >= 3 ? argv[2] : "";
  const std::string dtype = argc >= 4 ? argv[3] : "f32";
  if (argc < 3 || (arch != "gpt2" && arch != "llama" && arch != "bert" && arch != "gpt2-induction") ||
      (dtype != "f32" && dtype != "bf16")) {
    std::fprintf(stderr, "usage: qkv_make_tiny_model FOLDER gpt2|llama|bert|gpt2-induction [f32|bf16]\n");
    return 2;
  }
  try {
    qkv::models::testing::write_model(argv[1], arch, dtype == "bf16" ? qkv::DType::BF16 : qkv::DType::F32);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkv_make_tiny_model: %s\n", e.what());
    return 1;
  }
  std::printf("wrote a tiny %s model (%s) to %s\n", arch.c_str(), dtype.c_str(), argv[1]);
  return 0;
}
