"""Replayed decode steps: a CPU step's layers recorded once per batch layout, then run from C (`mstar_core.nn.tape`).

On a CPU, a small model's decode step is mostly Python around its kernels: SmolLM2-135M in bf16 spends ~4.5 ms
of a ~7.8 ms step in its 121 linears and most of the rest in module calls, checks, allocations and ctypes calls
(~330 a step). A step whose attention is the lane kernel alone (every row decodes in a lane, see
`mstar_attn_torch`) does the same calls on the same shapes every time, so the first such step of each row count
is recorded as it runs, and later ones copy their inputs into the recorded ones (embeddings, rotary tables,
each row's lane, position and slot) and replay the calls. The replay is the recorded step: the same kernels on
the same sizes give the same bits (tested against eager steps).

A module takes part by splitting its forward into `layer_inputs(ids, positions)` (computed every step),
`run_layers(inputs, context)` (recorded) and optionally `layer_outputs(hidden, inputs)` (run after a replay, e.g. to
append a column); one that does not, or whose layers run a torch op that computes (recording notes it), runs every
step as before.
"""

from __future__ import annotations

import logging
import operator
from collections import OrderedDict
from typing import Any

import torch

from mstar_core.nn import tape as tapes
from mstar_core.nn.packed import PackedLinear

log = logging.getLogger("mstar.kvcache.replay")

#: Recorded layouts kept per engine (least recently used dropped first), and the bytes their buffers may hold
MAX_PROGRAMS = 16
MAX_PROGRAM_BYTES = 512 << 20
#: Row counts refused, with none recorded, after which an engine stops recording
MAX_REFUSALS = 4


def _splits_forward(module: Any) -> bool:
    """Whether the class that defines `module`'s forward defines `layer_inputs` and `run_layers` with it.

    (A subclass that overrides `forward` alone no longer runs as its parent's split says: it opts out.)
    """
    for owner in type(module).__mro__:
        if "forward" in vars(owner):
            return "layer_inputs" in vars(owner) and "run_layers" in vars(owner)
    return False


class _Program:
    """One recorded step: its tape, the tensors it read its inputs from, its output, and the weights it assumed."""

    def __init__(self, tape: tapes.Tape, inputs: tuple[torch.Tensor, ...], output: torch.Tensor, context: Any,
                 module: torch.nn.Module):
        self.tape, self.inputs, self.output = tape, inputs, output
        self.context = context  # (holds the lane plan the recorded attention calls point at)
        self.nbytes = tape.nbytes()
        # a replay trusts the weights as recorded: every parameter the same tensor, unchanged in place, and every
        # packed linear's pack the one it ran (load_state_dict or a repack sends the step back to a recording)
        self.places = [(owner._parameters, name) for owner in module.modules()
                       for name, param in owner._parameters.items() if param is not None]
        self.params = [params[name] for params, name in self.places]
        self.versions = [param._version for param in self.params]
        self.packs = [(layer, layer._fast) for layer in module.modules() if isinstance(layer, PackedLinear)]

    def current(self) -> bool:
        """Whether the weights are still those recorded (~20 us for SmolLM2's 272 parameters)."""
        return ([param._version for param in self.params] == self.versions
                and all(map(operator.is_, [params.get(name) for params, name in self.places], self.params))
                and all(layer._fast is fast for layer, fast in self.packs))

    def run(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        for recorded, fresh in zip(self.inputs, inputs, strict=True):
            recorded.copy_(fresh)
        self.tape.replay()
        return self.output.clone()  # (the next replay overwrites the recorded output)


class StepReplay:
    """An engine's recorded decode steps, one per row count over the current lane storage."""

    def __init__(self, module: Any, node: str):
        self.module, self.node = module, node
        self.finish = getattr(module, "layer_outputs", None)  # (what forward adds after the layers, if anything)
        self.enabled = True  # False once the layers are known not to replay
        self.programs: OrderedDict[tuple, _Program] = OrderedDict()
        # row counts whose layers ran a torch op while recorded (a kernel may take only so many rows: AMX tiles take
        # up to 32, oneDNN the rest), so they run eagerly; a module none of whose recordings replays stops trying
        self.refused: set[int] = set()
        self.recorded = self.replayed = 0

    @classmethod
    def for_module(cls, module: Any, node: str, device: torch.device) -> StepReplay | None:
        """Replay for `module` on `device`, or None (not a CPU, no split forward, hooks on it, no replay loop here)."""
        if device.type != "cpu" or not _splits_forward(module) or getattr(module, "_forward_hooks", None) \
                or getattr(module, "_forward_pre_hooks", None):
            return None
        return cls(module, node) if tapes.available() else None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, context: Any) -> torch.Tensor | None:
        """The step's final hidden rows, replayed or recorded as they run; None: run this step eagerly."""
        layout = getattr(context, "replay_layout", None) if self.enabled else None
        step = layout() if layout is not None else None
        if step is None:
            return None
        storage, step_tensors = step
        rows = ids.shape[0]
        if rows in self.refused:
            return None
        key = (storage, rows, torch.get_num_threads())
        layer_inputs = self.module.layer_inputs(ids, positions)
        program = self.programs.get(key)
        if program is not None and program.current():
            self.programs.move_to_end(key)
            self.replayed += 1
            hidden = program.run((*layer_inputs, *step_tensors))
        else:
            hidden = self._record(key, layer_inputs, step_tensors, context)
        return hidden if self.finish is None else self.finish(hidden, layer_inputs)

    def _record(self, key: tuple, layer_inputs: tuple[torch.Tensor, ...], step_tensors: tuple[torch.Tensor, ...],
                context: Any) -> torch.Tensor:
        """Run the step's layers eagerly while recording them; keep the recording where it replays."""
        # the recording's own copies: later steps copy into them (a module may hand out views of what it keeps)
        layer_inputs = tuple(t.clone() for t in layer_inputs)
        tape = tapes.Tape()
        with tape.recording():
            hidden = self.module.run_layers(layer_inputs, context)
        if tape.failure is not None:
            rows = key[1]
            if not self.refused:
                log.info("node %s: decode steps of %d rows run eagerly (%s in its layers cannot be replayed)",
                         self.node, rows, tape.failure)
            self.refused.add(rows)
            if not self.recorded and len(self.refused) >= MAX_REFUSALS:
                self.enabled = False
            return hidden
        # recordings over lane storage that has since grown would pin the old storage (up to the pool's size)
        for stale in [k for k in self.programs if k[0] != key[0]]:
            del self.programs[stale]
        self.programs[key] = _Program(tape, (*layer_inputs, *step_tensors), hidden, context, self.module)
        self.recorded += 1
        while len(self.programs) > MAX_PROGRAMS or (
                len(self.programs) > 1 and sum(p.nbytes for p in self.programs.values()) > MAX_PROGRAM_BYTES):
            self.programs.popitem(last=False)
        return hidden.clone()
