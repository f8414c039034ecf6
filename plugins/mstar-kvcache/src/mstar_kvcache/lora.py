"""A `kvcache` node's LoRA adapters: which are loaded, which sequence runs under which, and each step's row groups.

A call names its adapter with the input `lora` (the adapter's name; absent: the base model). A label keeps the
adapter of its first call (its keys and values were computed under it): a later call may repeat the name or leave
it out, not name another. Forks of the label share it. The prefix cache keys a page by its adapter too (the
adapter's load, not only its name: an adapter reloaded under the same name never hits the old one's pages).

The weights and the per-row delta are `mstar_core.nn.lora.LoraBank`'s; this part maps sequences to its slots.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from mstar_core.errors import ConfigError, RequestError
from mstar_core.nn.lora import LoraBank, read_peft_adapter
from mstar_kvcache.sequence import Sequence


class NodeAdapters:
    """The adapters loaded on one node (`load`, `unload`), bound to sequences (`bind`), laid out per step (`begin`).

    `keys[name]` is the loaded adapter's identity (`name#load number`), what a sequence holds in `Sequence.lora`;
    `slots[key]` its slot in the bank. `in_use` says which loaded adapters some live sequence runs under.
    """

    def __init__(self, node: str, module: Any, max_loras: int, max_rank: int, seqs: Any):
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"node '{node}': LoRA adapters need a torch module")
        self.node = node
        self.bank = LoraBank(module, max_loras, max_rank, where=f"node '{node}'")
        self.seqs = seqs  # () -> the node's live sequences (labels and readers), for `in_use`
        self.keys: dict[str, str] = {}
        self.slots: dict[str, int] = {}
        self._loads = itertools.count(1)

    @property
    def max_loras(self) -> int:
        return self.bank.max_loras

    @property
    def max_rank(self) -> int:
        return self.bank.max_rank

    def load(self, name: str, path: str) -> None:
        """Read the PEFT directory at `path` and hold it as `name` (a `ConfigError` naming what does not fit)."""
        if name in self.keys:
            raise ConfigError(f"node '{self.node}': a LoRA adapter named '{name}' is already loaded; unload it first")
        adapter = read_peft_adapter(name, path, max_rank=self.bank.max_rank)
        slot = self.bank.load(adapter)
        key = f"{name}#{next(self._loads)}"
        self.keys[name], self.slots[key] = key, slot

    def unload(self, name: str) -> None:
        """Free `name`'s slot; refused (409) while a live sequence runs under it."""
        key = self.keys.get(name)
        if key is None:
            raise RequestError(f"node '{self.node}': no LoRA adapter named '{name}' is loaded", status=404)
        users = sum(1 for s in self.seqs() if s.lora == key)
        if users:
            raise RequestError(f"node '{self.node}': LoRA adapter '{name}' is in use by {users} sequence(s); "
                               "retry once their requests finish", status=409)
        self.bank.unload(self.slots.pop(key))
        del self.keys[name]

    def bind(self, seq: Sequence, name: str | None) -> None:
        """The sequence a call writes runs under adapter `name` (None: under what it already runs); raises before
        anything changes when the call cannot run there."""
        if name is None:
            return
        key = self.keys.get(name)
        if key is None:
            raise RequestError(f"node '{self.node}': LoRA adapter '{name}' is not loaded; loaded: "
                               f"{sorted(self.keys) or 'none'}", status=404, param="model")
        if seq.lora == key:
            return
        if seq.lora is not None or seq.tokens:
            was = "the base model" if seq.lora is None else f"adapter '{seq.lora.rsplit('#', 1)[0]}'"
            raise RequestError(f"node '{self.node}': cache label '{seq.label}' was computed under {was}; a call "
                               f"cannot continue it under adapter '{name}'")
        seq.lora = key

    def begin(self, work: list[tuple[Sequence, int]]) -> bool:
        """Lay out the step's rows by adapter; whether the step must run eagerly (adapter rows whose deltas are torch
        ops, which a replayed step would skip: see `LoraBank`)."""
        if not self.slots:
            return False  # (no adapter loaded: no hook on any linear)
        runs = []
        for seq, n in work:
            slot = None if seq.lora is None else self.slots.get(seq.lora)
            if seq.lora is not None and slot is None:  # (unloaded as it bound: `_run` retries rows alone)
                raise RequestError(f"node '{self.node}': LoRA adapter '{seq.lora.rsplit('#', 1)[0]}' was unloaded")
            runs.append((slot, n))
        self.bank.set_rows(runs)
        return self.bank.needs_eager

    @property
    def has_rows(self) -> bool:
        return self.bank.has_rows

    def end(self) -> None:
        self.bank.clear_rows()

    def stats(self) -> dict[str, float]:
        return {"lora_adapters": len(self.keys), "max_loras": self.bank.max_loras}
