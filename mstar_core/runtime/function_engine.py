"""The reference engine (kind `function`): runs a node's module as a plain callable.

For cheap glue nodes (CFG combination, token bookkeeping) and for tests of the runtime. The
module is either batch-aware (`forward_batch(list of input dicts) -> list of output dicts`) or
called once per invocation with the inputs as keyword arguments, returning a dict of outputs,
a tuple in output order, or a single value for a one-output node. Its contract
(`KeywordModule` or `BatchedModule`) is checked when the engine is built.
"""

from __future__ import annotations

from typing import Any, ClassVar

from mstar_core.runtime.contract import KeywordModule, check_keyword_module
from mstar_core.runtime.engine import Engine, Invocation, Result


class FunctionEngine(Engine):
    kind = "function"
    module_contract: ClassVar[type] = KeywordModule

    def __init__(self, node, module, context):
        super().__init__(node, module, context)
        check_keyword_module(module, node, self.kind)
        self._batch_fn = getattr(module, "forward_batch", None)
        self._queue: list[Invocation] = []

    def add(self, invocation: Invocation) -> None:
        self._queue.append(invocation)

    def has_work(self) -> bool:
        return bool(self._queue)

    def step(self) -> list[Result]:
        n = self.max_batch_size
        batch, self._queue = self._queue[:n], self._queue[n:]
        if self._batch_fn is not None:
            try:
                outs = self._batch_fn([inv.inputs for inv in batch])
                return [(inv, self._as_dict(out)) for inv, out in zip(batch, outs, strict=True)]
            except Exception:
                pass  # find the culprit: run one by one so one bad input fails only its request
        results: list[Result] = []
        for inv in batch:
            try:
                if self._batch_fn is not None:
                    out = self._batch_fn([inv.inputs])[0]
                else:
                    out = self.module(**inv.inputs)
                results.append((inv, self._as_dict(out)))
            except Exception as exc:
                results.append((inv, exc))
        return results

    def _as_dict(self, out: Any) -> dict[str, Any]:
        outputs = self.node.outputs
        if isinstance(out, dict):
            missing = [o for o in outputs if o not in out]
            if missing:
                raise KeyError(f"node '{self.node.name}' returned no {missing}")
            return out
        if len(outputs) == 1:
            return {outputs[0]: out}
        if isinstance(out, tuple) and len(out) == len(outputs):
            return dict(zip(outputs, out, strict=True))
        raise TypeError(f"node '{self.node.name}' must return a dict with keys {list(outputs)}")

    def release(self, request_id: str) -> None:
        self._queue = [inv for inv in self._queue if inv.request_id != request_id]

    def active_requests(self) -> set[str]:
        return {inv.request_id for inv in self._queue}
