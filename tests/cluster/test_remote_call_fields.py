"""A call crossing to a worker keeps its request's arrival (age priority there) and its error's `param`.

Timing-free: the worker's `gen` admits one request at a time (`max_active_requests: 1`), so which of
two waiting requests it admits when the holder is released shows which one it took for the older.
"""

import asyncio

import pytest
import pytest_asyncio

from mstar_core.cluster.remote_values import TYPE_KEY, to_wire
from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement
from mstar_core.errors import RequestError
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover
from mstar_core.runtime.engine import Invocation
from mstar_core.wire import RunLoop

# one worker for the module (each test releases what it holds): a worker start is most of the cost
pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="module")]
MODEL = "fixture-stream"
BAD_SAMPLING = {TYPE_KEY: "sampling", "fields": {"temperature": -1.0}}  # refused where it is rebuilt: the worker


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    placement = {"workers": {"gen": {}}, "nodes": {"gen": "gen"},
                 "engine_settings": {"gen": {"max_active_requests": 1}}}
    engine = placed_engine(discover())
    await engine.load_model(MODEL, LoadOptions(preset="tiny"), placement=Placement.from_dict(placement))
    try:
        yield engine
    finally:
        await engine.close()


def call(rid: str, arrival: float, **inputs) -> Invocation:
    return Invocation(rid, "gen", {"start": 0, **inputs}, {}, 0, 0.0, arrival)


def loop(rid: str, arrival: float, **env) -> RunLoop:
    return RunLoop(request_id=rid, model=MODEL, walk="count", loop=0, env=to_wire({"start": 0, "stop": 2, **env}),
                   arrival=arrival)


async def first_done(*futures) -> set:
    done, _ = await asyncio.wait(futures, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    assert done, "neither call finished"
    return done


async def test_a_worker_admits_the_request_that_arrived_first_not_the_one_sent_first(engine):
    cluster = engine.cluster
    assert (await asyncio.wait_for(cluster.invoke("gen", MODEL, call("hold", 1.0)), 60))["token"] == 0
    # sent younger first: with arrivals lost on the way, ties go by submission order and "young" would win
    young = cluster.invoke("gen", MODEL, call("young", 30.0))
    old = cluster.invoke("gen", MODEL, call("old", 20.0))
    cluster.release("gen", "hold")
    assert await first_done(young, old) == {old}
    assert not young.done()  # "old" keeps the one place until it is released
    cluster.release("gen", "old")
    assert (await asyncio.wait_for(young, 60))["token"] == 0
    cluster.release("gen", "young")


async def test_a_delegated_loop_queues_its_calls_by_the_request_arrival_it_was_sent(engine):
    cluster = engine.cluster
    await asyncio.wait_for(cluster.invoke("gen", MODEL, call("hold", 1.0)), 60)
    ignore = lambda _call, _outputs: None  # noqa: E731
    # the worker would otherwise date each loop by when it got there: "young" (sent first) would be older
    young = asyncio.ensure_future(cluster.run_loop("gen", loop("young", 30.0), ignore))
    old = asyncio.ensure_future(cluster.run_loop("gen", loop("old", 20.0), ignore))
    await asyncio.sleep(0)  # both tasks have sent their RunLoop (sends go out in order) before the release
    cluster.release("gen", "hold")
    assert await first_done(young, old) == {old}
    assert old.result()[0]["token"] == 2
    cluster.release("gen", "old")
    assert (await asyncio.wait_for(young, 60))[0]["token"] == 2
    cluster.release("gen", "young")


async def test_a_request_error_raised_in_a_worker_keeps_its_status_and_names_its_field(engine):
    cluster = engine.cluster
    with pytest.raises(RequestError, match="temperature") as call_err:
        await asyncio.wait_for(cluster.invoke("gen", MODEL, call("r1", 1.0, sampling=BAD_SAMPLING)), 60)
    with pytest.raises(RequestError, match="temperature") as loop_err:
        await asyncio.wait_for(cluster.run_loop("gen", loop("r2", 1.0, sampling=BAD_SAMPLING), None), 60)
    for err in (call_err.value, loop_err.value):
        assert (err.status, err.param) == (400, "temperature")
    # and the worker still serves
    assert (await asyncio.wait_for(cluster.invoke("gen", MODEL, call("r3", 1.0)), 60))["token"] == 0


async def test_a_worker_admits_a_live_request_before_an_older_background_one(engine):
    """A Batch API line's class crosses to the worker on calls and delegated loops: there too a live request is
    admitted first though it arrived later (`max_active_requests` admits live before background)."""
    from mstar_core.runtime.engine import BACKGROUND_PRIORITY

    cluster = engine.cluster
    cluster.release("gen", "r3")  # (the error test's last call keeps the worker's one place)
    await asyncio.wait_for(cluster.invoke("gen", MODEL, call("hold", 1.0)), 60)
    background = cluster.invoke("gen", MODEL, Invocation("bg", "gen", {"start": 0}, {}, 0, BACKGROUND_PRIORITY, 10.0))
    live = cluster.invoke("gen", MODEL, call("live", 30.0))
    cluster.release("gen", "hold")
    assert await first_done(background, live) == {live}
    cluster.release("gen", "live")
    await asyncio.wait_for(background, 60)
    cluster.release("gen", "bg")

    await asyncio.wait_for(cluster.invoke("gen", MODEL, call("hold2", 1.0)), 60)
    ignore = lambda _call, _outputs: None  # noqa: E731
    bg_loop = RunLoop(request_id="bgl", model=MODEL, walk="count", loop=0, env=to_wire({"start": 0, "stop": 2}),
                      arrival=10.0, priority=BACKGROUND_PRIORITY)
    background = asyncio.ensure_future(cluster.run_loop("gen", bg_loop, ignore))
    live = asyncio.ensure_future(cluster.run_loop("gen", loop("livel", 30.0), ignore))
    await asyncio.sleep(0)
    cluster.release("gen", "hold2")
    assert await first_done(background, live) == {live}
    cluster.release("gen", "livel")
    await asyncio.wait_for(background, 60)
    cluster.release("gen", "bgl")
