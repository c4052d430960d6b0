// `qkv memory`: the memory arithmetic of attention, exact and explained. Pure arithmetic, no
// attention is run.
//
//   qkv memory --seq 2048 --layers 96 --heads 96 --batch 1 --dtype f32 [--training]
//
// Standard attention materialises the weights softmax(Q K^T / sqrt(d)): one seq x seq matrix
// per head per sequence, so per layer batch * heads * seq^2 elements. The course's per-model
// figure (layers x one matrix) counts ONE head per layer; this command says so and gives both.
// Beside it: the flash path's O(seq * head_dim) working memory for the same model.
#include <cstdint>
#include <string>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "bounds.hpp"
#include "numbers.hpp"
#include "commands.hpp"
#include "qkv/qkv.hpp"

namespace qkv::cli {
namespace {

struct MemoryOptions {
  int64_t seq = 2048;
  int64_t layers = 96;
  int64_t heads = 96;
  int64_t batch = 1;
  int64_t head_dim = 128;
  std::string dtype = "f32";
  bool training = false;
};

// "16,777,216 B = 16 MiB"
std::string bytes_text(int64_t bytes) {
  return fmt::format("{} B = {}", group_thousands(bytes), human_bytes(static_cast<double>(bytes)));
}
std::string human(int64_t bytes) { return human_bytes(static_cast<double>(bytes)); }

// One row of a table: what is counted, its element count, its bytes.
void row(const std::string& what, const std::string& elements, const std::string& bytes) {
  fmt::print("  {:<34} {:>28}   {}\n", what, elements, bytes);
}

void run_memory(const MemoryOptions& o) {
  // The options by the names the user typed (the library would name its own fields).
  const std::pair<const char*, int64_t> sizes[] = {{"--seq", o.seq},     {"--layers", o.layers},
                                                   {"--heads", o.heads}, {"--batch", o.batch},
                                                   {"--head-dim", o.head_dim}};
  for (const auto& [name, value] : sizes)
    if (value <= 0) throw Error(fmt::format("{} must be positive, got {}", name, value));
  // Products of two sizes (d_model, heads x batch) are printed: each at most 2^30 keeps them in int64.
  for (const auto& [name, value] : sizes) check_range(name, value, 1, int64_t{1} << 30);
  const int64_t element_bytes = dtype_bytes(o.dtype);
  const analysis::AttentionMemory m = analysis::attention_memory({o.seq, o.layers, o.heads, o.batch, o.head_dim, element_bytes});
  const std::string n = group_thousands(o.seq);

  fmt::print("qkv memory: seq {}, {} layers x {} heads, batch {}, {} ({} bytes per element), head dim {} (d_model {})\n",
             n, o.layers, o.heads, o.batch, o.dtype, element_bytes, o.head_dim, group_thousands(o.heads * o.head_dim));

  fmt::print("\nStandard attention materialises the weights P = softmax(Q K^T / sqrt(d)), seq x seq per head:\n");
  row("", "elements", "bytes");
  row(fmt::format("one matrix ({} x {})", n, n), group_thousands(m.matrix_elements), bytes_text(m.matrix_bytes));
  row(fmt::format("one layer (x {} heads x batch {})", o.heads, o.batch), group_thousands(m.layer_elements),
      bytes_text(m.layer_bytes));
  row(fmt::format("the model (x {} layers)", o.layers), group_thousands(m.model_elements), bytes_text(m.model_bytes));
  fmt::print("  Inference frees each layer's P before the next layer, so its peak is one layer: {}.\n",
             human(m.layer_bytes));
  fmt::print("  Training keeps every layer's P for the backward pass: the whole model, {}.\n", human(m.model_bytes));
  if (o.heads > 1 || o.batch > 1) {
    fmt::print("  Note: the course's per-model figure, {} layers x {} = {}, counts ONE head of one\n", o.layers,
               human(m.matrix_bytes), human(m.course_model_bytes));
    fmt::print("  sequence per layer. With all {} heads and batch {} it is {}x that: {}.\n", o.heads, o.batch,
               group_thousands(o.heads * o.batch), human(m.model_bytes));
  }

  if (o.training) {
    // The course's multiplier and what each factor is; then what training really holds.
    fmt::print("\nTraining: the course multiplies each attention matrix by 5:\n");
    fmt::print("  1x  P      the weights, kept from the forward pass for backward\n");
    fmt::print("  1x  dP     dL/dP = dO V^T, the gradient of the weights\n");
    fmt::print("  1x  dS     dL/dS = P * (dP - rowsum(dP * P)), the gradient through the softmax\n");
    fmt::print("  2x  Adam   its first and second moments (momentum, velocity)\n");
    fmt::print("  5x the model above: {}", bytes_text(5 * m.model_bytes));
    if (o.heads > 1 || o.batch > 1) {
      fmt::print(" (the course's {} x {} x 5 = {} is again one head)", o.layers, human(m.matrix_bytes),
                 human(5 * m.course_model_bytes));
    }
    fmt::print(".\n");
    fmt::print("  But Adam keeps moments for parameters, and P is an activation, not a parameter: it has no\n");
    fmt::print("  optimizer state. At its peak backward holds every layer's P plus dP and dS of the layer\n");
    fmt::print("  it is differentiating (dS may overwrite dP, so that layer needs 1 or 2 more):\n");
    row(fmt::format("{} layers x P + 2 x one layer", o.layers), group_thousands(m.model_elements + 2 * m.layer_elements),
        bytes_text(m.model_bytes + 2 * m.layer_bytes));
  }

  fmt::print("\nFlash attention never forms P. Per layer it keeps the output O (seq x head dim per head) and\n");
  fmt::print("one log-sum-exp per row, all that backward needs to recompute P tile by tile:\n");
  row(fmt::format("one layer ({} x {} x {} x ({} + 1))", o.batch, o.heads, n, o.head_dim),
      group_thousands(m.flash_layer_elements), bytes_text(m.flash_layer_bytes));
  row(fmt::format("the model (x {} layers, training)", o.layers), group_thousands(m.flash_layer_elements * o.layers),
      bytes_text(m.flash_model_bytes));
  fmt::print("  plus a few tiles of scratch per thread, whatever the length: linear in seq, not quadratic.\n");
  fmt::print("  Per layer, P is {:.1f}x flash's O + lse. Q, K and V ({} per layer) are needed by both.\n",
             static_cast<double>(m.layer_bytes) / static_cast<double>(m.flash_layer_bytes),
             human_bytes(3.0 * static_cast<double>(o.batch) * static_cast<double>(o.heads) *
                         static_cast<double>(o.seq) * static_cast<double>(o.head_dim) * static_cast<double>(element_bytes)));
}

}  // namespace

void add_memory_command(CLI::App& app) {
  auto options = std::make_shared<MemoryOptions>();
  CLI::App* memory = app.add_subcommand(
      "memory", "The memory of attention for a model, worked out: one matrix, per layer, per model, flash");
  memory->add_option("--seq", options->seq, "Sequence length")->capture_default_str();
  memory->add_option("--layers", options->layers, "Transformer layers")->capture_default_str();
  memory->add_option("--heads", options->heads, "Attention heads per layer")->capture_default_str();
  memory->add_option("--batch", options->batch, "Sequences per batch")->capture_default_str();
  memory->add_option("--head-dim", options->head_dim, "Features per head (d_model / heads)")->capture_default_str();
  memory->add_option("--dtype", options->dtype, "Element type: f32, f16, bf16 or f64")->capture_default_str();
  memory->add_flag("--training", options->training, "Also the training multiplier, factor by factor");
  memory->footer("Defaults describe GPT-3 175B: 96 layers, 96 heads of 128, context 2048.");
  memory->callback([options] { run_memory(*options); });
}

}  // namespace qkv::cli
