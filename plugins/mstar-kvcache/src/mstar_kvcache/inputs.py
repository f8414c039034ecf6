"""Reading a `kvcache` invocation: token ids, optional embeddings, sampling, options; errors say what to fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation
from mstar_core.sampling import SamplingParams

#: Per-call options the engine understands (anything else in the walk's options is ignored).
OPTIONS = ("cache_label", "write_cache", "fork_from", "bidirectional", "frame_size")


@attrs.define
class ParsedInvocation:
    """An invocation's tokens and how to treat them."""

    ids: list[int]
    label: str
    write_cache: bool
    fork_from: str | None
    sampling: SamplingParams | None
    embeds: torch.Tensor | None
    bidirectional: bool
    frame_size: int | None


def _token_ids(value: Any, node: str) -> list[int]:
    if isinstance(value, bool):
        raise RequestError(f"node '{node}': input_ids must be token ids, got a bool")
    if isinstance(value, int):
        return [value]
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 and value.shape[0] == 1:
            value = value[0]  # a batch of one, as tokenizers return it
        if value.dim() > 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise RequestError(
                f"node '{node}': input_ids must be a 1-D integer tensor, got {tuple(value.shape)} {value.dtype}"
            )
        return value.tolist() if value.dim() else [int(value)]
    if isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise RequestError(f"node '{node}': input_ids must be an int, a list of ints or a 1-D tensor, got {type(value).__name__}")


def parse_invocation(inv: Invocation, vocab_size: int, hidden_size: int | None) -> ParsedInvocation:
    """Validate an invocation of a `kvcache` node."""
    node, opts, inputs = inv.node, inv.options, inv.inputs
    if "input_ids" not in inputs:
        raise RequestError(f"node '{node}': missing input 'input_ids'")
    ids = _token_ids(inputs["input_ids"], node)
    if not ids:
        raise RequestError(f"node '{node}': input_ids is empty; send at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"node '{node}': token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    sampling = inputs.get("sampling")
    if isinstance(sampling, Mapping):
        sampling = SamplingParams.from_mapping(sampling)
    elif sampling is not None and not isinstance(sampling, SamplingParams):
        raise RequestError(f"node '{node}': input 'sampling' must be SamplingParams or a dict, got {type(sampling).__name__}")
    embeds = inputs.get("input_embeds")
    if embeds is not None:
        if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2 or embeds.shape[0] != len(ids):
            shape = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
            raise RequestError(f"node '{node}': input_embeds must be a [{len(ids)}, hidden] tensor (one row per id), got {shape}")
        if hidden_size is not None and embeds.shape[1] != hidden_size:
            raise RequestError(f"node '{node}': input_embeds rows must have {hidden_size} features, got {embeds.shape[1]}")
    frame = opts.get("frame_size")
    if frame is not None and (not isinstance(frame, int) or frame < 1):
        raise RequestError(f"node '{node}': option frame_size must be a positive int, got {frame!r}")
    bidirectional = bool(opts.get("bidirectional", False))
    if bidirectional and frame is not None:
        raise RequestError(f"node '{node}': options bidirectional and frame_size are exclusive; pick one mask")
    label = opts.get("cache_label", "main")
    if not isinstance(label, str) or not label:
        raise RequestError(f"node '{node}': option cache_label must be a non-empty string, got {label!r}")
    return ParsedInvocation(
        ids=ids,
        label=label,
        write_cache=bool(opts.get("write_cache", True)),
        fork_from=opts.get("fork_from"),
        sampling=sampling,
        embeds=embeds,
        bidirectional=bidirectional,
        frame_size=frame,
    )


def mask_limits(start: int, count: int, bidirectional: bool, frame_size: int | None) -> list[int] | None:
    """Exclusive key-position bounds for tokens `start..start+count-1`; None for plain causal."""
    if bidirectional:
        return [start + count] * count
    if frame_size is not None:
        return [(p // frame_size + 1) * frame_size for p in range(start, start + count)]
    return None
