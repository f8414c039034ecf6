"""`StatelessEngine` (kind `stateless`): runs a node's module on batches of invocations, no state between calls."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from mstar_core.runtime.contract import KeywordModule, check_keyword_module
from mstar_core.runtime.engine import Engine, EngineContext, Invocation, Result
from mstar_stateless.batching import batch_key, call_single, pad_and_stack, split_outputs


class StatelessEngine(Engine):
    """Batches calls of one node across requests, as the module declares.

    A module with `forward_batch(list_of_input_dicts) -> list_of_output_dicts` batches itself.
    Otherwise tensor inputs of equal shape are stacked along a new leading dim (node option
    `pad_dim` pads that axis to the longest with `pad_value`, and outputs are trimmed back) and
    the outputs split along it. Calls with non-tensor inputs, or node option `batch: False`, run
    one by one. If a batched call raises, its calls are retried singly, so one bad input fails
    only its own request. The module's contract (`KeywordModule` or `BatchedModule`) is checked here,
    when the model loads.
    """

    kind = "stateless"
    module_contract = KeywordModule

    def __init__(self, node: Any, module: Any, context: EngineContext):
        super().__init__(node, module, context)
        check_keyword_module(module, node, self.kind)
        self.queue: deque[Invocation] = deque()
        self.device = torch.device(context.device)
        self.pad_dim = node.options.get("pad_dim")
        self.pad_value = float(node.options.get("pad_value", 0.0))
        self.batching = bool(node.options.get("batch", True))

    def add(self, invocation: Invocation) -> None:
        self.queue.append(invocation)

    def has_work(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[Result]:
        take = min(len(self.queue), self.max_batch_size)
        batch = [self.queue.popleft() for _ in range(take)]
        results: list[Result] = []
        with torch.inference_mode():
            for group in self._groups(batch):
                results.extend(self._run(group))
        return results

    def release(self, request_id: str) -> None:
        self.queue = deque(inv for inv in self.queue if inv.request_id != request_id)

    def active_requests(self) -> set[str]:
        return {inv.request_id for inv in self.queue}

    # -- internals --------------------------------------------------------------------------------

    def _inputs(self, inv: Invocation) -> dict[str, Any]:
        return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in inv.inputs.items()}

    def _groups(self, batch: list[Invocation]) -> list[list[Invocation]]:
        if hasattr(self.module, "forward_batch"):
            return [batch]
        if not self.batching:
            return [[inv] for inv in batch]
        groups: dict[Any, list[Invocation]] = {}
        singles: list[list[Invocation]] = []
        for inv in batch:
            key = batch_key(inv.inputs, self.pad_dim)
            if key is None:
                singles.append([inv])
            else:
                groups.setdefault(key, []).append(inv)
        return list(groups.values()) + singles

    def _run(self, group: list[Invocation]) -> list[Result]:
        try:
            outs = self._batched(group)
        except Exception as exc:
            if len(group) == 1:
                return [(group[0], exc)]
            return [r for inv in group for r in self._run([inv])]  # isolate the failing call
        return list(zip(group, outs, strict=True))

    def _batched(self, group: list[Invocation]) -> list[dict[str, Any]]:
        inputs = [self._inputs(inv) for inv in group]
        outputs = self.node.outputs
        if hasattr(self.module, "forward_batch"):
            outs = self.module.forward_batch(inputs)
            if len(outs) != len(group):
                raise ValueError(f"forward_batch returned {len(outs)} results for {len(group)} calls")
            return [dict(o) for o in outs]
        if len(group) == 1 and batch_key(group[0].inputs, self.pad_dim) is None:
            return [call_single(self.module, inputs[0], outputs)]
        stacked, lengths, padded_len = {}, None, None
        for name in inputs[0]:
            stacked[name], lens = pad_and_stack([i[name] for i in inputs], self.pad_dim, self.pad_value)
            if lens is not None and lengths is None:
                lengths, padded_len = lens, max(lens)
        result = self.module(**stacked)
        return split_outputs(result, outputs, len(group), lengths, self.pad_dim, padded_len)
