"""qkv: scaled dot-product attention and multi-head attention, from numpy.

The functions here follow PyTorch's conventions so that code moves between the two unchanged:

  scaled_dot_product_attention(q, k, v, ...)   torch.nn.functional.scaled_dot_product_attention
  scaled_dot_product_attention_backward(...)   its gradients (dq, dk, dv, and dbias for a float
                                               attn_mask), from the forward's output and row
                                               statistics (return_lse=True)
  MultiHeadAttention(embed_dim, num_heads)     torch.nn.MultiheadAttention (batch_first=True); also
                                               attention="linear", rotary=..., causal=True
  qkv.torch.scaled_dot_product_attention       the same on torch tensors (imported on use,
                                               only when torch is installed)
  linear_attention(q, k, v, ...)               linear attention (Katharopoulos et al. 2020), O(N);
                                               its backward: linear_attention_backward; on torch
                                               tensors: qkv.torch.linear_attention

Inputs are numpy arrays (or anything np.asarray accepts, torch tensors included). dtypes follow
PyTorch: query, key, value (and gradients, parameters) must be float32; float64 (and float16) is
an error unless the call says allow_cast=True, integer and bool inputs always are. Masks are
bool or float of any precision. float32 C-contiguous arrays are read in place; strided ones are
copied first. Outputs are float32 arrays. Bad input raises qkv.Error, a ValueError, with the
library's message naming the shapes involved.

A query that sees no key at all gets an output of zeros and weights of zeros (PyTorch 1.13
returns NaN there).
"""

import contextlib
import functools
import importlib
import importlib.util
import numbers
import re
import threading

import numpy as np

from . import _core
from ._core import Backend, Error, Mask, MaskParseError
from .models import Generation, Model, ModelOutput, load_model, write_safetensors  # real models: models.py

__version__ = _core.__version__
for _name in ("Backend", "Error", "Mask", "MaskParseError"):
    getattr(_core, _name).__module__ = __name__  # shown as qkv.Error, not qkv._core.Error

__all__ = [
    "Backend", "Error", "KVCache", "Mask", "MaskParseError", "MultiHeadAttention", "RotaryEmbedding",
    "attention_summary", "create_causal_mask", "create_padding_mask", "dropout_keeps", "entropy", "head_entropy",
    "linear_attention", "linear_attention_backward", "manual_seed", "scaled_dot_product_attention", "scaled_dot_product_attention_backward",
    "QuantizedKV", "quantize_kv", "cascade_attention", "PagedKVCache",
]

_INT64 = (-2**63, 2**63 - 1)


def _named_errors(function, who):
    """function with pybind11's TypeError for arguments it cannot convert (whose message prints
    every argument, arrays in full, and which `except qkv.Error` misses) turned into a qkv.Error
    naming each argument given, briefly, and the signature function takes."""
    signature = (function.__doc__ or "").split("\n", 1)[0]
    names = re.findall(r"(?:\(|, )(\w+):", signature)

    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except _core.ArrayError as error:  # an array argument refused by the binding, which knows no names
            raise Error(f"{who}: {error}") from None
        except TypeError as error:
            if "incompatible" not in str(error):
                raise
            given = [f"{name} = {_brief(value)}" for name, value in list(zip(names, args)) + list(kwargs.items())
                     if name != "self"]
            raise Error(f"{who}: cannot take {', '.join(given) or 'these arguments'}; it takes {signature}") from None

    return call


def _check_arguments_of_core():
    """Every function and method of _core that user code reaches raises qkv.Error for arguments
    of the wrong type (see _named_errors)."""
    for cls, methods in ((Mask, ("causal", "window", "key_lengths", "keep", "additive", "strided",
                                 "global_tokens", "block_sparse", "parse")),):
        for name in methods:
            setattr(cls, name, staticmethod(_named_errors(getattr(cls, name), f"Mask.{name}")))
    for cls, methods in ((_core.RotaryEmbedding, ("__init__", "apply")), (_core.KVCache, ("__init__",)),
                         (_core.MultiHeadAttentionCore, ("__init__", "forward", "backward", "backward_self",
                                                         "load_state_dict", "make_cache", "forward_cached",
                                                         "forward_packed"))):
        for name in methods:
            setattr(cls, name, _named_errors(getattr(cls, name), f"{cls.__name__}.{name}"))
    for name in ("attention", "attention_backward", "attention_half_kv", "attention_quantized_kv", "cascade_attention",
                 "linear_attention",
                 "linear_attention_backward", "create_causal_mask", "create_padding_mask", "row_entropy",
                 "head_entropy"):
        setattr(_core, name, _named_errors(getattr(_core, name), name))


_check_arguments_of_core()
dropout_keeps = _named_errors(_core.dropout_keeps, "dropout_keeps")
manual_seed = _named_errors(_core.manual_seed, "manual_seed")


def _brief(value):
    """value as an error message shows it: an array by its dtype and shape, never its elements."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"a {value.dtype} array of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(value, name, low=_INT64[0], high=_INT64[1]):
    """value as an int in [low, high], else a qkv.Error naming it (a float, a bool or a string is
    not an integer: int() would truncate or parse it)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or \
            not low <= int(value) <= high:
        raise Error(f"{name} must be an integer in [{low}, {high}], got {_brief(value)}")
    return int(value)


