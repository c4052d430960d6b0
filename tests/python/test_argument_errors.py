"""Every bad argument is a qkv.Error naming the argument and what it got: never a bare TypeError,
ValueError, IndexError or a pybind11 message printing whole arrays, and checked on the array's
metadata before anything is copied."""
import time

import numpy as np
import pytest

import qkv


def zeros(*shape, dtype=np.float32):
    return np.zeros(shape, dtype=dtype)


Q = zeros(2, 4, 5, 8)


def sdpa(**kwargs):
    return qkv.scaled_dot_product_attention(Q, Q, Q, **kwargs)


@pytest.mark.parametrize("call, names", [
    (lambda: sdpa(window=(1, 2, 3)), ["window", "(1, 2, 3)"]),
    (lambda: sdpa(window="wide"), ["window", "'wide'"]),
    (lambda: sdpa(window=(1.5, 0)), ["window left", "1.5"]),
    (lambda: sdpa(window=2**70), ["window", str(2**70)]),
    (lambda: sdpa(key_lengths="ab"), ["key_lengths", "'ab'"]),
    (lambda: sdpa(key_lengths=[[1, 2], [3, 4]]), ["key_lengths"]),
    (lambda: sdpa(key_lengths=[2.5, 1]), ["key_lengths"]),
    (lambda: sdpa(key_lengths=[1, None]), ["key_lengths"]),
    (lambda: sdpa(seed=-1), ["seed", "-1", "[0, 2**64)"]),
    (lambda: sdpa(seed="x"), ["seed", "'x'"]),
    (lambda: sdpa(dropout_p=None, seed=1), ["dropout_p", "None"]),
    (lambda: sdpa(scale="big"), ["scale", "'big'"]),
    (lambda: sdpa(softcap=[1, 2]), ["softcap", "[1, 2]"]),
    (lambda: sdpa(backend=None), ["backend", "None"]),
    (lambda: sdpa(backend=3), ["backend", "3"]),
    (lambda: sdpa(precision=None), ["precision", "None"]),
    (lambda: sdpa(alibi_slopes="x"), ["alibi_slopes", "'x'"]),
    (lambda: sdpa(sinks=np.array(["a"])), ["sinks", "<U1"]),
    (lambda: sdpa(attn_mask=np.ones((5, 5), dtype=np.int32)), ["attn_mask", "int32"]),
    (lambda: sdpa(attn_mask=np.array([["a"]])), ["attn_mask", "<U1"]),
    (lambda: sdpa(softcapp=1.0), ["softcapp", "softcap"]),
    (lambda: sdpa(mask=qkv.Mask()), ["mask"]),
    (lambda: qkv.scaled_dot_product_attention(None, Q, Q), ["query is None"]),
    (lambda: qkv.scaled_dot_product_attention(Q, [[1, 2], [3]], Q), ["key"]),
    (lambda: qkv.scaled_dot_product_attention(Q, "abc", Q), ["key", "<U3"]),
    (lambda: qkv.scaled_dot_product_attention_backward(Q, Q, Q, Q, Q, None), ["lse is None"]),
    (lambda: qkv.scaled_dot_product_attention_backward(Q, Q, Q, Q, Q, zeros(2, 4, 5), seed=-1), ["seed", "-1"]),
    (lambda: qkv.linear_attention(Q, Q, Q, eps="small"), ["eps", "'small'"]),
    (lambda: qkv.linear_attention(Q, Q, Q, feature_map=None), ["feature_map", "None"]),
    (lambda: qkv.linear_attention(Q, Q, Q, causal_offset=0.5), ["causal_offset", "0.5"]),
    (lambda: qkv.MultiHeadAttention(None, 4), ["embed_dim", "None"]),
    (lambda: qkv.MultiHeadAttention(16, 4, dropout="x"), ["dropout", "'x'"]),
    (lambda: qkv.MultiHeadAttention(16, 4, seed=-1), ["seed", "-1"]),
    (lambda: qkv.MultiHeadAttention(16, 4, precision=1), ["precision", "1"]),
    (lambda: qkv.MultiHeadAttention(16, 4)(zeros(2, 3, 16), key_padding_mask=zeros(3, 3, dtype=bool)),
     ["key_padding_mask", "(3, 3)", "(2, 3)"]),
    (lambda: qkv.MultiHeadAttention(16, 4)(zeros(2, 3, 16), key_padding_mask=np.bool_(True)),
     ["key_padding_mask", "()"]),
    (lambda: qkv.MultiHeadAttention(16, 4)(zeros(2, 3, 16), attn_mask=zeros(3, 3, 3, dtype=bool)),
     ["attn_mask", "(3, 3, 3)", "num_heads"]),
    (lambda: qkv.MultiHeadAttention(16, 4)(zeros(2, 3, 16), attn_mask=zeros(3, 3, dtype=np.int8)),
     ["attn_mask", "int8"]),
    (lambda: qkv.MultiHeadAttention(16, 4)(None), ["query is None"]),
    (lambda: qkv.MultiHeadAttention(16, 4).eval()(zeros(1, 2, 16), cache="c"), ["cache", "'c'"]),
    (lambda: qkv.MultiHeadAttention(16, 4).eval()(zeros(1, 2, 16), cache=qkv.MultiHeadAttention(16, 4).make_cache(
        1, 8), counts=["a"]), ["counts"]),
    (lambda: qkv.MultiHeadAttention(16, 4).make_cache(-1.5, 8), ["batch", "-1.5"]),
    (lambda: qkv.MultiHeadAttention(8, 2).load_state_dict(None), ["load_state_dict", "None"]),
    (lambda: qkv.MultiHeadAttention(8, 2).load_state_dict([("in_proj_weight", 1)]), ["load_state_dict", "[("]),
    (lambda: qkv.KVCache(None), ["make_cache", "None"]),
    (lambda: qkv.create_causal_mask("4"), ["n", "'4'"]),
    (lambda: qkv.create_padding_mask([1, "a"], 4), ["lengths"]),
    (lambda: qkv.dropout_keeps(-1, 0, 0, 0, 0, 0.5), ["dropout_keeps", "seed = -1"]),
    (lambda: qkv.manual_seed("s"), ["manual_seed", "seed = 's'"]),
    (lambda: qkv.Mask.window("a"), ["Mask.window", "left = 'a'"]),
    (lambda: qkv.Mask.causal(offset=None), ["Mask.causal", "offset = None"]),
    (lambda: qkv.Mask.parse(5), ["Mask.parse", "expression = 5"]),
    (lambda: qkv.Mask.keep("a"), ["Mask.keep"]),
    (lambda: qkv.Mask.key_lengths([1, "x"]), ["Mask.key_lengths", "lengths = [1, 'x']"]),
    (lambda: qkv.RotaryEmbedding("8"), ["RotaryEmbedding.__init__", "head_dim = '8'"]),
    (lambda: qkv.RotaryEmbedding(8).apply(zeros(2, 8), position_offset="a"), ["apply", "position_offset = 'a'"]),
])
def test_bad_argument_is_a_named_qkv_error(call, names):
    with pytest.raises(qkv.Error) as error:
        call()
    for name in names:
        assert name in str(error.value), (name, str(error.value))
    assert len(str(error.value)) < 600  # a message, not a printed array


