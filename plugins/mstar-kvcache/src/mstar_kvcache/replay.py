"""Replayed decode steps: a CPU step's layers recorded once per batch layout, then run from C (`mstar_core.nn.tape`).

On a CPU, a small model's decode step is mostly Python around its kernels: SmolLM2-135M in bf16 spends ~4.5 ms
of a ~7.8 ms step in its 121 linears and most of the rest in module calls, checks, allocations and ctypes calls
(~330 a step). A step whose attention is the lane kernel alone (every row decodes in a lane, see
`mstar_attn_torch`) does the same calls on the same shapes every time, so the first such step of each row count
is recorded as it runs, and later ones copy their inputs into the recorded ones (embeddings, rotary tables,
each row's lane, position and slot) and replay the calls. The replay is the recorded step: the same kernels on
the same sizes give the same bits (tested against eager steps).

A context whose other calls read per-step tensors adds them to its layout (`replay_layout()` -> `(storage, tensors)`
or `(storage, tensors, shape)`, `shape` what else a recording is made for: Whisper's cross-attention context adds its
plan's span table and pages, and each span's rows and frames as the shape).

A module takes part by splitting its forward into `layer_inputs(ids, positions)` (computed every step),
`run_layers(inputs, context)` (recorded) and optionally `layer_outputs(hidden, inputs)` (run after a replay, e.g. to
append a column); one that does not, or whose layers run a torch op that computes (recording notes it), runs every
step as before. What a replay assumes of the module it asks `mstar_core.nn.replayable`: whether calling the module
runs that split alone (no hooks, no subclass overriding `forward` alone), and its weights' generation, which moves
when its weights may have changed (a recording made under another generation records again).

An engine that samples every row of such a step also has the module's `compute_logits` recorded over the recorded
hidden rows, as a second tape replayed right after the layers': the LM head runs with no Python between it and the
last layer, into a buffer the step's sampler reads (`logits`). A head that does not record (a torch op: an unpacked
or vocabulary-split head) leaves the layers' replay as it was and is computed after the step. A step whose rows are
all greedy (the engine says so: `forward(..., greedy=True)`) also replays each row's argmax over those logits
(`mstar_core.nn.logits.greedy_tokens`, a third tape recorded the first time a step asks), into `tokens`: after a
replay has streamed every weight through the caches, the sampler's Python around that one kernel cost as much as the
kernel's own pass over the row.

A replayed step's final hidden rows are the recording's buffer, which the next replay overwrites: `forward` hands out
a copy unless the caller says it reads them only before the next step (`keep=False`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from mstar_core.nn import tape as tapes
from mstar_core.nn.logits import greedy_tokens
from mstar_core.nn.replayable import WeightsGeneration, splits_forward, weights_generation

log = logging.getLogger("mstar.kvcache.replay")

#: Recorded layouts kept per engine (least recently used dropped first), and the bytes their buffers may hold
MAX_PROGRAMS = 16
MAX_PROGRAM_BYTES = 512 << 20
#: Row counts refused, with none recorded, after which an engine stops recording
MAX_REFUSALS = 4


class _Program:
    """One recorded step: its tape, the tensors it read its inputs from, its output, and the weights it assumed."""

    def __init__(self, tape: tapes.Tape, inputs: tuple[torch.Tensor, ...], output: torch.Tensor, context: Any,
                 weights: WeightsGeneration, head: tuple[tapes.Tape, torch.Tensor] | None = None):
        self.tape, self.inputs, self.output = tape, inputs, output
        self.head = head  # (the LM head's tape over `output`, the logits it writes), where recorded
        # (the argmax's tape over the head's logits, the tokens it writes): recorded when a greedy step first asks;
        # False where it does not record (no kernel built here)
        self.tokens: tuple[tapes.Tape, torch.Tensor] | None | bool = None
        self.context = context  # (holds the lane plan the recorded attention calls point at)
        self.nbytes = tape.nbytes() + (head[0].nbytes() if head is not None else 0)
        # a replay trusts the weights as recorded: loading weights, assigning a parameter or repacking a packed
        # linear moves the module's generation, which sends the step back to a recording
        self.weights, self.generation = weights, weights.value

    def current(self) -> bool:
        """Whether the weights are still those recorded."""
        return self.weights.value == self.generation

    def run(self, inputs: tuple[torch.Tensor, ...], keep: bool = True, greedy: bool = False) -> torch.Tensor:
        """The step's hidden rows (`keep`: a copy; else the recorded buffer); the head's logits and, with `greedy`,
        their argmax are in `head` and `tokens` after it."""
        for recorded, fresh in zip(self.inputs, inputs, strict=True):
            recorded.copy_(fresh)
        self.tape.replay()
        if self.head is not None:
            self.head[0].replay()
            if greedy:
                if self.tokens is None:
                    self.tokens = self._record_tokens()
                elif self.tokens:
                    self.tokens[0].replay()
        return self.output.clone() if keep else self.output  # (the next replay overwrites the recorded output)

    def _record_tokens(self) -> tuple[tapes.Tape, torch.Tensor] | bool:
        """Each row's argmax over the head's logits, recorded as it runs (over this step's logits); False where it
        does not record."""
        tape = tapes.Tape()
        with tape.recording():
            tokens = greedy_tokens(self.head[1])
        if tokens is None or tape.failure is not None:
            return False
        return tape, tokens


class StepReplay:
    """An engine's recorded decode steps, one per row count over the current lane storage."""

    def __init__(self, module: Any, node: str, logits: bool = False):
        self.module, self.node = module, node
        # record the LM head after the layers (the engine samples every row of a replayed step); the logits of the
        # step just run when it did: the recorded buffer, which the next replay overwrites
        self.heads = logits and getattr(module, "compute_logits", None) is not None
        self.logits: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None  # each row's argmax over `logits`, where a greedy step asked for them
        self.head_refused = False  # a recording's head ran a torch op (logged once)
        self.weights = weights_generation(module)  # moves whenever the module's weights may have changed
        self.finish = getattr(module, "layer_outputs", None)  # (what forward adds after the layers, if anything)
        self.enabled = True  # False once the layers are known not to replay
        self.programs: OrderedDict[tuple, _Program] = OrderedDict()
        # row counts whose layers ran a torch op while recorded (a kernel may take only so many rows: AMX tiles take
        # up to 32, oneDNN the rest), so they run eagerly; a module none of whose recordings replays stops trying
        self.refused: set[int] = set()
        self.recorded = self.replayed = 0

    @classmethod
    def for_module(cls, module: Any, node: str, device: torch.device, logits: bool = False) -> StepReplay | None:
        """Replay for `module` on `device`, or None (not a CPU, no split forward, hooks on it, no replay loop here);
        `logits`: record the LM head too (see the module docstring)."""
        if device.type != "cpu" or not isinstance(module, torch.nn.Module) or not splits_forward(module):
            return None
        if not tapes.available():
            return None
        tapes.warm_recording()  # (while the model loads, not in the first request's step)
        return cls(module, node, logits)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, context: Any, keep: bool = True,
                greedy: bool = False) -> torch.Tensor | None:
        """The step's final hidden rows, replayed or recorded as they run; None: run this step eagerly.

        `keep=False`: the caller reads the rows only before the next step (a replay may hand out its buffer);
        `greedy`: every row takes its argmax, nothing adjusting the logits first (a replay that ran the head puts them
        in `tokens`).
        """
        self.logits = self.tokens = None
        layout = getattr(context, "replay_layout", None) if self.enabled else None
        step = layout() if layout is not None else None
        if step is None:
            return None
        # (storage: what the recorded calls point into, whose change makes every recording stale; then the step's
        # tensors a replay refreshes, and optionally what else fixes their shapes, e.g. a cross plan's spans)
        storage, step_tensors, *shape = step
        rows = ids.shape[0]
        if rows in self.refused:
            return None
        key = (storage, rows, torch.get_num_threads(), *shape)
        layer_inputs = self.module.layer_inputs(ids, positions)
        program = self.programs.get(key)
        if program is not None and program.current():
            self.programs.move_to_end(key)
            self.replayed += 1
            hidden = program.run((*layer_inputs, *step_tensors), keep or self.finish is not None, greedy)
            if program.head is not None:
                self.logits = program.head[1]
                if greedy and program.tokens:
                    self.tokens = program.tokens[1]
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
        head = None
        if self.heads and self.finish is None:
            head_tape, self.logits = self._record_head(hidden)
            head = (head_tape, self.logits) if head_tape is not None else None
        # recordings over lane storage that has since grown would pin the old storage (up to the pool's size)
        for stale in [k for k in self.programs if k[0] != key[0]]:
            del self.programs[stale]
        self.programs[key] = _Program(tape, (*layer_inputs, *step_tensors), hidden, context, self.weights, head)
        self.recorded += 1
        while len(self.programs) > MAX_PROGRAMS or (
                len(self.programs) > 1 and sum(p.nbytes for p in self.programs.values()) > MAX_PROGRAM_BYTES):
            self.programs.popitem(last=False)
        return hidden.clone()

    def _record_head(self, hidden: torch.Tensor) -> tuple[tapes.Tape | None, torch.Tensor]:
        """The LM head over the recorded hidden rows, recorded as it runs: (its tape, or None where it does not
        record, and the step's logits). Unrecorded, later steps' logits are computed after them, as before."""
        tape = tapes.Tape()
        with tape.recording():
            logits = self.module.compute_logits(hidden)
        if tape.failure is None:
            return tape, logits
        if not self.head_refused:
            log.info("node %s: the LM head runs after the replayed layers (%s in it cannot be replayed)", self.node,
                     tape.failure)
        self.head_refused = True
        return None, logits
