"""Walk runtime v2: joins inside loops, shared call sites, branching plans, options from the env, fan-out."""


import pytest

from mstar_core.errors import GraphValidationError, RequestError
from mstar_core.graph import Branch, FromEnv, Graph, GraphNode, Loop, NodeCall, Parallel, Walk
from mstar_core.model import LoadedModel
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from mstar_core.runtime.conductor import Conductor
from tests.core.helpers import Queued, fn_node


async def serve(model, **kw):
    engine = AsyncEngine(discover())
    await engine.add_model(model, **kw)
    return engine


async def test_a_parallel_inside_a_loop_joins_only_what_each_branch_changed():
    # branch "bump" rewrites x each iteration; branch "look" only reads it. From the second iteration on
    # the join used to let "look"'s stale copy of x overwrite the new one.
    nodes = [fn_node("bump", "x", "x", lambda x: x + 1), fn_node("look", "x", "seen", lambda x: x)]
    walk = Walk(name="w", body=Loop(body=Parallel("bump", "look"), iters=5, accumulate={"seen": "seens"}),
                inputs="x", outputs=("x", "seens"))
    engine = await serve(LoadedModel("p", Graph.build("p", nodes, [walk])))
    env = await engine.generate("p", {"x": 0})
    assert env["x"] == 5
    assert env["seens"] == [0, 1, 2, 3, 4]
    await engine.close()


class OptionEcho(Queued):
    """An engine answering each call with its cache_label option (the test reads what the runtime passed)."""

    kind = "optecho"

    def step(self):
        return [(inv, {"label": inv.options.get("cache_label"), "echo": inv.inputs.get("x")}) for inv in self.take()]


def _registry():
    import types

    from mstar_core.plugins import hookimpl

    plugin = types.SimpleNamespace(
        mstar_register_engines=hookimpl(lambda register: register("optecho", OptionEcho)))
    return discover(extra_modules=[plugin])


async def test_call_options_from_the_env_follow_the_loop_index():
    node = GraphNode("o", inputs="x", outputs=("label", "echo"), engine="optecho")
    call = NodeCall("o", options={"cache_label": FromEnv("loop_index", "step{}"), "fork_from": "main"})
    walk = Walk(name="w", body=Loop(body=call, iters=3, accumulate={"label": "labels"}), inputs="x",
                outputs="labels")
    engine = AsyncEngine(_registry())
    await engine.add_model(LoadedModel("o", Graph.build("o", [node], [walk])))
    assert (await engine.generate("o", {"x": 1}))["labels"] == ["step0", "step1", "step2"]
    await engine.close()


def test_an_option_from_a_name_not_available_is_a_build_error():
    node = GraphNode("o", inputs="x", outputs=("label", "echo"), engine="optecho")
    walk = Walk(name="w", body=NodeCall("o", options={"cache_label": FromEnv("loop_index")}), inputs="x")
    with pytest.raises(GraphValidationError, match="call option 'cache_label' reads env name 'loop_index'"):
        Graph.build("o", [node], [walk])


async def test_fan_out_runs_n_branches_each_with_its_index_and_label():
    node = GraphNode("o", inputs="x", outputs=("label", "echo"), engine="optecho")
    choice = NodeCall("o", options={"cache_label": FromEnv("choice", "choice{}"), "fork_from": "main"})
    walk = Walk(name="w", body=Parallel(choice, count="n", index_name="choice", collect={"label": "labels"}),
                inputs=("x", "n"), outputs="labels")
    engine = AsyncEngine(_registry())
    await engine.add_model(LoadedModel("o", Graph.build("o", [node], [walk])))
    assert (await engine.generate("o", {"x": 1, "n": 4}))["labels"] == [f"choice{i}" for i in range(4)]
    assert (await engine.generate("o", {"x": 1, "n": 0}))["labels"] == []
    # without `collect`, every name the body writes comes back as a list
    plain = Walk(name="w", body=Parallel("double", count=3, index_name="i"), inputs="v", outputs="out")
    engine2 = await serve(LoadedModel("d", Graph.build("d", [fn_node("double", "v", "out", lambda v: 2 * v)],
                                                       [plain])))
    assert (await engine2.generate("d", {"v": 5}))["out"] == [10, 10, 10]
    await engine.close()
    await engine2.close()


