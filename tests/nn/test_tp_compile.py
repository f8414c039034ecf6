"""Split layers under `torch.compile`: one graph, each collective one opaque `mstar_nn` op, eager's results.

In-process over a one-rank gloo group: the layers are built for a 2-way split (a group of world size
2, rank 0), so they take their collective paths, and summing over the one real rank leaves each value
as it is. What this pins down is the graph (fullgraph: no break at a collective) and which ops it calls.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mstar_core.nn.parallel import RowParallelLinear, TensorParallelGroup, VocabParallelEmbedding


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield TensorParallelGroup(0, 2)
    finally:
        dist.destroy_process_group()


def test_split_layers_compile_to_one_graph_with_opaque_collectives(one_rank_group):
    torch.manual_seed(0)
    embed = VocabParallelEmbedding(64, 16, one_rank_group)
    down = RowParallelLinear(16, 8, one_rank_group, bias=True)
    for p in (*embed.parameters(), *down.parameters()):
        torch.nn.init.normal_(p)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return down(torch.relu(embed(ids)))

    graphs = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.tensor([0, 5, 31, 32, 63, 7])  # rows on both sides of the rank's vocabulary shard
    with torch.inference_mode():
        want = forward(ids)
        got = torch.compile(forward, backend=capture, fullgraph=True, dynamic=False)(ids)
    assert torch.equal(got, want)
    assert len(graphs) == 1
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert calls.count("mstar_nn.all_reduce") == 2, calls  # the embedding's and the row-parallel sum
    assert not any("c10d" in target or "distributed" in target for target in calls), calls


def test_collectives_run_between_cuda_graph_pieces_not_inside_them():
    unsafe = getattr(torch.Tag, "cudagraph_unsafe", None)
    if unsafe is None:
        pytest.skip("this torch has no cudagraph_unsafe tag")
    for op in (torch.ops.mstar_nn.all_reduce.default, torch.ops.mstar_nn.all_gather_last.default):
        assert unsafe in op.tags, op
