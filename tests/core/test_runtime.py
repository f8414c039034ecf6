"""The in-process runtime: all four primitives plus streaming, at 1,000 concurrent requests."""

import asyncio
import random
import types

import pytest

from mstar_core.errors import NodeExecutionError, RequestCancelled, RequestError, RequestTimeout
from mstar_core.graph import (
    DynamicLoop,
    Graph,
    GraphNode,
    Loop,
    NodeCall,
    Parallel,
    Sequential,
    StreamingGraphEdge,
    Walk,
)
from mstar_core.model import LoadedModel
from mstar_core.plugins import discover, hookimpl
from mstar_core.runtime import AsyncEngine
from mstar_core.streaming import FixedChunkPolicy, LeftContextChunkPolicy, SlidingWindowChunkPolicy
from tests.core.helpers import Queued, fn_node


class TickEngine(Queued):
    """A stateful engine, like a KV cache: it keeps a per-request counter until released."""

    kind = "tick"

    def __init__(self, node, module, context):
        super().__init__(node, module, context)
        self.counters = {}
        self.max_seen_batch = 0

    def step(self):
        batch = self.take()
        self.max_seen_batch = max(self.max_seen_batch, len(batch))
        out = []
        for inv in batch:
            n = self.counters.get(inv.request_id, 0)
            self.counters[inv.request_id] = n + 1
            out.append((inv, {"token": inv.inputs["base"] + n, "count": n + 1}))
        return out

    def release(self, request_id):
        self.counters.pop(request_id, None)
        super().release(request_id)

    def active_requests(self):
        return set(self.counters) | super().active_requests()


test_plugin = types.SimpleNamespace(mstar_register_engines=hookimpl(lambda register: register("tick", TickEngine)))


def window_sum(chunk):
    return sum(chunk.new_items)


def boom(seed):
    if seed == 13:
        raise ValueError("unlucky input 13")
    return seed


POLICIES = {
    "fixed": FixedChunkPolicy(4),
    "sliding": SlidingWindowChunkPolicy(6, 2, tail="flush"),
    "left": LeftContextChunkPolicy(5, 3),
}


def make_model(name="toy"):
    nodes = [
        fn_node("double", "v", "out", lambda v: 2 * v),
        fn_node("square", "v", "out", lambda v: v * v),
        fn_node("add", ("d", "s"), "base", lambda d, s: d + s),
        fn_node("inc", "base", "base", lambda base: base + 1),
        fn_node("check", "seed", "checked", boom),
        GraphNode("tick", inputs="base", outputs=("token", "count"), engine="tick"),
        fn_node("window", "chunk", "wsum", window_sum),
    ]

    def body():
        return Sequential(
            NodeCall("check", outputs={"checked": "seed_ok"}),
            Parallel(
                NodeCall("double", inputs={"v": "seed"}, outputs={"out": "d"}),
                NodeCall("square", inputs={"v": "seed"}, outputs={"out": "s"}),
            ),
            "add",
            Loop(body="inc", iters=3, accumulate={"base": "bases"}),
            DynamicLoop(body="tick", until=lambda env: env["count"] >= env["n"], max_iters="limit"),
        )

    walks = [
        Walk(
            name=key,
            body=body(),
            inputs=("seed", "n", "limit"),
            outputs=("token", "wsum"),
            emit=("token", "wsum"),
            streams=(StreamingGraphEdge("tick.token", "window.chunk", policy),),
        )
        for key, policy in POLICIES.items()
    ]
    return LoadedModel(name, Graph.build(name, nodes, walks))


def expected_tokens(seed, n):
    base = 2 * seed + seed * seed + 3
    return [base + i for i in range(n)]


async def make_engine(**kw):
    engine = AsyncEngine(discover(extra_modules=[test_plugin]), **kw)
    await engine.add_model(make_model())
    return engine


def assert_no_state_left(engine):
    for node, eng in engine.node_engines("toy").items():
        assert eng.active_requests() == set(), node
    for sched in engine.node_schedulers("toy").values():
        assert not sched._pending and not sched._inflight
    assert engine.running == 0 and engine.waiting == 0 and not engine._handles


async def run_one(engine, seed, n, walk):
    handle = engine.submit("toy", {"seed": seed, "n": n, "limit": 1000, "walk": walk})
    tokens, wsums = [], []
    async for out in handle:
        (tokens if out.name == "token" else wsums).append(out.value)
    env = await handle.result()
    return tokens, wsums, env


