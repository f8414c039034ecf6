"""Reading a `kvcache` invocation: token ids and/or embeddings, positions, routing, module tensors, options.

Every problem is a `RequestError` that says what to fix. The call contract:

inputs  `input_ids` (int, list or 1-D tensor), `input_embeds` `[n, hidden]` (one row per id, or the rows
        at `embeds_at`: a bool mask `[T]` or indices `[n]` of the placeholder ids they replace; with no
        ids, the embeddings are the call's tokens), `positions` (`[T]` or `[axes, T]` RoPE positions),
        `routing` (`[T]` integer expert ids), `output_index` (`[k]` rows of the call to return),
        `sampling`, and the per-call tensors the module declares in `call_inputs`.
options see `OPTIONS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Invocation
from mstar_core.sampling import SamplingParams, choice_seed
from mstar_kvcache.cross import parse_cross

#: Per-call options (and node-static ones) the engine understands; anything else fails the model's load.
OPTIONS = (
    "cache_label",  # the label this call appends to (or, read-only, reads); default "main"
    "write_cache",  # False: read-only, attend to frozen labels plus this call's tokens, allocate nothing
    "read_labels",  # read-only calls: the frozen labels attended, in order (default [cache_label])
    "fork_from",  # a new label starts as a copy-on-write fork of this one
    "seed_offset",  # int added to sampling's seed; a fork made with it is a new sample (own generator, no tokens generated)
    "reset",  # True: the label starts empty at this call (a scratch cache per frame)
    "snapshot_before",  # label(s) made a fork of cache_label before this call's tokens (replacing them)
    "snapshot_after",  # label(s) made a fork of cache_label once this call is done
    "drop",  # label(s) dropped once this call is done
    "bidirectional",  # this call's tokens form one bidirectional block
    "blocks",  # block lengths summing to the call's tokens: each block bidirectional, causal across blocks
    "frame_size",  # frame-causal mask over absolute token indices
    "output_rows",  # outputs per token: "all" rows of the call (default) or the "last"; a sampling call asks so
    "decode_steps",  # a sampling call samples this many tokens, each fed back as the next input; next_token is their list
    "transfer",  # "export" / "import": move the request's caches between engines
    "share_cache_with",  # node-static: read-only calls read that node's labels (its pages, same pool)
    "cross_label",  # the request's cross-attention label this call's sequence attends to (cross.py)
)

_OPTION_NAMES = frozenset(OPTIONS)

#: Inputs the engine itself reads; any other input of a node must be declared by its module.
BUILTIN_INPUTS = ("input_ids", "input_embeds", "embeds_at", "positions", "routing", "output_index", "sampling",
                  "state", "cross_states", "lora")


@attrs.define
class ParsedInvocation:
    """An invocation's tokens and how to treat them."""

    ids: list[int]
    label: str
    write_cache: bool
    fork_from: str | None
    sampling: SamplingParams | None
    embeds: list[tuple[int, torch.Tensor]]  # (offset in the call, rows) runs
    bidirectional: bool
    frame_size: int | None
    positions: torch.Tensor | None = None  # [axes, n]
    routing: list[int] | None = None
    extras: dict[str, tuple[torch.Tensor, bool]] = attrs.field(factory=dict)  # name -> (value, per_token)
    output_index: torch.Tensor | None = None
    read_labels: tuple[str, ...] = ()
    reset: bool = False
    snapshot_before: tuple[str, ...] = ()
    snapshot_after: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    output_rows: str | None = None  # None: "all" on a per-token node, no per-token outputs on a sampling one
    seed_offset: int | None = None
    blocks: tuple[int, ...] | None = None
    decode_steps: int | None = None
    cross_label: str | None = None  # (cross.py) the cross label attended; with `cross_states`, the one they fill
    cross_states: torch.Tensor | None = None
    lora: str | None = None  # the LoRA adapter the call runs under (input `lora`, see lora.py); None: as its label does


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


def _labels(value: Any, option: str, node: str) -> tuple[str, ...]:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, list | tuple) else None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise RequestError(f"node '{node}': option {option} must be a label or a list of labels, got {value!r:.60}")
    return names


