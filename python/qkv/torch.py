"""qkv.torch: qkv's attention kernels inside PyTorch, as a torch.autograd.Function.

    import qkv.torch
    out = qkv.torch.scaled_dot_product_attention(q, k, v, is_causal=True)

takes the arguments of torch.nn.functional.scaled_dot_product_attention (plus qkv's key_lengths,
window and seed) on CPU float32 tensors. Tensors cross to qkv through numpy views and the
output comes back as a tensor over qkv's own buffer.

Gradients flow: forward keeps the inputs, the output and each row's statistics (log-sum-exp,
maximum and sum, so the recomputed weights stay exact even when every key of a row carries a
-1e9 bias), and backward calls qkv::scaled_dot_product_attention_backward with the same mask,
scale, dropout seed and score modifiers (so dropout drops the same weights both ways). Gradients
reach query, key, value, sinks and a float attn_mask (a learned bias: its gradient is summed
over the dims it broadcasts over, so a (1, H, N, N) bias over a batch gets one (1, H, N, N)
gradient, computed inside the fused backward); alibi_slopes and bool masks are not
differentiated. With grouped-query attention the key/value gradients sum over the query heads
sharing each key/value head.
"""

import torch

from . import Error, _check_gqa, _core, _linear_options, _mask_from, _options, _tempered_scale

__all__ = ["linear_attention", "scaled_dot_product_attention"]


def _check_tensor(t, name):
    if not isinstance(t, torch.Tensor):
        raise Error(f"qkv.torch.scaled_dot_product_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype != torch.float32:
        raise Error(f"qkv.torch.scaled_dot_product_attention: {name} is {t.dtype} on {t.device}; "
                    "qkv runs on CPU float32 tensors")


def _numpy(t):
    """A CPU float32 tensor's data as numpy (None stays None)."""
    return None if t is None else t.detach().numpy()


class ScaledDotProductAttention(torch.autograd.Function):
    """forward: qkv's kernel. Keeps (q, k, v, sinks, output, lse, row_max, row_sum) and the options.
    bias: the float attn_mask tensor (already in options' mask), an input here only so that it
    gets its gradient; None otherwise."""

    @staticmethod
    def forward(ctx, query, key, value, sinks, bias, options):
        options.sinks = _numpy(sinks)
        output, _weights, lse, row_max, row_sum = _core.attention(_numpy(query), _numpy(key), _numpy(value), options)
        output, lse, row_max, row_sum = (torch.from_numpy(x) for x in (output, lse, row_max, row_sum))
        # What backward will need: the inputs, the forward's output and row statistics (so P is
        # recomputed, never stored, and exactly), and the same options (mask, dropout seed, modifiers).
        ctx.save_for_backward(query, key, value, sinks, output, lse, row_max, row_sum)
        ctx.options = options
        if bias is not None:
            ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, sinks, output, lse, row_max, row_sum = ctx.saved_tensors
        grad_output = grad_output.detach().to(torch.float32).contiguous()
        dq, dk, dv, dsinks, dbias = _core.attention_backward(
            grad_output.numpy(), _numpy(query), _numpy(key), _numpy(value), output.numpy(), lse.numpy(),
            row_max.numpy(), row_sum.numpy(), ctx.options)
        grads = [torch.from_numpy(g) if needed and g is not None else None
                 for g, needed in zip((dq, dk, dv, dsinks), ctx.needs_input_grad[:4])]
        bias_grad = None
        if ctx.needs_input_grad[4] and dbias is not None:  # shaped as the mask given to the core
            bias_grad = torch.from_numpy(dbias).reshape(ctx.bias_shape).to(ctx.bias_dtype)
        return (*grads, bias_grad, None)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, key_lengths=None, window=None, sinks=None, temperature=None,
                                 **options):
    """torch.nn.functional.scaled_dot_product_attention computed by qkv (CPU float32).

    query (B, Hq, Nq, Dk), key (B, Hkv, Nk, Dk), value (B, Hkv, Nk, Dv), or rank 3 / 2 as one
    head. attn_mask: bool (True = attend) or float (added), broadcast numpy-style; is_causal,
    scale, enable_gqa as in PyTorch; key_lengths, window as qkv.scaled_dot_product_attention.
    sinks: (Hq) float32 tensor, as qkv.scaled_dot_product_attention's: it gets a gradient when it
    requires one. options: qkv.scaled_dot_product_attention's (seed, softcap, alibi_slopes (not
    differentiated), precision for the forward and the backward, backend), as keywords. A float
    attn_mask that requires grad gets dL/dattn_mask (summed over its broadcast dims).
    temperature: softmax(q.k * scale / T), as qkv.scaled_dot_product_attention's (None: T = 1).
    cu_seqlens_q, cu_seqlens_k: a packed batch of variable-length sequences ((total, H, D) tensors,
    int32 offsets), as qkv.scaled_dot_product_attention's; the output is then (total_q, Hq, Dv).
    rotary_cos, rotary_sin, rotary_interleaved, rotary_keys: rotary positions from tables, as
    qkv.scaled_dot_product_attention's; query and key get the gradients of their unrotated values.
    Returns the (B, Hq, Nq, Dv) output; backward gives query, key, value and sinks their gradients.
    """
    scale = _tempered_scale(scale, temperature, query, "qkv.torch.scaled_dot_product_attention")
    if isinstance(key, torch.Tensor) and key.dtype in (torch.bfloat16, torch.float16):
        # 16-bit keys and values (a KV cache): forward only, read as they are (docs/inference.md).
        import qkv

        _check_tensor(query, "query")
        if query.requires_grad or key.requires_grad or value.requires_grad:
            raise Error("qkv.torch.scaled_dot_product_attention: 16-bit key/value are for inference; "
                        "their backward is not supported (use float32 to train)")
        output = qkv.scaled_dot_product_attention(
            _numpy(query), key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa, key_lengths=key_lengths, window=window, sinks=_numpy(sinks), **options)
        return torch.from_numpy(output)
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        _check_tensor(t, name)
    if sinks is not None:
        _check_tensor(sinks, "sinks")
    _check_gqa(query, key, enable_gqa)
    mask = _mask_from(query, attn_mask, is_causal, key_lengths, window)
    options = _options("qkv.torch.scaled_dot_product_attention", options, mask=mask, scale=scale,
                       dropout_p=dropout_p)
    # A float attn_mask tensor that requires grad joins the inputs (already in `mask`, read as
    # numpy) so that autograd hands it dbias; its value is not read again.
    bias = (attn_mask if isinstance(attn_mask, torch.Tensor) and attn_mask.is_floating_point() and
            attn_mask.requires_grad else None)
    return ScaledDotProductAttention.apply(query, key, value, sinks, bias, options)


