"""`launcher: ray` on a multi-node Ray cluster: the placement's resource requests put workers on different nodes.

`ray.cluster_utils.Cluster` starts a head and two more raylets on this machine, each a Ray node of
its own (own node id, own resources). The head offers no CPU, each other node one, and each worker
of the disaggregated Orpheus asks for one CPU: Ray can only put the LM and the codec on two
different nodes. The audio must equal the colocated run's. Slow (three raylets and two actors
starting: ~40-90 s on 2 cores); the fast Ray test (a local head) runs in CI.
"""

from pathlib import Path

import pytest
import torch

from mstar_core.cluster.strategy import placed_engine
from mstar_core.config import Placement, load_placement
from mstar_core.model import LoadOptions
from mstar_core.plugins import discover

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")
pytest.importorskip("mstar_orpheus")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "placement"
REQUEST = {"text": "Hello from M star.", "voice": "tara", "seed": 7, "max_tokens": 120}


@pytest.fixture(scope="module")
def two_node_cluster():
    if ray.is_initialized():
        ray.shutdown()
    # the machine's own address, not loopback: ray.init resolves a loopback address to it, where a
    # loopback-bound head would not answer
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster, {n.node_id for n in nodes}, cluster.head_node.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


async def audio(placement):
    engine = placed_engine(discover())
    await engine.load_model("orpheus", LoadOptions(preset="tiny"), placement=placement)
    try:
        chunks = [torch.as_tensor(o.value).clone() async for o in engine.submit("orpheus", dict(REQUEST))
                  if o.name == "audio"]
        placed = {name: getattr(w.process, "node_id", None) for name, w in (engine.cluster.workers.items()
                                                                            if engine.cluster else ())}
        return chunks, placed
    finally:
        await engine.close()


async def test_ray_workers_land_on_two_nodes_and_the_audio_equals_colocated(two_node_cluster):
    _, worker_nodes, head = two_node_cluster
    want, _ = await audio(load_placement(EXAMPLES / "orpheus-colocated.yaml"))
    # examples/placement/orpheus-disaggregated.yaml with both workers as Ray actors
    placement = Placement.from_dict({
        "workers": {"lm": {"launcher": "ray", "num_cpus": 1}, "codec": {"launcher": "ray", "num_cpus": 1}},
        "nodes": {"lm": "lm", "snac": "codec"},
        "engine_settings": {"lm": {"num_pages": 512, "page_size": 16}},
        "control": {"heartbeat_interval": 0.2},
    }, "ray-two-nodes.yaml")
    got, placed = await audio(placement)
    assert set(placed) == {"lm", "codec"}
    # one CPU per node and one asked per worker: each worker on its own non-head node
    assert placed["lm"] != placed["codec"] and {placed["lm"], placed["codec"]} == worker_nodes
    assert head not in placed.values()
    assert len(got) == len(want) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
