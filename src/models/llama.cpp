// The Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM; Hugging Face's
// modeling_llama / _mistral / _qwen2): pre-norm blocks with RMSNorm,
//   x += o_proj(attn(rope(q_proj(h)), rope(k_proj(h)), v_proj(h))),  h = rms(x)
//   x += down_proj(silu(gate_proj(h)) * up_proj(h)),                  h = rms(x)
// grouped-query attention (num_key_value_heads), rotary positions (half-split pairs, HF's
// rotate_half) with rope_theta and rope_scaling, a final norm, and an lm_head (or the embedding
// when tied). Mistral's layers see a sliding window; Qwen2 has biases on q, k and v.
#include <optional>
#include <string>

#include "models/network.hpp"
#include "models/token_ops.hpp"
#include "models/weight_table.hpp"

namespace qkv::models::detail {

namespace {

struct LlamaLayer {
  std::vector<float> input_norm, post_attention_norm;
  StoredMatrix q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;        // OutIn
  std::vector<float> q_bias, k_bias, v_bias, o_bias, gate_bias, up_bias, down_bias;  // empty: none
};

class Llama final : public Network {
 public:
  Llama(const ModelConfig& config, const WeightSource& source)
      : c_(config),
        rotary_(config.head_dim,
                nn::RotaryEmbeddingOptions{.inverse_frequencies = rope_inverse_frequencies(
                                               config.head_dim, config.rope_theta, config.rope_scaling)}) {
    const WeightTable w(source, model_name(config));
    const int64_t d = c_.hidden_size, inner = c_.intermediate_size;
    const int64_t q_width = c_.num_heads * c_.head_dim, kv_width = c_.num_kv_heads * c_.head_dim;
    const auto bias = [&](bool present, const std::string& name, int64_t n) {
      return present ? w.vector(name, n) : std::vector<float>{};
    };
    embed_tokens_ = w.matrix("model.embed_tokens.weight", c_.vocab_size, d);
    for (int64_t i = 0; i < c_.num_layers; ++i) {
      const std::string l = "model.layers." + std::to_string(i) + ".";
      const std::string a = l + "self_attn.", m = l + "mlp.";
      LlamaLayer layer;
      layer.input_norm = w.vector(l + "input_layernorm.weight", d);
      layer.post_attention_norm = w.vector(l + "post_attention_layernorm.weight", d);
      layer.q_proj = w.matrix(a + "q_proj.weight", q_width, d);
      layer.k_proj = w.matrix(a + "k_proj.weight", kv_width, d);
      layer.v_proj = w.matrix(a + "v_proj.weight", kv_width, d);
      layer.o_proj = w.matrix(a + "o_proj.weight", d, q_width);
      layer.q_bias = bias(c_.attention_bias, a + "q_proj.bias", q_width);
      layer.k_bias = bias(c_.attention_bias, a + "k_proj.bias", kv_width);
      layer.v_bias = bias(c_.attention_bias, a + "v_proj.bias", kv_width);
      layer.o_bias = bias(c_.attention_output_bias, a + "o_proj.bias", d);
      layer.gate_proj = w.matrix(m + "gate_proj.weight", inner, d);
      layer.up_proj = w.matrix(m + "up_proj.weight", inner, d);
      layer.down_proj = w.matrix(m + "down_proj.weight", d, inner);
      layer.gate_bias = bias(c_.mlp_bias, m + "gate_proj.bias", inner);
      layer.up_bias = bias(c_.mlp_bias, m + "up_proj.bias", inner);
      layer.down_bias = bias(c_.mlp_bias, m + "down_proj.bias", d);
      layers_.push_back(std::move(layer));
    }
    norm_ = w.vector("model.norm.weight", d);
    lm_head_ = c_.tie_word_embeddings ? embed_tokens_ : w.matrix("lm_head.weight", c_.vocab_size, d);
  }

  Tensor hidden_states(const Pass& pass) const override {
    const int64_t rows = pass.rows(), d = c_.hidden_size, hd = c_.head_dim;
    Tensor x = Tensor::empty({rows, d});
    for (int64_t r = 0; r < rows; ++r) gather_row(embed_tokens_, pass.ids[static_cast<size_t>(r)], x.data() + r * d);
    Tensor h = Tensor::empty({rows, d});
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LlamaLayer& layer = layers_[i];
      rms_norm(x.data(), rows, d, layer.input_norm, c_.norm_eps, h.data());
      const Tensor q = linear(h, layer.q_proj, layer.q_bias);
      const Tensor k = linear(h, layer.k_proj, layer.k_bias);
      const Tensor v = linear(h, layer.v_proj, layer.v_bias);
      const Tensor heads_out = Tensor::empty({rows, c_.num_heads * hd});
      const AttentionSpec spec{
          .causal = true, .window = c_.window_of_layer(static_cast<int64_t>(i)), .rotary = &rotary_};
      attend(heads_view(q, pass, 0, c_.num_heads, hd), heads_view(k, pass, 0, c_.num_kv_heads, hd),
             heads_view(v, pass, 0, c_.num_kv_heads, hd), pass, static_cast<int64_t>(i), spec,
             heads_view(heads_out, pass, 0, c_.num_heads, hd));
      if (static_cast<int64_t>(i) == pass.stop_layer) return {};  // Model::query_keys has its q and k
      add_into(x.data(), linear(heads_out, layer.o_proj, layer.o_bias).data(),
               rows * d);
      rms_norm(x.data(), rows, d, layer.post_attention_norm, c_.norm_eps, h.data());
      Tensor gate = linear(h, layer.gate_proj, layer.gate_bias);
      const Tensor up = linear(h, layer.up_proj, layer.up_bias);
      gated_activate(gate.data(), up.data(), gate.numel(), c_.activation);
      add_into(x.data(), linear(gate, layer.down_proj, layer.down_bias).data(), rows * d);
    }
    rms_norm(x.data(), rows, d, norm_, c_.norm_eps, h.data());
    return h;
  }

  Tensor logits(const Tensor& hidden) const override { return linear(hidden, lm_head_, {}); }

 private:
  ModelConfig c_;
  nn::RotaryEmbedding rotary_;
  StoredMatrix embed_tokens_, lm_head_;
  std::vector<LlamaLayer> layers_;
  std::vector<float> norm_;
};

}  // namespace

std::unique_ptr<Network> make_llama(const ModelConfig& config, const WeightSource& weights) {
  return std::make_unique<Llama>(config, weights);
}

}  // namespace qkv::models::detail
