"""A sequence's cached state as plain data, so another engine (another worker) can continue it.

This is what per-walk placement moves between workers: the prefill runs on one rank, the
snapshot (tokens, keys and values, sampling state) travels as raw tensor frames, and the decode
rank imports it into its own pages and samples on as if it had run the prefill itself.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from mstar_core.errors import RequestError
from mstar_core.sampling import SamplingParams

#: Version of the plain-data form (`to_plain` / `from_plain`); bump on any change of meaning.
FORMAT = 1


@attrs.frozen(eq=False)
class CacheSnapshot:
    """Everything one cache label of one request holds once all its tokens are cached.

    `kv` is `[layers, 2 (k/v), len(tokens), kv_heads, head_dim]`, every KV head of the model (a node
    split across ranks gathers its ranks' heads, see ranks.py). `generator_state` is the
    request's sampling generator (`torch.Generator.get_state()`), so a seeded request draws the
    same tokens after the move as it would have without it.
    """

    label: str
    tokens: list[int]
    generated: list[int]
    kv: torch.Tensor
    sampling: SamplingParams | None = None
    generator_state: torch.Tensor | None = None
    limits: list[int] | None = None
    embeds: list[tuple[int, torch.Tensor]] = attrs.field(factory=list)
    cacheable: bool = True
    positions: torch.Tensor | None = None  # explicit RoPE positions [axes, len(tokens)], if any call gave some
    routing: list[int] | None = None

    def to_plain(self) -> dict[str, Any]:
        """Nested plain values and tensors (what `mstar_core.wire` encodes without pickle)."""
        return {
            "format": FORMAT,
            "label": self.label,
            "tokens": list(self.tokens),
            "generated": list(self.generated),
            "kv": self.kv,
            "sampling": None if self.sampling is None else attrs.asdict(self.sampling),
            "generator_state": self.generator_state,
            "limits": self.limits,
            "embeds": [[start, rows] for start, rows in self.embeds],
            "cacheable": self.cacheable,
            "positions": self.positions,
            "routing": self.routing,
        }

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> CacheSnapshot:
        """The inverse of `to_plain`; a malformed or foreign snapshot is a `RequestError` naming what is wrong."""
        if not isinstance(plain, dict) or plain.get("format") != FORMAT:
            got = plain.get("format") if isinstance(plain, dict) else type(plain).__name__
            raise RequestError(f"cache snapshot: expected format {FORMAT}, got {got!r}")
        kv = plain.get("kv")
        tokens = plain.get("tokens")
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or not isinstance(tokens, list) or kv.shape[2] != len(tokens):
            raise RequestError("cache snapshot: 'kv' must be [layers, 2, len(tokens), kv_heads, head_dim]")
        sampling = plain.get("sampling")
        return cls(
            label=plain["label"],
            tokens=tokens,
            generated=list(plain.get("generated", [])),
            kv=kv,
            sampling=None if sampling is None else SamplingParams.from_mapping(sampling),
            generator_state=plain.get("generator_state"),
            limits=plain.get("limits"),
            embeds=[(int(start), rows) for start, rows in plain.get("embeds", [])],
            cacheable=bool(plain.get("cacheable", True)),
            positions=plain.get("positions"),
            routing=plain.get("routing"),
        )
