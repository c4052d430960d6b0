"""qkv.load_model and qkv.write_safetensors: tiny random checkpoints written in the Hugging Face
layout (config.json, model.safetensors, tokenizer.json) into a temporary folder, loaded back and
checked against torch float64 implementations of the published equations (model_reference.py):
logits to 1e-4 relative, attention weights to 1e-5; greedy generation against the argmax of the
full recomputation; tokenizers' round trips; every bad argument a qkv.Error naming it."""
import json
import struct
import threading

import numpy as np
import pytest
import torch

import model_reference
import qkv

# ---- tokenizer.json files


def byte_to_unicode():
    """GPT-2's printable alphabet for the 256 bytes (tokenizers' ByteLevel)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def special(token_id, content):
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def byte_level_tokenizer(merges, specials, bos=None):
    """A byte-level BPE: byte b is id b, each merge's result the next id, then the specials; with
    bos, a post-processor putting it before every sequence (Llama 3's). Returns (json, vocab size)."""
    alphabet = byte_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    added = [special(len(vocab) + i, s) for i, s in enumerate(specials)]
    ids = {a["content"]: a["id"] for a in added}
    post = None
    if bos is not None:
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos: {"id": bos, "ids": [ids[bos]], "tokens": [bos]}}}
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": level,
                 "post_processor": post, "decoder": level,
                 "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                           "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]}}
    return tokenizer, len(vocab) + len(specials)


MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "c"), ("a", "t"), ("Ġc", "at"), ("Ġ", "s"), ("Ġs", "at")]
BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "dog", "##s", "a",
              ",", "."]


