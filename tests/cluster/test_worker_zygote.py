"""Spawned workers are forks of one zygote (torch and plugins imported once); its exits reach supervision."""

import asyncio
import os
import signal
from pathlib import Path

import pytest

from mstar_core.cluster.launchers import forked
from mstar_core.cluster.launchers.forked import ForkedProcess
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.wire.auth import SECRET_ENV
from tests.cluster.helpers import until

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "placement" / "llama-prefill-decode.yaml"
REQUEST = {"input_ids": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True}


async def _tokens(engine):
    return [out.value async for out in engine.submit("llama", dict(REQUEST)) if out.name == "next_token"]


async def _placed():
    engine = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(preset="tiny"), placement=load_placement(EXAMPLE))
    return engine


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def test_workers_are_forks_of_one_zygote_and_a_killed_one_is_replaced(monkeypatch):
    if forked._zygote is not None and forked._zygote.key != forked._key(dict(os.environ)):
        monkeypatch.setattr(forked, "_zygote", None)  # an earlier test changed the environment for good
    engine = placed_engine(discover())
    await engine.load_model("llama", LoadOptions(preset="tiny"))
    try:
        want = await _tokens(engine)
    finally:
        await engine.close()
    engine = await _placed()
    try:
        processes = {name: w.process for name, w in engine.cluster.workers.items()}
        zygote = forked._zygote
        assert all(isinstance(p, ForkedProcess) for p in processes.values())
        assert {_ppid(p.pid) for p in processes.values()} == {zygote.process.pid}
        assert await _tokens(engine) == want
        processes["decode"].kill()
        assert await asyncio.to_thread(processes["decode"].wait, 10) == -signal.SIGKILL  # reported by the zygote
        await until(lambda: engine.cluster.workers["decode"].ready and engine.cluster.workers["decode"].process
                    is not processes["decode"], 30, "the killed worker's replacement")
        assert isinstance(engine.cluster.workers["decode"].process, ForkedProcess)
        assert await _tokens(engine) == want
    finally:
        await engine.close()
    second = await _placed()  # a later engine in this process forks from the same zygote
    try:
        assert forked._zygote is zygote and not zygote.gone
        assert all(_ppid(w.process.pid) == zygote.process.pid for w in second.cluster.workers.values())
        assert await _tokens(second) == want
    finally:
        await second.close()
    monkeypatch.setenv("MSTAR_TEST_ZYGOTE_KEY", "changed")  # what the zygote imported under may differ now: no fork
    assert forked.fork_worker(["--help"], dict(os.environ), {}, os.devnull) is None
    monkeypatch.delenv("MSTAR_TEST_ZYGOTE_KEY")
    monkeypatch.setenv(forked.ZYGOTE_ENV, "0")
    assert forked.fork_worker(["--help"], dict(os.environ), {}, os.devnull) is None


def _gone(pid: int) -> bool:
    try:
        return _state(pid) in "ZX"  # a zombie waits for whoever adopted it; it runs nothing
    except FileNotFoundError:
        return True


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def test_workers_of_a_zygote_that_dies_are_reported_ended():
    zygote = forked.Zygote(("test",))
    try:
        assert await asyncio.to_thread(zygote.ready.wait, 120)
        env = {**os.environ, SECRET_ENV: "s" * 32, "MSTAR_JOIN_TIMEOUT": "60"}  # waits for a server that never answers
        child = await asyncio.to_thread(zygote.fork, ["--join", "ipc:///nonexistent/mstar", "--name", "w"], env,
                                        os.devnull)
        assert child is not None and child.poll() is None and _ppid(child.pid) == zygote.process.pid
        zygote.process.kill()
        assert await asyncio.to_thread(child.wait, 10) == -signal.SIGKILL
        await until(lambda: _gone(child.pid), 10, "the orphaned worker to end")
    finally:
        zygote.process.kill()
        zygote.process.wait()


def test_a_zygote_that_cannot_start_gives_plain_spawns_and_is_not_retried(monkeypatch):
    monkeypatch.setattr(forked, "_zygote", None)
    monkeypatch.setattr(forked.sys, "executable", "/bin/false")  # exits at once, never ready
    env = dict(os.environ)
    assert forked.fork_worker(["--help"], env, {}, os.devnull) is None
    first = forked._zygote
    assert first.gone and not first.worked
    assert forked.fork_worker(["--help"], env, {}, os.devnull) is None and forked._zygote is first