def _float(value, name):
    """value as a float (any real number, numpy's included), else a qkv.Error naming it."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise Error(f"{name} must be a number, got {_brief(value)}")
    return float(value)


def _int_list(values, name):
    """A sequence (or array, or single integer) of integers as a list of ints, else a qkv.Error."""
    try:
        array = np.asarray(values.detach().cpu().numpy() if hasattr(values, "detach") else values)
    except (TypeError, ValueError):
        array = None
    if array is None or array.ndim > 1 or not (array.dtype.kind in "iu" or (
            array.dtype.kind == "f" and np.all(np.mod(array, 1) == 0))):
        raise Error(f"{name} must be a sequence of integers, got {_brief(values)}")
    array = array.reshape(-1)
    return [_int(int(n), f"{name}[{i}]") for i, n in enumerate(array)]


# The fields of qkv::AttentionOptions the binding exposes (include/qkv/attention.hpp). PyTorch's
# own arguments set four of them (attn_mask, is_causal, key_lengths and window make the mask);
# every other field is a keyword of each function that attends (**options), under its own name.
_OPTION_FIELDS = frozenset(name for name, field in vars(_core.AttentionOptions).items() if isinstance(field, property))
_OPTION_KEYWORDS = _OPTION_FIELDS - {"mask", "need_weights", "scale", "dropout_p"}


def _options(who, keywords, **arguments):
    """qkv::AttentionOptions from the caller's option keywords (a dict) and the fields the function's
    own arguments give: the one place a keyword becomes an option. An unknown keyword, or a value
    its field cannot take, is a qkv.Error naming the keyword, what it takes (the field's
    docstring) and the value; the ranges (0 <= dropout_p < 1, scale > 0, ...) are the core's to
    check, when it is called."""
    unknown = sorted(set(keywords) - _OPTION_KEYWORDS)
    if unknown:
        raise Error(f"{who}: unexpected keyword argument(s) {', '.join(map(repr, unknown))} (the options are "
                    f"{', '.join(sorted(_OPTION_KEYWORDS))})")
    return _filled(_core.AttentionOptions(), who, {**arguments, **keywords})


def _filled(options, who, values):
    """options (a bound options struct) with each field set from values. A value its field cannot
    take is a qkv.Error naming the field, what it takes (its docstring) and the value."""
    for name, value in values.items():
        try:
            setattr(options, name, value)
        except Error:
            raise  # the binding's own message, which names the field
        except (TypeError, ValueError, OverflowError):
            raise Error(f"{who}: {name} must be {getattr(type(options), name).__doc__}, got {_brief(value)}") from None
    return options


def _as_array(x, name):
    """numpy view of x (nothing copied); torch tensors (detached, on the CPU) are accepted too.
    Its dtype must be a number's or bool and it has at most 4 dims (B, H, N, D): checked here, on
    the metadata, before anything is copied or cast."""
    if x is None:
        raise Error(f"{name} is None: an array is needed")
    try:
        if hasattr(x, "detach") and hasattr(x, "numpy"):  # a torch tensor, without importing torch
            x = x.detach().cpu().numpy()
        array = np.asarray(x)
    except (TypeError, ValueError) as error:
        raise Error(f"{name} cannot be read as an array ({error}): got {_brief(x)}") from None
    if array.dtype.kind not in "biuf":
        raise Error(f"{name} is {_brief(array)}: qkv reads numbers (float32, or bool masks)")
    if array.ndim > 4:
        raise Error(f"{name} is {array.shape}: qkv's arrays have at most 4 dims (B, H, N, D)")
    return array


def _as_float32(x, name, allow_cast=False):
    """x as a float32 array, by PyTorch's dtype rules: float32 as is; float64/float16 an error
    unless allow_cast (then converted); integer, bool and other dtypes always an error."""
    array = _as_array(x, name)
    if array.dtype == np.float32:
        return array
    if array.dtype.kind == "f":
        if allow_cast:
            return array.astype(np.float32)
        raise Error(f"{name} is {array.dtype}, but qkv computes in float32 (as PyTorch, it does not mix "
                    f"dtypes): pass allow_cast=True to convert, or {name}.astype(numpy.float32)")
    raise Error(f"{name} is {array.dtype}: attention needs float inputs (float32, or float64 with "
                f"allow_cast=True); PyTorch refuses integer and bool inputs too")


def _tensor_mask(mask, rank, name, true_means_attend):
    """A bool or float mask array as a qkv.Mask over scores of `rank` dims.

    bool: True = attend when true_means_attend (SDPA), True = masked otherwise
    (nn.MultiheadAttention). float: added to the scaled scores (-inf = masked).
    The array is aligned to the scores numpy-style: missing leading dims become 1.
    """
    mask = _as_array(mask, name)
    if mask.ndim < rank:
        mask = mask.reshape((1,) * (rank - mask.ndim) + mask.shape)
    if mask.dtype == np.bool_:
        return Mask.keep(mask if true_means_attend else ~mask)
    if np.issubdtype(mask.dtype, np.floating):
        return Mask.additive(mask.astype(np.float32, copy=False))
    raise Error(f"{name} must be bool or float, got {mask.dtype}")


def _window(window):
    """window=left or (left, right) as a Mask."""
    if isinstance(window, numbers.Integral) and not isinstance(window, (bool, np.bool_)):
        return Mask.window(_int(window, "window"), 0)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise Error(f"window must be an integer left or a pair (left, right), got {_brief(window)}")
    return Mask.window(_int(window[0], "window left"), _int(window[1], "window right"))


def _mask_from(query, attn_mask=None, is_causal=False, key_lengths=None, window=None):
    """The qkv.Mask that scaled_dot_product_attention's mask arguments describe."""
    mask = Mask()
    if attn_mask is not None:
        if isinstance(attn_mask, str):  # a mask expression, "causal & (window(127) | strided(128))"
            attn_mask = Mask.parse(attn_mask)
        mask = mask & (attn_mask if isinstance(attn_mask, Mask)
                       else _tensor_mask(attn_mask, query.ndim, "attn_mask", true_means_attend=True))
    if is_causal:
        mask = mask & Mask.causal()
    if window is not None:
        mask = mask & _window(window)
    if key_lengths is not None:
        mask = mask & Mask.key_lengths(_int_list(key_lengths, "key_lengths"))
    return mask


def _check_gqa(query, key, enable_gqa):
    if not enable_gqa and len(query.shape) == 4 and len(key.shape) == 4 and query.shape[1] != key.shape[1]:
        raise Error(f"scaled_dot_product_attention: query has {query.shape[1]} heads but key has "
                    f"{key.shape[1]}: pass enable_gqa=True for grouped-query attention")


def _tempered_scale(scale, temperature, query, who):
    """The scale with a softmax temperature folded in: scale / temperature (scale defaulting to
    1 / sqrt(Dk)), so the weights are softmax(q.k * scale / T). temperature None or 1 leaves the
    scale as given (None: the core's default)."""
    if temperature is None:
        return scale
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise Error(f"{who}: temperature must be a real number above 0, got {_brief(temperature)}")
    t = float(temperature)
    if not (t > 0 and np.isfinite(t)):
        raise Error(f"{who}: temperature must be finite and above 0, got {t}")
    if t == 1:
        return scale
    if scale is None:
        dk = np.shape(query)[-1] if np.ndim(query) else 0
        if dk <= 0:
            return scale  # the core names the bad shape
        scale = 1.0 / np.sqrt(float(dk))
    return float(scale) / t


def _half_bits(x):
    """(uint16 bits, "bf16" / "f16") of a 16-bit float array or tensor (numpy float16, torch
    float16 or bfloat16), else None."""
    dtype = str(getattr(x, "dtype", ""))
    if dtype in ("torch.bfloat16", "torch.float16"):  # a torch tensor, without importing torch
        import torch  # x is a torch tensor: torch is there

        bits = x.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
        return bits, "bf16" if dtype == "torch.bfloat16" else "f16"
    if isinstance(x, np.ndarray) and x.dtype == np.float16:
        return np.ascontiguousarray(x).view(np.uint16), "f16"
    return None


class QuantizedKV:
    """Keys or values quantized by qkv.quantize_kv: `values` (uint8 bytes: int8 of shape
    x.shape, or int4 pairs of shape x.shape[:-1] + (D // 2,)) and `scales` (float32, x.shape[:-1] +
    (1,) for int8, + (ceil(D / 32),) for int4), the format of docs/inference.md. Attention takes
    it wherever key or value go (both quantized, the same dtype)."""

    def __init__(self, values, scales, dtype):
        self.values, self.scales, self.dtype = values, scales, dtype

    @property
    def shape(self):
        """The shape of the float array it stands for."""
        last = self.values.shape[-1] * (2 if self.dtype == "int4" else 1)
        return tuple(self.values.shape[:-1]) + (last,)

    def dequantize(self):
        """The float32 values it stands for (q * scale), exactly as the kernels read them."""
        return _core.dequantize_kv(self.values, self.scales, self.dtype)

    def __repr__(self):
        return f"qkv.QuantizedKV(shape={self.shape}, dtype={self.dtype!r})"


def quantize_kv(x, dtype):
    """x (float32 array or tensor, finite, last dim D) quantized for attention's key or value:
    "int8" (a scale per row: max|row| / 127, error <= max|row| / 254) or "int4" (D even, a scale
    per group of 32 along D: max|group| / 7, error <= max|group| / 14). Returns a qkv.QuantizedKV."""
    if dtype not in ("int8", "int4"):
        raise Error(f"quantize_kv: dtype must be \"int8\" or \"int4\", got {_brief(dtype)}")
    values, scales = _core.quantize_kv(_as_float32(x, "x", False), dtype)
    return QuantizedKV(values, scales, dtype)


