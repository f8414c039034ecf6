"""Walk runtime v2: joins inside loops, shared call sites, branching plans, options from the env, fan-out."""


from mstar_core.graph import Graph, Loop, Parallel, Walk
from mstar_core.model import LoadedModel
from mstar_core.plugins import discover
from mstar_core.runtime import AsyncEngine
from tests.core.helpers import fn_node


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
