"""Real models from Python: a Hugging Face model folder run on qkv's attention (docs/models.md).

    model = qkv.load_model("path/to/folder")          # config.json, model.safetensors, tokenizer.json
    ids = model.tokenize("The cat sat")
    out = model(ids, need_attention=True)            # out.logits (B, N, V), out.attention[l] (B, H, N, N)
    gen = model.generate("The cat", max_new_tokens=16)
    print(gen.text, gen.decode_tokens_per_second)
    gens = model.generate_batch(["The cat", "Once upon a time"], max_new_tokens=16)  # no padding, paged

    qkv.write_safetensors("model.safetensors", {"wte.weight": array, ...})

Architectures: GPT2LMHeadModel, BertModel, BertForMaskedLM, LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM. The weights are memory-mapped and read in their stored dtype (f32, bf16, f16);
the outputs are float32 numpy arrays. Every C++ call runs with the GIL released. Every bad
argument raises qkv.Error (a ValueError) naming it.
"""

import dataclasses
import math
import numbers
import os
from typing import Callable, List, NamedTuple, Optional

import numpy as np

from . import _core
from ._core import Error

__all__ = ["Generation", "Model", "ModelOutput", "load_model", "write_safetensors"]

_KV_DTYPES = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16",
              "int8": "int8", "i8": "int8", "int4": "int4", "i4": "int4"}
_INT64_MAX = 2**63 - 1


