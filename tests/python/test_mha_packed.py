"""qkv.MultiHeadAttention on a packed batch (cu_seqlens=..., the core's
MultiHeadAttention::forward_packed): sequences end to end in one (total_tokens, embed_dim) array."""
import numpy as np
import pytest
import torch

import qkv


def test_multi_head_attention_on_a_packed_batch_equals_torch_per_sequence():
    """Each sequence's rows against torch.nn.MultiheadAttention in float64 on that sequence alone,
    causal, with lengths 0, 1 and odd; and the refusals."""
    rng = np.random.default_rng(5)
    embed, heads, lengths = 16, 4, [5, 1, 0, 11, 3]
    torch.manual_seed(5)
    theirs = torch.nn.MultiheadAttention(embed, heads, batch_first=True).double()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    ours = qkv.MultiHeadAttention(embed, heads)
    ours.load_state_dict(theirs.state_dict())
    ours.eval()
    cu = np.cumsum([0] + lengths)
    x = rng.standard_normal((cu[-1], embed)).astype(np.float32)
    out, weights = ours(x, is_causal=True, cu_seqlens=cu)
    assert weights is None and out.shape == (cu[-1], embed)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        xb = torch.from_numpy(x[cu[b]:cu[b + 1]].astype(np.float64))[None]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        want, _ = theirs(xb, xb, xb, attn_mask=causal, need_weights=False)
        np.testing.assert_allclose(out[cu[b]:cu[b + 1]], want[0].detach().numpy(), rtol=1e-4, atol=2e-5)
    with pytest.raises(qkv.Error, match=r"no key, value, masks, weights or cache"):
        ours(x, x, x, cu_seqlens=cu)
    with pytest.raises(qkv.Error, match=r"cu_seqlens_q\[5\] = 20 but q has 19 rows"):
        ours(x[:19], cu_seqlens=cu)
