"""Per-model weight-name mapping: rename, skip, transform, and fuse checkpoint tensors into module tensors."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs
import torch

from mstar_core.checkpoint.errors import CheckpointError

Transform = Callable[[str, torch.Tensor], torch.Tensor]


class WeightMapping:
    """Identity mapping; subclasses turn one checkpoint tensor into zero or more module tensors."""

    def __call__(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return ((name, tensor),)

    def flush(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Emit what was held back (e.g. fused experts); called once after the last tensor."""
        return ()


@attrs.define
class ExpertFusion:
    """Stack per-expert `...experts.E.{gate,up,down}_proj.weight` into `...experts.{gate_up_proj,down_proj}`."""

    num_experts: int
    pattern: re.Pattern = re.compile(r"^(?P<prefix>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
    _held: dict[str, dict[str, dict[int, torch.Tensor]]] = attrs.field(factory=dict)

    def take(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """Hold an expert tensor; returns fused tensors once a prefix is complete, None if `name` is not an expert."""
        m = self.pattern.match(name)
        if m is None:
            return None
        e = int(m["e"])
        if e >= self.num_experts:
            raise CheckpointError(f"checkpoint tensor {name!r}: expert {e} >= num_experts {self.num_experts}")
        held = self._held.setdefault(m["prefix"], {"gate_proj": {}, "up_proj": {}, "down_proj": {}})
        held[m["proj"]][e] = tensor
        if all(len(v) == self.num_experts for v in held.values()):
            del self._held[m["prefix"]]
            return self._fuse(m["prefix"], held)
        return []

    def _fuse(self, prefix: str, held: dict[str, dict[int, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        order = range(self.num_experts)
        gate_up = torch.stack([torch.cat((held["gate_proj"][e], held["up_proj"][e]), 0) for e in order])
        down = torch.stack([held["down_proj"][e] for e in order])
        return [(f"{prefix}.gate_up_proj", gate_up), (f"{prefix}.down_proj", down)]

    def incomplete(self) -> list[str]:
        """Names of expert tensors still missing for prefixes that were started."""
        missing = []
        for prefix, held in self._held.items():
            for proj, got in held.items():
                missing += [f"{prefix}.{e}.{proj}.weight" for e in range(self.num_experts) if e not in got]
        return missing


@attrs.define
class RuleMapping(WeightMapping):
    """Regex rules applied in order: `skip` drops, `rename` rewrites (re.sub), `transform` edits, `fuse` stacks experts.

    `transform` keys match the name after renaming.
    """

    rename: Sequence[tuple[str, str]] = ()
    skip: Sequence[str] = ()
    transform: Mapping[str, Transform] = attrs.field(factory=dict)
    fuse: ExpertFusion | None = None

    def __call__(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if any(re.search(p, name) for p in self.skip):
            return ()
        for pattern, repl in self.rename:
            name = re.sub(pattern, repl, name)
        for pattern, fn in self.transform.items():
            if re.search(pattern, name):
                tensor = fn(name, tensor)
        if self.fuse is not None:
            fused = self.fuse.take(name, tensor)
            if fused is not None:
                return fused
        return ((name, tensor),)

    def flush(self) -> Iterable[tuple[str, torch.Tensor]]:
        if self.fuse is not None and (missing := self.fuse.incomplete()):
            raise CheckpointError("checkpoint is missing expert weights: " + ", ".join(missing[:20]))
        return ()