class LinearAttention(torch.autograd.Function):
    """qkv::linear_attention and its backward (which recomputes the forward: only q, k, v are kept)."""

    @staticmethod
    def forward(ctx, query, key, value, feature_map, causal, eps, causal_offset):
        output = _core.linear_attention(_numpy(query), _numpy(key), _numpy(value), feature_map, causal, eps,
                                        causal_offset)
        ctx.save_for_backward(query, key, value)
        ctx.options = (feature_map, causal, eps, causal_offset)
        return torch.from_numpy(output)

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value = ctx.saved_tensors
        grad_output = grad_output.detach().to(torch.float32).contiguous()
        grads = _core.linear_attention_backward(_numpy(query), _numpy(key), _numpy(value), grad_output.numpy(),
                                                *ctx.options)
        return (*(torch.from_numpy(g) if needed else None for g, needed in zip(grads, ctx.needs_input_grad[:3])),
                None, None, None, None)


def linear_attention(query, key, value, feature_map="elu+1", is_causal=False, eps=1e-6, causal_offset=0,
                     enable_gqa=False):
    """qkv.linear_attention on CPU float32 torch tensors, differentiable in query, key and value."""
    for t, name in ((query, "query"), (key, "key"), (value, "value")):
        _check_tensor(t, name)
    if not enable_gqa and query.dim() == 4 and key.dim() == 4 and query.shape[1] != key.shape[1]:
        raise Error(f"linear_attention: query has {query.shape[1]} heads but key has {key.shape[1]}: "
                    "pass enable_gqa=True for grouped-query attention")
    return LinearAttention.apply(query, key, value, *_linear_options(feature_map, is_causal, eps, causal_offset))