def _quantized_attention(query, key, value, need_weights, dropout_p, return_row_stats, return_lse, allow_cast,
                         enable_gqa, mask_args, scale, options):
    """scaled_dot_product_attention with key and value qkv.QuantizedKV: (output, lse) or output."""
    if not (isinstance(key, QuantizedKV) and isinstance(value, QuantizedKV) and key.dtype == value.dtype):
        raise Error(f"key is {_brief(key)} but value is {_brief(value)}: quantized keys and values must both be "
                    "qkv.QuantizedKV of one dtype")
    if need_weights or dropout_p or return_row_stats:
        raise Error("quantized key/value are for inference: no need_weights, dropout_p or return_row_stats")
    query = _as_float32(query, "query", allow_cast)
    _check_gqa(query, key.values, enable_gqa)
    mask = _mask_from(query, *mask_args)
    output, lse = _core.attention_quantized_kv(query, key.values, key.scales, value.values, value.scales, key.dtype,
                                               _options("scaled_dot_product_attention", options, mask=mask,
                                                        scale=scale))
    return (output, lse) if return_lse else output


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, need_weights=False, key_lengths=None,
                                 window=None, return_lse=False, return_row_stats=False, allow_cast=False,
                                 temperature=None, **options):
    """softmax(query @ key^T * scale + mask) @ value, as torch's scaled_dot_product_attention.

    options: seed=0, backend="auto", softcap=0.0, alibi_slopes=None, sinks=None,
    precision="highest" (below), as keywords: the fields of qkv::AttentionOptions, which every
    function here that attends takes the same way (an unknown keyword is a qkv.Error).

    query (B, Hq, Nq, Dk), key (B, Hkv, Nk, Dk), value (B, Hkv, Nk, Dv); (B, N, D) and (N, D)
    are one head. Hq may be a multiple of Hkv with enable_gqa=True (grouped-query attention:
    query head h reads key/value head h // (Hq // Hkv), nothing is copied).

    attn_mask: bool, True = attend (PyTorch SDPA's convention); float, added to the scaled
      scores (0 = attend, -inf = masked); or a qkv.Mask, or a mask expression such as
      "causal & (window(127) | strided(128))" (qkv.Mask.parse). It broadcasts numpy-style over the
      scores (B, Hq, Nq, Nk). Unlike PyTorch, it may be combined with is_causal.
    is_causal: query i sees keys j <= i (top-left aligned, as PyTorch).
    scale: defaults to 1 / sqrt(Dk).
    temperature: the softmax's temperature T > 0 (None or 1: none): weights = softmax(q.k * scale
      / T), each row the T = 1 row raised to 1/T and renormalised; T < 1 sharpens, T > 1 flattens
      (the explorer's slider, docs/explorer.md). It divides the scale, so the score modifiers
      below act on the tempered scores. Give the backward the same temperature.
    dropout_p, seed: dropout on the weights; the same seed drops the same weights on every
      kernel (see qkv.dropout_keeps).
    key_lengths: padding, one length per batch: batch b sees its first key_lengths[b] keys.
    window: sliding-window attention, left or (left, right): query i sees i-left <= j <= i+right.
    need_weights: also return the (B, Hq, Nq, Nk) weights (after dropout, as applied to value).
    cu_seqlens_q, cu_seqlens_k: a packed batch of variable-length sequences (FlashAttention's
      varlen): query (total_q, Hq, Dk), key and value (total_k, Hkv, D), (B + 1,) int32 offsets;
      sequence b is rows cu[b]:cu[b + 1] and attends to its own keys alone, is_causal and window
      aligned to the end of its keys (bottom-right, as FlashAttention), (B, Hq) alibi_slopes a row
      each. Returns output (total_q, Hq, Dv) and lse (Hq, total_q); the backward and qkv.torch take
      the same keywords (docs/inference.md).
    block_table, cache_seqlens: paged K/V, as FlashAttention's flash_attn_with_kvcache takes them
      (its layout, not the (B, H, N, D) above): query (B, Nq, Hq, Dk), key (num_pages, page_size,
      Hkv, Dk) and value (num_pages, page_size, Hkv, Dv) page pools (float32, 16-bit, or
      qkv.quantize_kv of the pools: int8 / int4 rows with their scales paged alike),
      block_table (B, max_pages) int32 pool page indices, cache_seqlens (B,) int32 the keys each
      sequence holds; sequence b's key j is row j % page_size of page block_table[b, j // page_size],
      its query i at key position cache_seqlens[b] - Nq + i (is_causal and window bottom-right
      aligned, as FlashAttention). Returns output (B, Nq, Hq, Dv) and lse (B, Hq, Nq). Forward only:
      no need_weights, tensor masks, key_lengths or score functions (docs/inference.md).
    rotary_cos, rotary_sin: rotary positions from tables, as flash_attn_with_kvcache takes them:
      (seqlen_ro, rotary_dim / 2) float arrays, rotary_dim <= Dk; rotary_interleaved=False pairs
      x[i] with x[i + rotary_dim / 2] (GPT-NeoX), True x[2i] with x[2i + 1] (GPT-J). The first
      rotary_dim features of query, and of key unless rotary_keys=False, are rotated before the
      scores: query i at position n - Nq + i (its sequence's keys n: Nk, its packed sequence's,
      cache_seqlens[b]), key j at j. With Nq != Nk, is_causal (top-left) and key_lengths are
      refused: give attn_mask=qkv.Mask.causal(Nk - Nq), or the cache as pages. rotary_keys=False:
      key is a cache whose keys were rotated when appended (paged pools and 16-bit or quantized
      keys need it). The backward takes the same keywords and returns the gradients of the
      unrotated query and key (docs/inference.md).
    backend: "auto" (flash, or reference when the weights are wanted), "reference" or "flash".

    Score modifiers, applied to each scaled score s in this order, before the mask:
    softcap: > 0 caps the scores, s <- softcap * tanh(s / softcap) (Gemma 2); 0 = off.
    alibi_slopes: (Hq) or (B, Hq) floats, s <- s - slopes[b, h] * |i + Nk - Nq - j| (ALiBi; (B, Hq):
      a row per batch element, as FlashAttention takes them); None = off.
    sinks: (Hq) floats, a logit per head that joins each row's softmax denominator but carries no
      value (gpt-oss, StreamingLLM); None = off.

    precision: how precise the float32 products Q K^T and P V must be, as
      torch.set_float32_matmul_precision's levels: "highest" (float32, the default), "high"
      (each operand as the sum of two bfloat16, about 16 significant bits) or "medium" (one
      bfloat16). A permission, not a promise: today the flash forward and backward on CPUs with
      AMX (Intel Sapphire Rapids and later) run their products on AMX tiles at "high" and
      "medium"; everything else computes in float32 (docs/performance.md).

    return_lse: also return the (B, Hq, Nq) log-sum-exp of each row's scaled, masked scores
      (-inf where a query sees no key; the sink included): with the output, it is what
      scaled_dot_product_attention_backward needs (the weights are recomputed from it).
    allow_cast: accept float64 (and float16) query, key and value, converted to float32; by
      default they are an error, as in PyTorch. Integer inputs are always an error.
    return_row_stats: also return each row's maximum score and sum_j exp(s_ij - max), (B, Hq, Nq)
      each: given to the backward beside lse, they keep its weights exact even when every key
      of a row carries a huge bias (-1e9), where lse alone loses log(n) in float32.

    Returns the (B, Hq, Nq, Dv) float32 output; with need_weights, return_lse and/or
    return_row_stats, a tuple (output, weights, lse, row_max, row_sum) holding those asked for,
    in that order. A query that
    sees no key gets zeros (PyTorch gives NaN).

    key and value may both be 16-bit (numpy float16, torch float16 or bfloat16) with a float32
    query: read as they are (docs/inference.md); the output stays float32. Inference only: no
    need_weights, dropout or row stats. The same for key and value quantized by qkv.quantize_kv
    ("int8", "int4").
    """
    scale = _tempered_scale(scale, temperature, query, "scaled_dot_product_attention")
    if options.get("block_table") is not None or options.get("cache_seqlens") is not None:
        return _paged_attention(query, key, value, (attn_mask, is_causal, key_lengths, window), need_weights,
                                dropout_p, return_lse, return_row_stats, allow_cast, scale, options)
    if isinstance(key, QuantizedKV) or isinstance(value, QuantizedKV):
        return _quantized_attention(query, key, value, need_weights, dropout_p, return_row_stats, return_lse,
                                    allow_cast, enable_gqa, (attn_mask, is_causal, key_lengths, window), scale,
                                    options)
    key_half, value_half = _half_bits(key), _half_bits(value)
    if key_half is not None or value_half is not None:
        if key_half is None or value_half is None or key_half[1] != value_half[1]:
            raise Error(f"key is {getattr(key, 'dtype', '?')} but value is {getattr(value, 'dtype', '?')}: "
                        "16-bit keys and values must share a dtype")
        if need_weights or dropout_p or return_row_stats:
            raise Error("16-bit key/value are for inference: no need_weights, dropout_p or return_row_stats")
        query = _as_float32(query, "query", allow_cast)
        _check_gqa(query, key_half[0], enable_gqa)
        mask = _mask_from(query, attn_mask, is_causal, key_lengths, window)
        output, lse = _core.attention_half_kv(query, key_half[0], value_half[0], key_half[1], _options(
            "scaled_dot_product_attention", options, mask=mask, scale=scale))
        return (output, lse) if return_lse else output
    query, key, value = (_as_float32(query, "query", allow_cast), _as_float32(key, "key", allow_cast),
                         _as_float32(value, "value", allow_cast))
    _check_gqa(query, key, enable_gqa)
    mask = _mask_from(query, attn_mask, is_causal, key_lengths, window)
    output, weights, lse, row_max, row_sum = _core.attention(query, key, value, _options(
        "scaled_dot_product_attention", options, mask=mask, scale=scale, dropout_p=dropout_p,
        need_weights=bool(need_weights)))
    if not (need_weights or return_lse or return_row_stats):
        return output
    return ((output,) + ((weights,) if need_weights else ()) + ((lse,) if return_lse else ()) +
            ((row_max, row_sum) if return_row_stats else ()))


