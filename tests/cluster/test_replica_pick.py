"""A new request goes to a live replica: one whose process has exited is skipped before supervision notices."""

from __future__ import annotations

from types import SimpleNamespace

from mstar_core.cluster.remote_node import ReplicaGroup


class _Process:
    def __init__(self, code: int | None):
        self.code = code

    def poll(self) -> int | None:
        return self.code


def test_an_exited_replica_gets_no_new_request_even_while_still_marked_ready():
    workers = {"a": SimpleNamespace(ready=True, process=_Process(-9)),  # killed; supervision has not seen it yet
               "b": SimpleNamespace(ready=True, process=_Process(None))}
    group = ReplicaGroup(SimpleNamespace(workers=workers), ("a", "b"))
    assert {group.pick(f"req-{i}") for i in range(50)} == {"b"}
    assert not group.down()
    workers["b"].process.code = 1
    assert group.down()  # every replica gone: a new request is refused (503) up front
