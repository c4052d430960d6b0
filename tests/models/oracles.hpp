// Float64 oracles of the architectures, one sequence at a time, written from their published
// equations (GPT-2: Radford et al. 2019 with Hugging Face's Conv1D layout; BERT: Devlin et al.
// 2019; Llama: Touvron et al. 2023 with HF's rotate_half rotary convention, GQA, Mistral's
// sliding window) and independent of the library: plain loops over doubles.
#pragma once

#include <cmath>
#include <functional>
#include <numbers>
#include <string>
#include <vector>

#include "checkpoint.hpp"

namespace qkv::models::testing {

using Rows = std::vector<std::vector<double>>;  // (N, features)

struct OracleOutput {
  Rows hidden;                               // (N, hidden_size)
  Rows logits;                               // (N, vocab), empty without an lm head
  std::vector<std::vector<Rows>> attention;  // [layer][head] (N, N)
};

namespace oracle {

inline Rows linear(const Rows& x, const Values& w, bool in_out = false) {  // x W^T, W (out, in); or x W
  const int64_t out = in_out ? w.cols() : w.rows(), in = in_out ? w.rows() : w.cols();
  Rows y(x.size(), std::vector<double>(static_cast<size_t>(out), 0.0));
  for (size_t n = 0; n < x.size(); ++n)
    for (int64_t o = 0; o < out; ++o) {
      double sum = 0;
      for (int64_t i = 0; i < in; ++i) sum += x[n][static_cast<size_t>(i)] * (in_out ? w.at(i, o) : w.at(o, i));
      y[n][static_cast<size_t>(o)] = sum;
    }
  return y;
}
inline Rows linear(const Rows& x, const Values& w, const Values* bias, bool in_out = false) {
  Rows y = linear(x, w, in_out);
  if (bias != nullptr)
    for (auto& row : y)
      for (size_t o = 0; o < row.size(); ++o) row[o] += bias->data[o];
  return y;
}
inline void add(Rows& x, const Rows& y) {
  for (size_t n = 0; n < x.size(); ++n)
    for (size_t i = 0; i < x[n].size(); ++i) x[n][i] += y[n][i];
}
inline Rows layer_norm(const Rows& x, const Values& g, const Values& b, double eps) {
  Rows y = x;
  for (auto& row : y) {
    double mean = 0, var = 0;
    for (double v : row) mean += v;
    mean /= static_cast<double>(row.size());
    for (double v : row) var += (v - mean) * (v - mean);
    var /= static_cast<double>(row.size());
    for (size_t i = 0; i < row.size(); ++i) row[i] = (row[i] - mean) / std::sqrt(var + eps) * g.data[i] + b.data[i];
  }
  return y;
}
inline Rows rms_norm(const Rows& x, const Values& g, double eps) {
  Rows y = x;
  for (auto& row : y) {
    double ms = 0;
    for (double v : row) ms += v * v;
    ms /= static_cast<double>(row.size());
    for (size_t i = 0; i < row.size(); ++i) row[i] = row[i] / std::sqrt(ms + eps) * g.data[i];
  }
  return y;
}
inline double act(double x, Activation a) {
  switch (a) {
    case Activation::GeluTanh:
      return 0.5 * x * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
    case Activation::GeluErf: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case Activation::Silu: return x / (1 + std::exp(-x));
    case Activation::Relu: return x > 0 ? x : 0;
  }
  return x;
}
inline void activate(Rows& x, Activation a) {
  for (auto& row : x)
    for (double& v : row) v = act(v, a);
}
inline Rows embedding(const Values& table, const std::vector<int64_t>& rows) {
  Rows x;
  for (int64_t r : rows)
    x.emplace_back(table.data.begin() + r * table.cols(), table.data.begin() + (r + 1) * table.cols());
  return x;
}

// softmax(q k^T / sqrt(hd), over the keys `visible` allows) v per head; GQA: head h reads kv head
// h / (heads / kv_heads). Appends the weights of each head to `weights`.
inline Rows attention(const Rows& q, const Rows& k, const Rows& v, int64_t heads, int64_t kv_heads, int64_t hd,
                      const std::function<bool(int64_t, int64_t)>& visible, std::vector<Rows>& weights) {
  const auto n = static_cast<int64_t>(q.size());
  Rows out(q.size(), std::vector<double>(static_cast<size_t>(heads * hd), 0.0));
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t g = h / (heads / kv_heads);
    Rows w(q.size(), std::vector<double>(q.size(), 0.0));
    for (int64_t i = 0; i < n; ++i) {
      std::vector<double> s(q.size(), -INFINITY);
      double top = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        if (!visible(i, j)) continue;
        double dot = 0;
        for (int64_t e = 0; e < hd; ++e) dot += q[i][h * hd + e] * k[j][g * hd + e];
        s[j] = dot / std::sqrt(static_cast<double>(hd));
        top = std::max(top, s[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += s[j] == -INFINITY ? 0 : std::exp(s[j] - top);
      for (int64_t j = 0; j < n; ++j) {
        w[i][j] = s[j] == -INFINITY ? 0 : std::exp(s[j] - top) / sum;
        for (int64_t e = 0; e < hd; ++e) out[i][h * hd + e] += w[i][j] * v[j][g * hd + e];
      }
    }
    weights.push_back(std::move(w));
  }
  return out;
}

// HF's apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), per head,
// token n at position n, angle n * inverse_frequencies[i] for features i and i + hd / 2.
inline void rotate(Rows& x, int64_t heads, int64_t hd, const std::vector<double>& inverse_frequencies) {
  for (size_t n = 0; n < x.size(); ++n)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < hd / 2; ++i) {
        const double angle = static_cast<double>(n) * inverse_frequencies[static_cast<size_t>(i)];
        double& a = x[n][h * hd + i];
        double& b = x[n][h * hd + i + hd / 2];
        const double a0 = a, b0 = b;
        a = a0 * std::cos(angle) - b0 * std::sin(angle);
        b = b0 * std::cos(angle) + a0 * std::sin(angle);
      }
}

}  // namespace oracle

inline OracleOutput gpt2_oracle(const ModelConfig& c, const Checkpoint& k, const std::vector<int64_t>& ids,
                                const std::string& p = "transformer.") {
  using namespace oracle;
  OracleOutput out;
  Rows x = embedding(k[p + "wte.weight"], ids);
  for (size_t n = 0; n < ids.size(); ++n)
    for (int64_t i = 0; i < c.hidden_size; ++i) x[n][i] += k[p + "wpe.weight"].at(static_cast<int64_t>(n), i);
  const int64_t d = c.hidden_size;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string L = p + "h." + std::to_string(l) + ".";
    const Rows h = layer_norm(x, k[L + "ln_1.weight"], k[L + "ln_1.bias"], c.norm_eps);
    const Rows qkv = linear(h, k[L + "attn.c_attn.weight"], &k[L + "attn.c_attn.bias"], true);
    Rows q, kk, v;
    for (const auto& row : qkv) {
      q.emplace_back(row.begin(), row.begin() + d);
      kk.emplace_back(row.begin() + d, row.begin() + 2 * d);
      v.emplace_back(row.begin() + 2 * d, row.end());
    }
    out.attention.emplace_back();
    const Rows a = attention(
        q, kk, v, c.num_heads, c.num_heads, c.head_dim, [](int64_t i, int64_t j) { return j <= i; },
        out.attention.back());
    add(x, linear(a, k[L + "attn.c_proj.weight"], &k[L + "attn.c_proj.bias"], true));
    Rows f = linear(layer_norm(x, k[L + "ln_2.weight"], k[L + "ln_2.bias"], c.norm_eps), k[L + "mlp.c_fc.weight"],
                    &k[L + "mlp.c_fc.bias"], true);
    activate(f, c.activation);
    add(x, linear(f, k[L + "mlp.c_proj.weight"], &k[L + "mlp.c_proj.bias"], true));
  }
  out.hidden = layer_norm(x, k[p + "ln_f.weight"], k[p + "ln_f.bias"], c.norm_eps);
  out.logits = linear(out.hidden, c.tie_word_embeddings ? k[p + "wte.weight"] : k["lm_head.weight"]);
  return out;
}

