// qkv_model_benchmark: the real-models speed targets on random-weight checkpoints with the shapes
// of SmolLM2-135M (LlamaForCausalLM) and GPT-2 small, written here in the Hugging Face layout
// (model.safetensors + config.json) in bf16 and f32, so nothing is downloaded:
//   load      load_pretrained's time (cold: the file just written; warm: opened again) and the
//             resident memory it adds (VmRSS of /proc/self/status) against the file's size
//   prefill   a prompt of --prefill tokens through generate() (its prefill_seconds, which include
//             the first token's choice): tokens/s and FLOPs/s against the FMA peak
//   decode    a prompt of each --contexts length, then --steps single-token steps (generate()'s
//             decode_seconds): tokens/s, and the bytes of weights and K/V each step reads / time
//             against the memcpy bandwidth (bytes read + written per second, as `qkv bench`)
//   batch     --batch prompts of lengths spread over [--prefill / 4, --prefill], each then taking
//             --steps + 1 tokens: generate_batch (one packed prefill, one paged step for all) against
//             generate() on each prompt in turn, wall time; tokens/s counts the new tokens
// Each row is the median of --runs. The ceilings (FMA peak on every OpenMP thread, memcpy of
// 256 MiB) are measured before and after the models; the higher is kept.
//   OMP_NUM_THREADS=2 qkv_model_benchmark [--json] [--dir DIR] [--models llama,gpt2] [--dtypes bf16,f32]
// --dir keeps the checkpoints (DIR/<model>-<dtype>/) for bench/compare_models_torch.py.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fma_peak.hpp"
#include "qkv/dtype.hpp"
#include "qkv/models/pretrained.hpp"
#include "qkv/models/safetensors.hpp"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using qkv::DType;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// VmRSS of this process in bytes.
double resident_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) * 1024.0;
  return 0;
}

// memcpy of 256 MiB between pre-touched buffers: bytes read + written per second, median of 5.
double measure_memcpy_gbs() {
  const size_t bytes = size_t{256} << 20;
  std::vector<char> source(bytes, 1), destination(bytes, 0);
  std::vector<double> times;
  for (int run = 0; run < 6; ++run) {
    const auto start = Clock::now();
    std::memcpy(destination.data(), source.data(), bytes);
    if (run > 0) times.push_back(seconds_since(start));
  }
  if (destination[bytes / 2] != 1) std::fprintf(stderr, "memcpy copied wrong bytes\n");
  return 2.0 * static_cast<double>(bytes) / median(times) * 1e-9;
}

// The shapes of a checkpoint.
struct Shape {
  std::string name;  // "smollm2-135m" or "gpt2"
  bool llama = true;
  int64_t layers, d, heads, kv_heads, head_dim, inner, vocab, positions;
};

const Shape kSmolLM2{"smollm2-135m", true, 30, 576, 9, 3, 64, 1536, 49152, 8192};
const Shape kGpt2{"gpt2", false, 12, 768, 12, 12, 64, 3072, 50257, 1024};

std::string config_json(const Shape& s) {
  std::ostringstream o;
  if (s.llama) {
    o << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": )" << s.d
      << R"(, "num_hidden_layers": )" << s.layers << R"(, "num_attention_heads": )" << s.heads
      << R"(, "num_key_value_heads": )" << s.kv_heads << R"(, "intermediate_size": )" << s.inner
      << R"(, "vocab_size": )" << s.vocab << R"(, "max_position_embeddings": )" << s.positions
      << R"(, "rms_norm_eps": 1e-05, "rope_theta": 100000, "hidden_act": "silu", "tie_word_embeddings": true,)"
      << R"( "bos_token_id": 0, "eos_token_id": 0})";
  } else {
    o << R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": )" << s.d << R"(, "n_layer": )"
      << s.layers << R"(, "n_head": )" << s.heads << R"(, "n_positions": )" << s.positions << R"(, "n_ctx": )"
      << s.positions << R"(, "vocab_size": )" << s.vocab
      << R"(, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-05, "bos_token_id": 50256,)"
      << R"( "eos_token_id": 50256})";
  }
  return o.str();
}

