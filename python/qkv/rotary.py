"""Rotary positions from caller-supplied tables, as FlashAttention's kvcache API takes them.

  apply_rotary(x, rotary_cos, rotary_sin, rotary_interleaved=False, cache_seqlens=0)
  RotaryTable(head_dim, rotary_cos, rotary_sin, rotary_interleaved=False).apply(x, cache_seqlens)
  RotaryTable.from_base(head_dim, length, base=10000.0, interleaved=False, rotary_dim=None)

rotary_cos and rotary_sin are (seqlen_ro, rotary_dim / 2): row p holds the cosines and sines of
position p's angles. Only the first rotary_dim features of each head are rotated, the rest pass
through; rotary_interleaved=True pairs features (0, 1), (2, 3), ... (GPT-J), False pairs i with
i + rotary_dim / 2 (GPT-NeoX). On the rotated part, out = x * cos + rotate(x) * sin, as
flash_attn.layers.rotary.apply_rotary_emb computes it. x is (B, H, N, D) as everywhere in qkv
(FlashAttention's (B, N, H, D) is x.transpose(0, 2, 1, 3)); token n of batch element b sits at
position cache_seqlens[b] + n. The three table keywords are one options object,
qkv._core.RotaryTableOptions (include/qkv/inference.hpp: RotaryTableOptions).
"""

import numbers

import numpy as np

from . import _core
# qkv/__init__.py imports this module last, after it defines these.
from . import KVCache, _as_array, _as_float32, _filled, _float, _int, _int_list, _named_errors
from ._core import Error

__all__ = ["RotaryTable", "apply_rotary"]

# Arguments of the wrong type are a qkv.Error naming them, as for every function of _core.
for _name in ("__init__", "apply", "from_base"):
    _method = _named_errors(getattr(_core.RotaryTableCore, _name), f"RotaryTable.{_name}")
    setattr(_core.RotaryTableCore, _name, staticmethod(_method) if _name == "from_base" else _method)


def _table(value, name):
    """A table argument as a float array (float16/32/64; rounded to float32 by the binding)."""
    array = _as_array(value, name)
    if array.dtype.kind != "f":
        raise Error(f"{name} is {array.dtype}: the tables hold floats (cosines and sines)")
    return array


def _options(who, rotary_cos, rotary_sin, rotary_interleaved):
    """The one RotaryTableOptions the keywords fill (qkv._filled names a field a value cannot set)."""
    if not isinstance(rotary_interleaved, (bool, np.bool_)):
        raise Error(f"{who}: rotary_interleaved must be True or False, got {rotary_interleaved!r}")
    return _filled(_core.RotaryTableOptions(), who, dict(
        rotary_cos=_table(rotary_cos, f"{who}: rotary_cos"), rotary_sin=_table(rotary_sin, f"{who}: rotary_sin"),
        rotary_interleaved=bool(rotary_interleaved)))


def _offsets(cache_seqlens, who):
    """cache_seqlens (an integer, a sequence of integers, or a qkv.KVCache) as a list of offsets."""
    if isinstance(cache_seqlens, KVCache):
        return list(cache_seqlens.lengths)
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, (bool, np.bool_)):
        return [_int(cache_seqlens, f"{who}: cache_seqlens")]
    return _int_list(cache_seqlens, f"{who}: cache_seqlens")


class RotaryTable:
    """Rotary position embedding from tables (qkv::nn::RotaryTable), checked once, applied many
    times. head_dim is the features per head; rotary_dim (2 * rotary_cos.shape[1]) <= head_dim."""

    def __init__(self, head_dim, rotary_cos, rotary_sin, rotary_interleaved=False):
        if isinstance(head_dim, _core.RotaryTableCore):  # from_base's result
            self._core = head_dim
            return
        who = "RotaryTable"
        self._core = _core.RotaryTableCore(_int(head_dim, f"{who}: head_dim"),
                                           _options(who, rotary_cos, rotary_sin, rotary_interleaved))

    @classmethod
    def from_base(cls, head_dim, length, base=10000.0, interleaved=False, rotary_dim=None):
        """The tables of qkv.RotaryEmbedding's base form for positions [0, length): pair i at
        position p turned by p * base^(-2i / rotary_dim), kept in double, so that on the first
        rotary_dim features (default head_dim) they rotate exactly as RotaryEmbedding(rotary_dim,
        base, interleaved) does. .cos and .sin give them as float32 tables."""
        if not isinstance(interleaved, (bool, np.bool_)):
            raise Error(f"RotaryTable.from_base: interleaved must be True or False, got {interleaved!r}")
        return cls(_core.RotaryTableCore.from_base(
            _int(head_dim, "RotaryTable.from_base: head_dim"), _int(length, "RotaryTable.from_base: length"),
            _float(base, "RotaryTable.from_base: base"), bool(interleaved),
            0 if rotary_dim is None else _int(rotary_dim, "RotaryTable.from_base: rotary_dim")), None, None)

    head_dim = property(lambda self: self._core.head_dim)
    rotary_dim = property(lambda self: self._core.rotary_dim)
    length = property(lambda self: self._core.length)
    interleaved = property(lambda self: self._core.interleaved)
    cos = property(lambda self: self._core.cos, doc="the cosine table, float32 (length, rotary_dim / 2)")
    sin = property(lambda self: self._core.sin, doc="the sine table, float32 (length, rotary_dim / 2)")

    def apply(self, x, cache_seqlens=0, allow_cast=False):
        """x (B, H, N, D), (H, N, D) or (N, D) float32 (float64 with allow_cast=True) rotated, as a
        new float32 array: batch element b's token n at position cache_seqlens[b] + n
        (cache_seqlens: one integer for all, one per batch element, or a qkv.KVCache's lengths)."""
        array = _as_float32(x, "RotaryTable.apply: x", allow_cast)
        return self._core.apply(array, _offsets(cache_seqlens, "RotaryTable.apply"))

    def __repr__(self):
        return (f"qkv.RotaryTable(head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, length={self.length}, "
                f"interleaved={self.interleaved})")


def apply_rotary(x, rotary_cos, rotary_sin, rotary_interleaved=False, cache_seqlens=0, allow_cast=False):
    """x rotated by FlashAttention's tables (see the module's docstring): the first
    2 * rotary_cos.shape[1] features of each head, token n of batch element b at position
    cache_seqlens[b] + n. Apply it to q and to k before attending (flash_attn_with_kvcache rotates
    both at cache_seqlens). A RotaryTable checks the tables once for many calls."""
    array = _as_float32(x, "apply_rotary: x", allow_cast)
    if not 2 <= array.ndim <= 4:
        raise Error(f"apply_rotary: x is {array.shape}: expected (B, H, N, D), (H, N, D) or (N, D)")
    table = _core.RotaryTableCore(array.shape[-1],
                                  _options("apply_rotary", rotary_cos, rotary_sin, rotary_interleaved))
    return table.apply(array, _offsets(cache_seqlens, "apply_rotary"))
