"""Bad input raises ValueError (qkv.Error) carrying the library's own message."""
import re

import numpy as np
import pytest

import qkv


def zeros(*shape):
    return np.zeros(shape, dtype=np.float32)


@pytest.mark.parametrize("call, message", [
    (lambda: qkv.scaled_dot_product_attention(zeros(2, 8, 16, 64), zeros(2, 8, 16, 32), zeros(2, 8, 16, 32)),
     "scaled_dot_product_attention: q is (2, 8, 16, 64) but k is (2, 8, 16, 32): head dims differ"),
    (lambda: qkv.scaled_dot_product_attention(zeros(2, 4, 5, 8), zeros(2, 4, 6, 8), zeros(2, 4, 7, 8)),
     "scaled_dot_product_attention: k is (2, 4, 6, 8) but v is (2, 4, 7, 8): key and value lengths differ"),
    (lambda: qkv.scaled_dot_product_attention(zeros(2, 6, 5, 8), zeros(2, 4, 5, 8), zeros(2, 4, 5, 8),
                                              enable_gqa=True),
     "scaled_dot_product_attention: q is (2, 6, 5, 8) but k is (2, 4, 5, 8): query heads (6) must be a multiple "
     "of key/value heads (4)"),
    (lambda: qkv.scaled_dot_product_attention(zeros(2, 6, 5, 8), zeros(2, 2, 5, 8), zeros(2, 2, 5, 8)),
     "scaled_dot_product_attention: query has 6 heads but key has 2: pass enable_gqa=True for grouped-query "
     "attention"),
    (lambda: qkv.scaled_dot_product_attention(zeros(2, 4, 5, 8), zeros(2, 4, 6, 8), zeros(2, 4, 6, 8),
                                              attn_mask=np.ones((5, 5), dtype=bool)),
     "scaled_dot_product_attention: mask keep (1, 1, 5, 5) does not broadcast to the scores (2, 4, 5, 6)"),
    (lambda: qkv.scaled_dot_product_attention(zeros(2, 5, 8), zeros(2, 5, 8), zeros(2, 5, 8), key_lengths=[5]),
     "scaled_dot_product_attention: mask key_lengths has 1 lengths but the batch is 2"),
    (lambda: qkv.scaled_dot_product_attention(zeros(5, 8), zeros(5, 8), zeros(5, 8), dropout_p=1.0),
     "scaled_dot_product_attention: dropout_p must be in [0, 1), got 1"),
    (lambda: qkv.scaled_dot_product_attention(zeros(5, 8), zeros(5, 8), zeros(5, 8), scale=-1.0),
     "scaled_dot_product_attention: scale must be finite and positive, got -1"),
    (lambda: qkv.scaled_dot_product_attention(zeros(5, 8), zeros(5, 8), zeros(5, 8), attn_mask=np.ones((5, 5), int)),
     "attn_mask must be bool or float, got int64"),
    (lambda: qkv.scaled_dot_product_attention(zeros(5, 8), zeros(5, 8), zeros(5, 8), backend="fast"),
     "backend must be one of ['auto', 'decode', 'flash', 'reference'], got 'fast'"),
    (lambda: qkv.MultiHeadAttention(512, 7),
     "MultiHeadAttention: embed_dim (512) must be divisible by num_heads (7)"),
    (lambda: qkv.MultiHeadAttention(16, 4)(zeros(2, 3, 12)),
     "MultiHeadAttention: query is (2, 3, 12) but embed_dim is 16"),
    (lambda: qkv.MultiHeadAttention(16, 4).load_state_dict({"in_proj_weight": zeros(48, 15)}),
     "MultiHeadAttention::load_state_dict: in_proj_weight is (48, 15) but should be (48, 16) (q, k and v stacked)"),
    (lambda: qkv.MultiHeadAttention(8, 2).load_state_dict({"bias_k": zeros(1, 1, 8)}),
     "MultiHeadAttention::load_state_dict: unknown parameter 'bias_k'"),
])
def test_value_error_with_the_library_message(call, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        call()


def test_error_is_a_value_error_subclass():
    assert issubclass(qkv.Error, ValueError)
    with pytest.raises(qkv.Error):
        qkv.scaled_dot_product_attention(zeros(2, 3, 4, 5), zeros(2, 3, 4), zeros(2, 3, 4))


def test_failed_load_changes_nothing():
    mha = qkv.MultiHeadAttention(8, 2)
    before = {name: p.copy() for name, p in mha.parameters().items()}
    state = {name: np.ones_like(p) for name, p in before.items()}
    state["out_proj.bias"] = np.ones(7, np.float32)
    with pytest.raises(ValueError, match="out_proj.bias"):
        mha.load_state_dict(state)
    for name, p in mha.parameters().items():
        np.testing.assert_array_equal(p, before[name])
