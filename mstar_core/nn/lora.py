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
(`set_rows`) before it, and each targeted linear adds each row's delta under its slot (a segmented low-rank
matmul). The delta is added by a forward hook on the linear, after whatever kernel ran it (packed or not), so the
module's own code and `state_dict` are unchanged. On a CPU the hook is one call of `lora.cpp` per linear for every
slot at once, reading the rows' slots from a buffer; a step that replays recorded kernels (`mstar_core.nn.tape`)
replays those calls too, and loading or unloading an adapter makes recordings stale (`weights_changed`). Elsewhere
(no kernel built, a GPU) the deltas are torch ops per slot (a slice where a slot's rows are contiguous, gathered
rows where not), which a replay would skip: `needs_eager` says when a step must run eagerly.
"""

from __future__ import annotations

import collections
import ctypes
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
from mstar_core.nn.replayable import weights_changed

CONFIG_FILE = "adapter_config.json"
#: The largest rank a slot may hold (`lora.cpp`'s MAX_RANK)
MAX_RANK = 1024
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
    try:
        is_dir = directory.is_dir()
    except (OSError, ValueError):  # a name too long for the file system, a NUL
        is_dir = False
    if not is_dir:
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

    Part `k` of a fused linear uses rank rows `k * max_rank` on, for outputs `bounds[k]` (`(lo, rows)`);
    `cols[slot][k]` is slot's rank for part k (0: it does not target it), mirrored in the int64 tensors the kernel
    reads. Allocated, and the forward hook registered, when an adapter first targets the linear; the hook goes
    when no slot targets it any more.
    """

    def __init__(self, bank: LoraBank, linear: nn.Module, parts: int):
        self.bank, self.parts, self.linear = bank, parts, linear
        self.in_features, self.out_features = int(linear.in_features), int(linear.out_features)
        weight = linear.weight
        self.dtype, self.device = weight.dtype, weight.device
        if not self.dtype.is_floating_point:  # a quantized weight: the delta runs in the activations' float type
            self.dtype = torch.float32
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None
        self.cols = [[0] * parts for _ in range(bank.max_loras)]
        self.cols_tensor = torch.zeros(bank.max_loras * parts, dtype=torch.int64)  # (what the kernel reads)
        self.bounds = torch.zeros(2 * parts, dtype=torch.int64)
        self.handle: Any = None
        self.kernel = _kernel(self.dtype) if self.device.type == "cpu" else None
        self._dims: dict[tuple, torch.Tensor] = {}  # the kernel's sizes per call shape (recorded steps point at them)

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
        self.cols[slot][part.block] = r
        _write_int64(self.cols_tensor, [c for row in self.cols for c in row])

    def set_bounds(self, part: _Part) -> None:
        values = self.bounds.tolist()
        values[2 * part.block : 2 * part.block + 2] = [part.lo, part.rows]
        _write_int64(self.bounds, values)

    def width(self, slot: int) -> int:
        """The rank rows slot's parts span (0: the slot does not target this linear)."""
        return max((k * self.bank.max_rank + c for k, c in enumerate(self.cols[slot]) if c), default=0)

    def clear(self, slot: int) -> None:
        if self.a is not None and any(self.cols[slot]):
            with torch.no_grad():
                self.a[slot].zero_()
                self.b[slot].zero_()
        self.cols[slot] = [0] * self.parts
        _write_int64(self.cols_tensor, [c for row in self.cols for c in row])
        if self.handle is not None and not any(any(row) for row in self.cols):
            self.handle.remove()
            self.handle = None

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        bank = self.bank
        if not bank.active or self.a is None or torch.compiler.is_compiling():
            return
        x = args[0]
        x2 = x.reshape(-1, self.in_features)
        y2 = out.view(-1, self.out_features)  # (the linear's own fresh output: the delta is added in place)
        if bank.native:
            self._run_kernel(x2, y2)
            return
        for slot, rows in bank.groups:
            width = self.width(slot)
            if not width:
                continue
            a, b = self.a[slot, :width], self.b[slot, :width]
            if isinstance(rows, slice):
                y2[rows].addmm_(torch.mm(x2[rows].to(a.dtype), a.T).to(b.dtype), b.to(y2.dtype))
            else:
                low = torch.mm(x2.index_select(0, rows).to(a.dtype), a.T)
                y2.index_add_(0, rows, torch.mm(low, b).to(y2.dtype))

    def _run_kernel(self, x: torch.Tensor, y: torch.Tensor) -> None:
        from mstar_core.nn import native

        if x.stride(-1) != 1 or x.dtype is not self.dtype:  # (a torch op: a recording notes it and runs eagerly)
            x = x.contiguous().to(self.dtype)
        rows = x.shape[0]
        key = (rows, x.stride(0), y.stride(0), torch.get_num_threads())
        dims = self._dims.get(key)
        if dims is None:  # fixed per call shape, so a recorded call's sizes stay valid for its replays
            dims = self._dims[key] = torch.empty(9, dtype=torch.int64)
            _write_int64(dims, [rows, self.in_features, self.out_features, key[1], key[2], self.bank.max_rank,
                                self.bank.max_loras, self.parts, key[3]])
        args = (x.data_ptr(), y.data_ptr(), self.a.data_ptr(), self.b.data_ptr(), self.bank.row_slots.data_ptr(),
                self.cols_tensor.data_ptr(), dims.data_ptr(), self.bounds.data_ptr(), None)
        if self.kernel(*args):
            raise RuntimeError(f"the LoRA kernel refused the call (a rank over its {MAX_RANK})")
        if native.RECORDER is not None:  # (a tape recording this thread's kernel calls, see tape.py)
            native.RECORDER.record(self.kernel, args)