def _kv_level(key, value, names, allow_cast):
    """One level's key and value for cascade_attention: (key, value, "f32") as float32 arrays, or
    their bits and "bf16" / "f16" when both are 16-bit (as scaled_dot_product_attention takes them)."""
    key_half, value_half = _half_bits(key), _half_bits(value)
    if key_half is None and value_half is None:
        return _as_float32(key, names[0], allow_cast), _as_float32(value, names[1], allow_cast), "f32"
    if key_half is None or value_half is None or key_half[1] != value_half[1]:
        raise Error(f"cascade_attention: {names[0]} is {getattr(key, 'dtype', '?')} but {names[1]} is "
                    f"{getattr(value, 'dtype', '?')}: 16-bit keys and values must share a dtype")
    return key_half[0], value_half[0], key_half[1]


def cascade_attention(query, prefix_key, prefix_value, suffix_key, suffix_value, suffix_lengths=None,
                      is_causal=False, scale=None, return_lse=False, allow_cast=False, **options):
    """Shared-prefix (cascade) attention: B sequences share one copy of a prompt prefix's keys and
    values, and each has its own suffix (FlashInfer's cascade attention, vLLM's cascade_attention).
    Sequence b's rows equal scaled_dot_product_attention(query[b], concat(prefix, suffix[b])), its
    queries the last Nq positions of that sequence; the prefix is read once for all B sequences.

    query (B, Hq, Nq, Dk) float32 (Nq = 1 for a decode step); prefix_key (1, Hkv, Np, Dk),
    prefix_value (1, Hkv, Np, Dv); suffix_key (B, Hkv, Ns, Dk), suffix_value (B, Hkv, Ns, Dv).
    Hq a multiple of Hkv (grouped-query heads). Each level's key and value are float32, or both
    16-bit (numpy float16, torch float16 or bfloat16); numpy arrays or torch tensors.
    suffix_lengths: (B,) ints in [0, Ns], the suffix keys each sequence holds (vLLM's
      suffix_kv_lens); None: all Ns.
    is_causal: query i of sequence b sits at position Np + L_b - Nq + i and sees the positions up
      to its own (bottom-right, as flash_attn_with_kvcache); needs L_b >= Nq - 1.
    scale: defaults to 1 / sqrt(Dk). options: softcap, sinks (counted once), backend, precision;
      the others (dropout_p, alibi_slopes, ...) are a qkv.Error, as are bad shapes and lengths.
    return_lse: also return the (B, Hq, Nq) log-sum-exp of each row.

    Returns the (B, Hq, Nq, Dv) float32 output, or (output, lse) with return_lse.
    """
    query = _as_float32(query, "query", allow_cast)
    prefix = _kv_level(prefix_key, prefix_value, ("prefix_key", "prefix_value"), allow_cast)
    suffix = _kv_level(suffix_key, suffix_value, ("suffix_key", "suffix_value"), allow_cast)
    mask = _mask_from(query, None, is_causal, suffix_lengths, None)
    output, lse = _core.cascade_attention(query, *prefix, *suffix,
                                          _options("cascade_attention", options, mask=mask, scale=scale))
    return (output, lse) if return_lse else output


def _paged_attention(query, key, value, mask_arguments, need_weights, dropout_p, return_lse, return_row_stats,
                     allow_cast, scale, options):
    """scaled_dot_product_attention with block_table / cache_seqlens: query (B, Nq, Hq, Dk) in
    FlashAttention's layout, viewed as the core's (B, Hq, Nq, Dk); key and value page pools, float32
    or 16-bit; the output back in (B, Nq, Hq, Dv)."""
    who = "scaled_dot_product_attention"
    query = _as_float32(query, "query", allow_cast)
    if query.ndim != 4:
        raise Error(f"{who}: with block_table, query must be (B, Nq, Hq, Dk) as flash_attn_with_kvcache takes it, "
                    f"got shape {tuple(query.shape)}")
    # The core takes the table flattened (B x max_pages entries): its rows must be B here.
    table = options.get("block_table")
    if table is not None and np.ndim(table) == 2 and np.shape(table)[0] != query.shape[0]:
        raise Error(f"{who}: block_table has shape {tuple(np.shape(table))} but query {tuple(query.shape)} has "
                    f"B = {query.shape[0]}: one row of pages per sequence")
    query = np.ascontiguousarray(query.transpose(0, 2, 1, 3))
    mask = _mask_from(query, *mask_arguments)
    arguments = dict(mask=mask, scale=scale, dropout_p=dropout_p, need_weights=bool(need_weights))
    key_half, value_half = _half_bits(key), _half_bits(value)
    if isinstance(key, QuantizedKV) or isinstance(value, QuantizedKV):  # quantized page pools and their scales
        if not (isinstance(key, QuantizedKV) and isinstance(value, QuantizedKV) and key.dtype == value.dtype):
            raise Error(f"key is {_brief(key)} but value is {_brief(value)}: quantized pools must both be "
                        "qkv.QuantizedKV of one dtype")
        if return_row_stats:
            raise Error("quantized key/value are for inference: no return_row_stats")
        output, lse = _core.attention_quantized_kv(query, key.values, key.scales, value.values, value.scales,
                                                   key.dtype, _options(who, options, **arguments))
        row_max = row_sum = None
    elif key_half is not None or value_half is not None:
        if key_half is None or value_half is None or key_half[1] != value_half[1]:
            raise Error(f"key is {getattr(key, 'dtype', '?')} but value is {getattr(value, 'dtype', '?')}: "
                        "16-bit keys and values must share a dtype")
        if return_row_stats:
            raise Error("16-bit key/value are for inference: no return_row_stats")
        output, lse = _core.attention_half_kv(query, key_half[0], value_half[0], key_half[1],
                                              _options(who, options, **arguments))
        row_max = row_sum = None
    else:
        key, value = _as_float32(key, "key", allow_cast), _as_float32(value, "value", allow_cast)
        output, _, lse, row_max, row_sum = _core.attention(query, key, value, _options(who, options, **arguments))
    output = np.ascontiguousarray(output.transpose(0, 2, 1, 3))
    if not (return_lse or return_row_stats):
        return output
    return (output,) + ((lse,) if return_lse else ()) + ((row_max, row_sum) if return_row_stats else ())


def scaled_dot_product_attention_backward(grad_output, query, key, value, output, lse, attn_mask=None,
                                          dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                                          key_lengths=None, window=None, row_max=None, row_sum=None,
                                          allow_cast=False, temperature=None, **options):
    """Gradients (dq, dk, dv) of scaled_dot_product_attention, shaped as query, key and value;
    then dsinks when sinks are given, shaped as sinks; then dbias when attn_mask is a float array
    (a bias): dL/dattn_mask, shaped as attn_mask (its broadcast dims summed over), 0 where the
    masks hide the score. So (dq, dk, dv), (dq, dk, dv, dsinks), (dq, dk, dv, dbias) or
    (dq, dk, dv, dsinks, dbias).

    grad_output: dL/doutput, shaped as the output. output, lse (and row_max, row_sum): what the
    forward returned with return_lse=True (and return_row_stats=True), on the same query, key and
    value. Every other argument
    must be the one the forward was given (the mask arguments, scale, temperature, dropout_p and seed: dropout
    then drops the same weights in both directions; softcap, alibi_slopes, sinks). The weights are
    recomputed, never stored: from row_max and row_sum when given (exact whatever the biases),
    else from lse (exact unless every key of a row carries a huge bias such as -1e9).
    With grouped-query attention, dk and dv sum over the query heads that share a key/value
    head. A query that sees no key contributes nothing (zeros, never NaN).
    options (seed, backend, softcap, alibi_slopes, sinks, precision) and allow_cast: as in
    scaled_dot_product_attention (backend "auto" is flash here; the products at that precision).

        out, lse, row_max, row_sum = qkv.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True,
                                                                      return_row_stats=True)
        dq, dk, dv = qkv.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, is_causal=True,
                                                               row_max=row_max, row_sum=row_sum)
    """
    scale = _tempered_scale(scale, temperature, query, "scaled_dot_product_attention_backward")
    query, key, value = (_as_float32(query, "query", allow_cast), _as_float32(key, "key", allow_cast),
                         _as_float32(value, "value", allow_cast))
    grad_output, output, lse = (_as_float32(grad_output, "grad_output", allow_cast),
                                _as_float32(output, "output", allow_cast), _as_float32(lse, "lse", allow_cast))
    if (row_max is None) != (row_sum is None):
        raise Error("scaled_dot_product_attention_backward: give row_max and row_sum together (or neither)")
    row_max = None if row_max is None else _as_float32(row_max, "row_max", allow_cast)
    row_sum = None if row_sum is None else _as_float32(row_sum, "row_sum", allow_cast)
    _check_gqa(query, key, enable_gqa)
    mask = _mask_from(query, attn_mask, is_causal, key_lengths, window)
    dq, dk, dv, dsinks, dbias = _core.attention_backward(
        grad_output, query, key, value, output, lse, row_max, row_sum,
        _options("scaled_dot_product_attention_backward", options, mask=mask, scale=scale, dropout_p=dropout_p))
    grads = (dq, dk, dv) + ((dsinks,) if options.get("sinks") is not None else ())
    return grads + ((_bias_gradient(dbias, attn_mask),) if _is_float_mask(attn_mask) else ())