// Writes `s` with random weights in `dtype` to folder/model.safetensors + config.json; returns
// the file's size in bytes.
int64_t write_checkpoint(const Shape& s, DType dtype, const fs::path& folder) {
  fs::create_directories(folder);
  struct Pending {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Pending> tensors;
  std::mt19937 rng(1234);
  const auto add = [&](const std::string& name, std::vector<int64_t> shape, float center, float scale) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    std::vector<float> values(static_cast<size_t>(n));
    std::uniform_real_distribution<float> u(-scale, scale);
    for (float& v : values) v = center + u(rng);
    std::vector<uint8_t> bytes(values.size() * qkv::element_size(dtype));
    qkv::convert(values.data(), DType::F32, bytes.data(), dtype, values.size());
    tensors.push_back({name, std::move(shape), std::move(bytes)});
  };
  const int64_t d = s.d, q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  if (s.llama) {
    add("model.embed_tokens.weight", {s.vocab, d}, 0, 0.05f);
    for (int64_t i = 0; i < s.layers; ++i) {
      const std::string l = "model.layers." + std::to_string(i) + ".";
      add(l + "input_layernorm.weight", {d}, 1, 0.1f);
      add(l + "self_attn.q_proj.weight", {q, d}, 0, 0.05f);
      add(l + "self_attn.k_proj.weight", {kv, d}, 0, 0.05f);
      add(l + "self_attn.v_proj.weight", {kv, d}, 0, 0.05f);
      add(l + "self_attn.o_proj.weight", {d, q}, 0, 0.05f);
      add(l + "post_attention_layernorm.weight", {d}, 1, 0.1f);
      add(l + "mlp.gate_proj.weight", {s.inner, d}, 0, 0.05f);
      add(l + "mlp.up_proj.weight", {s.inner, d}, 0, 0.05f);
      add(l + "mlp.down_proj.weight", {d, s.inner}, 0, 0.03f);
    }
    add("model.norm.weight", {d}, 1, 0.1f);
  } else {
    add("transformer.wte.weight", {s.vocab, d}, 0, 0.05f);
    add("transformer.wpe.weight", {s.positions, d}, 0, 0.02f);
    for (int64_t i = 0; i < s.layers; ++i) {
      const std::string l = "transformer.h." + std::to_string(i) + ".";
      add(l + "ln_1.weight", {d}, 1, 0.1f);
      add(l + "ln_1.bias", {d}, 0, 0.02f);
      add(l + "attn.c_attn.weight", {d, 3 * d}, 0, 0.05f);
      add(l + "attn.c_attn.bias", {3 * d}, 0, 0.02f);
      add(l + "attn.c_proj.weight", {d, d}, 0, 0.05f);
      add(l + "attn.c_proj.bias", {d}, 0, 0.02f);
      add(l + "ln_2.weight", {d}, 1, 0.1f);
      add(l + "ln_2.bias", {d}, 0, 0.02f);
      add(l + "mlp.c_fc.weight", {d, s.inner}, 0, 0.05f);
      add(l + "mlp.c_fc.bias", {s.inner}, 0, 0.02f);
      add(l + "mlp.c_proj.weight", {s.inner, d}, 0, 0.03f);
      add(l + "mlp.c_proj.bias", {d}, 0, 0.02f);
    }
    add("transformer.ln_f.weight", {d}, 1, 0.1f);
    add("transformer.ln_f.bias", {d}, 0, 0.02f);
  }
  std::vector<qkv::models::SafetensorsTensor> views;
  for (const Pending& t : tensors)
    views.push_back({t.name, std::string(qkv::models::safetensors_dtype(dtype)), t.shape, t.bytes});
  qkv::models::write_safetensors(folder / "model.safetensors", views);
  std::ofstream(folder / "config.json") << config_json(s);
  return static_cast<int64_t>(fs::file_size(folder / "model.safetensors"));
}

