"""qkv.torch: qkv's attention kernels inside PyTorch, as a torch.autograd.Function.

    import qkv.torch
    out = qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True)

takes the arguments of torch.nn.functional.scaled_dot_product_attention (plus qkv's key_lengths,
window and seed) on CPU float32 tensors. Tensors cross to qkv through numpy views and the
output comes back as a tensor over qkv's own buffer.

Gradients flow: forward keeps the inputs, the output and the log-sum-exp of each row, and
backward calls qkv::scaled_dot_product_attention_backward with the same mask, scale and dropout
seed (so dropout drops the same weights both ways). Gradients reach query, key and value; the
mask is not differentiated (a float attn_mask gets no gradient). With grouped-query attention
the key/value gradients sum over the query heads sharing each key/value head.
"""

import torch

from . import Backend, Error, _check_gqa, _core, _mask_from

__all__ = ["scaled_dot_product_attention"]


def _check_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise Error(f"qkv.torch.scaled_dot_product_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype != torch.float32:
        raise Error(f"qkv.torch.scaled_dot_product_attention: {name} is {t.dtype} on {t.device}; "
                    "qkv runs on CPU float32 tensors")


class ScaledDotProductAttention(torch.autograd.Function):
    """forward: qkv's kernel. Keeps (q, k, v, output, lse) and the options for backward."""

    @staticmethod
    def forward(ctx, query, key, value, mask, scale, dropout_p, seed):
        output, _weights, lse = _core.attention(query.detach().numpy(), key.detach().numpy(),
                                                value.detach().numpy(), mask, scale, dropout_p, seed, False,
                                                Backend.Auto)
        output, lse = torch.from_numpy(output), torch.from_numpy(lse)
        # What backward will need: the inputs, the forward's output and log-sum-exp (so P is
        # recomputed, never stored), and the same options (the mask and dropout seed).
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.options = (mask, scale, dropout_p, seed)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, lse = ctx.saved_tensors
        mask, scale, dropout_p, seed = ctx.options
        grad_output = grad_output.detach().to(torch.float32).contiguous()
        dq, dk, dv = _core.attention_backward(grad_output.numpy(), query.detach().numpy(), key.detach().numpy(),
                                              value.detach().numpy(), output.numpy(), lse.numpy(), mask, scale,
                                              dropout_p, seed, Backend.Auto)
        grads = [torch.from_numpy(g) if needed else None
                 for g, needed in zip((dq, dk, dv), ctx.needs_input_grad[:3])]
        return (*grads, None, None, None, None)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, key_lengths=None, window=None, seed=0):
    """torch.nn.functional.scaled_dot_product_attention computed by qkv (CPU float32).

    query (B, Hq, Nq, Dk), key (B, Hkv, Nk, Dk), value (B, Hkv, Nk, Dv), or rank 3 / 2 as one
    head. attn_mask: bool (True = attend) or float (added), broadcast numpy-style; is_causal,
    scale, enable_gqa as in PyTorch; key_lengths, window, seed as qkv.scaled_dot_product_attention.
    Returns the (B, Hq, Nq, Dv) output; backward gives query, key and value their gradients.
    """
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        _check_tensor(t, name)
    _check_gqa(query, key, enable_gqa)
    mask = _mask_from(query, attn_mask, is_causal, key_lengths, window)
    return ScaledDotProductAttention.apply(query, key, value, mask, None if scale is None else float(scale),
                                           float(dropout_p), int(seed))