def _is_float_mask(attn_mask):
    """Whether attn_mask is a float array (a bias, differentiated), not bool, a Mask or text."""
    if attn_mask is None or isinstance(attn_mask, (str, Mask)):
        return False
    return _as_array(attn_mask, "attn_mask").dtype.kind == "f"


def _bias_gradient(dbias, attn_mask):
    """The core's dbias (shaped as the mask it was given: attn_mask with leading 1s) as attn_mask's shape."""
    return None if dbias is None else dbias.reshape(np.shape(attn_mask))


def _linear_options(feature_map, is_causal, eps, causal_offset):
    """linear_attention's keywords as the core takes them (feature_map, causal, eps, causal_offset)."""
    if not isinstance(feature_map, str):
        raise Error(f"linear_attention: feature_map must be \"elu+1\" or \"relu\", got {_brief(feature_map)}")
    return feature_map, bool(is_causal), _float(eps, "eps"), _int(causal_offset, "causal_offset")


def _linear_args(query, key, value, enable_gqa, allow_cast, who):
    query, key, value = (_as_float32(query, "query", allow_cast), _as_float32(key, "key", allow_cast),
                         _as_float32(value, "value", allow_cast))
    if not enable_gqa and query.ndim == 4 and key.ndim == 4 and query.shape[1] != key.shape[1]:
        raise Error(f"{who}: query has {query.shape[1]} heads but key has {key.shape[1]}: pass enable_gqa=True "
                    "for grouped-query attention")
    return query, key, value


def linear_attention(query, key, value, feature_map="elu+1", is_causal=False, eps=1e-6, causal_offset=0,
                     enable_gqa=False, allow_cast=False):
    """Linear attention (Katharopoulos et al. 2020), O(N) in the sequence length:

        out_i = sum_j phi(q_i).phi(k_j) v_j / (sum_j phi(q_i).phi(k_j) + eps)

    over every key j, or j <= i + causal_offset when is_causal (the rule of qkv.Mask.causal: with
    the default 0, query i sees keys 0..i). No scale. feature_map: "elu+1" (phi(x) = elu(x) + 1,
    the paper's) or "relu". Shapes, GQA and allow_cast as scaled_dot_product_attention; returns
    the float32 output, shaped as query's leading dims + (Nq, Dv).
    """
    query, key, value = _linear_args(query, key, value, enable_gqa, allow_cast, "linear_attention")
    return _core.linear_attention(query, key, value, *_linear_options(feature_map, is_causal, eps, causal_offset))


def linear_attention_backward(grad_output, query, key, value, feature_map="elu+1", is_causal=False, eps=1e-6,
                              causal_offset=0, enable_gqa=False, allow_cast=False):
    """Gradients (dq, dk, dv) of linear_attention with the same arguments (the forward is
    recomputed; nothing of it is needed). With GQA, dk and dv sum over the heads sharing them."""
    query, key, value = _linear_args(query, key, value, enable_gqa, allow_cast, "linear_attention_backward")
    grad_output = _as_float32(grad_output, "grad_output", allow_cast)
    return _core.linear_attention_backward(query, key, value, grad_output,
                                           *_linear_options(feature_map, is_causal, eps, causal_offset))


def entropy(weights, allow_cast=False):
    """The entropy of each row of attention weights, in nats: H(i) = -sum_j w_ij ln w_ij (0 ln 0 = 0).

    weights (..., Nq, Nk), such as scaled_dot_product_attention(..., need_weights=True) returns ->
    (..., Nq) float32. 0 for a row with all its weight on one key, ln(k) spread evenly over k keys;
    a row of zeros (a query that saw no key) is 0. Computed by qkv::analysis::row_entropy (in
    double per row), the function behind the explorer's and `qkv heads`' entropies, so the
    numbers agree with theirs. weights must be float32 unless allow_cast=True.
    """
    return _core.row_entropy(_as_float32(weights, "weights", allow_cast))


def head_entropy(weights, allow_cast=False):
    """Each head's mean row entropy (nats), the figure the explorer prints under each head:
    weights (B, H, Nq, Nk) -> (B, H), (H, Nq, Nk) -> (H). qkv::analysis::head_entropy."""
    return _core.head_entropy(_as_float32(weights, "weights", allow_cast))



def attention_summary(query, key, value, top_k=8, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                      key_lengths=None, window=None, allow_cast=False, temperature=None, **options):
    """What the attention weights say, without the (Nq, Nk) weights: computed inside the flash
    kernel in O(N top_k) memory (AttentionOptions::summary_top_k), for documents too long for
    need_weights. The arguments are scaled_dot_product_attention's (no dropout); top_k in
    [1, 256] (the keys kept per row). Returns a dict of numpy arrays, L = query's leading dims:

      output       L + (Nq, Dv), the attention output (flash's)
      lse          L + (Nq), each row's log-sum-exp
      entropy      L + (Nq), -sum_j w_ij ln w_ij (nats; 0 for a row that sees no key)
      top_keys     L + (Nq, top_k) int64, the keys of each row's largest weights, descending,
                   ties to the lower index; -1 past the row's keys of nonzero weight
      top_weights  L + (Nq, top_k) float32, their weights (0 where the key is -1)
      received     L + (Nk), sum over the queries of the weight each key receives

    They equal what the weights of need_weights=True give (to float32 rounding; the tests check
    1e-5). backend "auto" runs flash ("reference" computes them from its weights; "decode" is
    refused).
    """
    top_k = _int(top_k, "top_k", 1, 256)
    scale = _tempered_scale(scale, temperature, query, "attention_summary")
    query, key, value = (_as_float32(query, "query", allow_cast), _as_float32(key, "key", allow_cast),
                         _as_float32(value, "value", allow_cast))
    _check_gqa(query, key, enable_gqa)
    mask = _mask_from(query, attn_mask, is_causal, key_lengths, window)
    return _core.attention_summary(query, key, value, top_k,
                                   _options("attention_summary", options, mask=mask, scale=scale))

def create_causal_mask(n):
    """The (n, n) bool mask of causal attention, True = attend (on and below the diagonal).

    It can be passed as attn_mask, though is_causal=True is faster (no matrix is read).
    """
    return _core.create_causal_mask(_int(n, "n")).astype(bool)


def create_padding_mask(lengths, max_len):
    """The (B, 1, 1, max_len) bool padding mask, True = attend (j < lengths[b]).

    It can be passed as attn_mask, though key_lengths=lengths is faster.
    """
    return _core.create_padding_mask(_int_list(lengths, "lengths"), _int(max_len, "max_len")).astype(bool)


