"""`transport: nccl` in placement: a worker's big tensor frames over a torch.distributed group (gloo on CPU).

Control stays on the sealed ZeroMQ socket; the tensors go over the group, and the link's byte
counters show it. The same tests run on NCCL where two CUDA devices are available.
"""

import asyncio
import time
from pathlib import Path

import pytest
import torch
import yaml

from mstar_core.cluster.cluster import WorkerLost
from mstar_core.cluster.links import check_transports
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover

pytest.importorskip("mstar_transport_nccl")
pytestmark = pytest.mark.timeout(180)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placement"
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def example(name: str, **transports) -> Placement:
    data = yaml.safe_load((EXAMPLES / name).read_text())
    for worker, transport in transports.items():
        data["workers"][worker]["transport"] = transport
    return Placement.from_dict(data, name)


async def test_a_workers_tensors_go_over_the_group_and_small_frames_stay_on_the_socket():
    placement = Placement.from_dict({"workers": {"w": {"transport": "nccl"}}, "nodes": {"bump": "w"},
                                     "control": {"heartbeat_interval": 0.2}})
    engine = placed_engine(discover())
    await engine.load_model("fixture-blob", LoadOptions(), placement=placement)
    try:
        state = engine.cluster.workers["w"]
        link = state.link
        assert link.name == "nccl" and link.backend == "gloo" and not link.keep_device
        x = torch.randn(256, 1024)  # 1 MiB each way
        for _ in range(3):
            y = (await engine.submit("fixture-blob", {"x": x}).result())["y"]
            assert torch.equal(y, x + 1)
        assert link.sent_frames == 3 and link.received_frames == 3
        assert link.stats.offloaded_bytes == 3 * x.numel() * 4
        small = torch.arange(4.0)
        assert torch.equal((await engine.submit("fixture-blob", {"x": small}).result())["y"], small + 1)
        assert link.sent_frames == 3 and link.received_frames == 3  # below the threshold: inline
        deadline = time.monotonic() + 10
        while state.load.get("link", {}).get("offloaded_bytes", 0) < 3 * x.numel() * 4:  # the worker's end
            assert time.monotonic() < deadline, state.load
            await asyncio.sleep(0.05)
        assert state.load["link"]["transport"] == "nccl"
        # many messages in flight at once arrive whole and in order, each to its own request
        xs = [torch.full((64, 1024), float(i)) for i in range(12)]
        outs = await asyncio.gather(*(engine.submit("fixture-blob", {"x": v}).result() for v in xs))
        assert all(torch.equal(o["y"], v + 1) for o, v in zip(outs, xs, strict=True))
    finally:
        await engine.close()


async def synthesize(placement):
    pytest.importorskip("mstar_orpheus")
    engine = placed_engine(discover())
    await engine.load_model("orpheus", LoadOptions(preset="tiny"), placement=placement)
    try:
        request = {"text": "Hello from M star.", "voice": "tara", "seed": 7, "max_tokens": 120}
        chunks = [torch.as_tensor(o.value).clone() async for o in engine.submit("orpheus", request) if o.name == "audio"]
        links = {n: (getattr(s.link, "backend", None), getattr(s.link, "received_frames", 0)) for n, s in engine.cluster.workers.items()} \
            if engine.cluster else {}
        return chunks, links
    finally:
        await engine.close()


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    not TWO_GPUS, reason="NCCL needs two CUDA devices (one rank per GPU)"))])
async def test_disaggregated_orpheus_with_an_nccl_codec_link_gives_the_colocated_audio(backend):
    colocated, _ = await synthesize(None)
    if backend == "nccl":
        placement = example("orpheus-disaggregated.yaml", codec="nccl")
        placement = Placement.from_dict({
            "workers": {"lm": {"device": "cuda:1"},
                        "codec": {"device": "cuda:1", "transport": {"name": "nccl", "threshold": 16}}},
            "nodes": {"lm": "lm", "snac": "codec"}, "engine_settings": dict(placement.engine_settings)})
    else:
        # the tiny preset's audio windows are 64 bytes: a low threshold sends every tensor frame over the group
        placement = example("orpheus-disaggregated.yaml", codec={"name": "nccl", "threshold": 16})
    split, links = await synthesize(placement)
    assert links["codec"][0] == backend and links["codec"][1] > 0  # the audio windows came back over the group
    assert len(colocated) > 0 and len(split) == len(colocated)
    for a, b in zip(colocated, split, strict=True):
        assert torch.equal(a.cpu(), b.cpu())


