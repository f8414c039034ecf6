"""Producer loops inside Parallel branches, each streaming into a consumer (a CFG-like miniature, for stream tests).

Walk `cfg`: a static Parallel of a `cond` and an `uncond` loop (two branches, as classifier-free
guidance runs them), each streaming its items through its own edge into per-chunk `decode` calls.
Walk `fan`: `n` fan-out copies of one `gen` loop, all feeding one stream into `decode`.
Every item is a function of (seed, branch, step), so a test can account for each one.
"""

import torch

from mstar_core.graph import Graph, GraphNode, Loop, NodeCall, Parallel, StreamingGraphEdge, Walk
from mstar_core.model import LoadedModel, ModelSpec
from mstar_core.streaming import FixedChunkPolicy, LeftContextChunkPolicy

#: the `branch` of a `cfg` item; a `fan` copy i makes branch FAN_BRANCH + i
COND, UNCOND, FAN_BRANCH = 0, 1, 2


def item_of(seed: int, branch: int, step: int) -> float:
    return float(seed * 10_000 + branch * 1_000 + step)


def branch_of(item: float) -> int:
    """Which branch made `item` (`item_of` inverted; steps stay below 1000)."""
    return int(item) % 10_000 // 1_000


def _producer(branch: int | None):
    def step(inputs, n):  # a function of the inputs only: the engine's per-request call count is shared
        which = FAN_BRANCH + int(inputs["branch"]) if branch is None else branch
        return {"item": torch.tensor([item_of(int(inputs["seed"]), which, int(inputs["step"]))])}

    return step


def decode_step(inputs, n):
    chunk = inputs["chunk"]
    new = list(chunk.new_items)
    return {"wav": 2.0 * torch.cat(new) if new else torch.zeros(0), "context": int(chunk.num_context)}


def _loop(node: str, index: str, **inputs: str) -> Loop:
    return Loop(body=NodeCall(node, inputs={"step": index, **inputs}, outputs={"item": f"{node}_item"}),
                iters="length", index_name=index)


def branches_graph(name: str = "fixture-branches") -> Graph:
    nodes = [
        GraphNode("cond", inputs=("seed", "step"), outputs=("item",), engine="fixture_chain",
                  module=lambda: _producer(COND)),
        GraphNode("uncond", inputs=("seed", "step"), outputs=("item",), engine="fixture_chain",
                  module=lambda: _producer(UNCOND)),
        GraphNode("gen", inputs=("seed", "step", "branch"), outputs=("item",), engine="fixture_chain",
                  module=lambda: _producer(None)),
        GraphNode("decode", inputs=("chunk",), outputs=("wav", "context"), engine="fixture_chain",
                  module=lambda: decode_step),
    ]
    cfg = Walk(
        name="cfg",
        body=Parallel(_loop("cond", "cond_step"), _loop("uncond", "uncond_step")),
        inputs=("seed", "length"),
        outputs=("wav_cond", "wav_uncond"),
        emit=("wav_cond", "wav_uncond"),
        streams=tuple(
            StreamingGraphEdge(f"{node}.item", "decode.chunk", LeftContextChunkPolicy(3, 1),
                               outputs={"wav": f"wav_{node}", "context": f"context_{node}"})
            for node in ("cond", "uncond")
        ),
    )
    fan = Walk(
        name="fan",
        body=Parallel(_loop("gen", "gen_step", branch="choice"), count="n", index_name="choice", collect=()),
        inputs=("seed", "length", "n"),
        outputs=("wav",),
        emit=("wav",),
        streams=(StreamingGraphEdge("gen.item", "decode.chunk", FixedChunkPolicy(2)),),
    )
    return Graph.build(name, nodes, [cfg, fan])


def load(options):
    return LoadedModel(name="fixture-branches", graph=branches_graph(), random_weights=True)


SPEC = ModelSpec(name="fixture-branches", load=load,
                 description="producer loops in Parallel branches streaming into a decoder (tests)")
