"""Qwen3-TTS under `admit_streams` on its Talker: calls carry the listener's lead, and a stream past `max_starting`
starts only once one before it plays (exact order, no timing assumed)."""

from __future__ import annotations

import asyncio
import time

import pytest
from mstar_qwen_tts.model import ADMIT_STREAMS

from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from mstar_core.runtime.scheduler import NodeScheduler
from mstar_core.runtime.stream_admission import StreamAdmission, StreamLeads

# 28 frames: one 25-frame window plays while the Talker goes on
REQUEST = {"input": "Hello there!", "voice": "ryan", "max_frames": 28, "ignore_eos": True}


async def streams(monkeypatch, settings: dict | None, count: int = 2) -> tuple[list, dict, dict, tuple[str, ...], object]:
    """`count` concurrent requests on a tiny model loaded with `settings`: (the Talker's calls as (request, lead, time),
    each request's first call reaching the Talker's engine, each request's first audio, their ids, the Talker's
    `admit_streams` as built)."""
    talker_calls: list[tuple[str, float | None, float]] = []
    original = NodeScheduler.submit

    def spy(self, invocation):
        if invocation.node == "talker":
            talker_calls.append((invocation.request_id, invocation.lead, time.perf_counter()))
        return original(self, invocation)

    monkeypatch.setattr(NodeScheduler, "submit", spy)
    async with AsyncEngine(discover()) as engine:
        await engine.load_model("qwen3-tts", LoadOptions(preset="tiny"), settings=settings)
        first_audio: dict[str, float] = {}
        admitted: dict[str, float] = {}  # when each request's first call reached the Talker's engine
        talker = engine.node_schedulers("qwen3-tts")["talker"].engine
        add = talker.add

        def add_spy(invocation):
            admitted.setdefault(invocation.request_id, time.perf_counter())
            return add(invocation)

        monkeypatch.setattr(talker, "add", add_spy)

        async def one(seed: int) -> str:
            handle = engine.submit("qwen3-tts", {**REQUEST, "seed": seed})
            async for out in handle:
                if out.name == "audio":
                    first_audio.setdefault(handle.request_id, time.perf_counter())
            await handle.result()
            return handle.request_id

        ids = await asyncio.gather(*(one(seed) for seed in range(1, count + 1)))
    return talker_calls, admitted, first_audio, tuple(ids), talker.admit_streams


@pytest.mark.parametrize(("settings", "want"), [
    # more than one 2-s window ahead, three starting at once: see `mstar_qwen_tts.model`
    (None, StreamAdmission(min_lead_s=3.0, max_starting=3)),
    ({"talker": {"admit_streams": True}}, StreamAdmission()),
], ids=["model default", "set"])
async def test_a_stream_past_max_starting_reaches_the_talker_only_after_one_plays(monkeypatch, tiny_dir, settings,
                                                                                   want):
    """Served as `mstar serve` loads it (no settings), Qwen3-TTS admits streams: the default comes from the model.
    `max_starting` streams start at once; the next waits until one of them plays."""
    talker_calls, admitted, first_audio, ids, policy = await streams(monkeypatch, settings, want.max_starting + 1)
    assert policy == want
    early, last = ids[:-1], ids[-1]
    assert max(admitted[r] for r in early) < min(first_audio[r] for r in early) < admitted[last]
    leads = [lead for rid, lead, _ in talker_calls if rid == ids[0]]
    assert leads[0] is None and leads[-1] is not None  # no lead before the first window plays, then one
    first_lead = next(lead for lead in leads if lead is not None)
    assert 0.0 < first_lead <= 2.1  # one 25-frame window (2 s) made, a little of it played


async def test_the_configuration_turns_the_default_admission_off(monkeypatch, tiny_dir):
    _, admitted, first_audio, (a, b), policy = await streams(monkeypatch, {"talker": {"admit_streams": False}})
    assert policy is None
    assert admitted[b] < first_audio[a]  # both streams started at once


async def test_a_bad_admit_streams_setting_fails_the_load_naming_the_key(tiny_dir):
    async with AsyncEngine(discover()) as engine:
        with pytest.raises(ConfigError, match="admit_streams.min_lead'"):
            await engine.load_model("qwen3-tts", LoadOptions(preset="tiny"),
                                    settings={"talker": {"admit_streams": {"min_lead": 1}}})


async def test_a_node_placed_in_a_worker_process_refuses_admit_streams():
    """The calls' leads do not cross the wire yet: a worker refuses the setting instead of admitting blind."""
    from mstar_core.cluster.hosted_engines import HostedEngines
    from mstar_core.wire import LoadModel

    host = HostedEngines("w")
    try:
        with pytest.raises(ConfigError, match="node 'talker': setting 'admit_streams' is not supported"):
            await host.load(LoadModel(model="qwen3-tts", device="cpu", nodes=["talker"], preset="tiny",
                                      settings={"talker": {"admit_streams": True}}))
    finally:
        host.stop_device_thread()


async def test_a_talker_placed_in_a_worker_process_loads_without_the_model_default():
    """The model's default `admit_streams` is dropped on a worker (no leads there), not refused: placing the Talker
    elsewhere needs no setting turned off."""
    from mstar_core.cluster.hosted_engines import HostedEngines
    from mstar_core.wire import LoadModel

    host = HostedEngines("w")
    try:
        await host.load(LoadModel(model="qwen3-tts", device="cpu", nodes=["talker"], preset="tiny", settings={}))
        engine = host.schedulers["qwen3-tts/talker"].engine
        assert getattr(engine, "admit_streams", None) is None
    finally:
        host.stop_device_thread()


def test_the_default_holds_the_next_stream_until_the_first_is_a_window_and_a_second_ahead():
    """A lead counts the frames of the window not yet decoded (2 s here): just after its first window a stream is
    ~2 s ahead with nothing buffered beyond that window, so the next stream waits until it is 3 s ahead."""
    leads = StreamLeads(StreamAdmission.from_setting("talker", ADMIT_STREAMS))
    leads.observe("a", 2.0, 0.0)  # the first window landed
    leads.observe("a", 2.8, 1.0)  # 1.8 x real time over a second
    assert not leads.may_admit(["a"])  # fast enough, but under a second beyond its window
    leads.observe("a", 3.6, 2.0)
    assert leads.may_admit(["a"])
