// BERT (BertModel, BertForMaskedLM; Devlin et al. 2019, Hugging Face's modeling_bert): token,
// position and token-type embeddings summed and layer-normed, post-LN blocks that attend both ways
//   x = LN(x + dense(attn(x))),   x = LN(x + dense_out(act(dense_in(x)))),
// and for the masked LM the cls.predictions head: LN(act(dense(x))) then a decoder tied to the
// word embeddings plus a bias.
#include <string>

#include "models/network.hpp"
#include "models/token_ops.hpp"
#include "models/weight_table.hpp"

namespace qkv::models::detail {

namespace {

struct Dense {
  StoredMatrix weight;  // OutIn
  std::vector<float> bias;
};

struct Norm {
  std::vector<float> weight, bias;
};

struct BertLayer {
  Dense query, key, value, attention_output, intermediate, output;
  Norm attention_norm, output_norm;
};

class Bert final : public Network {
 public:
  Bert(const ModelConfig& config, const WeightSource& source) : c_(config) {
    const WeightTable w(source, model_name(config));
    // BertForMaskedLM's encoder lives under `bert.`; a BertModel is saved without it.
    const std::string p = w.contains("bert.embeddings.word_embeddings.weight") ? "bert." : "";
    const int64_t d = c_.hidden_size, inner = c_.intermediate_size;
    const auto dense = [&](const std::string& name, int64_t out, int64_t in) {
      return Dense{w.matrix(name + ".weight", out, in), w.vector(name + ".bias", out)};
    };
    // Checkpoints converted from the original TensorFlow BERT (bert-base-uncased among them) name
    // a LayerNorm's parameters gamma and beta; Hugging Face renames them on load, as here.
    const auto norm = [&](const std::string& name) {
      const bool tf_names = !w.contains(name + ".weight") && w.contains(name + ".gamma");
      return Norm{w.vector(name + (tf_names ? ".gamma" : ".weight"), d),
                  w.vector(name + (tf_names ? ".beta" : ".bias"), d)};
    };
    words_ = w.matrix(p + "embeddings.word_embeddings.weight", c_.vocab_size, d);
    positions_ = w.matrix(p + "embeddings.position_embeddings.weight", c_.max_positions, d);
    types_ = w.matrix(p + "embeddings.token_type_embeddings.weight", c_.type_vocab_size, d);
    embedding_norm_ = norm(p + "embeddings.LayerNorm");
    for (int64_t i = 0; i < c_.num_layers; ++i) {
      const std::string l = p + "encoder.layer." + std::to_string(i) + ".";
      layers_.push_back(BertLayer{.query = dense(l + "attention.self.query", d, d),
                                  .key = dense(l + "attention.self.key", d, d),
                                  .value = dense(l + "attention.self.value", d, d),
                                  .attention_output = dense(l + "attention.output.dense", d, d),
                                  .intermediate = dense(l + "intermediate.dense", inner, d),
                                  .output = dense(l + "output.dense", d, inner),
                                  .attention_norm = norm(l + "attention.output.LayerNorm"),
                                  .output_norm = norm(l + "output.LayerNorm")});
    }
    if (c_.has_lm_head()) {
      transform_ = dense("cls.predictions.transform.dense", d, d);
      transform_norm_ = norm("cls.predictions.transform.LayerNorm");
      decoder_ = c_.tie_word_embeddings ? words_ : w.matrix("cls.predictions.decoder.weight", c_.vocab_size, d);
      // The bias is saved as cls.predictions.bias, or only as the decoder's (the two are tied).
      const bool decoder_named = !w.contains("cls.predictions.bias") && w.contains("cls.predictions.decoder.bias");
      decoder_bias_ = w.vector(decoder_named ? "cls.predictions.decoder.bias" : "cls.predictions.bias", c_.vocab_size);
    }
  }

  Tensor hidden_states(const Pass& pass) const override {
    const int64_t rows = pass.rows(), d = c_.hidden_size, heads = c_.num_heads, hd = c_.head_dim;
    Tensor x = embed(pass);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const BertLayer& layer = layers_[i];
      const Tensor q = linear(x, layer.query.weight, layer.query.bias);
      const Tensor k = linear(x, layer.key.weight, layer.key.bias);
      const Tensor v = linear(x, layer.value.weight, layer.value.bias);
      const Tensor heads_out = Tensor::empty({rows, d});
      attend(heads_view(q, pass, 0, heads, hd), heads_view(k, pass, 0, heads, hd), heads_view(v, pass, 0, heads, hd),
             pass, static_cast<int64_t>(i), AttentionSpec{.causal = false}, heads_view(heads_out, pass, 0, heads, hd));
      if (static_cast<int64_t>(i) == pass.stop_layer) return {};  // Model::query_keys has its q and k
      Tensor a = linear(heads_out, layer.attention_output.weight, layer.attention_output.bias);
      add_into(a.data(), x.data(), rows * d);
      layer_norm(a.data(), rows, d, layer.attention_norm.weight, layer.attention_norm.bias, c_.norm_eps, x.data());
      Tensor inner = linear(x, layer.intermediate.weight, layer.intermediate.bias);
      activate(inner.data(), inner.numel(), c_.activation);
      Tensor m = linear(inner, layer.output.weight, layer.output.bias);
      add_into(m.data(), x.data(), rows * d);
      layer_norm(m.data(), rows, d, layer.output_norm.weight, layer.output_norm.bias, c_.norm_eps, x.data());
    }
    return x;
  }

  Tensor logits(const Tensor& hidden) const override {
    const int64_t rows = hidden.size(0), d = c_.hidden_size;
    Tensor h = linear(hidden, transform_.weight, transform_.bias);
    activate(h.data(), h.numel(), c_.activation);
    layer_norm(h.data(), rows, d, transform_norm_.weight, transform_norm_.bias, c_.norm_eps, h.data());
    return linear(h, decoder_, decoder_bias_);
  }

 private:
  // (rows, d): LN(words[id] + positions[position] + types[type]).
  Tensor embed(const Pass& pass) const {
    const int64_t d = c_.hidden_size, rows = pass.rows();
    const std::vector<int64_t> row_positions = pass.row_positions();
    Tensor x = Tensor::empty({rows, d});
    std::vector<float> term(static_cast<size_t>(d));
    for (int64_t r = 0; r < rows; ++r) {
      float* row = x.data() + r * d;
      gather_row(words_, pass.ids[static_cast<size_t>(r)], row);
      gather_row(positions_, row_positions[static_cast<size_t>(r)], term.data());
      add_into(row, term.data(), d);
      gather_row(types_, pass.token_types.empty() ? 0 : pass.token_types[static_cast<size_t>(r)], term.data());
      add_into(row, term.data(), d);
    }
    layer_norm(x.data(), rows, d, embedding_norm_.weight, embedding_norm_.bias, c_.norm_eps, x.data());
    return x;
  }

  ModelConfig c_;
  StoredMatrix words_, positions_, types_, decoder_;
  Norm embedding_norm_, transform_norm_;
  std::vector<BertLayer> layers_;
  Dense transform_;
  std::vector<float> decoder_bias_;
};

}  // namespace

std::unique_ptr<Network> make_bert(const ModelConfig& config, const WeightSource& weights) {
  return std::make_unique<Bert>(config, weights);
}

}  // namespace qkv::models::detail