class MultiHeadAttention:
    """Multi-head attention with torch.nn.MultiheadAttention's interface, on numpy arrays.

    project q/k/v, split into heads, attend, concatenate, project. Initialised as PyTorch
    initialises nn.MultiheadAttention (different random numbers); load_state_dict takes its
    state_dict() to compute exactly what it computes.

    num_kv_heads < num_heads gives grouped-query attention (no PyTorch counterpart).
    batch_first defaults to True here (PyTorch's default is False): inputs are (B, N, features),
    or (N, B, features) with batch_first=False, or unbatched (N, features).
    dropout applies to the attention weights while training (the default, as in PyTorch); call
    eval() to turn it off.
    seed fixes the initial weights and dropout decisions; without one, each module draws the
    next seed of a global sequence that qkv.manual_seed restarts (as torch.manual_seed).
    Score modifiers (no PyTorch counterpart): softcap > 0 caps the scores at +-softcap (tanh);
    alibi=True subtracts 2^(-8 (h + 1) / num_heads) * distance from head h's scores; sinks=True
    adds a learned per-head sink logit (parameter "sinks", zeros at first) to each softmax.
    causal=True applies a causal mask in every forward (as is_causal=True does per call).
    attention: "softmax" (scaled dot-product attention) or "linear" (qkv.linear_attention on the
    heads: O(N), phi(q).phi(k) in place of softmax, no scale; feature_map "elu+1" or "relu" is
    phi). A linear module takes no mask, weights, dropout, softcap, alibi or sinks, and no cache;
    causal=True is its causal form.
    rotary: rotary position embedding on q and k of every forward (token n at position n; with a
    cache, at its position after the cached ones): None (off), True (base 10000, half-split), a
    dict with keys "base" and "interleaved", or a qkv.RotaryEmbedding(head_dim, base=...,
    interleaved=...) whose options are copied (its head_dim must be embed_dim // num_heads).
    precision: of the attention's products, forward and backward, as in
    scaled_dot_product_attention ("highest", "high" or "medium"); the projections stay float32.
    relative_position_bias: a learned T5 relative-position bias (parameter
    "relative_position_bias.weight", (num_buckets, num_heads), zeros at first, trained through the
    fused backward's bias gradient): None (off), True (32 buckets, max_distance 128,
    bidirectional), or a dict with keys "num_buckets", "max_distance", "bidirectional" (False: a
    causal decoder's buckets). It works with a cache (not a ring buffer); not with linear
    attention or a float mask.
    """

    def __init__(self, embed_dim, num_heads, num_kv_heads=None, bias=True, dropout=0.0, kdim=None, vdim=None,
                 batch_first=True, seed=None, softcap=0.0, alibi=False, sinks=False, causal=False,
                 attention="softmax", feature_map="elu+1", rotary=None, precision="highest",
                 relative_position_bias=None):
        if not isinstance(attention, str) or not isinstance(feature_map, str):
            raise Error(f"MultiHeadAttention: attention and feature_map are strings (\"softmax\" or \"linear\"; "
                        f"\"elu+1\" or \"relu\"), got {_brief(attention)} and {_brief(feature_map)}")
        embed_dim = _int(embed_dim, "MultiHeadAttention: embed_dim")
        num_heads = _int(num_heads, "MultiHeadAttention: num_heads")
        options = _filled(_core.MultiHeadAttentionOptions(), "MultiHeadAttention", dict(
            num_kv_heads=0 if num_kv_heads is None else num_kv_heads, kdim=0 if kdim is None else kdim,
            vdim=0 if vdim is None else vdim, bias=bool(bias), dropout=dropout, causal=bool(causal), seed=seed,
            softcap=softcap, alibi=bool(alibi), sinks=bool(sinks), attention=attention, feature_map=feature_map,
            rotary=_rotary_options(rotary, embed_dim, num_heads), precision=precision,
            relative_position_bias=_relative_position_bias_options(relative_position_bias)))
        self._core = _core.MultiHeadAttentionCore(embed_dim, num_heads, options)
        self.batch_first = bool(batch_first)
        self.dropout = float(dropout)
        # Training: a forward's core call and its record in _last, and a backward's reading of
        # _last and its core call, are one step each, so _last always describes the forward the
        # core keeps (the core's own lock already runs training forwards one at a time).
        self._training_step = threading.Lock()

    embed_dim = property(lambda self: self._core.embed_dim)
    num_heads = property(lambda self: self._core.num_heads)
    num_kv_heads = property(lambda self: self._core.num_kv_heads)
    head_dim = property(lambda self: self._core.head_dim)
    kdim = property(lambda self: self._core.options.kdim)
    vdim = property(lambda self: self._core.options.vdim)
    training = property(lambda self: self._core.training)
    causal = property(lambda self: self._core.options.causal)
    attention = property(lambda self: self._core.options.attention)
    feature_map = property(lambda self: self._core.options.feature_map)
    precision = property(lambda self: self._core.options.precision)

    @property
    def relative_position_bias(self):
        """None, or {"num_buckets": ..., "max_distance": ..., "bidirectional": ...}: the T5 bias's options."""
        options = self._core.options.relative_position_bias
        return None if options is None else dict(zip(("num_buckets", "max_distance", "bidirectional"), options))

    @property
    def rotary(self):
        """None, or {"base": ..., "interleaved": ...}: the rotary embedding's options."""
        options = self._core.options.rotary
        return None if options is None else {"base": options[0], "interleaved": options[1]}

    def train(self, mode=True):
        self._core.train(bool(mode))
        return self

    def eval(self):
        return self.train(False)

    def parameters(self):
        """{name: array}: q_proj.weight, q_proj.bias, k_proj..., v_proj..., out_proj..., and sinks
        when built with sinks=True.

        Each array is a writable view of the module's parameter (weights are (out, in), as
        PyTorch stores them).
        """
        return dict(self._core.parameters())

    def grads(self):
        """{name: array}: the parameters' gradients under parameters()' names, zeros until a
        backward. Each array is a view of the module's gradient: backward() adds to it and
        zero_grad() clears it in place.
        """
        return dict(self._core.gradients())

    def torch_grads(self):
        """Copies of the gradients under torch.nn.MultiheadAttention's names (as state_dict()),
        so they compare directly with {name: p.grad for name, p in module.named_parameters()}.
        """
        return self._torch_names(self.grads())

    def zero_grad(self):
        """Sets every parameter gradient to zero (backward accumulates, as in PyTorch)."""
        self._core.zero_grad()

    def state_dict(self):
        """Copies of the parameters under torch.nn.MultiheadAttention's names.

        in_proj_weight when q, k and v have the same shape (else q_proj_weight, k_proj_weight,
        v_proj_weight), in_proj_bias (with num_kv_heads < num_heads, which torch has not:
        q_proj.bias, k_proj.bias, v_proj.bias), out_proj.weight, out_proj.bias; and sinks
        (num_heads) when built with sinks=True. load_state_dict reads it back.
        """
        return self._torch_names(self.parameters())

    @staticmethod
    def _torch_names(p):
        qkv_weights = [p[f"{n}_proj.weight"] for n in "qkv"]
        state = {}
        if all(w.shape == qkv_weights[0].shape for w in qkv_weights):
            state["in_proj_weight"] = np.concatenate(qkv_weights)
        else:
            state.update({f"{n}_proj_weight": w.copy() for n, w in zip("qkv", qkv_weights)})
        if "q_proj.bias" in p:
            biases = [p[f"{n}_proj.bias"] for n in "qkv"]
            if all(b.shape == biases[0].shape for b in biases):
                state["in_proj_bias"] = np.concatenate(biases)
            else:  # grouped-query attention: no torch counterpart, qkv's own names
                state.update({f"{n}_proj.bias": b.copy() for n, b in zip("qkv", biases)})
        state["out_proj.weight"] = p["out_proj.weight"].copy()
        if "out_proj.bias" in p:
            state["out_proj.bias"] = p["out_proj.bias"].copy()
        if "sinks" in p:
            state["sinks"] = p["sinks"].copy()
        if "relative_position_bias.weight" in p:  # no torch counterpart: qkv's own name
            state["relative_position_bias.weight"] = p["relative_position_bias.weight"].copy()
        return state

    def load_state_dict(self, state):
        """Loads torch.nn.MultiheadAttention().state_dict() (torch tensors or numpy arrays).

        Names: in_proj_weight (or q_proj_weight, k_proj_weight, v_proj_weight), in_proj_bias,
        out_proj.weight, out_proj.bias (and sinks); qkv's own names (q_proj.weight, ...) work too. Every
        parameter must be given with its exact shape; nothing is written if one is wrong.
        """
        if not hasattr(state, "items"):
            raise Error(f"MultiHeadAttention.load_state_dict: state must be a mapping of names to arrays (a "
                        f"state_dict()), got {_brief(state)}")
        self._core.load_state_dict({str(name): _as_float32(value, str(name), allow_cast=True)  # torch casts here too
                                   for name, value in state.items()})

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def make_cache(self, batch, capacity, dtype="f32", window=0, page_size=None):
        """A qkv.KVCache for this layer: batch sequences of up to capacity positions, keys and
        values stored in dtype ("f32", "bf16", "f16", or quantized on append: "int8", "int4"); window
        > 0: a ring buffer of window slots. page_size: keep them in a pool of page_size-position
        pages instead (a qkv.PagedKVCache of batch * ceil(capacity / page_size) pages, one sequence
        per batch row, `sequences[b]`; its `paged` pool forks them, and releases the forks: releasing
        a row's own sequence breaks the cache); no window then."""
        if not isinstance(dtype, str):
            raise Error(f"make_cache: dtype must be \"f32\", \"bf16\", \"f16\", \"int8\" or \"int4\", "
                        f"got {_brief(dtype)}")
        batch, capacity = _int(batch, "make_cache: batch"), _int(capacity, "make_cache: capacity")
        window = _int(window, "make_cache: window")
        if page_size is None:
            return KVCache(self._core.make_cache(batch, capacity, dtype, window))
        page_size = _int(page_size, "make_cache: page_size")
        if page_size < 1:
            raise Error(f"make_cache: page_size must be at least 1 (None: contiguous), got {page_size}")
        return KVCache(self._core.make_cache(batch, capacity, dtype, window, page_size))

    def forward(self, query, key=None, value=None, key_padding_mask=None, attn_mask=None, need_weights=False,
                average_attn_weights=True, is_causal=False, allow_cast=False, cache=None, counts=None,
                cu_seqlens=None, sequences=None):
        """Attention of query over key/value, as torch.nn.MultiheadAttention.forward.

        query (B, Nq, embed_dim), key (B, Nk, kdim), value (B, Nk, vdim) with batch_first
        (else (N, B, features)); or unbatched (N, features). key and value default to query
        (self-attention).

        BEWARE, nn.MultiheadAttention's bool masks mean True = MASKED (not attended), the
        opposite of scaled_dot_product_attention's attn_mask:
          key_padding_mask (B, Nk): True = this key is padding, ignore it. Float: added.
          attn_mask (Nq, Nk) or (B * num_heads, Nq, Nk): True = query may NOT attend to key.
            Float: added to the scores (-inf = masked).
        is_causal: apply a causal mask (query i sees keys j <= i). PyTorch takes it only as a
          hint that attn_mask is causal; here it is enough on its own.
        need_weights: also return the weights, averaged over heads (B, Nq, Nk) when
          average_attn_weights, else per head (B, num_heads, Nq, Nk). False by default here
          (PyTorch's default is True), because computing them takes the slower reference path.

        allow_cast: accept float64 inputs, converted to float32 (by default an error, as in PyTorch).

        cache: a qkv.KVCache from make_cache (self-attention, inference): query's tokens are the
          positions after those in the cache; their keys and values are appended and the output
          is what the full causal forward over the whole sequence gives them. counts: tokens of
          each batch element (right padding; default all). No masks or weights with a cache.
          A qkv.PagedKVCache serves the same way with sequences: batch element b continues the
          cache's sequence sequences[b] (add_sequence / fork ids), its new keys and values
          appended to that sequence's pages (a shared last page copied first) and attended where
          they lie (docs/inference.md).

        cu_seqlens: a packed batch (self-attention, inference; FlashAttention's varlen convention):
          query (total_tokens, embed_dim) holds the sequences end to end, sequence b its rows
          cu_seqlens[b]:cu_seqlens[b + 1] ((B + 1,) ints from 0 to total_tokens). Each sequence
          attends to its own tokens alone, from position 0; the output (total_tokens, embed_dim)
          rows of a sequence are what forward on it alone gives. is_causal applies per sequence;
          no key, value, masks, weights or cache.

        Returns (output, weights or None), as PyTorch does; output is (B, Nq, embed_dim)
        (or (Nq, B, embed_dim) without batch_first).
        """
        query = _as_float32(query, "query", allow_cast)
        if cu_seqlens is not None:
            if key is not None or value is not None or key_padding_mask is not None or attn_mask is not None \
                    or need_weights or cache is not None:
                raise Error("forward with cu_seqlens is self-attention on a packed batch: no key, value, masks, "
                            "weights or cache")
            offsets = _int_list(cu_seqlens, "cu_seqlens")
            output = self._core.forward_packed(np.ascontiguousarray(query), offsets,
                                               Mask.causal() if is_causal else Mask())
            return output, None
        if sequences is not None and not isinstance(cache, PagedKVCache):
            raise Error(f"MultiHeadAttention.forward: sequences go with a qkv.PagedKVCache cache, got cache="
                        f"{_brief(cache)}")
        if cache is not None:
            if key is not None or value is not None or key_padding_mask is not None or attn_mask is not None \
                    or need_weights:
                raise Error("forward with a cache is causal self-attention: no key, value, masks or weights")
            if isinstance(cache, KVCache) and cache.page_size is not None and counts is not None:
                raise Error("MultiHeadAttention.forward: a paged qkv.KVCache has one sequence per batch row, each "
                            "growing by whole rows: no sequences or counts (give its .paged cache for those)")
            if isinstance(cache, PagedKVCache):
                if sequences is None or counts is not None:
                    raise Error("MultiHeadAttention.forward: a qkv.PagedKVCache takes sequences= (one cache sequence "
                                "id per batch element) and no counts")
                x = np.swapaxes(query, 0, 1) if query.ndim == 3 and not self.batch_first else query
                output = self._core.forward_paged(np.ascontiguousarray(x), cache,
                                                  _int_list(sequences, "sequences"))
                if query.ndim == 3 and not self.batch_first:
                    output = np.swapaxes(output, 0, 1)
                return output, None
            if not isinstance(cache, KVCache):
                raise Error(f"MultiHeadAttention.forward: cache must be a qkv.KVCache (make_cache), got "
                            f"{_brief(cache)}")
            x = np.swapaxes(query, 0, 1) if query.ndim == 3 and not self.batch_first else query
            counts = [] if counts is None else _int_list(counts, "counts")
            with cache._lock:  # the GIL is released while the core writes the cache
                output = self._core.forward_cached(np.ascontiguousarray(x), cache._core, counts)
            if query.ndim == 3 and not self.batch_first:
                output = np.swapaxes(output, 0, 1)
            return output, None
        key_given, value_given = key is not None, value is not None
        self_attention = not key_given and not value_given  # forward(x): one fused projection
        key = query if key is None else _as_float32(key, "key", allow_cast)
        value = key if value is None else _as_float32(value, "value", allow_cast)
        batched = query.ndim == 3
        if batched and not self.batch_first:
            query, key, value = (np.swapaxes(x, 0, 1) for x in (query, key, value))
        batch = query.shape[0] if batched else 1

        mask = Mask()
        if key_padding_mask is not None:
            mask = mask & self._padding_mask(key_padding_mask, batched, batch, key)
        if attn_mask is not None:
            attn = _as_array(attn_mask, "attn_mask")
            if attn.ndim == 3:  # (B * num_heads, Nq, Nk), batch major, as PyTorch stacks it
                if attn.shape[0] % self.num_heads != 0:
                    raise Error(f"MultiHeadAttention: attn_mask is {attn.shape}: a 3-D attn_mask is (batch * "
                                f"num_heads, Nq, Nk), and {attn.shape[0]} is not a multiple of num_heads "
                                f"({self.num_heads})")
                attn = attn.reshape(-1, self.num_heads, attn.shape[-2], attn.shape[-1])
            mask = mask & _tensor_mask(attn, 4, "attn_mask", true_means_attend=False)
        if is_causal and self.attention == "linear":
            if not self.causal:  # linear attention takes no mask: its causal form is an option of the module
                raise Error("MultiHeadAttention: a linear-attention module is causal only when built with causal=True "
                            "(linear attention takes no mask); is_causal=True cannot make it so per call")
        elif is_causal:
            mask = mask & Mask.causal()

        if not need_weights:
            weights = _core.Weights.None_
        else:
            weights = _core.Weights.Averaged if average_attn_weights else _core.Weights.PerHead
        with self._training_step if self._core.training else contextlib.nullcontext():
            output, attn_weights = self._core.forward(query, *((None, None) if self_attention else (key, value)),
                                                      mask, weights)
            self._last = (key_given, value_given, batched)
        if batched and not self.batch_first:
            output = np.swapaxes(output, 0, 1)
        return output, attn_weights

    @staticmethod
    def _padding_mask(key_padding_mask, batched, batch, key):
        """key_padding_mask (B, Nk), or (Nk) unbatched, as a Mask (True = padding)."""
        padding = _as_array(key_padding_mask, "key_padding_mask")
        expected = ((batch,) if batched else ()) + key.shape[-2:-1]
        if key.ndim in (2, 3) and padding.shape != expected:
            raise Error(f"MultiHeadAttention: key_padding_mask is {padding.shape} but key is {key.shape}: it "
                        f"should be {expected} (batch, keys)")
        if key.ndim not in (2, 3):
            return Mask()  # the core refuses the key itself, naming its shape
        return _tensor_mask(padding.reshape(batch, 1, 1, padding.shape[-1]), 4, "key_padding_mask",
                            true_means_attend=False)

    def backward(self, grad_output):
        """Backward of the last forward: returns the input gradient(s), adds the parameters'.

        grad_output: dL/doutput, shaped as that forward's output. Returns dL/dquery when the
        forward was self-attention (key and value not given: the three paths are summed);
        otherwise (dquery, dkey, dvalue), where dvalue is None and dkey includes the value path
        when value was not given (it defaulted to key). The parameter gradients are ADDED to
        grads() (torch_grads() under PyTorch's names), as PyTorch accumulates .grad: call
        zero_grad() between steps. Dropout drops the same weights as in that forward.
        Call backward once per forward, on the same module (it keeps what the forward saved).
        """
        grad_output = _as_float32(grad_output, "grad_output")
        with self._training_step:
            if getattr(self, "_last", None) is None:
                raise Error("MultiHeadAttention.backward: no forward to differentiate (call forward first)")
            key_given, value_given, batched = self._last
            if batched and not self.batch_first:
                grad_output = np.swapaxes(grad_output, 0, 1)
            if not key_given and not value_given:  # forward(x): the core sums the three paths
                dx = self._core.backward_self(grad_output)
                return np.swapaxes(dx, 0, 1) if batched and not self.batch_first else dx
            dq, dk, dv = self._core.backward(grad_output)
        if batched and not self.batch_first:
            dq, dk, dv = (np.swapaxes(g, 0, 1) for g in (dq, dk, dv))
        if not value_given:
            return dq, dk + dv, None
        return dq, dk, dv

    def __repr__(self):
        extra = "" if self.attention == "softmax" else f", attention={self.attention!r}, feature_map={self.feature_map!r}"
        extra += "" if self.rotary is None else f", rotary={self.rotary!r}"
        extra += "" if self.relative_position_bias is None else \
            f", relative_position_bias={self.relative_position_bias!r}"
        extra += ", causal=True" if self.causal else ""
        return (f"qkv.MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, batch_first={self.batch_first}{extra})")


