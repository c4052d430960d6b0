// qkv generate / viz --model DIR on a Hugging Face model folder (pretrained.hpp); the helpers
// qkv serve shares (token_labels, encode_text, measure_roles) are in pretrained_text.cpp.
#include "pretrained.hpp"

#include <algorithm>
#include <cstdio>
#include <span>

#include <fmt/core.h>

#include "plot.hpp"
#include "qkv/error.hpp"
#include "qkv/models/head_roles.hpp"

namespace qkv::cli {
namespace {

DType kv_dtype_of(const std::string& name) {
  if (name == "f32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  if (name == "f16") return DType::F16;
  if (name == "int8") return DType::I8;
  if (name == "int4") return DType::I4;
  throw Error("unknown --kv-dtype '" + name + "': choose f32, bf16, f16, int8 or int4");
}

void describe(const models::Pretrained& model) {
  const models::ModelConfig& c = model.config;
  fmt::print(stderr, "{}: {}, {} layers, {} heads ({} for keys and values) of {} dims, vocabulary {}\n",
             model.path.string(), models::to_string(c.architecture), c.num_layers, c.num_heads, c.num_kv_heads,
             c.head_dim, c.vocab_size);
}

}  // namespace

namespace {

// One prompt, streamed: after each token, the new part of the decoded text (a token may end
// mid-character).
void generate_streamed(const models::Pretrained& model, const std::string& text,
                       const models::GenerationOptions& options) {
  const std::vector<int64_t> prompt = encode_text(model, text);
  std::vector<int64_t> generated;
  std::string shown;
  fmt::print("{}", text);
  std::fflush(stdout);
  const models::GenerationResult result = model.model.generate(prompt, options, [&](int64_t token) {
    generated.push_back(token);
    const std::string decoded = model.tokenizer->decode(generated, /*skip_special_tokens=*/true);
    if (decoded.size() > shown.size() && decoded.compare(0, shown.size(), shown) == 0) {
      fmt::print("{}", decoded.substr(shown.size()));
      std::fflush(stdout);
      shown = decoded;
    }
    return true;
  });
  fmt::print("\n");
  fmt::print("{} prompt tokens: prefill {:.1f} tokens/s; {} new tokens: decode {:.1f} tokens/s{}\n",
             result.prompt_tokens, result.prefill_tokens_per_second(), result.tokens.size(),
             result.decode_tokens_per_second(), result.stopped_at_eos ? " (stopped at end of sequence)" : "");
}

// Several prompts generated together (Model::generate_batch), each printed once done.
void generate_together(const models::Pretrained& model, const std::vector<std::string>& texts,
                       const models::GenerationOptions& options) {
  std::vector<std::vector<int64_t>> prompts;
  for (const std::string& text : texts) prompts.push_back(encode_text(model, text));
  const std::vector<models::GenerationResult> results = model.model.generate_batch(prompts, options);
  int64_t prompt_tokens = 0, new_tokens = 0, steps = 0;
  double prefill = 0, decode = 0;
  for (size_t b = 0; b < results.size(); ++b) {
    const models::GenerationResult& r = results[b];
    fmt::print("[{}] {}{}{}\n", b, texts[b], model.tokenizer->decode(r.tokens, /*skip_special_tokens=*/true),
               r.stopped_at_eos ? " (stopped at end of sequence)" : "");
    prompt_tokens += r.prompt_tokens;
    new_tokens += static_cast<int64_t>(r.tokens.size());
    steps += static_cast<int64_t>(r.tokens.size()) - 1;
    prefill = r.prefill_seconds;  // the batch's, the same for every prompt
    decode = std::max(decode, r.decode_seconds);
  }
  fmt::print("{} prompts together, {} prompt tokens: prefill {:.1f} tokens/s; {} new tokens: decode {:.1f} tokens/s\n",
             results.size(), prompt_tokens, prefill > 0 ? static_cast<double>(prompt_tokens) / prefill : 0.0,
             new_tokens, decode > 0 ? static_cast<double>(steps) / decode : 0.0);
}

}  // namespace

void run_pretrained_generate(const PretrainedGenerateOptions& o) {
  if (o.prompts.empty())
    throw Error("qkv generate --model DIR needs a prompt: qkv generate --model DIR \"Once upon\"");
  if (o.max_tokens < 1 || o.max_tokens > (int64_t{1} << 20))
    throw Error(fmt::format("--tokens must be between 1 and {}, got {}", int64_t{1} << 20, o.max_tokens));
  const models::Pretrained model = models::load_pretrained(o.folder, {.model = {.kv_dtype = kv_dtype_of(o.kv_dtype)}});
  if (!model.config.is_causal())
    throw Error(fmt::format("{} is {}, an encoder: it fills masks, it does not generate; try qkv viz --model",
                            o.folder, models::to_string(model.config.architecture)));
  describe(model);
  models::GenerationOptions options{.max_new_tokens = o.max_tokens,
                                    .temperature = o.temperature,
                                    .top_k = o.top_k,
                                    .top_p = o.top_p,
                                    .seed = o.seed,
                                    .stop_at_eos = !o.ignore_eos};
  models::check_generation_options(options);
  if (o.prompts.size() == 1) generate_streamed(model, o.prompts[0], options);
  else generate_together(model, o.prompts, options);
}

void run_pretrained_viz(const PretrainedVizOptions& o) {
  const plot::Format format = plot::format_from_path(o.output);  // a bad extension fails before the work
  (void)format;
  const models::Pretrained model = models::load_pretrained(o.folder);
  const models::ModelConfig& c = model.config;
  if (o.layer < -1 || o.layer >= c.num_layers)
    throw Error(fmt::format("--layer {} is not a layer of {}: it has layers 0 to {}", o.layer, o.folder,
                            c.num_layers - 1));
  const std::vector<int64_t> ids = encode_text(model, o.text);
  if (ids.size() > 256)
    throw Error(fmt::format("the text has {} tokens; qkv viz draws at most 256 (qkv serve shows longer ones)",
                            ids.size()));
  const models::ModelOutput out = model.model.forward(ids, /*need_attention=*/true);
  int64_t layer = o.layer;
  std::string why = "--layer";
  if (layer < 0) {  // the layer whose heads do the most recognisable things
    const std::vector<models::HeadRoleScores> roles = measure_roles(model, ids);
    std::vector<int64_t> named(static_cast<size_t>(c.num_layers), 0);
    for (const auto& head : roles)
      if (head.role != models::HeadRole::None && head.role != models::HeadRole::Broad)
        ++named[static_cast<size_t>(head.layer)];
    layer = std::max_element(named.begin(), named.end()) - named.begin();
    why = fmt::format("layer {} has the most heads with a role (qkv heads): {} of {}; --layer picks another", layer,
                      named[static_cast<size_t>(layer)], c.num_heads);
    if (named[static_cast<size_t>(layer)] == 0) {
      layer = c.num_layers / 2;
      why = "no head has a role but broad (qkv heads), so the middle layer; --layer picks another";
    }
  }
  plot::HeatmapFigure figure;
  figure.title = fmt::format("{}: layer {} of {}, {} heads", o.folder, layer, c.num_layers, c.num_heads);
  figure.notes.push_back(fmt::format("{}; {} tokens; {}", models::to_string(c.architecture), ids.size(), why));
  figure.row_labels = figure.col_labels = token_labels(*model.tokenizer, ids);
  figure.value_max = 1;
  figure.print_values = ids.size() <= 12;
  figure.columns = 4;
  const Tensor weights = out.attention[static_cast<size_t>(layer)].contiguous();  // (1, H, N, N)
  const auto n = static_cast<int64_t>(ids.size());
  // The pairs the architecture's mask hides (a causal model's future, a sliding window's past),
  // hatched rather than drawn as weights of 0.
  std::vector<uint8_t> masked;
  if (c.is_causal()) {
    const int64_t window = c.window_of_layer(layer);
    masked.resize(static_cast<size_t>(n * n));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) masked[static_cast<size_t>(i * n + j)] = j > i || (window > 0 && i - j >= window);
  }
  plot::HeatmapSection section;
  for (int64_t h = 0; h < c.num_heads; ++h) {
    plot::HeatmapPanel panel;
    panel.title = fmt::format("head {}", h);
    panel.rows = panel.cols = n;
    panel.masked = masked;
    panel.values.assign(weights.data() + h * n * n, weights.data() + (h + 1) * n * n);
    section.panels.push_back(std::move(panel));
  }
  figure.sections.push_back(std::move(section));
  const plot::HeatmapLayout drawn = plot::draw_heatmaps(figure, o.output);
  fmt::print("Wrote layer {}'s {} heads on {} tokens to {} ({} x {})\n", layer, c.num_heads, n, o.output, drawn.width,
             drawn.height);
}

}  // namespace qkv::cli