def _write_int64(tensor: torch.Tensor, values: Sequence[int]) -> None:
    """Write into an int64 CPU tensor without a torch op (a tape recording a step would note one)."""
    buffer = (ctypes.c_int64 * len(values))(*values)
    ctypes.memmove(tensor.data_ptr(), buffer, 8 * len(values))


SOURCE = Path(__file__).with_name("lora.cpp")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _kernel(dtype: torch.dtype):
    """`lora.cpp`'s entry point for `dtype` (None: not a kernel dtype, or no kernel built here: torch ops then)."""
    from mstar_core.nn import native

    if dtype not in _SUFFIX:
        return None
    return native.function(SOURCE, f"mstar_lora_delta_{_SUFFIX[dtype]}", [ctypes.c_void_p] * 9, ctypes.c_int)


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

    `slots[i]` is the adapter in slot `i` (None: free). While a step runs (`set_rows` .. `clear_rows`) `active` is
    set: the hooks add deltas. With the kernel (`native`: every targeted linear is fp32 or bf16 on a CPU that has
    `lora.cpp` built) every linear an adapter targets makes one kernel call per step, reading each row's slot from
    `row_slots` (-1: the base), so a recorded step replays correctly whatever the next step's rows are. Without it,
    `groups` lists the step's `(slot, rows)` (a slice or an index tensor) and the deltas are torch ops, which a
    replay would skip: `needs_eager` says when a step must run eagerly.
    """

    def __init__(self, module: nn.Module, max_loras: int, max_rank: int, *, where: str = "module"):
        for key, value in (("max_loras", max_loras), ("max_lora_rank", max_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        if max_rank > MAX_RANK:
            raise ConfigError(f"{where}: max_lora_rank {max_rank} is over the largest supported, {MAX_RANK}")
        self.max_loras, self.max_rank, self.where, self.module = max_loras, max_rank, where, module
        self.slots: list[LoraAdapter | None] = [None] * max_loras
        self.groups: list[tuple[int, slice | torch.Tensor | None]] = []
        self.active = False
        self.row_slots = torch.full((256,), -1, dtype=torch.int64)  # (grown on demand: recordings point at it)
        self.parts: dict[str, _Part] = {}
        layers: dict[str, LoraLayer] = {}
        device = None
        # a module may say which of its linears run in its forward (`lora_scope`: attribute-path prefixes; others run
        # in other nodes, where no step's rows are laid out) and under which prefix its checkpoint names them
        scope = tuple(getattr(module, "lora_scope", ()) or ())
        self.prefix = str(getattr(module, "checkpoint_prefix", "") or "")
        targets = {n: t for n, t in linear_targets(module).items() if not scope or n.startswith(scope)}
        parts_of = collections.Counter(path for path, *_ in targets.values())
        for name, (path, linear, lo, rows, block) in targets.items():
            if path.rsplit(".", 1)[-1] in OUTSIDE_FORWARD:
                continue
            if path not in layers:
                layers[path] = LoraLayer(self, linear, parts_of[path])
            self.parts[name] = part = _Part(layers[path], lo, rows, block)
            part.layer.set_bounds(part)
            device = layers[path].device
        self.layers = list(layers.values())
        self.device = device if device is not None else torch.device("cpu")
        self.native = bool(self.layers) and all(layer.kernel is not None for layer in self.layers)
        if not self.parts:
            raise ConfigError(f"{where}: the module has no linear layers for LoRA adapters to target")
        self._leaves = {n.rsplit(".", 1)[-1] for n in self.parts}

    # -- adapters --------------------------------------------------------------------------------

    def _name(self, name: str) -> str:
        """An adapter's module name as this module's own (the checkpoint's prefix of the module dropped)."""
        return name[len(self.prefix):] if self.prefix and name.startswith(self.prefix) else name

    def check(self, adapter: LoraAdapter) -> None:
        """Whether `adapter` fits this module: every target and tensor names one of its linears, at its shapes."""
        where = f"LoRA adapter {adapter.path!r}"
        if isinstance(adapter.target_modules, tuple):
            for target in adapter.target_modules:
                if (target not in self._leaves and self._name(target) not in self.parts
                        and target != "all-linear"):
                    raise ConfigError(f"{where}: target module {target!r} is not a linear of this model; "
                                      f"its linears: {sorted(self._leaves)}")
        for name, pair in adapter.pairs.items():
            part = self.parts.get(self._name(name))
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
            part = self.parts[self._name(name)]
            part.layer.write(free, part, pair)
        self.slots[free] = adapter
        weights_changed(self.module)  # recorded steps re-record, with this adapter's kernel calls
        return free

    def unload(self, slot: int) -> None:
        for layer in self.layers:
            layer.clear(slot)
        self.slots[slot] = None
        weights_changed(self.module)

    def slot_of(self, name: str) -> int | None:
        return next((i for i, a in enumerate(self.slots) if a is not None and a.name == name), None)

    # -- one step's rows -------------------------------------------------------------------------

    def set_rows(self, runs: Sequence[tuple[int | None, int]]) -> None:
        """The step's rows as consecutive runs `(slot or None, row count)`, in order (the step starts: `active`)."""
        self.active = any(a is not None for a in self.slots)
        total = sum(n for _, n in runs)
        if total > self.row_slots.shape[0]:  # a new buffer: recordings pointing at the old one re-record
            self.row_slots = torch.full((max(total, 2 * self.row_slots.shape[0]),), -1, dtype=torch.int64)
            weights_changed(self.module)
        _write_int64(self.row_slots, [-1 if slot is None else slot for slot, n in runs for _ in range(n)])
        if self.native:
            self.groups = [(slot, None) for slot in dict.fromkeys(s for s, _ in runs if s is not None)]
            return
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
        """Whether the current step has adapter rows."""
        return bool(self.groups)

    @property
    def needs_eager(self) -> bool:
        """Whether the current step must run eagerly: adapter rows whose deltas are torch ops (no kernel), which a
        replayed step would skip."""
        return self.has_rows and not self.native

    def clear_rows(self) -> None:
        self.groups = []
        self.active = False

    def close(self) -> None:
        """Remove the hooks (the module runs as it did before)."""
        for layer in self.layers:
            if layer.handle is not None:
                layer.handle.remove()
                layer.handle = None
        self.layers, self.parts = [], {}