def _rotary_options(rotary, embed_dim, num_heads):
    """MultiHeadAttention's rotary argument as the core's (base, interleaved), or None."""
    if rotary is None or rotary is False:
        return None
    if rotary is True:
        return (10000.0, False)
    if isinstance(rotary, RotaryEmbedding):
        head_dim = int(embed_dim) // max(int(num_heads), 1)
        if rotary.head_dim != head_dim:
            raise Error(f"MultiHeadAttention: rotary is a RotaryEmbedding of head_dim {rotary.head_dim}, but the "
                        f"module's heads have {head_dim} features (embed_dim {embed_dim} / num_heads {num_heads})")
        return (float(rotary.base), bool(rotary.interleaved))
    if isinstance(rotary, dict):
        unknown = sorted(set(rotary) - {"base", "interleaved"})
        if unknown:
            raise Error(f"MultiHeadAttention: unknown rotary option(s) {', '.join(map(str, unknown))}: "
                        f"the options are base and interleaved")
        base, interleaved = rotary.get("base", 10000.0), rotary.get("interleaved", False)
        if not isinstance(base, numbers.Real) or isinstance(base, (bool, np.bool_)):
            raise Error(f"MultiHeadAttention: rotary base must be a number, got {base!r}")
        if not isinstance(interleaved, (bool, np.bool_)):
            raise Error(f"MultiHeadAttention: rotary interleaved must be True or False, got {interleaved!r}")
        return (float(base), bool(interleaved))
    raise Error(f"MultiHeadAttention: rotary must be None, True, a dict (base, interleaved) or a "
                f"qkv.RotaryEmbedding, got {type(rotary).__name__}")


