"""Cross-attention in the paged engine (`mstar_kvcache.cross`): an encoder output held once per request as per-layer
keys and values in a read-only label, attended by every decoder layer; freed with the request, shared by forks,
batched across requests of different lengths exactly as each runs alone, and never a prefix-cache hit across audio."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mstar_core.graph import GraphNode
from mstar_core.nn.attention import DenseKVCache
from mstar_core.nn.cross_attention import CrossAttention, DenseCrossContext
from mstar_core.nn.self_attention import GroupedQueryAttention
from mstar_core.runtime.engine import Invocation
from tests.engines.paged_tiny import drain, engine_for

VOCAB, HIDDEN, HEADS, LAYERS = 48, 32, 4, 2


class TinyDecoder(nn.Module):
    """Self-attention, cross-attention and an MLP per layer; learned positions (no RoPE), as in Whisper."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        head_dim = HIDDEN // HEADS
        self.config = dict(num_hidden_layers=LAYERS, num_key_value_heads=HEADS, head_dim=head_dim, vocab_size=VOCAB,
                           hidden_size=HIDDEN, num_attention_heads=HEADS)
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(64, HIDDEN)
        self.self_attn = nn.ModuleList(GroupedQueryAttention(HIDDEN, HEADS, HEADS, head_dim, i) for i in range(LAYERS))
        self.cross_attn = nn.ModuleList(CrossAttention(HIDDEN, HEADS, i) for i in range(LAYERS))
        self.mlp = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.eval()

    def cross_kv(self, states: torch.Tensor) -> torch.Tensor:
        return torch.stack([layer.project_kv(states) for layer in self.cross_attn], dim=1)

    def forward(self, input_ids, positions, context):
        x = self.embed_tokens(input_ids) + self.positions(positions)
        for i in range(LAYERS):
            x = x + self.self_attn[i](x, None, context)
            x = x + self.cross_attn[i](x, context)
            x = x + self.mlp[i](x).tanh()
        return x

    def compute_logits(self, hidden):
        return self.head(hidden)


NODE = GraphNode("dec", inputs=("input_ids",), optional_inputs=("sampling", "cross_states"),
                 outputs=("next_token", "finish_reason", "logits"), engine="kvcache")
PROMPT = [1, 5, 9, 2, 7]