def _path(path, who):
    if not isinstance(path, (str, os.PathLike)):
        raise Error(f"{who}: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    return path


def _integer(value, name, who, low=None, high=None):
    """value as an int, refusing bools, floats and anything not integral; within [low, high]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise Error(f"{who}: {name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise Error(f"{who}: {name} is {value}; it must be {bounds}")
    return value


def _real(value, name, who):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise Error(f"{who}: {name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise Error(f"{who}: {name} is {value}; it must be finite")
    return value


def _boolean(value, name, who):
    if not isinstance(value, (bool, np.bool_)):
        raise Error(f"{who}: {name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def _as_numpy(x):
    if hasattr(x, "detach") and hasattr(x, "numpy"):  # a torch tensor, without importing torch
        return x.detach().cpu().numpy()
    return x


def _sequence(seq, name, who, vocab, where=""):
    """One sequence of token ids as a list of ints in [0, vocab)."""
    seq = _as_numpy(seq)
    if isinstance(seq, np.ndarray):
        if seq.dtype.kind not in "iu":
            raise Error(f"{who}: {name}{where} must hold integers, got a {seq.dtype} array")
        if seq.ndim != 1:
            raise Error(f"{who}: {name}{where} must be one sequence of ids, got an array of shape {seq.shape}")
        ids = seq.tolist()
    elif isinstance(seq, (list, tuple)):
        ids = []
        for i, token in enumerate(seq):
            token = _as_numpy(token)
            if isinstance(token, np.ndarray) and token.ndim == 0 and token.dtype.kind in "iu":
                token = token.item()
            if isinstance(token, (bool, np.bool_)) or not isinstance(token, numbers.Integral):
                raise Error(f"{who}: {name}{where} position {i} is {type(token).__name__} {token!r}, not a token id "
                            f"(an int)")
            ids.append(int(token))
    else:
        raise Error(f"{who}: {name}{where} must be a list of ints or an int array, got {type(seq).__name__}")
    if not ids:
        raise Error(f"{who}: {name}{where} is empty: give at least one token")
    if vocab is not None:
        for i, token in enumerate(ids):
            if not 0 <= token < vocab:
                raise Error(f"{who}: {name}{where} position {i} is token id {token}, outside the vocabulary "
                            f"[0, {vocab})")
    return ids


def _ids_or_none(ids, name, who, vocab):
    """A sequence of ids that may be empty (detokenize, tokens)."""
    ids = _as_numpy(ids)
    if isinstance(ids, (list, tuple, np.ndarray)) and len(ids) == 0:
        return []
    return _sequence(ids, name, who, vocab)


def _batch(ids, name, who, vocab):
    """ids as a batch: a list of ints (one sequence), a list of such lists, or an int array
    (N) or (B, N). Returns (list of lists of ints, whether the input was one sequence)."""
    ids = _as_numpy(ids)
    if isinstance(ids, np.ndarray):
        if ids.ndim == 2:
            if ids.shape[0] == 0:
                raise Error(f"{who}: {name} is empty: give at least one sequence")
            return [_sequence(row, name, who, vocab, f" sequence {b}") for b, row in enumerate(ids)], False
        return [_sequence(ids, name, who, vocab)], True
    if isinstance(ids, (list, tuple)):
        if not ids:
            raise Error(f"{who}: {name} is empty: give at least one token")
        first = _as_numpy(ids[0])
        nested = isinstance(first, (list, tuple)) or (isinstance(first, np.ndarray) and first.ndim >= 1)
        if nested:
            return [_sequence(row, name, who, vocab, f" sequence {b}") for b, row in enumerate(ids)], False
        return [_sequence(ids, name, who, vocab)], True
    raise Error(f"{who}: {name} must be a list of ints, a list of lists of ints or an int array (B, N), "
                f"got {type(ids).__name__}")


class ModelOutput(NamedTuple):
    """What Model(ids) returns. Rows of padding (positions past a shorter sequence's end in a
    ragged batch) are finite but meaningless; their attention rows and columns are zeros."""
    logits: Optional[np.ndarray]  # (B, N, vocab_size) float32; None for BertModel (no LM head)
    hidden: np.ndarray            # (B, N, hidden_size): the last hidden state (after the final norm)
    attention: Optional[List[np.ndarray]]  # need_attention: per layer, (B, num_heads, N, N)
    lengths: List[int]            # each sequence's number of tokens


@dataclasses.dataclass
class Generation:
    """What Model.generate returns."""
    tokens: List[int]              # the new tokens (the eos that stopped them included)
    text: Optional[str]            # the new tokens' text, special tokens left out (None without a tokenizer)
    prompt_ids: List[int]          # the prompt as the model saw it
    stopped_at_eos: bool
    prefill_seconds: float         # the prompt's forward and the first token's choice
    decode_seconds: float          # every later token's step
    prefill_tokens_per_second: float
    decode_tokens_per_second: float


class Model:
    """A Hugging Face model folder loaded by qkv.load_model: its config, tokenizer and weights."""

    def __init__(self, core):
        self._core = core
        self.config = core.config
        self.special_tokens = core.special_tokens

    path = property(lambda self: self._core.path)
    vocab_size = property(lambda self: self.config["vocab_size"])
    has_tokenizer = property(lambda self: self._core.has_tokenizer)

    def __repr__(self):
        c = self.config
        return (f"qkv.Model({c['architecture']}, layers={c['num_layers']}, heads={c['num_heads']}, "
                f"kv_heads={c['num_kv_heads']}, hidden={c['hidden_size']}, vocab={c['vocab_size']}, "
                f"path={self.path!r})")

    def _tokenizer_vocab(self, who):
        if not self._core.has_tokenizer:
            raise Error(f"{who}: the model was loaded without a tokenizer (tokenizer=False)")
        return self._core.tokenizer_vocab_size

    def tokenize(self, text, add_special_tokens=True):
        """The token ids of text (a str). add_special_tokens: what the tokenizer's post-processor adds
        around a sequence (BERT's [CLS] ... [SEP], Llama's BOS); special tokens written in the text
        are recognised as such either way."""
        who = "Model.tokenize"
        if not isinstance(text, str):
            raise Error(f"{who}: text must be a str, got {type(text).__name__}")
        add_special_tokens = _boolean(add_special_tokens, "add_special_tokens", who)
        self._tokenizer_vocab(who)
        return list(self._core.encode(text, add_special_tokens))

    def detokenize(self, ids, skip_special_tokens=False):
        """The text of a sequence of ids (bytes that are not valid UTF-8 become U+FFFD)."""
        who = "Model.detokenize"
        skip_special_tokens = _boolean(skip_special_tokens, "skip_special_tokens", who)
        ids = _ids_or_none(ids, "ids", who, self._tokenizer_vocab(who))
        return self._core.decode(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def tokens(self, ids):
        """Each id's spelling in the vocabulary ("Ġthe", "##ing", "[CLS]"): labels for plots."""
        who = "Model.tokens"
        ids = _ids_or_none(ids, "ids", who, self._tokenizer_vocab(who))
        return [t.decode("utf-8", errors="replace") for t in self._core.id_to_token(ids)]

    def _ids(self, ids, who):
        if isinstance(ids, str):
            return [self.tokenize(ids)], True
        return _batch(ids, "ids", who, self.vocab_size)

    def __call__(self, ids, need_attention=False, token_type_ids=None):
        """The full forward of a batch: causal models mask causally, BERT attends both ways.

        ids: a list of ints (one sequence), a list of lists (a batch; ragged lists run packed, no
          padding computed, or with need_attention right-padded and the padding masked out; the
          outputs are laid out padded either way), an int array (N) or (B, N), or a str.
        need_attention: also return each layer's attention weights (B, num_heads, N, N).
        token_type_ids: BERT's segment ids, shaped as ids (default all 0).
        Returns a ModelOutput (logits, hidden, attention, lengths), always batched (B, ...).
        """
        who = "Model"
        batch, _ = self._ids(ids, who)
        need_attention = _boolean(need_attention, "need_attention", who)
        types = []
        if token_type_ids is not None:
            if not self.config["type_vocab_size"]:
                raise Error(f"{who}: token_type_ids given, but {self.config['architecture']} has no token types")
            types, _ = _batch(token_type_ids, "token_type_ids", who, self.config["type_vocab_size"])
            if [len(t) for t in types] != [len(s) for s in batch]:
                raise Error(f"{who}: token_type_ids has sequences of lengths {[len(t) for t in types]}, but ids has "
                            f"{[len(s) for s in batch]}: give one type per token")
        logits, hidden, attention = self._core.forward(batch, types, need_attention)
        return ModelOutput(logits, hidden, attention if need_attention else None, [len(s) for s in batch])

    def generate(self, prompt, max_new_tokens=32, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_at_eos=True,
                 on_token: Optional[Callable[[int], Optional[bool]]] = None):
        """Continues prompt (a str, tokenized with the special tokens, or a list of ids) with up to
        max_new_tokens tokens through the KV cache (load_model's kv_dtype). temperature 0 is
        greedy (argmax); else sampled from softmax(logits / temperature), among the top_k most
        likely (0: all) and the fewest whose probability reaches top_p; the same seed gives the
        same tokens. on_token(id) is called with each new token; returning False stops.
        Returns a Generation (tokens, text, tokens per second of prefill and decode)."""
        who = "Model.generate"
        prompt_ids = self._prompt_ids(prompt, "prompt", who)
        options = self._generation_options(who, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos,
                                           on_token)
        return self._generation(self._core.generate(prompt_ids, *options), prompt_ids)

    def generate_batch(self, prompts, max_new_tokens=32, temperature=0.0, top_k=0, top_p=1.0, seed=0,
                       stop_at_eos=True, on_token: Optional[Callable[[int, int], Optional[bool]]] = None):
        """generate on several prompts at once, without padding: one packed prefill of every prompt,
        then one step for all unfinished sequences, each on its own pages of a paged KV cache
        (load_model's kv_dtype and page_size). Each prompt gets its own sampler seeded with seed, so
        prompt b gets generate(prompts[b], ...)'s tokens (in f32 up to ties in the last bits).
        on_token(index, id) is called with each new token of prompt `index`; returning False stops
        that prompt. Returns a list of Generation, one per prompt."""
        who = "Model.generate_batch"
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise Error(f"{who}: prompts must be a list of prompts (each a str or a list of ids), got "
                        f"{type(prompts).__name__}")
        prompt_ids = [self._prompt_ids(p, f"prompts[{b}]", who) for b, p in enumerate(prompts)]
        options = self._generation_options(who, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos,
                                           on_token)
        results = self._core.generate_batch(prompt_ids, *options)
        return [self._generation(r, ids) for r, ids in zip(results, prompt_ids)]

    def _prompt_ids(self, prompt, name, who):
        if not self.config["is_causal"]:
            raise Error(f"{who}: {self.config['architecture']} is not a causal language model")
        if isinstance(prompt, str):
            prompt_ids = self.tokenize(prompt)
            if not prompt_ids:
                raise Error(f"{who}: {name} {prompt!r} has no tokens")
            return prompt_ids
        return _sequence(prompt, name, who, self.vocab_size)

    @staticmethod
    def _generation_options(who, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos, on_token):
        max_new_tokens = _integer(max_new_tokens, "max_new_tokens", who, 0, _INT64_MAX)
        temperature = _real(temperature, "temperature", who)
        if temperature < 0:
            raise Error(f"{who}: temperature is {temperature}; it must be >= 0 (0: greedy)")
        top_k = _integer(top_k, "top_k", who, 0, _INT64_MAX)
        top_p = _real(top_p, "top_p", who)
        if not 0 < top_p <= 1:
            raise Error(f"{who}: top_p is {top_p}; it must be in (0, 1]")
        seed = _integer(seed, "seed", who, 0, 2**64 - 1)
        stop_at_eos = _boolean(stop_at_eos, "stop_at_eos", who)
        if on_token is not None and not callable(on_token):
            raise Error(f"{who}: on_token must be callable or None, got {type(on_token).__name__}")
        return max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos, on_token

    def _generation(self, r, prompt_ids):
        text = None
        if self._core.has_tokenizer:
            text = self._core.decode(r["tokens"], True).decode("utf-8", errors="replace")
        return Generation(tokens=list(r["tokens"]), text=text, prompt_ids=prompt_ids,
                          stopped_at_eos=r["stopped_at_eos"], prefill_seconds=r["prefill_seconds"],
                          decode_seconds=r["decode_seconds"],
                          prefill_tokens_per_second=r["prefill_tokens_per_second"],
                          decode_tokens_per_second=r["decode_tokens_per_second"])

    def head_roles(self, text, repeat_length=24, seed=0):
        """What each attention head does, measured on this model (include/qkv/models/head_roles.hpp):
        scores in [0, 1] for previous-token, first-token, self and broad on `text` (a str, or a list
        of ids), and induction on repeat_length random ordinary tokens repeated twice (drawn with
        seed). Returns one dict per head, layer by layer: {"layer", "head", "scores": {role: score},
        "role": the role whose score is furthest above its threshold, or None}."""
        who = "Model.head_roles"
        repeat_length = _integer(repeat_length, "repeat_length", who, 2, self.config["max_positions"])
        seed = _integer(seed, "seed", who, 0, 2**64 - 1)
        vocab = self._tokenizer_vocab(who)
        if isinstance(text, str):
            ids = self.tokenize(text)
        else:
            ids = _sequence(text, "text", who, self.vocab_size)
        # What the model expects first (a BOS, BERT's [CLS]) prefixes the repeated sequence too.
        prefix = []
        for token in self._core.encode("", True):
            if token < vocab and self._core.is_special(token) and ids[len(prefix):len(prefix) + 1] == [token]:
                prefix.append(token)
            else:
                break
        if len(ids) < 2:
            raise Error(f"{who}: text has {len(ids)} token(s); give at least 2")
        return self._core.head_roles(ids, prefix, self._core.ordinary_ids(), repeat_length, seed)


def load_model(path, kv_dtype="bf16", tokenizer=True, page_size=64):
    """Loads a Hugging Face model folder: config.json, model.safetensors (or its shards and
    model.safetensors.index.json) and tokenizer.json or tokenizer.model (tokenizer=False: none,
    pass ids). The weights are memory-mapped and used in place. kv_dtype: the dtype of
    generate()'s KV cache ("bf16", "f16", "f32", or quantized "int8" / "int4"); page_size: the
    pages of generate_batch()'s paged cache. Returns a qkv.Model."""
    who = "load_model"
    path = _path(path, who)
    if not isinstance(kv_dtype, str) or kv_dtype.lower() not in _KV_DTYPES:
        raise Error(f"{who}: kv_dtype must be \"bf16\", \"f16\", \"f32\", \"int8\" or \"int4\", got {kv_dtype!r}")
    tokenizer = _boolean(tokenizer, "tokenizer", who)
    page_size = _integer(page_size, "page_size", who, 1, 2**31 - 1)
    if not os.path.isdir(path):
        raise Error(f"{who}: {path!r} is not a directory: give a Hugging Face model folder (config.json, "
                    f"model.safetensors, tokenizer.json)")
    if not _core.is_model_folder(path):
        raise Error(f"{who}: {path!r} is not a model folder: it has no config.json")
    return Model(_core.ModelCore(path, _KV_DTYPES[kv_dtype.lower()], tokenizer, page_size))


# numpy dtype -> safetensors dtype, for arrays written as they are.
_NUMPY_DTYPES = {"float32": "F32", "float16": "F16", "float64": "F64", "int64": "I64", "int32": "I32",
                 "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_FLOAT_DTYPES = {"f32": "F32", "float32": "F32", "bf16": "BF16", "bfloat16": "BF16", "f16": "F16", "float16": "F16"}


def _bf16_bits(array):
    """float32 -> bfloat16 bits, rounded to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(array), np.uint16(0x7FC0), rounded)


def _tensor_bytes(name, value, dtype, who):
    """(safetensors dtype, shape, uint8 bytes) of one tensor."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
        value, dtype = value
    if str(getattr(value, "dtype", "")) == "torch.bfloat16":  # torch's bf16: its bits, as bf16
        import torch  # value is a torch tensor: torch is there

        value, dtype = value.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16), "bf16"
    array = np.asarray(_as_numpy(value))
    if array.dtype == object:
        raise Error(f"{who}: tensor {name!r} is not a numeric array")
    if dtype is None:
        if array.dtype == np.uint16:
            raise Error(f"{who}: tensor {name!r} is a uint16 array: say what its bits are with dtype=\"bf16\" or "
                        f"\"f16\" (e.g. write_safetensors(path, tensors, dtype=\"bf16\"), or ({name!r}: (bits, "
                        f"\"bf16\")))")
        stored = _NUMPY_DTYPES.get(array.dtype.name)
        if stored is None:
            raise Error(f"{who}: tensor {name!r} has dtype {array.dtype}, which safetensors cannot store")
        return stored, list(array.shape), np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    if not isinstance(dtype, str) or dtype.lower() not in _FLOAT_DTYPES:
        raise Error(f"{who}: dtype must be None, \"f32\", \"bf16\" or \"f16\", got {dtype!r} (tensor {name!r})")
    stored = _FLOAT_DTYPES[dtype.lower()]
    if array.dtype == np.uint16 and stored != "F32":  # the bits already
        bits = array
    elif array.dtype.kind in "fiu":
        if stored == "F32":
            bits = array.astype(np.float32)
        elif stored == "F16":
            bits = array.astype(np.float16)
        else:
            bits = _bf16_bits(array.astype(np.float32))
    else:
        raise Error(f"{who}: tensor {name!r} has dtype {array.dtype}, which cannot be written as {dtype}")
    return stored, list(array.shape), np.ascontiguousarray(bits).reshape(-1).view(np.uint8)


def write_safetensors(path, tensors, dtype=None):
    """Writes tensors ({name: array}) to a safetensors file at path, as Hugging Face reads it
    (atomically: a temporary file renamed over path). Arrays are stored in their own dtype
    (float32 -> F32, float16 -> F16, int64 -> I64, ...) unless dtype says "f32", "bf16" or "f16":
    then float arrays are converted (bf16 rounded to nearest even) and uint16 arrays are taken as
    the bits of that dtype. A value may also be a pair (array, dtype) for one tensor's own dtype;
    torch tensors are accepted (bfloat16 ones as bf16)."""
    who = "write_safetensors"
    path = _path(path, who)
    if not isinstance(tensors, dict):
        raise Error(f"{who}: tensors must be a dict {{name: array}}, got {type(tensors).__name__}")
    entries = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise Error(f"{who}: tensor names must be non-empty str, got {name!r}")
        stored, shape, data = _tensor_bytes(name, value, dtype, who)
        entries.append((name, stored, shape, data))
    _core.write_safetensors(path, entries)
