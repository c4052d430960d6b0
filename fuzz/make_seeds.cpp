// Writes the fuzzers' seed corpora (committed in fuzz/corpus/; rerun to regenerate):
//   fuzz_make_seeds <dir>  ->  <dir>/fuzz_model_load/{model,checkpoint,version1,version2,
//                                                    linear,sparse_rotary}.seed
//                              <dir>/fuzz_attention/seed-<n> (fixed pseudo-random bytes)
// Model seeds start with the mode byte of fuzz_model_load.cpp (0: reseal the checksum) and are
// the smallest models the format allows, so mutations stay cheap.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "qkv/train.hpp"

namespace {

std::vector<char> read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write(const std::filesystem::path& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <corpus dir>\n", argv[0]);
    return 2;
  }
  const std::filesystem::path root(argv[1]);
  const std::filesystem::path models = root / "fuzz_model_load", attention = root / "fuzz_attention";
  std::filesystem::create_directories(models);
  std::filesystem::create_directories(attention);

  const qkv::train::ModelConfig config{.vocab_size = 3, .max_len = 2, .d_model = 2, .num_heads = 1, .num_layers = 1};
  const qkv::train::AttentionModel model(config, 1);
  const std::string scratch = (root / "scratch.qkv").string();
  auto with_mode = [](std::vector<char> bytes) {
    bytes.insert(bytes.begin(), '\0');
    return bytes;
  };
  model.save(scratch);
  const std::vector<char> plain = read(scratch);
  write(models / "model.seed", with_mode(plain));
  // Version 2: version 3 without the attention kind, positions and (empty) mask at 56 .. 68; the
  // checksum is resealed by the fuzzer's mode 0.
  std::vector<char> v2 = plain;
  v2.erase(v2.begin() + 56, v2.begin() + 68);
  v2[8] = 2;
  write(models / "version2.seed", with_mode(v2));
  // Version 1: no flags, no checksum (mode byte 1: left as is).
  std::vector<char> v1 = v2;
  v1.erase(v1.end() - 4, v1.end());
  v1.erase(v1.begin() + 12, v1.begin() + 16);
  v1[8] = 1;
  v1.insert(v1.begin(), '\1');
  write(models / "version1.seed", v1);
  // Version 3's fields set: linear attention; rotary positions with a sparse mask expression.
  qkv::train::ModelConfig linear = config;
  linear.attention = qkv::nn::AttentionKind::Linear;
  qkv::train::AttentionModel(linear, 1).save(scratch);
  write(models / "linear.seed", with_mode(read(scratch)));
  qkv::train::ModelConfig sparse = config;
  sparse.positions = qkv::train::Positions::Rotary;
  sparse.mask = "window(1) | strided(2)";
  qkv::train::AttentionModel(sparse, 1).save(scratch);
  write(models / "sparse_rotary.seed", with_mode(read(scratch)));
  qkv::train::Checkpoint checkpoint{.step = 3, .optimizer = {}};
  checkpoint.optimizer.steps = 3;
  for (const auto& p : model.parameters()) {
    checkpoint.optimizer.first_moment.emplace_back(static_cast<size_t>(p.tensor.numel()), 0.5f);
    checkpoint.optimizer.second_moment.emplace_back(static_cast<size_t>(p.tensor.numel()), 0.25f);
  }
  model.save(scratch, &checkpoint);
  write(models / "checkpoint.seed", with_mode(read(scratch)));
  std::filesystem::remove(scratch);

  // Attention: FuzzedDataProvider reads integers from the end, so any bytes decode to a call.
  uint64_t state = 0x9E3779B97F4A7C15ULL;
  for (int n = 0; n < 12; ++n) {
    std::vector<char> bytes(static_cast<size_t>(32 + 24 * n));
    for (char& c : bytes) {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;  // xorshift64
      c = static_cast<char>(state >> 56);
    }
    write(attention / ("seed-" + std::to_string(n)), bytes);
  }
  std::printf("seeds written under %s\n", root.c_str());
  return 0;
}