async def test_thousand_concurrent_requests_with_random_cancellations():
    rng = random.Random(0)
    engine = await make_engine()
    jobs = []
    for _i in range(1000):
        seed = rng.choice([s for s in range(50) if s != 13])
        jobs.append((seed, rng.randint(1, 40), rng.choice(list(POLICIES)), rng.random() < 0.2))
    handles = [engine.submit("toy", {"seed": s, "n": n, "limit": 1000, "walk": w}) for s, n, w, _ in jobs]

    async def consume(handle, seed, n, walk, cancel):
        tokens, wsums = [], []
        if cancel:
            await asyncio.sleep(rng.random() * 0.05)
            if handle.done:  # finished before we got to cancel it
                assert (await handle.result())["token"] == expected_tokens(seed, n)[-1]
                return
            handle.cancel()
            with pytest.raises(RequestCancelled):
                await handle.result()
            cancelled.append(handle)
            return
        async for out in handle:
            (tokens if out.name == "token" else wsums).append(out.value)
        env = await handle.result()
        assert tokens == expected_tokens(seed, n)
        assert sum(wsums) == sum(tokens)  # every item reached the consumer once (tails flushed)
        assert env["wsum"] == wsums

    cancelled = []
    await asyncio.gather(*(consume(h, *job) for h, job in zip(handles, jobs, strict=True)))
    assert len(cancelled) > 50  # most cancellations hit requests mid-flight
    assert_no_state_left(engine)
    assert engine.node_engines("toy")["tick"].max_seen_batch > 1  # invocations were batched across requests
    await engine.close()


async def test_streaming_consumer_sees_policy_chunks():
    engine = await make_engine()
    tokens, wsums, _ = await run_one(engine, seed=2, n=7, walk="sliding")
    base = expected_tokens(2, 7)
    # window 6, stride 2, flush: fires at 6 (all new), then the tail item 7 with 5 items of context
    assert wsums == [sum(base[:6]), base[6]]
    tokens, wsums, _ = await run_one(engine, seed=2, n=7, walk="left")
    assert wsums == [sum(base[:5]), sum(base[5:])]
    await engine.close()


async def test_loop_accumulates_and_carries():
    engine = await make_engine()
    _, _, env = await run_one(engine, seed=1, n=1, walk="fixed")
    assert env["bases"] == [4, 5, 6] and env["base"] == 6  # 3 iterations of inc, accumulated
    await engine.close()


async def test_node_error_fails_only_its_request():
    engine = await make_engine()
    good = [engine.submit("toy", {"seed": s, "n": 5, "limit": 100, "walk": "fixed"}) for s in (1, 2, 3)]
    bad = engine.submit("toy", {"seed": 13, "n": 5, "limit": 100, "walk": "fixed"})
    with pytest.raises(NodeExecutionError, match="node 'check' failed .*unlucky input 13"):
        await bad.result()
    for s, h in zip((1, 2, 3), good, strict=True):
        assert (await h.result())["token"] == expected_tokens(s, 5)[-1]
    assert_no_state_left(engine)
    await engine.close()


async def test_timeout_frees_the_request():
    engine = await make_engine()
    handle = engine.submit("toy", {"seed": 1, "n": 10**6, "limit": 10**6, "walk": "fixed"}, timeout=0.05)
    with pytest.raises(RequestTimeout, match="timeout"):
        await handle.result()
    await asyncio.sleep(0.01)
    assert_no_state_left(engine)
    await engine.close()


async def test_bad_requests_are_rejected_at_submit():
    engine = await make_engine()
    with pytest.raises(RequestError, match="needs inputs \\['n', 'limit'\\]"):
        engine.submit("toy", {"seed": 1, "walk": "fixed"})
    with pytest.raises(RequestError, match="unknown walk 'nope'"):
        engine.submit("toy", {"seed": 1, "n": 1, "limit": 1, "walk": "nope"})
    with pytest.raises(RequestError, match="model 'other' is not loaded; loaded models: toy") as err:
        engine.submit("other", {})
    assert err.value.status == 404
    await engine.close()


async def test_queue_limit_answers_503():
    engine = await make_engine(max_running=1, max_queued=1)
    slow = engine.submit("toy", {"seed": 1, "n": 10**5, "limit": 10**5, "walk": "fixed"})
    engine.submit("toy", {"seed": 1, "n": 10**5, "limit": 10**5, "walk": "fixed"})
    await asyncio.sleep(0)
    with pytest.raises(RequestError) as err:
        engine.submit("toy", {"seed": 1, "n": 1, "limit": 1, "walk": "fixed"})
    assert err.value.status == 503
    slow.cancel()
    await engine.close()