def _runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs `(first, length)` of consecutive sorted indices."""
    out: list[tuple[int, int]] = []
    for i in index.tolist():
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def _embeds(inputs: Mapping[str, Any], ids: list[int] | None, hidden: int | None, node: str):
    """The call's ids (placeholders when only embeddings came) and its embedding runs."""
    embeds = inputs.get("input_embeds")
    if embeds is None:
        if inputs.get("embeds_at") is not None:
            raise RequestError(f"node '{node}': embeds_at was given without input_embeds")
        return ids, []
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 2:
        shape = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
        raise RequestError(f"node '{node}': input_embeds must be a [rows, hidden] tensor, got {shape}")
    if hidden is not None and embeds.shape[1] != hidden:
        raise RequestError(f"node '{node}': input_embeds rows must have {hidden} features, got {embeds.shape[1]}")
    if ids is None:
        return [0] * embeds.shape[0], [(0, embeds)]  # embeddings only: the ids are placeholders
    at = inputs.get("embeds_at")
    if at is None:
        if embeds.shape[0] != len(ids):
            raise RequestError(f"node '{node}': input_embeds must have one row per id ({len(ids)}), got "
                               f"{embeds.shape[0]}; or give embeds_at (the placeholder positions they fill)")
        return ids, [(0, embeds)]
    if not isinstance(at, torch.Tensor) or at.dim() != 1:
        raise RequestError(f"node '{node}': embeds_at must be a 1-D bool mask or index tensor")
    index = at.nonzero().flatten() if at.dtype == torch.bool else at.long()
    if at.dtype == torch.bool and at.shape[0] != len(ids):
        raise RequestError(f"node '{node}': embeds_at mask has {at.shape[0]} entries for {len(ids)} ids")
    if index.numel() != embeds.shape[0]:
        raise RequestError(f"node '{node}': embeds_at selects {index.numel()} positions for {embeds.shape[0]} rows")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= len(ids) or bool((index.diff() <= 0).any())):
        raise RequestError(f"node '{node}': embeds_at indices must be increasing and within [0, {len(ids)})")
    runs, row = [], 0
    for first, length in _runs(index.cpu()):
        runs.append((first, embeds[row : row + length]))
        row += length
    return ids, runs


def _positions(value: Any, n: int, axes: int, node: str) -> torch.Tensor | None:
    if value is None:
        return None
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dim() not in (1, 2):
        raise RequestError(f"node '{node}': positions must be an integer [T] or [axes, T] tensor")
    pos = value.long().cpu()
    if pos.dim() == 1:
        pos = pos.unsqueeze(0).expand(axes, -1)
    if pos.shape != (axes, n):
        raise RequestError(f"node '{node}': positions must be [{n}] or [{axes}, {n}] for this call, got {tuple(value.shape)}")
    if bool((pos < 0).any()):
        raise RequestError(f"node '{node}': positions must be non-negative")
    return pos.contiguous()


