"""Paged K/V (block_table / cache_seqlens, FlashAttention's flash_attn_with_kvcache layout).

- qkv.scaled_dot_product_attention with query (B, Nq, Hq, D), key and value page pools
  (num_pages, page_size, Hkv, D) in shuffled order with a page shared between two sequences,
  against a float64 numpy oracle that gathers each sequence's keys from the block table and
  attends causally aligned to the end of its keys (bottom-right), with an empty cache, one key,
  more queries than keys, GQA, ALiBi and softcap; numpy and torch int32 tables; float32 and
  torch bfloat16 / numpy float16 pools.
- Bad tables and options are a qkv.Error naming the value.
"""
import numpy as np
import pytest
import torch

import qkv

HQ, HKV, DK, DV = 4, 2, 12, 10
LENGTHS = [40, 70, 0, 1, 129]


def paged(seed, page_size, nq):
    """q (B, Nq, Hq, DK), pools, int32 block table and lengths; sequence 1 shares sequence 0's first page."""
    rng = np.random.default_rng(seed)
    pages = [-(-n // page_size) for n in LENGTHS]
    max_pages = max(pages) + 1
    num_pages = sum(pages) + 2
    slots = list(rng.permutation(num_pages))
    table = np.full((len(LENGTHS), max_pages), -1, np.int32)
    for b, count in enumerate(pages):
        for p in range(count):
            table[b, p] = table[0, 0] if (b == 1 and p == 0 and pages[0] > 1) else slots.pop()
    k_pool = rng.standard_normal((num_pages, page_size, HKV, DK)).astype(np.float32)
    v_pool = rng.standard_normal((num_pages, page_size, HKV, DV)).astype(np.float32)
    q = rng.standard_normal((len(LENGTHS), nq, HQ, DK)).astype(np.float32)
    return q, k_pool, v_pool, table, np.array(LENGTHS, np.int32)


def oracle(q, k_pool, v_pool, table, lengths, causal, softcap=0.0, slopes=None):
    """float64: each sequence's keys gathered page by page, query i at key position n - Nq + i."""
    q, k_pool, v_pool = (np.asarray(x, np.float64) for x in (q, k_pool, v_pool))
    batch, nq = q.shape[0], q.shape[1]
    page_size = k_pool.shape[1]
    out = np.zeros((batch, nq, HQ, DV))
    lse = np.full((batch, HQ, nq), -np.inf)
    for b in range(batch):
        n = int(lengths[b])
        rows = [(table[b, j // page_size], j % page_size) for j in range(n)]
        k = np.array([k_pool[p, r] for p, r in rows]).reshape(n, HKV, DK)
        v = np.array([v_pool[p, r] for p, r in rows]).reshape(n, HKV, DV)
        for h in range(HQ):
            g = h // (HQ // HKV)
            s = q[b, :, h] @ k[:, g].T / np.sqrt(DK)  # (Nq, n)
            if softcap:
                s = softcap * np.tanh(s / softcap)
            position = n - nq + np.arange(nq)[:, None]
            if slopes is not None:
                s = s - slopes[h] * np.abs(position - np.arange(n)[None, :])
            if causal:
                s = np.where(np.arange(n)[None, :] <= position, s, -np.inf)
            for i in range(nq):
                if n == 0 or np.all(np.isneginf(s[i])):
                    continue
                m = s[i].max()
                w = np.exp(s[i] - m)
                out[b, i, h] = w @ v[:, g] / w.sum()
                lse[b, h, i] = m + np.log(w.sum())
    return out, lse


@pytest.mark.parametrize("page_size", [1, 16, 64, 7])
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_against_float64(page_size, nq, causal):
    q, k_pool, v_pool, table, lengths = paged(page_size * 10 + nq, page_size, nq)
    out, lse = qkv.scaled_dot_product_attention(q, k_pool, v_pool, is_causal=causal, block_table=table,
                                                cache_seqlens=lengths, return_lse=True)
    want, want_lse = oracle(q, k_pool, v_pool, table, lengths, causal)
    assert out.shape == (len(LENGTHS), nq, HQ, DV) and lse.shape == (len(LENGTHS), HQ, nq)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)


def test_modifiers_and_more_queries_than_keys():
    q, k_pool, v_pool, table, lengths = paged(3, 16, 5)
    slopes = np.array([0.1, 0.2, 0.05, 0.3], np.float32)
    out = qkv.scaled_dot_product_attention(q, k_pool, v_pool, is_causal=True, block_table=table,
                                           cache_seqlens=lengths, softcap=4.0, alibi_slopes=slopes)
    want, _ = oracle(q, k_pool, v_pool, table, lengths, True, softcap=4.0, slopes=slopes)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    assert np.all(out[3, :4] == 0)  # one key: the first 4 of 5 queries see nothing


def test_torch_int32_tables_and_16_bit_pools():
    q, k_pool, v_pool, table, lengths = paged(5, 16, 2)
    want, _ = oracle(q, k_pool, v_pool, table, lengths, True)
    out = qkv.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k_pool), torch.from_numpy(v_pool),
                                           is_causal=True, block_table=torch.from_numpy(table),
                                           cache_seqlens=torch.from_numpy(lengths))
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    k16, v16 = torch.from_numpy(k_pool).bfloat16(), torch.from_numpy(v_pool).bfloat16()
    want16, _ = oracle(q, k16.float().numpy(), v16.float().numpy(), table, lengths, True)
    out16 = qkv.scaled_dot_product_attention(q, k16, v16, is_causal=True, block_table=table, cache_seqlens=lengths)
    np.testing.assert_allclose(out16, want16, atol=2e-5, rtol=2e-5)
    half = qkv.scaled_dot_product_attention(q, k_pool.astype(np.float16), v_pool.astype(np.float16), is_causal=True,
                                            block_table=table, cache_seqlens=lengths)
    want_half, _ = oracle(q, k_pool.astype(np.float16), v_pool.astype(np.float16), table, lengths, True)
    np.testing.assert_allclose(half, want_half, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("change, message", [
    (lambda t, n: (t.astype(np.float32), n), "int32"),
    (lambda t, n: (np.where(t == t[0, 0], 99, t).astype(np.int32), n), "is outside [0, "),
    (lambda t, n: (t, n + 1000), "cache_seqlens[0] = 1040 is outside"),
    (lambda t, n: (t, n[:2]), "cache_seqlens has 2 entries"),
    (lambda t, n: (t, None), "need both"),
    (lambda t, n: (t.reshape(1, -1), n), "block_table has shape (1, "),
    (lambda t, n: (t.astype(np.longlong), n + 1000), "cache_seqlens[0] = 1040 is outside"),  # int64 'q' is taken
])
def test_bad_tables_are_named(change, message):
    q, k_pool, v_pool, table, lengths = paged(7, 16, 1)
    table, lengths = change(table, lengths)
    with pytest.raises(qkv.Error, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        qkv.scaled_dot_product_attention(q, k_pool, v_pool, block_table=table, cache_seqlens=lengths)


def test_refused_options_are_named():
    q, k_pool, v_pool, table, lengths = paged(9, 16, 1)
    for keywords, message in [(dict(need_weights=True), "need_weights"), (dict(key_lengths=[1] * 5), "key_lengths"),
                              (dict(backend="flash"), "backend Flash")]:
        with pytest.raises(qkv.Error, match=message):
            qkv.scaled_dot_product_attention(q, k_pool, v_pool, block_table=table, cache_seqlens=lengths, **keywords)
    with pytest.raises(qkv.Error, match=r"\(B, Nq, Hq, Dk\)"):
        qkv.scaled_dot_product_attention(q[0], k_pool, v_pool, block_table=table, cache_seqlens=lengths)


def test_paged_kv_cache_fork_and_attention():
    """qkv.PagedKVCache: a prompt forked into two continuations (the shared, partly filled last
    page copied on the first append), attended through paged_options against the float64 oracle
    on each sequence's own rows."""
    rng = np.random.default_rng(11)
    cache = qkv.PagedKVCache(num_pages=20, page_size=4, kv_heads=HKV, head_dim=DK)
    rows = {}
    prompt = cache.add_sequence()
    k, v = rng.standard_normal((2, HKV, 10, DK), dtype=np.float32)
    cache.append(prompt, k, v)
    a, b = cache.fork(prompt), cache.fork(prompt)
    assert cache.pages(a) == cache.pages(prompt) and cache.references(cache.pages(a)[0]) == 3
    rows[prompt] = (k, v)
    for s, n in [(a, 5), (b, 1)]:
        k2, v2 = rng.standard_normal((2, HKV, n, DK), dtype=np.float32)
        cache.append(s, k2, v2)
        rows[s] = (np.concatenate([k, k2], 1), np.concatenate([v, v2], 1))
    assert cache.pages(a)[2] != cache.pages(prompt)[2] != cache.pages(b)[2]  # each copied the shared last page
    sequences = [prompt, a, b]
    table, lengths = cache.paged_options(sequences)
    assert list(lengths) == [10, 15, 11]
    q = rng.standard_normal((3, 2, HQ, DK)).astype(np.float32)
    out = qkv.scaled_dot_product_attention(q, cache.key_pool, cache.value_pool[..., :DK], is_causal=True,
                                           block_table=table, cache_seqlens=lengths)
    for i, s in enumerate(sequences):
        k_s, v_s = rows[s]
        n = k_s.shape[1]
        # the oracle on a one-page pool holding the sequence's own rows
        want, _ = oracle(q[i:i + 1], k_s.transpose(1, 0, 2)[None], v_s.transpose(1, 0, 2)[None, ..., :DV],
                         np.zeros((1, 1), np.int32), [n], True)
        np.testing.assert_allclose(out[i:i + 1, ..., :DV], want, atol=2e-5, rtol=2e-5)
    cache.release(prompt)
    cache.release(a)
    cache.release(b)
    assert cache.free_pages == 20


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16", "int8", "int4"])
def test_multi_head_attention_on_a_paged_cache(dtype):
    """MultiHeadAttention.forward(x, cache=PagedKVCache, sequences=): a prompt forked into two
    continuations, each step's output the one a contiguous qkv.KVCache of the same dtype gives the
    same tokens (the same keys and values, attended in the same order: equal to rounding), the
    prompt's pages shared; and the refusals."""
    rng = np.random.default_rng(5)
    mha = qkv.MultiHeadAttention(32, 4, num_kv_heads=2, rotary=True).eval()
    paged = qkv.PagedKVCache(num_pages=16, page_size=4, kv_heads=2, head_dim=8, dtype=dtype)
    assert paged.dtype == dtype
    prompt = rng.standard_normal((1, 6, 32)).astype(np.float32)
    root = paged.add_sequence()
    mha(prompt, cache=paged, sequences=[root])
    branches = [paged.fork(root), paged.fork(root)]
    contiguous = [mha.make_cache(1, 32, dtype) for _ in branches]
    for c in contiguous:
        mha(prompt, cache=c)
    for step in range(3):
        x = rng.standard_normal((2, 1 + step, 32)).astype(np.float32)
        got, _ = mha(x, cache=paged, sequences=branches)
        for b, c in enumerate(contiguous):
            want, _ = mha(x[b:b + 1], cache=c)
            np.testing.assert_allclose(got[b:b + 1], want, rtol=1e-5, atol=1e-5)
    assert [paged.length(s) for s in branches] == [12, 12]
    assert paged.pages(branches[0])[0] == paged.pages(branches[1])[0] == paged.pages(root)[0]  # the prompt's page
    assert paged.key_pool.dtype == np.float32 and paged.key_pool.shape == (16, 4, 2, 8)
    with pytest.raises(qkv.Error, match="sequences go with a qkv.PagedKVCache"):
        mha(x, sequences=branches)
    with pytest.raises(qkv.Error, match="takes sequences="):
        mha(x, cache=paged)
    with pytest.raises(qkv.Error, match="head_dim 7 must be even"):
        qkv.PagedKVCache(num_pages=2, page_size=4, kv_heads=2, head_dim=7, dtype="int4")


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_page_pools(dtype):
    """qkv.quantize_kv of page pools attends as the dequantised float32 pools do (the same values,
    read in another order: equal to rounding), and a non-finite append leaves the cache as it was."""
    q, k_pool, v_pool, table, lengths = paged(9, 16, 1)
    k_pool, v_pool = np.nan_to_num(k_pool), np.nan_to_num(v_pool)
    k_pool, v_pool = k_pool[..., :12], v_pool[..., :12]  # int4 needs an even D
    kq, vq = qkv.quantize_kv(k_pool, dtype), qkv.quantize_kv(v_pool, dtype)
    got = qkv.scaled_dot_product_attention(q[..., :12], kq, vq, block_table=table, cache_seqlens=lengths)
    want = qkv.scaled_dot_product_attention(q[..., :12], kq.dequantize(), vq.dequantize(), block_table=table,
                                            cache_seqlens=lengths)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    cache = qkv.PagedKVCache(num_pages=4, page_size=4, kv_heads=1, head_dim=8, dtype=dtype)
    s = cache.add_sequence()
    cache.append(s, np.ones((1, 3, 8), np.float32), np.ones((1, 3, 8), np.float32))
    bad = np.ones((1, 2, 8), np.float32)
    bad[0, 1, 5] = np.inf
    with pytest.raises(qkv.Error, match="needs finite keys and values"):
        cache.append(s, bad, np.ones((1, 2, 8), np.float32))
    assert cache.length(s) == 3 and cache.free_pages == 3
    np.testing.assert_array_equal(cache.key_pool[cache.pages(s)[0], :3], np.ones((3, 1, 8), np.float32))


@pytest.mark.parametrize("dtype", ["f32", "int8"])
def test_make_cache_with_page_size(dtype):
    """make_cache(batch, capacity, dtype, page_size=): the same outputs as the contiguous cache of
    that dtype, token by token, its rows' lengths, and reset returning the pages."""
    rng = np.random.default_rng(9)
    mha = qkv.MultiHeadAttention(32, 4, num_kv_heads=2, rotary=True).eval()
    paged, plain = mha.make_cache(2, 20, dtype, page_size=8), mha.make_cache(2, 20, dtype)
    assert paged.page_size == 8 and plain.page_size is None and paged.paged.free_pages == 6
    for n in (5, 1, 1, 4):
        x = rng.standard_normal((2, n, 32)).astype(np.float32)
        np.testing.assert_allclose(mha(x, cache=paged)[0], mha(x, cache=plain)[0], rtol=1e-5, atol=1e-5)
    assert paged.lengths == plain.lengths == [11, 11] and paged.length == 11 and paged.dtype == dtype
    assert [paged.paged.length(s) for s in paged.sequences] == [11, 11] and paged.paged is paged.paged
    # Each row keeps to the capacity, as a contiguous cache's, though the pool has a spare page.
    assert paged.paged.free_pages == 2
    with pytest.raises(qkv.Error, match="exceed the capacity 20"):
        mha(rng.standard_normal((2, 10, 32)).astype(np.float32), cache=paged)
    assert paged.lengths == [11, 11]
    paged.reset()
    assert paged.lengths == [0, 0] and paged.paged.free_pages == 6
    with pytest.raises(qkv.Error, match="a paged cache .page_size 8. has none"):
        mha.make_cache(2, 20, page_size=8, window=4)
    with pytest.raises(qkv.Error, match="no sequences or counts"):
        mha(x, cache=paged, counts=[1, 2])
