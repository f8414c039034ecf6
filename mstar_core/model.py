"""What a model plugin provides: a `ModelSpec` that loads into a `LoadedModel`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from mstar_core.errors import ConfigError
from mstar_core.graph.graph import Graph
from mstar_core.sampling import SamplingDefaults, SamplingParams
from mstar_core.schema import UNSET, RequestSchema


@attrs.frozen
class LoadOptions:
    """How to load a model: a checkpoint (a directory, or a Hugging Face Hub id `ORG/NAME[@REVISION]` that the
    runtime resolves to a directory in the Hub cache before the model sees it), or a named preset built from seeded
    random weights."""

    checkpoint: str | None = None
    preset: str | None = None
    device: str = "cpu"
    dtype: str | None = None  # "float32", "bfloat16", ...; None = the model's default for the device
    #: the nodes whose weights this process needs (a worker's nodes); None = all. A model builds the
    #: modules of the other nodes on the meta device (shapes, no memory, nothing read).
    nodes: tuple[str, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    #: nodes only other processes host (what a serving process's placement sends to workers, known before the
    #: graph is): built on the meta device too, so a partly-local model is built once, with only its local weights
    remote: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    #: this process's rank group (`mstar_core.nn.parallel.TensorParallelGroup`) when its nodes are split across
    #: processes; a model loads only this rank's slices of the split nodes' weights. None: unsplit.
    tensor_parallel: Any = attrs.field(default=None, eq=False)
    #: checkpoints of a model's separately published parts (part name -> directory or Hub id, e.g. Orpheus's
    #: `snac` codec), over where the model looks by default; the model names its parts in `ModelSpec.parts`
    parts: Mapping[str, str] = attrs.field(factory=dict, converter=dict, eq=False)
    #: where a model's default sampling comes from: "auto" (the checkpoint's `generation_config.json`, as vLLM
    #: does), "none" (or vLLM's word for it, "vllm": `SamplingParams`' own defaults, greedy), or a directory
    #: holding a `generation_config.json`
    generation_config: str = "auto"

    def part(self, name: str) -> str | None:
        """The checkpoint given for part `name` (a local path once the runtime resolved it), or None."""
        return self.parts.get(name)

    def device_for(self, *nodes: str) -> str:
        """The device for a module that `nodes` use: `device` if this process hosts any of them, else meta."""
        if nodes and all(node in self.remote for node in nodes):
            return "meta"
        if self.nodes is None or any(node in self.nodes for node in nodes):
            return self.device
        return "meta"

    def preset_or_checkpoint(self, model: str, presets: Sequence[str], default: str = "tiny") -> str | None:
        """The preset to build (`preset`, or `default` when no checkpoint is given); None: load `checkpoint`.

        Both given, or a preset the model does not have, is a `ConfigError` naming the model and its presets.
        """
        if self.checkpoint and self.preset:
            raise ConfigError(f"{model}: pass a checkpoint or a preset, not both")
        if self.checkpoint:
            return None
        preset = self.preset or default
        if preset not in presets:
            raise ConfigError(f"{model}: unknown preset {preset!r}; known: {list(presets)}")
        return preset

    def torch_dtype(self, model: str, default: str | None = "float32") -> torch.dtype:
        """`dtype` (or `default`) as a torch floating dtype; a `ConfigError` naming the choices otherwise.

        `default` None: the device's usual one, bfloat16 on CUDA and float32 elsewhere.
        """
        name = self.dtype or default or ("bfloat16" if str(self.device).startswith("cuda") else "float32")
        if name not in WEIGHT_DTYPES:
            raise ConfigError(f"{model}: unknown dtype {name!r}; use one of {sorted(WEIGHT_DTYPES)}")
        return WEIGHT_DTYPES[name]


#: The weight dtypes a model can be loaded in (`LoadOptions.dtype`).
WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.define
class LoadedModel:
    """A model ready to serve: its validated graph plus what adapters need (tokenizer, config).

    `request_schema` declares the request's fields (`mstar_core.schema`): `prepare_inputs` checks
    a request against it first (unknown fields, types, bounds, defaults), then `prepare(inputs)`
    turns the checked fields into the env the first walk reads, raising `RequestError` with a
    message that says what to fix. `engine_settings` gives per-node defaults (e.g. KV pages) that
    placement files may override.
    """

    name: str
    graph: Graph
    random_weights: bool = False
    prepare: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    engine_settings: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    extras: dict[str, Any] = attrs.field(factory=dict)
    request_schema: RequestSchema | None = None
    #: the sampling its `prepare` gives fields a request leaves unset (its checkpoint's `generation_config.json`,
    #: or the model's own recommendation), reported by `GET /v1/models`; `prepare` applies them
    sampling_defaults: SamplingDefaults = attrs.field(factory=SamplingDefaults)

    def request_defaults(self) -> dict[str, Any]:
        """What each declared request field takes when a request leaves it unset: the schema's default, else for a
        sampling field the model's `sampling_defaults`, else `SamplingParams`' own (unset lists and seeds omitted)."""
        if self.request_schema is None:
            return dict(self.sampling_defaults.values)
        params = {f.name: f.default for f in attrs.fields(SamplingParams)}
        out: dict[str, Any] = {}
        for field in self.request_schema.fields:
            if field.default is not UNSET and field.default is not None:
                out[field.name] = field.default
            elif field.name in self.sampling_defaults.values:
                out[field.name] = self.sampling_defaults.values[field.name]
            elif field.name in params and params[field.name] not in (None, ()):
                out[field.name] = params[field.name]
        return out

    def prepare_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The env a request starts with: `inputs` checked against the schema, then through `prepare`."""
        if self.request_schema is not None:
            inputs = self.request_schema.validate(inputs)
        return dict(inputs) if self.prepare is None else self.prepare(inputs)

    @property
    def example(self) -> Mapping[str, Any] | None:
        """A request (JSON form) this model answers: the schema's example."""
        return None if self.request_schema is None else self.request_schema.example


@attrs.frozen
class ModelSpec:
    """A model family as a plugin registers it (`mstar_register_models`)."""

    name: str
    load: Callable[[LoadOptions], LoadedModel] = attrs.field(eq=False)
    presets: tuple[str, ...] = ("tiny",)
    description: str = ""
    #: A request's inputs in JSON form (what `POST /v1/walks/{name}` takes), shown by `mstar run --help`
    #: before any model loads; the loaded model's `request_schema.example` is usually the same dict.
    example: Mapping[str, Any] | None = attrs.field(default=None, eq=False)
    #: the separately published parts whose checkpoints a deploy file may name (`LoadOptions.parts`)
    parts: tuple[str, ...] = ()