def test_pybind_never_prints_an_array():
    big = np.arange(10000, dtype=np.float32).reshape(100, 100)
    with pytest.raises(qkv.Error) as error:
        qkv.Mask.block_sparse(big, "a", 1)
    assert "block_q = 'a'" in str(error.value) and "9999" not in str(error.value)
    with pytest.raises(qkv.Error) as error:
        qkv.RotaryEmbedding(8).apply(big.astype(np.int64))
    assert "int64" in str(error.value) and "9999" not in str(error.value)


def test_rank_is_checked_before_a_broadcast_is_copied():
    # 8 GB once expanded: refused on the metadata, at once.
    huge = np.broadcast_to(np.float64(1.0), (64, 64, 64, 64, 8192))
    start = time.monotonic()
    for call in (lambda: qkv.scaled_dot_product_attention(huge, Q, Q, allow_cast=True),
                 lambda: qkv.scaled_dot_product_attention(Q, Q, Q, attn_mask=huge),
                 lambda: qkv.MultiHeadAttention(16, 4)(huge, allow_cast=True)):
        with pytest.raises(qkv.Error, match=r"is \(64, 64, 64, 64, 8192\): qkv's arrays have at most 4 dims"):
            call()
    with pytest.raises(qkv.Error, match=r"shape \(64, 64, 64, 64, 8192\)\): qkv's arrays have at most 4 dims"):
        qkv.RotaryEmbedding(8).apply(np.broadcast_to(np.float32(1), (64, 64, 64, 64, 8192)))
    assert time.monotonic() - start < 2.0


def test_a_strided_view_is_still_read():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 8, 6), dtype=np.float32)
    view = np.swapaxes(np.swapaxes(q, 2, 3).copy(), 2, 3)
    assert not view.flags.c_contiguous
    np.testing.assert_array_equal(qkv.scaled_dot_product_attention(view, view, view),
                                  qkv.scaled_dot_product_attention(q, q, q))
    broadcast = np.broadcast_to(q[:1], (2, 4, 8, 6))
    np.testing.assert_allclose(qkv.scaled_dot_product_attention(broadcast, q, q)[1],
                               qkv.scaled_dot_product_attention(q[:1], q[1:], q[1:])[0], atol=1e-6)


def test_a_mask_expression_with_a_nul_byte_arrives_whole():
    # The binding gets the whole string: the NUL is refused at its column, the text after it shown
    # (a message passed on as a C string would end at the NUL).
    with pytest.raises(qkv.MaskParseError, match=r"^mask 'causal\\0 & window\(2\)': column 7, found a NUL byte$"):
        qkv.Mask.parse("causal\x00 & window(2)")
    with pytest.raises(qkv.MaskParseError):
        sdpa(attn_mask="causal\x00")


def test_options_are_one_object():
    options = qkv._core.AttentionOptions()
    assert qkv._OPTION_KEYWORDS == {"seed", "backend", "softcap", "alibi_slopes", "sinks", "precision", "score_mod",
                                    "mask_mod", "mod_inputs", "cu_seqlens_q", "cu_seqlens_k", "block_table",
                                    "cache_seqlens", "rotary_cos", "rotary_sin", "rotary_interleaved",
                                    "rotary_keys"}
    made = qkv._options("f", {"softcap": 2, "backend": "FLASH", "precision": "High"}, scale=0.5, dropout_p=0.25)
    assert (made.softcap, made.backend, made.precision, made.scale, made.dropout_p) == (
        2.0, qkv.Backend.Flash, "high", 0.5, 0.25)
    assert options.alibi_slopes is None and options.mask.is_none()
