"""PyTorch's math path in float64, the oracle of the parity tests.

This is what torch.nn.functional.scaled_dot_product_attention's math backend does (PyTorch 1.13
has no such function, so it is spelled out): matmul, masked_fill, softmax, matmul. Grouped-query
attention repeats the key/value heads on the PyTorch side.
"""
import math

import numpy as np
import torch


def f64(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float64))


def causal_keep(nq, nk):
    """(nq, nk) bool, True = attend: query i sees keys j <= i (top-left, as PyTorch)."""
    return torch.ones(nq, nk, dtype=torch.bool).tril()


def window_keep(nq, nk, left, right):
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    return (j >= i - left) & (j <= i + right)


def lengths_keep(lengths, nk):
    """(B, 1, 1, nk) bool: batch b sees its first lengths[b] keys."""
    return (torch.arange(nk)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]


def attention(q, k, v, keep=None, additive=None, scale=None, dtype=torch.float64):
    """Returns (output, weights) of softmax(q k^T * scale + additive, masked by keep) v.

    keep: bool, True = attend; additive: float, added. Both broadcast as numpy/torch do.
    A fully masked row comes out NaN, as in PyTorch.
    """
    q, k, v = (f64(x).to(dtype) for x in (q, k, v))
    if q.dim() == 4 and k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if additive is not None:
        scores = scores + torch.as_tensor(np.asarray(additive)).to(dtype)
    if keep is not None:
        scores = scores.masked_fill(~torch.as_tensor(np.asarray(keep)), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, v).numpy(), weights.numpy()


def tolerance(q, k, v, **kwargs):
    """The error budget of a float32 kernel: a few times what PyTorch's own float32 math path
    misses the float64 result by on the same data (flash-attention's rule), plus a floor."""
    exact, _ = attention(q, k, v, **kwargs)
    single, _ = attention(q, k, v, dtype=torch.float32, **kwargs)
    return 1e-5 + 8 * float(np.nanmax(np.abs(single - exact)))
