"""Streaming equals offline: the audio streamed while tokens are generated equals the reference windowing.

The LM here is scripted (a function node replaying a token sequence) so the test isolates the
graph, the streaming edge and the batched SNAC node; `test_end_to_end.py` runs the real LM.
"""

import asyncio

import pytest
import torch
from mstar_orpheus.codes import AudioTokenMap, reference_audio, reference_windows
from mstar_orpheus.graph import build_graph
from mstar_orpheus.snac import SNACConfig, SNACDecoder
from mstar_orpheus.snac_node import SNACWindowDecoder

from mstar_core.graph import to_mermaid
from mstar_core.model import LoadedModel
from mstar_core.runtime import AsyncEngine
from tests.orpheus.helpers import TINY_SNAC, collect

AUDIO = AudioTokenMap(base=300, offset=10, codebook_size=16)
END_OF_SPEECH = AUDIO.base + 2


class Script:
    """Stands in for SamplingParams: the tokens this request's scripted LM will 'sample', in order."""

    def __init__(self, tokens):
        self.tokens = list(tokens)
        self.calls = 0


class ScriptedLM:
    """Each call returns the request's next scripted token (prefill's is discarded, as in the real walk)."""

    def forward_batch(self, inputs):
        outs = []
        for item in inputs:
            script = item["sampling"]
            i = script.calls
            script.calls += 1
            if i == 0:
                outs.append({"next_token": 0, "finish_reason": None, "logprob": 0.0})
                continue
            token = script.tokens[i - 1]
            done = token == END_OF_SPEECH or i == len(script.tokens)
            reason = ("stop" if token == END_OF_SPEECH else "length") if done else None
            outs.append({"next_token": token, "finish_reason": reason, "logprob": 0.0})
        return outs

    def __call__(self, **inputs):
        return self.forward_batch([inputs])[0]


def _snac_node() -> SNACWindowDecoder:
    torch.manual_seed(0)
    snac = SNACDecoder(SNACConfig.from_dict(TINY_SNAC))
    with torch.no_grad():
        for p in snac.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return SNACWindowDecoder(snac.fold_weight_norm().eval(), AUDIO)


def _script(n_audio: int, seed: int, end: bool) -> list[int]:
    """Valid audio tokens (slot-correct codes) with some non-audio ids sprinkled in."""
    gen = torch.Generator().manual_seed(seed)
    out, kept = [], 0
    while kept < n_audio:
        if torch.rand((), generator=gen) < 0.1:
            out.append(int(torch.randint(0, AUDIO.base, (), generator=gen)))  # text: not kept
            continue
        code = int(torch.randint(0, AUDIO.codebook_size, (), generator=gen))
        out.append(AUDIO.first + (kept % 7) * AUDIO.codebook_size + code)
        kept += 1
    return out + [END_OF_SPEECH] if end else out


def _loaded(snac_node) -> LoadedModel:
    graph = build_graph(ScriptedLM(), snac_node, AUDIO, lm_engine="function", snac_engine="function")

    def prepare(inputs):
        tokens = inputs["tokens"]
        return {"prompt_ids": [1, 2, 3], "decode_ids": [4], "sampling": Script(tokens),
                "max_tokens": len(tokens) + 5, "noise_seed": inputs["seed"]}

    return LoadedModel("orpheus-scripted", graph, random_weights=True, prepare=prepare)


@pytest.mark.parametrize("n_audio,end", [(70, True), (73, True), (59, False), (27, True), (28, True)])
async def test_streamed_audio_equals_offline_reference(n_audio, end):
    snac_node = _snac_node()
    engine = AsyncEngine()
    await engine.add_model(_loaded(snac_node))
    scripts = [_script(n_audio + k, seed=k, end=end) for k in range(4)]
    handles = [engine.submit("orpheus-scripted", {"tokens": s, "seed": 100 + k}) for k, s in enumerate(scripts)]

    results = await asyncio.gather(*(collect(h) for h in handles))
    await engine.close()
    for k, (audio, tokens, env) in enumerate(results):
        assert tokens == scripts[k]  # every generated token came out of the decode walk, the first included
        expected = reference_audio(tokens, AUDIO, lambda w, s, k=k: snac_node.decode_window(w, s, 100 + k))
        assert len(audio) == len(expected) == len(reference_windows(tokens, AUDIO))
        kept = sum(AUDIO.is_audio(t) for t in tokens)
        assert len(audio) == max(0, (kept - 28) // 7 + 1)  # no window dropped at the end
        for got, want in zip(audio, expected, strict=True):
            # same samples; batching windows of several requests in one conv call may reorder float sums
            assert got.shape == (16,) and (got - want).abs().max().item() <= 1e-5
        assert len(env["audio"]) == len(audio) and all(a is b for a, b in zip(env["audio"], audio, strict=True))


def test_batched_windows_equal_single_windows():
    node = _snac_node()
    tokens = _script(49, seed=7, end=False)
    windows = reference_windows(tokens, AUDIO)
    from mstar_orpheus.snac_node import window_seed

    batched = node.decode_windows([(w, s, window_seed(5, s)) for s, w in windows])
    for (s, w), got in zip(windows, batched, strict=True):
        assert (got - node.decode_window(w, s, 5)).abs().max().item() <= 1e-5


def test_invalid_window_is_skipped_like_the_reference():
    node = _snac_node()
    good = [t for t in _script(28, seed=1, end=False) if AUDIO.is_audio(t)]
    bad = list(good)
    bad[3] = AUDIO.first + 0  # slot 3 holding a slot-0 id: its code is negative
    assert node.decode_window(bad, 0).numel() == 0
    assert node.decode_window(good, 0).numel() == 16


def test_graph_renders_and_validates():
    graph = build_graph(None, None, AUDIO)
    assert set(graph.walks) == {"prefill", "decode"}
    assert graph.plan({}) == ["prefill", "decode"]
    text = to_mermaid(graph, "decode")
    assert "SlidingWindowChunkPolicy(28, 7" in text and "snac" in text
