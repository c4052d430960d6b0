#!/usr/bin/python3
"""qkv against PyTorch on the same checkpoints: prefill and decode tokens/s side by side.

Runs qkv_model_benchmark (--json --dir DIR), which writes random SmolLM2-135M- and GPT-2-shaped
checkpoints (model.safetensors + config.json, bf16 and f32) and times qkv on them; then builds the
same architectures from torch 1.13 modules (written here from the equations: RMSNorm, RoPE
rotate_half, SwiGLU, grouped-query attention; GPT-2's pre-norm blocks with Conv1D weights), loads
the very same safetensors files (parsed by hand: 8-byte header length, JSON, raw bytes viewed with
numpy/torch), and times prefill (one forward of the prompt) and decode (single-token steps on a
torch KV cache) the way the benchmark does. torch computes in the stored dtype (--torch-f32: in
float32 whatever the file holds).

    OMP_NUM_THREADS=2 /usr/bin/python3 bench/compare_models_torch.py --benchmark build/release/bench/qkv_model_benchmark
"""
import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F


def read_safetensors(path):
    """{name: tensor} viewing the file's bytes (BF16 through int16 bits, as numpy has no bfloat16)."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    buffer = np.frombuffer(data, dtype=np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = buffer[base + begin:base + end]
        if info["dtype"] == "F32":
            t = torch.from_numpy(raw.view(np.float32).copy())
        elif info["dtype"] == "F16":
            t = torch.from_numpy(raw.view(np.float16).copy())
        elif info["dtype"] == "BF16":
            t = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
        else:
            raise ValueError(f"{path}: {name} has dtype {info['dtype']}")
        out[name] = t.reshape(info["shape"])
    return out


def rms_norm(x, weight, eps):
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Llama(torch.nn.Module):
    def __init__(self, config, w, dtype):
        super().__init__()
        self.c = config
        self.d = config["hidden_size"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads", self.heads)
        self.hd = config.get("head_dim", self.d // self.heads)
        self.eps = config.get("rms_norm_eps", 1e-6)
        g = lambda name: torch.nn.Parameter(w[name].to(dtype), requires_grad=False)
        self.embed = g("model.embed_tokens.weight")
        self.layers = []
        for i in range(config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            self.layers.append({k: g(p + n) for k, n in [
                ("in_norm", "input_layernorm.weight"), ("post_norm", "post_attention_layernorm.weight"),
                ("q", "self_attn.q_proj.weight"), ("k", "self_attn.k_proj.weight"),
                ("v", "self_attn.v_proj.weight"), ("o", "self_attn.o_proj.weight"),
                ("gate", "mlp.gate_proj.weight"), ("up", "mlp.up_proj.weight"), ("down", "mlp.down_proj.weight")]})
        self.norm = g("model.norm.weight")
        self.lm_head = self.embed if config.get("tie_word_embeddings", False) else g("lm_head.weight")
        theta = config.get("rope_theta", 10000.0)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        self.dtype = dtype

    def forward(self, ids, cache, position):
        """Logits of the last of ids (1, n), which follow `position` cached tokens; cache grows."""
        n = ids.shape[1]
        x = F.embedding(ids, self.embed)
        t = torch.arange(position, position + n, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        for i, L in enumerate(self.layers):
            h = rms_norm(x, L["in_norm"], self.eps)
            q = F.linear(h, L["q"]).view(1, n, self.heads, self.hd).transpose(1, 2)
            k = F.linear(h, L["k"]).view(1, n, self.kv_heads, self.hd).transpose(1, 2)
            v = F.linear(h, L["v"]).view(1, n, self.kv_heads, self.hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if i in cache:
                k = torch.cat((cache[i][0], k), dim=2)
                v = torch.cat((cache[i][1], v), dim=2)
            cache[i] = (k, v)
            group = self.heads // self.kv_heads
            kk = k.repeat_interleave(group, dim=1)
            vv = v.repeat_interleave(group, dim=1)
            scores = torch.matmul(q, kk.transpose(2, 3)) / math.sqrt(self.hd)
            if n > 1:
                mask = torch.ones(n, position + n, dtype=torch.bool).tril(position)
                scores = scores.masked_fill(~mask, float("-inf"))
            attn = torch.matmul(torch.softmax(scores.float(), dim=-1).to(self.dtype), vv)
            x = x + F.linear(attn.transpose(1, 2).reshape(1, n, self.heads * self.hd), L["o"])
            h = rms_norm(x, L["post_norm"], self.eps)
            x = x + F.linear(F.silu(F.linear(h, L["gate"])) * F.linear(h, L["up"]), L["down"])
        x = rms_norm(x[:, -1:], self.norm, self.eps)
        return F.linear(x, self.lm_head)


class Gpt2(torch.nn.Module):
    def __init__(self, config, w, dtype):
        super().__init__()
        self.d = config["n_embd"]
        self.heads = config["n_head"]
        self.hd = self.d // self.heads
        self.eps = config.get("layer_norm_epsilon", 1e-5)
        p = "transformer." if "transformer.wte.weight" in w else ""
        g = lambda name: torch.nn.Parameter(w[name].to(dtype), requires_grad=False)
        self.wte, self.wpe = g(p + "wte.weight"), g(p + "wpe.weight")
        self.layers = []
        for i in range(config["n_layer"]):
            q = f"{p}h.{i}."
            self.layers.append({k: g(q + k) for k in [
                "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                "mlp.c_proj.weight", "mlp.c_proj.bias"]})
        self.ln_f = (g(p + "ln_f.weight"), g(p + "ln_f.bias"))
        self.dtype = dtype

    def forward(self, ids, cache, position):
        n = ids.shape[1]
        x = F.embedding(ids, self.wte) + self.wpe[position:position + n]
        conv1d = lambda h, w, b: torch.addmm(b, h.reshape(-1, h.shape[-1]), w).view(*h.shape[:-1], w.shape[1])
        for i, L in enumerate(self.layers):
            h = F.layer_norm(x, (self.d,), L["ln_1.weight"], L["ln_1.bias"], self.eps)
            q, k, v = conv1d(h, L["attn.c_attn.weight"], L["attn.c_attn.bias"]).split(self.d, dim=2)
            q, k, v = (t.view(1, n, self.heads, self.hd).transpose(1, 2) for t in (q, k, v))
            if i in cache:
                k = torch.cat((cache[i][0], k), dim=2)
                v = torch.cat((cache[i][1], v), dim=2)
            cache[i] = (k, v)
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.hd)
            if n > 1:
                mask = torch.ones(n, position + n, dtype=torch.bool).tril(position)
                scores = scores.masked_fill(~mask, float("-inf"))
            attn = torch.matmul(torch.softmax(scores.float(), dim=-1).to(self.dtype), v)
            x = x + conv1d(attn.transpose(1, 2).reshape(1, n, self.d), L["attn.c_proj.weight"], L["attn.c_proj.bias"])
            h = F.layer_norm(x, (self.d,), L["ln_2.weight"], L["ln_2.bias"], self.eps)
            h = F.gelu(conv1d(h, L["mlp.c_fc.weight"], L["mlp.c_fc.bias"]), approximate="tanh")
            x = x + conv1d(h, L["mlp.c_proj.weight"], L["mlp.c_proj.bias"])
        x = F.layer_norm(x[:, -1:], (self.d,), self.ln_f[0], self.ln_f[1], self.eps)
        return F.linear(x, self.wte)


def prompt_of(n, vocab):  # the benchmark's prompt_of
    return torch.tensor([[(i * 7919 + 13) % vocab for i in range(n)]], dtype=torch.long)


def time_torch(model, vocab, prefill, context, steps, runs):
    """(prefill seconds, decode seconds per token): medians of `runs`."""
    prefills, decodes = [], []
    with torch.no_grad():
        model(prompt_of(8, vocab), {}, 0)  # warm-up
        for _ in range(runs):
            start = time.perf_counter()
            logits = model(prompt_of(prefill, vocab), {}, 0)
            logits.argmax(-1)
            prefills.append(time.perf_counter() - start)
        for _ in range(1 if context > 1024 else runs):
            cache = {}
            token = model(prompt_of(context, vocab), cache, 0).argmax(-1)
            start = time.perf_counter()
            for s in range(steps):
                token = model(token.view(1, 1), cache, context + s).argmax(-1)
            decodes.append((time.perf_counter() - start) / steps)
    return statistics.median(prefills), statistics.median(decodes)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmark", default="build/release/bench/qkv_model_benchmark")
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--models", default="smollm2-135m,gpt2")
    parser.add_argument("--dtypes", default="bf16,f32")
    parser.add_argument("--contexts", default="512")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--qkv-json", help="also write the benchmark's JSON lines to this file")
    parser.add_argument("--torch-f32", action="store_true", help="torch computes in float32 whatever is stored")
    args = parser.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    folder = args.dir or tempfile.mkdtemp(prefix="qkv_compare_")
    command = [args.benchmark, "--json", "--dir", folder, "--models", args.models, "--dtypes", args.dtypes,
               "--contexts", args.contexts, "--prefill", str(args.prefill), "--steps", str(args.steps),
               "--runs", str(args.runs)]
    print("running", " ".join(command), file=sys.stderr)
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    if args.qkv_json:
        with open(args.qkv_json, "w") as f:
            f.write(output)
    rows = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    qkv = {(r["model"], r["dtype"], r["kind"], r["context"]): r for r in rows if r["kind"] != "env"}
    peak = next(r["fma_peak_gflops"] for r in rows if r["kind"] == "env")
    print(f"torch {torch.__version__}, {threads} threads; tokens/s (median of {args.runs}); prefill against "
          f"the benchmark's FMA peak ({peak:.1f} GFLOP/s, f32), the same FLOPs for both")
    print(f"{'model':14} {'dtype':5} {'what':12} {'qkv':>9} {'torch':>9} {'x torch':>8} "
          f"{'qkv x peak':>10} {'torch x peak':>12}")
    for model_name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            path = os.path.join(folder, f"{model_name}-{dtype_name}")
            with open(os.path.join(path, "config.json")) as f:
                config = json.load(f)
            weights = read_safetensors(os.path.join(path, "model.safetensors"))
            dtype = torch.float32 if args.torch_f32 or dtype_name == "f32" else (
                torch.bfloat16 if dtype_name == "bf16" else torch.float16)
            model = (Gpt2 if model_name == "gpt2" else Llama)(config, weights, dtype)
            positions = config.get("n_positions", config.get("max_position_embeddings"))
            for context in [int(c) for c in args.contexts.split(",")]:
                if context + args.steps > positions:
                    continue
                prefill_s, decode_s = time_torch(model, config["vocab_size"], args.prefill, context, args.steps,
                                                 args.runs)
                q_prefill = qkv.get((model_name, dtype_name, "prefill", args.prefill))
                q_decode = qkv.get((model_name, dtype_name, "decode", context))
                if context == int(args.contexts.split(",")[0]) and q_prefill:
                    t = args.prefill / prefill_s
                    q_t = q_prefill['tokens_per_second']
                    torch_peak = q_prefill['gflops'] * t / q_t / peak  # the benchmark's FLOPs per token
                    print(f"{model_name:14} {dtype_name:5} {'prefill ' + str(args.prefill):12} "
                          f"{q_t:9.1f} {t:9.1f} {q_t / t:8.2f} {q_prefill['x_peak']:10.2f} {torch_peak:12.2f}")
                if q_decode:
                    t = 1 / decode_s
                    print(f"{model_name:14} {dtype_name:5} {'decode@' + str(context):12} "
                          f"{q_decode['tokens_per_second']:9.1f} {t:9.1f} {q_decode['tokens_per_second'] / t:8.2f}")
            del model, weights
    if not args.dir:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
