"""LoRA adapters over a module's linears: PEFT adapter directories read, several held at once, mixed per row.

An adapter adds a low-rank delta to some linears: `y = x W^T + scale * (x A^T) B^T`, `A` `[r, in]`, `B` `[out, r]`,
`scale = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`). PEFT saves it as a directory:
`adapter_config.json` (`r`, `lora_alpha`, `target_modules`, ...) and `adapter_model.safetensors` with keys
`base_model.model.<linear's name>.lora_A.weight` / `.lora_B.weight`, the linear's name as in the base checkpoint
(`model.layers.0.self_attn.q_proj`).

`LoraBank` owns up to `max_loras` adapter slots over one module. Each linear an adapter may target gets a
`LoraLayer`: every slot's `A` and `B` (scale folded into `B`) stacked, zero where a slot does not target it. A
linear the module fuses from several checkpoint linears (`qkv_proj` from `q_proj`, `k_proj`, `v_proj`: see
`mstar_core.nn.fused`) takes each part's adapter side by side: the parts' `A`s stacked along the rank and their
`B`s block-diagonal, so one low-rank product gives every part its own delta.

Rows of different adapters (and none) run in one forward: the caller says which rows belong to which slot
(`set_rows`) before it, and each targeted linear adds, per slot present, the delta of that slot's rows (a
segmented low-rank matmul: a slice where a slot's rows are contiguous, gathered rows where not). The delta is
added by a forward hook on the linear, after whatever kernel ran it (packed, quantized), so the module's own
code and `state_dict` are unchanged. A step that replays recorded kernels (`mstar_core.nn.tape`) would skip the
hooks: `has_rows` says whether the current step needs them, and an engine must run such a step eagerly.
"""

from __future__ import annotations

import collections
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from mstar_core.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: PEFT's prefix of every saved key (its wrapper `base_model`, then the wrapped model's `model`)
PEFT_PREFIX = "base_model.model."
#: Linears that run outside the module's forward (the engines call `compute_logits` after it): never targets, since
#: a step's rows are laid out for the forward alone (PEFT's "all-linear" leaves the LM head out too)
OUTSIDE_FORWARD = frozenset({"lm_head"})
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
#: PEFT config values this reader cannot apply: a clear refusal beats a silently different model
_UNSUPPORTED = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "modules_to_save": (None, []),
    "layers_to_transform": (None, []),
    "bias": ("none", None),
}


@attrs.frozen
class LoraPair:
    """One targeted linear's `A` `[r, in]` and `B` `[out, r]` (scale not applied) and its scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@attrs.frozen
class LoraAdapter:
    """A PEFT adapter read from `path`: its pairs by the base checkpoint's linear name (`model.layers.0.self_attn.q_proj`)."""

    name: str
    path: str
    pairs: Mapping[str, LoraPair]
    target_modules: tuple[str, ...] | str

    @property
    def rank(self) -> int:
        return max(p.rank for p in self.pairs.values())


def _refuse(path: Path, message: str) -> ConfigError:
    return ConfigError(f"LoRA adapter {str(path)!r}: {message}")