inline OracleOutput bert_oracle(const ModelConfig& c, const Checkpoint& k, const std::vector<int64_t>& ids,
                                const std::vector<int64_t>& types) {
  using namespace oracle;
  OracleOutput out;
  const bool mlm = c.architecture == Architecture::BertMaskedLM;
  const std::string p = mlm ? "bert." : "";
  Rows x = embedding(k[p + "embeddings.word_embeddings.weight"], ids);
  for (size_t n = 0; n < ids.size(); ++n)
    for (int64_t i = 0; i < c.hidden_size; ++i)
      x[n][i] += k[p + "embeddings.position_embeddings.weight"].at(static_cast<int64_t>(n), i) +
                 k[p + "embeddings.token_type_embeddings.weight"].at(types.empty() ? 0 : types[n], i);
  x = layer_norm(x, k[p + "embeddings.LayerNorm.weight"], k[p + "embeddings.LayerNorm.bias"], c.norm_eps);
  const auto dense = [&](const Rows& in, const std::string& name) {
    return linear(in, k[name + ".weight"], &k[name + ".bias"]);
  };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string L = p + "encoder.layer." + std::to_string(l) + ".";
    out.attention.emplace_back();
    Rows a = attention(
        dense(x, L + "attention.self.query"), dense(x, L + "attention.self.key"), dense(x, L + "attention.self.value"),
        c.num_heads, c.num_heads, c.head_dim, [](int64_t, int64_t) { return true; }, out.attention.back());
    a = dense(a, L + "attention.output.dense");
    add(a, x);
    x = layer_norm(a, k[L + "attention.output.LayerNorm.weight"], k[L + "attention.output.LayerNorm.bias"], c.norm_eps);
    Rows f = dense(x, L + "intermediate.dense");
    activate(f, c.activation);
    f = dense(f, L + "output.dense");
    add(f, x);
    x = layer_norm(f, k[L + "output.LayerNorm.weight"], k[L + "output.LayerNorm.bias"], c.norm_eps);
  }
  out.hidden = x;
  if (mlm) {
    Rows h = dense(x, "cls.predictions.transform.dense");
    activate(h, c.activation);
    h = layer_norm(h, k["cls.predictions.transform.LayerNorm.weight"], k["cls.predictions.transform.LayerNorm.bias"],
                   c.norm_eps);
    out.logits = linear(
        h, c.tie_word_embeddings ? k[p + "embeddings.word_embeddings.weight"] : k["cls.predictions.decoder.weight"],
        &k["cls.predictions.bias"]);
  }
  return out;
}