async def test_several_models_in_one_engine():
    engine = await make_engine()
    await engine.add_model(make_model("toy2"))
    a = engine.submit("toy", {"seed": 1, "n": 3, "limit": 9, "walk": "fixed"})
    b = engine.submit("toy2", {"seed": 2, "n": 3, "limit": 9, "walk": "left"})
    assert (await a.result())["token"] == expected_tokens(1, 3)[-1]
    assert (await b.result())["token"] == expected_tokens(2, 3)[-1]
    assert set(engine.models) == {"toy", "toy2"}
    await engine.close()


def test_runs_under_uvloop_without_touching_the_global_policy():
    uvloop = pytest.importorskip("uvloop")
    policy_before = asyncio.get_event_loop_policy()

    async def main():
        assert "uvloop" in type(asyncio.get_running_loop()).__module__
        engine = await make_engine()
        tokens, _, _ = await run_one(engine, seed=3, n=9, walk="sliding")
        await engine.close()
        return tokens

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(main()) == expected_tokens(3, 9)
    assert asyncio.get_event_loop_policy() is policy_before


async def test_event_loop_stays_responsive_during_heavy_steps():
    import time

    def heavy(v):
        time.sleep(0.2)  # stands in for a forward pass on the device thread
        return v

    model = LoadedModel(
        "heavy",
        Graph.build("heavy", [fn_node("h", "v", "v", heavy)], [Walk(name="w", body="h", inputs="v", outputs="v")]),
    )
    engine = AsyncEngine(discover())
    await engine.add_model(model)
    handle = engine.submit("heavy", {"v": 1})
    started = time.perf_counter()
    await asyncio.sleep(0.01)
    assert time.perf_counter() - started < 0.1  # the loop was not blocked by the 200 ms step
    assert (await handle.result())["v"] == 1
    await engine.close()


async def test_a_node_with_its_own_thread_overlaps_the_shared_device_thread():
    import time

    def slow(v):
        time.sleep(0.2)  # stands in for a forward pass
        return v

    nodes = [fn_node("a", "v", "a", slow), fn_node("b", "v", "b", slow)]
    walk = Walk(name="w", body=Parallel("a", "b"), inputs="v", outputs=("a", "b"))
    model = LoadedModel("two", Graph.build("two", nodes, [walk]))

    async def wall(settings):
        engine = AsyncEngine(discover())
        await engine.add_model(model, settings=settings)
        started = time.perf_counter()
        assert (await engine.generate("two", {"v": 1}))["b"] == 1
        await engine.close()
        return time.perf_counter() - started

    assert await wall({}) >= 0.4  # one device thread: the two steps run one after the other
    assert await wall({"b": {"own_thread": True}}) < 0.35  # b's thread runs beside the shared one


async def test_a_request_arriving_mid_step_joins_the_batch_instead_of_splitting_it():
    """AR steps answered together come back together: a late arrival must not leave two groups taking turns."""
    import time

    class Step:
        def forward_batch(self, batch):
            time.sleep(0.005)  # a forward pass: the late request arrives while one runs
            return [{"i": b["i"] + 1} for b in batch]

        def __call__(self, i):
            return self.forward_batch([{"i": i}])[0]

    node = GraphNode("ar", inputs="i", outputs="i", engine="function", module=Step)
    walk = Walk(name="w", body=DynamicLoop(body="ar", until=lambda env: env["i"] >= env["n"], max_iters=1000),
                inputs=("i", "n"), outputs="i")
    engine = AsyncEngine(discover())
    await engine.add_model(LoadedModel("ar", Graph.build("ar", [node], [walk])))
    sched = engine.node_schedulers("ar")["ar"]
    early = [engine.submit("ar", {"i": 0, "n": 40}) for _ in range(8)]
    while sched.steps < 10:
        await asyncio.sleep(0.001)
    late = engine.submit("ar", {"i": 0, "n": 10})
    results = await asyncio.gather(*(h.result() for h in [*early, late]))
    assert [r["i"] for r in results] == [40] * 8 + [10]
    # 40 steps for the early ones; the late one rides along (at most a step or two on its own)
    assert sched.steps <= 43, sched.steps
    await engine.close()