// Weight bytes one decode step reads: every matrix a linear layer multiplies (the tied embedding
// once, as the lm_head; one row of it and of GPT-2's wpe are not counted) and the vectors.
double matrix_params(const Shape& s) {
  const double d = static_cast<double>(s.d), q = static_cast<double>(s.heads * s.head_dim),
               kv = static_cast<double>(s.kv_heads * s.head_dim), inner = static_cast<double>(s.inner);
  const double per_layer = s.llama ? d * q + 2 * d * kv + q * d + 3 * d * inner : 4 * d * d + 2 * d * inner;
  return static_cast<double>(s.layers) * per_layer;
}
double lm_head_params(const Shape& s) { return static_cast<double>(s.vocab) * static_cast<double>(s.d); }

// FLOPs of a prefill of n tokens: every layer's matrices on n rows, causal attention (QK^T and
// PV over n(n+1)/2 pairs per head), the lm_head on the last row.
double prefill_flops(const Shape& s, int64_t n) {
  const double pairs = static_cast<double>(n) * static_cast<double>(n + 1) / 2;
  return 2 * matrix_params(s) * static_cast<double>(n) +
         4.0 * static_cast<double>(s.layers * s.heads * s.head_dim) * pairs + 2 * lm_head_params(s);
}

// Bytes one decode step at `context` reads: the matrices and the K/V of `context` positions.
double decode_bytes(const Shape& s, DType weights, DType kv, int64_t context) {
  return (matrix_params(s) + lm_head_params(s)) * static_cast<double>(qkv::element_size(weights)) +
         2.0 * static_cast<double>(s.layers * s.kv_heads * s.head_dim * context) *
             static_cast<double>(qkv::element_size(kv));
}

struct Options {
  bool json = false;
  std::string dir;
  std::vector<std::string> models{"smollm2-135m", "gpt2"};
  std::vector<std::string> dtypes{"bf16", "f32"};
  std::vector<int64_t> contexts{512, 4096};
  int64_t prefill = 512, steps = 32, batch = 8;
  int runs = 3;
};

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

