"""Moving a request's caches between engines (per-walk placement): export, import, transfer invocations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation
from mstar_kvcache.blocks import BlockManager
from mstar_kvcache.labels import Labels
from mstar_kvcache.pool import PagePool
from mstar_kvcache.ranks import StepLeader
from mstar_kvcache.sequence import Sequence
from mstar_kvcache.snapshot import CacheSnapshot


class CacheTransfer:
    """A label's cache as a `CacheSnapshot`, and back; the transfer invocations that move all of a request's."""

    def __init__(self, node: str, labels: Labels, pool: PagePool, blocks: BlockManager, leader: StepLeader | None,
                 device: torch.device):
        self.node, self.labels, self.pool, self.blocks, self.device = node, labels, pool, blocks, device
        self.leader = leader  # rank 0 of a split node: a snapshot holds every rank's heads (ranks.py)

    def export_cache(self, request_id: str, label: str = "main") -> CacheSnapshot:
        """A copy of one label's cache and sampling state, for `import_cache` in another engine.

        Only between calls: the label's tokens must all be cached and no call may be in flight.
        """
        seq = self.labels.seqs.get((request_id, label))
        if seq is None:
            raise RequestError(f"node '{self.node}': request {request_id} has no cache label '{label}' to export")
        if seq.pending is not None or seq.remaining:
            raise RequestError(f"node '{self.node}': cache label '{label}' of {request_id} is mid-call; "
                               "export it between calls")
        kv = self.pool.read_rows(seq.pages, seq.num_computed)
        if self.leader is not None:  # a split node: the snapshot holds every rank's heads (ranks.py)
            kv = self.leader.gather_heads(seq.pages, seq.num_computed, kv)
        return CacheSnapshot(
            label=label,
            tokens=list(seq.tokens),
            generated=list(seq.generated),
            kv=kv,
            sampling=seq.sampling,
            generator_state=None if seq.generator is None else seq.generator.get_state(),
            limits=None if seq.limits is None else list(seq.limits),
            embeds=list(seq.embeds),
            cacheable=seq.cacheable,
            positions=seq.positions,
            routing=None if seq.routing is None else list(seq.routing),
        )

    def import_cache(self, request_id: str, snapshot: CacheSnapshot) -> None:
        """Make `snapshot` this request's cache label, as if its tokens had been computed here.

        Raises `RequestError` if the label exists, the shape does not match this model's KV, or
        the pool cannot hold it now (503: retry when requests finish; 413: it can never fit).
        """
        key = (request_id, snapshot.label)
        if key in self.labels.seqs:
            raise RequestError(f"node '{self.node}': cache label '{snapshot.label}' already exists for {request_id}")
        layers, _, _, _, heads, dim = self.pool.kv.shape
        # a snapshot holds every KV head of the model (each replicated head once)
        split = 1 if self.leader is None else self.leader.group.world_size // self.leader.kv_replicas
        want = (layers, 2, len(snapshot.tokens), heads * split, dim)
        if tuple(snapshot.kv.shape) != want:
            raise RequestError(f"node '{self.node}': cache snapshot has KV shape {tuple(snapshot.kv.shape)}, "
                               f"this model needs {want}")
        seq = Sequence(request_id, snapshot.label, tokens=list(snapshot.tokens), order=self.labels.next_order(),
                       generated=list(snapshot.generated), sampling=snapshot.sampling,
                       limits=None if snapshot.limits is None else list(snapshot.limits),
                       embeds=[(start, rows.to(self.device)) for start, rows in snapshot.embeds],
                       cacheable=snapshot.cacheable, positions=snapshot.positions,
                       routing=None if snapshot.routing is None else list(snapshot.routing))
        n = len(seq.tokens)
        if self.blocks.total_pages(seq) > self.pool.num_pages:
            raise RequestError(f"node '{self.node}': the snapshot needs {self.blocks.total_pages(seq)} KV pages, "
                               f"the pool has {self.pool.num_pages}", status=413)
        if not self.blocks.reserve(seq, n):
            raise RequestError(f"node '{self.node}': no KV pages free for the snapshot now; retry later", status=503)
        kv = snapshot.kv if self.leader is None else self.leader.scatter_heads(seq.pages, n, snapshot.kv)
        self.pool.write_rows(seq.pages, kv)
        seq.num_computed = n
        self.blocks.commit(seq)
        if snapshot.generator_state is not None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.set_state(snapshot.generator_state)
        self.labels.seqs[key] = seq

    def answer(self, inv: Invocation, op: str, release: Callable[[str], None]) -> dict[str, Any] | BaseException:
        """Answer a transfer invocation: every cache label of the request leaves (export: then `release` frees the
        request here) or arrives (import)."""
        try:
            if op == "export":
                labels = [label for rid, label in self.labels.seqs if rid == inv.request_id]
                state = {"labels": [self.export_cache(inv.request_id, label).to_plain() for label in labels]}
                release(inv.request_id)  # moved, not copied: the pages here are free again
                return {"state": state}
            if op == "import":
                state = inv.inputs.get("state")
                if not isinstance(state, dict) or not isinstance(state.get("labels"), list):
                    raise RequestError(f"node '{self.node}': import needs input 'state' as an export produced it")
                for plain in state["labels"]:
                    self.import_cache(inv.request_id, CacheSnapshot.from_plain(plain))
                return {}
            raise RequestError(f"node '{self.node}': unknown transfer {op!r}; use 'export' or 'import'")
        except Exception as exc:  # (an export only releases once every label is copied)
            return exc
