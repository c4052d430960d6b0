// A GPT-2 whose weights are set by hand so that layer 0 head 0 is a previous-token head and
// layer 1 head 0 an induction head (and every other head uniform: broad), for the test that
// `qkv heads` names exactly those (models_cli.cmake: models_heads_hand_set; qkv_make_tiny_model
// FOLDER gpt2-induction writes the folder). Every weight below follows from the construction;
// nothing was tuned against the tool.
//
// The residual stream has d = 2V + P features in three blocks of one-hot codes (V the vocabulary,
// P the positions):
//   T = [0, V)          the token: wte[t] = e_t
//   Q = [V, V + P)      the position: wpe[p] = e_{V + p}
//   R = [V + P, 2V + P) the previous token, written by layer 0 head 0
// Two heads of hd = d / 2 >= V, P features. LayerNorms have weight 1 and bias 0, the MLPs
// (n_inner 1) are zero and add nothing, and head 1 of each layer is zero (q = k = 0: uniform
// weights; v = 0: it writes nothing).
//
// Layer 0. Its input x_i = e_{t_i} + e_{V+i} has mean mu0 = 2/d and variance 2/d - mu0^2 for every
// i, so ln_1(x_i) = (x_i - mu0) / s0 with one s0 = sqrt(2/d - mu0^2 + eps). Head 0 reads it with
//   q_i[c] = L0 s0^2 sqrt(hd) y_i[V + c + 1] + bias  =  L0 s0 sqrt(hd) [i = c + 1]   (c < P - 1)
//   k_j[c] = y_j[V + c] + bias                       =  [j = c] / s0                (c < P)
// the biases cancelling the LayerNorm's -mu0 / s0. So the scaled score q_i.k_j / sqrt(hd) is L0 for
// j = i - 1 and 0 for every other key: with L0 = 20 and at most P - 1 = 63 other keys, row i >= 1
// puts at least 1 - 63 e^-20 > 1 - 2e-7 of its weight on i - 1 (row 0 sees only itself). Its
// values v_j[c] = s0 y_j[c] + mu0 = [c = t_j] (c < V), and c_proj copies them to block R: layer 0
// adds rho_i = sum_j w_ij e_{t_j}, that is e_{t_{i-1}} (row 0: e_{t_0}), to R.
//
// Layer 1. Its input x_i = e_{t_i} + e_{V+i} + rho_i has mean mu1 = 3/d (rho sums to 1) and variance
// (2 + |rho_i|^2)/d - mu1^2, within 4e-7 of (3/d - mu1^2) since rho_i is one-hot to 2e-7; s1 is
// the square root of that plus eps. Head 0 matches the query's token against the keys' previous
// tokens:
//   q_i[c] = L1 s1^2 sqrt(hd) y_i[c] + bias    ~= L1 s1 sqrt(hd) [c = t_i]   (c < V)
//   k_j[c] = y_j[V + P + c] + bias             ~= rho_j[c] / s1
// the biases cancelling -mu1 / s1 (exactly where |rho| = 1, to 1e-6 elsewhere). The scaled score
// is L1 rho_j[t_i]: L1 (to 1e-6) for a key whose previous token is the query's token, at most
// L1 * 2e-7 for any other. On r r (T random tokens twice), query T + t (token r_t) finds that key
// at t + 1, the next token after r_t's first occurrence: an induction head. L1 = 20 puts more
// than 1 - 63 e^-20 of the row there when the match is unique; a token drawn twice, or equal to
// r_0 (key 0's rho is e_{r_0}), shares the row between its matches, which lowers the mean a little.
//
// `qkv heads` then scores head (0, 0) previous-token ~1, head (1, 0) induction ~0.9-1, and the two
// zero heads uniform: broad 1, every other score at most 1 / 2 on average.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint.hpp"

namespace qkv::models::testing {

// config.json of the hand-set GPT-2 for a tokenizer of `vocab` ids.
inline std::string induction_config_json(int64_t vocab) {
  const int64_t positions = 64, d = 2 * vocab + positions;
  return R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": )" + std::to_string(vocab) +
         R"(, "n_embd": )" + std::to_string(d) + R"(, "n_layer": 2, "n_head": 2, "n_positions": )" +
         std::to_string(positions) + R"(, "n_inner": 1, "layer_norm_epsilon": 1e-5,
      "activation_function": "gelu_new", "tie_word_embeddings": true})";
}

