"""The three partitions overlap in time, and every label of every node is freed however a request ends."""

import asyncio
import time

import pytest
import torch

from mstar_core.errors import RequestCancelled
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from mstar_qwen_omni import nodes

SPEECH = {"messages": [{"role": "user", "content": "Tell me a story."}], "speaker": "chelsie",
          "talker_temperature": 0.0, "talker_repetition_penalty": 1.0}
KV_NODES = ("thinker", "talker", "code_predictor")


def trace(engine, names):
    """Wrap each node engine's `step`: (node, start, end) for every step that answered a call."""
    events = []
    for name, eng in engine.node_engines("qwen3-omni").items():
        if name not in names:
            continue

        def step(eng=eng, name=name, inner=eng.step):
            start = time.monotonic()
            done = inner()
            if done:
                events.append((name, start, time.monotonic()))
            return done

        eng.step = step
    return events


def assert_all_free(engine):
    for name, eng in engine.node_engines("qwen3-omni").items():
        assert eng.active_requests() == set(), name
        if name in KV_NODES:
            assert not eng.seqs, (name, list(eng.seqs))  # no label left, the per-frame scratch included
            assert eng.stats()["kv_pages_used"] == 0, name


async def wait_all_free(engine, timeout=5.0):
    """Releases run once the request's in-flight steps return: poll briefly, then check."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return assert_all_free(engine)
        except AssertionError:
            await asyncio.sleep(0.02)
    assert_all_free(engine)


async def _engine():
    engine = AsyncEngine(discover())
    await engine.load_model("qwen3-omni", LoadOptions(preset="tiny"))
    return engine


@pytest.mark.slow  # ~30 s: the Thinker must outlast 25 frames; benchmarks/qwen_omni_speech.py measures the same TTFA
async def test_talker_and_audio_start_before_the_thinker_ends():
    engine = await _engine()
    try:
        events = trace(engine, ("thinker", "talker", "code2wav"))
        handle = engine.submit("qwen3-omni", {**SPEECH, "max_tokens": 250, "talker_max_tokens": 26,
                                                     "ignore_eos": True})
        first_audio = None
        async for out in handle:
            if out.name == "audio" and first_audio is None:
                first_audio = time.monotonic()
        await handle.result()
        thinker = [e for e in events if e[0] == "thinker"]
        talker = [e for e in events if e[0] == "talker"]
        assert len(thinker) == 250 and len(talker) == 26 and first_audio is not None
        assert talker[0][1] < thinker[-1][1]  # the Talker's first step started before the Thinker's last
        assert first_audio < thinker[-1][2]  # the first audio chunk left before the Thinker finished
        assert_all_free(engine)
    finally:
        await engine.close()


async def test_labels_are_freed_after_normal_end_error_and_cancel(monkeypatch):
    engine = await _engine()
    try:
        # normal end, speech and text side by side
        await asyncio.gather(engine.submit("qwen3-omni", {**SPEECH, "max_tokens": 6, "talker_max_tokens": 8}).result(),
                             engine.submit("qwen3-omni", {"messages": SPEECH["messages"], "max_tokens": 6}).result())
        assert_all_free(engine)

        # cancelled mid-speech: frames are flowing, the code predictor holds its scratch label
        handle = engine.submit("qwen3-omni", {**SPEECH, "max_tokens": 200, "talker_max_tokens": 200})
        async for out in handle:
            if out.name == "codes" and out.value is not None:
                break
        handle.cancel()
        with pytest.raises(RequestCancelled):
            await handle.result()
        await wait_all_free(engine)

        # an error in the middle of speech fails the request and frees everything
        calls = {"n": 0}
        step = nodes.FrameStep.forward

        def failing(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("frame step broke")
            return step(self, *args, **kwargs)

        monkeypatch.setattr(nodes.FrameStep, "forward", failing)
        with pytest.raises(Exception, match="frame step broke"):
            await engine.submit("qwen3-omni", {**SPEECH, "max_tokens": 40, "talker_max_tokens": 40}).result()
        await wait_all_free(engine)
        monkeypatch.setattr(nodes.FrameStep, "forward", step)
        # and the engine keeps serving
        await engine.submit("qwen3-omni", {**SPEECH, "max_tokens": 4, "talker_max_tokens": 4}).result()
        assert_all_free(engine)
    finally:
        await engine.close()


async def test_sampled_speech_is_seeded_and_stays_in_the_codebook():
    engine = await _engine()
    try:
        inputs = {"messages": SPEECH["messages"], "speaker": "ethan", "max_tokens": 5, "talker_max_tokens": 30,
                  "temperature": 0.8, "seed": 11}  # the published sampling on Talker and code predictor

        async def codes_of(inputs):
            handle = engine.submit("qwen3-omni", inputs)
            frames = [out.value for out in [o async for o in handle] if out.name == "codes" and out.value is not None]
            await handle.result()
            return frames

        first, again = await asyncio.gather(codes_of(inputs), codes_of(inputs))
        other = await codes_of({**inputs, "seed": 12})
        codebook = engine.node_engines("qwen3-omni")["talker"].module.code_predictor.codebook
        assert first and all(int(f.max()) < codebook and int(f.min()) >= 0 for f in first)  # never EOS or specials
        assert len(first) == len(again) and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        assert len(other) != len(first) or any(not torch.equal(a, b) for a, b in zip(first, other, strict=True))
        await wait_all_free(engine)
    finally:
        await engine.close()


async def test_a_frame_is_one_code_predictor_call_of_g_minus_1_engine_steps():
    engine = await _engine()
    try:
        handle = engine.submit("qwen3-omni", {**SPEECH, "max_tokens": 4, "talker_max_tokens": 9, "ignore_eos": True})
        frames = [out.value for out in [o async for o in handle] if out.name == "codes" and out.value is not None]
        await handle.result()
        predictor = engine.node_engines("qwen3-omni")["code_predictor"]
        groups = predictor.module.heads + 1
        assert len(frames) == 8 and all(f.shape == (groups,) for f in frames)
        # the engine fed each code back itself: one walk call per frame, G - 1 forwards each
        assert engine.node_schedulers("qwen3-omni")["code_predictor"].invocations == len(frames)
        assert predictor.num_steps == len(frames) * (groups - 1)
        await wait_all_free(engine)
    finally:
        await engine.close()
