"""LoRA adapters served over loaded models: which names are adapters of which base model, as vLLM serves them.

A request names an adapter as its `model`; the runtime runs it on the base model with the env value `lora` set
to the adapter's name. The nodes that take adapters are those whose graph node declares the optional input
`lora` (a model opts in there; the `kvcache` engine's standard walks pass it on). Each such node's engine holds
the weights (`AdapterHost`: the `kvcache` engine, with `mstar_core.nn.lora` doing the arithmetic).
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

import attrs

from mstar_core.config.lora import LoraSettings
from mstar_core.errors import RequestError

#: The env name (and node input) carrying the adapter a request runs under
LORA_INPUT = "lora"


@runtime_checkable
class AdapterHost(Protocol):
    """An engine that holds LoRA adapters for its node (the `kvcache` engine)."""

    def enable_lora(self, max_loras: int, max_rank: int) -> None: ...

    def load_lora(self, name: str, path: str) -> None: ...

    def unload_lora(self, name: str) -> None: ...


@attrs.frozen
class ServedAdapter:
    """An adapter being served: its name, the base model it runs on, where it was read from, when."""

    name: str
    base: str
    path: str
    created: int = attrs.field(factory=lambda: int(time.time()))


class AdapterRegistry:
    """The adapters served, by name, and the models that take them (with their slot bounds)."""

    def __init__(self) -> None:
        self.adapters: dict[str, ServedAdapter] = {}
        self.enabled: dict[str, LoraSettings] = {}  # model -> its bounds (adapters loaded later not listed there)

    def resolve(self, model: str) -> tuple[str, str | None]:
        """`(base model, adapter name or None)` for a request's `model`."""
        served = self.adapters.get(model)
        return (model, None) if served is None else (served.base, served.name)

    def base_for_load(self, model: str | None) -> str:
        """The model a new adapter goes on: `model`, or the one model that takes adapters."""
        if model is not None:
            if model not in self.enabled:
                raise RequestError(f"model '{model}' does not serve LoRA adapters; models that do: "
                                   f"{sorted(self.enabled) or 'none'} (set max_loras in its deploy entry)",
                                   status=404 if not self.enabled else 400, param="model")
            return model
        if len(self.enabled) != 1:
            raise RequestError("name the base model ('model') the adapter is for; models that take adapters: "
                               f"{sorted(self.enabled) or 'none'}", status=400, param="model")
        return next(iter(self.enabled))