def _relative_position_bias_options(option):
    """MultiHeadAttention's relative_position_bias argument as the core's (num_buckets,
    max_distance, bidirectional), or None."""
    if option is None or option is False:
        return None
    if option is True:
        option = {}
    if not isinstance(option, dict):
        raise Error(f"MultiHeadAttention: relative_position_bias must be None, True or a dict (num_buckets, "
                    f"max_distance, bidirectional), got {type(option).__name__}")
    unknown = sorted(set(map(str, option)) - {"num_buckets", "max_distance", "bidirectional"})
    if unknown:
        raise Error(f"MultiHeadAttention: unknown relative_position_bias option(s) {', '.join(unknown)}: the "
                    f"options are num_buckets, max_distance and bidirectional")
    bidirectional = option.get("bidirectional", True)
    if not isinstance(bidirectional, (bool, np.bool_)):
        raise Error(f"MultiHeadAttention: relative_position_bias bidirectional must be True or False, "
                    f"got {bidirectional!r}")
    return (_int(option.get("num_buckets", 32), "MultiHeadAttention: relative_position_bias num_buckets"),
            _int(option.get("max_distance", 128), "MultiHeadAttention: relative_position_bias max_distance"),
            bool(bidirectional))


class KVCache:
    """One attention layer's keys and values for incremental decoding (make it with
    MultiHeadAttention.make_cache): preallocated, stored in "f32", "bf16", "f16", "int8" or "int4";
    with page_size, in the pages of a qkv.PagedKVCache (`paged`), batch row b its sequence
    `sequences[b]`.

    A forward with a cache writes it: calls on one cache from several threads take turns (its
    lock), so they never corrupt it; which thread's tokens come first is theirs to arrange."""

    def __init__(self, core):
        if not isinstance(core, _core.KVCache):
            raise Error(f"qkv.KVCache is made by MultiHeadAttention.make_cache, not from {_brief(core)}")
        self._core = core
        # The pool, fetched once: each read of core.paged adds a keep-alive link (pybind11), and one
        # object keeps its identity.
        self._paged = core.paged
        self._lock = threading.Lock()

    lengths = property(lambda self: list(self._core.lengths))
    length = property(lambda self: self._core.length)
    capacity = property(lambda self: self._core.capacity)
    window = property(lambda self: self._core.window)
    dtype = property(lambda self: self._core.dtype)
    page_size = property(lambda self: self._core.page_size or None)
    paged = property(lambda self: self._paged)  # the qkv.PagedKVCache pool, or None
    sequences = property(lambda self: list(self._core.sequences) if self._core.page_size else None)

    def reset(self):
        """Forget every position; the storage stays (a paged cache's pages return to its pool)."""
        with self._lock:
            self._core.reset()

    def __repr__(self):
        paged = "" if self.page_size is None else f", page_size={self.page_size}"
        return f"qkv.KVCache(length={self.length}, capacity={self.capacity}, dtype={self.dtype!r}{paged})"


RotaryEmbedding = _core.RotaryEmbedding
PagedKVCache = _core.PagedKVCache


def __getattr__(name):
    # qkv.torch is imported on first use, so `import qkv` neither needs nor loads torch.
    if name == "torch":
        if importlib.util.find_spec("torch") is None:
            raise AttributeError("qkv.torch needs PyTorch, which is not installed")
        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'qkv' has no attribute {name!r}")


# Rotary positions from caller-supplied tables (FlashAttention's rotary_cos / rotary_sin): rotary.py,
# imported last because it uses the helpers above.
from .rotary import RotaryTable, apply_rotary  # noqa: E402

__all__ += ["RotaryTable", "apply_rotary"]