inline Checkpoint induction_checkpoint(const ModelConfig& c) {
  const int64_t V = c.vocab_size, P = c.max_positions, d = c.hidden_size, hd = c.head_dim;
  const int64_t T0 = 0, Q0 = V, R0 = V + P;  // the blocks
  const double eps = c.norm_eps, logit = 20;  // L0 = L1 = 20
  const double mu0 = 2.0 / static_cast<double>(d), s0 = std::sqrt(2.0 / static_cast<double>(d) - mu0 * mu0 + eps);
  const double mu1 = 3.0 / static_cast<double>(d), s1 = std::sqrt(3.0 / static_cast<double>(d) - mu1 * mu1 + eps);
  const double root = std::sqrt(static_cast<double>(hd));
  Checkpoint k;
  const auto put = [&](const std::string& name, const std::vector<int64_t>& shape, std::vector<float> v) {
    k.values[name] = k.weights->add(name, shape, v, DType::F32);
  };
  const auto zeros = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n), 0.0f); };
  const auto ones = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n), 1.0f); };

  std::vector<float> wte = zeros(V * d), wpe = zeros(P * d);
  for (int64_t t = 0; t < V; ++t) wte[static_cast<size_t>(t * d + T0 + t)] = 1;
  for (int64_t p = 0; p < P; ++p) wpe[static_cast<size_t>(p * d + Q0 + p)] = 1;
  put("transformer.wte.weight", {V, d}, wte);
  put("transformer.wpe.weight", {P, d}, wpe);

  for (int64_t layer = 0; layer < 2; ++layer) {
    const std::string l = "transformer.h." + std::to_string(layer) + ".";
    // c_attn (d, 3d), Conv1D: qkv = y W + b; head 0's q, k, v are columns [0, hd), [d, d + hd), [2d, 2d + hd).
    std::vector<float> w = zeros(d * 3 * d), b = zeros(3 * d), proj = zeros(d * d);
    const auto at = [&](int64_t row, int64_t col) -> float& { return w[static_cast<size_t>(row * 3 * d + col)]; };
    if (layer == 0) {
      const double a = logit * s0 * s0 * root;
      for (int64_t c = 0; c + 1 < P; ++c) {  // q_i = (a / s0) e_{i-1}
        at(Q0 + c + 1, c) = static_cast<float>(a);
        b[static_cast<size_t>(c)] = static_cast<float>(a * mu0 / s0);
      }
      for (int64_t c = 0; c < P; ++c) {  // k_j = e_j / s0
        at(Q0 + c, d + c) = 1;
        b[static_cast<size_t>(d + c)] = static_cast<float>(mu0 / s0);
      }
      for (int64_t c = 0; c < V; ++c) {  // v_j = e_{t_j}
        at(T0 + c, 2 * d + c) = static_cast<float>(s0);
        b[static_cast<size_t>(2 * d + c)] = static_cast<float>(mu0);
      }
      for (int64_t c = 0; c < V; ++c) proj[static_cast<size_t>(c * d + R0 + c)] = 1;  // head 0's output to R
    } else {
      const double a = logit * s1 * s1 * root;
      for (int64_t c = 0; c < V; ++c) {
        at(T0 + c, c) = static_cast<float>(a);  // q_i ~ (a / s1) e_{t_i}
        b[static_cast<size_t>(c)] = static_cast<float>(a * mu1 / s1);
        at(R0 + c, d + c) = 1;  // k_j ~ rho_j / s1
        b[static_cast<size_t>(d + c)] = static_cast<float>(mu1 / s1);
      }  // v = 0 and c_proj = 0: the last layer's head need write nothing
    }
    put(l + "ln_1.weight", {d}, ones(d));
    put(l + "ln_1.bias", {d}, zeros(d));
    put(l + "attn.c_attn.weight", {d, 3 * d}, w);
    put(l + "attn.c_attn.bias", {3 * d}, b);
    put(l + "attn.c_proj.weight", {d, d}, proj);
    put(l + "attn.c_proj.bias", {d}, zeros(d));
    put(l + "ln_2.weight", {d}, ones(d));
    put(l + "ln_2.bias", {d}, zeros(d));
    put(l + "mlp.c_fc.weight", {d, c.intermediate_size}, zeros(d * c.intermediate_size));
    put(l + "mlp.c_fc.bias", {c.intermediate_size}, zeros(c.intermediate_size));
    put(l + "mlp.c_proj.weight", {c.intermediate_size, d}, zeros(c.intermediate_size * d));
    put(l + "mlp.c_proj.bias", {d}, zeros(d));
  }
  put("transformer.ln_f.weight", {d}, ones(d));
  put("transformer.ln_f.bias", {d}, zeros(d));
  return k;
}

}  // namespace qkv::models::testing
