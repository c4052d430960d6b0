"""The real models' architectures in torch float64, written from the published equations, for
test_models.py: each takes the checkpoint's tensors (numpy, by their Hugging Face names, holding
exactly the values stored), a config dict and one sequence of ids, and returns
(logits or None, last hidden state, [attention weights (H, N, N) per layer]).

  GPT-2 (Radford et al. 2019): learned positions, pre-LayerNorm blocks, GELU-tanh MLP, Conv1D
    weights stored (in, out), final ln_f, the head tied to wte.
  Llama (Touvron et al. 2023): RMSNorm, rotary positions on half-split pairs (rotate_half),
    SwiGLU MLP, grouped-query attention, untied head.
  BERT (Devlin et al. 2019): word + position + token-type embeddings then LayerNorm, post-LN
    blocks, GELU-erf, bidirectional attention; BertForMaskedLM's head: LN(gelu(dense(x))) then
    the tied decoder plus cls.predictions.bias.
"""
import math

import torch
import torch.nn.functional as F


def _t(weights, name):
    return torch.from_numpy(weights[name]).to(torch.float64)


def _layer_norm(x, weights, name, eps):
    return F.layer_norm(x, (x.shape[-1],), _t(weights, name + ".weight"), _t(weights, name + ".bias"), eps)


def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _attend(q, k, v, causal):
    """q (H, N, D), k and v (H, N, D) (kv heads already repeated): (output (N, H * D), weights)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = weights @ v
    return out.transpose(0, 1).reshape(q.shape[1], -1), weights


def _heads(x, heads):
    """(N, heads * D) -> (heads, N, D)."""
    return x.reshape(x.shape[0], heads, -1).transpose(0, 1)


def gpt2(weights, config, ids):
    w = {name.replace("transformer.", "", 1): value for name, value in weights.items()}
    eps, heads = config["layer_norm_epsilon"], config["n_head"]
    d = config["n_embd"]
    x = _t(w, "wte.weight")[ids] + _t(w, "wpe.weight")[: len(ids)]
    attention = []
    for layer in range(config["n_layer"]):
        p = f"h.{layer}."
        h = _layer_norm(x, w, p + "ln_1", eps)
        qkv = h @ _t(w, p + "attn.c_attn.weight") + _t(w, p + "attn.c_attn.bias")  # Conv1D: (in, out)
        q, k, v = (_heads(part, heads) for part in qkv.split(d, dim=-1))
        a, weights_l = _attend(q, k, v, causal=True)
        attention.append(weights_l)
        x = x + a @ _t(w, p + "attn.c_proj.weight") + _t(w, p + "attn.c_proj.bias")
        h = _layer_norm(x, w, p + "ln_2", eps)
        h = F.gelu(h @ _t(w, p + "mlp.c_fc.weight") + _t(w, p + "mlp.c_fc.bias"), approximate="tanh")
        x = x + h @ _t(w, p + "mlp.c_proj.weight") + _t(w, p + "mlp.c_proj.bias")
    x = _layer_norm(x, w, "ln_f", eps)
    return x @ _t(w, "wte.weight").T, x, attention


def _rotate(x, theta):
    """Rotary positions on half-split pairs (x_i, x_{i + D/2}): x cos + rotate_half(x) sin."""
    dim = x.shape[-1]
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(x.shape[1], dtype=torch.float64)[:, None] * inv[None, :]  # (N, D/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def llama(weights, config, ids):
    w, eps = weights, config["rms_norm_eps"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    theta = config.get("rope_theta", 10000.0)
    x = _t(w, "model.embed_tokens.weight")[ids]
    attention = []
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = _rms_norm(x, _t(w, p + "input_layernorm.weight"), eps)
        q = _rotate(_heads(h @ _t(w, p + "self_attn.q_proj.weight").T, heads), theta)
        k = _rotate(_heads(h @ _t(w, p + "self_attn.k_proj.weight").T, kv_heads), theta)
        v = _heads(h @ _t(w, p + "self_attn.v_proj.weight").T, kv_heads)
        group = heads // kv_heads  # query head j reads kv head j // group
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        a, weights_l = _attend(q, k, v, causal=True)
        attention.append(weights_l)
        x = x + a @ _t(w, p + "self_attn.o_proj.weight").T
        h = _rms_norm(x, _t(w, p + "post_attention_layernorm.weight"), eps)
        gate = F.silu(h @ _t(w, p + "mlp.gate_proj.weight").T)
        x = x + (gate * (h @ _t(w, p + "mlp.up_proj.weight").T)) @ _t(w, p + "mlp.down_proj.weight").T
    x = _rms_norm(x, _t(w, "model.norm.weight"), eps)
    return x @ _t(w, "lm_head.weight").T, x, attention


def bert(weights, config, ids, token_type_ids=None):
    mlm = "bert.embeddings.word_embeddings.weight" in weights
    w = {(name[len("bert."):] if name.startswith("bert.") else name): value for name, value in weights.items()}
    eps, heads = config["layer_norm_eps"], config["num_attention_heads"]
    types = [0] * len(ids) if token_type_ids is None else token_type_ids

    def dense(x, name):
        return x @ _t(w, name + ".weight").T + _t(w, name + ".bias")

    x = (_t(w, "embeddings.word_embeddings.weight")[ids] + _t(w, "embeddings.position_embeddings.weight")[: len(ids)]
         + _t(w, "embeddings.token_type_embeddings.weight")[types])
    x = _layer_norm(x, w, "embeddings.LayerNorm", eps)
    attention = []
    for layer in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{layer}."
        q, k, v = (_heads(dense(x, p + "attention.self." + part), heads) for part in ("query", "key", "value"))
        a, weights_l = _attend(q, k, v, causal=False)
        attention.append(weights_l)
        x = _layer_norm(x + dense(a, p + "attention.output.dense"), w, p + "attention.output.LayerNorm", eps)
        h = F.gelu(dense(x, p + "intermediate.dense"))  # erf
        x = _layer_norm(x + dense(h, p + "output.dense"), w, p + "output.LayerNorm", eps)
    if not mlm:
        return None, x, attention
    h = F.gelu(dense(x, "cls.predictions.transform.dense"))
    h = _layer_norm(h, w, "cls.predictions.transform.LayerNorm", eps)
    return h @ _t(w, "embeddings.word_embeddings.weight").T + _t(w, "cls.predictions.bias"), x, attention
