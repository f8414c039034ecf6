"""`DenseKVCache` (issue 26): the one dense reference KV cache equals full-sequence dense attention, piece by piece."""

from __future__ import annotations

import torch

from mstar_core.nn import DenseAttention, DenseKVCache


def _qkv(t: int, hq: int = 4, hkv: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g))


def test_prefill_then_decode_steps_equal_causal_attention_over_the_whole_sequence():
    q, k, v = _qkv(9)
    want = DenseAttention().attend(0, q, k, v, 0.3)
    cache = DenseKVCache()
    parts = [cache.attend(0, q[:5], k[:5], v[:5], 0.3)]  # a prefill from empty, then a chunk of two, then single rows
    parts.append(cache.attend(0, q[5:7], k[5:7], v[5:7], 0.3))
    parts += [cache.attend(0, q[i : i + 1], k[i : i + 1], v[i : i + 1], 0.3) for i in (7, 8)]
    torch.testing.assert_close(torch.cat(parts), want, rtol=1e-5, atol=1e-6)
    assert len(cache) == 9 and cache.nbytes() == 2 * 9 * 2 * 8 * 4


def test_a_bidirectional_block_after_a_prefix_sees_the_prefix_and_all_of_itself():
    q, k, v = _qkv(7, seed=1)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    mask[3:, 3:] = True  # rows 3..6: one bidirectional block after a causal prefix of 3
    want = DenseAttention(mask=mask).attend(0, q, k, v, 0.5)
    cache = DenseKVCache()
    head = cache.attend(0, q[:3], k[:3], v[:3], 0.5)
    cache.bidirectional = True
    block = cache.attend(0, q[3:], k[3:], v[3:], 0.5)
    torch.testing.assert_close(torch.cat([head, block]), want, rtol=1e-5, atol=1e-6)


def test_a_reading_forward_stores_nothing_and_a_copy_is_independent():
    q, k, v = _qkv(6, seed=2)
    cache = DenseKVCache()
    cache.attend(0, q[:4], k[:4], v[:4], 0.5)
    snapshot = cache.copy()
    cache.write = False
    first = cache.attend(0, q[4:], k[4:], v[4:], 0.5)
    assert len(cache) == 4 and torch.equal(cache.attend(0, q[4:], k[4:], v[4:], 0.5), first)
    snapshot.attend(0, q[4:], k[4:], v[4:], 0.5)
    assert len(snapshot) == 6 and len(cache) == 4 and snapshot.k[0].data_ptr() != cache.k[0].data_ptr()


def test_an_explicit_mask_replaces_causality():
    q, k, v = _qkv(5, seed=3)
    mask = torch.tensor([[True, False, False, False, True]] * 5)
    want = DenseAttention(mask=mask).attend(0, q, k, v, 0.5)
    torch.testing.assert_close(DenseKVCache(mask=mask).attend(0, q, k, v, 0.5), want, rtol=1e-5, atol=1e-6)
