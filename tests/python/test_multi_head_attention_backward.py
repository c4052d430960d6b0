"""qkv.MultiHeadAttention.backward against torch.nn.MultiheadAttention's autograd, identical weights.

PyTorch runs in float64 with dropout 0; qkv in float32. Both the input gradients and every
parameter gradient (torch_grads(): PyTorch's names) are compared, for self- and cross-attention,
key_padding_mask, attn_mask (bool and float, 2-D and per head), kdim/vdim without bias,
sequence-first and unbatched inputs.
"""
import numpy as np
import pytest
import torch

import qkv
from test_multi_head_attention import B, E, H, NK, NQ, pair, randn

GRAD_TOL = dict(rtol=2e-4, atol=5e-5)


def torch_backward(module, inputs, grad, **kwargs):
    """Input gradients and {name: grad} of sum(module(*inputs)[0] * grad). Inputs that are the
    same numpy object become one tensor, so its gradient sums every path (as self-attention)."""
    tensors = {}
    for x in inputs:
        if id(x) not in tensors:
            tensors[id(x)] = torch.from_numpy(np.asarray(x, np.float64)).requires_grad_()
    module.zero_grad()
    out, _ = module(*(tensors[id(x)] for x in inputs),
                    **{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()})
    (out * torch.from_numpy(grad.astype(np.float64))).sum().backward()
    return ([t.grad.numpy() for t in tensors.values()],
            {name: p.grad.numpy() for name, p in module.named_parameters() if p.grad is not None})


def check_param_grads(ours, expected):
    got = ours.torch_grads()
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], **GRAD_TOL, err_msg=name)


def test_self_attention_backward(rng):
    theirs, ours = pair(rng)
    x = randn(rng, B, NQ, E)
    grad = randn(rng, B, NQ, E)
    (expected_dx,), expected_params = torch_backward(theirs, (x, x, x), grad)
    ours(x)
    dx = ours.backward(grad)  # self-attention: one gradient, the three paths summed
    assert isinstance(dx, np.ndarray) and dx.shape == x.shape
    np.testing.assert_allclose(dx, expected_dx, **GRAD_TOL)
    check_param_grads(ours, expected_params)


@pytest.mark.parametrize("mask", ["none", "key_padding", "bool_2d", "float_3d", "causal_and_padding"])
def test_cross_attention_backward(rng, mask):
    theirs, ours = pair(rng)
    query, key, value = randn(rng, B, NQ, E), randn(rng, B, NK, E), randn(rng, B, NK, E)
    grad = randn(rng, B, NQ, E)
    padding = np.zeros((B, NK), dtype=bool)  # True = padding (PyTorch's convention)
    padding[1, 4:] = True
    masked = rng.random((NQ, NK)) < 0.4      # True = masked
    masked[:, 0] = False
    per_head = np.where(rng.random((B * H, NQ, NK)) < 0.3, -np.inf, rng.standard_normal((B * H, NQ, NK)))
    per_head[..., 0] = 0.0
    kwargs = {
        "none": {},
        "key_padding": {"key_padding_mask": padding},
        "bool_2d": {"attn_mask": masked},
        "float_3d": {"attn_mask": per_head},
        "causal_and_padding": {"attn_mask": np.triu(np.ones((NQ, NK), dtype=bool), k=1),
                               "key_padding_mask": padding},
    }[mask]
    expected_inputs, expected_params = torch_backward(theirs, (query, key, value), grad, **kwargs)
    ours(query, key, value, **kwargs)
    grads = ours.backward(grad)
    for got, expected in zip(grads, expected_inputs):
        np.testing.assert_allclose(got, expected, **GRAD_TOL)
    check_param_grads(ours, expected_params)


def test_kdim_vdim_without_bias_backward(rng):
    theirs, ours = pair(rng, bias=False, kdim=6, vdim=10)
    query, key, value = randn(rng, B, NQ, E), randn(rng, B, NK, 6), randn(rng, B, NK, 10)
    grad = randn(rng, B, NQ, E)
    expected_inputs, expected_params = torch_backward(theirs, (query, key, value), grad)
    assert "q_proj_weight" in expected_params and "in_proj_bias" not in expected_params
    ours(query, key, value)
    for got, expected in zip(ours.backward(grad), expected_inputs):
        np.testing.assert_allclose(got, expected, **GRAD_TOL)
    check_param_grads(ours, expected_params)


def test_sequence_first_and_unbatched_backward(rng):
    theirs, ours = pair(rng, batch_first=False)
    query, memory = randn(rng, NQ, B, E), randn(rng, NK, B, E)  # (N, B, E)
    grad = randn(rng, NQ, B, E)
    (expected_dq, expected_dm), expected_params = torch_backward(theirs, (query, memory, memory), grad)
    ours(query, memory)  # value defaults to key: its path is in dkey
    dq, dm, dv = ours.backward(grad)
    assert dv is None and dq.shape == query.shape and dm.shape == memory.shape
    np.testing.assert_allclose(dq, expected_dq, **GRAD_TOL)
    np.testing.assert_allclose(dm, expected_dm, **GRAD_TOL)
    check_param_grads(ours, expected_params)

    ours.zero_grad()
    single = query[:, 0]  # unbatched (N, E)
    (expected_dx,), expected_params = torch_backward(theirs, (single, single, single), grad[:, 0])
    ours(single)
    np.testing.assert_allclose(ours.backward(grad[:, 0]), expected_dx, **GRAD_TOL)
    check_param_grads(ours, expected_params)


def test_gradients_accumulate_until_zero_grad(rng):
    _, ours = pair(rng)
    x, grad = randn(rng, B, NQ, E), randn(rng, B, NQ, E)
    grads = ours.grads()
    assert list(grads) == list(ours.parameters())
    assert all((g == 0).all() for g in grads.values())
    ours(x)
    ours.backward(grad)
    once = {name: g.copy() for name, g in ours.grads().items()}
    assert any((g != 0).any() for g in once.values())
    ours(x)
    ours.backward(grad)
    for name, g in ours.grads().items():
        np.testing.assert_allclose(g, 2 * once[name], rtol=1e-5, atol=1e-6)
    ours.zero_grad()
    assert all((g == 0).all() for g in grads.values())  # the views see the clear


def test_backward_before_forward_is_an_error():
    ours = qkv.MultiHeadAttention(E, H)
    with pytest.raises(ValueError, match="forward"):
        ours.backward(np.zeros((B, NQ, E), np.float32))