def wordpiece_tokenizer():
    vocab = {token: i for i, token in enumerate(BERT_VOCAB)}
    post = {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                       {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                               "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}}
    return {"version": "1.0", "added_tokens": [special(i, BERT_VOCAB[i]) for i in range(5)],
            "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                           "strip_accents": None, "lowercase": True},
            "pre_tokenizer": {"type": "BertPreTokenizer"}, "post_processor": post,
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
            "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                      "max_input_chars_per_word": 100, "vocab": vocab}}


# ---- checkpoints


def uniform(rng, shape, scale, center=0.0):
    return (center + scale * rng.uniform(-1, 1, shape)).astype(np.float32)


def gpt2_checkpoint(rng, vocab, d=16, layers=2, heads=2, positions=32, inner=24):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab, "n_embd": d,
              "n_layer": layers, "n_head": heads, "n_positions": positions, "n_inner": inner,
              "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "bos_token_id": vocab - 1,
              "eos_token_id": vocab - 1}
    s = d ** -0.5
    w = {"transformer.wte.weight": uniform(rng, (vocab, d), 0.5),
         "transformer.wpe.weight": uniform(rng, (positions, d), 0.3)}
    for layer in range(layers):
        p = f"transformer.h.{layer}."
        w.update({p + "ln_1.weight": uniform(rng, d, 0.2, 1), p + "ln_1.bias": uniform(rng, d, 0.1),
                  p + "attn.c_attn.weight": uniform(rng, (d, 3 * d), 2 * s),
                  p + "attn.c_attn.bias": uniform(rng, 3 * d, 0.1),
                  p + "attn.c_proj.weight": uniform(rng, (d, d), s), p + "attn.c_proj.bias": uniform(rng, d, 0.1),
                  p + "ln_2.weight": uniform(rng, d, 0.2, 1), p + "ln_2.bias": uniform(rng, d, 0.1),
                  p + "mlp.c_fc.weight": uniform(rng, (d, inner), s), p + "mlp.c_fc.bias": uniform(rng, inner, 0.1),
                  p + "mlp.c_proj.weight": uniform(rng, (inner, d), inner ** -0.5),
                  p + "mlp.c_proj.bias": uniform(rng, d, 0.1)})
    w.update({"transformer.ln_f.weight": uniform(rng, d, 0.2, 1), "transformer.ln_f.bias": uniform(rng, d, 0.1)})
    return config, w


def llama_checkpoint(rng, vocab, eos, bos, d=24, layers=2, heads=4, kv_heads=2, head_dim=8, inner=20):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": d,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "intermediate_size": inner, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-6, "rope_theta": 500.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "bos_token_id": bos, "eos_token_id": eos}
    w = {"model.embed_tokens.weight": uniform(rng, (vocab, d), 1.0)}

    def proj(name, out, inp):
        w[name + ".weight"] = uniform(rng, (out, inp), 1.5 / inp ** 0.5)

    for layer in range(layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = uniform(rng, d, 0.2, 1)
        w[p + "post_attention_layernorm.weight"] = uniform(rng, d, 0.2, 1)
        proj(p + "self_attn.q_proj", heads * head_dim, d)
        proj(p + "self_attn.k_proj", kv_heads * head_dim, d)
        proj(p + "self_attn.v_proj", kv_heads * head_dim, d)
        proj(p + "self_attn.o_proj", d, heads * head_dim)
        proj(p + "mlp.gate_proj", inner, d)
        proj(p + "mlp.up_proj", inner, d)
        proj(p + "mlp.down_proj", d, inner)
    w["model.norm.weight"] = uniform(rng, d, 0.2, 1)
    w["lm_head.weight"] = uniform(rng, (vocab, d), d ** -0.5)
    return config, w


def bert_checkpoint(rng, vocab, mlm, d=16, layers=2, heads=2, inner=24, positions=32):
    config = {"architectures": ["BertForMaskedLM" if mlm else "BertModel"], "model_type": "bert",
              "vocab_size": vocab, "hidden_size": d, "num_hidden_layers": layers, "num_attention_heads": heads,
              "intermediate_size": inner, "max_position_embeddings": positions, "type_vocab_size": 2,
              "layer_norm_eps": 1e-12, "hidden_act": "gelu", "pad_token_id": 0}
    p = "bert." if mlm else ""
    w = {}

    def dense(name, out, inp):
        w[name + ".weight"] = uniform(rng, (out, inp), 1.5 / inp ** 0.5)
        w[name + ".bias"] = uniform(rng, out, 0.1)

    def norm(name):
        w[name + ".weight"] = uniform(rng, d, 0.2, 1)
        w[name + ".bias"] = uniform(rng, d, 0.1)

    w[p + "embeddings.word_embeddings.weight"] = uniform(rng, (vocab, d), 0.5)
    w[p + "embeddings.position_embeddings.weight"] = uniform(rng, (positions, d), 0.3)
    w[p + "embeddings.token_type_embeddings.weight"] = uniform(rng, (2, d), 0.3)
    norm(p + "embeddings.LayerNorm")
    for layer in range(layers):
        q = f"{p}encoder.layer.{layer}."
        for part in ("query", "key", "value"):
            dense(q + "attention.self." + part, d, d)
        dense(q + "attention.output.dense", d, d)
        norm(q + "attention.output.LayerNorm")
        dense(q + "intermediate.dense", inner, d)
        dense(q + "output.dense", d, inner)
        norm(q + "output.LayerNorm")
    if mlm:
        dense("cls.predictions.transform.dense", d, d)
        norm("cls.predictions.transform.LayerNorm")
        w["cls.predictions.bias"] = uniform(rng, vocab, 0.1)
    return config, w


def write_folder(folder, config, weights, tokenizer, dtype=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    qkv.write_safetensors(folder / "model.safetensors", weights, dtype=dtype)
    return folder


def stored(weights, dtype):
    """What a checkpoint written in dtype holds, as float32 (torch rounds to bf16 as the format does)."""
    if dtype is None:
        return weights
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    return {n: torch.from_numpy(a).to(torch_dtype).to(torch.float32).numpy() for n, a in weights.items()}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    tokenizer, vocab = byte_level_tokenizer(MERGES, ["<|endoftext|>"])
    config, weights = gpt2_checkpoint(np.random.default_rng(1), vocab)
    folder = write_folder(tmp_path_factory.mktemp("gpt2"), config, weights, tokenizer)
    return qkv.load_model(folder, kv_dtype="f32"), config, weights


@pytest.fixture(scope="module", params=[None, "bf16"])
def llama(tmp_path_factory, request):
    tokenizer, vocab = byte_level_tokenizer(MERGES, ["<|begin_of_text|>", "<|end_of_text|>"], bos="<|begin_of_text|>")
    config, weights = llama_checkpoint(np.random.default_rng(2), vocab, eos=vocab - 1, bos=vocab - 2)
    folder = write_folder(tmp_path_factory.mktemp("llama"), config, weights, tokenizer, dtype=request.param)
    return qkv.load_model(folder, kv_dtype="f32"), config, stored(weights, request.param)


@pytest.fixture(scope="module", params=[True, False], ids=["BertForMaskedLM", "BertModel"])
def bert(tmp_path_factory, request):
    config, weights = bert_checkpoint(np.random.default_rng(3), len(BERT_VOCAB), mlm=request.param)
    folder = write_folder(tmp_path_factory.mktemp("bert"), config, weights, wordpiece_tokenizer())
    return qkv.load_model(folder), config, weights


def assert_relative(actual, expected, rtol=1e-4):
    expected = np.asarray(expected, dtype=np.float64)
    error = np.abs(np.asarray(actual, dtype=np.float64) - expected).max() / np.abs(expected).max()
    assert error <= rtol, f"max error {error:.3g} relative to the largest value, over {rtol}"


def check_against(model, reference, ids, **kwargs):
    """The model's logits (or hidden state) and attention on one sequence against the torch oracle."""
    out = model(ids, need_attention=True, **kwargs)
    ref_logits, ref_hidden, ref_attention = reference
    if ref_logits is None:
        assert out.logits is None
        assert_relative(out.hidden[0], ref_hidden)
    else:
        assert out.logits.shape == (1, len(ids), model.vocab_size) and out.logits.dtype == np.float32
        assert_relative(out.logits[0], ref_logits)
    assert len(out.attention) == model.config["num_layers"]
    for got, want in zip(out.attention, ref_attention):
        assert got.shape == (1, model.config["num_heads"], len(ids), len(ids))
        np.testing.assert_allclose(got.sum(-1), 1, atol=1e-5)
        np.testing.assert_allclose(got[0], want.numpy(), atol=1e-5)
    return out


# ---- the architectures against torch


def test_gpt2_matches_torch(gpt2):
    model, config, weights = gpt2
    assert model.config["architecture"] == "GPT2LMHeadModel" and model.config["num_layers"] == 2
    assert model.config["vocab_size"] == 256 + len(MERGES) + 1 and model.config["is_causal"]
    ids = model.tokenize("the cat sat on the mat")
    out = check_against(model, model_reference.gpt2(weights, config, ids), ids)
    assert (np.triu(out.attention[0][0, 0], 1) == 0).all()  # causal
    assert out.hidden.shape == (1, len(ids), config["n_embd"])


def test_llama_matches_torch(llama):
    model, config, weights = llama
    assert model.config["architecture"] == "LlamaForCausalLM"
    assert (model.config["num_heads"], model.config["num_kv_heads"], model.config["head_dim"]) == (4, 2, 8)
    ids = model.tokenize("The cat sat on the mat.")
    assert ids[0] == config["bos_token_id"]
    check_against(model, model_reference.llama(weights, config, ids), ids)


def test_bert_matches_torch(bert):
    model, config, weights = bert
    ids = model.tokenize("The cat sat on the mat, a dog sat.")
    assert model.tokens(ids)[:3] == ["[CLS]", "the", "cat"] and ids[-1] == 3
    types = [0] * 6 + [1] * (len(ids) - 6)
    out = check_against(model, model_reference.bert(weights, config, ids, types), ids, token_type_ids=types)
    assert (out.attention[0] > 0).all()  # bidirectional
    assert (out.logits is None) == (config["architectures"] == ["BertModel"])


def test_ragged_batch_equals_each_sequence(gpt2, bert):
    for model, _, _ in (gpt2, bert):
        texts = ["the cat sat on the mat", "the cat", "a dog"]
        batch = [model.tokenize(t) for t in texts]
        out = model(batch, need_attention=True)
        assert out.lengths == [len(s) for s in batch]
        assert out.hidden.shape[:2] == (3, max(out.lengths))
        for b, ids in enumerate(batch):
            one = model(ids, need_attention=True)
            n = len(ids)
            np.testing.assert_allclose(out.hidden[b, :n], one.hidden[0], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(out.attention[1][b, :, :n, :n], one.attention[1][0], atol=1e-6)
            assert (out.attention[1][b, :, :, n:] == 0).all()
    # An int array (B, N) is a batch, the same as its rows as lists.
    model = gpt2[0]
    array = np.array([model.tokenize("the cat sat"), model.tokenize("a hat, a mat")[:4]], dtype=np.int32)
    np.testing.assert_array_equal(model(array).logits, model(array.tolist()).logits)
    np.testing.assert_array_equal(model(torch.from_numpy(array)).logits, model(array.tolist()).logits)
    np.testing.assert_array_equal(model("the cat").logits, model(model.tokenize("the cat")).logits)


# ---- generation


def test_greedy_generation_is_argmax_of_recomputation(gpt2, llama):
    for model in (gpt2[0], llama[0]):
        check_greedy(model)


def check_greedy(model):
    gen = model.generate("the cat", max_new_tokens=8, stop_at_eos=False)
    assert len(gen.tokens) == 8 and not gen.stopped_at_eos
    ids = list(gen.prompt_ids)
    for token in gen.tokens:
        # The argmax of the recomputation, or a token within its rounding of it: the cached step
        # and the full forward sum in different orders (kernels chosen per CPU), so a near tie may
        # go either way; any other token is far below.
        row = model(ids).logits[0, -1]
        best = float(row.max())
        assert float(row[token]) >= best - 1e-4 * max(1.0, abs(best)), (token, int(np.argmax(row)))
        ids.append(token)
    assert gen.text == model.detokenize(gen.tokens, skip_special_tokens=True)
    assert gen.prefill_tokens_per_second > 0 and gen.decode_tokens_per_second > 0
    assert gen.prefill_seconds > 0 and gen.decode_seconds > 0
    # ids as the prompt give the same
    assert model.generate(gen.prompt_ids, max_new_tokens=8, stop_at_eos=False).tokens == gen.tokens


def test_sampling_and_on_token(gpt2):
    model = gpt2[0]
    a = model.generate("the", max_new_tokens=12, temperature=1.5, top_k=50, top_p=0.9, seed=7, stop_at_eos=False)
    b = model.generate("the", max_new_tokens=12, temperature=1.5, top_k=50, top_p=0.9, seed=7, stop_at_eos=False)
    assert a.tokens == b.tokens
    seen = []
    short = model.generate("the", max_new_tokens=12, temperature=1.5, top_k=50, top_p=0.9, seed=7,
                           stop_at_eos=False, on_token=lambda t: seen.append(t) or len(seen) < 3)
    assert seen == a.tokens[:3] and short.tokens == seen

    def fail(token):
        raise KeyError("stop here")

    with pytest.raises(KeyError, match="stop here"):
        model.generate("the", max_new_tokens=4, on_token=fail)


def test_generate_batch_gives_each_prompt_its_own_generation(gpt2, llama, tmp_path):
    """Prompts of different lengths at once, on pages: each gets generate()'s tokens (greedy and
    sampled), on_token sees (index, token) and stops one prompt alone."""
    for model in (gpt2[0], llama[0]):
        prompts = ["the cat sat on the mat", "a", model.tokenize("the dog")]
        for kwargs in ({}, {"temperature": 1.2, "top_k": 20, "seed": 3}):
            gens = model.generate_batch(prompts, max_new_tokens=6, stop_at_eos=False, **kwargs)
            assert len(gens) == 3
            for prompt, gen in zip(prompts, gens):
                alone = model.generate(prompt, max_new_tokens=6, stop_at_eos=False, **kwargs)
                assert gen.tokens == alone.tokens and gen.prompt_ids == alone.prompt_ids
                assert gen.text == alone.text
        seen = []
        gens = model.generate_batch(prompts, max_new_tokens=6, stop_at_eos=False,
                                    on_token=lambda b, t: seen.append((b, t)) or b != 1)
        assert [len(g.tokens) for g in gens] == [6, 1, 6]
        assert [t for b, t in seen if b == 0] == gens[0].tokens

    def fail(index, token):
        raise KeyError("stop the batch")

    with pytest.raises(KeyError, match="stop the batch"):
        gpt2[0].generate_batch(["the", "a cat"], max_new_tokens=4, on_token=fail)
    # int8 pages of 3 positions: the same machinery on a quantized pool
    quantized = qkv.load_model(gpt2[0].path, kv_dtype="int8", page_size=3)
    gens = quantized.generate_batch(["the cat", "a"], max_new_tokens=5, stop_at_eos=False)
    assert [len(g.tokens) for g in gens] == [5, 5]


def test_calls_from_threads(gpt2):
    """The GIL is released around the C++ work: threads run models (and callbacks) side by side."""
    model = gpt2[0]
    ids = model.tokenize("the cat sat on the mat")
    expected = model(ids).logits
    results, errors = [], []

    def run():
        try:
            results.append(model(ids).logits)
            model.generate(ids, max_new_tokens=3, on_token=lambda t: None)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for r in results:
        np.testing.assert_array_equal(r, expected)


# ---- tokenizers


def test_tokenize_round_trips(gpt2, llama, bert):
    model = gpt2[0]
    for text in ["the cat sat", " the  cat\n", "héllo 🙂 日本", ""]:
        ids = model.tokenize(text, add_special_tokens=False)
        assert model.detokenize(ids) == text
    assert model.tokens(model.tokenize(" the cat")) == ["Ġthe", "Ġcat"]
    assert model.tokenize("the<|endoftext|>")[-1] == model.vocab_size - 1  # specials in the text
    assert model.special_tokens["eos"] == model.vocab_size - 1
    llama_model = llama[0]
    ids = llama_model.tokenize("the cat")
    assert llama_model.tokens(ids) == ["<|begin_of_text|>", "t", "he", "Ġcat"]  # no t+he merge
    assert llama_model.detokenize(ids, skip_special_tokens=True) == "the cat"
    assert llama_model.tokenize("the cat", add_special_tokens=False) == ids[1:]
    bert_model = bert[0]
    ids = bert_model.tokenize("The cats sat.")
    assert bert_model.tokens(ids) == ["[CLS]", "the", "cat", "##s", "sat", ".", "[SEP]"]
    assert bert_model.detokenize(ids, skip_special_tokens=True) == "the cats sat."
    assert bert_model.detokenize(np.array([], dtype=np.int64)) == ""


# ---- head roles


def test_head_roles(gpt2, bert):
    for model, _, _ in (gpt2, bert):
        text = "the cat sat on the mat, a dog sat on the cat." if model is bert[0] else "the cat sat on the mat"
        roles = model.head_roles(text, repeat_length=6, seed=1)
        c = model.config
        assert [(r["layer"], r["head"]) for r in roles] == [(l, h) for l in range(c["num_layers"])
                                                            for h in range(c["num_heads"])]
        for r in roles:
            assert set(r["scores"]) == {"previous-token", "first-token", "self", "induction", "broad"}
            assert all(0 <= s <= 1 + 1e-6 for s in r["scores"].values())
            assert r["role"] is None or r["role"] in r["scores"]
        # previous-token: the mean over rows i >= 1 of w[i][i-1] on the text
        weights = model(model.tokenize(text), need_attention=True).attention[1][0, 1]
        expected = np.mean([weights[i, i - 1] for i in range(1, weights.shape[0])])
        assert roles[c["num_heads"] + 1]["scores"]["previous-token"] == pytest.approx(expected, abs=1e-5)


# ---- write_safetensors


def read_safetensors(path):
    """An independent reader: {name: (dtype, shape, bytes)}."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return {name: (h["dtype"], h["shape"], data[8 + n + h["data_offsets"][0]:8 + n + h["data_offsets"][1]])
            for name, h in header.items()}


def test_write_safetensors(tmp_path):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    bits = torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    path = tmp_path / "t.safetensors"
    qkv.write_safetensors(path, {"a": a, "ids": ids, "half": a.astype(np.float16), "bits": (bits, "bf16"),
                                 "rounded": (a.astype(np.float64), "bf16"),
                                 "torch": torch.from_numpy(a).to(torch.bfloat16)})
    got = read_safetensors(path)
    assert got["a"] == ("F32", [3, 5], a.tobytes())
    assert got["ids"] == ("I64", [2, 3], ids.tobytes())
    assert got["half"] == ("F16", [3, 5], a.astype(np.float16).tobytes())
    for name in ("bits", "rounded", "torch"):  # the same bf16 bits, whichever way given
        assert got[name] == ("BF16", [3, 5], bits.tobytes()), name
    qkv.write_safetensors(str(path), {"x": a}, dtype="bf16")
    assert read_safetensors(path)["x"] == ("BF16", [3, 5], bits.tobytes())


# ---- errors


def raises(match, call, *args, **kwargs):
    with pytest.raises(qkv.Error, match=match):
        call(*args, **kwargs)


def test_bad_arguments(gpt2, bert, tmp_path):
    model, bert_model = gpt2[0], bert[0]
    v = model.vocab_size
    raises("ids is empty", model, [])
    raises("sequence 1 is empty", model, [[1, 2], []])
    raises("position 1 is float", model, [1, 2.5])
    raises("position 0 is bool", model, [True])
    raises(f"token id {v}, outside the vocabulary", model, [1, v])
    raises("token id -1", model, [[1], [-1]])
    raises("must hold integers", model, np.zeros((2, 3)))
    raises("ids must be", model, 3)
    raises("ids must be", model, None)
    raises("need_attention must be True or False", model, [1], need_attention="yes")
    raises("has no token types", model, [1], token_type_ids=[0])
    raises("token_type_ids sequence 0 position 0 is token id 2", bert_model, [2, 5], token_type_ids=[[2, 0]])
    raises("one type per token", bert_model, [2, 5], token_type_ids=[0])
    raises("max_position", model, list(range(40)))
    raises("text must be a str", model.tokenize, b"bytes")
    raises("add_special_tokens must be True or False", model.tokenize, "x", add_special_tokens=None)
    raises(f"token id {v + 1}", model.detokenize, [v + 1])
    raises("position 0 is str", model.tokens, ["the"])
    raises("prompt is empty", model.generate, [])
    raises("temperature is -1.0", model.generate, "the", temperature=-1)
    raises("temperature must be a number", model.generate, "the", temperature="hot")
    raises("top_p is 0.0", model.generate, "the", top_p=0)
    raises("top_k is -1", model.generate, "the", top_k=-1)
    raises("max_new_tokens must be an int", model.generate, "the", max_new_tokens=1.5)
    raises("seed is -3", model.generate, "the", seed=-3)
    raises("on_token must be callable", model.generate, "the", on_token=5)
    raises("not a causal language model", bert_model.generate, "the")
    raises("repeat_length is 1", model.head_roles, "the cat", repeat_length=1)
    raises("give at least 2", model.head_roles, [5])
    # load_model
    raises("path must be a str", qkv.load_model, 3)
    raises("is not a directory", qkv.load_model, tmp_path / "missing")
    raises("it has no config.json", qkv.load_model, tmp_path)
    raises("kv_dtype must be", qkv.load_model, tmp_path, kv_dtype="int2")
    raises("page_size is 0", qkv.load_model, tmp_path, page_size=0)
    # generate_batch
    raises("prompts must be a list", model.generate_batch, "the")
    raises(r"prompts\[1\] is empty", model.generate_batch, ["the", []])
    raises(f"token id {v}", model.generate_batch, [[1], [1, v]])
    raises("not a causal language model", bert_model.generate_batch, ["the"])
    raises("max_new_tokens 40 is outside", model.generate_batch, ["the", "the cat"], max_new_tokens=40)
    raises("tokenizer must be True or False", qkv.load_model, tmp_path, tokenizer="yes")
    # write_safetensors
    raises("tensors must be a dict", qkv.write_safetensors, tmp_path / "x.safetensors", [np.zeros(2)])
    raises("names must be non-empty str", qkv.write_safetensors, tmp_path / "x.safetensors", {1: np.zeros(2)})
    raises("uint16 array", qkv.write_safetensors, tmp_path / "x.safetensors", {"a": np.zeros(2, np.uint16)})
    raises("dtype must be None", qkv.write_safetensors, tmp_path / "x.safetensors", {"a": np.zeros(2)}, dtype="i8")
    raises("not a numeric array", qkv.write_safetensors, tmp_path / "x.safetensors", {"a": np.array([None])})


def test_bad_folders(tmp_path):
    tokenizer, vocab = byte_level_tokenizer(MERGES, ["<|endoftext|>"])
    config, weights = gpt2_checkpoint(np.random.default_rng(5), vocab, layers=1)
    folder = write_folder(tmp_path / "gpt2", config, weights, tokenizer)
    # No tokenizer: an error naming the files looked for, unless tokenizer=False (then ids only).
    (folder / "tokenizer.json").unlink()
    raises("tokenizer.json", qkv.load_model, folder)
    model = qkv.load_model(folder, tokenizer=False)
    assert model(list(range(5))).logits.shape == (1, 5, vocab)
    assert model.generate([1, 2], max_new_tokens=2, stop_at_eos=False).text is None
    raises("without a tokenizer", model.tokenize, "the")
    # A weight missing or misshaped: the tensor named.
    del weights["transformer.h.0.mlp.c_fc.bias"]
    qkv.write_safetensors(folder / "model.safetensors", weights)
    raises("transformer.h.0.mlp.c_fc.bias", qkv.load_model, folder, tokenizer=False)
    # A config that is not one.
    (folder / "config.json").write_text('{"model_type": "gpt5"}')
    raises("gpt5", qkv.load_model, folder, tokenizer=False)