def parse_invocation(
    inv: Invocation,
    vocab_size: int | None,
    hidden_size: int | None,
    axes: int = 1,
    call_inputs: Mapping[str, str] | None = None,
) -> ParsedInvocation:
    """Validate an invocation of a `kvcache` node."""
    node, opts, inputs = inv.node, inv.options, inv.inputs
    if not _OPTION_NAMES.issuperset(opts):
        unknown = sorted(set(opts) - _OPTION_NAMES)
        raise RequestError(f"node '{node}': unknown call option(s) {unknown}; known: {sorted(OPTIONS)}")
    ids = _token_ids(inputs["input_ids"], node) if inputs.get("input_ids") is not None else None
    if ids is None and inputs.get("input_embeds") is None:
        raise RequestError(f"node '{node}': missing input 'input_ids' (or 'input_embeds')")
    ids, embeds = _embeds(inputs, ids, hidden_size, node)
    if not ids:
        raise RequestError(f"node '{node}': input_ids is empty; send at least one token")
    if vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"node '{node}': token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    n = len(ids)
    sampling = inputs.get("sampling")
    if sampling is None or isinstance(sampling, SamplingParams):
        pass
    elif isinstance(sampling, Mapping):
        sampling = SamplingParams.from_mapping(sampling)
    else:
        raise RequestError(f"node '{node}': input 'sampling' must be SamplingParams or a dict, got {type(sampling).__name__}")
    offset = opts.get("seed_offset")
    if offset is not None:
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise RequestError(f"node '{node}': option seed_offset must be an int >= 0, got {offset!r:.40}")
        if sampling is not None and sampling.seed is not None and offset:
            sampling = attrs.evolve(sampling, seed=choice_seed(sampling.seed, offset))
    routing = inputs.get("routing")
    if routing is not None:
        if isinstance(routing, torch.Tensor) and not routing.dtype.is_floating_point and routing.shape == (n,):
            routing = routing.tolist()
        elif not (isinstance(routing, list) and len(routing) == n and all(isinstance(r, int) for r in routing)):
            raise RequestError(f"node '{node}': routing must be {n} integer expert ids, one per token")
    extras: dict[str, tuple[torch.Tensor, bool]] = {}
    for name, kind in (call_inputs or {}).items():
        value = inputs.get(name)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise RequestError(f"node '{node}': input '{name}' must be a tensor, got {type(value).__name__}")
        per_token = kind == "token"
        if per_token and (value.dim() == 0 or value.shape[0] != n):
            raise RequestError(f"node '{node}': input '{name}' is per token: its first dimension must be {n}")
        extras[name] = (value, per_token)
    output_index = inputs.get("output_index")
    if output_index is not None:
        if not isinstance(output_index, torch.Tensor) or output_index.dim() != 1 or output_index.dtype.is_floating_point:
            raise RequestError(f"node '{node}': output_index must be a 1-D integer tensor of rows of this call")
        output_index = output_index.long().cpu()
        if output_index.numel() and (int(output_index.min()) < -n or int(output_index.max()) >= n):
            raise RequestError(f"node '{node}': output_index must lie within the call's {n} rows")
    frame = opts.get("frame_size")
    if frame is not None and (not isinstance(frame, int) or frame < 1):
        raise RequestError(f"node '{node}': option frame_size must be a positive int, got {frame!r}")
    bidirectional = bool(opts.get("bidirectional", False))
    blocks = opts.get("blocks")
    if blocks is not None:
        if not isinstance(blocks, list | tuple) or not all(type(b) is int and b > 0 for b in blocks) or sum(blocks) != n:
            raise RequestError(f"node '{node}': option blocks must be positive block lengths summing to the call's "
                               f"{n} tokens, got {blocks!r:.60}")
        blocks = tuple(blocks)
    if bidirectional + (frame is not None) + (blocks is not None) > 1:
        raise RequestError(f"node '{node}': options bidirectional, blocks and frame_size are exclusive; pick one mask")
    label = opts.get("cache_label", "main")
    if not isinstance(label, str) or not label:
        raise RequestError(f"node '{node}': option cache_label must be a non-empty string, got {label!r}")
    write = bool(opts.get("write_cache", True))
    reads = _labels(opts.get("read_labels"), "read_labels", node)
    if reads and write:
        raise RequestError(f"node '{node}': option read_labels is for read-only calls (write_cache: False)")
    rows = opts.get("output_rows")
    if rows not in (None, "all", "last"):
        raise RequestError(f"node '{node}': option output_rows must be 'all' or 'last', got {rows!r}")
    steps = opts.get("decode_steps")
    if steps is not None:
        if type(steps) is not int or steps < 1:
            raise RequestError(f"node '{node}': option decode_steps must be a positive int, got {steps!r:.40}")
        if sampling is None or not write or rows is not None or output_index is not None:
            raise RequestError(f"node '{node}': option decode_steps needs a sampling call that writes its cache "
                               "and asks for no per-token outputs")
    cross_label, cross_states = parse_cross(inputs, opts, node, hidden_size)
    return ParsedInvocation(
        ids=ids,
        label=label,
        write_cache=write,
        fork_from=opts.get("fork_from"),
        sampling=sampling,
        embeds=embeds,
        bidirectional=bidirectional,
        frame_size=frame,
        positions=_positions(inputs.get("positions"), n, axes, node),
        routing=routing,
        extras=extras,
        output_index=output_index,
        read_labels=reads or (label,),
        reset=bool(opts.get("reset", False)),
        snapshot_before=_labels(opts.get("snapshot_before"), "snapshot_before", node),
        snapshot_after=_labels(opts.get("snapshot_after"), "snapshot_after", node),
        drop=_labels(opts.get("drop"), "drop", node),
        output_rows=rows,
        seed_offset=offset,
        blocks=blocks,
        decode_steps=steps,
        cross_label=cross_label,
        cross_states=cross_states,
        lora=_adapter_name(inputs.get("lora"), write, node),
    )


def _adapter_name(value: Any, write: bool, node: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(f"node '{node}': input lora must be an adapter's name, got {type(value).__name__}")
    if not write:
        raise RequestError(f"node '{node}': LoRA adapters apply to calls that write their cache label, not to "
                           "read-only calls (write_cache: False)")
    return value


def mask_limits(start: int, count: int, bidirectional: bool, frame_size: int | None,
                blocks: tuple[int, ...] | None = None) -> list[int] | None:
    """Exclusive key-position bounds for tokens `start..start+count-1`; None for plain causal."""
    if bidirectional:
        return [start + count] * count
    if blocks is not None:  # a token sees every earlier block and the whole of its own
        bounds, end = [], start
        for size in blocks:
            end += size
            bounds.extend([end] * size)
        return bounds
    if frame_size is not None:
        return [(p // frame_size + 1) * frame_size for p in range(start, start + count)]
    return None