def read_peft_adapter(name: str, path: str | Path, *, max_rank: int | None = None) -> LoraAdapter:
    """Read a PEFT LoRA directory; a `ConfigError` naming the directory and what is wrong otherwise."""
    directory = Path(path)
    if not directory.is_dir():
        raise _refuse(directory, "is not a directory (a PEFT adapter is a directory with adapter_config.json and "
                                 "adapter_model.safetensors)")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise _refuse(directory, f"missing file {CONFIG_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise _refuse(directory, f"{CONFIG_FILE} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise _refuse(directory, f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(directory, f"{CONFIG_FILE}: peft_type is {config.get('peft_type')!r}; only LORA adapters load")
    for key, allowed in _UNSUPPORTED.items():
        if key in config and config[key] not in allowed:
            raise _refuse(directory, f"{CONFIG_FILE}: {key}={config[key]!r} is not supported (allowed: "
                                     f"{[a for a in allowed if a is not None] or 'null'})")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _refuse(directory, f"{CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise _refuse(directory, f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    rslora = bool(config.get("use_rslora", False))
    targets = config.get("target_modules")
    if isinstance(targets, list) and all(isinstance(t, str) for t in targets) and targets:
        targets = tuple(targets)
    elif not isinstance(targets, str) or not targets:
        raise _refuse(directory, f"{CONFIG_FILE}: target_modules must be a list of module names or a regex, "
                                 f"got {targets!r}")
    alpha_pattern = config.get("alpha_pattern") or {}
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        pickled = [p.name for p in directory.glob("adapter_model.bin")]
        hint = " (adapter_model.bin is a pickle, which M* does not load: re-save it with safetensors)" if pickled else ""
        raise _refuse(directory, f"missing file {WEIGHTS_FILE}{hint}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise _refuse(directory, f"{WEIGHTS_FILE} cannot be read: {exc}") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or not key.startswith(PEFT_PREFIX):
            raise _refuse(directory, f"{WEIGHTS_FILE}: tensor {key!r} is not a LoRA A/B weight "
                                     f"('{PEFT_PREFIX}<module>.lora_A.weight'); embedding LoRA, DoRA and saved "
                                     "modules are not supported")
        module = match["module"][len(PEFT_PREFIX):]
        halves.setdefault(module, {})[match["which"]] = tensor
    pairs: dict[str, LoraPair] = {}
    for module, half in sorted(halves.items()):
        if set(half) != {"A", "B"}:
            missing = "lora_B" if "A" in half else "lora_A"
            raise _refuse(directory, f"{WEIGHTS_FILE}: {module} has no {missing} weight")
        a, b = half["A"], half["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _refuse(directory, f"{WEIGHTS_FILE}: {module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} "
                                     "are not [r, in] and [out, r]")
        r = int(a.shape[0])
        if max_rank is not None and r > max_rank:
            raise _refuse(directory, f"rank {r} of {module} is over this server's max_lora_rank {max_rank}; "
                                     "raise max_lora_rank or serve a lower-rank adapter")
        module_alpha = _pattern_value(alpha_pattern, module, alpha)
        scale = module_alpha / math.sqrt(r) if rslora else module_alpha / r
        pairs[module] = LoraPair(a.contiguous(), b.contiguous(), float(scale))
    if not pairs:
        raise _refuse(directory, f"{WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(name, str(directory), pairs, targets)


def _pattern_value(pattern: Mapping[str, Any], module: str, default: float) -> float:
    """PEFT's per-module override: a key matching the end of the module's name (`re.match(rf".*\\.{key}$")`)."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return float(value)
    return float(default)


@attrs.define(eq=False)
class _Part:
    """Where a checkpoint linear lives: output rows `lo:lo+rows` of `layer`'s linear, rank block `block`."""

    layer: LoraLayer
    lo: int
    rows: int
    block: int


class LoraLayer:
    """One linear's adapter slots: `a` `[slots, parts * max_rank, in]`, `b` `[slots, parts * max_rank, out]`.

    Part `k` of a fused linear uses rank columns `k * max_rank` on; `cols[slot]` is the width a slot uses (0: the
    slot does not target this linear). Allocated when an adapter first targets the linear.
    """

    def __init__(self, bank: LoraBank, linear: nn.Module, parts: int):
        self.bank, self.parts = bank, parts
        self.in_features, self.out_features = int(linear.in_features), int(linear.out_features)
        weight = linear.weight
        self.dtype, self.device = weight.dtype, weight.device
        if not self.dtype.is_floating_point:  # a quantized weight: the delta runs in the activations' float type
            self.dtype = torch.float32
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.cols = [0] * bank.max_loras
        self.linear = linear
        self.handle: Any = None  # the forward hook, on the linear while some slot targets it (none costs nothing)

    def write(self, slot: int, part: _Part, pair: LoraPair) -> None:
        if self.a is None:
            width = self.parts * self.bank.max_rank
            self.a = torch.zeros(self.bank.max_loras, width, self.in_features, dtype=self.dtype, device=self.device)
            self.b = torch.zeros(self.bank.max_loras, width, self.out_features, dtype=self.dtype, device=self.device)
        lo, r = part.block * self.bank.max_rank, pair.rank
        if self.handle is None:
            self.handle = self.linear.register_forward_hook(self)
        with torch.no_grad():
            self.a[slot, lo : lo + r] = pair.a.to(self.a)
            # B^T with the scale folded in, in this part's output rows (the rest of the block stays zero)
            self.b[slot, lo : lo + r, part.lo : part.lo + part.rows] = (pair.b.to(torch.float32) * pair.scale).T.to(self.b)
        self.cols[slot] = max(self.cols[slot], lo + r)

    def clear(self, slot: int) -> None:
        if self.a is not None and self.cols[slot]:
            with torch.no_grad():
                self.a[slot].zero_()
                self.b[slot].zero_()
        self.cols[slot] = 0
        if self.handle is not None and not any(self.cols):
            self.handle.remove()
            self.handle = None

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        groups = self.bank.groups
        if not groups or self.a is None:
            return
        x = args[0]
        x2 = x.reshape(-1, self.in_features)
        y2 = out.view(-1, self.out_features)  # (the linear's own fresh output: the delta is added in place)
        for slot, rows in groups:
            width = self.cols[slot]
            if not width:
                continue
            a, b = self.a[slot, :width], self.b[slot, :width]
            if isinstance(rows, slice):
                y2[rows].addmm_(torch.mm(x2[rows].to(a.dtype), a.T).to(b.dtype), b.to(y2.dtype))
            else:
                low = torch.mm(x2.index_select(0, rows).to(a.dtype), a.T)
                y2.index_add_(0, rows, torch.mm(low, b).to(y2.dtype))


def linear_targets(module: nn.Module) -> dict[str, tuple[str, nn.Module, int, int, int]]:
    """The module's linears an adapter may target, by checkpoint name: `(attribute path, linear, lo, rows, part)`.

    A fused linear lists each checkpoint part (`...self_attn.q_proj` as rows of `...self_attn.qkv_proj`).
    """
    out: dict[str, tuple[str, nn.Module, int, int, int]] = {}
    for owner_name, owner in module.named_modules():
        parts = getattr(owner, "checkpoint_parts", {})
        part_rows = getattr(owner, "checkpoint_part_rows", {})
        for child_name, child in owner.named_children():
            if not (hasattr(child, "in_features") and hasattr(child, "out_features") and hasattr(child, "weight")):
                continue
            path = f"{owner_name}.{child_name}" if owner_name else child_name
            prefix = f"{owner_name}." if owner_name else ""
            if child_name in parts and child_name in part_rows:
                lo = 0
                for k, (part, rows) in enumerate(zip(parts[child_name], part_rows[child_name], strict=True)):
                    out[prefix + part] = (path, child, lo, rows, k)
                    lo += rows
            else:
                out[path] = (path, child, 0, int(child.out_features), 0)
    return out


class LoraBank:
    """Up to `max_loras` adapters of rank up to `max_rank` over `module`'s linears, and the current step's rows.

    `slots[i]` is the adapter in slot `i` (None: free). `groups` is the current step's `(slot, rows)` list (rows a
    slice or an index tensor), empty between steps and on steps with no adapter rows.
    """

    def __init__(self, module: nn.Module, max_loras: int, max_rank: int, *, where: str = "module"):
        for key, value in (("max_loras", max_loras), ("max_lora_rank", max_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        self.max_loras, self.max_rank, self.where = max_loras, max_rank, where
        self.slots: list[LoraAdapter | None] = [None] * max_loras
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.parts: dict[str, _Part] = {}
        layers: dict[str, LoraLayer] = {}
        device = None
        targets = linear_targets(module)
        parts_of = collections.Counter(path for path, *_ in targets.values())
        for name, (path, linear, lo, rows, block) in targets.items():
            if path.rsplit(".", 1)[-1] in OUTSIDE_FORWARD:
                continue
            if path not in layers:
                layers[path] = LoraLayer(self, linear, parts_of[path])
            self.parts[name] = _Part(layers[path], lo, rows, block)
            device = layers[path].device
        self.layers = list(layers.values())
        self.device = device if device is not None else torch.device("cpu")
        if not self.parts:
            raise ConfigError(f"{where}: the module has no linear layers for LoRA adapters to target")
        self._leaves = {n.rsplit(".", 1)[-1] for n in self.parts}

    # -- adapters --------------------------------------------------------------------------------

    def check(self, adapter: LoraAdapter) -> None:
        """Whether `adapter` fits this module: every target and tensor names one of its linears, at its shapes."""
        where = f"LoRA adapter {adapter.path!r}"
        if isinstance(adapter.target_modules, tuple):
            for target in adapter.target_modules:
                if target not in self._leaves and target not in self.parts and target != "all-linear":
                    raise ConfigError(f"{where}: target module {target!r} is not a linear of this model; "
                                      f"its linears: {sorted(self._leaves)}")
        for name, pair in adapter.pairs.items():
            part = self.parts.get(name)
            if part is None:
                raise ConfigError(f"{where}: weights for {name!r}, which is not a linear of this model "
                                  f"(its linears are named like {next(iter(self.parts))!r})")
            if pair.rank > self.max_rank:
                raise ConfigError(f"{where}: rank {pair.rank} of {name} is over max_lora_rank {self.max_rank}")
            want_a, want_b = (pair.rank, part.layer.in_features), (part.rows, pair.rank)
            if tuple(pair.a.shape) != want_a or tuple(pair.b.shape) != want_b:
                raise ConfigError(f"{where}: {name}: lora_A {list(pair.a.shape)} / lora_B {list(pair.b.shape)}, "
                                  f"this model needs {list(want_a)} / {list(want_b)} (an adapter of another model?)")

    def load(self, adapter: LoraAdapter) -> int:
        """Put `adapter` in a free slot; its slot index."""
        self.check(adapter)
        free = next((i for i, a in enumerate(self.slots) if a is None), None)
        if free is None:
            raise ConfigError(f"{self.where}: all {self.max_loras} LoRA slots are taken (max_loras); unload one first")
        for name, pair in adapter.pairs.items():
            part = self.parts[name]
            part.layer.write(free, part, pair)
        self.slots[free] = adapter
        return free

    def unload(self, slot: int) -> None:
        for layer in self.layers:
            layer.clear(slot)
        self.slots[slot] = None

    def slot_of(self, name: str) -> int | None:
        return next((i for i, a in enumerate(self.slots) if a is not None and a.name == name), None)

    # -- one step's rows -------------------------------------------------------------------------

    def set_rows(self, runs: Sequence[tuple[int | None, int]]) -> None:
        """The step's rows as consecutive runs `(slot or None, row count)`, in order."""
        spans: dict[int, list[tuple[int, int]]] = {}
        row = 0
        for slot, n in runs:
            if slot is not None:
                found = spans.setdefault(slot, [])
                if found and found[-1][1] == row:
                    found[-1] = (found[-1][0], row + n)
                else:
                    found.append((row, row + n))
            row += n
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, found in spans.items():
            if len(found) == 1:
                groups.append((slot, slice(*found[0])))
            else:
                index = [r for lo, hi in found for r in range(lo, hi)]
                groups.append((slot, torch.tensor(index, dtype=torch.long, device=self.device)))
        self.groups = groups

    @property
    def has_rows(self) -> bool:
        """Whether the current step has adapter rows (its linears' hooks add deltas: a replay would drop them)."""
        return bool(self.groups)

    def clear_rows(self) -> None:
        self.groups = []

    def close(self) -> None:
        """Remove the hooks (the module runs as it did before)."""
        for layer in self.layers:
            if layer.handle is not None:
                layer.handle.remove()
                layer.handle = None
        self.layers, self.parts = [], {}

