"""Optional inputs are walk-scoped (issue 26): taken from the call's mapping or the walk's own names, never
from what an earlier walk left in the env; one the walk never has is left out; a mapped typo is an error."""

from __future__ import annotations

import pytest

from mstar_core.errors import GraphValidationError
from mstar_core.graph import DynamicLoop, Graph, GraphNode, Loop, NodeCall, Sequential, Walk
from mstar_core.model import LoadedModel
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from tests.core.helpers import fn_node


class Seen:
    """A node module recording which optional inputs each call received (and their values)."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, input_ids, input_embeds=None, sampling=None):
        self.calls.append({k: v for k, v in (("input_embeds", input_embeds), ("sampling", sampling)) if v is not None})
        return {"next_token": input_ids + 1, "finish_reason": None}


def _lm(seen: Seen) -> GraphNode:
    return GraphNode("lm", inputs="input_ids", optional_inputs=("input_embeds", "sampling"),
                     outputs=("next_token", "finish_reason"), engine="function", module=lambda: seen)


def _prefill_decode(seen: Seen, decode_call: NodeCall, **decode_kw) -> Graph:
    """The previous release's pattern: the prefill maps `input_embeds`, the decode walk leaves it out."""
    embed = fn_node("embed", "prompt_ids", "prompt_embeds", lambda prompt_ids: [prompt_ids] * 2)
    prefill = Walk(name="prefill", body=Sequential(
        "embed", NodeCall("lm", inputs={"input_ids": "prompt_ids", "input_embeds": "prompt_embeds"})),
        inputs=("prompt_ids",), optional_inputs=("sampling",), outputs=("next_token",))
    decode = Walk(name="decode", body=Loop(body=decode_call, iters=2), inputs=("next_token",),
                  outputs=("next_token",), **decode_kw)
    return Graph.build("m", [embed, _lm(seen)], [prefill, decode], plan=lambda env: ["prefill", "decode"])


async def _run(graph: Graph, inputs: dict) -> dict:
    engine = AsyncEngine(discover())
    await engine.add_model(LoadedModel("m", graph))
    try:
        return await engine.generate("m", inputs)
    finally:
        await engine.close()


async def test_an_optional_input_one_walk_maps_and_another_leaves_out_builds_and_stays_in_its_walk():
    seen = Seen()
    graph = _prefill_decode(seen, NodeCall("lm", inputs={"input_ids": "next_token"}), optional_inputs=("sampling",))
    env = await _run(graph, {"prompt_ids": 5, "sampling": "greedy"})
    assert env["next_token"] == 8
    prefill, *decode = seen.calls
    assert prefill == {"input_embeds": [5, 5], "sampling": "greedy"}
    # the prefill's embeddings stay in the env (another walk's value), yet no decode call gets them
    assert env["prompt_embeds"] == [5, 5]
    assert decode == [{"sampling": "greedy"}] * 2


async def test_a_request_value_the_walk_does_not_declare_is_not_an_optional_input():
    seen = Seen()  # the decode walk does not declare `sampling`: the request's value is not its input
    graph = _prefill_decode(seen, NodeCall("lm", inputs={"input_ids": "next_token"}))
    await _run(graph, {"prompt_ids": 1, "sampling": "greedy"})
    assert seen.calls[1:] == [{}, {}]


async def test_a_declared_optional_input_is_taken_when_supplied_and_left_out_when_not():
    seen = Seen()
    walk = Walk(name="w", body="lm", inputs="input_ids", optional_inputs=("input_embeds", "sampling"))
    graph = Graph.build("m", [_lm(seen)], [walk])
    await _run(graph, {"input_ids": 1, "sampling": "s"})
    await _run(graph, {"input_ids": 1, "input_embeds": "e"})
    assert seen.calls == [{"sampling": "s"}, {"input_embeds": "e"}]


async def test_an_optional_input_mapped_to_none_is_left_out_even_where_the_walk_has_it():
    seen = Seen()
    walk = Walk(name="w", body=NodeCall("lm", inputs={"sampling": None}), inputs=("input_ids", "sampling"))
    await _run(Graph.build("m", [_lm(seen)], [walk]), {"input_ids": 1, "sampling": "s"})
    assert seen.calls == [{}]


def test_a_required_input_mapped_to_none_is_a_build_error():
    walk = Walk(name="w", body=NodeCall("lm", inputs={"input_ids": None}), inputs="input_ids")
    with pytest.raises(GraphValidationError, match="required input 'input_ids' to None"):
        Graph.build("m", [_lm(Seen())], [walk])


def test_an_optional_input_mapped_to_a_name_the_walk_never_has_is_a_build_error():
    # the typo case: 'step_embed' is neither declared nor produced, so the mapping would be dropped silently
    call = NodeCall("lm", inputs={"input_ids": "next_token", "input_embeds": "step_embed"})
    with pytest.raises(GraphValidationError) as err:
        _prefill_decode(Seen(), call)
    message = str(err.value)
    assert "'decode'" in message and "'lm'" in message and "'step_embed'" in message and "None" in message


async def test_a_name_a_loop_body_writes_is_not_read_from_an_earlier_walk_on_the_first_iteration():
    # `state` is fed back by `update` on later iterations; the earlier walk's `state` must not reach iteration 0
    got = []

    def step(x, state=None):
        got.append(state)
        return {"y": x, "done": len(got) == 3}

    nodes = [fn_node("seed", "x", "state", lambda x: "from-first-walk"),
             fn_node("step", "x", ("y", "done"), step, optional_inputs="state"),
             fn_node("update", "y", "state", lambda y: f"from-iteration-{len(got)}")]
    first = Walk(name="first", body="seed", inputs="x", outputs="state")
    loop = DynamicLoop(body=Sequential("step", "update"), until=lambda env: env["done"], max_iters=5)
    second = Walk(name="second", body=loop, inputs="x", outputs="state")
    graph = Graph.build("m", nodes, [first, second], plan=lambda env: ["first", "second"])
    env = await _run(graph, {"x": 0})
    assert got == [None, "from-iteration-1", "from-iteration-2"]
    assert env["state"] == "from-iteration-3"


async def test_a_hidden_value_the_walk_never_rewrites_is_back_in_the_env_after_it():
    # a loop that runs no iteration writes nothing: the earlier walk's value survives the walk untouched
    nodes = [fn_node("seed", "x", "state", lambda x: "kept"),
             fn_node("step", "x", "state", lambda x, state=None: "new", optional_inputs="state")]
    first = Walk(name="first", body="seed", inputs="x")
    second = Walk(name="second", body=Loop(body="step", iters="n"), inputs=("x", "n"))
    graph = Graph.build("m", nodes, [first, second], plan=lambda env: ["first", "second"])
    assert (await _run(graph, {"x": 0, "n": 0}))["state"] == "kept"