def test_fan_out_is_validated():
    double = fn_node("double", "v", "out", lambda v: 2 * v)
    with pytest.raises(GraphValidationError, match="Parallel count names 'n'"):
        Graph.build("d", [double], [Walk(name="w", body=Parallel("double", count="n"), inputs="v")])
    with pytest.raises(GraphValidationError, match="collect names 'nope'"):
        Graph.build("d", [double], [Walk(name="w", body=Parallel("double", count=2, collect="nope"), inputs="v")])
    with pytest.raises(ValueError, match="exactly one body"):
        Parallel("double", "double", count=2)


def _think_graph(choose, declared=("image", "caption")):
    nodes = [fn_node("decode", "prompt", "text", lambda prompt: prompt.upper()),
             fn_node("draw", "text", "image", lambda text: f"<image of {text}>"),
             fn_node("say", "text", "caption", lambda text: f"caption: {text}")]
    walks = [Walk(name="think", body="decode", inputs="prompt", outputs="text"),
             Walk(name="image", body="draw", inputs="text", outputs="image"),
             Walk(name="caption", body="say", inputs="text", outputs="caption")]
    return Graph.build("think", nodes, walks, plan=lambda env: ["think"],
                       branches=[Branch(after="think", choose=choose, walks=declared)])


async def test_the_plan_branches_on_a_value_an_earlier_walk_produced():
    def choose(env):  # BAGEL's think mode: an image only if the decoded text asks for one
        return ["image", "caption"] if "DRAW" in env["text"] else None

    engine = await serve(LoadedModel("think", _think_graph(choose)))
    drawn = await engine.generate("think", {"prompt": "please draw a cat"})
    assert drawn["image"] == "<image of PLEASE DRAW A CAT>" and drawn["caption"].startswith("caption:")
    told = await engine.generate("think", {"prompt": "tell me a joke"})
    assert "image" not in told and "caption" not in told and told["text"] == "TELL ME A JOKE"
    await engine.close()


async def test_a_branch_to_an_undeclared_walk_fails_clearly():
    with pytest.raises(GraphValidationError, match="may choose unknown walk 'paint'"):
        _think_graph(lambda env: "paint", declared=("paint",))
    with pytest.raises(GraphValidationError, match="branch after unknown walk 'nope'"):
        Graph.build("g", [fn_node("a", "x", "y", abs)], [Walk(name="w", body="a", inputs="x")],
                    branches=[Branch(after="nope", choose=lambda env: None, walks=())])
    with pytest.raises(GraphValidationError, match="form a cycle: w -> w"):
        Graph.build("g", [fn_node("a", "x", "y", abs)], [Walk(name="w", body="a", inputs="x")],
                    branches=[Branch(after="w", choose=lambda env: None, walks=("w",))])
    # declared "image" but chose "caption": a request error naming what the branch may choose
    engine = await serve(LoadedModel("think", _think_graph(lambda env: "caption", declared=("image",))))
    with pytest.raises(RequestError, match="chose walk 'caption', which it does not declare; it may choose"):
        await engine.generate("think", {"prompt": "x"})
    await engine.close()


class RecordingScheduler:
    """Stands in for a node's scheduler: answers at once and records who was asked."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def submit(self, inv):
        import asyncio

        self.log.append((self.name, inv.node))
        future = asyncio.get_running_loop().create_future()
        future.set_result({"y": inv.inputs["x"]})
        return future

    def release(self, request_id):
        pass


async def test_a_call_shared_by_two_walks_is_routed_per_walk():
    # one NodeCall object in two walks, the node placed per walk: with tables keyed by id(call),
    # the last walk compiled won and both walks' calls went to its worker
    shared = NodeCall("lm")
    node = GraphNode("lm", inputs="x", outputs="y", engine="function", module=lambda: abs)
    graph = Graph.build("s", [node], [Walk(name="prefill", body=shared, inputs="x"),
                                      Walk(name="decode", body=Loop(body=shared, iters=2), inputs="x")])
    log = []
    conductor = Conductor(graph, {"lm": RecordingScheduler("default", log)},
                          {("prefill", "lm"): RecordingScheduler("A", log),
                           ("decode", "lm"): RecordingScheduler("B", log)})
    await conductor.run("r1", {"x": 1, "walk": "prefill"}, lambda out: None)
    await conductor.run("r2", {"x": 1, "walk": "decode"}, lambda out: None)
    assert [who for who, _ in log] == ["A", "B", "B"]