std::vector<int64_t> prompt_of(int64_t n, int64_t vocab) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = (i * 7919 + 13) % vocab;
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--json") o.json = true;
    else if (a == "--dir") o.dir = value();
    else if (a == "--models") o.models = split(value());
    else if (a == "--dtypes") o.dtypes = split(value());
    else if (a == "--contexts") {
      o.contexts.clear();
      for (const auto& c : split(value())) o.contexts.push_back(std::stoll(c));
    } else if (a == "--prefill") o.prefill = std::stoll(value());
    else if (a == "--steps") o.steps = std::stoll(value());
    else if (a == "--runs") o.runs = std::stoi(value());
    else if (a == "--batch") o.batch = std::stoll(value());
    else {
      std::fprintf(stderr, "usage: %s [--json] [--dir DIR] [--models smollm2-135m,gpt2] [--dtypes bf16,f32] "
                           "[--contexts 512,4096] [--prefill 512] [--steps 32] [--batch 8] [--runs 3]\n", argv[0]);
      return a == "--help" ? 0 : 2;
    }
  }
  const bool keep = !o.dir.empty();
  const fs::path root = keep ? fs::path(o.dir) : fs::temp_directory_path() / ("qkv_model_bench_" + std::to_string(getpid()));
  const auto say = [&](const std::string& line) {
    if (!o.json) std::cout << line << std::flush;
  };

  qkv::cli::FmaPeak fma = qkv::cli::measure_fma_peak(5);
  double memcpy_gbs = measure_memcpy_gbs();
  char line[512];
  std::snprintf(line, sizeof line, "threads %d, %s: FMA peak %.1f GFLOP/s, memcpy %.1f GB/s (read + written)\n",
                omp_get_max_threads(), fma.target.c_str(), fma.gflops, memcpy_gbs);
  say(line);
  say("model          dtype  what            tokens/s      ms  GFLOP/s x peak   GB/s x memcpy  load / RSS\n");

  struct Row {
    std::string model, dtype, what;
    int64_t tokens = 0, context = 0;
    double seconds = 0, gflops = 0, gbs = 0, load_cold = 0, load_warm = 0, rss = 0, file = 0;
  };
  std::vector<Row> rows;
  for (const std::string& model_name : o.models) {
    const Shape& s = model_name == "gpt2" ? kGpt2 : kSmolLM2;
    if (model_name != "gpt2" && model_name != kSmolLM2.name) {
      std::fprintf(stderr, "unknown model %s\n", model_name.c_str());
      return 2;
    }
    for (const std::string& dtype_name : o.dtypes) {
      const DType dtype = dtype_name == "f32" ? DType::F32 : dtype_name == "f16" ? DType::F16 : DType::BF16;
      const fs::path folder = root / (s.name + "-" + dtype_name);
      const int64_t file = write_checkpoint(s, dtype, folder);
      qkv::models::PretrainedOptions options;
      options.require_tokenizer = false;
      // Load: cold right after writing (the page cache holds the file), warm on the second open;
      // resident memory added by the second load, measured with the first one released.
      auto start = Clock::now();
      auto first = std::make_unique<qkv::models::Pretrained>(qkv::models::load_pretrained(folder, options));
      const double cold = seconds_since(start);
      first.reset();
      const double rss_before = resident_bytes();
      start = Clock::now();
      qkv::models::Pretrained p = qkv::models::load_pretrained(folder, options);
      const double warm = seconds_since(start);
      const double rss = resident_bytes() - rss_before;
      Row load{s.name, dtype_name, "load", 0, 0, warm, 0, 0, cold, warm, rss, static_cast<double>(file)};
      rows.push_back(load);
      std::snprintf(line, sizeof line, "%-14s %-6s load            %.3f s warm (%.3f s cold), +%.0f MB resident = %.2f x the file (%.0f MB)\n",
                    s.name.c_str(), dtype_name.c_str(), warm, cold, rss / 1e6, rss / static_cast<double>(file),
                    static_cast<double>(file) / 1e6);
      say(line);

      qkv::models::GenerationOptions g;
      g.stop_at_eos = false;
      // Prefill.
      {
        g.max_new_tokens = 1;
        const auto prompt = prompt_of(o.prefill, s.vocab);
        p.model.generate(prompt, g);  // warm-up: pages touched, scratch allocated
        std::vector<double> times;
        for (int r = 0; r < o.runs; ++r) times.push_back(p.model.generate(prompt, g).prefill_seconds);
        Row row{s.name, dtype_name, "prefill", o.prefill, o.prefill, median(times)};
        row.gflops = prefill_flops(s, o.prefill) / row.seconds * 1e-9;
        rows.push_back(row);
        std::snprintf(line, sizeof line, "%-14s %-6s prefill %-7lld %9.1f %7.1f %8.1f %6.2f\n", s.name.c_str(),
                      dtype_name.c_str(), static_cast<long long>(o.prefill), o.prefill / row.seconds,
                      row.seconds * 1e3, row.gflops, row.gflops / fma.gflops);
        say(line);
      }
      // Decode at each context that fits the model's positions.
      for (int64_t context : o.contexts) {
        if (context + o.steps > s.positions) continue;
        g.max_new_tokens = o.steps + 1;
        const auto prompt = prompt_of(context, s.vocab);
        std::vector<double> times;
        const int runs = context > 1024 ? 1 : o.runs;  // a long prefill per run
        for (int r = 0; r < runs; ++r) times.push_back(p.model.generate(prompt, g).decode_seconds / o.steps);
        Row row{s.name, dtype_name, "decode", 1, context, median(times)};
        row.gbs = decode_bytes(s, dtype, qkv::models::ModelOptions{}.kv_dtype, context) / row.seconds * 1e-9;
        rows.push_back(row);
        std::snprintf(line, sizeof line, "%-14s %-6s decode@%-7lld %9.1f %7.2f %22.1f %6.2f\n", s.name.c_str(),
                      dtype_name.c_str(), static_cast<long long>(context), 1 / row.seconds, row.seconds * 1e3,
                      row.gbs, row.gbs / memcpy_gbs);
        say(line);
      }
      if (o.batch > 0 && o.prefill >= 4 && o.prefill + o.steps + 1 <= s.positions) {
        std::vector<std::vector<int64_t>> prompts;
        for (int64_t i = 0; i < o.batch; ++i)
          prompts.push_back(prompt_of(o.prefill / 4 + i * (o.prefill - o.prefill / 4) / std::max<int64_t>(1, o.batch - 1),
                                      s.vocab));
        g.max_new_tokens = o.steps + 1;
        // Wall times, and the decode steps' alone (a batched step serves every prompt at once).
        std::vector<double> batched, sequential, batched_decode, sequential_decode;
        for (int r = 0; r < o.runs; ++r) {
          auto start = Clock::now();
          double decode = 0;
          for (const auto& result : p.model.generate_batch(prompts, g)) decode = std::max(decode, result.decode_seconds);
          batched.push_back(seconds_since(start));
          batched_decode.push_back(decode);
          start = Clock::now();
          decode = 0;
          for (const auto& prompt : prompts) decode += p.model.generate(prompt, g).decode_seconds;
          sequential.push_back(seconds_since(start));
          sequential_decode.push_back(decode);
        }
        const int64_t tokens = o.batch * g.max_new_tokens;
        Row row{s.name, dtype_name, "batch", tokens, o.prefill, median(batched)};
        rows.push_back(row);
        Row one_at_a_time{s.name, dtype_name, "sequential", tokens, o.prefill, median(sequential)};
        rows.push_back(one_at_a_time);
        std::snprintf(line, sizeof line, "%-14s %-6s batch%-10lld %9.1f %7.0f   %.2f x one prompt at a time (%.0f ms); "
                      "decode steps %.2f x (%.0f vs %.0f ms)\n",
                      s.name.c_str(), dtype_name.c_str(), static_cast<long long>(o.batch), tokens / row.seconds,
                      row.seconds * 1e3, one_at_a_time.seconds / row.seconds, one_at_a_time.seconds * 1e3,
                      median(sequential_decode) / median(batched_decode), median(batched_decode) * 1e3,
                      median(sequential_decode) * 1e3);
        say(line);
      }
      if (!keep) fs::remove_all(folder);
    }
  }
  if (!keep) fs::remove_all(root);
  // The ceilings again: the higher of the two measurements.
  const qkv::cli::FmaPeak fma_end = qkv::cli::measure_fma_peak(5);
  const double memcpy_end = measure_memcpy_gbs();
  std::snprintf(line, sizeof line, "after: FMA peak %.1f GFLOP/s, memcpy %.1f GB/s\n", fma_end.gflops, memcpy_end);
  say(line);
  if (o.json) {
    fma.gflops = std::max(fma.gflops, fma_end.gflops);
    memcpy_gbs = std::max(memcpy_gbs, memcpy_end);
    std::printf("{\"kind\": \"env\", \"threads\": %d, \"simd_target\": \"%s\", \"fma_peak_gflops\": %.2f, "
                "\"memcpy_gbs\": %.2f, \"dir\": \"%s\"}\n",
                omp_get_max_threads(), fma.target.c_str(), fma.gflops, memcpy_gbs, keep ? root.c_str() : "");
    for (const Row& r : rows)
      std::printf("{\"kind\": \"%s\", \"model\": \"%s\", \"dtype\": \"%s\", \"tokens\": %lld, \"context\": %lld, "
                  "\"seconds\": %.6f, \"tokens_per_second\": %.3f, \"gflops\": %.2f, \"x_peak\": %.3f, "
                  "\"gbs\": %.2f, \"x_memcpy\": %.3f, \"load_cold\": %.4f, \"load_warm\": %.4f, "
                  "\"rss_bytes\": %.0f, \"file_bytes\": %.0f}\n",
                  r.what.c_str(), r.model.c_str(), r.dtype.c_str(), static_cast<long long>(r.tokens),
                  static_cast<long long>(r.context), r.seconds, r.tokens > 0 ? r.tokens / r.seconds : 0, r.gflops,
                  r.gflops / fma.gflops, r.gbs, r.gbs / memcpy_gbs, r.load_cold, r.load_warm, r.rss, r.file);
  }
  return 0;
}