async def test_prefill_and_decode_workers_with_nccl_links_give_the_colocated_tokens():
    from tests.cluster.test_per_walk_placement import REQUESTS, generate

    colocated, _, _ = await generate()
    engine = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(preset="tiny"),
                            placement=example("llama-prefill-decode.yaml", prefill={"name": "nccl", "threshold": 256},
                                              decode={"name": "nccl", "threshold": 256}))
    try:
        split = []
        for request in REQUESTS:
            split.append([o.value async for o in engine.submit("llama", dict(request)) if o.name == "next_token"])
        prefill, decode = engine.cluster.workers["prefill"], engine.cluster.workers["decode"]
        assert prefill.link.backend == decode.link.backend == "gloo"
        # the KV pages went straight from worker to worker (tests/cluster/test_direct_kv_move.py), not through here
        deadline = time.monotonic() + 10
        while decode.load.get("peer", {}).get("received_moves", 0) < len(REQUESTS):
            assert time.monotonic() < deadline, decode.load
            await asyncio.sleep(0.05)
    finally:
        await engine.close()
    assert split == colocated


async def test_killing_an_nccl_worker_fails_its_requests_quickly_and_the_replacement_serves():
    placement = Placement.from_dict({"workers": {"gen": {"transport": "nccl"}}, "nodes": {"gen": "gen"},
                                     "engine_settings": {"gen": {"step_delay": 0.01}},
                                     "control": {"heartbeat_interval": 0.2}})
    engine = placed_engine(discover())
    await engine.load_model("fixture-stream", LoadOptions(preset="tiny"), placement=placement)
    gen = engine.cluster.workers["gen"]
    try:
        handle = engine.submit("fixture-stream", {"start": 0, "stop": 10**6})
        async for out in handle:
            if out.name == "token":
                break
        old = gen.process
        engine.cluster.kill("gen")
        killed_at = time.monotonic()
        with pytest.raises(WorkerLost, match="gen"):
            await asyncio.wait_for(handle.result(), 15)
        assert time.monotonic() - killed_at < 1.5
        deadline = time.monotonic() + 60
        while not (gen.ready and gen.process is not old):
            assert time.monotonic() < deadline, "the replacement worker did not come back"
            await asyncio.sleep(0.05)
        out = await asyncio.wait_for(engine.generate("fixture-stream", {"start": 2, "stop": 9}), 30)
        assert out["token"] == 9
        assert gen.link.backend == "gloo" and gen.link._session is not None  # a fresh group for the new process
    finally:
        await engine.close()


def test_placement_checks_nccl_options_and_refuses_a_remote_rendezvous_unless_allowed():
    registry = discover()

    def check(transport, bind=None):
        check_transports(Placement.from_dict({"workers": {"w": {"transport": transport}},
                                              "control": {"bind": bind} if bind else None}, "p.yaml"), registry)

    check("nccl")
    check({"name": "nccl", "backend": "gloo", "threshold": 4096})
    with pytest.raises(ConfigError, match=r"workers.w.transport: .*no authentication.*allow_remote: true"):
        check("nccl", bind="tcp://10.0.0.2:7100")
    check({"name": "nccl", "allow_remote": True}, bind="tcp://10.0.0.2:7100")
    with pytest.raises(ConfigError, match=r"takes no option 'bogus'; its options: allow_remote, backend"):
        check({"name": "nccl", "bogus": 1})
    with pytest.raises(ConfigError, match="backend must be 'nccl' or 'gloo'"):
        check({"name": "nccl", "backend": "mpi"})
    with pytest.raises(ConfigError, match="transport 'zmq' takes no option 'threshold'"):
        check({"name": "zmq", "threshold": 1})
    with pytest.raises(ConfigError, match="transport 'shm' takes no option"):
        check({"name": "shm", "threshold": 1})


def test_the_server_end_refuses_a_non_loopback_rendezvous_and_says_why():
    from mstar_transport_nccl.link import DistLink

    from mstar_core.wire.errors import TransportError

    link = DistLink("server")
    with pytest.raises(TransportError, match="no authentication or encryption"):
        link.peer_joined({"control": "tcp://10.0.0.2:7100", "device": "cpu"})
    link.close()