def _states(frames: int, seed: int) -> torch.Tensor:
    return torch.randn(frames, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _reference(module: TinyDecoder, states: torch.Tensor, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the first logits, run dense: no pages, the encoder keys at hand."""
    with torch.no_grad():
        ctx = DenseCrossContext(DenseKVCache(), module.cross_kv(states[None])[0])
        ids, out, first = list(prompt), [], None
        hidden = module(torch.tensor(ids), torch.arange(len(ids)), ctx)
        for _ in range(steps):
            logits = module.compute_logits(hidden[-1:])
            first = logits[0] if first is None else first
            out.append(int(logits.argmax()))
            hidden = module(torch.tensor(out[-1:]), torch.tensor([len(ids) + len(out) - 1]), ctx)
        return out, first


def _decode(engine, requests: dict[str, tuple[torch.Tensor, list[int]]], steps: int, release: bool = True):
    """Greedy decode of every request at once (the first call brings its encoder output)."""
    for rid, (states, prompt) in requests.items():
        engine.add(Invocation(rid, "dec", {"input_ids": prompt, "cross_states": states}, {"cross_label": "audio"}))
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    first: dict[str, torch.Tensor] = {}
    while engine.has_work():
        for inv, res in engine.step():
            if isinstance(res, BaseException):
                raise res
            first.setdefault(inv.request_id, res["logits"])
            out[inv.request_id].append(res["next_token"])
            if len(out[inv.request_id]) < steps:
                engine.add(Invocation(inv.request_id, "dec", {"input_ids": [res["next_token"]]}, {}))
            elif release:
                engine.release(inv.request_id)
    return out, first


def test_paged_cross_attention_matches_the_dense_reference():
    module = TinyDecoder()
    states = _states(37, seed=1)
    want, logits = _reference(module, states, PROMPT, 6)
    got, first = _decode(engine_for(module, NODE), {"a": (states, PROMPT)}, 6)
    assert got["a"] == want
    torch.testing.assert_close(first["a"], logits, rtol=1e-5, atol=1e-5)


def test_batched_across_audio_lengths_equals_each_alone():
    module = TinyDecoder()
    requests = {"a": (_states(37, 1), PROMPT), "b": (_states(11, 2), [3, 4]), "c": (_states(64, 3), PROMPT[:3])}
    together, first = _decode(engine_for(module, NODE), requests, 5)
    engine = engine_for(module, NODE)
    assert engine.largest_batch == 0
    for rid, req in requests.items():
        alone, alone_first = _decode(engine_for(module, NODE), {rid: req}, 5)
        assert together[rid] == alone[rid]
        assert torch.equal(first[rid], alone_first[rid])  # bit for bit: a row reads only its own sequence


def test_the_encoder_output_is_projected_once_and_batched():
    module = TinyDecoder()
    calls = []
    real = module.cross_kv
    module.cross_kv = lambda states: calls.append(tuple(states.shape)) or real(states)
    engine = engine_for(module, NODE)
    _decode(engine, {"a": (_states(16, 1), PROMPT), "b": (_states(16, 2), PROMPT), "c": (_states(8, 3), PROMPT)}, 4)
    assert sorted(calls) == [(1, 8, HIDDEN), (2, 16, HIDDEN)]  # one call per length, none per decode step


def test_pages_are_freed_on_finish_and_on_cancel():
    module = TinyDecoder()
    engine = engine_for(module, NODE, enable_prefix_caching=False)
    _decode(engine, {"a": (_states(37, 1), PROMPT)}, 3, release=False)
    assert engine.stats()["kv_cross_pages"] == 10  # 37 frames in pages of 4
    assert engine.pool.num_used == 10 + 2  # and the decoder's own 7 tokens
    engine.release("a")
    assert engine.pool.num_used == 0 and engine.stats()["kv_cross_pages"] == 0 and not engine.active_requests()
    # cancelled before its states were even stored, and cancelled mid-decode
    engine.add(Invocation("b", "dec", {"input_ids": PROMPT, "cross_states": _states(9, 2)}, {"cross_label": "audio"}))
    engine.release("b")
    assert not engine.has_work() and engine.pool.num_used == 0
    engine.add(Invocation("c", "dec", {"input_ids": PROMPT, "cross_states": _states(9, 2)}, {"cross_label": "audio"}))
    engine.step()
    engine.add(Invocation("c", "dec", {"input_ids": [3]}, {}))
    engine.release("c")
    assert engine.pool.num_used == 0 and not engine.active_requests()


def test_forks_share_the_one_cross_label():
    module = TinyDecoder()
    states = _states(37, 1)
    want, _ = _reference(module, states, PROMPT + [4], 3)
    engine = engine_for(module, NODE)
    engine.add(Invocation("a", "dec", {"input_ids": PROMPT, "cross_states": states}, {"cross_label": "audio"}))
    drain(engine)
    used = engine.pool.num_used
    engine.fork("a", "main", "second")
    outs = {}
    for label in ("main", "second"):
        engine.add(Invocation("a", "dec", {"input_ids": [4]}, {"cache_label": label}))
        outs[label] = [drain(engine)["a"]["next_token"]]
    assert engine.stats()["kv_cross_pages"] == 10  # one copy of the encoder keys for both labels
    assert engine.pool.num_used <= used + 2  # the fork copied at most its shared tail page
    for label, tokens in outs.items():
        for _ in range(2):
            engine.add(Invocation("a", "dec", {"input_ids": [tokens[-1]]}, {"cache_label": label}))
            tokens.append(drain(engine)["a"]["next_token"])
        assert tokens == want
    engine.release("a")
    assert engine.pool.num_used == 0


def test_prefix_cache_hits_only_for_the_same_encoder_output():
    module = TinyDecoder()
    engine = engine_for(module, NODE)
    prompt = PROMPT * 2  # two full pages
    _decode(engine, {"a": (_states(16, 1), prompt)}, 2)
    hits = engine.pool.hits
    other, _ = _decode(engine, {"b": (_states(16, 2), prompt)}, 2)
    assert engine.pool.hits == hits  # same prompt, other audio: nothing shared
    assert other["b"] == _reference(module, _states(16, 2), prompt, 2)[0]
    same, _ = _decode(engine, {"c": (_states(16, 1), prompt)}, 2)
    assert engine.pool.hits > hits
    assert same["c"] == _reference(module, _states(16, 1), prompt, 2)[0]


def test_preempted_decoders_recompute_against_their_cross_label():
    module = TinyDecoder()
    requests = {rid: (_states(8, i), PROMPT) for i, rid in enumerate("abc")}
    engine = engine_for(module, NODE, num_pages=16, enable_prefix_caching=False)  # 3 x 2 cross pages, little room
    got, _ = _decode(engine, requests, 12)
    assert engine.num_preemptions > 0
    for rid, (states, prompt) in requests.items():
        assert got[rid] == _reference(module, states, prompt, 12)[0]


def test_bad_cross_inputs_fail_the_call_alone():
    engine = engine_for(TinyDecoder(), NODE)
    cases = [({"input_ids": PROMPT, "cross_states": _states(4, 1)}, {}, "needs option cross_label"),
             ({"input_ids": PROMPT, "cross_states": torch.zeros(4, 7)}, {"cross_label": "x"}, "32 features"),
             ({"input_ids": PROMPT}, {"cross_label": "nope"}, "no cross label 'nope'"),
             ({"input_ids": PROMPT}, {"cross_label": "x", "write_cache": False}, "read-only call")]
    for inputs, opts, message in cases:
        engine.add(Invocation("a", "dec", inputs, opts))
        (_, res), = engine.step()
        assert isinstance(res, Exception) and message in str(res)
    engine.add(Invocation("big", "dec", {"input_ids": PROMPT, "cross_states": _states(400, 1)}, {"cross_label": "x"}))
    (_, res), = engine.step()
    assert getattr(res, "status", None) == 413


@pytest.mark.parametrize("frames", [1, 4, 5])
def test_page_boundaries(frames):
    module = TinyDecoder()
    states = _states(frames, 7)
    got, _ = _decode(engine_for(module, NODE), {"a": (states, PROMPT)}, 3)
    assert got["a"] == _reference(module, states, PROMPT, 3)[0]


def test_rows_written_into_consecutive_pages_equal_the_scattered_write():
    """`PagePool.write_rows` copies straight into consecutive pages (a fresh cross label's): the same page contents,
    the rows after the written ones zero, as the general path that stages a zeroed copy."""
    from mstar_kvcache.pool import PagePool

    kv = torch.randn(3, 2, 37, 2, 4, generator=torch.Generator().manual_seed(0))  # [layers, k/v, rows, heads, dim]
    pools = [PagePool(12, 8, 3, 2, 4) for _ in range(2)]
    for pool in pools:
        pool.kv.fill_(7.0)  # (stale bytes where the tail must become zeros)
    pools[0].write_rows([2, 3, 4, 5, 6], kv)
    pools[1].write_rows([2, 3, 4, 6, 5], kv)  # (not consecutive: the general path)
    slots = pools[0].kv[:, :, 2:7].flatten(2, 3)
    assert torch.equal(slots[:, :, :37], kv) and not slots[:, :, 37:].any()
    assert torch.equal(pools[0].read_rows([2, 3, 4, 5, 6], 40), pools[1].read_rows([2, 3, 4, 6, 5], 40))
    assert torch.equal(pools[0].kv[:, :, 7:], pools[1].kv[:, :, 7:]) and (pools[0].kv[:, :, :2] == 7.0).all()
