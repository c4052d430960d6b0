// GPT-2 (GPT2LMHeadModel; Radford et al. 2019, Hugging Face's modeling_gpt2): learned token and
// position embeddings, pre-LN blocks
//   x += c_proj(attn(ln_1(x))),   x += mlp_c_proj(gelu_tanh(c_fc(ln_2(x)))),
// a final ln_f and the lm head tied to wte. Conv1D weights are stored (in, out).
#include <string>

#include "models/network.hpp"
#include "models/token_ops.hpp"
#include "models/weight_table.hpp"

namespace qkv::models::detail {

namespace {

struct Gpt2Layer {
  std::vector<float> ln_1_weight, ln_1_bias, ln_2_weight, ln_2_bias;
  StoredMatrix c_attn, attn_c_proj, c_fc, mlp_c_proj;  // InOut
  std::vector<float> c_attn_bias, attn_c_proj_bias, c_fc_bias, mlp_c_proj_bias;
};

class Gpt2 final : public Network {
 public:
  Gpt2(const ModelConfig& config, const WeightSource& source) : c_(config) {
    const WeightTable w(source, model_name(config));
    // Hugging Face saves GPT2LMHeadModel with the `transformer.` prefix, GPT2Model without.
    const std::string p = w.contains("transformer.wte.weight") ? "transformer." : "";
    const int64_t d = c_.hidden_size, inner = c_.intermediate_size;
    wte_ = w.matrix(p + "wte.weight", c_.vocab_size, d);
    wpe_ = w.matrix(p + "wpe.weight", c_.max_positions, d);
    for (int64_t i = 0; i < c_.num_layers; ++i) {
      const std::string l = p + "h." + std::to_string(i) + ".";
      Gpt2Layer layer;
      layer.ln_1_weight = w.vector(l + "ln_1.weight", d);
      layer.ln_1_bias = w.vector(l + "ln_1.bias", d);
      layer.c_attn = w.matrix(l + "attn.c_attn.weight", d, 3 * d, Layout::InOut);
      layer.c_attn_bias = w.vector(l + "attn.c_attn.bias", 3 * d);
      layer.attn_c_proj = w.matrix(l + "attn.c_proj.weight", d, d, Layout::InOut);
      layer.attn_c_proj_bias = w.vector(l + "attn.c_proj.bias", d);
      layer.ln_2_weight = w.vector(l + "ln_2.weight", d);
      layer.ln_2_bias = w.vector(l + "ln_2.bias", d);
      layer.c_fc = w.matrix(l + "mlp.c_fc.weight", d, inner, Layout::InOut);
      layer.c_fc_bias = w.vector(l + "mlp.c_fc.bias", inner);
      layer.mlp_c_proj = w.matrix(l + "mlp.c_proj.weight", inner, d, Layout::InOut);
      layer.mlp_c_proj_bias = w.vector(l + "mlp.c_proj.bias", d);
      layers_.push_back(std::move(layer));
    }
    ln_f_weight_ = w.vector(p + "ln_f.weight", d);
    ln_f_bias_ = w.vector(p + "ln_f.bias", d);
    lm_head_ = c_.tie_word_embeddings ? wte_ : w.matrix("lm_head.weight", c_.vocab_size, d);
  }

  Tensor hidden_states(const Pass& pass) const override {
    const int64_t rows = pass.rows(), d = c_.hidden_size;
    Tensor x = embed(pass);
    Tensor h = Tensor::empty({rows, d});
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Gpt2Layer& layer = layers_[i];
      layer_norm(x.data(), rows, d, layer.ln_1_weight, layer.ln_1_bias, c_.norm_eps, h.data());
      const Tensor qkv = linear(h, layer.c_attn, layer.c_attn_bias);  // (rows, 3d): q | k | v
      const int64_t heads = c_.num_heads, hd = c_.head_dim;
      const Tensor heads_out = Tensor::empty({rows, d});
      attend(heads_view(qkv, pass, 0, heads, hd), heads_view(qkv, pass, d, heads, hd),
             heads_view(qkv, pass, 2 * d, heads, hd), pass, static_cast<int64_t>(i), AttentionSpec{.causal = true},
             heads_view(heads_out, pass, 0, heads, hd));
      if (static_cast<int64_t>(i) == pass.stop_layer) return {};  // Model::query_keys has its q and k
      add_into(x.data(), linear(heads_out, layer.attn_c_proj, layer.attn_c_proj_bias).data(),
               rows * d);
      layer_norm(x.data(), rows, d, layer.ln_2_weight, layer.ln_2_bias, c_.norm_eps, h.data());
      Tensor inner = linear(h, layer.c_fc, layer.c_fc_bias);
      activate(inner.data(), inner.numel(), c_.activation);
      add_into(x.data(), linear(inner, layer.mlp_c_proj, layer.mlp_c_proj_bias).data(), rows * d);
    }
    layer_norm(x.data(), rows, d, ln_f_weight_, ln_f_bias_, c_.norm_eps, h.data());
    return h;
  }

  Tensor logits(const Tensor& hidden) const override { return linear(hidden, lm_head_, {}); }

 private:
  // (rows, d): wte[id] + wpe[position], each row at its position in its sequence.
  Tensor embed(const Pass& pass) const {
    const int64_t d = c_.hidden_size;
    Tensor x = Tensor::empty({pass.rows(), d});
    std::vector<float> position(static_cast<size_t>(d));
    const std::vector<int64_t> positions = pass.row_positions();
    for (int64_t r = 0; r < pass.rows(); ++r) {
      float* row = x.data() + r * d;
      gather_row(wte_, pass.ids[static_cast<size_t>(r)], row);
      gather_row(wpe_, positions[static_cast<size_t>(r)], position.data());
      add_into(row, position.data(), d);
    }
    return x;
  }

  ModelConfig c_;
  StoredMatrix wte_, wpe_, lm_head_;
  std::vector<Gpt2Layer> layers_;
  std::vector<float> ln_f_weight_, ln_f_bias_;
};

}  // namespace

std::unique_ptr<Network> make_gpt2(const ModelConfig& config, const WeightSource& weights) {
  return std::make_unique<Gpt2>(config, weights);
}

}  // namespace qkv::models::detail
