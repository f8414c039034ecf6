"""Moving a request's caches between engines (per-walk placement): export, import, transfer invocations."""

from __future__ import annotations

from typing import Any

import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation
from mstar_kvcache.sequence import Sequence
from mstar_kvcache.snapshot import CacheSnapshot


class CacheTransfer:
    """Mixin of `KVCacheEngine`: a label's cache as a `CacheSnapshot`, and back."""

    def export_cache(self, request_id: str, label: str = "main") -> CacheSnapshot:
        """A copy of one label's cache and sampling state, for `import_cache` in another engine.

        Only between calls: the label's tokens must all be cached and no call may be in flight.
        """
        seq = self.seqs.get((request_id, label))
        if seq is None:
            raise RequestError(f"node '{self.node.name}': request {request_id} has no cache label '{label}' to export")
        if seq.pending is not None or seq.remaining:
            raise RequestError(f"node '{self.node.name}': cache label '{label}' of {request_id} is mid-call; "
                               "export it between calls")
        kv = self._read_kv(seq.pages, seq.num_computed)
        if self.ranks is not None:  # a split node: the snapshot holds every rank's heads (ranks.py)
            kv = self._gather_heads(seq.pages, seq.num_computed, kv)
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
        if key in self.seqs:
            raise RequestError(f"node '{self.node.name}': cache label '{snapshot.label}' already exists for {request_id}")
        layers, _, _, _, heads, dim = self.pool.kv.shape
        split = 1 if self.ranks is None else self.ranks.world_size  # a snapshot holds every KV head of the model
        want = (layers, 2, len(snapshot.tokens), heads * split, dim)
        if tuple(snapshot.kv.shape) != want:
            raise RequestError(f"node '{self.node.name}': cache snapshot has KV shape {tuple(snapshot.kv.shape)}, "
                               f"this model needs {want}")
        seq = Sequence(request_id, snapshot.label, tokens=list(snapshot.tokens), order=next(self._order),
                       generated=list(snapshot.generated), sampling=snapshot.sampling,
                       limits=None if snapshot.limits is None else list(snapshot.limits),
                       embeds=[(start, rows.to(self.device)) for start, rows in snapshot.embeds],
                       cacheable=snapshot.cacheable, positions=snapshot.positions,
                       routing=None if snapshot.routing is None else list(snapshot.routing))
        n = len(seq.tokens)
        if self.blocks.total_pages(seq) > self.pool.num_pages:
            raise RequestError(f"node '{self.node.name}': the snapshot needs {self.blocks.total_pages(seq)} KV pages, "
                               f"the pool has {self.pool.num_pages}", status=413)
        if not self.blocks.reserve(seq, n):
            raise RequestError(f"node '{self.node.name}': no KV pages free for the snapshot now; retry later", status=503)
        kv = snapshot.kv if self.ranks is None else self._scatter_heads(seq.pages, n, snapshot.kv)
        self._write_kv(seq.pages, kv)
        seq.num_computed = n
        self.blocks.commit(seq)
        if snapshot.generator_state is not None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.set_state(snapshot.generator_state)
        self.seqs[key] = seq

    def _read_kv(self, pages: list[int], rows: int) -> torch.Tensor:
        """A copy of the first `rows` token rows of `pages` in this pool: `[layers, 2, rows, kv_heads, head_dim]`."""
        index = torch.tensor(pages, dtype=torch.long, device=self.pool.kv.device)
        return self.pool.kv.index_select(2, index).flatten(2, 3)[:, :, :rows].clone()

    def _write_kv(self, pages: list[int], kv: torch.Tensor) -> None:
        """Store `kv` (`[layers, 2, rows, kv_heads, head_dim]`) as the first token rows of `pages`; the rest are zeros."""
        layers, _, _, page_size, heads, dim = self.pool.kv.shape
        filled = self.pool.kv.new_zeros(layers, 2, len(pages) * page_size, heads, dim)
        filled[:, :, : kv.shape[2]] = kv
        index = torch.tensor(pages, dtype=torch.long, device=self.pool.kv.device)
        self.pool.kv.index_copy_(2, index, filled.unflatten(2, (len(pages), page_size)))

    def _transfer(self, inv: Invocation, op: str) -> dict[str, Any] | RequestError:
        """Answer a transfer invocation: every cache label of the request leaves (export) or arrives (import)."""
        try:
            if op == "export":
                labels = [label for rid, label in self.seqs if rid == inv.request_id]
                state = {"labels": [self.export_cache(inv.request_id, label).to_plain() for label in labels]}
                self.release(inv.request_id)  # moved, not copied: the pages here are free again
                return {"state": state}
            if op == "import":
                state = inv.inputs.get("state")
                if not isinstance(state, dict) or not isinstance(state.get("labels"), list):
                    raise RequestError(f"node '{self.node.name}': import needs input 'state' as an export produced it")
                for plain in state["labels"]:
                    self.import_cache(inv.request_id, CacheSnapshot.from_plain(plain))
                return {}
            raise RequestError(f"node '{self.node.name}': unknown transfer {op!r}; use 'export' or 'import'")
        except Exception as exc:  # (an export only releases once every label is copied)
            return exc