// Hugging Face's rope inverse frequencies, written from its rope utilities: default, linear, llama3.
inline std::vector<double> hf_inverse_frequencies(const ModelConfig& c) {
  std::vector<double> inv;
  for (int64_t i = 0; i < c.head_dim; i += 2)
    inv.push_back(1.0 / std::pow(c.rope_theta, static_cast<double>(i) / static_cast<double>(c.head_dim)));
  const RopeScaling& s = c.rope_scaling;
  if (s.kind == RopeScaling::Kind::Linear)
    for (double& f : inv) f /= s.factor;
  if (s.kind == RopeScaling::Kind::Llama3) {
    const double old_context = static_cast<double>(s.original_max_position_embeddings);
    const double low_freq_wavelen = old_context / s.low_freq_factor,
                 high_freq_wavelen = old_context / s.high_freq_factor;
    for (double& f : inv) {
      const double wavelen = 2 * std::numbers::pi / f;
      double scaled = wavelen > low_freq_wavelen ? f / s.factor : f;
      const double smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      const double smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
      const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
      f = medium ? smoothed : scaled;
    }
  }
  return inv;
}

inline OracleOutput llama_oracle(const ModelConfig& c, const Checkpoint& k, const std::vector<int64_t>& ids) {
  using namespace oracle;
  OracleOutput out;
  Rows x = embedding(k["model.embed_tokens.weight"], ids);
  const std::vector<double> inv = hf_inverse_frequencies(c);
  const auto proj = [&](const Rows& in, const std::string& name) {
    return linear(in, k[name + ".weight"], k.has(name + ".bias") ? &k[name + ".bias"] : nullptr);
  };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string L = "model.layers." + std::to_string(l) + ".";
    const Rows h = rms_norm(x, k[L + "input_layernorm.weight"], c.norm_eps);
    Rows q = proj(h, L + "self_attn.q_proj"), kk = proj(h, L + "self_attn.k_proj");
    const Rows v = proj(h, L + "self_attn.v_proj");
    rotate(q, c.num_heads, c.head_dim, inv);
    rotate(kk, c.num_kv_heads, c.head_dim, inv);
    const int64_t window = c.sliding_window > 0 && l >= c.sliding_window_from_layer ? c.sliding_window : 0;
    out.attention.emplace_back();
    const Rows a = attention(
        q, kk, v, c.num_heads, c.num_kv_heads, c.head_dim,
        [&](int64_t i, int64_t j) { return j <= i && (window == 0 || i - j < window); }, out.attention.back());
    add(x, proj(a, L + "self_attn.o_proj"));
    const Rows h2 = rms_norm(x, k[L + "post_attention_layernorm.weight"], c.norm_eps);
    Rows gate = proj(h2, L + "mlp.gate_proj");
    const Rows up = proj(h2, L + "mlp.up_proj");
    for (size_t n = 0; n < gate.size(); ++n)
      for (size_t i = 0; i < gate[n].size(); ++i) gate[n][i] = act(gate[n][i], c.activation) * up[n][i];
    add(x, proj(gate, L + "mlp.down_proj"));
  }
  out.hidden = rms_norm(x, k["model.norm.weight"], c.norm_eps);
  out.logits = linear(out.hidden, c.tie_word_embeddings ? k["model.embed_tokens.weight"] : k["lm_head.weight"]);
  return out;
}

}  // namespace qkv::models::testing
