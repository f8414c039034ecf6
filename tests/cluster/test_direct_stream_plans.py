"""Which streams go worker to worker, decided from the placement alone (no processes: a stand-in cluster).

The fixture chain: `gen` (a loop in the body) -> stream 0 -> the `talker` consumer loop -> stream 1
-> `window` per chunk. Stream 1 is produced by stream 0's consumer, so it can go direct only from
where that consumer runs: on a worker, reached directly. The fixture's Parallel walks (`branches.py`):
producer loops in two branches, and in fan-out copies, each stream sent on from the producer's worker.
"""

import types

from mstar_fixture_plugin.chain import chain_graph

from mstar_core.cluster.remote_loop import delegate_loops
from mstar_core.cluster.remote_node import RemoteNodeScheduler, ReplicaGroup
from mstar_core.cluster.remote_stream import plan_direct_streams
from mstar_core.runtime.conductor import Conductor


class StandInCluster:
    """What planning and `StreamPlan.target` read of a cluster: replica groups and each worker's heartbeat load."""

    def __init__(self, workers, reachable=None):
        self.workers = {w: types.SimpleNamespace(ready=True, load={}) for w in workers}
        for w in reachable if reachable is not None else workers:  # a peer mailbox known from its heartbeats
            self.workers[w].load["peer"] = {"address": f"tcp://127.0.0.1:{7000 + len(w)}"}
        self._groups = {}

    def replica_group(self, replicas):
        return self._groups.setdefault(tuple(replicas), ReplicaGroup(self, tuple(replicas)))


def plan(where, reachable=None):
    """The conductor's direct streams for `where` (node -> worker; missing: this process)."""
    cluster = StandInCluster(sorted(set(where.values())), reachable)
    graph = chain_graph()
    local = types.SimpleNamespace()  # a scheduler in this process: never a RemoteNodeScheduler
    schedulers = {n: RemoteNodeScheduler(cluster, "fixture-chain", n, [where[n]]) if n in where else local
                  for n in graph.nodes}
    conductor = Conductor(graph, schedulers)
    delegate_loops(conductor, cluster, "fixture-chain")
    count = plan_direct_streams(conductor, cluster, "fixture-chain")
    plans = conductor.direct_streams.get("speak", {})
    assert count == len(plans)
    return plans


def test_a_stream_produced_by_a_consumer_on_a_worker_goes_on_from_there():
    plans = plan({"gen": "a", "talker": "b", "window": "c"})
    assert sorted(plans) == [0, 1]
    assert plans[0].parent is None and plans[1].parent is plans[0]
    assert plans[1].target("r1")[0] == "c" and plans[0].target("r1")[0] == "b"


def test_both_ends_on_one_worker_go_through_its_own_mailbox():
    plans = plan({"gen": "a", "talker": "b", "window": "b"})
    assert sorted(plans) == [0, 1] and plans[1].target("r1")[0] == "b"
    assert sorted(plan({"gen": "a", "talker": "a", "window": "a"})) == [0, 1]


def test_streams_whose_producer_or_consumer_stays_here_stay_here():
    # the producer loop runs here (gen not on a worker): its items are here, and so are the talker's
    assert plan({"talker": "b", "window": "c"}) == {}
    # the decoder runs here: only the first stream goes direct
    assert sorted(plan({"gen": "a", "talker": "b"})) == [0]
    # the talker runs here: its frames are here too
    assert sorted(plan({"gen": "a", "window": "c"})) == []


def test_a_request_keeps_a_chained_stream_here_while_its_producing_consumer_is_not_reachable():
    plans = plan({"gen": "a", "talker": "b", "window": "c"}, reachable=["a", "c"])
    assert sorted(plans) == [0, 1]
    # b's mailbox is not known yet: stream 0 stays here, so the talker runs here and stream 1 must too
    assert plans[0].open("r1") is None and plans[1].open("r1") is None
    plans = plan({"gen": "a", "talker": "b", "window": "c"}, reachable=["a", "b"])
    assert plans[0].open("r1") is not None and plans[1].open("r1") is None  # c not reachable: stays here


def branch_plans(where):
    """The direct streams of the fixture's Parallel walks for `where` (node -> worker; missing: this process)."""
    from mstar_fixture_plugin.branches import branches_graph

    cluster = StandInCluster(sorted(set(where.values())))
    graph = branches_graph()
    local = types.SimpleNamespace()
    conductor = Conductor(graph, {n: RemoteNodeScheduler(cluster, "fixture-branches", n, [where[n]]) if n in where
                                  else local for n in graph.nodes})
    delegate_loops(conductor, cluster, "fixture-branches")
    plan_direct_streams(conductor, cluster, "fixture-branches")
    return {walk: sorted(plans) for walk, plans in conductor.direct_streams.items()}


def test_streams_from_loops_in_parallel_branches_and_fan_out_copies_go_worker_to_worker():
    assert branch_plans({"cond": "a", "uncond": "a", "gen": "a", "decode": "b"}) == {"cfg": [0, 1], "fan": [0]}
    # each branch's stream on its own: one producer loop runs here, the other's stream still goes direct
    assert branch_plans({"uncond": "a", "gen": "a", "decode": "b"}) == {"cfg": [1], "fan": [0]}
    # the consumer here: every stream stays here
    assert branch_plans({"cond": "a", "uncond": "a", "gen": "a"}) == {}
